"""The engine's stage order: ``decide`` runs every requested token through the stages, cheapest first.

1. ties      exact duplicate rows become groups; one representative is decided
2. screen    one Gram pass checks z = s (w_k - t c) for every token (a bfloat16 pass first on large
             heads: without a bias, or with one in a bounded domain); on large heads without a
             bias, z = s C^+ (w_k - c) for the few left
3. interior  a closed-form convex combination for rows deep inside the hull
3a. min-norm  heads of at most 256 dimensions in R^d (after the LP of few dimensions and the
             origin's route below): without a bias a few Frank-Wolfe iterations for witnesses, then Wolfe's fully
             corrective minimum-norm method on the lifted rows (w_i, lambda b_i), a non-negative
             least squares on a pool of rows per round, priced against the whole head (corrective.py)
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

Each stage only proposes certificates; certify.py accepts or rejects them in
float64 (settle.py records what passes), so no stage can turn a guess into a verdict.
"""

from __future__ import annotations

import sys
import math
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from tqdm import tqdm

from auditor.domain import Ball, Domain
from auditor.engine import head as head_module
from auditor.engine.anchor import anchored_certificates
from auditor.engine import corrective
from auditor.engine.bounded_dual import bounded_dual
from auditor.engine.decisions import (ARGMAXABLE, INCONCLUSIVE, STAGES, UNDECIDED, Decisions, set_convex,
                                      set_witness, spread_to_groups, undecided)
from auditor.engine.frank_wolfe import frank_wolfe
from auditor.engine.head import EngineHead, build_engine_head, storage_dtype
from auditor.engine.heap import release_free_pages
from auditor.engine.interior import interior_certificates
from auditor.engine.lp import lp_decide_all
from auditor.engine.normal_form import normal_form, times_power_of_two, to_given_units
from auditor.engine.rounding import per_unit_norm, safe_norm
from auditor.engine.screen import screen, whitened_witnesses
from auditor.engine.settle import CentreRoutes, settle_dual, settle_frank_wolfe, sparsify
from auditor.engine.ties import duplicate_groups
from auditor.engine.tilt import tilted_certificates

_DUAL_FACTOR = 4
_QUICK_ITERATIONS = 16  # Frank-Wolfe iterations for witnesses before the minimum-norm rounds
_DIRECT_LP_WIDTH = 8  # heads of at most this width go from the interior stage straight to the exact LP
_FEW_SHARE = 64  # at most 1/64 of the competitors requested: the few-token route (decide)
_NEVER = 1 << 62  # a head size no head reaches: switches the low-precision passes and whitened witnesses off


@dataclass
class EngineOptions:
    frank_wolfe_iterations: int = 100
    newton_iterations: int = 40
    min_norm_rounds: int = 40  # rounds of the fully corrective minimum-norm method per token (corrective.py)
    lp_rounds: int = 10  # rounds of constraint generation per token before the LP over all rows (lp.py)
    residual_tol: float = 1e-10
    defer_flat: bool = False  # bounded domains: leave tokens whose dual value is zero up to the tolerance
    #                           inconclusive rather than solve an LP (the norm domain settles them in R^d)
    # a witness must lead by more than the tolerance a convex certificate may rest on (head.witness_lead),
    # so that no token can hold both and the verdict does not depend on which is found first; the
    # norm domain's reduced head, whose convex certificates also come from the head as given, does not
    decide_at_tolerance: bool = True
    # heads of at least this many entries (n d) are screened in bfloat16 first (low_precision.py), and,
    # without a bias, try whitened witnesses before Frank-Wolfe: below them neither pays for itself
    bfloat16_entries: int = field(default_factory=lambda: head_module.BFLOAT16_ENTRIES)
    whitened_entries: int = field(default_factory=lambda: head_module.WHITENED_ENTRIES)
    # heads without a bias of at least this many entries take the int8 pass instead of the bfloat16 one
    # where the device's int8 product is exact (integer_pass.py)
    int8_entries: int = field(default_factory=lambda: head_module.INT8_ENTRIES)


@dataclass
class _Leftovers:
    """What the stages hand on for the tokens they could not decide."""

    seeds: dict[int, list[np.ndarray]]  # rival rows for the LP to start from
    lower: dict[int, float]  # best margin found (bounded domains: of a witness; unbounded: unit-ball)
    upper: dict[int, float]  # no point leads by more (the dual value, or the distance to the hull)


