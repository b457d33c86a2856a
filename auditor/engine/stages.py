"""Each stage's call and what it records: the tokens it proves go into the ``Decisions``, the rest are handed on.

pipeline.py chooses which stages run and in what order; each function here runs one of them on the
tokens still left (``left``, with each one's strongest rival ``threat``), records what it proved
(``set_witness``, ``set_convex``, or settle.py for Frank-Wolfe's and the dual's outcomes) and returns the
tokens it left. Each stage only proposes: what it records passed the float64 checks of certify.py (the
screen's formula witnesses, the bound of its own certified pass).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass

import numpy as np
import torch
from tqdm import tqdm

from auditor.engine.arithmetic.head import EngineHead
from auditor.engine.arithmetic.rounding import per_unit_norm, safe_norm
from auditor.engine.decisions import ARGMAXABLE, INCONCLUSIVE, STAGES, UNDECIDED, Decisions, set_convex, set_witness
from auditor.engine.exact.caratheodory import lifted_dimension
from auditor.engine.exact.certify import check_witnesses_sharpened
from auditor.engine.exact.constraint_generation import lp_decide_all
from auditor.engine.exact.pools import drawn_pools_fit
from auditor.engine.options import EngineOptions
from auditor.engine.screen import orthant
from auditor.engine.screen.gram import screen
from auditor.engine.screen.whitened import whitened_witnesses
from auditor.engine.settle import CentreRoutes, settle_dual, settle_frank_wolfe
from auditor.engine.solvers import corrective
from auditor.engine.solvers.anchor import anchored_certificates
from auditor.engine.solvers.bounded_dual import bounded_dual
from auditor.engine.solvers.frank_wolfe import frank_wolfe
from auditor.engine.solvers.interior import interior_certificates
from auditor.engine.solvers.tilt import pooled_certificates, tilted_certificates
from auditor.question.domain import Ball

_DUAL_FACTOR = 4
QUICK_ITERATIONS = 16  # Frank-Wolfe iterations for witnesses before the minimum-norm rounds


@dataclass
class Leftovers:
    """What the stages hand on for the tokens they could not decide."""

    seeds: dict[int, list[np.ndarray]]  # rival rows for the LP to start from
    lower: dict[int, float]  # best margin found (bounded domains: of a witness; unbounded: unit-ball)
    upper: dict[int, float]  # no point leads by more (the dual value, or the distance to the hull)



def progress_bar(total: int, desc: str, enabled: bool):
    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not enabled or total == 0,
                leave=False, unit="tok", dynamic_ncols=True)


def single_row(out: Decisions, todo: np.ndarray, d: int) -> None:
    out.verdict[todo] = ARGMAXABLE
    out.margin[todo] = np.inf
    out.stage[todo] = STAGES.index("single row")
    for k in todo.tolist():
        out.explicit_witness[k] = np.zeros(d)


_ORTHANT_BLOCK = 1 << 12  # tokens whose candidates are formed at once (B x d float64 each)


def orthant_screen(head: EngineHead, out: Decisions, todo: np.ndarray,
                   progress: bool) -> tuple[np.ndarray, np.ndarray]:
    """z >= 0: check each token's candidate witnesses (screen/orthant.py) against every row and record the
    certified ones; returns the tokens left and each one's strongest rival at its first candidate."""
    threat = np.full(len(todo), -1, dtype=np.int64)
    with progress_bar(len(todo), "screening", progress) as bar:
        for start in range(0, len(todo), _ORTHANT_BLOCK):
            ids = todo[start:start + _ORTHANT_BLOCK]
            for Z in orthant.candidates(head, ids):
                pending = (out.verdict[ids] == UNDECIDED) & (Z.abs().amax(dim=1) > 0).cpu().numpy()
                if head.bias is not None:
                    pending = out.verdict[ids] == UNDECIDED  # z = 0 may win on the bias alone
                if not pending.any():
                    continue
                at = np.flatnonzero(pending)
                witnesses = Z[torch.as_tensor(at, device=Z.device)]
                check = check_witnesses_sharpened(head, ids[at], witnesses)
                quoted = check.margin
                if head.bias is None and not head.domain.bounded:  # per unit of ||z||, as every unbounded margin
                    quoted = per_unit_norm(check.margin, safe_norm(witnesses.cpu(), dim=1).numpy(), head.d)
                for row, j in enumerate(at.tolist()):
                    if check.certified[row]:
                        set_witness(out, int(ids[j]), witnesses[row].cpu().numpy(), float(quoted[row]),
                                    int(check.runner_up[row]), "screen")
                    elif threat[start + j] < 0:
                        threat[start + j] = int(check.runner_up[row])
            bar.update(len(ids))
    keep = out.verdict[todo] == UNDECIDED
    return todo[keep], threat[keep]


