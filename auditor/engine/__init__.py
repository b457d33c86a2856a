"""The engine: decides every requested token in stages, cheapest first.

1. ties      exact duplicate rows become groups; one representative is decided
2. screen    one Gram pass checks z = s (w_k - t c) for every token
3. interior  a closed-form convex combination for rows deep inside the hull
4. frank-wolfe  batched pairwise Frank-Wolfe on the min-norm problem (no bias), or on
             the domain's dual r ||w_k - sum alpha_i w_i|| + sum alpha_i (b_k - b_i) (balls,
             the norm domain included, and boxes with the l1 norm, with a bias; the
             unbounded domain with a bias on a ladder of large balls)
5. newton    maximum-entropy convex combinations by Newton's method (no bias)
6. lp        constraint generation with cvxpy for whatever is left
7. whatever no stage proved is ``inconclusive``, with the bounds found
8. sparsify  every convex certificate on more than D rows is reduced to at
             most D (Carathéodory; D = d + 1, d + 2 with a bias) and checked again

Each stage only proposes certificates; certify.py accepts or rejects them in
float64, so no stage can turn a guess into a verdict.
"""

from __future__ import annotations

import math
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm import tqdm

from auditor.domain import Ball, Domain
from auditor.engine.caratheodory import Pool, from_pool, reduce_support
from auditor.engine.bounded_dual import bounded_dual
from auditor.engine.certify import check_convex, check_witnesses, check_witnesses_sharpened
from auditor.engine.frank_wolfe import frank_wolfe
from auditor.engine.head import EngineHead, build_engine_head, storage_dtype
from auditor.engine.interior import interior_certificates
from auditor.engine.lp import lp_decide, polish
from auditor.engine.normal_form import NormalForm, _power, normal_form
from auditor.engine.screen import screen
from auditor.engine.ties import duplicate_groups
from auditor.engine.tilt import tilted_certificates

UNDECIDED, ARGMAXABLE, UNARGMAXABLE, TIED, INCONCLUSIVE = range(5)
VERDICT_NAMES = ("undecided", "argmaxable", "unargmaxable", "tied", "inconclusive")
_DUAL_FACTOR = 4
STAGES = ("", "single row", "screen", "interior", "frank-wolfe", "lp", "unbounded hull", "newton", "ceiling")


@dataclass
class EngineOptions:
    frank_wolfe_iterations: int = 100
    newton_iterations: int = 40
    lp_rounds: int = 30
    residual_tol: float = 1e-10
    defer_flat: bool = False  # bounded domains: leave tokens whose dual value is zero up to the tolerance
    #                           inconclusive rather than solve an LP (the norm domain settles them in R^d)


@dataclass
class Decisions:
    """Per-token verdicts and certificates, indexed by token id (length n arrays)."""

    verdict: np.ndarray  # int8 codes, VERDICT_NAMES
    margin: np.ndarray  # float64, nan where it does not apply
    runner_up: np.ndarray  # int64, -1 where unknown
    stage: np.ndarray  # int8 index into STAGES
    witness_shift: np.ndarray  # witness = scale * (w_k - shift * centre) unless explicit
    witness_scale: np.ndarray  # nan where there is no formula witness
    representative: np.ndarray
    centre: np.ndarray
    explicit_witness: dict[int, np.ndarray] = field(default_factory=dict)
    convex: dict[int, tuple[np.ndarray, np.ndarray, float, float]] = field(default_factory=dict)
    bounds: dict[int, tuple[float, float]] = field(default_factory=dict)
    group_verdict: dict[int, int] = field(default_factory=dict)  # tied token -> its group's verdict code
    ceiling: dict[int, tuple[float, float, np.ndarray]] = field(default_factory=dict)  # k -> (lower, upper, point)
    timings: dict[str, float] = field(default_factory=dict)
    tolerances: dict[str, float] = field(default_factory=dict)


