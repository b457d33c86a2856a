"""The plot data of the HTML report: per-row numbers computed from the head and the report, upstream of the formats.

The figures (auditor/formats/_plots.py) draw from this and the JSON document
only. The head is read in float64 blocks of rows, never copied whole.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from auditor.findings.gate import GateResult
from auditor.util.arrays import as_float64, row_blocks

_BLOCK_VALUES = 1 << 23  # 64 MB of float64 per block of rows, whatever the hidden size


@dataclass
class PlotData:
    """What the figures need per token: margins, verdicts, ceilings, and the rows' geometry."""

    margins: np.ndarray  # the certified margin of each token (NaN where there is none)
    argmaxable: np.ndarray  # bool mask
    verdict: np.ndarray  # each token's verdict name
    ceilings: np.ndarray  # upper bound of each token's largest probability (NaN when not computed)
    geometry: RowGeometry


@dataclass
class RowGeometry:
    """Per-row facts computed once from the head: norms and the 2-D principal projection."""

    norms: np.ndarray
    projection: np.ndarray  # n x 2
    explained: tuple[float, float]  # fraction of the variance along each of the two directions


def _numpy_blocks(weight):
    """(start, float64 numpy block of rows), about 64 MB at a time whatever the hidden size."""
    rows = max(1, _BLOCK_VALUES // max(int(weight.shape[1]), 1))
    for start, _, block in row_blocks(weight, rows):
        yield start, block if isinstance(block, np.ndarray) else as_float64(block)


def row_geometry(weight) -> RowGeometry:
    """Row norms and the projection on the top-2 principal directions, via the d x d covariance."""
    n, d = (int(s) for s in weight.shape)
    norms, total, gram, shift = np.empty(n), np.zeros(d), np.zeros((d, d)), None
    for start, block in _numpy_blocks(weight):
        norms[start:start + len(block)] = np.linalg.norm(block, axis=1)
        # sums about the first block's mean: no cancellation when the rows share a large common offset
        shift = block.mean(axis=0) if shift is None else shift
        centred = block - shift
        total += centred.sum(axis=0)
        gram += centred.T @ centred
    offset = total / n
    covariance = (gram - n * np.outer(offset, offset)) / max(n - 1, 1)
    mean = shift + offset
    values, vectors = np.linalg.eigh(covariance)
    top = vectors[:, ::-1][:, :2]
    if top.shape[1] < 2:  # a one-dimensional head: the second direction is empty
        top = np.hstack([top, np.zeros((d, 1))])
    top = top * np.where(top[np.abs(top).argmax(axis=0), [0, 1]] < 0, -1.0, 1.0)  # a fixed sign: same picture each run
    projection = np.empty((n, 2))
    for start, block in _numpy_blocks(weight):
        projection[start:start + len(block)] = (block - mean) @ top
    variance = max(values.sum(), np.finfo(float).tiny)
    shares = (values[::-1][:2] / variance).tolist() + [0.0]
    return RowGeometry(norms, projection, (shares[0], shares[1]))


def plot_data(result: GateResult) -> PlotData:
    """The plot data of a gate result: one pass over the report's arrays, two over the head's rows."""
    report = result.report
    verdict = np.full(report.n_tokens, "undecided", dtype=object)
    for name in ("argmaxable", "unargmaxable", "tied", "inconclusive"):
        verdict[report.ids(name)] = name
    return PlotData(report.margins(), verdict == "argmaxable", verdict, report.ceilings()[1],
                    row_geometry(result.head.weight))
