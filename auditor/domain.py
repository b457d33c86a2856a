"""The sets of hidden states a token may be argmaxed over.

A domain answers two questions the engine asks: its support function
``s_D(v) = sup_{z in D} v.z`` (used by the dual certificate of a bounded
domain) and how to scale a direction so that it lies inside D (used to turn
a winning direction into a witness).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from auditor.errors import InputError

# A witness scaled onto the boundary of a ball could land a rounding error
# outside it; this keeps it strictly inside.
_INSIDE = 1.0 - 1e-12


@dataclass(frozen=True)
class Unbounded:
    """All of R^d: the plain question."""

    bounded = False

    def __str__(self) -> str:
        return "unbounded"

    def support(self, v: np.ndarray) -> float:
        return 0.0 if not np.any(v) else math.inf

    def largest_scale(self, direction: np.ndarray) -> float:
        return math.inf

    def contains(self, z: np.ndarray) -> bool:
        return True


@dataclass(frozen=True)
class Ball:
    """Hidden states of Euclidean norm at most ``radius``."""

    radius: float
    bounded = True

    def __post_init__(self):
        _check_radius(self.radius, "ball")

    def __str__(self) -> str:
        return f"ball:{_exact(self.radius)}"

    def support(self, v: np.ndarray) -> float:
        return self.radius * float(np.linalg.norm(v))

    def largest_scale(self, direction: np.ndarray) -> float:
        norm = float(np.linalg.norm(direction))
        return math.inf if norm == 0 else _INSIDE * self.radius / norm

    def contains(self, z: np.ndarray) -> bool:
        return float(np.linalg.norm(z)) <= self.radius

    def reach(self, d: int) -> float:
        """The largest Euclidean norm of a point of the domain in R^d."""
        return self.radius


@dataclass(frozen=True)
class Box:
    """Hidden states with every coordinate in ``[-radius, radius]``."""

    radius: float
    bounded = True

    def __post_init__(self):
        _check_radius(self.radius, "box")

    def __str__(self) -> str:
        return f"box:{_exact(self.radius)}"

    def support(self, v: np.ndarray) -> float:
        return self.radius * float(np.abs(v).sum())

    def largest_scale(self, direction: np.ndarray) -> float:
        peak = float(np.abs(direction).max()) if direction.size else 0.0
        return math.inf if peak == 0 else _INSIDE * self.radius / peak

    def contains(self, z: np.ndarray) -> bool:
        return bool(np.all(np.abs(z) <= self.radius))

    def reach(self, d: int) -> float:
        """The largest Euclidean norm of a point of the domain in R^d: a corner's."""
        return self.radius * math.sqrt(d)


@dataclass(frozen=True)
class Norm:
    """The outputs of the checkpoint's final LayerNorm or RMSNorm (see auditor/norm.py)."""

    bounded = True

    def __str__(self) -> str:
        return "norm"

    def contains(self, z) -> bool:  # membership is by construction: every witness is the norm of a pre-norm vector
        return True


Domain = Unbounded | Ball | Box | Norm


def _exact(radius: float) -> str:
    """The radius as written in reports: short, and read back as the very same float."""
    short = f"{radius:g}"
    return short if float(short) == radius else repr(float(radius))


# Radii far from 1 would push products of weights and hidden states into overflow or underflow.
_SMALLEST_RADIUS, _LARGEST_RADIUS = 2.0**-400, 2.0**400


def _check_radius(radius: float, kind: str) -> None:
    if not (isinstance(radius, (int, float)) and not isinstance(radius, bool) and math.isfinite(radius) and radius > 0):
        raise InputError(f"a {kind} domain needs a finite positive radius, got {radius!r}")
    if not _SMALLEST_RADIUS <= radius <= _LARGEST_RADIUS:
        raise InputError(f"a {kind} domain's radius must lie between 1e-120 and 1e120, got {radius!r}")


def parse_domain(spec: str | Domain) -> Domain:
    """Turn ``"unbounded"``, ``"ball:R"`` or ``"box:R"`` into a domain object.

    Domain objects pass through unchanged. Raises InputError for anything else.
    """
    if isinstance(spec, (Unbounded, Ball, Box, Norm)):
        return spec
    if not isinstance(spec, str):
        raise InputError(f"unknown domain {spec!r}: use 'unbounded', 'ball:R', 'box:R' or 'norm'")
    text = spec.strip().lower()
    if text == "unbounded":
        return Unbounded()
    if text == "norm":
        return Norm()
    kind, _, radius = text.partition(":")
    if kind in ("ball", "box") and radius:
        try:
            value = float(radius)
        except ValueError:
            raise InputError(f"domain {spec!r}: the radius {radius!r} is not a number") from None
        return Ball(value) if kind == "ball" else Box(value)
    raise InputError(f"unknown domain {spec!r}: use 'unbounded', 'ball:R', 'box:R' or 'norm'")