def _bar(total: int, desc: str, enabled: bool):
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not enabled or total == 0,
                leave=False, unit="tok", dynamic_ncols=True)


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
    form = normal_form(weight, bias, domain, competitor, row_error, bias_error)
    head = build_engine_head(form.weight, form.bias, representative, form.domain, options.residual_tol,
                             form.row_error, form.bias_error)
    if row_error is None and bias_error is None and (form.row_error is not None or form.bias_error is not None):
        # exact numbers the normal form rounded (a translation, a shifted bias): kept for the rational
        # test of check_convex; otherwise the head's own rows are exact and no second copy stays alive
        head.exact_source = (weight, bias, domain)
    del weight, bias
    timings["ties"] = time.perf_counter() - clock

    out = Decisions(
        verdict=np.zeros(n, dtype=np.int8), margin=np.full(n, np.nan), runner_up=np.full(n, -1, dtype=np.int64),
        stage=np.zeros(n, dtype=np.int8), witness_shift=np.zeros(n), witness_scale=np.full(n, np.nan),
        representative=representative, centre=head.witness_centre.cpu().numpy(),
        tolerances={"residual_tol": options.residual_tol,
                    "typical_spread": head.typical_spread * _power(-form.weight_exponent),
                    "logit_error_factor": head.error_factor},
    )
    todo = np.unique(representative[ids])

    if head.n_competitors == 1:  # one distinct row: it wins everywhere, against nobody
        out.verdict[todo] = ARGMAXABLE
        out.margin[todo] = np.inf
        out.stage[todo] = STAGES.index("single row")
        for k in todo.tolist():
            out.explicit_witness[k] = np.zeros(head.d)
        todo = todo[:0]

    clock = time.perf_counter()
    with _bar(len(todo), "screening", progress) as bar:
        screened = screen(head, todo, bar)
    won = screened.certified
    out.verdict[todo[won]] = ARGMAXABLE
    out.stage[todo[won]] = STAGES.index("screen")
    out.margin[todo[won]] = screened.margin[won]
    out.runner_up[todo[won]] = screened.runner_up[won]
    out.witness_shift[todo[won]] = screened.shift[won]
    out.witness_scale[todo[won]] = screened.scale[won]
    left, threat = todo[~won], screened.threat[~won]
    timings["screen"] = time.perf_counter() - clock

    clock = time.perf_counter()
    for k, (indices, weights, residual, gap) in interior_certificates(head, left).items():
        _set_convex(out, k, indices, weights, residual, gap, "interior")
    keep = out.verdict[left] == UNDECIDED
    left, threat = left[keep], threat[keep]
    timings["interior"] = time.perf_counter() - clock

    clock = time.perf_counter()
    seeds: dict[int, list[np.ndarray]] = {int(k): [np.array([t])] for k, t in zip(left, threat)}
    lower: dict[int, float] = {}
    upper: dict[int, float] = {}
    if head.bias is None and len(left) and options.frank_wolfe_iterations > 0:
        with _bar(len(left), "frank-wolfe", progress) as bar:
            outcomes = frank_wolfe(head, left, threat, options.frank_wolfe_iterations, bar)
        _settle_frank_wolfe(head, out, left, outcomes, seeds, lower, upper)
        keep = out.verdict[left] == UNDECIDED
        left, threat = left[keep], threat[keep]
    elif head.domain.bounded and len(left) and options.frank_wolfe_iterations > 0:
        with _bar(len(left), "frank-wolfe (dual)", progress) as bar:
            # Most dual iterations score only a working set of rivals (bounded_dual.py), a fraction of
            # an unbounded iteration's cost: it gets four times as many.
            outcomes = bounded_dual(head, left, threat, _DUAL_FACTOR * options.frank_wolfe_iterations, bar)
        _settle_dual(head, out, left, outcomes, seeds, lower, upper)
        keep = out.verdict[left] == UNDECIDED
        left, threat = left[keep], threat[keep]
    elif len(left) and options.frank_wolfe_iterations > 0:  # unbounded, with a bias: ever larger balls
        for radius in _homogenising_radii(head):
            if not len(left):
                break
            with _bar(len(left), f"frank-wolfe (ball {radius:.3g})", progress) as bar:
                outcomes = bounded_dual(head, left, threat, _DUAL_FACTOR * options.frank_wolfe_iterations, bar,
                                        domain=Ball(radius))
            _settle_dual(head, out, left, outcomes, seeds, {}, {})
            keep = out.verdict[left] == UNDECIDED
            left, threat = left[keep], threat[keep]
    timings["frank_wolfe"] = time.perf_counter() - clock

    clock = time.perf_counter()
    if head.bias is None and len(left) and options.newton_iterations > 0:
        with _bar(len(left), "newton", progress) as bar:
            settled = tilted_certificates(head, left, options.newton_iterations, progress=bar)
        for k, (indices, weights, residual, gap) in settled.items():
            _set_convex(out, k, indices, weights, residual, gap, "newton")
        left = left[out.verdict[left] == UNDECIDED]
    timings["newton"] = time.perf_counter() - clock

    clock = time.perf_counter()
    if options.defer_flat and head.domain.bounded:
        reach = head.domain.reach(head.d)
        flat = np.array([upper.get(int(k), np.inf) <= head.residual_tolerance(int(k)) * reach for k in left], dtype=bool)
        for k in left[flat].tolist():
            out.verdict[k] = INCONCLUSIVE
            out.bounds[k] = (lower.get(k, -np.inf), upper[k])
        left = left[~flat]
    with _bar(len(left), "exact LP", progress) as bar:
        for k in left.tolist():
            result = lp_decide(head, k, np.concatenate(seeds[k]), max_rounds=options.lp_rounds)
            if result.verdict == "argmaxable":
                _set_witness(out, k, result.witness, result.margin, result.runner_up, "lp")
            elif result.verdict == "unargmaxable":
                _set_convex(out, k, result.indices, result.weights, result.residual, result.bias_gap, "lp")
            else:
                out.verdict[k] = INCONCLUSIVE
                out.bounds[k] = (max(result.margin, lower.get(k, -np.inf)),
                                 min(result.residual, upper.get(k, np.inf)) if _upper_bounds_margin(head) else np.inf)
            bar.update(1)
    timings["lp"] = time.perf_counter() - clock

    clock = time.perf_counter()
    _sparsify(head, out)
    timings["sparsify"] = time.perf_counter() - clock

    _unscale(out, form, head)
    _spread_to_groups(out, ids)
    out.timings = timings
    return out


