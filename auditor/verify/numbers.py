"""The numbers a certificates file states beside its certificates, each re-derived: a witness's margin, convex
weights' residual (a dual bound in a bounded domain) and bias gap, and the probability ceilings' bounds.

Each number is a one-sided claim. A margin, a ceiling's lower bound: at least that much is reached; a
residual, a bias gap, a ceiling's upper bound: no more than that. A claim fails when the checker's own
bound on the exact value contradicts it, beyond the rounding of both computations (the audit's own,
float32 for a float32 head, is allowed for); rational arithmetic settles what float64 cannot tell.
"""

from __future__ import annotations

import math

import numpy as np

from auditor.domain import Ball, Unbounded
from auditor.verify.arithmetic import ETA, U, U32, dual_at_most_exactly, exactly, gamma, safe_norm


class Reach:
    """How far the audit's own value of a logit difference at z may be from exact: float32 rounding (the
    precision it computes margins in for a float32 head), a translation of the rows by their median, and
    (norm domain) the normalisation of the hidden state; the checker's own rounding is bounded apart."""

    def __init__(self, W: np.ndarray, b: np.ndarray, norm, float32: bool):
        d = W.shape[1]
        self.relative = 2 * gamma(d + 8, U32) if float32 else 2 * gamma(d + 8)
        self.factor = 4 * self.relative + 16 * (d + 8) * U + (1e-11 if norm is not None else 0.0)
        self.rows = float(safe_norm(W, axis=1).max(initial=0.0)) + float(safe_norm(np.abs(W).max(axis=0)))
        self.bias = 2 * float(np.abs(b).max(initial=0.0))
        self.floor = 8 * (d + 4) * ETA

    def allowance(self, z: np.ndarray) -> float:
        return self.factor * (self.rows * float(safe_norm(z)) + self.bias) + self.floor


def margin_limit(lead: float, size: float, unit_ball: bool, relative: float) -> float:
    """The largest margin a witness of norm ``size`` and exact lead at most ``lead`` may state; on the
    unit ball the lead is divided by ||z||, which the audit may have computed ``relative`` off (float32)."""
    if not unit_ball:
        return lead
    if size == 0:
        return math.inf
    return lead / (size * (1 - relative)) if lead > 0 else lead / (size * (1 + relative))


def convex_claims(domain, W, b, row_error, bias_error, exact: bool, token, scale: float) -> list[str]:
    """What the token's stated residual and bias gap claim beyond what its convex weights give: each is an
    upper bound, so it fails when it is below a lower bound of the exact value (in rational arithmetic
    where float64 cannot tell, on the head's own rows). ``row_error`` / ``bias_error``: the checker's
    rounding of derived rows (the norm domain's reduced head), or None."""
    k = token.id
    idx = np.asarray(token.convex_indices, dtype=np.int64)
    alpha = np.asarray(token.convex_weights, dtype=np.float64)
    if idx.size == 0 or not np.all(np.isfinite(alpha)) or alpha.sum() <= 0:
        return []
    d, s = W.shape[1], idx.size
    beta = alpha / alpha.sum()
    differences = W[idx] - W[k]
    offset = -(beta @ differences)
    slack = 2 * gamma(s + 3) * float(beta @ safe_norm(differences, axis=1)) + 4 * (d + 4) * ETA
    bias_differences = b[k] - b[idx]
    gap = float(beta @ bias_differences)
    gap_error = 2 * gamma(s + 3) * float(beta @ np.abs(bias_differences)) + 4 * ETA
    if row_error is not None:
        slack += float(beta @ row_error[idx]) + float(row_error[k])
        gap_error += float(beta @ bias_error[idx]) + float(bias_error[k])
    reasons = []
    decidable = exact and s <= 64

    def undecided(lower: float, upper: float, stated: float) -> bool:
        return lower <= stated < upper

    stated_gap = token.bias_gap
    if stated_gap is not None and not math.isnan(stated_gap):
        claim = stated_gap * scale
        lower = gap - gap_error
        if claim < lower or (undecided(lower, gap + gap_error, claim) and exact
                             and exactly(alpha, W[k][:0], W[idx][:, :0], b[k], b[idx])[1] > claim):
            reasons.append(f"bias_gap: states {stated_gap:.6g}, below what the weights give "
                           f"({_at_least(lower, claim, scale)})")
    stated = token.residual
    if stated is None or math.isnan(stated):
        return reasons
    claim = stated * scale
    if isinstance(domain, Unbounded):
        name, size, error = "residual", float(safe_norm(offset)), slack
        lower, upper = size * (1 - gamma(d + 1)) - error, size * (1 + gamma(d + 1)) + error
    else:
        name = "residual (the dual bound)"
        size = float(safe_norm(offset)) if isinstance(domain, Ball) else float(np.abs(offset).sum())
        error = slack if isinstance(domain, Ball) else math.sqrt(d) * slack
        lower = domain.radius * (size * (1 - gamma(d + 1)) - error) + gap - gap_error
        upper = domain.radius * (size * (1 + gamma(d + 1)) + error) + gap + gap_error
    if claim < lower or (undecided(lower, upper, claim) and decidable
                         and not dual_at_most_exactly(domain, alpha, W[k], W[idx], b[k], b[idx], claim)):
        reasons.append(f"{name}: states {stated:.6g}, below what the weights give ({_at_least(lower, claim, scale)})")
    return reasons


