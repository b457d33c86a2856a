"""Probability ceilings: the largest softmax probability a token can reach in a bounded domain.

For token k, p_k(z) = 1 / (1 + exp(F_k(z))) with

    F_k(z) = log sum_{i != k} exp(l_i(z) - l_k(z)),

a log-sum-exp of affine functions: convex. So max_{z in D} p_k = 1 / (1 + exp(min_D F_k)),
a convex problem. Every point z of D gives a lower bound p_k(z). Convexity
gives an upper bound at every point too: F_k(z') >= F_k(z) + g.(z' - z) with
g = grad F_k(z), so min_D F_k >= F_k(z) - g.z - s_D(-g), s_D the support
function (the Frank-Wolfe gap). Both are widened by the rounding bound of the
computed logits. The solver is spectral projected gradient (Barzilai-Borwein
steps with a non-monotone acceptance test), batched over tokens; a token stops
when the two bounds are within the requested gap in probability, and the few
still open after the iteration budget get an interior-point solve (cvxpy,
Clarabel) whose point is evaluated the same way. Copies of row k count as rivals
(each adds exp(0) = 1): a token tied with m - 1 others never passes 1/m.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from auditor.domain import Ball, Box, Domain
from auditor.engine.head import robust_row_norms
from auditor.engine.rounding import gamma, safe_norm

_BLOCK_BUDGET = 1 << 25  # float64 entries per token x vocabulary block


@dataclass
class Ceilings:
    lower: np.ndarray  # p_k at the best point found (a probability the token does reach)
    upper: np.ndarray  # a bound no point of the domain exceeds
    point: np.ndarray  # B x d: the points attaining ``lower``


def _project(domain: Domain, z: torch.Tensor) -> torch.Tensor:
    if isinstance(domain, Ball):  # onto a sphere a hair inside, so rounding cannot carry the point out
        norm = torch.linalg.vector_norm(z, dim=1, keepdim=True)
        return z * torch.clamp((1 - 1e-12) * domain.radius / torch.clamp(norm, min=1e-300), max=1.0)
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
                         start: torch.Tensor, gap: float = 1e-4, iterations: int = 2000, progress=None,
                         row_error: float = 0.0, bias_error: float = 0.0) -> Ceilings:
    """Bound max_{z in D} softmax_k(W z + b) for tokens ``ids`` to within ``gap``, starting from points ``start``.

    ``row_error`` / ``bias_error`` bound how far the rows and biases may be from
    exact ones (the norm domain's reduced head); they widen the bounds like rounding does.
    """
    if not isinstance(domain, (Ball, Box)):
        raise ValueError("probability ceilings need a bounded domain")
    count = len(ids)
    if weight.shape[0] == 1:  # no rival: the only token has probability 1 everywhere
        return Ceilings(np.ones(count), np.ones(count), _project(domain, start).cpu().numpy())
    lower = np.zeros(count)
    upper = np.ones(count)
    point = np.zeros((count, weight.shape[1]))
    batch = max(1, min(512, _BLOCK_BUDGET // max(weight.shape[0], 1)))
    scale = _Scale(weight, bias, row_error, bias_error)
    for s in range(0, count, batch):
        part = slice(s, min(s + batch, count))
        k = torch.as_tensor(ids[part], device=weight.device)
        lo, up, z = _solve_batch(weight, bias, k, _project(domain, start[part]), domain, gap, iterations, scale)
        lower[part], upper[part], point[part] = lo, up, z
        if progress is not None:
            progress.update(part.stop - part.start)
    wide = np.nonzero(upper - lower > gap)[0][:_EXACT_LIMIT]
    for j in wide.tolist():  # the few that first-order steps leave open: an interior-point solve
        z = _cvxpy_point(weight, bias, int(ids[j]), domain)
        if z is not None:
            k = torch.as_tensor(ids[j:j + 1], device=weight.device)
            lo, up, zz = _solve_batch(weight, bias, k, _project(domain, z[None, :]), domain, gap, 50, scale)
            if up[0] - lo[0] < upper[j] - lower[j]:
                lower[j], upper[j], point[j] = max(lo[0], lower[j]), min(up[0], upper[j]), zz[0]
    return Ceilings(lower, upper, point)


_EXACT_LIMIT = 64


class _Scale:
    """Rounding bound of a computed F_k(z): every logit is within f (||w_i|| ||z|| + |b_i|) of exact."""

    def __init__(self, weight, bias, row_error, bias_error):
        d = weight.shape[1]
        self.factor = 2.0 * gamma(d + 4)
        self.norms = robust_row_norms(weight)  # an underflowed norm would shrink the bound
        self.max_norm = float(self.norms.max())
        self.max_bias = float(bias.abs().max()) if bias is not None else 0.0
        self.row_error = row_error
        self.bias_error = bias_error

    def error(self, k: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        size = safe_norm(z, dim=1)
        spread = (self.norms[k] + self.max_norm) * size + 2 * self.max_bias
        return self.factor * spread + 2 * (self.row_error * size + self.bias_error) + 1e-14


def _cvxpy_point(weight, bias, k: int, domain) -> torch.Tensor | None:
    import cvxpy as cp

    W = weight.cpu().numpy()
    b = bias.cpu().numpy() if bias is not None else np.zeros(W.shape[0])
    rivals = np.arange(W.shape[0]) != k
    z = cp.Variable(W.shape[1])
    limit = cp.norm(z, 2) <= domain.radius if isinstance(domain, Ball) else cp.abs(z) <= domain.radius
    problem = cp.Problem(cp.Minimize(cp.log_sum_exp((W[rivals] - W[k]) @ z + (b[rivals] - b[k]))), [limit])
    try:
        problem.solve(solver=cp.CLARABEL)
    except (cp.error.SolverError, ValueError, ArithmeticError):
        return None
    if z.value is None:
        return None
    return torch.as_tensor(np.asarray(z.value, dtype=np.float64), device=weight.device)


def _solve_batch(weight, bias, k, z, domain, gap, iterations, scale: _Scale):
    """Spectral projected gradient (Barzilai-Borwein steps, non-monotone acceptance) on F_k, batched."""
    value, gradient = _objective(weight, bias, k, z)
    best_value, best_z = value.clone(), z.clone()
    best_dual = value - (gradient * z).sum(dim=1) - _support(domain, -gradient)  # min_D F >= this
    step = torch.full_like(value, 1.0 / max(scale.max_norm, 1e-150) ** 2)
    recent = value[:, None].repeat(1, _MEMORY)  # the last values, for the non-monotone test

    def bounds():
        lower = _probability(best_value + scale.error(k, best_z))
        upper = _probability(best_dual - 2 * scale.error(k, best_z) - 1e-12 * (1 + best_dual.abs()))
        return lower, torch.clamp(upper, max=1.0)

    for _ in range(iterations):
        lower, upper = bounds()
        active = upper - lower > gap
        if not bool(active.any()):
            break
        idx = torch.nonzero(active).flatten()
        zi = _project(domain, z[idx] - step[idx, None] * gradient[idx])
        vi, gi = _objective(weight, bias, k[idx], zi)
        accept = vi <= recent[idx].max(dim=1).values - 1e-4 * (step[idx] * (gradient[idx] * (z[idx] - zi)).sum(dim=1)).abs()
        accept &= torch.isfinite(vi)
        dz, dg = zi - z[idx], gi - gradient[idx]
        curvature = (dz * dg).sum(dim=1)
        bb = (dz * dz).sum(dim=1) / torch.clamp(curvature, min=1e-300)
        spectral = torch.where((curvature > 0) & torch.isfinite(bb), bb, step[idx] * 4)
        step[idx] = torch.where(accept, spectral, step[idx] * 0.25)  # refused: the same point, a shorter step
        moved = idx[accept]
        z[moved], gradient[moved] = zi[accept], gi[accept]
        recent[moved] = torch.cat([recent[moved, 1:], vi[accept, None]], dim=1)
        better = vi < best_value[idx]
        best_value[idx[better]] = vi[better]
        best_z[idx[better]] = zi[better]
        di = vi - (gi * zi).sum(dim=1) - _support(domain, -gi)
        best_dual[idx] = torch.maximum(best_dual[idx], torch.where(torch.isfinite(di), di, best_dual[idx]))
    lower, upper = bounds()
    return lower.cpu().numpy(), upper.cpu().numpy(), best_z.cpu().numpy()


_MEMORY = 10
