"""Exact duplicate rows: tokens whose weight row and bias are equal in value.

Two such tokens always have equal logits, so neither can ever win strictly.
The engine decides one representative per group (the smallest id) against the
other distinct rows; the answer tells whether the group as a whole could win.

Rows are grouped by an integer hash of their bits (after turning -0.0 into
0.0, so that equal values hash alike), by blocks of rows: no sorted copy of
the head. Rows that share a hash are then compared value by value, so a hash
collision can never make two different rows a tie.
"""

from __future__ import annotations

import numpy as np
import torch

_BLOCK_ROWS = 2048  # int64 bits of a block: 12 MiB at d = 768
_BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32,
         torch.float64: torch.int64}


def _row_hashes(weight: torch.Tensor) -> np.ndarray:
    """An integer hash of each row's bits: each entry's bits times an odd multiplier of their own width
    (wrapping: a bijection on those bits), summed with wrapping in 32 bits for float32 rows (a vectorised sum,
    twice as fast as int64's) and in 64 for float64. Equal rows hash alike; rows that collide are compared
    by value, so a narrower hash costs comparisons, never a verdict."""
    bits_dtype = _BITS[weight.dtype]
    generator = torch.Generator().manual_seed(0x5EED)
    multipliers = torch.randint(-2**62, 2**62, (weight.shape[1],), generator=generator, dtype=torch.int64)
    multipliers = (multipliers | 1).to(bits_dtype).to(weight.device)  # odd: every bit of every entry matters
    accumulate = torch.int64 if bits_dtype == torch.int64 else torch.int32
    out = torch.empty(weight.shape[0], dtype=accumulate, device=weight.device)
    # through a buffer that stays in a core's cache (1 MiB), reused block after block
    step = max(16, (1 << 20) // max(weight.shape[1] * weight.element_size(), 1))
    values = torch.empty(step, weight.shape[1], dtype=weight.dtype, device=weight.device)
    for s in range(0, weight.shape[0], step):
        block = weight[s:s + step]
        v = values[:block.shape[0]]
        torch.add(block, 0.0, out=v)  # -0.0 + 0.0 = 0.0
        bits = v.view(bits_dtype)
        bits.mul_(multipliers)  # in the buffer's own bits, wrapping: still a hash
        torch.sum(bits, dim=1, dtype=accumulate, out=out[s:s + step])
    return out.cpu().numpy().astype(np.int64)


def duplicate_groups(weight: torch.Tensor, bias: torch.Tensor | None) -> np.ndarray:
    """Return ``representative[i]``: the smallest id whose row (and bias) equals row i."""
    n = weight.shape[0]
    representative = np.arange(n, dtype=np.int64)
    hashes = _row_hashes(weight)
    if bias is not None:
        b = bias.cpu().numpy() + 0.0
        hashes = hashes ^ (b.view(np.int64) * np.int64(0x9E3779B97F4A7C15 - 2**64))
    order = np.argsort(hashes, kind="stable")
    sorted_hashes = hashes[order]
    starts = np.flatnonzero(np.r_[True, sorted_hashes[1:] != sorted_hashes[:-1]])
    sizes = np.diff(np.r_[starts, n])
    for start, size in zip(starts[sizes > 1].tolist(), sizes[sizes > 1].tolist()):
        members = order[start:start + size]  # ascending ids: the sort was stable
        rows = weight[torch.as_tensor(members, device=weight.device)]
        values = bias[torch.as_tensor(members, device=bias.device)] if bias is not None else None
        unmatched = list(range(size))
        while unmatched:  # compare values, not hashes; a collision leaves different rows apart
            first = unmatched[0]
            same = [m for m in unmatched if torch.equal(rows[m], rows[first])
                    and (values is None or bool(values[m] == values[first]))]
            representative[members[same]] = members[first]
            unmatched = [m for m in unmatched if m not in same]
    return representative