def screen_stage(head: EngineHead, out: Decisions, todo: np.ndarray, progress: bool) -> tuple[np.ndarray, np.ndarray]:
    """Record the screen's formula witnesses; returns the tokens left and each one's strongest rival."""
    with progress_bar(len(todo), "screening", progress) as bar:
        screened = screen(head, todo, bar)
    won = screened.certified
    out.verdict[todo[won]] = ARGMAXABLE
    out.stage[todo[won]] = STAGES.index("screen")
    out.margin[todo[won]] = screened.margin[won]
    out.runner_up[todo[won]] = screened.runner_up[won]
    out.witness_shift[todo[won]] = screened.shift[won]
    out.witness_scale[todo[won]] = screened.scale[won]
    priced = screened.whitened
    if priced is None:
        return whitened_stage(head, out, todo[~won], screened.threat[~won], screened.centred)
    # the whitened witnesses the int8 pass proved, then the float64 check of its close calls
    _record_witnesses(head, out, todo[priced.proved], priced.witnesses, priced.margin, priced.runner_up)
    open_calls = out.verdict[todo[priced.close]] == UNDECIDED  # not proved by the float32 pass meanwhile
    close, witnesses = todo[priced.close][open_calls], priced.close_witnesses[torch.as_tensor(open_calls)]
    if close.size:
        check = check_witnesses_sharpened(head, close, witnesses)
        _record_witnesses(head, out, close[check.certified], witnesses[torch.as_tensor(check.certified)],
                          check.margin[check.certified], check.runner_up[check.certified])
    left = todo[~won]
    keep = out.verdict[left] == UNDECIDED
    return left[keep], screened.threat[~won][keep]


def _record_witnesses(head: EngineHead, out: Decisions, ids: np.ndarray, witnesses: torch.Tensor,
                      margin: np.ndarray, runner_up: np.ndarray) -> None:
    """Record proved explicit witnesses; the unbounded head without a bias quotes its margin on the unit ball."""
    rows = witnesses.cpu().numpy()
    quoted = (np.asarray(margin, dtype=np.float64) if head.domain.bounded or head.bias is not None
              else per_unit_norm(margin, safe_norm(witnesses, dim=1).cpu().numpy(), head.d))
    for j, k in enumerate(ids.tolist()):
        set_witness(out, int(k), rows[j], float(quoted[j]), int(runner_up[j]), "screen")


def whitened_stage(head: EngineHead, out: Decisions, left: np.ndarray, threat: np.ndarray, centred
              ) -> tuple[np.ndarray, np.ndarray]:
    """Record the whitened witnesses (whitened.whitened_witnesses, where the head's size calls for them);
    returns the tokens left."""
    tried, witnesses, check = whitened_witnesses(head, left, centred)
    if check is not None:
        at = np.nonzero(check.certified)[0]
        chosen = witnesses[torch.as_tensor(at, device=witnesses.device)]
        # the unbounded head without a bias quotes its margin on the unit ball
        quoted = (check.margin[at] if head.domain.bounded
                  else per_unit_norm(check.margin[at], safe_norm(chosen, dim=1).cpu().numpy(), head.d))
        rows = chosen.cpu().numpy()
        for j, row in enumerate(tried[at].tolist()):
            set_witness(out, int(left[row]), rows[j], float(quoted[j]), int(check.runner_up[at[j]]), "screen")
        keep = out.verdict[left] == UNDECIDED
        left, threat = left[keep], threat[keep]
    return left, threat


