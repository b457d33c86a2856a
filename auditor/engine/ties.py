"""Exact duplicate rows: tokens whose weight row and bias are bit-for-bit equal in value.

Two such tokens always have equal logits, so neither can ever win strictly.
The engine decides one representative per group (the smallest id) against the
other distinct rows; the answer tells whether the group as a whole could win.
"""

from __future__ import annotations

import numpy as np
import torch


def duplicate_groups(weight: torch.Tensor, bias: torch.Tensor | None) -> np.ndarray:
    """Return ``representative[i]``: the smallest id whose row (and bias) equals row i."""
    rows = weight if bias is None else torch.cat([weight, bias[:, None]], dim=1)
    # Comparing values (not bytes) makes -0.0 equal to 0.0, as the logits are.
    _, inverse = torch.unique(rows, dim=0, return_inverse=True)
    inverse = inverse.cpu().numpy()
    n = inverse.shape[0]
    first = np.full(int(inverse.max()) + 1, n, dtype=np.int64)
    np.minimum.at(first, inverse, np.arange(n, dtype=np.int64))
    return first[inverse]
