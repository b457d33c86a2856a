"""The engine's stage order: ``decide`` runs every requested token through the stages, cheapest first.

1. ties      exact duplicate rows become groups; one representative is decided
2. screen    one Gram pass checks z = s (w_k - t c) for every token (an int8 or bfloat16 pass first on
             large heads: without a bias, or with one in a bounded domain); on large heads without a
             bias, z = C^+ (w_k - c) too, in an int8 pass of its own where the int8 pass runs
3. interior  a closed-form convex combination for rows deep inside the hull
3a. min-norm  heads of at most 256 dimensions in R^d (after the LP of few dimensions and the
             origin's route below): without a bias a few Frank-Wolfe iterations for witnesses, then Wolfe's fully
             corrective minimum-norm method on the lifted rows (w_i, lambda b_i), a non-negative
             least squares on a pool of rows per round, priced against the whole head (corrective.py);
             wider heads run the same rounds after stage 5, for the tokens Frank-Wolfe and Newton leave
4. frank-wolfe  batched pairwise Frank-Wolfe on the min-norm problem (no bias), or on
             the domain's dual r ||w_k - sum alpha_i w_i|| + sum alpha_i (b_k - b_i) (balls,
             the norm domain included, and boxes with the l1 norm, with a bias; the
             unbounded domain with a bias on a ladder of large balls)
5. newton    maximum-entropy convex combinations by Newton's method (with a bias, leaning
             towards the rows of larger bias), and the point they are the smoothed leaders of as a
             witness where it beats every rival; its first part runs before Frank-Wolfe: without
             a bias, rows whose ray from a rival passes through the origin (a row swallowed by
             a longer copy of itself) take one sparse certificate of the origin, found once
             (anchor.py)
6. lp        constraint generation with HiGHS for whatever is left (Clarabel in a ball), then,
             for a token it has not decided in a few rounds, the LP over all rows
7. whatever no stage proved is ``inconclusive``, with the bounds found
8. sparsify  every convex certificate on more than D rows is reduced to at
             most D (Carathéodory; D = d + 1, d + 2 with a bias) and checked again

Heads of at most 8 dimensions (a polyhedral domain) run stage 6 right after stage 3: there the exact LP
takes a few pivots a token, and what it leaves (ties within the tolerance) goes through 4, 5 and 6.

Over z >= 0 (the nonneg domains) the stages are the ties, the orthant's screen (screen/orthant.py), the
exact LP (6) with z >= 0 and sparsify (8): _orthant_stages.

Each stage only proposes certificates; certify.py accepts or rejects them in
float64 (settle.py records what passes), so no stage can turn a guess into a verdict. stages.py runs
each stage and records what it proved; this module chooses which run, and in what order.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

import numpy as np
import torch

from auditor.engine import stages
from auditor.engine.arithmetic.head import build_engine_head, EngineHead
from auditor.engine.arithmetic.heap import release_free_pages
from auditor.engine.arithmetic.normal_form import NormalForm, normal_form, times_power_of_two, to_given_units
from auditor.engine.arithmetic.row_statistics import storage_dtype
from auditor.engine.decisions import UNDECIDED, Decisions, set_convex, spread_to_groups, undecided
from auditor.engine.options import EngineOptions
from auditor.engine.screen.ties import duplicate_groups
from auditor.engine.settle import CentreRoutes, sparsify
from auditor.engine.solvers import corrective
from auditor.question.domain import Domain

_DIRECT_LP_WIDTH = 8  # heads of at most this width go from the interior stage straight to the exact LP
_FEW_SHARE = 64  # at most 1/64 of the competitors requested: the few-token route (decide)
_NEVER = 1 << 62  # a head size no head reaches: switches the low-precision passes and whitened witnesses off
_NEAR_CENTRE = 0.1  # Mahalanobis distance from the centre within which a row first tries the routes around it
_SIMPLEX_REACH = 0.25  # times 1 / sqrt(D): the distance within which the centre's basis goes first

__all__ = ["EngineOptions", "decide"]


@dataclass
class _Prepared:
    """The head in its normal form on the engine's device, and the tokens to decide."""

    head: EngineHead
    form: NormalForm
    todo: np.ndarray  # the representatives of the requested tokens' groups
    few: bool  # a few tokens of a large head: nothing built for the whole head before it pays


