"""Settling proposals: Frank-Wolfe and dual outcomes checked into verdicts; certificates reduced to D rows.

Frank-Wolfe and dual outcomes become verdicts after a float64 check, and
convex certificates are reduced to at most D rows (sparsify).

Every proposal passes through certify.py (or lp.polish, which ends in it)
before it is recorded; what fails leaves its rows as seeds for the LP and its
bounds for an inconclusive answer.
"""

from __future__ import annotations

import numpy as np
import torch

from auditor.engine.arithmetic.budget import batch_count
from auditor.engine.arithmetic.head import EngineHead
from auditor.engine.arithmetic.rounding import per_unit_norm, safe_norm
from auditor.engine.decisions import STAGES, UNDECIDED, Decisions, set_convex, set_witness
from auditor.engine.exact.caratheodory import Pool, lifted_dimension, lifted_points, lifted_tensor, reduce_supports
from auditor.engine.exact.certify import check_convex, check_witnesses, check_witnesses_sharpened
from auditor.engine.exact.dual_simplex import Basis
from auditor.engine.exact.lp import polish
from auditor.engine.exact.elimination import eliminate_on_pool
from auditor.engine.exact.pools import (DRAWN_POOL, POOL_HESSIANS, PoolCentre, centre_pool, drawn_pools_fit,
                                        from_pool, linear_weights_batch, pool_centre,
                                        pool_certificate, pool_start, shared_null_vectors, spread_pool, weighted_pool)
from auditor.engine.solvers.tilt import bias_can_lean

def settle_frank_wolfe(head: EngineHead, out: Decisions, ids: np.ndarray, outcomes, seeds, lower, upper) -> None:
    """Accept Frank-Wolfe witnesses in their final form, and its weights where w_k is inside."""
    won = [j for j, o in enumerate(outcomes) if o.certified]
    if won:
        witnesses = np.stack([outcomes[j].witness for j in won])
        if head.domain.bounded:  # without a bias any positive multiple wins: move it into the domain
            witnesses = np.stack([w * head.domain.largest_scale(w) for w in witnesses])
        check = check_witnesses(head, ids[won], torch.as_tensor(witnesses, device=head.device))
        # check.margin bounds the lead at z from below; unbounded, it is stated per unit of ||z||
        margins = check.margin if head.domain.bounded else per_unit_norm(
            check.margin, safe_norm(torch.as_tensor(witnesses), dim=1).numpy(), head.d)
        for row, j in enumerate(won):
            k = int(ids[j])
            if check.certified[row]:
                set_witness(out, k, witnesses[row], float(margins[row]), int(check.runner_up[row]), "frank-wolfe")
    for j, outcome in enumerate(outcomes):
        k = int(ids[j])
        if out.verdict[k] != UNDECIDED:
            continue
        if not head.domain.bounded:
            lower[k] = outcome.margin  # a unit-ball margin, the quoted unit of an unbounded head
        if outcome.support.size:
            indices, weights, check = polish(head, k, outcome.support, outcome.support_weights)
            upper[k] = check.residual
            if check.accepted:
                set_convex(out, k, indices, weights, check.residual, check.bias_gap, "frank-wolfe")
                continue
            seeds[k].append(outcome.support)


