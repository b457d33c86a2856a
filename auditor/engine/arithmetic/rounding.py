"""Rigorous bounds on float64 rounding error, so that a computed margin proves a sign.

A dot product of length d computed in floating point (any order, with or
without fused multiply-add) is within gamma_d * |x|.|y| of the exact value,
gamma_d = d u / (1 - d u), u = 2^-53 (Higham, Accuracy and Stability of
Numerical Algorithms, 2nd ed., section 3.1). We bound |x|.|y| by ||x|| ||y||
(Cauchy-Schwarz) so that one norm per row serves every witness, allow four
more roundings for adding a bias, a shift and a scale, and double the result
to cover the rounding of the bound's own arithmetic and of storing the witness.
"""

from __future__ import annotations

import numpy as np
import torch


def unit_roundoff(dtype: torch.dtype) -> float:
    """u = 2^-p for a format of p significant bits (the implicit one included): half its machine epsilon,
    which finfo gives as 2^(1-p). The relative error of one rounding to nearest is at most u."""
    return float(torch.finfo(dtype).eps) / 2


def smallest_subnormal(dtype: torch.dtype) -> float:
    """The spacing of the format's numbers below its normal range: smallest normal times epsilon."""
    info = torch.finfo(dtype)
    return float(info.tiny) * float(info.eps)


def smallest_normal(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).tiny)


UNIT_ROUNDOFF = unit_roundoff(torch.float64)  # 2^-53
SMALLEST_SUBNORMAL = smallest_subnormal(torch.float64)  # 2^-1074
# The same constants for float32 arithmetic (the screening pass of float32 heads).
UNIT_ROUNDOFF_32 = unit_roundoff(torch.float32)  # 2^-24
SMALLEST_SUBNORMAL_32 = smallest_subnormal(torch.float32)  # 2^-149
SMALLEST_NORMAL_32 = smallest_normal(torch.float32)  # 2^-126, bfloat16's too
# bfloat16 keeps 8 significant bits: u = 2^-8
UNIT_ROUNDOFF_BF16 = unit_roundoff(torch.bfloat16)


def gamma(n: int, unit: float = UNIT_ROUNDOFF) -> float:
    return n * unit / (1.0 - n * unit)


def logit_error_factor(d: int, unit: float = UNIT_ROUNDOFF) -> float:
    """f such that a computed logit w.z + b is within f (||w|| ||z|| + |b|) of the exact one."""
    return 2.0 * gamma(d + 4, unit)


def underflow_floor(d: int, subnormal: float = SMALLEST_SUBNORMAL) -> float:
    """Absolute error a length-d dot product can add through gradual underflow (d + 4 products and sums, doubled)."""
    return 2.0 * (d + 4) * subnormal


def safe_norm(x, dim: int = -1):
    """Euclidean norms along ``dim`` that neither underflow nor overflow (the peak is divided out first)."""
    peak = x.abs().amax(dim=dim, keepdim=True)
    unit = x / torch.where(peak > 0, peak, torch.ones_like(peak))
    return peak.squeeze(dim) * torch.linalg.vector_norm(unit, dim=dim)


def float32_towards_zero(scale):
    """float32 values at most ``scale`` (positive float64 tensor), as float64: a witness scaled by them stays
    inside the domain, and a float32 pass multiplies by them exactly."""
    rounded = scale.to(torch.float32)
    high = rounded.to(torch.float64) > scale
    rounded[high] = torch.nextafter(rounded[high], torch.zeros_like(rounded[high]))
    return rounded.to(torch.float64)


def proves_positive(margin, tolerance, unit: float = UNIT_ROUNDOFF):
    """True where a computed difference is positive even after the worst rounding.

    ``margin`` is fl(l_k) - fl(l_i) and ``tolerance`` bounds the error of the two
    logits; the subtraction itself adds at most one rounding, the (1 - u) factor
    (u the unit roundoff of the arithmetic the subtraction was done in).
    Works on floats and on tensors alike.
    """
    return margin * (1.0 - unit) > tolerance


def proven_lower(margin, tolerance, unit: float = UNIT_ROUNDOFF):
    """A float64 number at most the exact difference whose computed value is ``margin``: the margin a
    witness states. ``margin`` and ``tolerance`` are as for proves_positive: the exact difference is at
    least margin - unit |margin| / (1 - unit) - tolerance, and this evaluates
    margin - 2 unit |margin| - tolerance, less 4 u (|margin| + tolerance) + 4 eta for its own float64
    rounding (two subtractions, each within u of its result, and an underflow at most eta each).
    Works on floats, numpy arrays and tensors alike."""
    size = abs(margin) + tolerance
    return (margin - 2 * unit * abs(margin) - tolerance) - 4 * UNIT_ROUNDOFF * size - 4 * SMALLEST_SUBNORMAL


def per_unit_norm(lead, norm_z, d: int):
    """``lead`` / ||z|| rounded down, for a lead that is a lower bound at z and ``norm_z`` a computed
    float64 norm of the d-vector z (safe_norm: within gamma_{d+4} of ||z||): the unit-ball margin a witness
    of an unbounded head without a bias states. The divisor is taken on the side of ||z|| that makes the
    quotient smaller (above it for a positive lead, below for a negative one), and the one rounding of
    the division is undone by stepping to the next float64 below. Floats, numpy arrays or tensors."""
    relative = gamma(d + 8)
    if isinstance(lead, torch.Tensor):
        norm_z = torch.as_tensor(norm_z, dtype=torch.float64, device=lead.device)
        size = torch.where(lead > 0, norm_z * (1 + relative), norm_z * (1 - relative))
        quotient = lead / size
        return torch.nextafter(quotient, torch.full_like(quotient, -torch.inf))
    lead, norm_z = np.asarray(lead, dtype=np.float64), np.asarray(norm_z, dtype=np.float64)
    size = np.where(lead > 0, norm_z * (1 + relative), norm_z * (1 - relative))
    with np.errstate(divide="ignore", invalid="ignore"):
        quotient = np.nextafter(lead / size, -np.inf)
    return quotient if quotient.ndim else float(quotient)


def rounded_down(x):
    """The next float64 below ``x`` (a tensor): at most the exact value of one correctly rounded operation."""
    return torch.nextafter(x, torch.full_like(x, -torch.inf))


def rounded_up(x):
    """The next float64 above ``x`` (a tensor): at least the exact value of one correctly rounded operation."""
    return torch.nextafter(x, torch.full_like(x, torch.inf))


class ieee_float32_products:
    """Keep float32 matrix products in float32 (no TF32 or bfloat16 stand-ins) inside the block: the
    float32 rounding bounds assume float32 inputs and float32 (or better) accumulation.

    torch has two ways to lower that precision: the global ``set_float32_matmul_precision`` and,
    newer, each backend's ``fp32_precision``. Once the second has been used, the first's getter
    raises; so the block sets whichever is in use, and puts back what it found."""

    def __enter__(self):
        self.legacy = None
        self.backends = []
        try:
            self.legacy = torch.get_float32_matmul_precision()
        except RuntimeError:  # the per-backend settings are in use
            for backend in (torch.backends.cuda.matmul, getattr(torch.backends.mkldnn, "matmul", None)):
                if backend is not None and hasattr(backend, "fp32_precision"):
                    self.backends.append((backend, backend.fp32_precision))
                    backend.fp32_precision = "ieee"
        else:
            torch.set_float32_matmul_precision("highest")
        return self

    def __exit__(self, *exc):
        if self.legacy is not None:
            torch.set_float32_matmul_precision(self.legacy)
        for backend, precision in reversed(self.backends):
            backend.fp32_precision = precision
