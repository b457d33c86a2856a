"""Probability ceilings: the largest softmax probability a token can reach in a bounded domain.

For token k, p_k(z) = 1 / (1 + exp(F_k(z))) with

    F_k(z) = log sum_{i != k} exp(l_i(z) - l_k(z)),

a log-sum-exp of affine functions a_i.z + c_i (a_i = w_i - w_k, c_i = b_i - b_k):
convex. So max_{z in D} p_k = 1 / (1 + exp(min_D F_k)). Both bounds are widened
by the rounding bound of the computed numbers.

- Lower bound: p_k at any point z of D, computed over every row.
- Upper bound: log-sum-exp is the maximum over the simplex of pi.x + H(pi)
  (H the entropy), so for ANY probability vector pi over a rival set S,
  min_D F_k >= min_D F_k^S >= pi.c + H(pi) - s_D(-sum_i pi_i a_i), s_D the support
  function (F_k^S sums over S only and is <= F_k pointwise). With pi the softmax at
  a point this is the Frank-Wolfe gap bound F(z) - g.z - s_D(-g).

The stages, cheapest first:

1. Screen: one pass over the vocabulary at each token's start point pushed to the
   domain's boundary. A token whose lower bound is already >= 1 - gap is done
   (the upper bound 1 closes it); on real heads that is most of them.
2. Constraint generation for the rest, batched: solve min_D F_k^S over the
   top rivals S at the current point with spectral projected gradient on the
   small problem (for a ball, in the span of the a_i, an orthonormal basis of
   at most |S| coordinates), take the subset dual bound as the upper bound,
   evaluate F_k over every row at the subset's best point for the lower bound,
   add the rivals that lead there, repeat.
3. The few still open: spectral projected gradient over all rows, then an
   interior-point solve (cvxpy, Clarabel) whose point is evaluated the same way.

Copies of row k count as rivals (each adds exp(0) = 1): a token tied with
m - 1 others never passes 1/m.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from auditor.domain import Ball, Box, Domain
from auditor.engine.head import robust_row_norms
from auditor.engine.rounding import gamma, safe_norm

_BLOCK_BUDGET = 1 << 25  # float64 entries per token x vocabulary block
_LOCAL_BUDGET = 1 << 24  # float64 entries of the gathered rival rows (tokens x rivals x d) per chunk
_ROUNDS = 8  # constraint-generation rounds before the full-vocabulary fallback
_LOCAL_ITERATIONS = 400  # spectral projected gradient steps per round, on the small problem
_INSIDE = 1 - 1e-12  # ball points a hair inside, so rounding cannot carry them out


@dataclass
class Ceilings:
    lower: np.ndarray  # p_k at the best point found (a probability the token does reach)
    upper: np.ndarray  # a bound no point of the domain exceeds
    point: np.ndarray  # B x d: the points attaining ``lower``


def _project(domain: Domain, z: torch.Tensor) -> torch.Tensor:
    if isinstance(domain, Ball):  # onto a sphere a hair inside, so rounding cannot carry the point out
        norm = torch.linalg.vector_norm(z, dim=1, keepdim=True)
        return z * torch.clamp(_INSIDE * domain.radius / torch.clamp(norm, min=1e-300), max=1.0)
    return z.clamp(-domain.radius, domain.radius)


def _to_boundary(domain: Domain, z: torch.Tensor) -> torch.Tensor:
    """The point of the boundary in z's direction (a ball) or in z's orthant (a box): where l_k grows most."""
    if isinstance(domain, Ball):
        norm = safe_norm(z, dim=1)[:, None]
        return torch.where(norm > 0, z * (_INSIDE * domain.radius / torch.where(norm > 0, norm, 1.0)), z)
    return domain.radius * torch.sign(z)


def _support(domain: Domain, v: torch.Tensor) -> torch.Tensor:
    if isinstance(domain, Ball):
        return domain.radius * torch.linalg.vector_norm(v, dim=1)
    return domain.radius * v.abs().sum(dim=1)


def _probability(value: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(-value)


def probability_ceilings(weight: torch.Tensor, bias: torch.Tensor | None, ids: np.ndarray, domain: Domain,
                         start: torch.Tensor, gap: float = 1e-4, iterations: int = 2000, progress=None,
                         row_error: float = 0.0, bias_error: float = 0.0, rivals: int = 256) -> Ceilings:
    """Bound max_{z in D} softmax_k(W z + b) for tokens ``ids`` to within ``gap``, starting from points ``start``.

    Returns Ceilings: ``lower`` (reached at ``point``, a point of D) and ``upper``
    (no point of D exceeds it); ``upper - lower > gap`` only where every stage
    failed to close a token. ``start`` gives each token's starting direction: it is
    pushed to the domain's boundary, and also tried as given. ``row_error`` /
    ``bias_error`` bound how far the rows and biases may be from exact ones (the
    norm domain's reduced head); they widen the bounds like rounding does.
    ``rivals`` is the size of the first rival set of constraint generation, and
    ``iterations`` bounds the full-vocabulary fallback. Raises ValueError for an
    unbounded domain.
    """
    if not isinstance(domain, (Ball, Box)):
        raise ValueError("probability ceilings need a bounded domain")
    count, d = len(ids), weight.shape[1]
    if weight.shape[0] == 1:  # no rival: the only token has probability 1 everywhere
        return Ceilings(np.ones(count), np.ones(count), _project(domain, start).cpu().numpy())
    scale = _Scale(weight, bias, domain, row_error, bias_error)
    k_all = torch.as_tensor(ids, device=weight.device)
    lower = torch.zeros(count, dtype=torch.float64, device=weight.device)
    upper = torch.ones(count, dtype=torch.float64, device=weight.device)
    point = torch.zeros((count, d), dtype=torch.float64, device=weight.device)
    m = max(1, min(rivals, weight.shape[0] - 1))
    leaders = torch.zeros((count, m), dtype=torch.int64, device=weight.device)

    # 1. screen: every token at its start pushed to the boundary, and as given
    batch = max(1, min(1024, _BLOCK_BUDGET // weight.shape[0]))
    for s in range(0, count, batch):
        part = slice(s, min(s + batch, count))
        k = k_all[part]
        for z in (_to_boundary(domain, start[part].to(torch.float64)), _project(domain, start[part].to(torch.float64))):
            lo, logits = _evaluate(weight, bias, k, z, scale)
            better = lo > lower[part]
            lower[part] = torch.where(better, lo, lower[part])
            point[part] = torch.where(better[:, None], z, point[part])
            leaders[part] = torch.where(better[:, None], logits.topk(m, dim=1).indices, leaders[part])
            del logits
        if progress is not None:
            progress.update(int((upper[part] - lower[part] <= gap).sum()))

    # 2. constraint generation for the tokens the screen left open
    open_ = torch.nonzero(upper - lower > gap).flatten()
    chunk = max(1, min(256, _LOCAL_BUDGET // (d * m * 2), _BLOCK_BUDGET // weight.shape[0]))
    for s in range(0, len(open_), chunk):
        j = open_[s:s + chunk]
        lo, up, z = _generate_constraints(weight, bias, k_all[j], point[j], leaders[j], domain, gap, scale)
        better = lo > lower[j]
        lower[j] = torch.where(better, lo, lower[j])
        point[j] = torch.where(better[:, None], z, point[j])
        upper[j] = torch.minimum(upper[j], up)
        if progress is not None:
            progress.update(int((upper[j] - lower[j] <= gap).sum()))

    # 3. the few left: first-order steps over every row, then an interior-point solve
    lower, upper, point = lower.cpu().numpy(), upper.cpu().numpy(), point.cpu().numpy()
    wide = np.nonzero(upper - lower > gap)[0]
    for s in range(0, len(wide), batch):
        part = wide[s:s + batch]
        k = torch.as_tensor(ids[part], device=weight.device)
        z0 = torch.as_tensor(point[part], device=weight.device)
        lo, up, z = _solve_batch(weight, bias, k, z0, domain, gap, iterations, scale)
        _keep(lower, upper, point, part, lo, up, z)
    for j in np.nonzero(upper - lower > gap)[0][:_EXACT_LIMIT].tolist():
        z = _cvxpy_point(weight, bias, int(ids[j]), domain)
        if z is not None:
            k = torch.as_tensor(ids[j:j + 1], device=weight.device)
            lo, up, zz = _solve_batch(weight, bias, k, _project(domain, z[None, :]), domain, gap, 50, scale)
            _keep(lower, upper, point, np.array([j]), lo, up, zz)
    if progress is not None:
        progress.update(len(wide))
    return Ceilings(lower, upper, point)


def _keep(lower, upper, point, part, lo, up, z):
    """Merge new bounds into the running ones: the higher lower bound (with its point), the lower upper bound."""
    better = lo > lower[part]
    lower[part] = np.where(better, lo, lower[part])
    point[part] = np.where(better[:, None], z, point[part])
    upper[part] = np.minimum(upper[part], up)


_EXACT_LIMIT = 64


class _Scale:
    """Rounding bounds of computed F_k values and subset dual bounds.

    Every logit is within f (||w_i|| ||z|| + |b_i|) of exact, f = 2 gamma_{d+4};
    the reduced head's own error adds row_error ||z|| + bias_error per logit;
    log-sum-exp is 1-Lipschitz in the largest logit error, and its own sum of n
    terms adds a relative gamma_{n+4}.
    """

    def __init__(self, weight, bias, domain, row_error, bias_error):
        n, d = weight.shape
        self.factor = 2.0 * gamma(d + 4)
        self.sum_factor = gamma(n + 4)
        self.norms = robust_row_norms(weight)  # an underflowed norm would shrink the bound
        self.max_norm = float(self.norms.max())
        self.max_bias = float(bias.abs().max()) if bias is not None else 0.0
        self.row_error = row_error
        self.bias_error = bias_error
        self.d = d
        # the largest ||z|| in D, and the factor from ||v||_2 to s_D(v)
        self.reach = domain.radius if isinstance(domain, Ball) else domain.radius * d ** 0.5

    def error(self, k: torch.Tensor, z: torch.Tensor, value: torch.Tensor | None = None) -> torch.Tensor:
        """How far a computed F_k(z) may be from the exact value for the exact head."""
        size = safe_norm(z, dim=1)
        spread = (self.norms[k] + self.max_norm) * size + 2 * self.max_bias
        total = self.factor * spread + 2 * (self.row_error * size + self.bias_error) + 1e-14
        if value is not None:
            total = total + self.sum_factor * (2 + value.abs())
        return total

    def dual_error(self, k: torch.Tensor, rivals: int, entropy: torch.Tensor) -> torch.Tensor:
        """How far a computed subset dual bound may be from the exact one for the exact head.

        pi.c (rivals terms), H(pi) and the rounded normalisation of pi each err by a
        relative gamma_{rivals+4} of their size; g = sum pi_i w_i - w_k by
        gamma_{rivals+d+4} (||w_k|| + max ||w_i||) in norm, which s_D scales by at most
        the reach (sqrt(d) r for a box). Doubled, as the bound's own arithmetic rounds too.
        """
        f = 2.0 * gamma(rivals + self.d + 8)
        own = f * (2 * self.max_bias + entropy.abs() + 2 + self.reach * (self.norms[k] + self.max_norm))
        return own + 2 * (self.row_error * self.reach + self.bias_error) + 1e-14


def _evaluate(weight, bias, k: torch.Tensor, z: torch.Tensor, scale: _Scale):
    """The lower bound p_k(z) for a batch of tokens, and the rival logits l_i(z) - l_k(z) (-inf at k)."""
    rows = torch.arange(len(k), device=z.device)
    logits = z @ weight.T
    if bias is not None:
        logits += bias[None, :]
    logits -= logits[rows, k].clone()[:, None]
    logits[rows, k] = -torch.inf
    value = torch.logsumexp(logits, dim=1)
    return _probability(value + scale.error(k, z, value)), logits


def _subset_dual(weight, bias, k, rivals, pi, domain, scale: _Scale) -> torch.Tensor:
    """The upper bound on p_k from any weights pi over the rival rows ``rivals`` (B x m), rounding included."""
    pi = pi / pi.sum(dim=1, keepdim=True)
    gradient = torch.bmm(pi[:, None, :], weight[rivals]).squeeze(1) - weight[k]
    level = (pi * (bias[rivals] - bias[k][:, None])).sum(dim=1) if bias is not None else 0.0
    entropy = -torch.special.xlogy(pi, pi).sum(dim=1)
    dual = level + entropy - _support(domain, -gradient)
    dual = dual - scale.dual_error(k, rivals.shape[1], entropy) - 1e-12 * (1 + dual.abs())
    return torch.clamp(_probability(dual), max=1.0)


def _generate_constraints(weight, bias, k, z, rivals, domain, gap, scale: _Scale):
    """Stage 2 for a chunk of tokens: returns (lower, upper, point), tensors."""
    lower = torch.zeros(len(k), dtype=torch.float64, device=weight.device)
    upper = torch.ones_like(lower)
    point = z.clone()
    todo = torch.arange(len(k), device=weight.device)  # positions in the chunk still open
    add = rivals.shape[1]
    n = weight.shape[0]
    for _ in range(_ROUNDS):
        problem = _LocalProblem(weight, bias, k[todo], rivals, domain)
        u, dual_u = _local_spg(problem, problem.coordinates(point[todo]), domain, gap)
        zz = _project(domain, problem.point(u))
        lo, logits = _evaluate(weight, bias, k[todo], zz, scale)
        up = _subset_dual(weight, bias, k[todo], rivals, problem.weights(dual_u), domain, scale)
        better = lo > lower[todo]
        lower[todo] = torch.where(better, lo, lower[todo])
        point[todo] = torch.where(better[:, None], zz, point[todo])
        upper[todo] = torch.minimum(upper[todo], up)
        still = upper[todo] - lower[todo] > gap
        if not bool(still.any()) or rivals.shape[1] >= n - 1:
            break
        # the rivals that lead at the new point and are not yet in the set
        logits = logits[still]
        logits.scatter_(1, rivals[still], -torch.inf)
        fresh = logits.topk(min(add, n - 1 - rivals.shape[1]), dim=1).indices
        rivals = torch.cat([rivals[still], fresh], dim=1)
        todo = todo[still]
        del logits
    return lower, upper, point


class _LocalProblem:
    """min_D log sum_{i in S} exp(a_i.z + c_i) for a batch of tokens, in few coordinates.

    For a ball the minimiser lies in the span of the a_i (or the optimality
    condition g = -lambda z could not hold), so z = Q x with Q an orthonormal
    basis of that span and ||z|| = ||x||: |S| coordinates instead of d. For a box
    the coordinates are z itself. Only the solver works here; every bound is
    computed again in the original coordinates.
    """

    def __init__(self, weight, bias, k, rivals, domain):
        gathered = weight[rivals] - weight[k][:, None, :]  # B x m x d: the a_i
        self.offset = bias[rivals] - bias[k][:, None] if bias is not None else \
            torch.zeros(rivals.shape, dtype=weight.dtype, device=weight.device)
        if isinstance(domain, Ball):
            self.basis, r = torch.linalg.qr(gathered.transpose(1, 2))  # a_i = basis @ r[:, i]
            self.matrix = r.transpose(1, 2)  # B x m x p
        else:
            self.basis, self.matrix = None, gathered

    def coordinates(self, z):
        return z if self.basis is None else torch.bmm(z[:, None, :], self.basis).squeeze(1)

    def point(self, x):
        return x if self.basis is None else torch.bmm(self.basis, x[:, :, None]).squeeze(2)

    def logits(self, x):
        return torch.bmm(self.matrix, x[:, :, None]).squeeze(2) + self.offset

    def weights(self, x):
        return torch.softmax(self.logits(x), dim=1)

    def objective(self, x):
        logits = self.logits(x)
        pi = torch.softmax(logits, dim=1)
        return torch.logsumexp(logits, dim=1), torch.bmm(pi[:, None, :], self.matrix).squeeze(1)


def _local_spg(problem: _LocalProblem, x, domain, gap):
    """Spectral projected gradient on the small problems until their own bounds are within gap / 4.

    Returns the best point and the point whose Frank-Wolfe bound is best, in the
    problem's coordinates (the bounds are recomputed rigorously elsewhere).
    """
    x = _project(domain, x)
    value, gradient = problem.objective(x)
    best_value, best_x = value.clone(), x.clone()
    best_dual = value - (gradient * x).sum(dim=1) - _support(domain, -gradient)
    dual_x = x.clone()
    peak = float(torch.linalg.vector_norm(problem.matrix, dim=2).max())
    step = torch.full_like(value, 1.0 / max(peak, 1e-150) ** 2)
    recent = value[:, None].repeat(1, _MEMORY)
    for _ in range(_LOCAL_ITERATIONS):
        active = _probability(best_dual) - _probability(best_value) > gap / 4
        if not bool(active.any()):
            break
        xi = _project(domain, x - step[:, None] * gradient)
        vi, gi = problem.objective(xi)
        accept = vi <= recent.max(dim=1).values - 1e-4 * (step * (gradient * (x - xi)).sum(dim=1)).abs()
        accept &= torch.isfinite(vi) & active
        dx, dg = xi - x, gi - gradient
        curvature = (dx * dg).sum(dim=1)
        bb = (dx * dx).sum(dim=1) / torch.clamp(curvature, min=1e-300)
        spectral = torch.where((curvature > 0) & torch.isfinite(bb), bb, step * 4)
        step = torch.where(accept, spectral, torch.where(active, step * 0.25, step))
        x = torch.where(accept[:, None], xi, x)
        gradient = torch.where(accept[:, None], gi, gradient)
        recent = torch.where(accept[:, None], torch.cat([recent[:, 1:], vi[:, None]], dim=1), recent)
        better = (vi < best_value) & active
        best_value = torch.where(better, vi, best_value)
        best_x = torch.where(better[:, None], xi, best_x)
        di = vi - (gi * xi).sum(dim=1) - _support(domain, -gi)
        raised = (di > best_dual) & torch.isfinite(di) & active
        best_dual = torch.where(raised, di, best_dual)
        dual_x = torch.where(raised[:, None], xi, dual_x)
    return best_x, dual_x


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