def centre_first(routes: CentreRoutes, out: Decisions, left: np.ndarray, threat: np.ndarray,
                  pivots: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Certificates on at most D rows straight from the bases around the centre (the few-token route, and
    the whole audit's rows near the centre with ``pivots``)."""
    for k in left.tolist():
        found = routes.direct(k) if pivots is None else routes.direct(k, pivots)
        if found is not None:
            set_convex(out, k, *found, "interior")
    keep = out.verdict[left] == UNDECIDED
    return left[keep], threat[keep]


def centre_distance(head: EngineHead, ids: np.ndarray) -> np.ndarray:
    """Each token's distance from the centre in the metric of the head's covariance (mean-initialised rows:
    about sqrt(1e-9 d) in float32; rounded to bfloat16, about 0.03 at d = 2048)."""
    offsets = head.rows64(torch.as_tensor(ids, device=head.device)) - head.centre
    return ((offsets @ head.precision) * offsets).sum(dim=1).clamp(min=0).sqrt().cpu().numpy()


def interior_stage(head: EngineHead, out: Decisions, left: np.ndarray, threat: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    for k, (indices, weights, residual, gap) in interior_certificates(head, left).items():
        set_convex(out, k, indices, weights, residual, gap, "interior")
    keep = out.verdict[left] == UNDECIDED
    return left[keep], threat[keep]


def frank_wolfe_stage(head: EngineHead, out: Decisions, left: np.ndarray, threat: np.ndarray, options: EngineOptions,
                 progress: bool, leftovers: Leftovers) -> np.ndarray:
    """The min-norm problem without a bias, the domain's dual in a bounded domain, and otherwise
    (unbounded, with a bias) the dual on ever larger balls; returns the tokens left."""
    seeds, lower, upper = leftovers.seeds, leftovers.lower, leftovers.upper
    if head.bias is None:
        with progress_bar(len(left), "frank-wolfe", progress) as bar:
            outcomes = frank_wolfe(head, left, threat, options.frank_wolfe_iterations, bar)
        settle_frank_wolfe(head, out, left, outcomes, seeds, lower, upper)
        return left[out.verdict[left] == UNDECIDED]
    # Most dual iterations score only a working set of rivals (bounded_dual.py), a fraction of
    # an unbounded iteration's cost: it gets four times as many.
    iterations = _DUAL_FACTOR * options.frank_wolfe_iterations
    if head.domain.bounded:
        with progress_bar(len(left), "frank-wolfe (dual)", progress) as bar:
            outcomes = bounded_dual(head, left, threat, iterations, bar)
        settle_dual(head, out, left, outcomes, seeds, lower, upper)
        return left[out.verdict[left] == UNDECIDED]
    for radius in homogenising_radii(head):
        if not len(left):
            break
        with progress_bar(len(left), f"frank-wolfe (ball {radius:.3g})", progress) as bar:
            outcomes = bounded_dual(head, left, threat, iterations, bar, domain=Ball(radius))
        settle_dual(head, out, left, outcomes, seeds, {}, {})  # bounds in a ball bound no margin in R^d
        keep = out.verdict[left] == UNDECIDED
        left, threat = left[keep], threat[keep]
    return left


def homogenising_radii(head: EngineHead) -> list[float]:
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


def quick_witnesses(head: EngineHead, out: Decisions, left: np.ndarray, threat: np.ndarray, progress: bool
                     ) -> tuple[np.ndarray, np.ndarray]:
    """A few batched Frank-Wolfe iterations (no bias) for witnesses only, no weights polished: a token that
    wins at an early iterate costs a fraction of a round of the minimum-norm method, which must reach the
    nearest point before its direction separates. (With a bias the dual's first iterations found no
    cheaper witnesses than the rounds: docs/performance.md.)"""
    with progress_bar(len(left), "frank-wolfe (witnesses)", progress) as bar:
        outcomes = frank_wolfe(head, left, threat, QUICK_ITERATIONS, bar)
    for outcome in outcomes:
        if not outcome.certified:
            outcome.support = outcome.support[:0]
    settle_frank_wolfe(head, out, left, outcomes, {}, {}, {})
    keep = out.verdict[left] == UNDECIDED
    return left[keep], threat[keep]


def min_norm_stage(head: EngineHead, out: Decisions, left: np.ndarray, threat: np.ndarray, options: EngineOptions,
              progress: bool) -> tuple[np.ndarray, np.ndarray, dict]:
    """Wolfe's fully corrective rounds (corrective.py); returns the tokens left and their last pools."""
    with progress_bar(len(left), "min-norm", progress) as bar:
        certificates, witnesses, pools = corrective.corrective_certificates(
            head, left, threat, rounds=options.min_norm_rounds, done=lambda k: bar.update(1))
    for k, (indices, weights, residual, gap) in certificates.items():
        set_convex(out, k, indices, weights, residual, gap, "min-norm")
    for k, found in witnesses.items():
        set_witness(out, k, found.witness, found.margin, found.runner_up, "min-norm")
    keep = out.verdict[left] == UNDECIDED
    return left[keep], threat[keep], pools


def anchored_stage(head: EngineHead, out: Decisions, left: np.ndarray, threat: np.ndarray, options: EngineOptions
              ) -> tuple[np.ndarray, np.ndarray]:
    for k, (indices, weights, residual, gap) in anchored_certificates(head, left, options.newton_iterations).items():
        set_convex(out, k, indices, weights, residual, gap, "newton")
    keep = out.verdict[left] == UNDECIDED
    return left[keep], threat[keep]


def pooled_stage(head: EngineHead, out: Decisions, left: np.ndarray, threat: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Rows a short way from the centre (rows added near the mean, beyond the interior stage's linear weights):
    certificates on a pool of 3D rows drawn around each (tilt.pooled_certificates), before Frank-Wolfe and
    Newton's solves over the whole head. Only rows within sqrt(2 ln(m / D)) of the centre in the metric of
    the head's covariance try it: about as deep as the hull of m rows of a Gaussian cloud reaches, where a
    trained head's own rows lie about sqrt(d) out; a token whose pool misses its row costs one pool's solve (at
    most 8 float32 and pools.POOL_HESSIANS float64 Hessians of 3D x D). Heads too wide for such pools, or with too
    few rows (pools.drawn_pools_fit), skip it; the pipeline calls it only where the minimum-norm rounds do not
    go first (heads of more than corrective.WIDTH dimensions)."""
    if not len(left) or head.domain.bounded or not drawn_pools_fit(head):
        return left, threat
    dim = lifted_dimension(head)  # (drawn_pools_fit: the head has more than 6D rows)
    near = centre_distance(head, left) <= math.sqrt(2.0 * math.log(head.n_competitors / dim))
    for k, (indices, weights, residual, gap) in pooled_certificates(head, left[near]).items():
        set_convex(out, k, indices, weights, residual, gap, "newton")
    keep = out.verdict[left] == UNDECIDED
    return left[keep], threat[keep]


def newton_stage(head: EngineHead, out: Decisions, left: np.ndarray, options: EngineOptions, progress: bool) -> np.ndarray:
    witnesses = {}  # the points Newton runs to, where they beat every rival (checked like any witness)
    with progress_bar(len(left), "newton", progress) as bar:
        settled = tilted_certificates(head, left, options.newton_iterations, progress=bar, witnesses=witnesses)
    for k, (indices, weights, residual, gap) in settled.items():
        set_convex(out, k, indices, weights, residual, gap, "newton")
    for k, (witness, margin, runner_up) in witnesses.items():
        if out.verdict[k] == UNDECIDED:
            set_witness(out, k, witness, margin, runner_up, "newton")
    return left[out.verdict[left] == UNDECIDED]


def defer_flat(head: EngineHead, out: Decisions, left: np.ndarray, leftovers: Leftovers) -> np.ndarray:
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
    """Run the exact stage (constraint_generation.lp_decide_all) on ``tokens`` and record what it proves;
    returns every outcome."""
    with progress_bar(len(tokens), "exact LP", progress) as bar:
        results = lp_decide_all(head, tokens, seeds, options.lp_rounds, done=lambda k: bar.update(1))
    for k in tokens:
        result = results[k]
        if result.verdict == "argmaxable":
            set_witness(out, k, result.witness, result.margin, result.runner_up, "lp")
        elif result.verdict == "unargmaxable":
            set_convex(out, k, result.indices, result.weights, result.residual, result.bias_gap, "lp")
    return results


def lp_stage(head: EngineHead, out: Decisions, left: np.ndarray, options: EngineOptions, progress: bool,
        leftovers: Leftovers) -> None:
    """The exact stage for every token left (constraint_generation.lp_decide_all: constraint generation, then
    the LP over all rows); what it cannot prove is inconclusive, with its bounds."""
    lower, upper = leftovers.lower, leftovers.upper
    tokens = left.tolist()
    results = _exact(head, out, tokens, {k: np.concatenate(leftovers.seeds[k]) for k in tokens}, options, progress)
    for k in tokens:
        result = results[k]
        if result.verdict is None:
            out.verdict[k] = INCONCLUSIVE
            out.bounds[k] = (max(result.margin, lower.get(k, -np.inf)),
                             min(result.residual, upper.get(k, np.inf)) if _upper_bounds_margin(head) else np.inf)


def lp_first(head: EngineHead, out: Decisions, left: np.ndarray, threat: np.ndarray, options: EngineOptions,
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
