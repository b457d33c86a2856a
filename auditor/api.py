"""``auditor.audit``: the one entry point for weight arrays."""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Iterable

import numpy as np
import torch

from auditor.engine import ARGMAXABLE, INCONCLUSIVE, STAGES, UNARGMAXABLE, UNDECIDED, EngineOptions, decide
from auditor.engine.screen.ties import duplicate_groups
from auditor.errors import InputError
from auditor.question.domain import Ball, Domain, Norm, parse_domain
from auditor.question.factorised import is_factor_pair, split_factors
from auditor.question.norm import FinalNorm, NormMap, exact_ties, output_error, reduce_head
from auditor.util.arrays import as_float64
from auditor.util.input import check_options, prepare_inputs, prepare_token_ids, resolve_device
from auditor.util.threads import applying_threads
from auditor.verdicts.report import AuditReport


def _row_reader(weight):
    """k -> float64 copy of row k of the caller's array (exact for every float dtype)."""
    rows = weight if isinstance(weight, torch.Tensor) else np.asarray(weight)
    return lambda k: as_float64(rows[k])


@applying_threads
def audit(weight, bias=None, *, domain: str | Domain = "unbounded", device: str = "auto",
          tokens: Iterable[int] | None = None, progress: bool = True, final_norm: FinalNorm | None = None,
          probability_ceiling: bool = False, residual_tol: float = 1e-10, frank_wolfe_iterations: int = 100,
          lp_rounds: int = 10, newton_iterations: int = 40, min_norm_rounds: int = 40, threads: int | None = None,
          bfloat16_entries: int | None = None, whitened_entries: int | None = None,
          int8_entries: int | None = None) -> AuditReport:
    """Decide which tokens of a head can be the strict argmax of its logits ``W z + b``.

    ``weight`` is an n x d numpy array or torch tensor (float16, bfloat16, float32
    or float64) and ``bias`` a length-n vector or None. ``domain`` is
    ``"unbounded"``, ``"ball:R"``, ``"box:R"``, ``"norm"``, ``"nonneg"``, ``"nonneg:R"`` or a domain object;
    ``"norm"`` decides over the outputs of the final normalisation given as
    ``final_norm=auditor.FinalNorm(kind, weight=g, bias=beta, eps=eps)``; ``"nonneg"`` over hidden states
    z >= 0 (a ReLU's, or a pooled ReLU's, outputs), ``"nonneg:R"`` those of norm at most R.
    ``tokens`` restricts the audit to some ids; the others are reported
    ``undecided``. ``probability_ceiling=True`` (bounded domains only) also
    sets ``tokens[k].max_probability``, the largest softmax probability token k
    reaches in the domain, to within 1e-4, with ``probability_bounds`` and the
    point that reaches at least the lower bound. ``residual_tol`` is the relative
    residual an unargmaxable certificate may rest on (see docs/method.md);
    ``frank_wolfe_iterations``, ``newton_iterations`` and ``lp_rounds`` bound
    the work of those stages (0 skips one; the dual Frank-Wolfe of biased heads
    and bounded domains runs four times ``frank_wolfe_iterations``, most of them
    on a working set of rivals). ``lp_rounds`` is the most rounds of constraint
    generation the exact LP runs for one token before it solves the LP over all rows
    (warm, from the basis the rounds reached), so no token the plain LP decides is
    left inconclusive; 0 skips the stage. ``min_norm_rounds`` bounds the rounds of Wolfe's
    fully corrective minimum-norm method that heads of at most 256 dimensions run in the
    unbounded domain before the full Frank-Wolfe stage, and wider heads for the tokens
    Frank-Wolfe and Newton leave (docs/method.md, stage 2a); 0 skips it.

    ``bfloat16_entries``, ``int8_entries`` and ``whitened_entries`` are the head sizes (n d) from which the
    screen runs its bfloat16 pass, its int8 pass (heads without a bias, in place of the bfloat16 one) and
    tries whitened witnesses (docs/method.md, stage 1); None takes the engine's 2^22, below which none pays
    for itself. Every certificate holds either way.

    ``threads`` caps the CPU threads torch uses during the call (the previous
    setting is restored afterwards; numpy's and scipy's BLAS run on one thread
    meanwhile); None takes OMP_NUM_THREADS when it is set,
    else torch's current setting. The count used is ``report.threads``.

    ``weight`` may also be a pair ``(U, V)`` standing for W = U @ V (U n x r,
    V r x d, r <= d): when V has full row rank every verdict of W is that of the
    head U in R^r, so U is audited and the product never formed; the report's
    ``factorised`` says so, and its witnesses are points of R^r. Unbounded
    domain only.

    Returns an AuditReport. Raises auditor.InputError for bad input (NaN or Inf
    weights, wrong shapes or dtypes, an empty head, an unknown domain or device,
    a bad thread count, a rank-deficient V or a bounded domain for a pair)
    before deciding anything.
    """
    started = time.perf_counter()
    check_options(residual_tol, frank_wolfe_iterations, lp_rounds, newton_iterations, min_norm_rounds)
    parsed_domain = parse_domain(domain)
    factorisation = None
    if is_factor_pair(weight):  # W = U @ V is decided exactly as U (see auditor/question/factorised.py)
        weight, factorisation = split_factors(weight, parsed_domain)
    if probability_ceiling and parsed_domain.orthant:
        raise InputError(f"probability ceilings are computed over balls, boxes and the norm domain, not over "
                         f"{parsed_domain}")
    if probability_ceiling and not parsed_domain.bounded:
        raise InputError("probability ceilings need a bounded domain (ball:R, box:R or norm): in the unbounded "
                         "domain every argmaxable token's probability comes arbitrarily close to 1")
    chosen = resolve_device(device)
    w, b64, dtype = prepare_inputs(weight, bias, chosen)
    ids = prepare_token_ids(tokens, w.shape[0])
    options = EngineOptions(frank_wolfe_iterations=frank_wolfe_iterations, lp_rounds=lp_rounds,
                            newton_iterations=newton_iterations, min_norm_rounds=min_norm_rounds,
                            residual_tol=residual_tol,
                            **{name: value for name, value in (("bfloat16_entries", bfloat16_entries),
                                                               ("whitened_entries", whitened_entries),
                                                               ("int8_entries", int8_entries))
                               if value is not None})
    norm_map = None
    if isinstance(parsed_domain, Norm):
        if final_norm is None:
            raise InputError("domain 'norm' needs final_norm=auditor.FinalNorm(kind, weight=..., bias=..., eps=...)")
        w64 = w.to(torch.float64)  # the reduced head is computed, hence float64, in any case
        reduced = reduce_head(w64, b64, final_norm)
        norm_map = NormMap(final_norm, reduced)
        ties = exact_ties(w64, b64, reduced, final_norm)
        row_error = reduced.row_error + output_error(w.shape[1]) * torch.linalg.vector_norm(reduced.weight, dim=1)
        ceilings, rest, proved = None, ids, None
        if probability_ceiling:  # first: their certified points also prove most tokens argmaxable
            ceilings = _ceilings(reduced.weight, reduced.bias, ids, Ball(reduced.radius), progress,
                                 float(row_error.max()), float(reduced.bias_error.max()))
            proved = ceilings[0].margin > 0  # the reduced head keeps the plain rule (EngineOptions)
            rest = _not_won(ids, proved, ties)
        # Tokens whose dual value is zero up to rounding (rows inside the hull: the reduced bias W beta is
        # linear in the rows, so their bias gap is too) are settled in R^d first, the LP only if that fails.
        decisions = decide(reduced.weight, reduced.bias, rest, Ball(reduced.radius),
                           dataclasses.replace(options, defer_flat=True, decide_at_tolerance=False), progress, row_error,
                           reduced.bias_error, representative=ties)
        clock = time.perf_counter()
        _hull_fallback(decisions, w64, b64, options, norm_map.reach)
        left = np.nonzero(decisions.verdict == INCONCLUSIVE)[0]
        if left.size:
            _take(decisions, decide(reduced.weight, reduced.bias, left, Ball(reduced.radius),
                                    dataclasses.replace(options, decide_at_tolerance=False), progress,
                                    row_error, reduced.bias_error, representative=ties), left)
        decisions.timings["hull_fallback"] = time.perf_counter() - clock
        del reduced
    else:
        groups, ceilings, rest, proved = None, None, ids, None
        if probability_ceiling:
            groups = duplicate_groups(w, b64)
            ceilings = _ceilings(w.to(torch.float64), b64, ids, parsed_domain, progress)
            proved = _lead_beyond_tolerance(ceilings[0], ids, w, parsed_domain, residual_tol) > 0
            rest = _not_won(ids, proved, groups)
        decisions = decide(w, b64, rest, parsed_domain, options, progress, representative=groups)
    if ceilings is not None:
        _record_ceilings(decisions, ids, *ceilings, proved)
    timings = dict(decisions.timings)
    report = AuditReport(decisions, _row_reader(weight), n_tokens=w.shape[0], hidden_size=w.shape[1],
                         dtype=dtype, has_bias=b64 is not None, domain=parsed_domain, device=str(chosen),
                         timings=timings, norm_map=norm_map, threads=torch.get_num_threads(),
                         factorised=factorisation)
    timings["total"] = time.perf_counter() - started
    return report