def decide(weight: torch.Tensor, bias: torch.Tensor | None, ids: np.ndarray, domain: Domain,
           options: EngineOptions, progress: bool, row_error: torch.Tensor | None = None,
           bias_error: torch.Tensor | None = None, representative: np.ndarray | None = None) -> Decisions:
    """Decide tokens ``ids``. ``row_error`` / ``bias_error`` bound how far derived rows (the norm
    domain's reduced head) may be from the exact ones; convex certificates allow for them.
    ``representative`` gives the groups of tied rows when the caller knows them exactly (the
    norm domain); otherwise rows are tied when they are equal in value."""
    timings: dict[str, float] = {}
    clock = time.perf_counter()
    prepared = _prepare(weight, bias, ids, domain, options, row_error, bias_error, representative)
    del weight, bias
    head, todo = prepared.head, prepared.todo
    timings["ties"] = time.perf_counter() - clock

    out = undecided(head.representative, head.witness_centre.cpu().numpy(),
                    {"residual_tol": options.residual_tol,
                     "typical_spread": prepared.form.given_length(head.typical_spread),
                     "logit_error_factor": head.error_factor})
    if head.n_competitors == 1:  # one distinct row: it wins everywhere, against nobody
        stages.single_row(out, todo, head.d)
        todo = todo[:0]

    if head.domain.orthant:
        _orthant_stages(head, out, todo, options, progress, timings)
    else:
        _stages(head, out, todo, options, progress, timings, prepared.few)

    to_given_units(out, prepared.form, head)
    spread_to_groups(out, ids)
    out.timings = timings
    return out


def _stages(head: EngineHead, out: Decisions, todo: np.ndarray, options: EngineOptions, progress: bool,
            timings: dict[str, float], few: bool) -> None:
    """Stages 2 to 8 in R^d, balls and boxes."""
    clock = time.perf_counter()
    # the screen sees the head with both passes off (the same rows and facts; its sizes say "never")
    screened = (replace(head, bfloat16_entries=_NEVER, whitened_entries=_NEVER, int8_entries=_NEVER) if few
                else head)
    left, threat = stages.screen_stage(screened, out, todo, progress)
    timings["screen"] = time.perf_counter() - clock
    release_free_pages()  # the screen's blocks (here and after each stage that frees large arrays)

    clock = time.perf_counter()
    left, threat, routes = _near_centre(head, out, left, threat, options, few)
    left, threat = stages.interior_stage(head, out, left, threat)
    timings["interior"] = time.perf_counter() - clock

    _after_interior(head, out, left, threat, options, progress, timings)

    clock = time.perf_counter()
    sparsify(head, out, routes)
    timings["sparsify"] = time.perf_counter() - clock


def _orthant_stages(head: EngineHead, out: Decisions, todo: np.ndarray, options: EngineOptions, progress: bool,
                    timings: dict[str, float]) -> None:
    """z >= 0 (NonNeg): the orthant's screen, then the exact stage for what it leaves, then sparsify.

    The hull stages (interior, minimum-norm, Frank-Wolfe, Newton) certify w_k as a combination of rows,
    which over z >= 0 is more than needed (sum alpha_i w_i >= w_k suffices) and whose witnesses lie
    anywhere in R^d; the margin program with z >= 0 (lp.py) decides both ways from the first round."""
    clock = time.perf_counter()
    left, threat = stages.orthant_screen(head, out, todo, progress)
    timings["screen"] = time.perf_counter() - clock
    clock = time.perf_counter()
    leftovers = stages.Leftovers({int(k): [np.array([t])] for k, t in zip(left, threat)}, {}, {})
    stages.lp_stage(head, out, left, options, progress, leftovers)
    timings["lp"] = time.perf_counter() - clock
    clock = time.perf_counter()
    sparsify(head, out)
    timings["sparsify"] = time.perf_counter() - clock