def _upper_bounds_margin(head: EngineHead) -> bool:
    """Whether a convex certificate's residual is an upper bound on the margin.

    It is the dual value in a bounded domain and, without a bias, the distance
    to the hull (the unit-ball margin); with a bias in the unbounded domain the
    margin has no finite upper bound to quote.
    """
    return head.domain.bounded or head.bias is None


def _unscale(out: Decisions, form: NormalForm, head: EngineHead) -> None:
    """Report margins, residuals, witnesses and the centre in the units of the head as given.

    The normal form's logits are 2^c times the given ones, its rows 2^a times the given
    (translated) rows, and its point y is the point z = 2^(a - c) y (normal_form.py).
    """
    a, c = form.weight_exponent, form.logit_exponent

    def times(x, e):  # x 2^e in two exact steps: 2^e alone may not be a float64 (2^1024)
        return x * math.ldexp(1.0, e // 2) * math.ldexp(1.0, e - e // 2)

    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        out.margin = times(out.margin, -c)
    for k in list(out.explicit_witness):
        out.explicit_witness[k] = times(out.explicit_witness[k], a - c)
    # The formula witness s (w_k - t c) refers to the rows as given: z = 2^(a-c) s 2^a (w_k - t c)
    # takes the scale 2^(2a-c) s. Where that leaves the normal float range, or the rows were
    # translated (the formula's rows are then not the given ones), store the very point checked.
    with np.errstate(over="ignore", under="ignore"):
        scaled = times(out.witness_scale, 2 * a - c)
    normal = ~np.isfinite(out.witness_scale) | (np.isfinite(scaled) & (np.abs(scaled) >= np.finfo(np.float64).tiny))
    if form.translation is not None:
        normal = ~np.isfinite(out.witness_scale)
    for k in np.nonzero(~normal)[0].tolist():
        row = head.rows64([k])[0]
        direction = row - out.witness_shift[k] * head.witness_centre if out.witness_shift[k] else row
        out.explicit_witness[k] = times((direction * float(out.witness_scale[k])).cpu().numpy(), a - c)
        scaled[k] = np.nan
    out.witness_scale = scaled
    out.centre = times(out.centre, -a)
    if form.translation is not None:
        out.centre = out.centre + form.translation.cpu().numpy()
    residual_unit = -c if head.domain.bounded else -a
    for k, (indices, weights, residual, gap) in out.convex.items():
        out.convex[k] = (indices, weights, times(residual, residual_unit), times(gap, -c))
    for k, (lower, upper) in out.bounds.items():
        out.bounds[k] = (times(lower, -c), times(upper, -c if head.domain.bounded or head.bias is None else -a))


def _set_witness(out: Decisions, k: int, witness: np.ndarray, margin: float, runner_up: int, stage: str) -> None:
    out.verdict[k] = ARGMAXABLE
    out.explicit_witness[k] = witness
    out.margin[k] = margin
    out.runner_up[k] = runner_up
    out.stage[k] = STAGES.index(stage)


def _set_convex(out: Decisions, k: int, indices, weights, residual: float, gap: float, stage: str) -> None:
    out.verdict[k] = UNARGMAXABLE
    weights = np.asarray(weights, dtype=np.float64)
    weights = weights / weights.sum()  # the check was about alpha / sum(alpha); report exactly that
    order = np.argsort(-weights, kind="stable")  # largest weights first: the main competitors
    out.convex[k] = (np.asarray(indices)[order], np.asarray(weights)[order], float(residual), float(gap))
    out.stage[k] = STAGES.index(stage)


def _sparsify(head: EngineHead, out: Decisions) -> None:
    """Replace every convex certificate on more than D rows by one on at most D (caratheodory.py).

    The reduced weights must pass the same float64 check (re-solved on their
    support by lp.polish when they do not at first); where they still fail, the
    dense certificate stands. A full reduction leaves a pool of at most 2D rows
    around the point it reproduced. Later certificates of the interior stage
    (mean-initialised rows all sit at the centre) move their bulk onto the
    pool's rows and are reduced by one elimination instead
    (caratheodory.from_pool).
    """
    dim = head.d + (2 if head.bias is not None else 1)
    pools: list[Pool] = []
    for k, (indices, weights, _, _) in list(out.convex.items()):
        if indices.size <= dim:
            continue
        found = None
        near_centre = out.stage[k] == STAGES.index("interior")  # Newton's rows sit near the boundary
        for pool in pools if near_centre else []:
            reduced = from_pool(head, pool, k, indices, weights)
            if reduced is not None and reduced[0].size <= dim:
                check = check_convex(head, k, *reduced)
                if check.accepted:
                    found = (*reduced, check)
                    break
        if found is None:
            support, alpha, pool = reduce_support(head, indices, weights)
            if near_centre:
                pools = [pool] + pools[:_POOLS - 1]
            check = check_convex(head, k, support, alpha)
            if not check.accepted:
                support, alpha, check = polish(head, k, support, alpha)
            if not (check.accepted and support.size <= dim):
                continue
            found = support, alpha, check
        support, alpha, check = found
        _set_convex(out, k, support, alpha, check.residual, check.bias_gap, STAGES[int(out.stage[k])])


_POOLS = 2  # pools kept, newest first


def _settle_frank_wolfe(head: EngineHead, out: Decisions, ids: np.ndarray, outcomes, seeds, lower, upper) -> None:
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
                _set_witness(out, k, witnesses[row], margin, int(check.runner_up[row]), "frank-wolfe")
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
                _set_convex(out, k, indices, weights, check.residual, check.bias_gap, "frank-wolfe")
                continue
            seeds[k].append(outcome.support)


def _homogenising_radii(head: EngineHead) -> list[float]:
    """Balls for the unbounded domain with a bias: from the radius at which the rows' typical
    spread makes logit differences of the bias's size, up by 64 twice (witnesses found in a ball
    hold in R^d; the last ball's weights are nearly the exact x = 0 certificate)."""
    base = max(head.max_abs_bias, 1e-3 * head.typical_spread) / max(head.typical_spread, 1e-300)
    return [4 * base, 256 * base, 16384 * base]


def _settle_dual(head: EngineHead, out: Decisions, ids: np.ndarray, outcomes, seeds, lower, upper) -> None:
    """Accept the dual's witnesses after a float64 check, and its weights after lp.polish (which
    tries them as they are first); record the bounds in a bounded domain."""
    won = [j for j, o in enumerate(outcomes) if o.certified]
    if won:
        witnesses = torch.as_tensor(np.stack([outcomes[j].witness for j in won]), device=head.device)
        check = check_witnesses_sharpened(head, ids[won], witnesses)
        for row, j in enumerate(won):
            if check.certified[row]:
                _set_witness(out, int(ids[j]), outcomes[j].witness, float(check.margin[row]),
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
                _set_convex(out, k, indices, weights, check.residual, check.bias_gap, "frank-wolfe")
                continue
            seeds[k].append(outcome.support)


def _spread_to_groups(out: Decisions, ids: np.ndarray) -> None:
    """Give every requested token its representative's answer; duplicates become ``tied``.

    A representative that was decided only on behalf of its group, but was not
    itself requested, goes back to undecided.
    """
    rep = out.representative
    requested = np.zeros(rep.shape[0], dtype=bool)
    requested[ids] = True
    duplicated = np.bincount(rep, minlength=rep.shape[0])[rep] > 1
    for k in np.nonzero(requested & duplicated)[0].tolist():
        r = int(rep[k])
        out.group_verdict[k] = int(out.verdict[r])
        if k == r:
            continue
        for array in (out.margin, out.runner_up, out.stage, out.witness_shift, out.witness_scale):
            array[k] = array[r]
        for table in (out.explicit_witness, out.convex, out.bounds):
            if r in table:
                table[k] = table[r]
    for k in np.nonzero(~requested & (out.verdict != UNDECIDED))[0].tolist():
        out.verdict[k] = UNDECIDED
        out.margin[k], out.runner_up[k], out.stage[k], out.witness_scale[k] = np.nan, -1, 0, np.nan
        for table in (out.explicit_witness, out.convex, out.bounds):
            table.pop(k, None)
    for k in out.group_verdict:
        out.verdict[k] = TIED
