"""The numbers a certificates file states beside its certificates, each re-derived: a witness's margin, convex
weights' residual (a dual bound in a bounded domain) and bias gap, and the probability ceilings' bounds.

Each number is a one-sided claim. A margin, a ceiling's lower bound: at least that much is reached; a
residual, a bias gap, a ceiling's upper bound: no more than that. A claim fails when the checker's own
bound on the exact value contradicts it, beyond the checker's float64 rounding; rational arithmetic
settles what float64 cannot tell. A margin is the audit's proven lower bound at its witness, so the
checker allows for none of the audit's own rounding: only for its own.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

from auditor.question.domain import Ball, NonNeg
from auditor.verify.arithmetic import ETA, U, dual_at_most_exactly, exactly, gamma, safe_norm

EXACT_RIVALS = 64  # most rivals per witness whose lead is compared with a stated margin in rational arithmetic


class Reach:
    """How far the audit's value of a logit difference at a stated probability point may be from the
    checker's: a translation of the rows by their median, and (norm domain) the rounding of the stated
    output of the norm; the checker's own rounding is bounded apart."""

    def __init__(self, W: np.ndarray, b: np.ndarray, norm):
        d = W.shape[1]
        self.relative = 2 * gamma(d + 8)
        self.factor = 4 * self.relative + 16 * (d + 8) * U + (1e-11 if norm is not None else 0.0)
        self.rows = float(safe_norm(W, axis=1).max(initial=0.0)) + float(safe_norm(np.abs(W).max(axis=0)))
        self.bias = 2 * float(np.abs(b).max(initial=0.0))
        self.floor = 8 * (d + 4) * ETA

    def allowance(self, z: np.ndarray) -> float:
        return self.factor * (self.rows * float(safe_norm(z)) + self.bias) + self.floor


def normalise(x: np.ndarray, kind: str, gain: np.ndarray, shift: np.ndarray, eps: float
              ) -> tuple[np.ndarray, float, float]:
    """(z, e, f): the norm's output z for the pre-norm vector x as the checker computes it in float64, and
    bounds that make the exact output z* of x within reach: z_j - z*_j = g_j e_j + r_j + a_j with
    ||e|| <= e, |r_j| <= 2 u |z_j| and |a_j| <= f (underflow), so that a logit difference moves by at most
    e ||g * (w_k - w_i)|| + 2 u |w_k - w_i|.|z| + f ||w_k - w_i||_1.

    LayerNorm: c = x - m (m the mean), r(c) = sqrt(c.c / d + eps), z* = g c / r(c) + beta. The checker's
    mean is within gamma_d mean|x| of m (a sum of d terms and a division), so its c' = fl(x - m') has
    ||c' - c|| <= D = sqrt(d) gamma_d mean|x| + 2 u ||c'||; RMSNorm takes c = x, D = 0. Its root is
    within gamma_{d+3} of r(c') (the squares' sum, a division, eps and the square root), so
    fl(fl(g_j c'_j) / root) = g_j (c'_j / r(c')) (1 + t_j), |t_j| <= gamma_{d+6}, and adding beta_j
    rounds once more (the r_j above). The map c -> c / r(c) has Jacobian (I - c c^T / (d r^2)) / r, of
    norm at most 1 / r, and ||c / r(c)|| < sqrt(d); on the segment from c to c', r is at least
    R = max(sqrt(eps), r(c') - D / sqrt(d)) (r is 1/sqrt(d)-Lipschitz). So
    ||e|| <= gamma_{d+6} sqrt(d) + D / R. Each entry's underflow (products, the division and the sum
    each within eta / 2) gives f = 2 eta (1 + 1 / R)."""
    d = x.shape[0]
    if kind == "layernorm":
        mean_error = gamma(d + 2) * float(np.abs(x).sum()) / d + d * ETA
        x = x - x.mean()
        offset = math.sqrt(d) * mean_error * (1 + 4 * U) + 2 * U * float(safe_norm(x)) * (1 + gamma(d + 8))
    else:
        offset = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        squares = float(x @ x)
    if not (np.all(np.isfinite(x)) and math.isfinite(squares) and (squares == 0 or squares >= np.finfo(np.float64).tiny)):
        # the sum of squares overflowed or left the normal range: no bound holds, and nothing passes on it
        return gain * x + shift, math.inf, math.inf
    root = math.sqrt(squares / d + eps)
    z = gain * x / root + shift
    least = max(math.sqrt(eps) * (1 - 4 * U), root / (1 + gamma(d + 4)) - offset / math.sqrt(d) * (1 + 4 * U))
    if not least > 0:
        return z, math.inf, math.inf
    error = (gamma(d + 6) * math.sqrt(d) + offset / least) * (1 + 8 * U)
    return z, error, 2 * ETA * (1 + 1 / least) * (1 + 8 * U)