def _prepare(weight: torch.Tensor, bias: torch.Tensor | None, ids: np.ndarray, domain: Domain, options: EngineOptions,
             row_error: torch.Tensor | None, bias_error: torch.Tensor | None,
             representative: np.ndarray | None) -> _Prepared:
    """The groups of tied rows, the normal form and the engine head built on it."""
    n = weight.shape[0]
    weight = weight.to(storage_dtype(weight))  # no copy for a float32 head
    if representative is None:
        representative = duplicate_groups(weight, bias)  # on the rows as given, before any rounding
    competitor = torch.as_tensor(representative == np.arange(n), device=weight.device)
    # A few tokens of a large head (a vocabulary's added rows): nothing is built for the whole head
    # before it pays for itself.
    # The bfloat16 pass (a copy of the head) and the whitened witnesses (its covariance) are left out of
    # the screen, and the rows it leaves first try the centre's basis (settle.CentreRoutes.direct: a pool
    # of 3D rows narrowed to 2D around the centre, and a basis on it), where a mean-initialised row takes a
    # few pivots; only the tokens still left go the whole way. (Not where a token may hold a witness and
    # convex weights at once, decide_at_tolerance off: there the whitened witnesses must go before any
    # convex certificate, as in the whole audit.)
    todo = np.unique(representative[ids])
    few = len(todo) * _FEW_SHARE <= int(competitor.sum()) and options.decide_at_tolerance
    # A float32 head stays as given, its power of two carried (normal_form's carry): the stages read it through
    # EngineHead (rows64, blocks, the screen's products, the bfloat16 copy, the steering products), so no scaled
    # copy of the whole head is made.
    form = normal_form(weight, bias, domain, competitor, row_error, bias_error, carry=True)
    head = build_engine_head(form.stored, form.bias, representative, form.domain, options.residual_tol,
                             form.row_error, form.bias_error, form.median, form.facts, form.stored_exponent)
    head.decide_at_tolerance = options.decide_at_tolerance
    head.bfloat16_entries, head.whitened_entries = options.bfloat16_entries, options.whitened_entries
    head.int8_entries = options.int8_entries
    if form.translation is not None:
        head.origin = times_power_of_two(-form.translation.to(torch.float64), form.weight_exponent)
    if row_error is None and bias_error is None and (form.row_error is not None or form.bias_error is not None):
        # exact numbers the normal form rounded (a translation, a shifted bias): kept for the rational
        # test of check_convex; otherwise the head's own rows are exact and no second copy stays alive
        head.exact_source = (weight, bias, domain)
    return _Prepared(head, form, todo, few)


def _near_centre(head: EngineHead, out: Decisions, left: np.ndarray, threat: np.ndarray, options: EngineOptions,
                 few: bool) -> tuple[np.ndarray, np.ndarray, CentreRoutes | None]:
    """The routes around the centre for the rows near it (mean-initialised rows), before the interior stage;
    returns the tokens left and the routes, let go (sparsify builds a basis again if it needs one)."""
    routes = None
    if few and len(left):
        routes = CentreRoutes(head)
        left, threat = stages.centre_first(routes, out, left, threat)
        if len(left):  # the whitened witnesses where the head's own size calls for them
            left, threat = stages.whitened_stage(head, out, left, threat, None)
    elif len(left) and head.bias is None and options.decide_at_tolerance and head.n_competitors > 3 * (head.d + 1):
        # The whole audit's mean-initialised rows: the same route, before the interior stage's dense
        # weights (a pass over the head and a float64 check of n rows a token, then a reduction) for rows
        # that a few pivots settle. Only where a token lies near the centre are the routes built at all
        # (and only on more than 3D rows: the routes draw a pool of 3D, on fewer the centre has no basis).
        distance = stages.centre_distance(head, left)
        near = distance <= _NEAR_CENTRE
        if near.any():
            routes = CentreRoutes(head)
            # rows well inside the basis' simplex take a few pivots; those further out (the inradius of a
            # simplex of D rows around the centre is at most about 1 / sqrt(D) in this metric) take the
            # centre pool's maximum-entropy weights and one elimination instead, as do the rows the pivots miss
            inner = near & (distance <= _SIMPLEX_REACH / math.sqrt(head.d + 1))
            stages.centre_first(routes, out, left[inner], threat[inner], routes.direct_pivots())
            outer = near & (out.verdict[left] == UNDECIDED)
            for k, found in routes.pooled(left[outer].tolist()).items():
                set_convex(out, k, *found, "interior")
            keep = out.verdict[left] == UNDECIDED
            left, threat = left[keep], threat[keep]
    if routes is not None:
        routes.let_go()  # the later stages' memory; sparsify builds a basis again if it needs one
        release_free_pages()
    return left, threat, routes


