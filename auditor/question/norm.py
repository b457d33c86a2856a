"""The ``norm`` domain: the hidden states a checkpoint's final LayerNorm or RMSNorm can output.

LayerNorm maps x to z = g (x - mean x) / sqrt(var x + eps) + beta. Its
normalised part u = (x - mean x) / sqrt(var x + eps) is orthogonal to the
all-ones vector and has ||u||^2 = d var / (var + eps): with eps > 0 every
length below sqrt(d) is reached (small variances give short u), none at or
above it. So the outputs are exactly { g u + beta : u . 1 = 0, ||u|| < sqrt(d) },
an open ball in a subspace, mapped affinely. RMSNorm (z = g x / sqrt(mean x^2 + eps))
gives { g u : ||u|| < sqrt(d) } the same way, without the subspace and beta.

A strict win is an open condition, so a token wins somewhere in the open ball
iff it wins somewhere in its closure. With P the projection onto the
subspace, the logits are W (g u + beta) + b = (W diag(g) P) u + (W beta + b),
so the norm domain is the ball of radius sqrt(d) for the reduced head
W_r = W diag(g) P (rows g * w_i minus their mean, for LayerNorm) and
b_r = W beta + b. The engine decides that; a witness u is turned back into a
pre-norm vector x = c u with c = sqrt(eps / (1 - ||u||^2 / d)), pushed through
the norm in float64 and checked against the original head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from auditor.errors import InputError
from auditor.util.input import prepare_vector

KINDS = ("layernorm", "rmsnorm")

# How far the norm's exact output for the reported pre-norm vector x may be from the engine's
# point y, relative to ||y||: NormMap.outputs centres y, scales it by c = sqrt(eps / (1 - ||u||^2 / d))
# and the norm divides it by sqrt(var + eps) again, each a few d roundings of unit 2^-53 (at most
# 8 (d + 8) of them in all), plus the 1e-12 pull inside the sphere. The engine adds this times
# ||w_i|| to each reduced row's error bound, so that its float64 check of y proves the win at x.
_U = float(np.finfo(np.float64).eps) / 2  # float64's unit roundoff, 2^-53
OUTPUT_ERROR_PER_DIMENSION = 8 * _U


@dataclass
class FinalNorm:
    """The normalisation applied to the hidden state right before the head.

    ``kind`` is ``"layernorm"`` (z = g (x - mean x) / sqrt(var x + eps) + beta) or
    ``"rmsnorm"`` (z = g x / sqrt(mean x^2 + eps)); ``weight`` is g and ``bias``
    beta (None: zero). ``unit_offset`` says the stored weight is g - 1 (the
    convention of Gemma and some others: the layer multiplies by 1 + weight).
    """

    kind: str
    weight: Any = None
    bias: Any = None
    eps: float = 1e-5
    unit_offset: bool = False
    names: tuple[str, ...] = ()


@dataclass
class ReducedHead:
    weight: torch.Tensor  # n x d: W diag(g) P
    bias: torch.Tensor  # n: W beta + b
    row_error: torch.Tensor  # n: bound on || computed row - exact row ||
    bias_error: torch.Tensor  # n: bound on | computed bias - exact bias |
    gain: torch.Tensor  # d: g (with the unit offset applied)
    shift: torch.Tensor  # d: beta
    radius: float  # sqrt(d)


def check_final_norm(norm: FinalNorm, d: int) -> None:
    if not isinstance(norm, FinalNorm):
        raise InputError("domain 'norm' needs final_norm=auditor.FinalNorm(kind, weight=..., bias=..., eps=...)")
    if norm.kind not in KINDS:
        raise InputError(f"unknown final norm kind {norm.kind!r}; use 'layernorm' or 'rmsnorm'")
    if not (isinstance(norm.eps, (int, float)) and math.isfinite(norm.eps) and norm.eps > 0):
        raise InputError(f"the final norm's eps must be a positive number, got {norm.eps!r}")


def reduce_head(weight: torch.Tensor, bias: torch.Tensor | None, norm: FinalNorm) -> ReducedHead:
    """The head seen from the normalised vector u (see the module docstring), with rounding bounds."""
    n, d = weight.shape
    check_final_norm(norm, d)
    device = weight.device
    gain = prepare_vector(norm.weight, d, "the final norm's weight", device) if norm.weight is not None \
        else torch.ones(d, dtype=torch.float64, device=device)
    if norm.unit_offset:
        gain = 1.0 + gain
    shift = prepare_vector(norm.bias, d, "the final norm's bias", device) if norm.bias is not None \
        else torch.zeros(d, dtype=torch.float64, device=device)
    if norm.kind == "rmsnorm" and bool(shift.any()):
        raise InputError("an RMSNorm has no bias; use kind='layernorm' for a norm with one")
    u = _U
    scaled = weight * gain
    if norm.kind == "layernorm":
        reduced = scaled - scaled.mean(dim=1, keepdim=True)
        # product, mean (d terms) and subtraction: (d + 3) roundings of entries at most max|g w_i|
        peak = scaled.abs().amax(dim=1)
        row_error = 2 * (d + 3) * u * peak * math.sqrt(d)
    else:
        reduced = scaled
        row_error = u * torch.linalg.vector_norm(scaled, dim=1)
    offset = weight @ shift
    bias_error = 2 * (d + 2) * u * (weight.abs() @ shift.abs())
    if bias is not None:
        offset = offset + bias
        bias_error = bias_error + u * bias.abs()
    return ReducedHead(reduced, offset, row_error, bias_error, gain, shift, math.sqrt(d))


def pre_norm(u: np.ndarray, norm: FinalNorm) -> np.ndarray:
    """A vector x whose normalised part is u (||u|| < sqrt(d); for LayerNorm u must sum to 0)."""
    d = u.shape[0]
    fill = float(u @ u) / d
    if fill >= 1.0:
        raise ValueError("the normalised part of an output has length below sqrt(d)")
    return math.sqrt(norm.eps / (1.0 - fill)) * u


def apply_norm(x: np.ndarray, norm: FinalNorm, gain: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """The norm's output for x, in float64, as the layer computes it."""
    if norm.kind == "layernorm":
        centred = x - x.mean()
        return gain * (centred / math.sqrt(float(centred @ centred) / x.shape[0] + norm.eps)) + shift
    return gain * (x / math.sqrt(float(x @ x) / x.shape[0] + norm.eps))