def decide(weight: torch.Tensor, bias: torch.Tensor | None, ids: np.ndarray, domain: Domain,
           options: EngineOptions, progress: bool, row_error: torch.Tensor | None = None,
           bias_error: torch.Tensor | None = None, representative: np.ndarray | None = None) -> Decisions:
    """Decide tokens ``ids``. ``row_error`` / ``bias_error`` bound how far derived rows (the norm
    domain's reduced head) may be from the exact ones; convex certificates allow for them.
    ``representative`` gives the groups of tied rows when the caller knows them exactly (the
    norm domain); otherwise rows are tied when they are equal in value."""
    n = weight.shape[0]
    timings: dict[str, float] = {}
    clock = time.perf_counter()
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
    del weight, bias
    timings["ties"] = time.perf_counter() - clock

    out = undecided(representative, head.witness_centre.cpu().numpy(),
                    {"residual_tol": options.residual_tol,
                     "typical_spread": form.given_length(head.typical_spread),
                     "logit_error_factor": head.error_factor})
    if head.n_competitors == 1:  # one distinct row: it wins everywhere, against nobody
        _single_row(out, todo, head.d)
        todo = todo[:0]

    clock = time.perf_counter()
    # the screen sees the head with both passes off (the same rows and facts; its sizes say "never")
    left, threat = _screen(replace(head, bfloat16_entries=_NEVER, whitened_entries=_NEVER, int8_entries=_NEVER) if few else head,
                           out, todo, progress)
    timings["screen"] = time.perf_counter() - clock
    release_free_pages()  # the screen's blocks (here and after each stage that frees large arrays)

    clock = time.perf_counter()
    routes = None
    if few and len(left):
        routes = CentreRoutes(head)
        left, threat = _centre_first(routes, out, left, threat)
        if len(left):  # the whitened witnesses where the head's own size calls for them
            left, threat = _whitened(head, out, left, threat, None)
    elif len(left) and head.bias is None and options.decide_at_tolerance and head.n_competitors > 3 * (head.d + 1):
        # The whole audit's mean-initialised rows: the same route, before the interior stage's dense
        # weights (a pass over the head and a float64 check of n rows a token, then a reduction) for rows
        # that a few pivots settle. Only where a token lies near the centre are the routes built at all
        # (and only on more than 3D rows: the routes draw a pool of 3D, on fewer the centre has no basis).
        distance = _centre_distance(head, left)
        near = distance <= _NEAR_CENTRE
        if near.any():
            routes = CentreRoutes(head)
            # rows well inside the basis' simplex take a few pivots; those further out (the inradius of a
            # simplex of D rows around the centre is at most about 1 / sqrt(D) in this metric) take the
            # centre pool's maximum-entropy weights and one elimination instead, as do the rows the pivots miss
            inner = near & (distance <= _SIMPLEX_REACH / math.sqrt(head.d + 1))
            _centre_first(routes, out, left[inner], threat[inner], routes.direct_pivots())
            outer = near & (out.verdict[left] == UNDECIDED)
            for k, found in routes.pooled(left[outer].tolist()).items():
                set_convex(out, k, *found, "interior")
            keep = out.verdict[left] == UNDECIDED
            left, threat = left[keep], threat[keep]
    if routes is not None:
        routes.let_go()  # the later stages' memory; sparsify builds a basis again if it needs one
        release_free_pages()
    left, threat = _interior(head, out, left, threat)
    timings["interior"] = time.perf_counter() - clock

    # The origin's route (part of the Newton stage) before Frank-Wolfe: the rows it settles lie just
    # inside the hull, where Frank-Wolfe only converges towards them and hands them on undecided.
    # In a few dimensions the exact LP takes a few pivots a token, far less than the iterative stages
    # spend on the crowded boundaries of low-rank heads (docs/performance.md, "Low-rank heads"): it
    # goes first there, and only what it leaves (tokens within the tolerance of a tie, whose
    # certificates rest on the tolerance) goes on to the iterative stages.
    clock = time.perf_counter()
    if len(left) and head.d <= _DIRECT_LP_WIDTH and head.domain.polyhedral and options.lp_rounds > 0:
        left, threat = _lp_first(head, out, left, threat, options, progress)
    lp_first = time.perf_counter() - clock
    clock = time.perf_counter()
    if len(left) and options.newton_iterations > 0:
        release_free_pages()
        left, threat = _anchored(head, out, left, threat, options)
    anchored = time.perf_counter() - clock
    clock = time.perf_counter()
    pools, quick = {}, 0.0
    if (len(left) and options.min_norm_rounds > 0 and head.d <= corrective.WIDTH
            and not head.domain.bounded):
        if head.bias is None and options.frank_wolfe_iterations > 0 and _QUICK_ITERATIONS > 0:
            left, threat = _quick_witnesses(head, out, left, threat, progress)
        quick = time.perf_counter() - clock
        left, threat, pools = _min_norm(head, out, left, threat, options, progress)
    timings["min_norm"] = time.perf_counter() - clock - quick

    clock = time.perf_counter()
    leftovers = _Leftovers({int(k): [np.array([t])] + ([pools[int(k)]] if int(k) in pools else [])
                            for k, t in zip(left, threat)}, {}, {})
    if len(left) and options.frank_wolfe_iterations > 0:
        left = _frank_wolfe(head, out, left, threat, options, progress, leftovers)
    timings["frank_wolfe"] = quick + time.perf_counter() - clock

    clock = time.perf_counter()
    if len(left) and options.newton_iterations > 0:
        left = _newton(head, out, left, options, progress)
    timings["newton"] = anchored + time.perf_counter() - clock

    clock = time.perf_counter()
    if options.defer_flat and head.domain.bounded:
        left = _defer_flat(head, out, left, leftovers)
    _lp(head, out, left, options, progress, leftovers)
    timings["lp"] = lp_first + time.perf_counter() - clock

    clock = time.perf_counter()
    sparsify(head, out, routes)
    timings["sparsify"] = time.perf_counter() - clock

    to_given_units(out, form, head)
    spread_to_groups(out, ids)
    out.timings = timings
    return out


