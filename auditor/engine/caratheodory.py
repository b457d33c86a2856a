"""Carathéodory reduction: the same convex certificate on at most D rows.

A convex certificate for token k is a point of the simplex alpha with

    sum_i alpha_i (w_i, b_i, 1) = (sum_i alpha_i w_i, sum_i alpha_i b_i, 1),

a vector of R^D, D = d + 2 with a bias and d + 1 without. Carathéodory's
theorem says the same vector is a non-negative combination of at most D of
the (w_i, b_i, 1), and every quantity the certificate check reads (the
residual w_k - sum alpha_i w_i, the bias gap, the dual value of a bounded
domain) depends on alpha only through that vector. So the reduced weights
prove exactly what the dense ones proved, with at most D rows to name,
store and re-check.

The interior and Newton stages produce certificates on every row of the
head. Eliminating one row at a time from 30 000 would cost an SVD each, so
the reduction merges first (Maalouf, Jubran and Feldman, "Fast and accurate
least-mean-squares solvers", NeurIPS 2019): split the support into 2D
groups, replace each group by its weighted mean, reduce those 2D means to D
by the plain method, and keep only the groups whose means survived, with
their weights rescaled. Each round at least halves the support, and each
costs one pass over it plus one small null-space elimination.

The result is re-solved on its support and checked by certify.check_convex
like any other certificate; the engine keeps the dense one if it fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.linalg
import torch

from auditor.engine.head import EngineHead

_EPS = float(np.finfo(np.float64).eps)
_GATHER_ROWS = 2048  # rows gathered in float64 at a time when forming group means
_PANEL = 64  # null vectors corrected together by one triangular solve and one matrix product


def reduce_support(head: EngineHead, indices: np.ndarray, weights: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, Pool]:
    """Weights on at most D of ``indices`` (D = d + 1, or d + 2 with a bias) reproducing
    ``sum weights_i (w_i, b_i, 1)`` up to rounding: (indices, weights summing to 1, and the at most
    2D rows of the last merge round: a pool of rows around the point, for points near it)."""
    indices, alpha = _positive(indices, weights)
    dim = lifted_dimension(head)
    while indices.size > 2 * dim:
        merge = _Merge(head, indices, alpha)
        means, merge.means = [merge.means], None  # handed over: the elimination spends them
        indices, alpha = merge.keep(eliminate(means, merge.mass))
    if indices.size > dim:
        # the points handed over, column-major, and factored where they lie: the pool gathers them again when a
        # holder needs them (Pool.lifted), so that the elimination's arrays never sit beside a copy of them
        pool = Pool(indices, None)
        alpha = eliminate([lifted_points(head, indices, column_major=True)], alpha)
        survive = alpha > 0
        indices, alpha = indices[survive], alpha[survive]
    else:
        pool = Pool(indices, lifted_points(head, indices))
    return indices, alpha / alpha.sum(), pool


def lifted_dimension(head: EngineHead) -> int:
    """D: the dimension of the lifted rows (w_i, b_i, 1), d + 2 with a bias and d + 1 without."""
    return head.d + (2 if head.bias is not None else 1)


def _positive(indices: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows of positive weight, and their weights summing to 1."""
    keep = np.asarray(weights) > 0
    alpha = np.asarray(weights, dtype=np.float64)[keep]
    return np.asarray(indices)[keep], alpha / alpha.sum()