def margin_limit(lead, size: float, unit_ball: bool, d: int, upward: bool = True):
    """A bound on the margin a lead gives: the lead itself, or on the unit ball lead / ||z|| for a witness
    whose norm the checker computed as ``size`` (safe_norm: within gamma_{d+4} of ||z||). ``upward``: ``lead``
    bounds the exact lead from above and so does the result (the divisor on the side of ||z|| that makes
    the quotient larger, the division rounded up); else both bound it from below. Numbers or arrays."""
    if not unit_ball:
        return lead
    relative = gamma(d + 8)
    lead = np.asarray(lead, dtype=np.float64)
    larger = (lead > 0) != upward  # where the larger divisor puts the quotient on the wanted side
    divisor = np.where(larger, size * (1 + relative), size * (1 - relative))
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        quotient = np.nextafter(lead / divisor, math.inf if upward else -math.inf)
    if size == 0:
        quotient = np.full_like(lead, math.inf if upward else -math.inf)
    return quotient if quotient.ndim else float(quotient)


def lead_threshold(claims: np.ndarray, sizes: np.ndarray, unit_ball: bool, d: int) -> np.ndarray:
    """For each stated margin (times the head's scale), a lead at least as large as the one it claims at its
    witness: the margin itself, or on the unit ball the margin times ||z|| (``sizes`` the computed norms),
    taken on the large side of ||z|| and raised past the rounding of the products."""
    if not unit_ball:
        return claims
    relative = gamma(d + 8)
    with np.errstate(over="ignore", invalid="ignore"):
        product = np.where(claims >= 0, claims * (sizes * (1 + relative)), claims * (sizes * (1 - relative)))
        return product + 4 * U * np.abs(product) + ETA


def margin_claim(stated: float, scale: float, k: int, z: np.ndarray, most: float, close: np.ndarray,
                 W: np.ndarray, b: np.ndarray, unit_ball: bool, exact: bool) -> str | None:
    """Why token k's stated margin is more than its witness z gives, or None when it is not.

    The margin is the least lead l_k - l_i over the rivals (on the unit ball divided by ||z||), so the claim
    fails when one rival's exact lead is below it. ``most`` bounds the least exact lead at z from above on
    the head ``W``, ``b`` (``scale`` times the head as given); ``close`` lists the rivals whose leads' lower
    bounds do not show them to reach the claim (lead_threshold). ``exact``: z is the point itself (not the
    norm domain's computed output), so that the leads of those rivals may be formed again: from the
    differences w_k - w_i and b_k - b_i (an offset the rows share adds no error), within
    gamma_{d+3} (|w_k - w_i|.|z| + |b_k - b_i|), and for up to EXACT_RIVALS of them in rational arithmetic."""
    d = z.shape[0]
    claim = stated * scale
    size = float(safe_norm(z))
    most = margin_limit(most, size, unit_ball, d)
    if claim > most:
        return f"margin: states {stated:.6g}, more than its witness gives (at most {most / scale:.6g})"
    if not (exact and close.size and math.isfinite(claim)):
        return None
    differences, bias_differences = W[k] - W[close], b[k] - b[close]
    lead = differences @ z + bias_differences
    error = (gamma(d + 3) * (np.abs(differences) @ np.abs(z) + np.abs(bias_differences)) * (1 + gamma(d + 3))
             + 4 * (d + 4) * ETA)
    with np.errstate(over="ignore", invalid="ignore"):
        most = margin_limit(float(np.nextafter(lead + error, math.inf).min()), size, unit_ball, d)
        least = margin_limit(np.nextafter(lead - error, -math.inf), size, unit_ball, d, upward=False)
    if claim > most:
        return f"margin: states {stated:.6g}, more than its witness gives (at most {most / scale:.6g})"
    order = np.argsort(least, kind="stable")  # the rivals that lead least first
    close = close[order[least[order] < claim]][:EXACT_RIVALS]
    if not close.size:
        return None
    point = [Fraction(float(v)) for v in z]
    own = [Fraction(float(v)) for v in W[k]]
    square = sum(p * p for p in point) if unit_ball else None
    bound = Fraction(stated) * Fraction(scale)
    for i in close.tolist():
        value = sum((a - Fraction(float(v))) * p for a, v, p in zip(own, W[i], point) if p)
        if _below(value + Fraction(float(b[k])) - Fraction(float(b[i])), bound, square):
            return (f"margin: states {stated:.6g}, more than its witness gives (its lead over token {i} is less, "
                    "in exact rational arithmetic)")
    return None


def _below(lead: Fraction, claim: Fraction, square: Fraction | None) -> bool:
    """Whether lead < claim, or on the unit ball lead < claim ||z|| with square = ||z||^2, exactly."""
    if square is None:
        return lead < claim
    if claim >= 0:
        return lead < 0 or lead * lead < claim * claim * square
    return lead < 0 and lead * lead > claim * claim * square


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
    kept = np.maximum(offset, 0.0) if domain.orthant else offset  # over z >= 0: the positive part (1-Lipschitz)
    if not domain.bounded:
        name, size, error = "residual", float(safe_norm(kept)), slack
        lower, upper = size * (1 - gamma(d + 1)) - error, size * (1 + gamma(d + 1)) + error
    else:
        name = "residual (the dual bound)"
        euclidean = isinstance(domain, (Ball, NonNeg))
        size = float(safe_norm(kept)) if euclidean else float(np.abs(offset).sum())
        error = slack if euclidean else math.sqrt(d) * slack
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
    reach = Reach(W, b, norm)
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
            if not domain.contains(P[j], safe_norm):  # the orthant's too, bounded or not
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