def _bar(total: int, desc: str, enabled: bool):
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not enabled or total == 0,
                leave=False, unit="tok", dynamic_ncols=True)


def _single_row(out: Decisions, todo: np.ndarray, d: int) -> None:
    out.verdict[todo] = ARGMAXABLE
    out.margin[todo] = np.inf
    out.stage[todo] = STAGES.index("single row")
    for k in todo.tolist():
        out.explicit_witness[k] = np.zeros(d)


def _screen(head: EngineHead, out: Decisions, todo: np.ndarray, progress: bool) -> tuple[np.ndarray, np.ndarray]:
    """Record the screen's formula witnesses; returns the tokens left and each one's strongest rival."""
    with _bar(len(todo), "screening", progress) as bar:
        screened = screen(head, todo, bar)
    won = screened.certified
    out.verdict[todo[won]] = ARGMAXABLE
    out.stage[todo[won]] = STAGES.index("screen")
    out.margin[todo[won]] = screened.margin[won]
    out.runner_up[todo[won]] = screened.runner_up[won]
    out.witness_shift[todo[won]] = screened.shift[won]
    out.witness_scale[todo[won]] = screened.scale[won]
    return _whitened(head, out, todo[~won], screened.threat[~won], screened.centred)


def _whitened(head: EngineHead, out: Decisions, left: np.ndarray, threat: np.ndarray, centred
              ) -> tuple[np.ndarray, np.ndarray]:
    """Record the whitened witnesses (screen.whitened_witnesses, where the head's size calls for them);
    returns the tokens left."""
    tried, witnesses, check = whitened_witnesses(head, left, centred)
    if check is not None:
        sizes = safe_norm(witnesses, dim=1).cpu().numpy()
        for j, row in enumerate(tried.tolist()):
            if check.certified[j]:  # the unbounded head without a bias quotes its margin on the unit ball
                margin = check.margin[j] if head.domain.bounded else per_unit_norm(check.margin[j], sizes[j], head.d)
                set_witness(out, int(left[row]), witnesses[j].cpu().numpy(), float(margin), int(check.runner_up[j]),
                            "screen")
        keep = out.verdict[left] == UNDECIDED
        left, threat = left[keep], threat[keep]
    return left, threat


