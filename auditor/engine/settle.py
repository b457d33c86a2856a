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

from auditor.engine.caratheodory import centre_pool, from_pool, lifted_dimension, reduce_supports, spread_pool
from auditor.engine.certify import check_convex, check_witnesses, check_witnesses_sharpened
from auditor.engine.decisions import STAGES, UNDECIDED, Decisions, set_convex, set_witness
from auditor.engine.head import EngineHead
from auditor.engine.lp import polish

def settle_frank_wolfe(head: EngineHead, out: Decisions, ids: np.ndarray, outcomes, seeds, lower, upper) -> None:
    """Accept Frank-Wolfe witnesses in their final form, and its weights where w_k is inside."""
    won = [j for j, o in enumerate(outcomes) if o.certified]
    if won:
        witnesses = np.stack([outcomes[j].witness for j in won])
        if head.domain.bounded:  # without a bias any positive multiple wins: move it into the domain
            witnesses = np.stack([w * head.domain.largest_scale(w) for w in witnesses])
        check = check_witnesses(head, ids[won], torch.as_tensor(witnesses, device=head.device))
        for row, j in enumerate(won):
            k = int(ids[j])
            if check.certified[row]:
                margin = outcomes[j].margin if not head.domain.bounded else float(check.margin[row])
                set_witness(out, k, witnesses[row], margin, int(check.runner_up[row]), "frank-wolfe")
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


def sparsify(head: EngineHead, out: Decisions) -> None:
    """Replace every convex certificate on more than D rows by one on at most D (caratheodory.py).

    The reduced weights must pass the same float64 check (re-solved on their
    support by lp.polish when they do not at first); where they still fail, the
    dense certificate stands. The full reductions run together
    (caratheodory.reduce_supports): the elimination steps of up to 8 of them
    are one batch of tensor operations. Certificates of the interior stage
    (mean-initialised rows all sit at the centre) first try to move their bulk
    onto a pool of rows around the centre and be reduced by one or two
    eliminations (caratheodory.from_pool): the at most 2D rows the centre of the
    head passes through (caratheodory.centre_pool), else 3D rows drawn around it
    (caratheodory.spread_pool).
    """
    dim = lifted_dimension(head)
    dense = [k for k, (indices, _, _, _) in out.convex.items() if indices.size > dim]
    interior = {k for k in dense if out.stage[k] == STAGES.index("interior")}
    # Interior certificates try pools first: the at most 2D rows around the centre of the head, then 3D
    # rows drawn around it. Both depend on the head alone, so a token's certificate does not depend on
    # the tokens decided with it (ranks and blocks of ids give the certificates of one whole run).
    spread = spread_pool(head) if interior else None
    pools = [pool for pool in (centre_pool(head, spread) if spread is not None else None, spread) if pool is not None]
    left = []
    for k in dense:
        for pool in pools if k in interior else []:
            reduced = from_pool(head, pool, k, *out.convex[k][:2])
            check = check_convex(head, k, *reduced) if reduced is not None and reduced[0].size <= dim else None
            if check is not None and check.accepted:
                set_convex(out, k, *reduced, check.residual, check.bias_gap, STAGES[int(out.stage[k])])
                break
        else:
            left.append(k)
    for k, (support, alpha) in zip(left, reduce_supports(head, [out.convex[k][:2] for k in left])):
        _record(head, out, k, support, alpha, dim)


def _record(head: EngineHead, out: Decisions, k: int, support: np.ndarray, alpha: np.ndarray, dim: int) -> None:
    """The reduced certificate in place of the dense one when it passes the check (after lp.polish if need be)."""
    check = check_convex(head, k, support, alpha)
    if not check.accepted:
        support, alpha, check = polish(head, k, support, alpha)
    if check.accepted and support.size <= dim:
        set_convex(out, k, support, alpha, check.residual, check.bias_gap, STAGES[int(out.stage[k])])
