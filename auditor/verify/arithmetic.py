"""The checker's arithmetic: unit roundoffs, rounding bounds, a safe norm, and exact rational values."""

from __future__ import annotations

from fractions import Fraction

import numpy as np

from auditor.question.domain import Ball, NonNeg

U = float(np.finfo(np.float64).eps) / 2  # 2^-53: the unit roundoff of p = 53 significant bits is 2^-p
ETA = float(np.finfo(np.float64).smallest_subnormal)  # 2^-1074


def gamma(n: int, unit: float = U) -> float:
    return n * unit / (1 - n * unit)


def safe_norm(x: np.ndarray, axis=None):
    """Euclidean norm without underflow or overflow: the peak is divided out first."""
    peak = np.abs(x).max(axis=axis, keepdims=True, initial=0.0)
    unit = x / np.where(peak > 0, peak, 1.0)
    return np.squeeze(peak, axis=axis) * np.linalg.norm(unit, axis=axis)


def exactly(alpha, w_k, rows, b_k, b):
    """x = w_k - sum beta_i w_i and the gap sum beta_i (b_k - b_i), beta = alpha / sum(alpha), as Fractions."""
    a = [Fraction(float(v)) for v in alpha]
    total = sum(a)
    x = [Fraction(float(w_k[j])) - sum(c * Fraction(float(v)) for c, v in zip(a, rows[:, j])) / total
         for j in range(rows.shape[1])]
    return x, sum(c * (Fraction(float(b_k)) - Fraction(float(v))) for c, v in zip(a, b)) / total


def dual_at_most_exactly(domain, alpha, w_k, rows, b_k, b, limit: float = 0.0) -> bool:
    """Whether s_D(w_k - sum beta_i w_i) + sum beta_i (b_k - b_i) <= limit for beta = alpha / sum(alpha), in
    rational arithmetic (the ball: r^2 ||x||^2 <= (limit - gap)^2 with gap <= limit; the box:
    r ||x||_1 + gap <= limit; unbounded: ||x||^2 <= limit^2, the residual alone; over z >= 0 x_+ for x)."""
    x, gap = exactly(alpha, w_k, rows, b_k, b)
    room = Fraction(limit)
    if domain.orthant:  # over z >= 0 only the positive part of x can lead
        x = [v for v in x if v > 0]
    if not domain.bounded:
        return room >= 0 and sum(v * v for v in x) <= room * room
    # the checker's own formulas, apart from the engine's (domain.py): a shared mistake would pass both
    r = Fraction(float(domain.radius))
    if isinstance(domain, (Ball, NonNeg)):
        return gap <= room and r * r * sum(v * v for v in x) <= (room - gap) ** 2
    return r * sum(abs(v) for v in x) + gap <= room
