"""Pools of rows around a point, and certificates on them: a few rows instead of a reduction over the head.

A certificate near the centre of a head (mean-initialised rows) can move most of its mass onto a pool
of at most 3D rows whose hull surrounds that point, as the maximum-entropy combination that reproduces
it (weights all positive, found by Newton's method on F(theta) = log sum exp(theta . (x_i - target))),
and then needs one elimination (elimination.py) instead of a full reduction (caratheodory.py). A row a
short way from the centre takes a pool drawn around it (tilted_pools), and a dense certificate a pool drawn
from its own weights (weighted_pool), in the same way. The pools depend on the head alone (and a token's
pools on its own id and row), so a token's certificate never depends on the tokens decided with it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from auditor.engine.arithmetic.head import EngineHead
from auditor.engine.arithmetic.rounding import ieee_float32_products
from auditor.engine.exact.caratheodory import (
    Pool,
    lifted_dimension,
    lifted_points,
    reduce_support,
)
from auditor.engine.exact.elimination import (
    cholesky_in_place,
    eliminate_on,
    eliminate_where,
    null_vectors,
)

_EPS = float(np.finfo(np.float64).eps)


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


DRAWN_POOL = 3  # times D: the rows of a pool drawn around a point or from a certificate (Wendel's bound, as for spread_pool)
_TILTED_ROWS = 2  # times the pool: the rows a head needs for pools to be drawn from it
_POOL_BYTES = 1 << 27  # a drawn pool's float64 points and the solve's copy of them, at most (D <= 1672);
#                       bench/families.py --pool-bytes sets it
POOL_HESSIANS = 12  # a pool's float64 Hessians at most (after at most 8 float32 ones): what a pool whose hull misses
#                    the point costs, in m D^2 products, before the stage after it takes over


def drawn_pools_fit(head: EngineHead) -> bool:
    """Whether pools of 3D rows can be drawn around a point: the head has at least twice as many other rows, and
    two float64 3D x D arrays (the points and the solve's offsets) fit in _POOL_BYTES. On wider heads a pool's
    solve (3 D^3 a Hessian) costs more than it saves (bench/families.py's base member at 32768 x 2048: 102 s with
    pools, 91 s without; at 32768 x 1024, 21 s with them, 28 s without) and its arrays take 0.2 GB, a fifth of a
    Llama-3 head at that width on top of the audit's peak; there the tokens take Newton's solves over the head
    and the full reductions."""
    dim = lifted_dimension(head)
    return (head.n_competitors - 1 >= _TILTED_ROWS * DRAWN_POOL * dim
            and 2 * 8 * DRAWN_POOL * dim * dim <= _POOL_BYTES)


def tilted_pools(head: EngineHead, ids: np.ndarray, points: torch.Tensor | None = None,
                 lean: tuple[torch.Tensor, torch.Tensor] | None = None) -> list[np.ndarray | None]:
    """Per token, 3D rows drawn around its own row from the head's competitors, or None where no pools are drawn
    (drawn_pools_fit). With ``points`` (B x d), the rows are drawn around those points instead, ``ids`` giving
    each its seed (and the row never drawn: -1 for none, with the head's row count as the seed).

    The draw follows the exponential tilt of the rows towards p = w_k that a Gaussian cloud would need:
    pi_i proportional to exp(theta . w_i), theta = C^-1 (p - c) (C the head's covariance, c its centre), which
    moves the mean of rows N(c, C) onto p itself. The rows are drawn without replacement in proportion to pi,
    by perturbing the log-weights with Gumbel noise and keeping the largest. Near the centre pi is nearly
    uniform and the pool a cloud around p; further out (trained heads have heavier tails than a Gaussian, so
    the tilt rests on a few rows) it is the rows that lead furthest along theta, those beyond p with the
    noise's draw of the rest around them, as the origin's pool is (anchor._pooled). The noise comes from a
    generator seeded by k, and each token's scores from a product of its own (no batch whose rounding could
    differ with the tokens in it): a token's pool depends on the head and its own id alone, never on the
    tokens decided with it. The token's own row and copies of rows are never drawn.

    ``lean``: (lambda, B; u, n) adds lambda_j u_i to the log-weights of token j: with u the part of the bias
    the rows do not fix, in units of its spread (tilt._bias_lean), the pool's rows lean towards larger biases
    by about lambda spreads without moving their centre in R^d."""
    if len(ids) == 0 or not drawn_pools_fit(head):
        return [None] * len(ids)
    size = DRAWN_POOL * lifted_dimension(head)
    ids = np.asarray(ids, dtype=np.int64)
    if points is None:
        points = head.rows64(torch.as_tensor(ids, device=head.device))
    pools = []
    for j, token in enumerate(ids.tolist()):
        theta = (points[j:j + 1] - head.centre) @ head.precision
        scores = head.logits(theta)[0] - float(theta[0] @ head.centre)  # theta . (w_i - c)
        if head.row_mask is not None:
            scores += head.row_mask
        if lean is not None:
            scores += lean[0][j] * lean[1]
        if token >= 0:
            scores[token] = -torch.inf
        scores = scores.cpu().numpy()
        drawn = np.flatnonzero(np.isfinite(scores))
        noise = np.random.default_rng(token if token >= 0 else head.n).random(head.n)[drawn]
        pools.append(np.sort(drawn[_gumbel_top(scores[drawn], noise, min(size, drawn.size))]))
    return pools


def weighted_pool(indices: np.ndarray, weights: np.ndarray, k: int, size: int) -> np.ndarray:
    """``size`` of a dense certificate's rows drawn in proportion to its weights (all positive), without
    replacement, the noise seeded by k: the rows around its point, as tilted_pools draws them around a row
    with a Gaussian cloud's tilt, here with the certificate's own (maximum-entropy weights reproduce the
    point, so it lies among the rows drawn). A function of the certificate and k alone."""
    noise = np.random.default_rng(k).random(indices.size)
    positive = weights > 0  # (a support may carry zero weights)
    keep = _gumbel_top(np.log(weights[positive]), noise[positive], min(size, int(positive.sum())))
    return np.sort(indices[positive][keep])


def _gumbel_top(log_weights: np.ndarray, noise: np.ndarray, size: int) -> np.ndarray:
    """Positions of ``size`` items drawn without replacement in proportion to exp(log_weights): the largest
    log-weights perturbed by Gumbel noise, -log(-log u) for the uniform ``noise`` u."""
    keys = log_weights - np.log(-np.log(np.maximum(noise, np.finfo(np.float64).tiny)))
    return np.argpartition(-keys, size - 1)[:size]


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
    alpha = eliminate_on(head.device, lifted_points(head, union), alpha)
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
    and a float32 Hessian of a singular one may be indefinite). Every array of
    the solve is torch's, on the points' device (on the CPU on the audit's threads: numpy's BLAS runs on one
    during an audit, auditor/util/threads.py); only scalars (a step's gradient size, slope and objective) reach
    the host. ``points`` and ``target`` may be numpy arrays (the weights then come back as one) or tensors.

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
    maximum-entropy weights of the points (the centre's, pools.pool_centre), the family and the answer
    are the same and only the path changes: from the centre's weights, whose Hessian is its PoolCentre's factor
    (``start``), a target near the centre takes chord steps first. ``chord``: a fresh Hessian is formed
    where a step leaves the gradient above this fraction of the one before (a chord step costs about 1 / D of
    a Hessian, so a start close to the answer's Hessian keeps stepping with it)."""
    kind = np.ndarray if isinstance(points, np.ndarray) else torch.Tensor
    points = torch.from_numpy(points) if kind is np.ndarray else points
    target = torch.as_tensor(target, dtype=torch.float64, device=points.device)
    # one m x D array, scaled in place: fresh arrays cost page faults
    offsets = torch.sub(points, target, out=points) if overwrite else points - target
    scale = max(float(offsets.max()), -float(offsets.min())) or 1.0
    offsets /= scale
    if prior is not None:
        prior = torch.as_tensor(prior, dtype=torch.float64, device=points.device)
    # start's Hessian over scale^2: its steps are scale^2 times the unscaled factor's (no D x D copy of it)
    first = (start, scale * scale) if start is not None else None
    found = _entropy_newton(offsets, torch.float32, min(iterations, _FLOAT32_HESSIANS), first, prior, chord)
    if found is None:
        found = _entropy_newton(offsets, torch.float64, iterations, first, prior, chord)
    return found.cpu().numpy() if kind is np.ndarray and found is not None else found


def _with_ridge(matrix: torch.Tensor) -> torch.Tensor:
    """``matrix`` (a D x D covariance, changed in place) plus a tiny ridge, 1e-14 of its trace, on its diagonal:
    rows of a normalised head span only a subspace. No D x D identity (a sixteenth of a float32 head of
    128256 x 4096)."""
    matrix.diagonal().add_(1e-14 * float(matrix.trace()))
    return matrix


_FLOAT32_HESSIANS = 8  # the float32 attempt's Hessians: a pool around the centre of a real head takes 3


_ROUNDING_GRADIENT = 1e-13  # a gradient this small (offsets scaled to at most 1) is at the rounding of its sum


_CHORD_STEPS = 150  # the steps a shared start adds (O(m D) each: at D = 4097 all of them cost a tenth of a Hessian)


def _hessian(offsets: torch.Tensor, pi: torch.Tensor, mean: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """sum_i pi_i (x_i - mean)(x_i - mean)^T (float64, D x D, on the offsets' device) from ``dtype`` products of
    blocks of _HESSIAN_ROWS offsets: no m x D copy in either precision."""
    hessian = torch.zeros(offsets.shape[1], offsets.shape[1], dtype=torch.float64, device=offsets.device)
    root = pi.sqrt()
    with ieee_float32_products():  # float32's own rounding, not TF32's (a caller's matmul precision)
        for s in range(0, offsets.shape[0], _HESSIAN_ROWS):
            block = (offsets[s:s + _HESSIAN_ROWS] - mean).mul_(root[s:s + _HESSIAN_ROWS, None]).to(dtype)
            hessian.add_(block.T @ block)  # a float32 product widened as it is added
    return hessian


_HESSIAN_ROWS = 2048


def _entropy_newton(offsets: torch.Tensor, dtype: torch.dtype, iterations: int,
                    start: tuple[torch.Tensor, float] | None = None, prior: torch.Tensor | None = None,
                    chord: float = 0.25) -> torch.Tensor | None:
    """maximum_entropy_weights' Newton's method from theta = 0, its Hessians formed in ``dtype`` (float32 or
    float64) products; ``start``, (a Cholesky factor L, s) with L L^T / s the Hessian at theta = 0, for the
    first (chord) steps; ``prior`` and ``chord`` as there. The arrays stay on the offsets' device."""
    narrow = dtype == torch.float32
    theta = offsets.new_zeros(offsets.shape[1])

    def weights(t):
        logits = offsets @ t
        if prior is not None:
            logits += prior
        top = float(logits.max())
        if not math.isfinite(top):  # a step so long that the logits overflow: F is +inf, the line search halves it
            return None, math.inf, math.inf
        pi = torch.exp(logits.sub_(top))  # (a logit below top by more than float64 holds: weight 0)
        total = float(pi.sum())
        return pi.div_(total), top + math.log(total), abs(top)  # F's rounding: about its leading logit's

    pi, current, magnitude = weights(theta)
    factor, step_scale = start if start is not None else (None, 1.0)
    hessians, previous = 0, math.inf
    for _ in range(4 * iterations + (_CHORD_STEPS if start is not None else 0)):
        gradient = pi @ offsets
        size = float(gradient.abs().max())
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
        step = torch.cholesky_solve(gradient[:, None], factor)[:, 0] * step_scale if factor is not None else None
        finite = step is not None and bool(torch.isfinite(step).all())
        if not finite and hessians == 0:  # the shared start failed: a fresh Hessian next
            factor, previous = None, math.inf
            continue
        if not finite:  # singular: not positive definite, or NaN. Least squares by an SVD, on the host (rare)
            hessian = _with_ridge(_hessian(offsets, pi, gradient, dtype)).cpu().numpy()
            host = np.linalg.lstsq(hessian, gradient.cpu().numpy(), rcond=None)[0]
            hessian = factor = None
            if not (np.all(np.isfinite(host)) and bool(torch.isfinite(gradient).all())):
                return None  # weights that overflowed or a Hessian of NaN: no direction to step in
            step = torch.as_tensor(host, device=offsets.device)
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
                    and float((trial_pi @ offsets).abs().max()) < size):
                break
            eta *= 0.5
        else:
            return None
        theta = theta - eta * step
        pi, current, magnitude = trial_pi, trial, trial_magnitude
    return _converged(pi, offsets)


def shared_null_vectors(points: np.ndarray | torch.Tensor) -> np.ndarray | torch.Tensor | None:
    """null_vectors of a pool's lifted points, for pool_certificate's tokens outside the pool (None for a pool
    of at most D rows, which needs none); of the points' kind, on their device."""
    return null_vectors(points) if points.shape[0] > points.shape[1] else None


def _tensor(x: np.ndarray | torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x


def pool_start(points: np.ndarray | torch.Tensor) -> torch.Tensor | None:
    """A Cholesky factor of the covariance of ``points`` (m x D, float64; uniform weights, a tiny ridge as the
    Hessians take), on their device: maximum_entropy_weights' ``start`` for the targets of one pool. None where
    it fails."""
    points = _tensor(points)
    uniform = points.new_full((points.shape[0],), 1.0 / points.shape[0])
    factor, info = cholesky_in_place(_with_ridge(_hessian(points, uniform, uniform @ points, torch.float64)))
    return factor if info == 0 else None


@dataclass
class PoolCentre:
    """The centre c of the head as a combination of a pool's rows: its maximum-entropy weights mu on them (all
    positive, sum mu_i x_i = c) and a Cholesky factor of H = sum_i mu_i (x_i - c)(x_i - c)^T, for
    linear_weights; tensors on the pool's device."""

    weights: torch.Tensor  # m, the pool's rows in order
    point: torch.Tensor  # c
    factor: torch.Tensor  # lower triangular, D - 1 square (the points without their last coordinate)


def pool_centre(points: np.ndarray | torch.Tensor, centre: np.ndarray | torch.Tensor) -> PoolCentre | None:
    """The PoolCentre of ``points`` (m x (D - 1): the pool's lifted points less their last coordinate) for the
    point ``centre``; None when the maximum-entropy solve or the factor fails (the centre is not inside
    the pool's hull). One solve and one m D^2 product for the pool, shared by every token near the centre."""
    points = _tensor(points)
    centre = torch.as_tensor(centre, dtype=torch.float64, device=points.device)
    weights = maximum_entropy_weights(points, centre)
    if weights is None or not bool((weights > 0).all()):  # (an underflowed weight: linear_weights and the prior need all)
        return None
    factor, info = cholesky_in_place(_with_ridge(_hessian(points, weights, centre, torch.float64)))
    return PoolCentre(weights, centre, factor) if info == 0 else None


def linear_weights(points: np.ndarray | torch.Tensor, centre: PoolCentre, target: np.ndarray | torch.Tensor
                   ) -> np.ndarray | torch.Tensor | None:
    """Convex weights on a pool's rows (``points`` their lifted points, m x D) reproducing ``target`` (the
    lifted point less its last coordinate: w_k, and b_k with a bias), from the centre's in one linear solve:
    nu_i = mu_i (1 + theta . (x_i - c)) with H theta = target - c. They sum to 1 (the mu_i (x_i - c) sum to
    0) and sum nu_i x_i = c + H theta = target in exact arithmetic (and for H without its ridge): the
    first-order term of the maximum-entropy weights about the centre, with no Newton's method. Valid where
    every 1 + theta . (x_i - c) is positive, as for a point a short way from the centre in the metric of H
    (their mean square over mu is theta . H theta): rows mean-initialised and rounded to bfloat16 leave them
    at 0.35 or more. One refinement against the float64 residual; None where a weight is not positive
    (maximum_entropy_weights may still reach such a target). O(m D) and two triangular solves a target;
    linear_weights_batch takes many targets at once. Of the points' kind."""
    kind = np.ndarray if isinstance(points, np.ndarray) else torch.Tensor
    points = _tensor(points)
    nu, positive = linear_weights_batch(points, centre, torch.as_tensor(target, device=points.device)[None, :])
    if not bool(positive[0]):
        return None
    return nu[:, 0].cpu().numpy() if kind is np.ndarray else nu[:, 0]


def linear_weights_batch(points: torch.Tensor, centre: PoolCentre, targets: torch.Tensor
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """linear_weights for B ``targets`` (B x (D - 1)), on the pool's device: (m x B weights, and per target
    whether every weight is positive: the columns linear_weights would return). Each column comes from its own
    target's solves and products, one right-hand side each (a solve or product with several right-hand sides
    rounds a column differently with different neighbours): a token's weights are the same whatever the block
    it is solved in."""
    rows = points[:, :-1]

    def step(offset: torch.Tensor) -> torch.Tensor:  # mu_i theta . (x_i - c), H theta = offset
        theta = torch.cholesky_solve(offset[:, None], centre.factor)[:, 0]
        return centre.weights * (rows @ theta - centre.point @ theta)

    columns, positive = [], []
    for target in targets:
        nu = centre.weights + step(target - centre.point)
        first = (nu > 0).all()
        nu = nu / nu.sum()  # (its drift from 1 is rounding) before the refinement, which keeps the sum
        nu = nu + step(target - nu @ rows)
        columns.append(nu)
        positive.append(first & (nu > 0).all())
    if not columns:
        return points.new_zeros((points.shape[0], 0)), torch.zeros(0, dtype=torch.bool, device=points.device)
    return torch.stack(columns, dim=1), torch.stack(positive)


def pool_certificate(head: EngineHead, pool: Pool, points: np.ndarray, k: int,
                     start: torch.Tensor | None = None, null: np.ndarray | None = None,
                     centre: PoolCentre | None = None, target: np.ndarray | None = None,
                     iterations: int = 60) -> tuple[np.ndarray, np.ndarray] | None:
    """Weights on at most D of the pool's rows (``points`` their lifted points) reproducing token k's row: the
    maximum-entropy weights on the pool (all positive where the row lies inside the pool's hull) and one
    elimination. No dense certificate first: for a row near the pool's centre (a mean-initialised row rounded
    to bfloat16) this is the work of one elimination on 2D rows. None when the pool does not surround the row.
    ``null``: the null vectors of all of ``points`` (null_vectors), for a token whose row is not in the pool.
    ``start``: pool_start's factor, the solve starting from uniform weights; or ``centre``: the solve starting
    from the centre's weights (less row k's, for a row of the pool) and factor, the factor kept while its
    chord steps cut the gradient by 30 % (a row near the centre, where the first-order weights of
    linear_weights turn negative, takes fewer Hessians than from uniform weights). ``target``: the point to
    reproduce, lifted, less its last coordinate (row k's own when None: with a bias, a certificate's point
    whose bias lies above b_k, as settle._lifted_target makes it). ``iterations``: the float64 Hessians at most."""
    others = pool.indices != k
    if target is None:
        target = lifted_points(head, np.array([k]))[0, :-1]
    points = _tensor(points)
    rows = points[torch.as_tensor(others, device=points.device)]  # a copy, spent by the solve
    if centre is not None:
        spread = maximum_entropy_weights(rows[:, :-1], target, iterations, start=centre.factor, overwrite=True,
                                         prior=centre.weights[torch.as_tensor(others, device=points.device)].log(),
                                         chord=_CENTRE_CHORD)
    else:
        spread = maximum_entropy_weights(rows[:, :-1], target, iterations, start=start, overwrite=True)
    del rows  # spent: let go before the elimination's arrays
    if spread is None:
        return None
    alpha = eliminate_where(points[torch.as_tensor(others, device=points.device)], spread,
                            torch.as_tensor(null, device=points.device) if null is not None and others.all() else None)
    survive = alpha > 0
    return pool.indices[others][survive], alpha[survive] / alpha[survive].sum()


_CENTRE_CHORD = 0.7  # pool_certificate from the centre's weights: a fresh Hessian once a chord step cuts the gradient by less than 30 %


def _converged(pi: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor | None:
    return pi if float((pi @ offsets).abs().max()) <= 1e-12 else None
