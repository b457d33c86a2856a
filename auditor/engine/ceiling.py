"""Probability ceilings: the largest softmax probability a token can reach in a bounded domain.

For token k, p_k(z) = 1 / (1 + exp(F_k(z))) with

    F_k(z) = log sum_{i != k} exp(l_i(z) - l_k(z)),

a log-sum-exp of affine functions: convex. So max_{z in D} p_k = 1 / (1 + exp(min_D F_k)),
a convex problem. Every point z of D gives a lower bound p_k(z). Convexity
gives an upper bound at every point too: F_k(z') >= F_k(z) + g.(z' - z) with
g = grad F_k(z), so min_D F_k >= F_k(z) - g.z - s_D(-g), s_D the support
function (the Frank-Wolfe gap). Both are widened by the rounding bounds of the
computed value and gradient.

The softmax over the rivals is dense on real heads (on the normalised MiniLM head
every one of the 30,524 rivals is within 20 of the leading logit at the best
point), so every evaluation costs two products with the whole head and n
exponentials per token. The search therefore runs in a fast steering precision
(bfloat16 products where the hardware has them, float32 otherwise; nothing it
computes is trusted), and each token's best steering point is then evaluated
once in float64, which gives both certified bounds; a token whose lower bound is
already within the gap of 1 needs no gradient. Spectral projected gradient
(Barzilai-Borwein steps with a non-monotone acceptance test), batched over
tokens, drives both the steering and, in float64, the tokens whose certified
bounds are still further apart than the gap; the few still open after that get
an interior-point solve (cvxpy, Clarabel) whose point is evaluated the same way.
Copies of row k count as rivals (each adds exp(0) = 1): a token tied with m - 1
others never passes 1/m.
"""

from __future__ import annotations

import math
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


class _Buffers:
    """Scratch tensors reused from one evaluation to the next: a fresh B x n tensor each time costs
    as much in page faults as an elementwise pass over it."""

    def __init__(self):
        self.held: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, int], dtype: torch.dtype, device) -> torch.Tensor:
        size = shape[0] * shape[1]
        held = self.held.get(name)
        if held is None or held.dtype != dtype or held.device != torch.device(device) or held.numel() < size:
            held = self.held[name] = torch.empty(size, dtype=dtype, device=device)
        return held[:size].view(shape)


def _evaluate(weight: torch.Tensor, bias: torch.Tensor | None, k: torch.Tensor, z: torch.Tensor,
              gradient=True, buffers: _Buffers | None = None):
    """F_k(z) and its gradient for a batch of tokens: products in ``weight``'s precision, the rest in z's.

    ``gradient`` is True (for every row) or a function of the values giving a boolean mask of
    the rows that need it; rows left out get NaN. One pass of exponentials over the
    logits, in place."""
    buffers = buffers or _Buffers()
    rows = torch.arange(len(k), device=z.device)
    shape = (len(k), weight.shape[0])
    logits = buffers.get("logits", shape, z.dtype, z.device)
    if weight.dtype == z.dtype:
        torch.matmul(z, weight.T, out=logits)
    else:
        products = buffers.get("products", shape, weight.dtype, z.device)
        torch.matmul(z.to(weight.dtype), weight.T, out=products)
        logits.copy_(products)
    if bias is not None:
        logits += bias[None, :]
    own = logits[rows, k].clone()
    logits[rows, k] = -torch.inf
    top = logits.max(dim=1).values
    terms = logits.sub_(top[:, None]).exp_()  # exp(l_i - max): each in (0, 1], the largest 1
    total = terms.sum(dim=1)
    value = torch.log(total) + (top - own)
    if gradient is True:
        need, chosen = rows, terms
    else:
        need = torch.nonzero(gradient(value)).flatten()
        chosen = terms[need]
    g = torch.full_like(z, torch.nan)
    if len(need):
        if chosen.dtype != weight.dtype:
            narrow = buffers.get("products", tuple(chosen.shape), weight.dtype, z.device)
            chosen = narrow.copy_(chosen)
        mix = (chosen @ weight).to(z.dtype) / total[need, None]
        g[need] = mix - weight[k[need]].to(z.dtype)
    return value, g


