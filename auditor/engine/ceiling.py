"""Probability ceilings: the largest softmax probability a token can reach in a bounded domain.

For token k, p_k(z) = 1 / (1 + exp(F_k(z))) with

    F_k(z) = log sum_{i != k} exp(l_i(z) - l_k(z)),

a log-sum-exp of affine functions: convex. So max_{z in D} p_k = 1 / (1 + exp(min_D F_k)),
a convex problem. Every point z of D gives a lower bound p_k(z). Convexity
gives an upper bound at every point too: F_k(z') >= F_k(z) + g.(z' - z) with
g = grad F_k(z), so min_D F_k >= F_k(z) - g.z - s_D(-g), s_D the support
function (the Frank-Wolfe gap). The solver is projected gradient descent with
Barzilai-Borwein steps, batched over tokens; a token stops when the two bounds
are within the requested gap in probability. Copies of row k count as rivals
(each adds exp(0) = 1): a token tied with m - 1 others never passes 1/m.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from auditor.domain import Ball, Box, Domain

_BLOCK_BUDGET = 1 << 25  # float64 entries per token x vocabulary block
_PAD = 1e-9  # added to every upper bound: far beyond the float64 rounding of a log-sum-exp


@dataclass
class Ceilings:
    lower: np.ndarray  # p_k at the best point found (a probability the token does reach)
    upper: np.ndarray  # a bound no point of the domain exceeds
    point: np.ndarray  # B x d: the points attaining ``lower``


def _project(domain: Domain, z: torch.Tensor) -> torch.Tensor:
    if isinstance(domain, Ball):
        norm = torch.linalg.vector_norm(z, dim=1, keepdim=True)
        return z * torch.clamp(domain.radius / torch.clamp(norm, min=1e-300), max=1.0)
    return z.clamp(-domain.radius, domain.radius)


def _support(domain: Domain, v: torch.Tensor) -> torch.Tensor:
    if isinstance(domain, Ball):
        return domain.radius * torch.linalg.vector_norm(v, dim=1)
    return domain.radius * v.abs().sum(dim=1)


def _objective(weight: torch.Tensor, bias: torch.Tensor | None, k: torch.Tensor, z: torch.Tensor):
    """F_k(z) and its gradient for a batch of tokens."""
    rows = torch.arange(len(k), device=z.device)
    logits = z @ weight.T
    if bias is not None:
        logits += bias[None, :]
    own = logits[rows, k].clone()
    logits -= own[:, None]
    logits[rows, k] = -torch.inf
    value = torch.logsumexp(logits, dim=1)
    weights = torch.softmax(logits, dim=1)  # pi_i over the rivals
    gradient = weights @ weight - weight[k]
    return value, gradient


def _probability(value: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(-value)


def probability_ceilings(weight: torch.Tensor, bias: torch.Tensor | None, ids: np.ndarray, domain: Domain,
                         start: torch.Tensor, gap: float = 1e-4, iterations: int = 500, progress=None) -> Ceilings:
    """Bound max_{z in D} softmax_k(W z + b) for tokens ``ids`` to within ``gap``, starting from points ``start``."""
    if not isinstance(domain, (Ball, Box)):
        raise ValueError("probability ceilings need a bounded domain")
    count = len(ids)
    lower = np.zeros(count)
    upper = np.ones(count)
    point = np.zeros((count, weight.shape[1]))
    batch = max(1, min(512, _BLOCK_BUDGET // max(weight.shape[0], 1)))
    for s in range(0, count, batch):
        part = slice(s, min(s + batch, count))
        lo, up, z = _solve_batch(weight, bias, torch.as_tensor(ids[part], device=weight.device),
                                 _project(domain, start[part]), domain, gap, iterations)
        lower[part], upper[part], point[part] = lo, up, z
        if progress is not None:
            progress.update(part.stop - part.start)
    return Ceilings(lower, upper, point)


def _solve_batch(weight, bias, k, z, domain, gap, iterations):
    value, gradient = _objective(weight, bias, k, z)
    best_value, best_z = value.clone(), z.clone()
    dual = value - (gradient * z).sum(dim=1) - _support(domain, -gradient)  # min_D F >= dual
    best_dual = dual.clone()
    step = torch.full_like(value, 1.0 / max(float(torch.linalg.vector_norm(weight, dim=1).max()) ** 2, 1e-300))
    active = _probability(best_dual) + _PAD - _probability(best_value) > gap
    for _ in range(iterations):
        if not bool(active.any()):
            break
        idx = torch.nonzero(active).flatten()
        zi = _project(domain, z[idx] - step[idx, None] * gradient[idx])
        vi, gi = _objective(weight, bias, k[idx], zi)
        # Barzilai-Borwein: the secant step length, kept positive and finite
        dz, dg = zi - z[idx], gi - gradient[idx]
        curvature = (dz * dg).sum(dim=1)
        bb = (dz * dz).sum(dim=1) / torch.clamp(curvature, min=1e-300)
        step[idx] = torch.where((curvature > 0) & torch.isfinite(bb), bb, step[idx] * 2)
        # a step that made things worse is retried shorter from the best point
        worse = vi > best_value[idx] + 1e-12 * best_value[idx].abs()
        step[idx[worse]] = step[idx[worse]] * 0.25
        z[idx], gradient[idx] = zi, gi
        better = vi < best_value[idx]
        best_value[idx[better]] = vi[better]
        best_z[idx[better]] = zi[better]
        di = vi - (gi * zi).sum(dim=1) - _support(domain, -gi)
        best_dual[idx] = torch.maximum(best_dual[idx], di)
        z[idx[worse]] = best_z[idx[worse]]
        if bool(worse.any()):
            _, gradient[idx[worse]] = _objective(weight, bias, k[idx[worse]], best_z[idx[worse]])
        active = _probability(best_dual) + _PAD - _probability(best_value) > gap
    lower = _probability(best_value)
    upper = torch.clamp(_probability(best_dual) + _PAD, max=1.0)
    return lower.cpu().numpy(), upper.cpu().numpy(), best_z.cpu().numpy()