def _centre_first(routes: CentreRoutes, out: Decisions, left: np.ndarray, threat: np.ndarray,
                  pivots: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Certificates on at most D rows straight from the bases around the centre (the few-token route, and
    the whole audit's rows near the centre with ``pivots``)."""
    for k in left.tolist():
        found = routes.direct(k) if pivots is None else routes.direct(k, pivots)
        if found is not None:
            set_convex(out, k, *found, "interior")
    keep = out.verdict[left] == UNDECIDED
    return left[keep], threat[keep]


_NEAR_CENTRE = 0.1  # Mahalanobis distance from the centre within which a row first tries the routes around it
_SIMPLEX_REACH = 0.25  # times 1 / sqrt(D): the distance within which the centre's basis goes first


def _centre_distance(head: EngineHead, ids: np.ndarray) -> np.ndarray:
    """Each token's distance from the centre in the metric of the head's covariance (mean-initialised rows:
    about sqrt(1e-9 d) in float32; rounded to bfloat16, about 0.03 at d = 2048)."""
    offsets = head.rows64(torch.as_tensor(ids, device=head.device)) - head.centre
    return ((offsets @ head.precision) * offsets).sum(dim=1).clamp(min=0).sqrt().cpu().numpy()


def _interior(head: EngineHead, out: Decisions, left: np.ndarray, threat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    for k, (indices, weights, residual, gap) in interior_certificates(head, left).items():
        set_convex(out, k, indices, weights, residual, gap, "interior")
    keep = out.verdict[left] == UNDECIDED
    return left[keep], threat[keep]


def _frank_wolfe(head: EngineHead, out: Decisions, left: np.ndarray, threat: np.ndarray, options: EngineOptions,
                 progress: bool, leftovers: _Leftovers) -> np.ndarray:
    """The min-norm problem without a bias, the domain's dual in a bounded domain, and otherwise
    (unbounded, with a bias) the dual on ever larger balls; returns the tokens left."""
    seeds, lower, upper = leftovers.seeds, leftovers.lower, leftovers.upper
    if head.bias is None:
        with _bar(len(left), "frank-wolfe", progress) as bar:
            outcomes = frank_wolfe(head, left, threat, options.frank_wolfe_iterations, bar)
        settle_frank_wolfe(head, out, left, outcomes, seeds, lower, upper)
        return left[out.verdict[left] == UNDECIDED]
    # Most dual iterations score only a working set of rivals (bounded_dual.py), a fraction of
    # an unbounded iteration's cost: it gets four times as many.
    iterations = _DUAL_FACTOR * options.frank_wolfe_iterations
    if head.domain.bounded:
        with _bar(len(left), "frank-wolfe (dual)", progress) as bar:
            outcomes = bounded_dual(head, left, threat, iterations, bar)
        settle_dual(head, out, left, outcomes, seeds, lower, upper)
        return left[out.verdict[left] == UNDECIDED]
    for radius in _homogenising_radii(head):
        if not len(left):
            break
        with _bar(len(left), f"frank-wolfe (ball {radius:.3g})", progress) as bar:
            outcomes = bounded_dual(head, left, threat, iterations, bar, domain=Ball(radius))
        settle_dual(head, out, left, outcomes, seeds, {}, {})  # bounds in a ball bound no margin in R^d
        keep = out.verdict[left] == UNDECIDED
        left, threat = left[keep], threat[keep]
    return left


def _homogenising_radii(head: EngineHead) -> list[float]:
    """Balls for the unbounded domain with a bias: from the radius at which the rows' typical
    spread makes logit differences of the bias's size, up by 64 twice (witnesses found in a ball
    hold in R^d; the last ball's weights are nearly the exact x = 0 certificate).

    Rows that are all one point (zero spread) make logit differences that do not depend on z:
    the bias alone decides, every ball gives the answer of R^d, and the unit ball is taken.
    """
    if head.typical_spread == 0:
        return [1.0]
    base = max(head.max_abs_bias, 1e-3 * head.typical_spread) / head.typical_spread
    return [4 * base, 256 * base, 16384 * base]


def _quick_witnesses(head: EngineHead, out: Decisions, left: np.ndarray, threat: np.ndarray, progress: bool
                     ) -> tuple[np.ndarray, np.ndarray]:
    """A few batched Frank-Wolfe iterations (no bias) for witnesses only, no weights polished: a token that
    wins at an early iterate costs a fraction of a round of the minimum-norm method, which must reach the
    nearest point before its direction separates. (With a bias the dual's first iterations found no
    cheaper witnesses than the rounds: docs/performance.md.)"""
    with _bar(len(left), "frank-wolfe (witnesses)", progress) as bar:
        outcomes = frank_wolfe(head, left, threat, _QUICK_ITERATIONS, bar)
    for outcome in outcomes:
        if not outcome.certified:
            outcome.support = outcome.support[:0]
    settle_frank_wolfe(head, out, left, outcomes, {}, {}, {})
    keep = out.verdict[left] == UNDECIDED
    return left[keep], threat[keep]


def _min_norm(head: EngineHead, out: Decisions, left: np.ndarray, threat: np.ndarray, options: EngineOptions,
              progress: bool) -> tuple[np.ndarray, np.ndarray, dict]:
    """Wolfe's fully corrective rounds (corrective.py); returns the tokens left and their last pools."""
    with _bar(len(left), "min-norm", progress) as bar:
        certificates, witnesses, pools = corrective.corrective_certificates(
            head, left, threat, rounds=options.min_norm_rounds, done=lambda k: bar.update(1))
    for k, (indices, weights, residual, gap) in certificates.items():
        set_convex(out, k, indices, weights, residual, gap, "min-norm")
    for k, found in witnesses.items():
        set_witness(out, k, found.witness, found.margin, found.runner_up, "min-norm")
    keep = out.verdict[left] == UNDECIDED
    return left[keep], threat[keep], pools


def _anchored(head: EngineHead, out: Decisions, left: np.ndarray, threat: np.ndarray, options: EngineOptions
              ) -> tuple[np.ndarray, np.ndarray]:
    for k, (indices, weights, residual, gap) in anchored_certificates(head, left, options.newton_iterations).items():
        set_convex(out, k, indices, weights, residual, gap, "newton")
    keep = out.verdict[left] == UNDECIDED
    return left[keep], threat[keep]


def _newton(head: EngineHead, out: Decisions, left: np.ndarray, options: EngineOptions, progress: bool) -> np.ndarray:
    witnesses = {}  # the points Newton runs to, where they beat every rival (checked like any witness)
    with _bar(len(left), "newton", progress) as bar:
        settled = tilted_certificates(head, left, options.newton_iterations, progress=bar, witnesses=witnesses)
    for k, (indices, weights, residual, gap) in settled.items():
        set_convex(out, k, indices, weights, residual, gap, "newton")
    for k, (witness, margin, runner_up) in witnesses.items():
        if out.verdict[k] == UNDECIDED:
            set_witness(out, k, witness, margin, runner_up, "newton")
    return left[out.verdict[left] == UNDECIDED]


def _defer_flat(head: EngineHead, out: Decisions, left: np.ndarray, leftovers: _Leftovers) -> np.ndarray:
    """Leave inconclusive the tokens whose dual value is zero up to the tolerance; returns the rest."""
    reach = head.domain.reach(head.d)
    upper, lower = leftovers.upper, leftovers.lower
    flat = np.array([upper.get(int(k), np.inf) <= head.residual_tolerance(int(k)) * reach for k in left], dtype=bool)
    for k in left[flat].tolist():
        out.verdict[k] = INCONCLUSIVE
        out.bounds[k] = (lower.get(k, -np.inf), upper[k])
    return left[~flat]


def _exact(head: EngineHead, out: Decisions, tokens: list[int], seeds: dict[int, np.ndarray], options: EngineOptions,
           progress: bool) -> dict:
    """Run the exact stage (lp.lp_decide_all) on ``tokens`` and record what it proves; returns every outcome."""
    with _bar(len(tokens), "exact LP", progress) as bar:
        results = lp_decide_all(head, tokens, seeds, options.lp_rounds, done=lambda k: bar.update(1))
    for k in tokens:
        result = results[k]
        if result.verdict == "argmaxable":
            set_witness(out, k, result.witness, result.margin, result.runner_up, "lp")
        elif result.verdict == "unargmaxable":
            set_convex(out, k, result.indices, result.weights, result.residual, result.bias_gap, "lp")
    return results


def _lp(head: EngineHead, out: Decisions, left: np.ndarray, options: EngineOptions, progress: bool,
        leftovers: _Leftovers) -> None:
    """The exact stage for every token left (lp.lp_decide_all: constraint generation, then the LP over all
    rows); what it cannot prove is inconclusive, with its bounds."""
    lower, upper = leftovers.lower, leftovers.upper
    tokens = left.tolist()
    results = _exact(head, out, tokens, {k: np.concatenate(leftovers.seeds[k]) for k in tokens}, options, progress)
    for k in tokens:
        result = results[k]
        if result.verdict is None:
            out.verdict[k] = INCONCLUSIVE
            out.bounds[k] = (max(result.margin, lower.get(k, -np.inf)),
                             min(result.residual, upper.get(k, np.inf)) if _upper_bounds_margin(head) else np.inf)


def _lp_first(head: EngineHead, out: Decisions, left: np.ndarray, threat: np.ndarray, options: EngineOptions,
              progress: bool) -> tuple[np.ndarray, np.ndarray]:
    """The exact stage before the iterative ones (few dimensions); returns the tokens it leaves."""
    tokens = left.tolist()
    _exact(head, out, tokens, {k: np.array([t]) for k, t in zip(tokens, threat.tolist())}, options, progress)
    keep = out.verdict[left] == UNDECIDED
    return left[keep], threat[keep]


def _upper_bounds_margin(head: EngineHead) -> bool:
    """Whether a convex certificate's residual is an upper bound on the margin.

    It is the dual value in a bounded domain and, without a bias, the distance
    to the hull (the unit-ball margin); with a bias in the unbounded domain the
    margin has no finite upper bound to quote.
    """
    return head.domain.bounded or head.bias is None
