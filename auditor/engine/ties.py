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
    generator = torch.Generator().manual_seed(0x5EED)
    multipliers = torch.randint(-2**62, 2**62, (weight.shape[1],), generator=generator, dtype=torch.int64)
    multipliers = (multipliers | 1).to(weight.device)  # odd: every bit of every entry matters
    out = torch.empty(weight.shape[0], dtype=torch.int64, device=weight.device)
    for s in range(0, weight.shape[0], _BLOCK_ROWS):
        block = weight[s:s + _BLOCK_ROWS] + 0.0  # -0.0 + 0.0 = 0.0
        bits = block.contiguous().view(_BITS[block.dtype]).to(torch.int64)
        out[s:s + _BLOCK_ROWS] = (bits * multipliers).sum(dim=1)  # wraps modulo 2^64: still a hash
    return out.cpu().numpy()


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