def settle_dual(head: EngineHead, out: Decisions, ids: np.ndarray, outcomes, seeds, lower, upper) -> None:
    """Accept the dual's witnesses after a float64 check, and its weights after lp.polish (which
    tries them as they are first); record the bounds in a bounded domain."""
    won = [j for j, o in enumerate(outcomes) if o.certified]
    if won:
        witnesses = torch.as_tensor(np.stack([outcomes[j].witness for j in won]), device=head.device)
        check = check_witnesses_sharpened(head, ids[won], witnesses)
        for row, j in enumerate(won):
            if check.certified[row]:
                set_witness(out, int(ids[j]), outcomes[j].witness, float(check.margin[row]),
                            int(check.runner_up[row]), "frank-wolfe")
    for j, outcome in enumerate(outcomes):
        k = int(ids[j])
        if out.verdict[k] != UNDECIDED:
            continue
        if head.domain.bounded:
            lower[k], upper[k] = outcome.lower, outcome.upper
        if outcome.support.size:
            # A bounded domain's dual value is accepted as it is; the unbounded certificate needs a
            # residual at the tolerance, which only an exact solve on the support gives.
            indices, weights = outcome.support, outcome.support_weights
            if head.domain.bounded:
                check = check_convex(head, k, indices, weights)
                flat = min(outcome.upper, check.residual) <= head.residual_tolerance(k) * head.domain.reach(head.d)
                if not check.accepted and flat:
                    # a dual value zero up to rounding, as for a row exactly between others with its bias
                    # exactly between theirs: the exact combination on the support may still be certified
                    indices, weights, check = polish(head, k, indices, weights)
            else:
                indices, weights, check = polish(head, k, indices, weights)
            if check.accepted:
                set_convex(out, k, indices, weights, check.residual, check.bias_gap, "frank-wolfe")
                continue
            seeds[k].append(outcome.support)


def sparsify(head: EngineHead, out: Decisions, routes: CentreRoutes | None = None) -> None:
    """Replace every convex certificate on more than D rows by one on at most D (caratheodory.py).

    The reduced weights must pass the same float64 check (re-solved on their
    support by lp.polish when they do not at first); where they still fail, the
    dense certificate stands. Certificates whose bulk lies near the centre of
    the head (those of the interior stage, where mean-initialised rows go, and
    without a bias any whose heaviest row holds at most 10 % of the weight) first try routes
    through rows around the centre (CentreRoutes); every other dense certificate (unbounded
    domain) first tries a pool of 3D rows drawn in proportion to its own weights
    (_from_weighted_pool), before those routes where it has them, and so do the interior
    stage's where the routes miss. What is left takes full
    reductions together (caratheodory.reduce_supports): the elimination steps of
    up to 8 of them are one batch of tensor operations.
    ``routes`` are those an earlier stage built (the few-token route of pipeline.py), reused.
    """
    dim = lifted_dimension(head)
    dense = [k for k, (indices, _, _, _) in out.convex.items() if indices.size > dim]
    # Without a bias a spread-out certificate lies near the centre too; with one, a spread-out certificate is
    # Newton's lean towards the rows of larger bias, which the rows around the centre do not reach
    near = [k for k in dense if out.stage[k] == STAGES.index("interior")
            or (head.bias is None and out.convex[k][1].max() <= _SPREAD_WEIGHT)]
    if near and routes is None:
        routes = CentreRoutes(head)
    routed = set(near)
    # a pool drawn from the weights of a dense certificate (Newton's, Frank-Wolfe's) holds its point; the
    # interior stage's weights are the centre's, nearly uniform, and its tokens take the centre's routes first
    weighted = (bool(dense) and not head.domain.bounded and drawn_pools_fit(head) and bias_can_lean(head))
    left = [k for k in dense if k not in routed and not (weighted and _from_weighted_pool(head, out, k, dim))]
    for k in near:
        interior = out.stage[k] == STAGES.index("interior")
        if not interior and weighted and _from_weighted_pool(head, out, k, dim):
            continue
        reduced = routes.reduce(k, *out.convex[k], interior=interior)
        if reduced is None:
            left.append(k)
        else:
            set_convex(out, k, *reduced, STAGES[int(out.stage[k])])
    left = [k for k in left if out.stage[k] != STAGES.index("interior") or not (weighted and _from_weighted_pool(head, out, k, dim))]
    for k, (support, alpha) in zip(left, reduce_supports(head, [out.convex[k][:2] for k in left])):
        _record(head, out, k, support, alpha, dim)