class _Merge:
    """One merge round: the support split into 2D interleaved groups (each mixes large and small weights,
    so no group mean sits far out), their masses and mean lifted points; ``keep`` rescales the weights by
    the masses an elimination left to each group."""

    def __init__(self, head: EngineHead, indices: np.ndarray, alpha: np.ndarray):
        groups = 2 * lifted_dimension(head)
        self.indices, self.alpha = indices, alpha
        self.label = np.argsort(np.argsort(-alpha, kind="stable"), kind="stable") % groups
        self.mass = np.bincount(self.label, weights=alpha, minlength=groups)
        self.means = _group_means(head, indices, alpha, self.label, groups)
        self.means /= self.mass[:, None]

    def keep(self, kept_mass: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        alpha = self.alpha * (kept_mass / self.mass)[self.label]
        survive = alpha > 0
        return self.indices[survive], alpha[survive] / alpha[survive].sum()


def spread_pool(head: EngineHead, seed: int = 0) -> Pool | None:
    """A pool of 3D rows drawn at random (a fixed seed) from the competitors: their hull holds a region
    around the centre of the head (by Wendel's theorem m points drawn symmetrically about a point in d
    dimensions miss it with the probability that m - 1 fair coins show fewer than d heads: about 1/2 at
    m = 2d, and below 10^-20 at m = 3d for d >= 300), so a certificate near the centre can use
    ``from_pool`` instead of a full reduction. A function of the head alone, so that a token's
    certificate does not depend on which other tokens are decided with it. None when there are too
    few rows."""
    dim = lifted_dimension(head)
    rows = torch.nonzero(head.competitor).flatten().cpu().numpy()
    if rows.size <= 3 * dim:
        return None
    chosen = np.sort(np.random.default_rng(seed).choice(rows, size=3 * dim, replace=False))
    return Pool(chosen, lifted_points(head, chosen))


def centre_pool(head: EngineHead, spread: Pool) -> tuple[Pool, np.ndarray] | None:
    """At most 2D rows around the centre of the head: those the uniform weights on the competitors pass
    through when moved onto ``spread`` and reduced (from_pool's merge round), and the at most D of them
    the reduced weights use (a basis for the centre: dual_simplex.Basis). Mean-initialised rows sit so
    near the centre that this smaller pool surrounds them too, and, like ``spread``, it depends on the
    head alone. None when the spread pool does not surround the centre. The spread pool's points are spent
    by the solve (its ``lifted`` gathers them again)."""
    rows = torch.nonzero(head.competitor).flatten().cpu().numpy()
    centre = head.centre.cpu().numpy()  # the uniform weights' combination, found with the head
    if head.bias is not None:
        centre = np.append(centre, float(head.bias[head.competitor].mean()))
    narrowed: list[Pool] = []
    found = from_pool(head, spread, -1, rows, np.full(rows.size, 1.0 / rows.size), narrowed=narrowed, total=centre,
                      spend=True)
    return (narrowed[0], found[0]) if found is not None and narrowed else None


@dataclass
class Pool:
    """At most 2D rows around a point that a full reduction passed through (its last merge round), and
    their lifted points (None once a holder has let them go: ``lifted`` gathers them again)."""

    indices: np.ndarray
    points: np.ndarray | None

    def lifted(self, head: EngineHead) -> np.ndarray:
        return self.points if self.points is not None else lifted_points(head, self.indices)


def from_pool(head: EngineHead, pool: Pool, k: int, indices: np.ndarray, weights: np.ndarray,
              heaviest: int = 8, narrowed: list[Pool] | None = None, total: np.ndarray | None = None,
              spend: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
    """Reduce token k's certificate, whose bulk lies near a pool of rows, without a full reduction.

    The certificate's ``heaviest`` rows keep their weights; the rest of its mass
    is moved onto the pool's rows as the maximum-entropy combination that
    reproduces the rest's point (all weights positive when that point is inside
    the pool's hull), and the union, at most 2D + ``heaviest`` rows, is reduced
    by one elimination. None when the pool does not surround the point. A pool of more than 2D rows
    takes one merge round first; its last round's at most 2D rows, a pool around this point, are
    appended to ``narrowed`` when given. ``total``, when the caller has it, is the certificate's point
    sum_i weights_i (w_i, b_i) (without the 1), which spares the pass over the head that finds the rest's.
    ``spend``: the pool's points are the solve's to spend (its holder lets them go after): no copy of them.
    """
    order = np.argsort(-weights, kind="stable")
    top, rest = order[:heaviest], order[heaviest:]
    mass = float(weights[rest].sum())
    if mass <= 0:
        return None
    if total is not None:  # the whole point less the heaviest rows' part
        target = (total - weights[top] @ lifted_points(head, indices[top])[:, :-1]) / mass
    else:
        dense = torch.zeros(head.n, dtype=torch.float64, device=head.device)
        dense[torch.as_tensor(indices[rest], device=head.device)] = torch.as_tensor(weights[rest],
                                                                                    device=head.device)
        target = head.combine(dense[None, :])[0].cpu().numpy() / mass  # one pass over the head, by blocks
        if head.bias is not None:
            target = np.append(target, float(dense @ head.bias) / mass)
    others = pool.indices != k  # the token may sit among the rows another token's certificate used
    # from theta = 0: no token depends on another; the selection is a copy, spent by the solve (as are the
    # pool's own points where the holder spends them)
    if spend and others.all():
        points, pool.points = pool.lifted(head), None
        spread = maximum_entropy_weights(points[:, :-1], target, overwrite=True)
        del points
    else:
        spread = maximum_entropy_weights(pool.lifted(head)[others, :-1], target, overwrite=True)
    if spread is None:
        return None
    union, position = np.unique(np.concatenate([indices[top], pool.indices[others]]), return_inverse=True)
    alpha = np.zeros(union.size)
    np.add.at(alpha, position, np.concatenate([weights[top], mass * spread]))
    if union.size > 2 * lifted_dimension(head):  # a large pool: one merge round first
        union, alpha, last = reduce_support(head, union, alpha)
        if narrowed is not None:
            narrowed[:] = [last]  # one pool kept: the newest
        return union, alpha
    alpha = eliminate(lifted_points(head, union), alpha)
    survive = alpha > 0
    return union[survive], alpha[survive] / alpha[survive].sum()


def maximum_entropy_weights(points: np.ndarray, target: np.ndarray, iterations: int = 60,
                            start: torch.Tensor | None = None, overwrite: bool = False,
                            prior: np.ndarray | None = None, chord: float = 0.25) -> np.ndarray | None:
    """Weights pi_i proportional to exp(theta . x_i), all positive, with sum pi_i x_i = target, by Newton's
    method on F(theta) = log sum exp(theta . (x_i - target)) from theta = 0 (see tilt.py, which does the
    same over a whole head). None when it does not converge: the target is not inside the hull.

    The Hessian (m D^2, the cost of a step) is formed again only when the previous step with an older one
    did not cut the gradient to ``chord`` times what it was (a quarter unless the caller says otherwise; a
    chord step is O(m D)); ``iterations`` bounds the Hessians, and four times as many steps are taken at most
    (_CHORD_STEPS more with a ``start``). A chord step that stalls where the gradient is at its own rounding
    (_ROUNDING_GRADIENT) ends the solve. The Hessian only picks the direction of a step: the line
    search and the gradient, which the weights must bring to 0, stay in float64. So it is first formed from
    float32 products (half the time), by blocks of rows, for at most _FLOAT32_HESSIANS Hessians; where that does not
    converge, or a step fails, Newton's method starts again from theta = 0 with float64 Hessians (float32
    directions can carry theta where the gradient stalls, on points nearly collinear in some coordinates,
    and a float32 Hessian of a singular one may be indefinite). The Hessian and
    its factors are torch's (on the CPU's audit threads: numpy's BLAS runs on one during an audit,
    auditor/_threads.py); the O(m D) steps are numpy's, whose small operations cost less than torch's.

    ``start``: a Cholesky factor of the Hessian at theta = 0 in the points' own units, shared by the targets
    that use one pool: the covariance of ``points`` under uniform weights (pool_start), or under the
    ``prior``'s (PoolCentre.factor). The Hessian at theta = 0 is that covariance divided by the square of the
    offsets' scale, whatever the target, so the first steps of a target near the pool's centre take it as
    chord steps (O(m D) each; the steps are scaled, the factor is not copied) and a fresh Hessian is formed
    only where they stall.

    ``overwrite``: ``points`` is the caller's to spend (a copy made for this call), and the offsets are formed
    in it: one m x D array fewer.

    ``prior``: the logarithms of positive weights on the points to start from, theta = 0 giving them instead of
    uniform ones (pi_i proportional to prior_i exp(theta . x_i)). Where the prior weights are themselves
    maximum-entropy weights of the points (the centre's, caratheodory.pool_centre), the family and the answer
    are the same and only the path changes: from the centre's weights, whose Hessian is its PoolCentre's factor
    (``start``), a target near the centre takes chord steps first. ``chord``: a fresh Hessian is formed
    where a step leaves the gradient above this fraction of the one before (a chord step costs about 1 / D of
    a Hessian, so a start close to the answer's Hessian keeps stepping with it)."""
    # one m x D array, scaled in place: fresh arrays cost page faults
    offsets = np.subtract(points, target, out=points if overwrite else None)
    scale = max(float(offsets.max()), -float(offsets.min())) or 1.0
    offsets /= scale
    # start's Hessian over scale^2: its steps are scale^2 times the unscaled factor's (no D x D copy of it)
    first = (start, scale * scale) if start is not None else None
    found = _entropy_newton(offsets, torch.float32, min(iterations, _FLOAT32_HESSIANS), first, prior, chord)
    return found if found is not None else _entropy_newton(offsets, torch.float64, iterations, first, prior, chord)


def _with_ridge(matrix: torch.Tensor) -> torch.Tensor:
    """``matrix`` (a D x D covariance, changed in place) plus a tiny ridge, 1e-14 of its trace, on its diagonal:
    rows of a normalised head span only a subspace. No D x D identity (a sixteenth of a float32 head of
    128256 x 4096)."""
    matrix.diagonal().add_(1e-14 * float(matrix.trace()))
    return matrix


_FLOAT32_HESSIANS = 8  # the float32 attempt's Hessians: a pool around the centre of a real head takes 3
_ROUNDING_GRADIENT = 1e-13  # a gradient this small (offsets scaled to at most 1) is at the rounding of its sum
_CHORD_STEPS = 150  # the steps a shared start adds (O(m D) each: at D = 4097 all of them cost a tenth of a Hessian)


def _hessian(offsets: np.ndarray, pi: np.ndarray, mean: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """sum_i pi_i (x_i - mean)(x_i - mean)^T (float64, D x D) from ``dtype`` products of blocks of _HESSIAN_ROWS
    offsets: no m x D copy in either precision."""
    hessian = torch.zeros(offsets.shape[1], offsets.shape[1], dtype=torch.float64)
    for s in range(0, offsets.shape[0], _HESSIAN_ROWS):
        block = torch.from_numpy(offsets[s:s + _HESSIAN_ROWS]) - torch.from_numpy(mean)
        block = block.mul_(torch.from_numpy(np.sqrt(pi[s:s + _HESSIAN_ROWS]))[:, None]).to(dtype)
        hessian.add_(block.T @ block)  # a float32 product widened as it is added
    return hessian


_HESSIAN_ROWS = 2048


def _entropy_newton(offsets: np.ndarray, dtype: torch.dtype, iterations: int,
                    start: tuple[torch.Tensor, float] | None = None, prior: np.ndarray | None = None,
                    chord: float = 0.25) -> np.ndarray | None:
    """maximum_entropy_weights' Newton's method from theta = 0, its Hessians formed in ``dtype`` (float32 or
    float64) products; ``start``, (a Cholesky factor L, s) with L L^T / s the Hessian at theta = 0, for the
    first (chord) steps; ``prior`` and ``chord`` as there."""
    narrow = dtype == torch.float32
    theta = np.zeros(offsets.shape[1])

    def weights(t):
        logits = offsets @ t
        if prior is not None:
            logits += prior
        top = logits.max()
        pi = np.exp(logits - top)
        total = pi.sum()
        return pi / total, top + np.log(total), abs(float(top))  # F's rounding: about its leading logit's

    pi, current, magnitude = weights(theta)
    factor, step_scale = start if start is not None else (None, 1.0)
    hessians, previous = 0, np.inf
    for _ in range(4 * iterations + (_CHORD_STEPS if start is not None else 0)):
        gradient = pi @ offsets
        size = float(np.abs(gradient).max())
        if size <= 1e-15:
            return pi
        if factor is None or size > previous * chord:  # a Newton step: a fresh Hessian
            if factor is not None and size <= _ROUNDING_GRADIENT:
                return pi  # a step stalled where the gradient is rounding: a Hessian would not move it
            if hessians == iterations:
                break
            # The old factor is let go before the new Hessian is formed, and the factor is written over the
            # Hessian (a tiny ridge first: rows of a normalised head span only a subspace): one D x D array
            # at a time, where the singular case's least squares forms the Hessian again.
            factor, step_scale = None, 1.0
            factor, info = cholesky_in_place(_with_ridge(_hessian(offsets, pi, gradient, dtype)))
            hessians += 1
            if info != 0:
                if narrow:  # the float32 rounding may leave a singular Hessian indefinite
                    return None
                factor = None
        previous = size
        step = (torch.cholesky_solve(torch.from_numpy(gradient)[:, None], factor)[:, 0].numpy() * step_scale
                if factor is not None else None)
        if (step is None or not np.all(np.isfinite(step))) and hessians == 0:  # the shared start failed:
            factor, previous = None, np.inf  # a fresh Hessian next
            continue
        if step is None or not np.all(np.isfinite(step)):  # singular: not positive definite, or NaN
            hessian = _with_ridge(_hessian(offsets, pi, gradient, dtype))
            step = np.linalg.lstsq(hessian.numpy(), gradient, rcond=None)[0]
            hessian = factor = None
        slope = float(gradient @ step)
        if not slope > 0:
            return None
        eta = 1.0
        while eta > 1e-8:
            trial_pi, trial, trial_magnitude = weights(theta - eta * step)
            if trial <= current - 1e-4 * eta * slope:
                break
            # near the solution F's decrease falls below its own rounding: there a full step that shrinks
            # the gradient is taken (the gradient is what the weights must bring to 0)
            if (eta == 1.0 and trial <= current + 8 * _EPS * (abs(current) + magnitude)
                    and np.abs(trial_pi @ offsets).max() < size):
                break
            eta *= 0.5
        else:
            return None
        theta = theta - eta * step
        pi, current, magnitude = trial_pi, trial, trial_magnitude
    return _converged(pi, offsets)


def shared_null_vectors(points: np.ndarray) -> np.ndarray | None:
    """_null_vectors of a pool's lifted points, for pool_certificate's tokens outside the pool (None for a pool
    of at most D rows, which needs none)."""
    return _null_vectors(points) if points.shape[0] > points.shape[1] else None


def pool_start(points: np.ndarray) -> torch.Tensor | None:
    """A Cholesky factor of the covariance of ``points`` (m x D, float64; uniform weights, a tiny ridge as the
    Hessians take): maximum_entropy_weights' ``start`` for the targets of one pool. None where it fails."""
    uniform = np.full(points.shape[0], 1.0 / points.shape[0])
    factor, info = cholesky_in_place(_with_ridge(_hessian(points, uniform, uniform @ points, torch.float64)))
    return factor if info == 0 else None


@dataclass
class PoolCentre:
    """The centre c of the head as a combination of a pool's rows: its maximum-entropy weights mu on them (all
    positive, sum mu_i x_i = c) and a Cholesky factor of H = sum_i mu_i (x_i - c)(x_i - c)^T, for
    linear_weights."""

    weights: np.ndarray  # m, the pool's rows in order
    point: np.ndarray  # c
    factor: torch.Tensor  # lower triangular, D - 1 square (the points without their last coordinate)


def pool_centre(points: np.ndarray, centre: np.ndarray) -> PoolCentre | None:
    """The PoolCentre of ``points`` (m x (D - 1): the pool's lifted points less their last coordinate) for the
    point ``centre``; None when the maximum-entropy solve or the factor fails (the centre is not inside
    the pool's hull). One solve and one m D^2 product for the pool, shared by every token near the centre."""
    weights = maximum_entropy_weights(points, centre)
    if weights is None or not np.all(weights > 0):  # (an underflowed weight: linear_weights and the prior need all)
        return None
    factor, info = cholesky_in_place(_with_ridge(_hessian(points, weights, np.asarray(centre, dtype=np.float64),
                                                            torch.float64)))
    return PoolCentre(weights, np.asarray(centre, dtype=np.float64), factor) if info == 0 else None


def linear_weights(points: np.ndarray, centre: PoolCentre, target: np.ndarray) -> np.ndarray | None:
    """Convex weights on a pool's rows (``points`` their lifted points, m x D) reproducing ``target`` (the
    lifted point less its last coordinate: w_k, and b_k with a bias), from the centre's in one linear solve:
    nu_i = mu_i (1 + theta . (x_i - c)) with H theta = target - c. They sum to 1 (the mu_i (x_i - c) sum to
    0) and sum nu_i x_i = c + H theta = target in exact arithmetic (and for H without its ridge): the
    first-order term of the maximum-entropy weights about the centre, with no Newton's method. Valid where
    every 1 + theta . (x_i - c) is positive, as for a point a short way from the centre in the metric of H
    (their mean square over mu is theta . H theta): rows mean-initialised and rounded to bfloat16 leave them
    at 0.35 or more. One refinement against the float64 residual; None where a weight is not positive
    (maximum_entropy_weights may still reach such a target). O(m D) and two triangular solves a target."""
    def step(offset: np.ndarray) -> np.ndarray:  # mu_i theta . (x_i - c), H theta = offset
        theta = torch.cholesky_solve(torch.from_numpy(offset)[:, None], centre.factor)[:, 0].numpy()
        return centre.weights * (points @ np.append(theta, 0.0) - float(centre.point @ theta))

    nu = centre.weights + step(np.subtract(target, centre.point))
    if not np.all(nu > 0):
        return None
    nu /= nu.sum()  # (its drift from 1 is rounding) before the refinement, which keeps the sum
    nu += step(np.subtract(target, nu @ points[:, :-1]))
    return nu if np.all(nu > 0) else None


def pool_certificate(head: EngineHead, pool: Pool, points: np.ndarray, k: int,
                     start: torch.Tensor | None = None, null: np.ndarray | None = None,
                     centre: PoolCentre | None = None) -> tuple[np.ndarray, np.ndarray] | None:
    """Weights on at most D of the pool's rows (``points`` their lifted points) reproducing token k's row: the
    maximum-entropy weights on the pool (all positive where the row lies inside the pool's hull) and one
    elimination. No dense certificate first: for a row near the pool's centre (a mean-initialised row rounded
    to bfloat16) this is the work of one elimination on 2D rows. None when the pool does not surround the row.
    ``null``: the null vectors of all of ``points`` (_null_vectors), for a token whose row is not in the pool.
    ``start``: pool_start's factor, the solve starting from uniform weights; or ``centre``: the solve starting
    from the centre's weights (less row k's, for a row of the pool) and factor, the factor kept while its
    chord steps cut the gradient by 30 % (a row near the centre, where the first-order weights of
    linear_weights turn negative, takes fewer Hessians than from uniform weights)."""
    others = pool.indices != k
    target = lifted_points(head, np.array([k]))[0, :-1]
    if centre is not None:
        spread = maximum_entropy_weights(points[others, :-1], target, start=centre.factor, overwrite=True,
                                         prior=np.log(centre.weights[others]), chord=_CENTRE_CHORD)
    else:
        spread = maximum_entropy_weights(points[others, :-1], target, start=start, overwrite=True)  # a copy, spent
    if spread is None:
        return None
    alpha = eliminate(points[others], spread, null if others.all() else None)
    survive = alpha > 0
    return pool.indices[others][survive], alpha[survive] / alpha[survive].sum()


_CENTRE_CHORD = 0.7  # pool_certificate from the centre's weights: a fresh Hessian once a chord step cuts the gradient by less than 30 %


def _converged(pi: np.ndarray, offsets: np.ndarray) -> np.ndarray | None:
    return pi if np.abs(pi @ offsets).max() <= 1e-12 else None


def lifted_points(head: EngineHead, indices: np.ndarray, column_major: bool = False) -> np.ndarray:
    """The rows as points (w_i, b_i, 1) of R^D, float64: one m x D array, filled a block of rows at a time (at
    D = 4097 a pool of 2D rows is an eighth of a float32 head of 128256 rows, and its copies count);
    ``column_major`` for points an elimination is handed to factor where they lie (_null_vectors)."""
    indices = np.asarray(indices, dtype=np.int64).reshape(-1)
    points = np.empty((indices.size, lifted_dimension(head)), order="F" if column_major else "C")
    for s in range(0, indices.size, _GATHER_ROWS):
        points[s:s + _GATHER_ROWS, :head.d] = head.rows(indices[s:s + _GATHER_ROWS])
    if head.bias is not None:
        points[:, head.d] = head.biases(indices)
    points[:, -1] = 1.0
    return points


def _group_means(head: EngineHead, indices: np.ndarray, alpha: np.ndarray, label: np.ndarray,
                 groups: int) -> np.ndarray:
    """sum_{i in group g} alpha_i (w_i, b_i, 1) for every group, gathering rows by blocks on the device: one
    column-major groups x D array (eliminate factors it where it lies: at D = 4097 a merge round's is a tenth of
    a head), the sums formed row-major (contiguous row additions) and copied in."""
    total = torch.zeros(groups, head.d, dtype=torch.float64, device=head.device)
    for s in range(0, indices.size, _GATHER_ROWS):
        rows = head.rows64(indices[s:s + _GATHER_ROWS])
        weights = torch.as_tensor(alpha[s:s + _GATHER_ROWS], device=head.device)
        total.index_add_(0, torch.as_tensor(label[s:s + _GATHER_ROWS], device=head.device), rows * weights[:, None])
    sums = np.empty((groups, lifted_dimension(head)), order="F")
    sums[:, :head.d] = total.cpu().numpy()
    del total
    if head.bias is not None:
        sums[:, head.d] = np.bincount(label, weights=alpha * head.biases(indices), minlength=groups)
    sums[:, -1] = np.bincount(label, weights=alpha, minlength=groups)
    return sums


def _null_vectors(points: np.ndarray | list[np.ndarray]) -> np.ndarray:
    """(m - D) x m: a basis of the u with u @ points = 0, for m x D points of rank D (see eliminate). The
    factorisation and the triangular solve run in torch (float64, on the CPU's audit threads). ``points`` handed
    over in a one-element list (a merge round's group means, column-major) are the call's: it takes them out,
    scales and factors them where they lie, and lets them go as soon as the factors are spent."""
    spent = isinstance(points, list)
    if spent:
        points = points.pop()
    m, dim = points.shape
    # m x D arrays are let go as soon as they are spent, and none is made twice: at D = 4097 each is a tenth of a
    # head. The scaled points column-major, factored where they lie.
    columns = points if spent and points.flags.f_contiguous else np.empty((m, dim), order="F")
    np.divide(points, np.maximum(np.maximum(points.max(axis=0), -points.min(axis=0)), np.finfo(np.float64).tiny),
              out=columns)
    del points
    factors, pivots, _ = lu_in_place(torch.from_numpy(columns))  # columns[permutation] = L U, L = [L1; L2] unit lower
    del columns
    permutation = np.arange(m)
    for i, p in enumerate(pivots.numpy() - 1):  # LAPACK's row swaps, in order
        permutation[i], permutation[p] = permutation[p], permutation[i]
    # L1^T is the strict upper triangle of factors[:dim]^T with a unit diagonal (U fills the rest, unread);
    # L2 = factors[dim:] whole. L1^-T L2^T by blocks, L1^T read where it lies (no D x D copy of it).
    top = factors[dim:].T.contiguous()
    _solve_by_blocks(factors[:dim].T, top, upper=True, unit=True)
    del factors
    # the null vectors of L^T are the columns of [-L1^-T L2^T; I]; coordinate j of w is that of point permutation[j]
    null = np.zeros((m - dim, m))
    null[:, permutation[:dim]] = top.neg_().T.numpy()
    null[np.arange(m - dim), permutation[dim:]] = 1.0
    return null


def cholesky_in_place(matrix: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The lower Cholesky factor of a symmetric row-major ``matrix`` written over it (at D = 4097 a D x D float64
    array is a fifteenth of a float32 head of 128256 rows): LAPACK factors the column-major view of its
    transpose, the same matrix, where it lies (torch's ``out=`` takes the input itself; a row-major ``out``
    would go through a column-major copy). Where this torch declines the aliasing, a new tensor. Returns
    (factor, info: 0 unless not positive definite)."""
    info = torch.empty((), dtype=torch.int32)
    columns = matrix.mT
    try:
        factor, info = torch.linalg.cholesky_ex(columns, out=(columns, info))
    except RuntimeError:
        factor, info = torch.linalg.cholesky_ex(matrix)
    return factor, int(info)


def lu_in_place(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """LAPACK's LU factors with partial pivoting of ``matrix`` written over it (a column-major one: no second
    copy; torch's ``out=`` takes the input itself), or, where this torch declines the aliasing, into a new
    tensor. Returns (factors, pivots counted from 1, info)."""
    pivots = torch.empty(min(matrix.shape), dtype=torch.int32)
    info = torch.empty((), dtype=torch.int32)
    try:
        factors, pivots, info = torch.linalg.lu_factor_ex(matrix, out=(matrix, pivots, info))
    except RuntimeError:
        factors, pivots, info = torch.linalg.lu_factor_ex(matrix)
    return factors, pivots, int(info)


def eliminate(points: np.ndarray | list[np.ndarray], alpha: np.ndarray, null: np.ndarray | None = None
              ) -> np.ndarray:
    """Carathéodory by null-space steps: non-negative weights on at most D of the m points with
    ``weights @ points == alpha @ points`` (up to rounding). ``points`` is m x D, ``alpha`` >= 0.

    Step j moves along null vector u_j until a weight reaches zero; every later null vector must
    first lose the coordinates already dropped (``null``: the null vectors of ``points`` when the caller
    shares them among the weights of one pool; they are read, not changed). Rather than updating all later vectors after each
    step (m r^2 work in rank-one updates), each vector is corrected when its turn comes: with V the
    vectors used so far and t their dropped coordinates, V[i][t_l] = 0 for i > l, so the correction
    x solves the lower-triangular system T x = u[t] with T[l, i] = V[i][t_l]. The corrections by the
    vectors of earlier panels are applied to a whole panel at once. ``points`` in a one-element list: the
    call's to spend (_null_vectors).
    """
    alpha = alpha + 0.0  # a copy, with any -0.0 made +0.0 (the ratio test below divides by the weights)
    m, dim = (points[0] if isinstance(points, list) else points).shape
    if m <= dim:
        return alpha
    # Null vectors from an LU factorisation with partial pivoting, points = L[order] U: sum_i u_i points_i
    # = 0 iff L^T w = 0 with u = w[order], and with L = [L1; L2] (|entries| <= 1) the vectors [-L1^-T L2^T e_j; e_j]
    # span those (a quarter of the work of a complete QR). Each coordinate is scaled first so that the
    # units of w, b and 1 do not matter.
    # The vectors used are kept for the later corrections: in the null vectors' own rows when they are this
    # call's (vector j is stored at row j or before, once its row has been read), else in an array of their own
    if null is None:
        null = _null_vectors(points)
        used = null
    else:
        used = np.zeros((null.shape[0], m))
    triangle = np.zeros((null.shape[0], null.shape[0]))
    dropped = np.zeros(null.shape[0], dtype=np.int64)  # the first j entries: the coordinates dropped so far
    j = 0
    reach = np.empty(m)
    for start in range(0, null.shape[0], _PANEL):
        # The corrections by every vector used before this panel, for the whole panel at once (BLAS-3).
        panel = null[start:start + _PANEL].copy()
        first = j
        if first:  # in torch: the audit's threads (numpy's BLAS has one)
            x = _lower_solve(triangle, first, panel[:, dropped[:first]].T)
            panel -= (x.T @ torch.from_numpy(used[:first])).numpy()
        for u in panel:
            if j > first:  # and by those used within this panel (LAPACK's solver called directly: a step is small)
                # as solve_triangular passes a C-ordered matrix: its transpose, transposed solve, same rounding
                x, _ = _triangular_solve(triangle[first:j, first:j].T, u[dropped[first:j]], trans=1, lower=0)
                u -= x @ used[first:j]
            u[dropped[:j]] = 0.0  # zero on the dropped coordinates: no dropped row comes back
            out = _first_to_reach_zero(alpha, u, reach)
            if out < 0:
                u = -u
                out = _first_to_reach_zero(alpha, u, reach)
                if out < 0:  # u is 0
                    continue
            alpha -= (alpha[out] / u[out]) * u  # one weight reaches zero; the combination does not move
            alpha[out] = np.inf  # dropped: held at +inf until the end (see _first_to_reach_zero), u is 0 there
            np.maximum(alpha, 0.0, out=alpha)  # rounding may leave -1e-17 where the ratios tied
            used[j] = u
            dropped[j] = out
            triangle[j, :j + 1] = used[:j + 1, out]
            j += 1
    alpha[dropped[:j]] = 0.0
    return alpha


def _lower_solve(triangle: np.ndarray, size: int, rhs: np.ndarray) -> torch.Tensor:
    """T^-1 rhs for the lower triangle T = triangle[:size, :size] (``rhs``: size x k)."""
    x = torch.from_numpy(np.ascontiguousarray(rhs))
    _solve_by_blocks(torch.from_numpy(triangle)[:size, :size], x, upper=False, unit=False)
    return x


def _solve_by_blocks(t: torch.Tensor, x: torch.Tensor, upper: bool, unit: bool) -> None:
    """x = T^-1 x in place, for a square triangular T whose rows are contiguous (a block of a larger matrix), by
    blocks of _PANEL rows: each block row of T is read where it lies (a product with a strided view), where a
    triangular solve would first copy the whole of T (at D = 4097, 134 MiB, once a panel of an elimination)."""
    size = t.shape[0]
    starts = range(0, size, _PANEL)
    for s in (reversed(starts) if upper else starts):
        e = min(s + _PANEL, size)
        if upper and e < size:
            x[s:e] -= t[s:e, e:] @ x[e:]
        elif not upper and s:
            x[s:e] -= t[s:e, :s] @ x[:s]
        x[s:e] = torch.linalg.solve_triangular(t[s:e, s:e], x[s:e], upper=upper, unitriangular=unit)


def _first_to_reach_zero(alpha: np.ndarray, u: np.ndarray, reach: np.ndarray) -> int:
    """argmin of alpha_i / u_i over u_i > 0 (alpha >= 0), the first weight that alpha - t u brings to zero as t
    grows; -1 when no u_i is positive. Found as argmax of u_i / alpha_i in one pass, with no mask: a weight at 0
    where u_i > 0 gives +inf, a step of 0, as it should (the largest such u_i is taken). An entry of u that is
    only rounding at a weight that is only rounding is no pivot. The caller holds its dropped coordinates at
    +inf (so u_i / alpha_i = 0 there); a 0 / 0 elsewhere (u_i = 0 where the weight is 0) gives NaN, no
    candidate. ``reach`` is scratch."""
    with np.errstate(divide="ignore", invalid="ignore"):
        np.divide(u, alpha, out=reach)
    out = int(np.argmax(reach))
    value = reach[out]
    if value != value:  # a 0 / 0: u_i = 0 at a weight at 0, no candidate
        reach[np.isnan(reach)] = 0.0
        out = int(np.argmax(reach))
        value = reach[out]
    if value == np.inf:  # weights at 0 with u_i > 0: a step of 0 whichever is dropped; the largest u_i is
        zero = np.flatnonzero(reach == np.inf)  # the pivot the later corrections divide by
        out = int(zero[np.argmax(u[zero])])
    if not value > 0:
        return -1
    if u[out] > _NEGLIGIBLE * np.abs(u).max() or alpha[out] > _NEGLIGIBLE:
        return out
    # u_i only rounding where the weight is only rounding too (0, or what a tie left): such entries are set to
    # 0 (their weights do not move) and the test is made again on the rest
    u[(np.abs(u) <= _NEGLIGIBLE * np.abs(u).max()) & (alpha <= _NEGLIGIBLE)] = 0.0
    return _first_to_reach_zero(alpha, u, reach)


# a null vector's entry this far below its largest is rounding where the weight is below it too (weights sum to 1)
_NEGLIGIBLE = 2.0**-30
_triangular_solve = scipy.linalg.lapack.dtrtrs  # what solve_triangular calls, without its checks' overhead


_BATCH = 8  # certificates whose elimination steps run as one batch of tensor operations, at most
_BATCH_BYTES = 1 << 27  # and within this memory, one certificate at least: about three float64 2D x D arrays
#                         a certificate (its points, its null vectors overwritten by their corrections, the
#                         D x D triangle of those), so that wide heads batch fewer
_BATCH_PANEL = 64  # the batched steps' panel: each step re-reads its panel's earlier vectors


def reduce_supports(head: EngineHead, certificates: list[tuple[np.ndarray, np.ndarray]]
                    ) -> list[tuple[np.ndarray, np.ndarray]]:
    """``reduce_support`` for many certificates at once: the eliminations of a merge round of up to _BATCH
    of them run as one batched elimination (_eliminate_batch), each step a few tensor operations on all of
    them together; so does the last elimination, on the at most 2D rows left of each."""
    dim = lifted_dimension(head)
    batch_size = max(1, min(_BATCH, _BATCH_BYTES // (3 * 8 * 2 * dim * dim)))
    states = [_positive(indices, weights) for indices, weights in certificates]
    while True:
        large = [j for j, (indices, _) in enumerate(states) if indices.size > 2 * dim]
        if not large:
            break
        for s in range(0, len(large), batch_size):
            batch = large[s:s + batch_size]
            merges = [_Merge(head, *states[j]) for j in batch]
            kept, failed = _eliminate_batch(torch.as_tensor(np.stack([m.means for m in merges]), device=head.device),
                                            torch.as_tensor(np.stack([m.mass for m in merges]), device=head.device))
            kept = kept.cpu().numpy()
            for row, (j, merge) in enumerate(zip(batch, merges)):
                states[j] = merge.keep(eliminate(merge.means, merge.mass) if failed[row] else kept[row])
    # The last elimination, on the rows themselves (at most 2D, a different number per certificate): each
    # certificate is padded to 2D rows with copies of its first row at weight 0 (any weight the steps move
    # onto them is the first row's).
    large = [j for j, (indices, _) in enumerate(states) if indices.size > dim]
    for s in range(0, len(large), batch_size):
        batch = large[s:s + batch_size]
        size = 2 * dim  # the same for every certificate, so that none depends on its batch
        points, weights = [], []
        for j in batch:
            indices, alpha = states[j]
            lifted = lifted_points(head, indices)
            pad = size - indices.size
            points.append(np.vstack([lifted, np.repeat(lifted[:1], pad, axis=0)]))
            weights.append(np.concatenate([alpha, np.zeros(pad)]))
        kept, failed = _eliminate_batch(torch.as_tensor(np.stack(points), device=head.device),
                                        torch.as_tensor(np.stack(weights), device=head.device))
        kept = kept.cpu().numpy()
        for row, j in enumerate(batch):
            indices, alpha = states[j]
            if failed[row]:
                alpha = eliminate(points[row][:indices.size], alpha)
            else:  # weight the steps moved onto the copies goes back to the row they copy
                alpha = kept[row][:indices.size].copy()
                alpha[0] += kept[row][indices.size:].sum()
            survive = alpha > 0
            states[j] = (indices[survive], alpha[survive])
    return [(indices, alpha / alpha.sum()) for indices, alpha in states]


def _eliminate_batch(points: torch.Tensor, alpha: torch.Tensor) -> tuple[torch.Tensor, np.ndarray]:
    """``eliminate`` for a batch: points B x m x D (m > D), weights B x m >= 0, on the device.

    The same steps as ``eliminate``, taken for every certificate of the batch together: null vectors
    from an LU factorisation of each, then m - D steps, each dropping one row per certificate, with the
    corrections by earlier panels applied by batched triangular solves and products. Returns the new
    weights and, per certificate, whether a step found no direction to move in (rounding); those are
    done again by ``eliminate``.
    """
    batch, m, dim = points.shape
    r = m - dim
    device = points.device
    # the null vectors one certificate at a time (an LU factorisation each: a fraction of the steps' cost)
    null = torch.as_tensor(np.stack([_null_vectors(p) for p in points.cpu().numpy()]), device=device)
    alpha = alpha.clone()
    triangle = torch.zeros(batch, r, r, dtype=points.dtype, device=device)
    dropped = torch.zeros(batch, r, dtype=torch.int64, device=device)
    alive = torch.ones(batch, m, dtype=torch.bool, device=device)
    failed = torch.zeros(batch, dtype=torch.bool, device=device)
    for start in range(0, r, _BATCH_PANEL):
        panel = null[:, start:start + _BATCH_PANEL].clone()
        if start:
            seen = dropped[:, :start]
            x = torch.linalg.solve_triangular(triangle[:, :start, :start],
                                              panel.gather(2, seen[:, None, :].expand(-1, panel.shape[1], -1)).mT,
                                              upper=False)
            panel -= x.mT @ null[:, :start]
        for i in range(panel.shape[1]):
            j = start + i
            u = panel[:, i]
            if i:
                x = torch.linalg.solve_triangular(triangle[:, start:j, start:j], u.gather(1, dropped[:, start:j])[..., None],
                                                  upper=False)
                u = u - (x.mT @ null[:, start:j])[:, 0]
            u = u.masked_fill(~alive, 0.0)
            u = torch.where((u.amax(dim=1) <= 0)[:, None], -u, u)
            # as in eliminate: an entry of u far below its largest, where the weight is only rounding, is no pivot
            rounding = (alpha <= _NEGLIGIBLE) & (u <= _NEGLIGIBLE * u.abs().amax(dim=1, keepdim=True))
            positive = alive & (u > 0) & ~rounding
            ratios = torch.where(positive, alpha / torch.where(positive, u, torch.ones_like(u)), torch.inf)
            step, out = ratios.min(dim=1)
            stuck = ~torch.isfinite(step)
            failed |= stuck
            step = torch.where(stuck, torch.zeros_like(step), step)
            alpha = (alpha - step[:, None] * u).clamp_(min=0.0)  # rounding may leave -1e-17 where ratios tied
            alpha.scatter_(1, out[:, None], 0.0)
            alive.scatter_(1, out[:, None], False)
            null[:, j] = u  # its null vector is spent: the corrected one takes its place
            dropped[:, j] = out
            triangle[:, j, :j + 1] = null[:, :j + 1].gather(2, out[:, None, None].expand(-1, j + 1, 1))[..., 0]
    return alpha, failed.cpu().numpy()
