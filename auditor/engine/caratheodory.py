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
costs one pass over it plus one small null-space elimination.

The result is re-solved on its support and checked by certify.check_convex
like any other certificate; the engine keeps the dense one if it fails.
"""

from __future__ import annotations

import numpy as np
import torch

from auditor.engine.head import EngineHead

_GATHER_ROWS = 8192  # rows gathered in float64 at a time when forming group means


def reduce_support(head: EngineHead, indices: np.ndarray, weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Weights on at most D of ``indices`` (D = d + 1, or d + 2 with a bias) reproducing
    ``sum weights_i (w_i, b_i, 1)`` up to rounding; returned as (indices, weights), weights summing to 1."""
    keep = weights > 0
    indices, alpha = np.asarray(indices)[keep], np.asarray(weights, dtype=np.float64)[keep]
    alpha = alpha / alpha.sum()
    dim = head.d + (2 if head.bias is not None else 1)
    while indices.size > 2 * dim:
        groups = 2 * dim
        # Interleaved groups: each mixes large and small weights, so no group mean sits far out.
        label = np.argsort(np.argsort(-alpha, kind="stable"), kind="stable") % groups
        mass = np.bincount(label, weights=alpha, minlength=groups)
        means = _group_means(head, indices, alpha, label, groups) / mass[:, None]
        kept_mass = _eliminate(means, mass)
        ratio = kept_mass / mass
        alpha = alpha * ratio[label]
        survive = alpha > 0
        indices, alpha = indices[survive], alpha[survive]
    if indices.size > dim:
        points = _lifted(head, indices)
        alpha = _eliminate(points, alpha)
        survive = alpha > 0
        indices, alpha = indices[survive], alpha[survive]
    return indices, alpha / alpha.sum()


def _lifted(head: EngineHead, indices: np.ndarray) -> np.ndarray:
    """The rows as points (w_i, b_i, 1) of R^D, float64."""
    columns = [head.rows(indices)]
    if head.bias is not None:
        columns.append(head.biases(indices)[:, None])
    columns.append(np.ones((indices.size, 1)))
    return np.hstack(columns)


def _group_means(head: EngineHead, indices: np.ndarray, alpha: np.ndarray, label: np.ndarray,
                 groups: int) -> np.ndarray:
    """sum_{i in group g} alpha_i (w_i, b_i, 1) for every group, gathering rows by blocks."""
    dim = head.d + (2 if head.bias is not None else 1)
    total = torch.zeros(groups, dim, dtype=torch.float64, device=head.device)
    for s in range(0, indices.size, _GATHER_ROWS):
        part = indices[s:s + _GATHER_ROWS]
        points = torch.as_tensor(_lifted(head, part), device=head.device)
        weighted = points * torch.as_tensor(alpha[s:s + _GATHER_ROWS], device=head.device)[:, None]
        total.index_add_(0, torch.as_tensor(label[s:s + _GATHER_ROWS], device=head.device), weighted)
    return total.cpu().numpy()


def _eliminate(points: np.ndarray, alpha: np.ndarray) -> np.ndarray:
    """Carathéodory by null-space steps: non-negative weights on linearly independent points with
    ``weights @ points == alpha @ points`` (up to rounding). ``points`` is m x D, ``alpha`` >= 0."""
    alpha = alpha.copy()
    m = points.shape[0]
    # Scale each coordinate so that the units of w, b and 1 do not matter. The last m - D columns of
    # the complete QR factor of the points are orthogonal to every coordinate column: null vectors
    # of the combination (rank deficiency only adds null vectors that this leaves unused).
    columns = points / np.maximum(np.abs(points).max(axis=0), np.finfo(np.float64).tiny)
    q, _ = np.linalg.qr(columns, mode="complete")
    null = np.ascontiguousarray(q[:, points.shape[1]:])  # m x (m - D): sum_i v_i points_i ~ 0
    alive = np.ones(m, dtype=bool)  # not yet eliminated; every later null vector is zero off it
    for j in range(null.shape[1]):
        v = null[:, j]
        if not np.any(v[alive]):
            continue
        if v[alive].max() <= 0:
            v = -v
        positive = alive & (v > 0)
        ratios = np.full(m, np.inf)
        ratios[positive] = alpha[positive] / v[positive]
        out = int(np.argmin(ratios))
        alpha -= ratios[out] * v  # one weight reaches zero; the combination does not move
        alpha[out] = 0.0
        np.maximum(alpha, 0.0, out=alpha)  # rounding may leave -1e-17 where the ratios tied
        alive[out] = False
        rest = null[:, j + 1:]
        rest -= np.outer(v, rest[out] / v[out])  # later steps must not revive the row just dropped
        rest[out] = 0.0
    return alpha