def _from_weighted_pool(head: EngineHead, out: Decisions, k: int, dim: int) -> bool:
    """A certificate for token k on at most D rows from a pool of 3D rows drawn in proportion to its dense
    certificate's weights (pools.weighted_pool): the pool's maximum-entropy weights for the same point and one
    elimination, in place of a full reduction's merge rounds over every row of the support (at 32768 x 512,
    0.4 s against 1.4 s for a planted row's Newton certificate). Only for a support of more than two pools (and
    sparsify calls it only in the unbounded domain, whose certificates reproduce w_k, on heads narrow enough for
    pools.drawn_pools_fit, and where the bias can lean: tilt.bias_can_lean); False where the pool's hull misses
    the point, which then takes the full reduction."""
    indices, weights, _, gap = out.convex[k]
    size = DRAWN_POOL * dim
    if indices.size <= 2 * size:
        return False
    chosen = weighted_pool(indices, weights, k, size)
    points = lifted_points(head, chosen)
    found = pool_certificate(head, Pool(chosen, points), points, k, target=_lifted_target(head, k, gap)[:-1],
                             iterations=POOL_HESSIANS)
    if found is None or found[0].size > dim:
        return False
    check = check_convex(head, k, *found)
    if not check.accepted:
        return False
    set_convex(out, k, *found, check.residual, check.bias_gap, STAGES[int(out.stage[k])])
    return True


