"""The sets of hidden states a token may be argmaxed over, each with the operations the solvers need on it.

Every bounded domain here is r times the unit ball of a norm: the Euclidean
norm for Ball, the largest coordinate for Box. Its support function is
``s_D(v) = sup_{z in D} v.z = r ||v||_*`` with the dual norm (l2 for Ball, l1
for Box), which the dual certificates need; the norm itself ("gauge")
decides membership and how far a direction can be scaled and stay inside,
which turns a winning direction into a witness.

The orthant ``NonNeg`` (z >= 0, optionally with ||z|| <= r) is not a ball of a norm: its support function
is 0 or infinite (unbounded) or ``r ||v_+||`` (bounded), v_+ the positive part of v, since the best
z >= 0 of norm at most r puts its weight on v's positive coordinates only.

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
    orthant = False  # z >= 0 (NonNeg)

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
    orthant = False

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
    orthant = False

    def __str__(self) -> str:
        return "norm"

    def contains(self, z, euclidean=None) -> bool:
        """Membership is by construction: every witness is the norm of a pre-norm vector."""
        return True


@dataclass(frozen=True)
class NonNeg:
    """Hidden states with every coordinate at least 0 (a ReLU's or a pooled ReLU's outputs), and of Euclidean
    norm at most ``radius`` when one is given."""

    radius: float | None = None
    orthant = True

    def __post_init__(self):
        if self.radius is not None:
            _check_radius(self.radius, "nonneg")

    @property
    def bounded(self) -> bool:
        return self.radius is not None

    @property
    def polyhedral(self) -> bool:  # with a radius, a second-order cone cut by the orthant
        return self.radius is None

    def __str__(self) -> str:
        return "nonneg" if self.radius is None else f"nonneg:{_exact(self.radius)}"

    def support(self, v: np.ndarray, euclidean=np.linalg.norm) -> float:
        """s_D(v): unbounded 0 when v <= 0 and infinite otherwise; bounded r ||v_+||, as computed."""
        positive = np.maximum(v, 0.0)
        if self.radius is None:
            return 0.0 if not np.any(positive) else math.inf
        return self.radius * float(euclidean(positive))

    def largest_scale(self, direction: np.ndarray) -> float:
        """The largest s with s * direction inside the ball a hair short of its boundary (the caller's
        direction is non-negative); unlimited without a radius or for 0."""
        size = float(np.linalg.norm(direction))
        return math.inf if self.radius is None or size == 0 else _INSIDE * self.radius / size

    def largest_scales(self, directions):
        """largest_scale of each row of a B x d tensor, 1 for a zero row (float64, the rows' device)."""
        import torch

        reach = _vector_norms(directions)
        ones = torch.ones(directions.shape[0], dtype=torch.float64, device=directions.device)
        return torch.where(reach > 0, _INSIDE * self.radius / reach, ones)

    def contains(self, z: np.ndarray, euclidean=np.linalg.norm) -> bool:
        """Whether every z_j >= 0 (NaN fails) and, with a radius, ||z|| <= r."""
        z = np.asarray(z)
        return bool(np.all(z >= 0)) and (self.radius is None or float(euclidean(z)) <= self.radius)

    def contains_rows(self, z, euclidean=_vector_norms):
        """Membership of each row of a B x d tensor (a bool tensor)."""
        inside = (z >= 0).all(dim=1)
        if self.radius is not None:
            inside = inside & (euclidean(z) <= self.radius)
        return inside

    def scaled(self, exponent: int) -> NonNeg:
        """The domain after scaling every point by 2^exponent (exact)."""
        return self if self.radius is None else NonNeg(math.ldexp(self.radius, exponent))

    def support_bound(self, offset: np.ndarray, error: float, length: float) -> float:
        """A bound on s_D(x) = r ||x_+|| for every x with ||x - offset|| <= error and ||x_+|| <= ``length``:
        r * length (the caller bounds the positive part's norm, without underflow, the error included)."""
        return self.radius * length

    def support_exactly_at_most(self, x: list, bound) -> bool:
        """Whether r ||x_+|| <= bound in rational arithmetic: bound >= 0 and r^2 ||x_+||^2 <= bound^2."""
        from fractions import Fraction

        r = Fraction(float(self.radius))
        return bound >= 0 and r * r * sum(v * v for v in x if v > 0) <= bound * bound

    def project_rows(self, z):
        """Each row of a B x d tensor clamped to z >= 0, then (with a radius) scaled a hair inside the ball."""
        import torch

        z = z.clamp(min=0)
        if self.radius is None:
            return z
        norm = torch.linalg.vector_norm(z, dim=1, keepdim=True)
        return z * torch.clamp(_INSIDE * self.radius / torch.clamp(norm, min=1e-300), max=1.0)

    def constraints(self, z) -> list:
        """z in D for a cvxpy variable z."""
        import cvxpy as cp

        return [z >= 0] + ([] if self.radius is None else [cp.norm(z, 2) <= self.radius])

    def reach(self, d: int) -> float:
        """The largest Euclidean norm of a point of the domain."""
        return math.inf if self.radius is None else self.radius


Domain = Unbounded | Ball | Box | Norm | NonNeg


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


_KNOWN = "use 'unbounded', 'ball:R', 'box:R', 'norm', 'nonneg' or 'nonneg:R'"


def parse_domain(spec: str | Domain) -> Domain:
    """Turn ``"unbounded"``, ``"ball:R"``, ``"box:R"``, ``"norm"``, ``"nonneg"`` or ``"nonneg:R"`` into a domain
    object.

    Domain objects pass through unchanged. Raises InputError for anything else.
    """
    if isinstance(spec, (Unbounded, Ball, Box, Norm, NonNeg)):
        return spec
    if not isinstance(spec, str):
        raise InputError(f"unknown domain {spec!r}: {_KNOWN}")
    text = spec.strip().lower()
    if text == "unbounded":
        return Unbounded()
    if text == "norm":
        return Norm()
    if text == "nonneg":
        return NonNeg()
    kind, _, radius = text.partition(":")
    if kind in ("ball", "box", "nonneg") and radius:
        try:
            value = float(radius)
        except ValueError:
            raise InputError(f"domain {spec!r}: the radius {radius!r} is not a number") from None
        return {"ball": Ball, "box": Box, "nonneg": NonNeg}[kind](value)
    raise InputError(f"unknown domain {spec!r}: {_KNOWN}")
