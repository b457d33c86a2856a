"""Per-row and per-column facts of a head, found by blocks of rows: norms, the median row, storage, the centre.

Every function reads the rows a block at a time (float64 blocks of _BLOCK_ROWS rows, or a few columns
at a time for the medians), so that no float64 copy of the whole head is made; norms that may have
underflowed are found again by safe_norm.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from auditor.engine.arithmetic.rounding import safe_norm
from auditor.util.arrays import row_blocks

_BLOCK_ROWS = 2048  # rows converted to float64 at a time (12 MiB at d = 768)
# Storage kept as given: every entry a float32 value, widened to float32 a block of rows at a time
HALF_DTYPES = (torch.float16, torch.bfloat16)


_MEDIAN_ENTRIES = 1 << 20  # entries of the block of columns one selection sorts (4 MiB of float32, a thread)


_MEDIAN_COLUMNS = 64  # but no fewer columns (256 bytes of each float32 row; 32 MiB at 128k rows)


def robust_row_norms(weight: torch.Tensor, centre: torch.Tensor | None = None) -> torch.Tensor:
    """float64 Euclidean norms of the rows (of w_i - centre when given) that do not underflow,
    without a rescaled copy of the whole head."""
    norms = torch.empty(weight.shape[0], dtype=torch.float64, device=weight.device)
    for s, e, rows in row_blocks(weight, _BLOCK_ROWS):
        norms[s:e] = torch.linalg.vector_norm(_offsets(rows, centre), dim=1)
    return _without_underflow(norms, weight, centre)


def _without_underflow(norms: torch.Tensor, weight: torch.Tensor, centre: torch.Tensor | None) -> torch.Tensor:
    """``norms`` with those that may have underflowed (below 1e-150) found again by safe_norm."""
    tiny = torch.nonzero(norms < 1e-150).flatten()  # only these can have underflowed
    for i in tiny.tolist():
        norms[i] = safe_norm(_offsets(weight[i:i + 1].to(torch.float64), centre), dim=1)[0]
    return norms


def _offsets(rows: torch.Tensor, centre: torch.Tensor | None) -> torch.Tensor:
    return rows - centre if centre is not None else rows


def median_row(weight: torch.Tensor, competitor: torch.Tensor) -> torch.Tensor:
    """The coordinate-wise lower median of the competitor rows (float64): a centre no far row can
    drag, which moves exactly with the rows when they are all translated or scaled (column_statistics)."""
    return column_statistics(weight, competitor)[0]


def column_statistics(weight: torch.Tensor, competitor: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each column's lower median, largest and smallest entry over the competitor rows (float64). A few
    columns at a time, each block copied contiguous for the selection, so that no copy of the whole head is
    made; on the CPU the columns are shared among as many Python threads as torch has (numpy's selection
    releases the GIL), each with its own two buffers."""
    rows = torch.nonzero(competitor).flatten()
    count, d = rows.numel(), weight.shape[1]
    threads = max(1, min(torch.get_num_threads(), d)) if weight.device.type == "cpu" else 1
    share = -(-d // threads)  # columns per thread
    # at least _MEDIAN_COLUMNS columns a block: the gather reads that many entries of each row at once
    width = max(1, min(max(_MEDIAN_COLUMNS, _MEDIAN_ENTRIES // max(count, 1)), share))
    median = torch.empty(d, dtype=torch.float64, device=weight.device)
    largest, smallest = torch.empty_like(median), torch.empty_like(median)

    def select(first: int) -> None:
        gathered = torch.empty(count * width, dtype=weight.dtype, device=weight.device)
        # numpy selects on float16 and wider (no bfloat16): a half-precision head's columns are widened, exactly
        columns = torch.empty(count * width, dtype=torch.float32 if weight.dtype in HALF_DTYPES else weight.dtype,
                              device=weight.device)
        for s in range(first, min(first + share, d), width):
            wide = min(width, first + share - s, d - s)
            block = gathered[:count * wide].view(count, wide)
            torch.index_select(weight[:, s:s + wide], 0, rows, out=block)
            transposed = columns[:count * wide].view(wide, count)
            transposed.copy_(block.T)
            median[s:s + wide], largest[s:s + wide], smallest[s:s + wide] = _order_statistics(transposed)

    firsts = list(range(0, d, share))
    if len(firsts) > 1:
        with ThreadPoolExecutor(len(firsts) - 1) as pool:  # this thread takes the first share
            others = [pool.submit(select, first) for first in firsts[1:]]  # each writes its own columns
            select(firsts[0])
            for done in others:
                done.result()
    else:
        select(0)
    # a zero median as -0.0, whichever zero the selection returned: then w - m turns both zeros of a column
    # into +0.0, as the translation of W + v turns the entries equal to its median (x - x = +0.0)
    return torch.where(median == 0, torch.full_like(median, -0.0), median), largest, smallest


def _order_statistics(block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The lower median, the largest and the smallest entry of each row of a contiguous block (float64),
    which it may reorder: numpy's introselect in place on the CPU (a third of torch.kthvalue's time there),
    after which the smallest entry lies in the first half of the row and the largest in the second;
    kthvalue elsewhere. Order statistics, so both give the same values."""
    k = (block.shape[1] + 1) // 2
    if block.device.type == "cpu":
        values = block.numpy()
        values.partition(k - 1, axis=1)
        return (torch.from_numpy(values[:, k - 1].astype(np.float64)),
                torch.from_numpy(values[:, k - 1:].max(axis=1).astype(np.float64)),
                torch.from_numpy(values[:, :k].min(axis=1).astype(np.float64)))
    smallest, largest = torch.aminmax(block, dim=1)
    return (torch.kthvalue(block, k, dim=1).values.to(torch.float64), largest.to(torch.float64),
            smallest.to(torch.float64))


def storage_dtype(weight: torch.Tensor) -> torch.dtype:
    """The head's own dtype when it is float16, bfloat16 or float32 (the stages widen half-precision rows
    by blocks, exactly); float32 for a float64 head whose every entry is a float32 value, else float64."""
    if weight.dtype in (torch.float16, torch.bfloat16, torch.float32):
        return weight.dtype
    for s in range(0, weight.shape[0], _BLOCK_ROWS):
        block = weight[s:s + _BLOCK_ROWS]
        if not torch.equal(block.to(torch.float32).to(torch.float64), block):
            return torch.float64
    return torch.float32


def row_facts(weight: torch.Tensor, competitor: torch.Tensor, median: torch.Tensor) -> RowFacts:
    """One float64 pass: the rows' norms, their distances from the median and the competitors' mean."""
    device = weight.device
    row_norm = torch.empty(weight.shape[0], dtype=torch.float64, device=device)
    distance = torch.empty(weight.shape[0], dtype=torch.float64, device=device)
    centre = torch.zeros(weight.shape[1], dtype=torch.float64, device=device)
    for s, e, rows in row_blocks(weight, _BLOCK_ROWS):
        row_norm[s:e] = torch.linalg.vector_norm(rows, dim=1)
        distance[s:e] = torch.linalg.vector_norm(rows - median, dim=1)
        centre += rows[competitor[s:e]].sum(dim=0)
    centre /= int(competitor.sum())
    return RowFacts(_without_underflow(row_norm, weight, None), _without_underflow(distance, weight, median),
                    centre, None)


def low_quantile(norms: torch.Tensor) -> float:
    positive = norms[norms > 0]
    if positive.numel() == 0:
        return 0.0
    return float(torch.kthvalue(positive.cpu(), max(1, int(0.1 * positive.numel()))).values)


@dataclass
class RowFacts:
    """Per-row facts of a head (float64), as build_engine_head finds them; the normal form finds them on the
    passes it makes anyway (normal_form.py)."""

    norm: torch.Tensor  # ||w_i||
    distance: torch.Tensor  # ||w_i - m||, m the coordinate-wise median row
    centre: torch.Tensor  # the mean of the competitor rows
    centre_logits: torch.Tensor | None  # w_i . (centre rounded to the storage dtype); None: not formed
