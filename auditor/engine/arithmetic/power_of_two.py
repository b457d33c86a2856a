"""Multiplying by powers of two exactly: numbers and tensors, and the scaled copy of a head's rows.

A product with 2^e rounds only where it overflows or lands below the normal
range; each function here either proves that it did not or takes an exact route.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from auditor.errors import InputError


def halves(e: int) -> tuple[float, float]:
    """2^(e // 2) and 2^(e - e // 2): their product is 2^e, which alone may not be a float64 (2^1074)."""
    return math.ldexp(1.0, e // 2), math.ldexp(1.0, e - e // 2)


def power(e: int) -> float:
    first, second = halves(e)
    return first * second


def times_power_of_two(x, e: int):
    """x 2^e in two exact steps (a number, a numpy array or a tensor)."""
    first, second = halves(e)
    return x * first * second


def cache_rows(d: int) -> int:
    """Rows of float64 scratch that fit a core's cache (1 MiB): a pass over the head through buffers of this
    size runs about half again as fast as one through fresh 2048-row blocks."""
    return max(16, (1 << 17) // max(d, 1))


def scaled_exactly(t: torch.Tensor, e: int, what: str, centre: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(t 2^e checked exact (no entry under- or overflowed) by scaling back, and with ``centre`` (float64)
    the float64 products of the scaled rows with ``centre`` rounded to their dtype, formed while each block
    is at hand). By blocks of rows, so that the one copy made is the result (a float32 tensor whose scaled
    entries only float64 holds exactly is converted first). ``what`` names the tensor in the error raised
    where float64 cannot hold it either."""
    if e == 0 and centre is None:
        return t, None
    # one factor 2^e where it and 2^-e are normal numbers of the dtype (a float32 tensor takes a Python
    # factor as float32), else two exact steps
    smallest = -np.finfo(np.float32 if t.dtype == torch.float32 else np.float64).minexp
    factors = (math.ldexp(1.0, e),) if abs(e) < smallest else halves(e)
    tiny = float(torch.finfo(t.dtype).tiny)
    result = torch.empty_like(t) if e != 0 else t
    products = None
    if centre is not None:
        witness = centre.to(t.dtype).to(torch.float64)
        products = torch.empty(t.shape[0], dtype=torch.float64, device=t.device)
    step = 4 * cache_rows(t.shape[1] if t.dim() > 1 else 1)  # float32 rows: about 512 at d = 1024
    wide = torch.empty((step,) + tuple(t.shape[1:]), dtype=torch.float64, device=t.device) if centre is not None else None
    magnitude = torch.empty((step,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    for s in range(0, t.shape[0], step):
        block = t[s:s + step]
        part = result[s:s + step]
        if e != 0:
            torch.mul(block, factors[0], out=part)
            for f in factors[1:]:
                part.mul_(f)
            if (not surely_exact(block, part, e, tiny, magnitude[:block.shape[0]])
                    and not torch.equal(times_power_of_two(part, -e), block)):
                if t.dtype == torch.float32:  # float32's narrower range: float64 holds it exactly
                    del result
                    return scaled_exactly(t.to(torch.float64), e, what, centre)
                raise InputError(f"the {what} spans more orders of magnitude than float64 can hold exactly "
                                 f"(largest entry {float(t.abs().max()):.3g}); rescale it")
        if products is not None:
            x = wide[:block.shape[0]]
            x.copy_(part)
            torch.mv(x, witness, out=products[s:s + step])
    return result, products


def float32_times_power(x: torch.Tensor, e: int) -> torch.Tensor | None:
    """2^e fl32(x) as a float32 array, or None where that is not exact (an entry overflows or loses bits
    below the normal range). Then its products with v are those of fl32(x) with 2^e v: the same real numbers,
    rounded alike, so a product with rows stored as 2^-e w needs no scaled copy of them."""
    wide = x.to(torch.float32).to(torch.float64) * math.ldexp(1.0, e)  # exact in float64
    narrow = wide.to(torch.float32)
    return narrow if bool(torch.isfinite(narrow).all()) and torch.equal(narrow.to(torch.float64), wide) else None


def surely_exact(block: torch.Tensor, part: torch.Tensor, e: int, tiny: float, scratch: torch.Tensor) -> bool:
    """Whether ``part`` = ``block`` 2^e was exact for every entry, read off the results: a product with 2^e
    rounds only when it overflows or lands below the normal range (for e < 0, where the input's low bits
    may fall off); a finite result above ``tiny`` throughout proves it, one pass (the exact product then
    lay above tiny: rounding is monotone; one that lay a hair below may round up to tiny itself). False:
    the slow check decides."""
    low, high = torch.aminmax(torch.abs(part, out=scratch))
    if not bool(torch.isfinite(high)):
        return False
    if e > 0 or float(low) > tiny:
        return True
    if float(low) == 0:  # the input's zeros scale exactly (a translated head has one in each column): the
        # rest decide; a zero from a nonzero input (an underflow) stays and fails the test
        low = scratch.masked_fill_(block == 0, torch.inf).amin()
    return float(low) > tiny


def centre_products(t: torch.Tensor, centre: torch.Tensor, e: int) -> tuple[torch.Tensor, float]:
    """(the float64 products of the float32 rows 2^e t_i with ``centre`` rounded to float32, and for e < 0 the
    smallest nonzero |t_ij| (inf when every entry is 0; 0.0 for e >= 0, not measured)), by blocks, without the
    scaled rows: t_i . c is formed and scaled instead, bit for bit the same numbers. Every product of two float32
    entries is exact in float64 and a multiple of 2^-298, and so is every nonzero partial sum (at least 2^-298,
    and less than 2^256 n d): none is subnormal at either scale (2^e t within float32's range keeps |e| below
    280), and a power of two commutes with each rounding."""
    witness = centre.to(torch.float32).to(torch.float64)
    products = torch.empty(t.shape[0], dtype=torch.float64, device=t.device)
    step = 4 * cache_rows(t.shape[1])
    wide = torch.empty((step, t.shape[1]), dtype=torch.float64, device=t.device)
    magnitude = torch.empty((step, t.shape[1]), dtype=t.dtype, device=t.device) if e < 0 else None
    smallest = math.inf if e < 0 else 0.0
    for s in range(0, t.shape[0], step):
        block = t[s:s + step]
        x = wide[:block.shape[0]]
        x.copy_(block)
        torch.mv(x, witness, out=products[s:s + step])
        if magnitude is not None:
            size = torch.abs(block, out=magnitude[:block.shape[0]])
            low = float(size.amin())
            if low == 0:  # zeros scale exactly: the nonzero entries decide
                low = float(size.masked_fill_(block == 0, torch.inf).amin())
            smallest = min(smallest, low)
    return times_power_of_two(products, e), smallest


def normalised_points(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(2^s z, 2^-s) for B x d float64 points z, s >= 0 per point: a point whose largest entry lies below 1/2
    is scaled up (exactly) until it lies in [1/2, 1); others keep s = 0 ((z, None) when every point does). Products of the float32 rounding of
    2^s z, scaled back by 2^-s in float64 (exact but where they fall below float64's normal range, which
    its own floor covers), keep the float32 bounds of a point of that size. Without it a tiny point's
    entries round to float32 subnormals, an absolute error that a far row's ||w_i||_1 multiplies beyond
    fast_error_factor and the floor (a point of 2^-140 against a row 64 times the typical: twice the bound).
    For a point of largest entry at least 1/2 such an error is below 2^-149 sqrt(d) of ||w_i|| ||z||,
    which the factor's allowance for rounding z (2u) holds many times over."""
    if not z.numel():
        return z, None
    if z.shape[0] == 1:  # one point: in Python numbers, without the tensor operations a batch pays for
        peak = float(z.abs().max())
        if peak >= 0.5 or peak == 0:
            return z, None
        first, second = halves(-math.frexp(peak)[1])  # 2^s in two exact steps
        return z * first * second, torch.full((1,), 1.0 / first / second, dtype=z.dtype, device=z.device)
    peak = z.abs().amax(dim=1)
    if bool(((peak >= 0.5) | (peak == 0)).all()):  # the common case, one test: nothing to scale
        return z, None
    _, exponent = torch.frexp(peak)  # peak = m 2^e, m in [1/2, 1); a zero point gives e = 0
    up = torch.clamp(-exponent.to(torch.int64), min=0)
    half = up // 2  # two steps: 2^s alone may leave float64's normal range (s up to 1073)
    first, second = _power_of_two(half), _power_of_two(up - half)
    scaled = z * first[:, None] * second[:, None]  # exact: scaled up, nothing overflows
    return scaled, 1.0 / first / second  # powers of two: 2^-s, held exactly (at least 2^-1073)


def _power_of_two(k: torch.Tensor) -> torch.Tensor:
    """2^k as float64 for integers 0 <= k <= 1023, from the bits (torch.ldexp computes 2^k in the default dtype)."""
    return ((k + 1023) << 52).view(torch.float64)