def _ceilings(weight: torch.Tensor, bias: torch.Tensor | None, ids: np.ndarray, domain, progress: bool,
              row_error: float = 0.0, bias_error: float = 0.0):
    """Probability ceilings for the requested tokens, and the seconds they took."""
    from tqdm import tqdm

    from auditor.engine.ceiling import probability_ceilings

    clock = time.perf_counter()
    with tqdm(total=len(ids), desc="ceilings", file=sys.stderr, disable=not progress, leave=False, unit="tok") as bar:
        found = probability_ceilings(weight, bias, ids, domain, progress=bar, row_error=row_error,
                                     bias_error=bias_error)
    return found, time.perf_counter() - clock


def _lead_beyond_tolerance(found, ids: np.ndarray, weight: torch.Tensor, domain, residual_tol: float) -> np.ndarray:
    """The ceilings' certified leads, less what the verdict rule asks a witness to lead by (EngineHead.witness_lead):
    residual_tol times a row's spread times ||z|| (the domain's reach when bounded). The spread is bounded by the
    diagonal of the rows' bounding box, which holds every row and their median: a token the ceilings prove keeps
    a positive value only when it leads beyond its own threshold; the verdict stages decide the others."""
    low, high = weight.amin(dim=0).to(torch.float64), weight.amax(dim=0).to(torch.float64)
    diagonal = float(torch.linalg.vector_norm(high - low)) * (1 + 2.0**-40)
    if domain.bounded:
        size = np.full(len(ids), domain.reach(weight.shape[1]))
    else:
        size = np.array([float(np.linalg.norm(found.witness(j))) for j in range(len(ids))]) * (1 + 2.0**-40)
    return found.margin - residual_tol * diagonal * size