def _probability(value: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(-value)


_SIGMOID_ROUNDING = 8 * 2.0**-53  # the sigmoid's own relative error, allowed for generously


def _probability_below(value: torch.Tensor) -> torch.Tensor:
    """A probability at most 1 / (1 + exp(value)): near 1 the value's slack is below one unit of p. NaN gives 0."""
    p = torch.sigmoid(-value) * (1 - _SIGMOID_ROUNDING)
    return torch.where(torch.isnan(p), torch.zeros_like(p), p)


def _probability_above(value: torch.Tensor) -> torch.Tensor:
    """A probability at least 1 / (1 + exp(value)), at most 1 (NaN stays NaN: no bound)."""
    return torch.clamp(torch.sigmoid(-value) * (1 + _SIGMOID_ROUNDING), max=1.0)


def steering_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 where matrix products in it are fast (CUDA with bfloat16, CPUs with AVX512-BF16 or AMX),
    else float32: the search's own precision, whose answers are all evaluated again in float64."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "cpu":
        probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
        try:
            if any(probe is not None and probe() for probe in probes):
                return torch.bfloat16
        except RuntimeError:
            pass
    return torch.float32


def probability_ceilings(weight: torch.Tensor, bias: torch.Tensor | None, ids: np.ndarray, domain: Domain,
                         start: torch.Tensor, gap: float = 1e-4, iterations: int = 2000, progress=None,
                         row_error: float = 0.0, bias_error: float = 0.0,
                         steering: torch.dtype | None = None) -> Ceilings:
    """Bound max_{z in D} softmax_k(W z + b) for tokens ``ids`` to within ``gap``, starting from points ``start``.

    ``row_error`` / ``bias_error`` bound how far the rows and biases may be from
    exact ones (the norm domain's reduced head); they widen the bounds like rounding does.
    ``steering``: the search's precision (default: ``steering_dtype`` of the device).
    """
    if not isinstance(domain, (Ball, Box)):
        raise ValueError("probability ceilings need a bounded domain")
    count = len(ids)
    if weight.shape[0] == 1:  # no rival: the only token has probability 1 everywhere
        return Ceilings(np.ones(count), np.ones(count), _project(domain, start.to(torch.float64)).cpu().numpy())
    weight = weight.to(torch.float64)
    bias = bias.to(torch.float64) if bias is not None else None
    lower = np.zeros(count)
    upper = np.ones(count)
    point = np.zeros((count, weight.shape[1]))
    batch = max(1, min(512, _BLOCK_BUDGET // max(weight.shape[0], 1)))
    scale = _Scale(weight, bias, row_error, bias_error, domain)
    fast = _Steering(weight, bias, steering or steering_dtype(weight.device))
    exact = _Buffers()  # the float64 evaluations' scratch
    for s in range(0, count, batch):
        part = slice(s, min(s + batch, count))
        k = torch.as_tensor(ids[part], device=weight.device)
        z = _project(domain, start[part].to(torch.float64))
        z = _spg(fast.evaluate, k, z.to(fast.compute), domain, gap * _STEERING_GAP, _STEERING_ITERATIONS,
                 scale.max_norm)[2]
        lower[part], upper[part], point[part] = _certify(weight, bias, k, _project(domain, z.to(torch.float64)),
                                                         domain, gap, scale, exact)
        if progress is not None:
            progress.update(part.stop - part.start)
    # where the steering's point is not close enough: on in float64 from it, in full batches
    left = np.nonzero(upper - lower > gap)[0]
    for s in range(0, left.size, batch):
        part = left[s:s + batch]
        k = torch.as_tensor(ids[part], device=weight.device)
        z = torch.as_tensor(point[part], device=weight.device)
        lo, up, zz = _solve_batch(weight, bias, k, z, domain, gap, iterations, scale, exact)
        better = lo > lower[part]
        lower[part] = np.maximum(lo, lower[part])
        upper[part] = np.minimum(up, upper[part])
        point[part[better]] = zz[better]
    wide = np.nonzero(upper - lower > gap)[0][:_EXACT_LIMIT]
    for j in wide.tolist():  # the few that first-order steps leave open: an interior-point solve
        z = _cvxpy_point(weight, bias, int(ids[j]), domain)
        if z is not None:
            k = torch.as_tensor(ids[j:j + 1], device=weight.device)
            lo, up, zz = _solve_batch(weight, bias, k, _project(domain, z[None, :]), domain, gap, 50, scale)
            if lo[0] > lower[j]:  # the point stays with the bound reached at it
                lower[j], point[j] = lo[0], zz[0]
            upper[j] = min(up[0], upper[j])
    return Ceilings(lower, upper, point)


_EXACT_LIMIT = 64
_STEERING_ITERATIONS = 12
_STEERING_GAP = 0.5  # of the gap: the steering's estimates are not certified, so it aims closer


class _Steering:
    """The head in the steering precision; values and bounds without any rounding allowance."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        self.weight = weight.to(dtype)
        self.compute = torch.float32 if dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float64
        self.bias = bias.to(self.compute) if bias is not None else None
        self.buffers = _Buffers()

    def evaluate(self, k, z):
        return _evaluate(self.weight, self.bias, k, z, buffers=self.buffers)


class _Scale:
    """Rounding bounds of a computed F_k(z) and of its gradient, in float64.

    Every logit is within f (||w_i|| ||z|| + |b_i|) of exact (plus the rows' and biases'
    own error when they are derived); the sum of n exponentials, its logarithm and the
    products with the softmax weights add relative errors of about n units of roundoff."""

    def __init__(self, weight, bias, row_error, bias_error, domain):
        n, d = weight.shape
        self.factor = 2.0 * gamma(d + 4)
        self.norms = robust_row_norms(weight)  # an underflowed norm would shrink the bound
        self.max_norm = float(self.norms.max())
        self.max_bias = float(bias.abs().max()) if bias is not None else 0.0
        self.row_error = row_error
        self.bias_error = bias_error
        self.summation = gamma(n + 8)  # exponentials (a few units each), their sum and its logarithm
        self.reach = domain.reach(d)

    def logit_error(self, k: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """A bound on |computed l_i - l_k - exact l_i - l_k| for every i."""
        size = safe_norm(z, dim=1)
        spread = (self.norms[k] + self.max_norm) * size + 2 * self.max_bias
        return self.factor * spread + 2 * (self.row_error * size + self.bias_error) + 1e-300

    def value_error(self, k: torch.Tensor, z: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return self.logit_error(k, z) + self.summation * (1 + value.abs())

    def gradient_error(self, k: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """A bound on ||computed gradient - exact gradient||: the softmax weights are within a factor
        exp(2 e) of exact for logits within e, and each w_i - w_k within 2 row_error."""
        shift = torch.expm1(2 * self.logit_error(k, z))
        return (shift + self.summation) * 2 * self.max_norm + 2 * self.row_error


def _certified_bounds(scale: _Scale, domain, k, z, value, gradient, dual_value):
    """p_k at z, rounded down, and the upper bound from the linearisation at the point
    where ``dual_value`` = F - g.z - s_D(-g) was computed (``z``, ``value``, ``gradient`` there)."""
    lower = _probability_below(value + scale.value_error(k, z, value))
    size = safe_norm(z, dim=1)
    # F(z') >= F(z) + g.(z' - z) - ||g - g~|| ||z' - z||, ||z' - z|| <= reach + ||z||; the products
    # g~.z and s_D(-g~) are float64 sums of d terms
    products = gamma(gradient.shape[1] + 2) * safe_norm(gradient, dim=1) * (size + scale.reach * math.sqrt(gradient.shape[1]))
    slack = scale.value_error(k, z, value) + scale.gradient_error(k, z) * (scale.reach + size) + products
    return lower, _probability_above(dual_value - slack)


def _dual(domain, value, gradient, z):
    return value - (gradient * z).sum(dim=1) - _support(domain, -gradient)


def _certify(weight, bias, k, z, domain, gap, scale: _Scale, buffers: _Buffers | None = None):
    """One float64 evaluation at z: the certified bounds, with the gradient only where the lower
    bound is not already within ``gap`` of 1."""
    value, gradient = _evaluate(weight, bias, k, z, buffers=buffers,
                                gradient=lambda v: _probability_below(v + scale.value_error(k, z, v)) < 1 - gap)
    lower, upper = _certified_bounds(scale, domain, k, z, value, gradient, _dual(domain, value, gradient, z))
    upper = torch.where(torch.isnan(upper), torch.ones_like(upper), upper)  # no gradient: 1 is within the gap
    return lower.cpu().numpy(), upper.cpu().numpy(), z.cpu().numpy()


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


def _solve_batch(weight, bias, k, z, domain, gap, iterations, scale: _Scale, buffers: _Buffers | None = None):
    """Float64 spectral projected gradient with certified bounds at every point it evaluates."""
    lower, upper, best_z = _spg(lambda kk, zz: _evaluate(weight, bias, kk, zz, buffers=buffers), k, z, domain, gap, iterations,
                                scale.max_norm, scale)
    return lower.cpu().numpy(), upper.cpu().numpy(), best_z.cpu().numpy()


def _spg(evaluate, k, z, domain, gap, iterations, max_norm, scale: _Scale | None = None):
    """Spectral projected gradient (Barzilai-Borwein steps, non-monotone acceptance) on F_k, batched.

    Returns the best lower and upper bounds on max p_k seen and the point of the lower one:
    certified ones with ``scale``, the steering's plain estimates without it."""
    value, gradient = evaluate(k, z)

    def bounds_at(kk, vv, gg, zz):
        dual = _dual(domain, vv, gg, zz)
        if scale is None:
            return _probability(vv), torch.clamp(_probability(dual), max=1.0)
        return _certified_bounds(scale, domain, kk, zz, vv, gg, dual)

    best_lower, best_upper = bounds_at(k, value, gradient, z)
    best_upper = torch.where(torch.isfinite(best_upper), best_upper, torch.ones_like(best_upper))
    best_z = z.clone()
    step = torch.full_like(value, 1.0 / max(max_norm, 1e-150) ** 2)
    recent = value[:, None].repeat(1, _MEMORY)  # the last values, for the non-monotone test
    for _ in range(iterations):
        active = best_upper - best_lower > gap
        if not bool(active.any()):
            break
        idx = torch.nonzero(active).flatten()
        zi = _project(domain, z[idx] - step[idx, None] * gradient[idx])
        vi, gi = evaluate(k[idx], zi)
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
        li, ui = bounds_at(k[idx], vi, gi, zi)
        better = li > best_lower[idx]
        best_lower[idx[better]] = li[better]
        best_z[idx[better]] = zi[better]
        best_upper[idx] = torch.minimum(best_upper[idx], torch.where(torch.isfinite(ui), ui, best_upper[idx]))
    return best_lower, best_upper, best_z


_MEMORY = 10
