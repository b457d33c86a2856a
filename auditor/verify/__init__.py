"""Re-check a report's certificates from scratch, the way a third party would.

Nothing here reuses the engine: plain float64 numpy on the caller's weights.

- Every verdict must carry its certificate: a witness for argmaxable tokens,
  convex weights for unargmaxable ones, the group's certificate for a tied
  token whose group was decided. A tie is checked pair by pair (equal rows and
  biases, exactly); a token that names itself among its copies, or as its
  runner_up, fails.
- A witness z of token k passes when, for every row i outside k's tie group,
  fl(l_k) - fl(l_i) exceeds the rounding bound gamma_{d+2} (|w_i|.|z| + |b_i|)
  of both logits, plus an underflow term, and z lies in the domain. A rival that this bound cannot
  settle is re-decided on (w_k - w_i).z + (b_k - b_i) with the differences formed first, so that a
  bias or a row offset the two share adds no error, and in rational arithmetic where that cannot tell.
- Convex weights pass when they are non-negative, avoid k's group, sum to 1,
  and either (any domain) the residual ||w_k - sum alpha_i w_i|| (over z >= 0, the nonneg domains: the
  norm of its positive part, ||(w_k - sum alpha_i w_i)_+||) is at most
  residual_tol * max(||w_k - m||, t) with a bias gap
  b_k - sum alpha_i b_i <= 0 (its sign in rational arithmetic when it is zero up to rounding), or
  (bounded domain) the dual value
  s_D(w_k - sum alpha_i w_i) + b_k - sum alpha_i b_i, which bounds k's lead anywhere in D, is at most
  residual_tol * max(||w_k - m||, t) times the domain's reach (r for a ball, r sqrt(d) for a box, r for
  nonneg:r, whose s_D(x) is r ||x_+||). Each quantity is
  recomputed with its rounding error added on the unfavourable side. m is the
  coordinate-wise median of the distinct rows and t the 10th percentile of their
  non-zero distances from it: the rows' spread, which no common offset changes.
- Every number the file states beside a certificate is re-derived (numbers.py):
  a margin, residual, bias gap, dual bound or probability bound that claims
  more than the weights give fails, with the field named. A margin is a lower
  bound of the exact least lead at its witness (per unit of ||z|| for an
  unbounded head without a bias; in the norm domain at the exact output of the
  pre-norm vector): it fails when it is above the checker's float64 upper bound
  of that lead, with only the checker's own rounding allowed for, or below it
  but above a rival's exact lead in rational arithmetic.

The head is first rescaled by an exact power of two (logits scale with it, so
every sign is unchanged) to keep norms and products away from overflow.

What is checked may be an AuditReport, the Certificates of a certificates file
(``auditor.load_certificates``), or that file's parsed JSON; formula witnesses
of a file are evaluated on the weight given here, before the rescaling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import TYPE_CHECKING

import numpy as np

from auditor.errors import InputError
from auditor.question.domain import Ball, NonNeg, Unbounded
from auditor.util.arrays import as_float64
from auditor.verdicts.certificates import Certificates, parse_certificates
from auditor.verify.arithmetic import ETA, U, dual_at_most_exactly, exactly, gamma, safe_norm
from auditor.verify.numbers import convex_claims, lead_threshold, margin_claim, normalise, probability_claims

if TYPE_CHECKING:  # the checker uses no engine code; a report is only read through its certificates
    from auditor.verdicts.report import AuditReport


@dataclass
class Verification:
    """``checked`` certificates re-checked (a tie claim, a witness, convex weights each count one), for
    ``tokens`` distinct tokens and ``groups`` distinct tie groups; ``failed`` the sorted ids whose certificate
    or stated numbers do not hold, ``reasons[k]`` what failed for each, starting with the field's name
    (tie, missing certificate, witness, convex weights, margin, runner_up, residual, bias_gap, max_probability,
    bounds)."""

    checked: int = 0
    failed: list[int] = field(default_factory=list)
    reasons: dict[int, list[str]] = field(default_factory=dict)
    tokens: int = 0
    groups: int = 0

    @property
    def ok(self) -> bool:
        return not self.failed

    def fail(self, k: int, reason: str) -> None:
        self.failed.append(k)
        self.reasons.setdefault(k, []).append(reason)


def _power_of_two(W: np.ndarray, b: np.ndarray) -> float:
    """2^e that brings the largest entry of the head into [1/2, 1), when that scaling is exact; else 1 (a
    bias of -1.8e308 masking a token would push the rows below float64's normal range and round them, and
    the wins checked would be those of other rows). Unscaled, what overflows fails, never passes."""
    peak = max(float(np.abs(W).max(initial=0.0)), float(np.abs(b).max(initial=0.0)))
    if peak == 0:
        return 1.0
    scale = math.ldexp(1.0, -math.frexp(peak)[1])
    with np.errstate(over="ignore", under="ignore"):
        exact = all(np.array_equal(x * scale / scale, x) for x in (W, b))
    return scale if exact else 1.0


def verify(report: AuditReport | Certificates | dict, weight, bias=None, final_norm=None,
           chunk: int = 512) -> Verification:
    """Check every certificate in ``report`` against ``weight`` and ``bias``; returns a Verification.

    ``report`` is an AuditReport, Certificates, or the parsed JSON of a
    certificates file. A report of the ``norm`` domain needs the same
    ``final_norm``: its witnesses are re-derived by normalising their pre-norm
    vectors here. Raises InputError for a malformed certificates document or a
    weight of another shape than the file's head.
    """
    W = as_float64(weight)
    b = as_float64(bias) if bias is not None else np.zeros(W.shape[0])
    if isinstance(report, dict):
        report = parse_certificates(report)
    if isinstance(report, Certificates):
        if report.has_bias != (bias is not None):  # b = 0 for a head with a bias would be another head
            raise InputError(f"{report.source}: the certificates are for a head "
                             f"{'with' if report.has_bias else 'without'} a bias; pass "
                             f"{'its bias' if report.has_bias else 'bias=None'}")
        report = report.resolve(W)  # on the rows as given: the witness is a point of the caller's space
    norm = None
    if str(report.domain) == "norm":
        if final_norm is None:
            raise ValueError("a norm-domain report is verified against its final_norm: pass final_norm=")
        d = W.shape[1]
        gain = as_float64(final_norm.weight) if final_norm.weight is not None else np.ones(d)
        gain = 1.0 + gain if final_norm.unit_offset else gain
        shift = as_float64(final_norm.bias) if final_norm.bias is not None else np.zeros(d)
        norm = (final_norm.kind, gain, shift, float(final_norm.eps))
    scale = _power_of_two(W, b)
    given = W, b  # probabilities, unlike signs, change with the head's scale
    W, b = W * scale, b * scale  # exact (checked): the largest entry lands in [0.5, 1) where it can
    n, d = W.shape
    result = Verification()
    tokens = [report.tokens[k] for k in range(n)]
    group = {t.id: set(t.tied_with) for t in tokens if t.tied_with}
    result.groups = len({frozenset(others | {k}) for k, others in group.items()})
    checked: set[int] = set()  # the tokens whose certificate was checked
    for k, others in group.items():  # a tie is itself a claim: equal logits wherever the domain reaches
        result.checked += 1
        checked.add(k)
        if k in others:  # a token is trivially "tied" with itself: that claims nothing and hides no copy
            result.fail(k, f"tie: lists token {k} itself as its copy")
        untied = [j for j in sorted(others - {k}) if not _tied(W, b, k, j, norm)]
        if untied:
            result.fail(k, f"tie: not the same logits as {', '.join(map(str, untied))}")

    # In the norm domain a win is certified by the hidden state before the norm; elsewhere by z itself.
    def point(token):
        return token.pre_norm if norm is not None else token.witness

    for token in tokens:  # every decided verdict must carry the certificate it claims
        if token.verdict == "tied" and not token.tied_with:
            result.checked += 1
            checked.add(token.id)
            result.fail(token.id, "missing certificate: tied, but with no copies named")
            continue
        claim = token.group_verdict if token.verdict == "tied" else token.verdict
        if claim == "argmaxable" and point(token) is None:
            result.checked += 1
            checked.add(token.id)
            result.fail(token.id, f"missing certificate: no {'witness' if norm is None else 'pre_norm'}")
        elif claim == "unargmaxable" and token.convex_indices is None:
            result.checked += 1
            checked.add(token.id)
            result.fail(token.id, "missing certificate: no convex weights")
        rival = token.runner_up
        if rival is not None and (rival == token.id or rival in group.get(token.id, ())):
            what = "the token itself" if rival == token.id else "a copy of it"
            result.fail(token.id, f"runner_up: names token {rival}, {what}, which is not a rival")
        lower, upper = token.bounds if token.bounds is not None else (-math.inf, math.inf)
        if lower > upper:  # the two bounds of an inconclusive token cannot both hold (weak duality)
            result.fail(token.id, f"bounds: margin_lower {lower:.6g} is above margin_upper {upper:.6g}")

    with_witness = [t.id for t in tokens if point(t) is not None]
    abs_W = np.abs(W)
    # an unbounded head without a (non-constant) bias quotes its margins on the unit ball
    unit_ball = str(report.domain) in ("unbounded", "nonneg") and not np.any(b != b[0])
    if norm is not None:  # what the rows make of the normalisation's error (numbers.normalise)
        gained = safe_norm(W * norm[1], axis=1) * (1 + gamma(d + 8))  # >= ||g * w_i||
        spans = abs_W.sum(axis=1) * (1 + gamma(d + 2))  # >= ||w_i||_1
    for start in range(0, len(with_witness), chunk):
        ks = np.array(with_witness[start:start + chunk])
        if norm is not None:  # the model's own output for the stated hidden state, not the report's z
            outputs = [normalise(tokens[int(k)].pre_norm, *norm) for k in ks]
            Z = np.stack([z for z, _, _ in outputs])
        else:
            Z = np.stack([tokens[int(k)].witness for k in ks])
        rows = np.arange(len(ks))
        logits = Z @ W.T + b[None, :]
        mass = np.abs(Z) @ abs_W.T + np.abs(b)[None, :]  # |w_i|.|z| + |b_i|
        bound = gamma(d + 2) * mass * (1 + gamma(d + 2)) + 4 * (d + 4) * ETA
        diff = logits[rows, ks][:, None] - logits
        tolerance = bound[rows, ks][:, None] + bound + U * np.abs(diff)
        wins = diff > tolerance
        wins[rows, ks] = True  # a token is not its own rival, nor are its exact copies
        for j, k in enumerate(ks.tolist()):
            for other in group.get(k, ()):
                wins[j, other] = True
            if norm is None and not wins[j].all():  # a close call: the exactly normalised pairs decide
                wins[j] = _wins_by_differences(*given, k, Z[j], wins[j])
        # bounds on the exact lead of k over every rival at z (the norm domain: at the exact output of the
        # pre-norm vector, which the checker's z misses by its normalisation error), each sum rounded outwards
        rivals = np.ones_like(wins)
        rivals[rows, ks] = False
        for j, k in enumerate(ks.tolist()):
            rivals[j, list(group.get(k, ()))] = False
        reach = tolerance
        if norm is not None:
            error = np.array([e for _, e, _ in outputs])[:, None]
            floor = np.array([f for _, _, f in outputs])[:, None]
            reach = (tolerance + error * (gained[ks][:, None] + gained[None, :])
                     + 3 * U * (mass[rows, ks][:, None] + mass) + floor * (spans[ks][:, None] + spans[None, :]))
        with np.errstate(invalid="ignore", over="ignore"):
            most = np.nextafter(np.where(rivals, diff + reach, np.inf).min(axis=1, initial=np.inf), np.inf)
            close = np.zeros_like(rivals)  # the rivals whose leads float64 does not show to reach the margin
            if norm is None:  # where z is the point itself, they are looked at again
                margins = np.array([tokens[k].margin if tokens[k].margin is not None else math.nan for k in ks])
                close = rivals & (np.nextafter(diff - reach, -np.inf)
                                  < lead_threshold(margins * scale, safe_norm(Z, axis=1), unit_ball, d)[:, None])
        for j, k in enumerate(ks.tolist()):
            result.checked += 1
            checked.add(k)
            if not np.all(np.isfinite(Z[j])):
                result.fail(k, "witness: not a finite vector")
                continue
            if not report.domain.contains(Z[j], safe_norm):
                result.fail(k, f"witness: outside the {report.domain} domain")
            elif not wins[j].all():
                rival = int(np.argmin(np.where(wins[j], np.inf, diff[j] - tolerance[j])))
                result.fail(k, f"witness: does not beat token {rival} beyond rounding")
            stated = tokens[k].margin
            if stated is not None and not math.isnan(stated):
                reason = margin_claim(stated, scale, k, Z[j], float(most[j]), np.flatnonzero(close[j]), W, b,
                                      unit_ball, norm is None)
                if reason is not None:
                    result.fail(k, reason)

    tol = report.tolerances["residual_tol"]
    # the last entry: whether the rows are the head's own, whose dual value may be settled exactly
    views = [(report.domain, W, b, _typical_spread(W, b), True)]
    claims = {"": (report.domain, W, b, None, None, True)}  # the head on which each stage's numbers are stated
    if norm is not None:  # the hull on the rows as given, or the ball question on the reduced head
        kind, gain, shift, _ = norm
        reduced = _reduced_rows(W, norm)
        reduced_bias = W @ shift + b
        views = [(Unbounded(), W, b, views[0][3], True),
                 (Ball(math.sqrt(d)), reduced, reduced_bias, _typical_spread(reduced, reduced_bias), False)]
        # bounds on the checker's own rounding of the reduced rows and biases
        row_error = 4 * gamma(d + 2) * safe_norm(W * gain, axis=1)
        bias_error = gamma(d + 2) * (np.abs(W) @ np.abs(shift) + np.abs(b)) + 4 * ETA
        claims = {"": (views[1][0], reduced, reduced_bias, row_error, bias_error, False),
                  "unbounded hull": (Unbounded(), W, b, None, None, True)}
    for token in tokens:
        if token.convex_indices is None:
            continue
        result.checked += 1
        checked.add(token.id)
        why = [_convex_failure(domain, rows, bias_, token, group.get(token.id, set()), tol, typical, exact)
               for domain, rows, bias_, typical, exact in views]
        if all(why):  # every view fails; the first (the domain as given) says why
            result.fail(token.id, f"convex weights: {why[0]}")
            continue
        for reason in convex_claims(*claims.get(token.stage if norm is not None else "", claims[""]), token, scale):
            result.fail(token.id, reason)
    for k, reason in probability_claims(tokens, report.domain, *given, norm, chunk):
        result.fail(k, reason)
    result.tokens = len(checked)
    result.failed = sorted(set(result.failed))
    return result


EXACT_RIVALS = 64  # most rivals per witness whose sign is settled in rational arithmetic


def _wins_by_differences(W: np.ndarray, b: np.ndarray, k: int, z: np.ndarray, wins: np.ndarray) -> np.ndarray:
    """``wins`` with the rivals it lacks re-decided on l_k - l_i = (w_k - w_i).z + (b_k - b_i), the
    differences formed first: a bias or a row offset the two share cancels before any rounding, so the
    bound is a fraction of |w_k - w_i|.|z| + |b_k - b_i|, not of the raw |w_i|.|z| + |b_i|. What that
    cannot tell either way is settled in rational arithmetic (on the weights as given)."""
    from fractions import Fraction

    wins = wins.copy()
    rivals = np.flatnonzero(~wins)
    d = W.shape[1]
    dw = W[k] - W[rivals]  # each entry within u of its exact value
    db = b[k] - b[rivals]
    lead = dw @ z + db
    error = gamma(d + 3) * (np.abs(dw) @ np.abs(z) + np.abs(db)) * (1 + gamma(d + 3)) + 4 * (d + 4) * ETA
    wins[rivals[lead > error]] = True
    close = rivals[np.abs(lead) <= error][:EXACT_RIVALS]
    if close.size:
        point = [Fraction(float(v)) for v in z]
        own = [Fraction(float(v)) for v in W[k]]
        for i in close.tolist():
            exact = sum((a - Fraction(float(v))) * p for a, v, p in zip(own, W[i], point))
            if exact + Fraction(float(b[k])) - Fraction(float(b[i])) > 0:
                wins[i] = True
    return wins


def _tied(W: np.ndarray, b: np.ndarray, k: int, j: int, norm) -> bool:
    """Rows k and j have equal logits everywhere: identical rows, or (norm domain) equal after the norm, exactly."""
    if np.array_equal(W[k], W[j]) and b[k] == b[j]:
        return True
    if norm is None:
        return False
    from fractions import Fraction

    kind, gain, shift, _ = norm
    diff = [Fraction(float(x)) - Fraction(float(y)) for x, y in zip(W[k], W[j])]
    scaled = [Fraction(float(g)) * x for g, x in zip(gain, diff)]
    flat = all(v == scaled[0] for v in scaled) if kind == "layernorm" else all(v == 0 for v in scaled)
    level = sum(x * Fraction(float(s)) for x, s in zip(diff, shift)) + Fraction(float(b[k])) - Fraction(float(b[j]))
    return flat and level == 0


def _typical_spread(W: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, float]:
    """The coordinate-wise lower median m of the distinct rows and the 10th-percentile non-zero
    ||w_i - m|| among them, as the acceptance rule defines them (distances from m: a common offset
    of the rows changes nothing, and no far row can drag m)."""
    distinct = np.unique(np.hstack([W, b[:, None]]), axis=0)[:, :-1]
    middle = (distinct.shape[0] - 1) // 2
    centre = np.partition(distinct, middle, axis=0)[middle]
    norms = safe_norm(distinct - centre, axis=1)
    positive = np.sort(norms[norms > 0])
    return centre, (float(positive[max(1, int(0.1 * positive.size)) - 1]) if positive.size else 0.0)


def _reduced_rows(W: np.ndarray, norm) -> np.ndarray:
    kind, gain, _, _ = norm
    scaled = W * gain
    return scaled - scaled.mean(axis=1, keepdims=True) if kind == "layernorm" else scaled


def _convex_failure(domain, W, b, token, group: set, tol: float, spread, exact: bool) -> str | None:
    """Why the convex weights do not certify the token in this view; None when they do. ``exact``: the
    rows are the head's own (not computed), so a dual value zero up to rounding may be settled exactly."""
    k = token.id
    centre, typical = spread
    idx = np.asarray(token.convex_indices, dtype=np.int64)
    alpha = np.asarray(token.convex_weights, dtype=np.float64)
    if idx.size == 0:
        return "no rows"
    if not np.all(alpha >= 0):  # NaN fails too
        return "a negative weight"
    if k in idx or group.intersection(idx.tolist()):
        return "the combination uses the token itself or a copy of it"
    if abs(alpha.sum() - 1.0) > 1e-12:
        return f"the weights sum to {alpha.sum():.17g}, not 1"
    d = W.shape[1]
    s = idx.size
    beta = alpha / alpha.sum()  # the certificate is the point alpha / sum(alpha) of the simplex
    # w_k - sum beta_i w_i = -sum beta_i (w_i - w_k): differences first, each rounded relative to
    # itself, so a common offset of the rows adds no error
    differences = W[idx] - W[k]
    offset = -(beta @ differences)
    r_k = float(safe_norm(W[k] - centre))
    involved = float(beta @ safe_norm(differences, axis=1))
    slack = 2 * gamma(s + 3) * involved
    if involved > 0:  # products of exact zeros cannot underflow
        slack += 4 * (d + 4) * ETA
    # over z >= 0 only the coordinates where w_k exceeds the combination can lead: the positive part's
    # norm, which is 1-Lipschitz, so the combination's rounding adds as it does to the whole residual
    kept = np.maximum(offset, 0.0) if domain.orthant else offset
    residual = float(safe_norm(kept)) * (1 + gamma(d + 1)) + slack
    gap = 0.0
    bias_differences = b[k] - b[idx]
    if np.any(bias_differences):  # as the engine: products of zeros cannot underflow
        computed = float(beta @ bias_differences)
        gap = computed + 2 * gamma(s + 3) * float(beta @ np.abs(bias_differences)) + 4 * ETA
        if computed - (gap - computed) <= 0 < gap and s <= 64:  # zero up to rounding: settled exactly
            exact = exactly(alpha, W[k][:0], W[idx][:, :0], b[k], b[idx])[1]
            if exact <= 0:  # the exact gap rounded up: a bound the dual value below may add, not only a sign
                gap = float(exact)
                if Fraction(gap) < exact:
                    gap = float(np.nextafter(gap, np.inf))
    hull = residual <= tol * max(r_k, typical) and gap <= 0
    if hull:
        return None
    unit = max(r_k, typical) or 1.0
    if domain.bounded:
        if isinstance(domain, (Ball, NonNeg)):  # r ||x|| or, over z >= 0, r ||x_+||: residual bounds either
            support = domain.radius * residual
        else:
            support = domain.radius * (float(np.abs(offset).sum()) * (1 + gamma(d)) + math.sqrt(d) * slack)
        if support + gap <= tol * max(r_k, typical) * domain.reach(d):  # a lead of at most that, anywhere in D
            return None
        size = float(safe_norm(kept)) if isinstance(domain, (Ball, NonNeg)) else float(np.abs(offset).sum())
        computed = domain.radius * size + float(beta @ bias_differences)
        if exact and s <= 64 and computed <= (support + gap) - computed and dual_at_most_exactly(
                domain, alpha, W[k], W[idx], b[k], b[idx]):
            return None  # zero within rounding, and at most zero in rational arithmetic
        return "the dual value is positive, and the residual or bias gap too large for the hull test"
    # relative to the row's norm: the head was rescaled above, the file's numbers were not
    if residual > tol * max(r_k, typical):
        return f"the residual is {residual / unit:.3g} of the row norm, above the tolerance {tol:g}"
    return f"the bias gap is positive ({gap / unit:.3g} of the row norm)"
