"""Rows on a ray through the origin: one sparse certificate of the origin serves them all.

A row swallowed by a longer copy of itself, w_j = s w_k with s > 1, lies on the
segment from w_j to the origin of the coordinates the head was given in:

    w_k = (1 - 1/mu) w_j + (1/mu) p,   p = w_j + mu (w_k - w_j),

with p the origin itself (mu = s / (s - 1)). When the origin lies inside the
hull of the rows, a convex certificate of p and the weight 1 - 1/mu on w_j
certify w_k. Rows shrunk towards the origin, and rows near it, have rays that
pass near it as well; a row at the origin itself (reserved rows left at zero),
or near it, takes the origin's certificate moved to its own point.

The origin's certificate is found once per audit (every rank or block of ids finds the
same one): maximum-entropy weights on the rows that lead along the first
Newton step towards the origin (_pooled), or on rows drawn around it (_tilted)
where that pool declines or misses, or where their hulls miss it on all rows by
Newton's method (tilt.maximum_entropy; rows at the origin itself stay out of the
first and the last of these: a vertex there would hold the origin and certify
nothing the route needs), reduced to at most D rows
(caratheodory.reduce_support), whose basis on the rows of the reduction's last
round starts the dual simplex (dual_simplex.Basis) for each token's own point p,
the point of its ray closest to the origin: a few pivots from the origin's
basis. Row k itself may carry weight in p's combination (a row of the origin's
basis, or a zero row that rows drawn around the origin rest on): from
w_k = a w_k + sum_i c_i w_i with a < 1, w_k = sum_i c_i w_i / (1 - a), a convex
combination of the others, so the token's own row never has to be pivoted out.
With the weight on w_j the certificate has at most D + 1 rows, and one
elimination brings it to D. So such a token costs neither a Newton solve of its
own nor a full reduction of a dense certificate. Every certificate goes through
certify.check_convex.

The origin and its basis depend on the head alone, and whether a token takes
this route on its own row, so a token's certificate does not depend on the
tokens decided with it. Heads with a bias take the per-token Newton stage: the
origin's weights would also have to carry a bias above the token's.
"""

from __future__ import annotations

import numpy as np
import torch

from auditor.engine.arithmetic.head import EngineHead
from auditor.engine.arithmetic.row_statistics import robust_row_norms
from auditor.engine.exact.caratheodory import lifted_dimension, lifted_points, lifted_tensor, reduce_support
from auditor.engine.exact.certify import check_convex
from auditor.engine.exact.dual_simplex import Basis
from auditor.engine.exact.elimination import eliminate_on
from auditor.engine.exact.pools import POOL_HESSIANS, maximum_entropy_weights, tilted_pools
from auditor.engine.solvers.tilt import maximum_entropy, ray_rivals

_REACH = 1e-3  # a ray passing within this many typical spreads of the origin is worth the route
_BATCH = 64


class _Origin:
    """The origin's basis (None when the origin is not inside the hull of the rows); ``norms``: each row's
    distance from the origin when the caller has them. Rows at the origin itself stay out of the solves."""

    def __init__(self, head: EngineHead, iterations: int, norms: torch.Tensor | None = None):
        self.point = _given_origin(head)
        self.basis = None
        if norms is None:  # ||w_i - o||: the head's own row norms where it was not translated (no copy of it)
            norms = head.row_norm if head.origin is None else robust_row_norms(head.weight, head.origin)
        at_origin = norms == 0
        found = _pooled(head, self.point, at_origin)
        if found is None:
            found = _tilted(head, self.point)
        if found is None:
            found = _whole_head(head, self.point, iterations, at_origin)
        if found is None:
            return  # the origin is outside the hull, or on its boundary
        support, weights = found
        indices, weights, pool = reduce_support(head, support, weights)
        self.basis = Basis(head, pool.indices, indices, pool.lifted(head))


