"""Reading a head's rows: a block at a time, and exactly into float64 from any float dtype.

Every float16, bfloat16 and float32 value is exactly a float64 value, so these
conversions lose nothing: whatever is computed from the float64 rows is about
the very weights stored. Walking in blocks keeps the float64 copy to one block
of a head that may be stored in half the bytes.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch


def as_float64(array) -> np.ndarray:
    """A float64 numpy copy of a numpy array or torch tensor of any float dtype (bfloat16 included)."""
    if isinstance(array, torch.Tensor):
        return array.detach().to(torch.float64).cpu().numpy()
    array = np.asarray(array)
    if array.dtype.name == "bfloat16":  # ml_dtypes' bfloat16: float32 holds it exactly
        array = array.astype(np.float32)
    return array.astype(np.float64)


def row_blocks(weight, rows: int) -> Iterator[tuple[int, int, torch.Tensor | np.ndarray]]:
    """(start, stop, rows start..stop-1 in float64), ``rows`` rows at a time.

    A torch tensor gives float64 tensors on its own device; anything else gives float64 numpy arrays.
    """
    n = int(weight.shape[0])
    step = max(1, int(rows))
    for start in range(0, n, step):
        stop = min(n, start + step)
        block = weight[start:stop]
        if isinstance(block, torch.Tensor):
            yield start, stop, block.detach().to(torch.float64)
        else:
            yield start, stop, as_float64(block)
