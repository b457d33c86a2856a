"""The sets of hidden states a token may be argmaxed over, each with the operations the solvers need on it.

Every bounded domain here is r times the unit ball of a norm: the Euclidean
norm for Ball, the largest coordinate for Box. Its support function is
``s_D(v) = sup_{z in D} v.z = r ||v||_*`` with the dual norm (l2 for Ball, l1
for Box), which the dual certificates need; the norm itself ("gauge")
decides membership and how far a direction can be scaled and stay inside,
which turns a winning direction into a witness.

Euclidean norms are computed by the caller's function where one is passed
(``euclidean``): the checker and the certifier divide the peak out first so
that no square overflows, the search does not; the domain does not choose.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from auditor.errors import InputError

# A witness scaled onto the boundary of a domain could land a rounding error
# outside it; this keeps it strictly inside.
_INSIDE = 1.0 - 1e-12
_UNIT_ROUNDOFF = float(np.finfo(np.float64).eps) / 2  # 2^-53


def _vector_norms(rows):
    """Plain Euclidean norms of the rows of a B x d tensor (the default ``euclidean`` for rows)."""
    import torch

    return torch.linalg.vector_norm(rows, dim=1)


@dataclass(frozen=True)
class Unbounded:
    """All of R^d: the plain question."""

    bounded = False
    polyhedral = True  # R^d is a polyhedron: its problems are linear programs

    def __str__(self) -> str:
        return "unbounded"

    def support(self, v: np.ndarray) -> float:
        """s_D(v): 0 for v = 0, infinite otherwise."""
        return 0.0 if not np.any(v) else math.inf

    def largest_scale(self, direction: np.ndarray) -> float:
        """The largest s with s * direction in D: unlimited."""
        return math.inf

    def contains(self, z: np.ndarray, euclidean=None) -> bool:
        """Every point lies in R^d."""
        return True

    def contains_rows(self, z, euclidean=None):
        """Membership of each row of a B x d tensor: all True."""
        import torch

        return torch.ones(z.shape[0], dtype=torch.bool, device=z.device)

    def scaled(self, exponent: int) -> Unbounded:
        """The domain after scaling every point by 2^exponent: itself."""
        return self


@dataclass(frozen=True)
class _Radial:
    """r times the unit ball of a norm; subclasses give the norm (``gauge``) and its dual."""

    radius: float
    bounded = True

    def support(self, v: np.ndarray, euclidean=np.linalg.norm) -> float:
        """s_D(v) = r ||v||_*, as computed (no rounding bound)."""
        return self.radius * self.dual_norm(v, euclidean)

    def support_rows(self, v, euclidean=_vector_norms):
        """s_D of each row of a B x d tensor: r ||v_j||_*."""
        return self.radius * self.dual_norm_rows(v, euclidean)

    def largest_scale(self, direction: np.ndarray) -> float:
        """The largest s with s * direction inside D, a hair short of the boundary (inf for 0)."""
        size = self.gauge(direction)
        return math.inf if size == 0 else _INSIDE * self.radius / size

    def largest_scales(self, directions):
        """largest_scale of each row of a B x d tensor, 1 for a zero row (float64, the rows' device)."""
        import torch

        reach = self.gauge_rows(directions)
        ones = torch.ones(directions.shape[0], dtype=torch.float64, device=directions.device)
        return torch.where(reach > 0, _INSIDE * self.radius / reach, ones)

    def contains_rows(self, z, euclidean=_vector_norms):
        """Membership of each row of a B x d tensor (a bool tensor)."""
        return self.gauge_rows(z, euclidean) <= self.radius

    def scaled(self, exponent: int):
        """The domain after scaling every point by 2^exponent (exact: the radius moves by a power of two)."""
        return type(self)(math.ldexp(self.radius, exponent))


@dataclass(frozen=True)
class Ball(_Radial):
    """Hidden states of Euclidean norm at most ``radius``."""

    polyhedral = False  # a second-order cone: its problems go to a conic solver

    def __post_init__(self):
        _check_radius(self.radius, "ball")

    def __str__(self) -> str:
        return f"ball:{_exact(self.radius)}"

    def gauge(self, z: np.ndarray, euclidean=np.linalg.norm) -> float:
        """||z||, the norm whose ball of radius r is D."""
        return float(euclidean(z))

    def gauge_rows(self, z, euclidean=_vector_norms):
        """||z_j|| for each row of a B x d tensor."""
        return euclidean(z)

    def dual_norm(self, v: np.ndarray, euclidean=np.linalg.norm) -> float:
        """||v||, the norm dual to the gauge (the ball's is its own)."""
        return float(euclidean(v))

    def dual_norm_rows(self, v, euclidean=_vector_norms):
        """||v_j|| for each row of a B x d tensor."""
        return euclidean(v)

    def contains(self, z: np.ndarray, euclidean=np.linalg.norm) -> bool:
        """Whether ||z|| <= r, with ||z|| computed by ``euclidean``."""
        return float(euclidean(z)) <= self.radius

    def support_bound(self, offset: np.ndarray, error: float, length: float) -> float:
        """A bound on s_D(x) for every x with ||x - offset|| <= error and ||x|| <= ``length``: r * length."""
        return self.radius * length

    def support_exactly_at_most(self, x: list, bound) -> bool:
        """Whether r ||x|| <= bound in rational arithmetic: bound >= 0 and r^2 ||x||^2 <= bound^2."""
        from fractions import Fraction

        r = Fraction(float(self.radius))
        return bound >= 0 and r * r * sum(v * v for v in x) <= bound * bound

    def project_rows(self, z):
        """Each row of a B x d tensor scaled onto a sphere a hair inside D if it lies outside, so that
        rounding cannot carry it out."""
        import torch

        norm = torch.linalg.vector_norm(z, dim=1, keepdim=True)
        return z * torch.clamp(_INSIDE * self.radius / torch.clamp(norm, min=1e-300), max=1.0)

    def constraints(self, z) -> list:
        """z in D for a cvxpy variable z."""
        import cvxpy as cp

        return [cp.norm(z, 2) <= self.radius]

    def reach(self, d: int) -> float:
        """The largest Euclidean norm of a point of the domain in R^d."""
        return self.radius


@dataclass(frozen=True)
class Box(_Radial):
    """Hidden states with every coordinate in ``[-radius, radius]``."""

    polyhedral = True  # its problems are linear programs

    def __post_init__(self):
        _check_radius(self.radius, "box")

    def __str__(self) -> str:
        return f"box:{_exact(self.radius)}"

    def gauge(self, z: np.ndarray, euclidean=None) -> float:
        """max_j |z_j|, the norm whose ball of radius r is D (0 in R^0)."""
        return float(np.abs(z).max()) if z.size else 0.0

    def gauge_rows(self, z, euclidean=None):
        """max_j |z_j| for each row of a B x d tensor."""
        return z.abs().amax(dim=1)

    def dual_norm(self, v: np.ndarray, euclidean=None) -> float:
        """||v||_1, the norm dual to the largest coordinate."""
        return float(np.abs(v).sum())

    def dual_norm_rows(self, v, euclidean=None):
        """||v_j||_1 for each row of a B x d tensor."""
        return v.abs().sum(dim=1)

    def contains(self, z: np.ndarray, euclidean=None) -> bool:
        """Whether every |z_j| <= r."""
        return bool(np.all(np.abs(z) <= self.radius))

    def support_bound(self, offset: np.ndarray, error: float, length: float) -> float:
        """A bound on s_D(x) for every x with ||x - offset|| <= error: r (||offset||_1 (1 + gamma_d) + sqrt(d) error),
        gamma_d covering the rounding of the computed l1 norm and sqrt(d) the l1 size of a Euclidean error."""
        d = offset.size
        gamma = d * _UNIT_ROUNDOFF / (1.0 - d * _UNIT_ROUNDOFF)
        return self.radius * (float(np.abs(offset).sum()) * (1 + gamma) + math.sqrt(d) * error)

    def support_exactly_at_most(self, x: list, bound) -> bool:
        """Whether r ||x||_1 <= bound in rational arithmetic."""
        from fractions import Fraction

        return Fraction(float(self.radius)) * sum(abs(v) for v in x) <= bound

    def project_rows(self, z):
        """Each row of a B x d tensor with its coordinates clamped into [-r, r]."""
        return z.clamp(-self.radius, self.radius)

    def constraints(self, z) -> list:
        """z in D for a cvxpy variable z, as two sets of linear inequalities."""
        return [z <= self.radius, z >= -self.radius]

    def reach(self, d: int) -> float:
        """The largest Euclidean norm of a point of the domain in R^d: a corner's."""
        return self.radius * math.sqrt(d)


@dataclass(frozen=True)
class Norm:
    """The outputs of the checkpoint's final LayerNorm or RMSNorm (see auditor/question/norm.py); the engine sees
    the ball of the reduced head instead."""

    bounded = True

    def __str__(self) -> str:
        return "norm"

    def contains(self, z, euclidean=None) -> bool:
        """Membership is by construction: every witness is the norm of a pre-norm vector."""
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
