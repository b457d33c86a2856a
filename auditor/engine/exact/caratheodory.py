"""Carathéodory reduction: the same convex certificate on at most D rows.

A convex certificate for token k is a point of the simplex alpha with

    sum_i alpha_i (w_i, b_i, 1) = (sum_i alpha_i w_i, sum_i alpha_i b_i, 1),

a vector of R^D, D = d + 2 with a bias and d + 1 without. Carathéodory's
theorem says the same vector is a non-negative combination of at most D of
the (w_i, b_i, 1), and every quantity the certificate check reads (the
residual w_k - sum alpha_i w_i, the bias gap, the dual value of a bounded
domain) depends on alpha only through that vector. So the reduced weights
prove exactly what the dense ones proved, with at most D rows to name,
store and re-check.

The interior and Newton stages produce certificates on every row of the
head. Eliminating one row at a time from 30 000 would cost an SVD each, so
the reduction merges first (Maalouf, Jubran and Feldman, "Fast and accurate
least-mean-squares solvers", NeurIPS 2019): split the support into 2D
groups, replace each group by its weighted mean, reduce those 2D means to D
by the plain method, and keep only the groups whose means survived, with
their weights rescaled. Each round at least halves the support, and each
costs one pass over it plus one small null-space elimination (elimination.py).
Certificates near the centre of a head skip most rounds through a pool of rows around it (pools.py).

The result is re-solved on its support and checked by certify.check_convex
like any other certificate; the engine keeps the dense one if it fails.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from auditor.engine.arithmetic.budget import batch_count
from auditor.engine.arithmetic.head import EngineHead
from auditor.engine.exact.elimination import (
    eliminate,
    eliminate_batch,
    eliminate_on,
    steps_on_host,
)

_GATHER_ROWS = 2048  # rows gathered in float64 at a time when forming group means


def reduce_support(head: EngineHead, indices: np.ndarray, weights: np.ndarray
                   ) -> tuple[np.ndarray, np.ndarray, Pool]:
    """Weights on at most D of ``indices`` (D = d + 1, or d + 2 with a bias) reproducing
    ``sum weights_i (w_i, b_i, 1)`` up to rounding: (indices, weights summing to 1, and the at most
    2D rows of the last merge round: a pool of rows around the point, for points near it)."""
    indices, alpha = _positive(indices, weights)
    dim = lifted_dimension(head)
    while indices.size > 2 * dim:
        merge = _Merge(head, indices, alpha)
        means, merge.means = [merge.means], None  # handed over: the elimination spends them
        indices, alpha = merge.keep(eliminate_on(head.device, means, merge.mass))
    if indices.size > dim:
        # the points handed over, column-major, and factored where they lie: the pool gathers them again when a
        # holder needs them (Pool.lifted), so that the elimination's arrays never sit beside a copy of them
        pool = Pool(indices, None)
        alpha = eliminate_on(head.device, [lifted_points(head, indices, column_major=True)], alpha)
        survive = alpha > 0
        indices, alpha = indices[survive], alpha[survive]
    else:
        pool = Pool(indices, lifted_points(head, indices))
    return indices, alpha / alpha.sum(), pool


def lifted_dimension(head: EngineHead) -> int:
    """D: the dimension of the lifted rows (w_i, b_i, 1), d + 2 with a bias and d + 1 without."""
    return head.d + (2 if head.bias is not None else 1)


def _positive(indices: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The rows of positive weight, and their weights summing to 1."""
    keep = np.asarray(weights) > 0
    alpha = np.asarray(weights, dtype=np.float64)[keep]
    return np.asarray(indices)[keep], alpha / alpha.sum()