def _at_least(lower: float, claim: float, scale: float) -> str:
    return f"at least {lower / scale:.6g}" if claim < lower else "more, in exact rational arithmetic"


def _log_sum_exp(x: np.ndarray) -> np.ndarray:
    top = x.max(axis=1, initial=-np.inf)
    safe = np.where(np.isfinite(top), top, 0.0)
    with np.errstate(divide="ignore"):
        return safe + np.log(np.exp(x - safe[:, None]).sum(axis=1))


def probability_claims(tokens, domain, W: np.ndarray, b: np.ndarray, norm, chunk: int):
    """(id, reason) for every stated probability bound its point contradicts: ``max_probability`` must not
    exceed p_k at ``probability_point`` (which must lie in the domain), nor the upper bound fall below it.
    p_k = 1 / (1 + exp F_k), F_k = log sum_{i != k} exp(l_i - l_k), copies of k among the rivals."""
    listed = [t for t in tokens if t.max_probability is not None]
    if not listed:
        return []
    n, d = W.shape
    reach = Reach(W, b, norm, float32=False)
    abs_W = np.abs(W)
    found = []
    for start in range(0, len(listed), chunk):
        part = listed[start:start + chunk]
        ks = np.array([t.id for t in part])
        P = np.stack([t.probability_point for t in part])
        if not np.all(np.isfinite(P)):
            found += [(t.id, "max_probability.point: not a finite vector") for t in part
                      if not np.all(np.isfinite(t.probability_point))]
            continue
        rows = np.arange(len(ks))
        logits = P @ W.T + b[None, :]
        bound = gamma(d + 2) * (np.abs(P) @ abs_W.T + np.abs(b)[None, :]) * (1 + gamma(d + 2)) + 4 * (d + 4) * ETA
        diff = logits - logits[rows, ks][:, None]  # l_i - l_k
        tolerance = bound + bound[rows, ks][:, None] + U * np.abs(diff)
        tolerance += np.array([reach.allowance(z) for z in P])[:, None]
        rival = np.ones(diff.shape, dtype=bool)
        rival[rows, ks] = False
        with np.errstate(over="ignore", invalid="ignore"):
            low = _log_sum_exp(np.where(rival, diff - tolerance, -np.inf))
            high = _log_sum_exp(np.where(rival, diff + tolerance, -np.inf))
            # the exponentials, their sum and its logarithm; no rival at all: F_k = -inf, p_k = 1
            low = np.where(np.isfinite(low), low - gamma(n + 8) * (1 + np.abs(low)), low)
            high = np.where(np.isfinite(high), high + gamma(n + 8) * (1 + np.abs(high)), high)
            most = 1 / (1 + np.exp(low)) * (1 + 8 * U)  # p_k at the point is at most this
            least = 1 / (1 + np.exp(high)) * (1 - 8 * U)  # and at least this
        for j, token in enumerate(part):
            lower, upper = token.probability_bounds
            if domain.bounded and not domain.contains(P[j], safe_norm):
                found.append((token.id, f"max_probability.point: outside the {domain} domain"))
            if lower > most[j]:
                found.append((token.id, f"max_probability.lower: states {lower:.6g}, more than p at its point "
                                        f"(at most {most[j]:.6g})"))
            if upper < lower:
                found.append((token.id, f"max_probability.upper: states {upper:.6g}, below max_probability.lower"))
            elif upper < least[j]:
                found.append((token.id, f"max_probability.upper: states {upper:.6g}, below a probability "
                                        f"reached (p at its point is at least {least[j]:.6g})"))
    return found