def _pooled(head: EngineHead, point: torch.Tensor, at_point: torch.Tensor | None = None
            ) -> tuple[np.ndarray, np.ndarray] | None:
    """Maximum-entropy weights for ``point`` on the rows that lead along the first Newton step of the whole
    head's solve (the precision matrix times point - centre, which a tilt towards the point follows first),
    or None when their hull does not hold it (then the whole head's solve runs). The rows taken: those
    beyond the point along that step and as many before it, so that the point lies between them, and at
    least 2D (a point is inside the hull of 2D rows drawn symmetrically about it about half the time, by
    Wendel's theorem). A solve on m rows (m D^2 a Hessian) in place of Newton's passes over n, and a
    support of m rows in place of a reduction from n: at 128256 x 4096 about 20 s against about 120 s. Only
    where m is at most a quarter of the rows (the point well off the centre; near it, too many rows lead it
    for the pool to save much) and at least D / 2 rows lie beyond the point (with fewer, their hull holds it
    in too few directions: at 32768 x 2048, 952 rows beyond, a pool of 2D missed it after 10 s of solves).
    A function of the head alone: scores from fast_logits, ties by row. Rows ``at_point`` (n, bool) stay out.
    """
    dim = lifted_dimension(head)
    rivals = torch.nonzero(head.competitor if at_point is None else head.competitor & ~at_point).flatten()
    direction = (point - head.centre) @ head.precision
    scores = head.fast_logits(direction[None, :])[0, rivals].cpu().numpy()
    beyond = int((scores > float(direction @ point)).sum())
    size = max(2 * dim, 2 * beyond)
    if 2 * beyond < dim or 4 * size > rivals.numel():
        return None
    chosen = np.sort(rivals.cpu().numpy()[np.argsort(-scores, kind="stable")[:size]])
    points = lifted_tensor(head, chosen)  # on the head's device, where the solve runs
    # the lifted points are spent by the solve (reduce_support gathers its own)
    weights = maximum_entropy_weights(points[:, :-1], point, iterations=POOL_HESSIANS, overwrite=True)
    return (chosen, weights.cpu().numpy()) if weights is not None else None


def _tilted(head: EngineHead, point: torch.Tensor) -> tuple[np.ndarray, np.ndarray] | None:
    """Maximum-entropy weights for ``point`` on 3D rows drawn around it (pools.tilted_pools), where _pooled declines
    (its rows would be too many a share of the head, as for the origin one standard deviation of the leading
    direction from the centre at 32768 x 512: 0.05 s; or too few lie beyond it) or its hull misses the point;
    None when this pool's hull misses it too (then the whole head's solve runs)."""
    chosen = tilted_pools(head, np.array([-1]), point[None, :])[0]
    if chosen is None:
        return None
    weights = maximum_entropy_weights(lifted_tensor(head, chosen)[:, :-1], point, iterations=POOL_HESSIANS,
                                      overwrite=True)
    return (chosen, weights.cpu().numpy()) if weights is not None else None


def _whole_head(head: EngineHead, point: torch.Tensor, iterations: int, at_point: torch.Tensor | None = None
                ) -> tuple[np.ndarray, np.ndarray] | None:
    """Maximum-entropy weights for ``point`` on all rows but those ``at_point`` (tilt.maximum_entropy:
    Newton's method over the head), or None when they do not reproduce it to a token's tolerance.

    A row at the point would let the weights reproduce it by resting on that row alone, which certifies
    nothing the route needs, and Newton reaches such a vertex only slowly (every step a few passes over the
    head: 2 s at 4096 x 512). Without those rows the point is either inside the others' hull, or some theta
    puts its logit above every row's, where the solve stops at once (``own``)."""
    mask = torch.zeros(1, head.n, dtype=torch.float64, device=head.device)
    if head.row_mask is not None:
        mask += head.row_mask[None, :]
    if at_point is not None:
        mask[0, at_point] = -torch.inf
    # as a token's own solve aims (its tolerance, which the tokens' certificates scale by 1/mu)
    goal = torch.tensor([head.residual_tol * head.typical_spread], dtype=torch.float64, device=head.device)
    pi, least, _ = maximum_entropy(head, point[None, :], mask, goal, iterations, own=point[None, :])
    if not bool(least[0] <= goal[0]):
        return None
    support = torch.nonzero(pi[0] > 0).flatten()
    return support.cpu().numpy(), pi[0, support].cpu().numpy()