def _not_won(ids: np.ndarray, proved: np.ndarray, representative: np.ndarray) -> np.ndarray:
    """The tokens the ceilings did not prove argmaxable: for those left, the verdict stages.

    A token whose certified point makes its logit the strict maximum is argmaxable with that
    point as its witness (the check is the screen's, from the same float32 rounding bounds, see
    ceiling.bounds.Float32Certifier). Only tokens without a copy are taken: a tied token never wins."""
    alone = (representative == np.arange(representative.size)) & (np.bincount(representative)[representative] == 1)
    won = proved & alone[ids]
    return ids[~won]


def _record_ceilings(decisions, ids: np.ndarray, found, seconds: float, proved: np.ndarray) -> None:
    """Every requested token's ceiling; the argmaxable verdict of the tokens the ceilings proved (``proved``)."""
    for j, k in enumerate(ids.tolist()):
        decisions.ceiling[k] = (float(found.lower[j]), float(found.upper[j]), found.point[j])
        if decisions.verdict[k] == UNDECIDED and proved[j]:
            decisions.verdict[k] = ARGMAXABLE
            decisions.explicit_witness[k] = found.witness(j)
            decisions.margin[k] = float(found.margin[j])
            decisions.runner_up[k] = int(found.runner_up[j])
            decisions.stage[k] = STAGES.index("ceiling")
    decisions.timings["ceilings"] = seconds


def _take(decisions, again, ids: np.ndarray) -> None:
    """Copy the answers for ``ids`` from a second decision over the same head into the first."""
    for name in ("verdict", "margin", "runner_up", "stage", "witness_shift", "witness_scale"):
        getattr(decisions, name)[ids] = getattr(again, name)[ids]
    for name in ("explicit_witness", "convex", "bounds"):
        table, other = getattr(decisions, name), getattr(again, name)
        for k in ids.tolist():
            table.pop(k, None)
            if k in other:
                table[k] = other[k]
    for k, v in again.timings.items():
        decisions.timings[k] = decisions.timings.get(k, 0.0) + v


def _hull_fallback(d, weight: torch.Tensor, bias: torch.Tensor | None,
                   options: EngineOptions, reach: float) -> None:
    """Norm domain: settle what is left with the unbounded question on the head as given.

    A token that cannot win anywhere in R^d cannot win on the norm's outputs
    either. This catches rows inside the hull whose reduced-space certificate
    could not show a non-positive bias gap: the norm's shift beta turns every
    row's w_i . beta into a bias, and a residual along the all-ones direction
    (invisible to LayerNorm) gives that bias gap an arbitrary sign. Such a
    certificate bounds the margin by residual * ||z||, and the norm's outputs
    reach ||z|| <= ``reach``: it is accepted only when that product is within the
    tolerance a unit z gets at the rows' typical spread. Tied tokens are left alone: in R^d their tie-mates
    are distinct rows, and one member must not be certified by another.
    """
    left = np.nonzero(d.verdict == INCONCLUSIVE)[0]
    if left.size == 0:
        return
    from auditor.question.domain import Unbounded

    plain = decide(weight, bias, left, Unbounded(), options, progress=False)
    typical = plain.tolerances["typical_spread"]
    for k in left.tolist():
        if plain.verdict[k] != UNARGMAXABLE or k not in plain.convex:
            continue
        indices, weights, residual, gap = plain.convex[k]
        if residual * max(reach, 1.0) > d.tolerances["residual_tol"] * typical:
            continue
        d.convex[k] = plain.convex[k]
        d.bounds.pop(k, None)
        d.stage[k] = STAGES.index("unbounded hull")
        d.verdict[k] = UNARGMAXABLE