def _after_interior(head: EngineHead, out: Decisions, left: np.ndarray, threat: np.ndarray, options: EngineOptions,
                    progress: bool, timings: dict[str, float]) -> None:
    """The stages after the interior one, each on what the ones before it left; the exact LP last."""
    # The origin's route (part of the Newton stage) before Frank-Wolfe: the rows it settles lie just
    # inside the hull, where Frank-Wolfe only converges towards them and hands them on undecided.
    # In a few dimensions the exact LP takes a few pivots a token, far less than the iterative stages
    # spend on the crowded boundaries of low-rank heads (docs/performance.md, "Low-rank heads"): it
    # goes first there, and only what it leaves (tokens within the tolerance of a tie, whose
    # certificates rest on the tolerance) goes on to the iterative stages.
    clock = time.perf_counter()
    if len(left) and head.d <= _DIRECT_LP_WIDTH and head.domain.polyhedral and options.lp_rounds > 0:
        left, threat = stages.lp_first(head, out, left, threat, options, progress)
    lp_first = time.perf_counter() - clock
    clock = time.perf_counter()
    if len(left) and options.newton_iterations > 0:
        release_free_pages()
        left, threat = stages.anchored_stage(head, out, left, threat, options)
    rounds_first = options.min_norm_rounds > 0 and head.d <= corrective.WIDTH and not head.domain.bounded
    if len(left) and options.newton_iterations > 0 and not rounds_first:
        # rows near the centre on pools drawn around them; a low-rank head's rounds, which come first there,
        # price every row for each token at O(d^2) a round and take such rows as they come
        left, threat = stages.pooled_stage(head, out, left, threat)
    anchored = time.perf_counter() - clock
    clock = time.perf_counter()
    pools, quick = {}, 0.0
    if len(left) and rounds_first:
        if head.bias is None and options.frank_wolfe_iterations > 0 and stages.QUICK_ITERATIONS > 0:
            left, threat = stages.quick_witnesses(head, out, left, threat, progress)
        quick = time.perf_counter() - clock
        left, threat, pools = stages.min_norm_stage(head, out, left, threat, options, progress)
    timings["min_norm"] = time.perf_counter() - clock - quick

    clock = time.perf_counter()
    leftovers = stages.Leftovers({int(k): [np.array([t])] + ([pools[int(k)]] if int(k) in pools else [])
                                  for k, t in zip(left, threat)}, {}, {})
    if len(left) and options.frank_wolfe_iterations > 0:
        left = stages.frank_wolfe_stage(head, out, left, threat, options, progress, leftovers)
    timings["frank_wolfe"] = quick + time.perf_counter() - clock

    clock = time.perf_counter()
    if len(left) and options.newton_iterations > 0:
        left = stages.newton_stage(head, out, left, options, progress)
    timings["newton"] = anchored + time.perf_counter() - clock

    # Wider heads take the minimum-norm rounds too, but only for what Frank-Wolfe and Newton leave: there a
    # round's solve costs O(d^3) and most tokens never need one, while a token left here would otherwise go
    # to the exact LP, whose dense programs take seconds a round on a wide head (a row just outside a steep
    # spectrum's hull, 32768 x 512: 25 s in the LP, 2.7 s in the rounds; docs/performance.md).
    clock = time.perf_counter()
    if (len(left) and options.min_norm_rounds > 0 and head.d > corrective.WIDTH and corrective.LEFTOVERS
            and not head.domain.bounded):
        threat = np.array([int(leftovers.seeds[int(k)][0][0]) for k in left], dtype=np.int64)
        left, threat, pools = stages.min_norm_stage(head, out, left, threat, options, progress)
        for k, pool in pools.items():
            leftovers.seeds[int(k)].append(pool)
    timings["min_norm"] += time.perf_counter() - clock

    clock = time.perf_counter()
    if options.defer_flat and head.domain.bounded:
        left = stages.defer_flat(head, out, left, leftovers)
    stages.lp_stage(head, out, left, options, progress, leftovers)
    timings["lp"] = lp_first + time.perf_counter() - clock