def anchored_certificates(head: EngineHead, ids: np.ndarray, iterations: int = 40
                          ) -> dict[int, tuple[np.ndarray, np.ndarray, float, float]]:
    """Return ``{k: (indices, weights, residual, bias_gap)}`` for the tokens whose ray from a rival through
    their row passes within _REACH typical spreads of the origin and whose certificate that way checks."""
    found: dict[int, tuple[np.ndarray, np.ndarray, float, float]] = {}
    if len(ids) == 0 or head.bias is not None or head.n_competitors <= head.d or head.typical_spread == 0:
        return found
    # ||w_i - o|| once for all batches, for a translated head (otherwise the head's row norms serve)
    given = (_given_origin(head), robust_row_norms(head.weight, head.origin)) if head.origin is not None else None
    rays = [ray for s in range(0, len(ids), _BATCH) for ray in _rays(head, ids[s:s + _BATCH], given)]
    near = [(int(k), j, mu, p) for k, (j, mu, p, distance) in zip(ids.tolist(), rays)
            if distance <= _REACH * head.typical_spread]
    if not near:
        return found
    origin = _Origin(head, iterations, given[1] if given is not None else None)
    if origin.basis is None:
        return found
    dim = lifted_dimension(head)
    for k, j, mu, p in near:
        rest = origin.basis.certificate(k, np.append(p, 1.0), max_pivots=max(dim // 4, 16), own=True)
        if rest is not None and rest[0].size == 1 and rest[0][0] == k:
            # p is row k itself (a row at the origin that the origin's basis rests on): pivoted out instead
            rest = origin.basis.certificate(k, np.append(p, 1.0), max_pivots=max(dim // 4, 16))
        if rest is None:
            continue
        if j < 0:  # w_k itself near the origin: p = w_k, the rest's weights alone
            indices, weights = rest
        else:
            indices, position = np.unique(np.append(rest[0], j), return_inverse=True)  # j may be among the rest's
            weights = np.zeros(indices.size)
            np.add.at(weights, position, np.append(rest[1] / mu, 1.0 - 1.0 / mu))
        mine = indices == k
        if mine.any():  # w_k = a w_k + sum_i c_i w_i with a < 1: w_k = sum_i c_i w_i / (1 - a)
            own = float(weights[mine].sum())
            if not own < 1.0:
                continue
            indices, weights = indices[~mine], weights[~mine] / (1.0 - own)
        if indices.size > dim:  # the points handed over, column-major: factored where they lie
            weights = eliminate_on(head.device, [lifted_points(head, indices, column_major=True)], weights)
            indices, weights = indices[weights > 0], weights[weights > 0]
        check = check_convex(head, k, indices, weights)
        if check.accepted:
            found[k] = (indices, weights, check.residual, check.bias_gap)
    return found


def _rays(head: EngineHead, ids: np.ndarray, given: tuple[torch.Tensor, torch.Tensor] | None
          ) -> list[tuple[int, float, np.ndarray, float]]:
    """Per token, of the rays from its candidate rivals w_j through w_k: (j, mu, p, ||p - origin||) for the one
    passing closest to the origin at or beyond w_k (mu >= 1); distance inf when none does. Where w_k itself is
    as close (a row at the origin or near it, as reserved rows are left), (-1, 1, w_k, ||w_k - origin||):
    the origin's certificate moved to w_k, no rival's weight. ``given``: see tilt.ray_rivals."""
    k = torch.as_tensor(ids, device=head.device)
    origin = _given_origin(head)
    w_k = head.rows64(k)
    rivals = ray_rivals(head, k, w_k, given)
    w_j = head.rows64(rivals.reshape(-1)).reshape(*rivals.shape, head.d)
    u = w_k[:, None, :] - w_j
    reach = (u * u).sum(dim=2)
    mu = torch.where(reach > 0, ((origin - w_j) * u).sum(dim=2) / reach.clamp(min=torch.finfo(torch.float64).tiny),
                     torch.zeros_like(reach))
    p = w_j + mu[:, :, None] * u
    distance = torch.where(mu >= 1, torch.linalg.vector_norm(p - origin, dim=2), torch.full_like(mu, torch.inf))
    best = distance.argmin(dim=1)
    rows = torch.arange(len(k), device=head.device)
    own = torch.linalg.vector_norm(w_k - origin, dim=1)
    itself = own <= distance[rows, best]
    return [(-1, 1.0, w.cpu().numpy(), float(o)) if at else (int(j), float(m), q.cpu().numpy(), float(dist))
            for at, w, o, j, m, q, dist in zip(itself.tolist(), w_k, own, rivals[rows, best], mu[rows, best],
                                                p[rows, best], distance[rows, best])]


def _given_origin(head: EngineHead) -> torch.Tensor:
    """The origin of the coordinates the rows were given in, in the head's own (float64, d)."""
    return head.origin if head.origin is not None else torch.zeros(head.d, dtype=torch.float64, device=head.device)