class _Merge:
    """One merge round: the support split into 2D interleaved groups (each mixes large and small weights,
    so no group mean sits far out), their masses and mean lifted points; ``keep`` rescales the weights by
    the masses an elimination left to each group."""

    def __init__(self, head: EngineHead, indices: np.ndarray, alpha: np.ndarray):
        groups = 2 * lifted_dimension(head)
        self.indices, self.alpha = indices, alpha
        self.label = np.argsort(np.argsort(-alpha, kind="stable"), kind="stable") % groups
        self.mass = np.bincount(self.label, weights=alpha, minlength=groups)
        self.means = _group_means(head, indices, alpha, self.label, groups)
        self.means /= self.mass[:, None]

    def keep(self, kept_mass: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        alpha = self.alpha * (kept_mass / self.mass)[self.label]
        survive = alpha > 0
        return self.indices[survive], alpha[survive] / alpha[survive].sum()


@dataclass
class Pool:
    """At most 2D rows around a point that a full reduction passed through (its last merge round), and
    their lifted points (None once a holder has let them go: ``lifted`` gathers them again)."""

    indices: np.ndarray
    points: np.ndarray | None

    def lifted(self, head: EngineHead) -> np.ndarray:
        return self.points if self.points is not None else lifted_points(head, self.indices)


def lifted_points(head: EngineHead, indices: np.ndarray, column_major: bool = False) -> np.ndarray:
    """The rows as points (w_i, b_i, 1) of R^D, float64: one m x D array, filled a block of rows at a time (at
    D = 4097 a pool of 2D rows is an eighth of a float32 head of 128256 rows, and its copies count);
    ``column_major`` for points an elimination is handed to factor where they lie (null_vectors)."""
    indices = np.asarray(indices, dtype=np.int64).reshape(-1)
    points = np.empty((indices.size, lifted_dimension(head)), order="F" if column_major else "C")
    for s in range(0, indices.size, _GATHER_ROWS):
        points[s:s + _GATHER_ROWS, :head.d] = head.rows(indices[s:s + _GATHER_ROWS])
    if head.bias is not None:
        points[:, head.d] = head.biases(indices)
    points[:, -1] = 1.0
    return points


def lifted_tensor(head: EngineHead, indices: np.ndarray) -> torch.Tensor:
    """lifted_points as a tensor on the head's device, gathered there (on the CPU the same array as
    lifted_points, shared with numpy): the points a pool's solves and eliminations work on where the head lies."""
    if head.device.type == "cpu":
        return torch.from_numpy(lifted_points(head, indices))
    index = torch.as_tensor(np.asarray(indices, dtype=np.int64).reshape(-1), device=head.device)
    points = torch.empty(index.numel(), lifted_dimension(head), dtype=torch.float64, device=head.device)
    for s in range(0, index.numel(), _GATHER_ROWS):
        points[s:s + _GATHER_ROWS, :head.d] = head.rows64(index[s:s + _GATHER_ROWS])
    if head.bias is not None:
        points[:, head.d] = head.bias.index_select(0, index)
    points[:, -1] = 1.0
    return points


def _group_means(head: EngineHead, indices: np.ndarray, alpha: np.ndarray, label: np.ndarray,
                 groups: int) -> np.ndarray:
    """sum_{i in group g} alpha_i (w_i, b_i, 1) for every group, gathering rows by blocks on the device: one
    column-major groups x D array (eliminate factors it where it lies: at D = 4097 a merge round's is a tenth of
    a head), the sums formed row-major (contiguous row additions) and copied in."""
    total = torch.zeros(groups, head.d, dtype=torch.float64, device=head.device)
    for s in range(0, indices.size, _GATHER_ROWS):
        rows = head.rows64(indices[s:s + _GATHER_ROWS])
        weights = torch.as_tensor(alpha[s:s + _GATHER_ROWS], device=head.device)
        total.index_add_(0, torch.as_tensor(label[s:s + _GATHER_ROWS], device=head.device), rows * weights[:, None])
    sums = np.empty((groups, lifted_dimension(head)), order="F")
    sums[:, :head.d] = total.cpu().numpy()
    del total
    if head.bias is not None:
        sums[:, head.d] = np.bincount(label, weights=alpha * head.biases(indices), minlength=groups)
    sums[:, -1] = np.bincount(label, weights=alpha, minlength=groups)
    return sums


_BATCH = 8  # certificates whose elimination steps run as one batch of tensor operations, at most
_BATCH_BYTES = 1 << 27  # and within this memory, one certificate at least: about three float64 2D x D arrays
#                         a certificate (its points, its null vectors overwritten by their corrections, the
#                         D x D triangle of those), so that wide heads batch fewer; on a GPU a quarter of its free
#                         memory (arithmetic/budget.py)
_DEVICE_BATCH = 64  # certificates a batch at most on a GPU: each step is the same few kernels for 1 certificate or 64


def reduce_supports(head: EngineHead, certificates: list[tuple[np.ndarray, np.ndarray]]
                    ) -> list[tuple[np.ndarray, np.ndarray]]:
    """``reduce_support`` for many certificates at once: the eliminations of a merge round of up to _BATCH
    of them run as one batched elimination (eliminate_batch), each step a few tensor operations on all of
    them together; so does the last elimination, on the at most 2D rows left of each."""
    dim = lifted_dimension(head)
    batch_size = batch_count(head.device, _BATCH_BYTES, 3 * 8 * 2 * dim * dim,
                             _BATCH if steps_on_host(head.device) else _DEVICE_BATCH)
    host = steps_on_host(head.device)
    states = [_positive(indices, weights) for indices, weights in certificates]
    while True:
        large = [j for j, (indices, _) in enumerate(states) if indices.size > 2 * dim]
        if not large:
            break
        for s in range(0, len(large), batch_size):
            batch = large[s:s + batch_size]
            merges, means = [], []
            for j in batch:  # off the CPU each certificate's means go to the device as they are formed
                merge = _Merge(head, *states[j])
                means.append(torch.as_tensor(merge.means, device=head.device))
                if not host:
                    merge.means = None
                merges.append(merge)
            means = torch.stack(means)
            kept, failed = eliminate_batch(means, torch.as_tensor(np.stack([m.mass for m in merges]),
                                                                  device=head.device))
            kept = kept.cpu().numpy()
            for row, (j, merge) in enumerate(zip(batch, merges)):
                if failed[row]:
                    kept[row] = eliminate(merge.means if host else means[row].cpu().numpy(), merge.mass)
                states[j] = merge.keep(kept[row])
            del means
    # The last elimination, on the rows themselves (at most 2D, a different number per certificate): each
    # certificate is padded to 2D rows with copies of its first row at weight 0 (any weight the steps move
    # onto them is the first row's).
    large = [j for j, (indices, _) in enumerate(states) if indices.size > dim]
    for s in range(0, len(large), batch_size):
        batch = large[s:s + batch_size]
        size = 2 * dim  # the same for every certificate, so that none depends on its batch
        points, weights = [], []
        for j in batch:
            indices, alpha = states[j]
            lifted = lifted_points(head, indices)
            pad = size - indices.size
            points.append(torch.as_tensor(np.vstack([lifted, np.repeat(lifted[:1], pad, axis=0)]), device=head.device))
            weights.append(np.concatenate([alpha, np.zeros(pad)]))
        points = torch.stack(points)
        kept, failed = eliminate_batch(points, torch.as_tensor(np.stack(weights), device=head.device))
        kept = kept.cpu().numpy()
        for row, j in enumerate(batch):
            indices, alpha = states[j]
            if failed[row]:
                alpha = eliminate(points[row, :indices.size].cpu().numpy(), alpha)
            else:  # weight the steps moved onto the copies goes back to the row they copy
                alpha = kept[row][:indices.size].copy()
                alpha[0] += kept[row][indices.size:].sum()
            survive = alpha > 0
            states[j] = (indices[survive], alpha[survive])
    return [(indices, alpha / alpha.sum()) for indices, alpha in states]