def output_error(d: int) -> float:
    return OUTPUT_ERROR_PER_DIMENSION * (d + 8) + 2e-12


class NormMap:
    """Turns a witness of the reduced head (a point y of the ball) into the model's terms."""

    def __init__(self, norm: FinalNorm, reduced: ReducedHead):
        self.norm = norm
        self.gain = reduced.gain.cpu().numpy()
        self.shift = reduced.shift.cpu().numpy()
        self.reduced_rows = reduced.weight.cpu()  # the rows the engine's witness formula refers to
        # the largest norm of an output: ||g * u + beta|| <= max|g| sqrt(d) + ||beta||
        self.reach = float(np.abs(self.gain).max()) * reduced.radius + float(np.linalg.norm(self.shift))

    def row(self, k: int) -> np.ndarray:
        return self.reduced_rows[k].numpy()

    def outputs(self, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(pre-norm x, normalised output z) for the engine's witness y."""
        u = y - y.mean() if self.norm.kind == "layernorm" else y
        radius2 = u.shape[0]
        if float(u @ u) >= radius2:  # rounding put it on the sphere: pull it just inside
            u = u * (1 - 1e-12) * math.sqrt(radius2 / float(u @ u))
        x = pre_norm(u, self.norm)
        return x, apply_norm(x, self.norm, self.gain, self.shift)


def exact_ties(weight: torch.Tensor, bias: torch.Tensor | None, reduced: ReducedHead, norm: FinalNorm) -> np.ndarray:
    """``representative[i]``: the smallest id whose logits equal row i's at every output of the norm.

    Rows i and j tie there iff g * (w_i - w_j) is a multiple of the all-ones vector
    (zero for RMSNorm) and (w_i - w_j) . beta + b_i - b_j = 0: their reduced rows and
    biases are then equal in exact arithmetic, though their rounded ones may differ.
    Candidates are rows whose reduced rows project to within their error bounds of
    each other along one fixed random direction; each candidate pair is then
    compared exactly, in rational arithmetic, so rounding can neither make nor
    break a tie.
    """
    n, d = reduced.weight.shape
    generator = torch.Generator().manual_seed(0x7115)
    direction = torch.randn(d + 1, generator=generator, dtype=torch.float64).to(reduced.weight.device)
    keys = reduced.weight @ direction[:d] + reduced.bias * direction[d]
    spread = (reduced.weight.abs() @ direction[:d].abs() + reduced.bias.abs() * direction[d].abs())
    # each key within this of the exact rows' key: the derived rows' error, and the projection's own rounding
    slack = (reduced.row_error * float(torch.linalg.vector_norm(direction[:d])) + reduced.bias_error * abs(float(direction[d]))
             + 2 * (d + 2) * _U * spread) * 2 + 1e-300
    keys, slack = keys.cpu().numpy(), slack.cpu().numpy()
    order = np.argsort(keys, kind="stable")
    representative = np.arange(n, dtype=np.int64)
    exact = _ExactRows(weight, bias, reduced, norm)
    start = 0
    for stop in range(1, n + 1):  # runs of keys each within reach of the previous one
        if stop < n and keys[order[stop]] - keys[order[stop - 1]] <= slack[order[stop]] + slack[order[stop - 1]]:
            continue
        if stop - start > 1:
            members = np.sort(order[start:stop])
            leaders: list[int] = []
            for i in members.tolist():
                for j in leaders:
                    if exact.tied(i, j):
                        representative[i] = j
                        break
                else:
                    leaders.append(i)
        start = stop
    return representative


class _ExactRows:
    """The tie test of ``exact_ties`` on pairs of rows, in rational arithmetic."""

    def __init__(self, weight, bias, reduced: ReducedHead, norm: FinalNorm):
        from fractions import Fraction

        self.fraction = Fraction
        self.weight = weight
        self.bias = bias
        self.layernorm = norm.kind == "layernorm"
        self.gain = [Fraction(float(v)) for v in reduced.gain.cpu().numpy()]
        self.shift = [Fraction(float(v)) for v in reduced.shift.cpu().numpy()]

    def tied(self, i: int, j: int) -> bool:
        F = self.fraction
        row_i = self.weight[i].cpu().numpy()
        row_j = self.weight[j].cpu().numpy()
        offset = (F(float(self.bias[i])) - F(float(self.bias[j]))) if self.bias is not None else F(0)
        if np.array_equal(row_i, row_j):
            return offset == 0
        diff = [F(float(a)) - F(float(b)) for a, b in zip(row_i, row_j)]
        scaled = [g * x for g, x in zip(self.gain, diff)]
        flat = all(v == scaled[0] for v in scaled) if self.layernorm else all(v == 0 for v in scaled)
        return flat and sum(x * s for x, s in zip(diff, self.shift)) + offset == 0