def _route_pivots(dim: int) -> int:
    """Pivots a route may take before the token goes to a full reduction instead: a pivot is three
    matrix-vector products of D x D blocks (O(D^2), memory-bound: dual_simplex.py), and D / 8 of them cost
    less than a full reduction (merge rounds of O(D^3) matrix products) does."""
    return max(_DIRECT_PIVOTS, dim // 8)


_LINEAR_BYTES = 1 << 24  # linear_weights_batch's m x B weights (and its products) at most, on the CPU
_SPREAD_WEIGHT = 0.1  # a dense certificate whose heaviest weight is at most this has its bulk near the centre
_DIRECT_PIVOTS = 32  # pivots of the few-token route from the centre's basis (CentreRoutes.direct)


class CentreRoutes:
    """Sparse certificates through rows around the centre of the head, tried in turn, cheapest first:

    1. the dual simplex from the basis of the centre on the at most 2D rows the
       centre of the head passes through (dual_simplex.Basis, pools.centre_pool):
       a few pivots for a mean-initialised row;
    2. a basis of 3D rows drawn around the centre (pools.spread_pool), as
       much of the centre's basis as they hold, whose hull reaches further;
       each of these two routes with at most max(32, D / 8) pivots (_route_pivots);
    3. for certificates of the interior stage, moving the bulk onto either pool
       and one or two eliminations (pools.from_pool).

    The pools are drawn when the routes are made, the bases built at first use (and again after let_go);
    every pool and basis depends on the head alone, and each token's attempts on
    its own certificate, so a token's certificate does not depend on the tokens
    decided with it (ranks and blocks of ids give the certificates of one whole
    run).
    """

    def __init__(self, head: EngineHead):
        self.head = head
        self.dim = lifted_dimension(head)
        self.spread = spread_pool(head)
        self.centre = centre_pool(head, self.spread) if self.spread is not None else None
        if self.spread is not None:  # 3D x D float64, gathered again if a later route needs it
            self.spread.points = None
        self.bases: dict[str, Basis] = {}

    def _basis(self, name: str) -> Basis:
        """The basis of the centre on the centre pool ("centre") or on the spread pool ("spread"), built once;
        the pool's own lifted points are let go (the basis holds them scaled)."""
        if name not in self.bases:
            pool, support = self.centre
            chosen = pool if name == "centre" else self.spread
            self.bases[name] = Basis(self.head, chosen.indices, support, chosen.lifted(self.head))
            chosen.points = None
        return self.bases[name]

    def direct(self, k: int, pivots: int = _DIRECT_PIVOTS) -> tuple[np.ndarray, np.ndarray, float, float] | None:
        """A certificate for token k on at most D rows straight from the centre's basis (route 1), with no
        dense certificate to start from: the point reproduced is (w_k, b_k, 1), a bias gap of 0 up to
        rounding, which the check settles; at most ``pivots`` pivots (mean-initialised rows take 1-9 at
        D = 385, more on wider heads, whose simplex around the centre is thinner). None when the basis
        does not reach the point."""
        return self._from_bases(k, lifted_points(self.head, np.array([k]))[0], direct=pivots)

    def pooled(self, ks: list[int]) -> dict[int, tuple[np.ndarray, np.ndarray, float, float]]:
        """Accepted certificates on at most D rows for tokens near the centre, from their own rows on the centre
        pool, for rows the centre's basis reaches only after many pivots (mean-initialised rows rounded to
        bfloat16 sit tens of times further out than the float32 ones): the centre's weights on the pool moved
        to the row by one linear solve (pools.linear_weights), or where one of those weights is not
        positive the row's maximum-entropy weights (pools.pool_certificate: from the centre's weights,
        stepping with the centre's factor; failing that from uniform weights, whose first steps share one factor
        of the pool's covariance), and one elimination. The pool's points, the centre's weights and
        factor are made once for all of ``ks`` and let go after."""
        found: dict[int, tuple[np.ndarray, np.ndarray, float, float]] = {}
        if self.centre is None or not ks or self.head.bias is not None:  # (rows without a bias: their point is w_k)
            return found
        pool, _ = self.centre
        head = self.head
        # on the head's device, where the solves and eliminations run (on the CPU the pool's own array)
        points = (torch.from_numpy(pool.points) if pool.points is not None and head.device.type == "cpu"
                  else lifted_tensor(head, pool.indices))
        outside = np.isin(ks, pool.indices, invert=True)
        centre = pool_centre(points[:, :-1], head.centre) if outside.any() else None
        null = shared_null_vectors(points) if outside.any() else None
        linear = self._linear(points, centre, null, [k for k, away in zip(ks, outside.tolist()) if away])
        start: list = []  # the factor of the maximum-entropy route, made at its first token
        for k in ks:
            certificate = linear.get(k)
            check = check_convex(head, k, *certificate) if certificate is not None else None
            if (check is None or not check.accepted or certificate[0].size > self.dim) and centre is not None:
                # from the centre's weights, its factor kept for chord steps (a row of the pool too: without
                # it the centre's weights are still of the family, and its factor is H less one rank-one term)
                certificate = pool_certificate(head, pool, points, k, null=null, centre=centre)
                check = check_convex(head, k, *certificate) if certificate is not None else None
            if check is None or not check.accepted or certificate[0].size > self.dim:
                if not start:  # from uniform weights: where the centre has no weights on the pool, or its route failed
                    start.append(pool_start(points[:, :-1]))
                certificate = pool_certificate(head, pool, points, k, start[0], null)
                check = check_convex(head, k, *certificate) if certificate is not None else None
            if check is not None and check.accepted and certificate[0].size <= self.dim:
                found[k] = (*certificate, check.residual, check.bias_gap)
        return found

    def _linear(self, points: torch.Tensor, centre: PoolCentre | None, null: torch.Tensor | None,
                ks: list[int]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
        """The centre pool's certificates from linear_weights for tokens ``ks`` (rows not in the pool), where
        every weight is positive: each token's weights from its own pair of triangular solves, and a block's
        eliminations on the pool's shared null vectors (elimination.eliminate_on_pool: together on a GPU), on
        the pool's device. Each token's certificate is its own alone, whatever the others in its block."""
        found: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        if centre is None or not ks:
            return found
        pool, _ = self.centre
        m = points.shape[0]
        # each token: its m weights and the solve's temporaries (about four m-vectors) on the device, its
        # D-vector target on the host
        block = min(batch_count(points.device, _LINEAR_BYTES, 8 * (5 * m + points.shape[1]), len(ks)),
                    max(1, _LINEAR_BYTES // (8 * points.shape[1])))
        for s in range(0, len(ks), block):
            tokens = ks[s:s + block]
            targets = torch.as_tensor(lifted_points(self.head, np.array(tokens))[:, :-1], device=points.device)
            nu, positive = linear_weights_batch(points, centre, targets)
            reached = np.flatnonzero(positive.cpu().numpy())
            alphas = eliminate_on_pool(points, nu[:, torch.as_tensor(reached, device=points.device)].T, null)
            for j, alpha in zip(reached.tolist(), alphas):
                survive = alpha > 0
                found[tokens[j]] = pool.indices[survive], alpha[survive] / alpha[survive].sum()
        return found

    def let_go(self) -> None:
        """Let the bases go (each a pool of up to 3D rows and a D x D inverse: at D = 4097 a tenth of a float32
        head or more) while other stages run; a later route builds them again (the same bases: they depend on
        the head alone), at the cost of their factorisation."""
        self.bases.clear()

    def direct_pivots(self) -> int:
        """The pivots the whole audit allows a direct route (the few-token route allows _DIRECT_PIVOTS): as
        many as sparsify's routes, which a token the route misses would take after the interior stage."""
        return _route_pivots(self.dim)

    def _from_bases(self, k: int, target: np.ndarray, direct: int = 0
                    ) -> tuple[np.ndarray, np.ndarray, float, float] | None:
        """The centre's basis, then the spread pool's (up to _route_pivots each); ``direct``: the centre's
        alone, up to that many pivots, so a token further out costs little before it goes the whole way."""
        routes = ((("centre", min(self.dim, direct)),) if direct
                  else (("centre", _route_pivots(self.dim)), ("spread", _route_pivots(self.dim))))
        for name, pivots in routes if self.centre is not None else ():
            found = self._basis(name).certificate(k, target, max_pivots=pivots)
            check = check_convex(self.head, k, *found) if found is not None else None
            if check is not None and check.accepted:
                return (*found, check.residual, check.bias_gap)
        return None

    def reduce(self, k: int, indices: np.ndarray, weights: np.ndarray, residual: float, gap: float,
               interior: bool = True) -> tuple[np.ndarray, np.ndarray, float, float] | None:
        """(indices, weights, residual, bias gap) of an accepted certificate on at most D rows, or None; route 3
        only for an ``interior`` certificate."""
        found = self._from_bases(k, _lifted_target(self.head, k, gap))
        if found is not None:
            return found
        if not interior:  # moving the bulk suits certificates spread around the centre, not a tilt's
            return None
        pools = [pool for pool in (self.centre[0] if self.centre is not None else None, self.spread) if pool is not None]
        for pool in pools:
            found = from_pool(self.head, pool, k, indices, weights)
            check = check_convex(self.head, k, *found) if found is not None and found[0].size <= self.dim else None
            if check is not None and check.accepted:
                return (*found, check.residual, check.bias_gap)
        return None


def _lifted_target(head: EngineHead, k: int, gap: float) -> np.ndarray:
    """The point a sparse certificate for token k reproduces: (w_k, 1), or with a bias (w_k, b_k + h, 1),
    h half the bias the dense certificate holds above b_k (its bias gap is -2h). The weights' bias must
    exceed b_k, not meet it, and the dense certificate shows how far it can."""
    point = lifted_points(head, np.array([k]))[0]
    if head.bias is not None and gap < 0:
        point[-2] -= gap / 2
    return point


def _record(head: EngineHead, out: Decisions, k: int, support: np.ndarray, alpha: np.ndarray, dim: int) -> None:
    """The reduced certificate in place of the dense one when it passes the check (after lp.polish if need be)."""
    check = check_convex(head, k, support, alpha)
    if not check.accepted:
        support, alpha, check = polish(head, k, support, alpha)
    if check.accepted and support.size <= dim:
        set_convex(out, k, support, alpha, check.residual, check.bias_gap, STAGES[int(out.stage[k])])
