"""Sparse certificates for tokens near a known point: the dual simplex from a shared basis.

A convex certificate for token k on at most D rows is a basic feasible solution of

    sum_i x_i p_i = t,   x >= 0,     p_i = (w_i, b_i, 1),  t = (w_k, b_k, 1),

over the rows of a pool. Mean-initialised rows all sit near the centre of the
head, and the reduced certificate of the centre (pools.centre_pool) is a
basis whose weights for such a t have only a few negative entries. The dual
simplex method removes them: with cost 0 on the starting basis and 1 on every
other row the start is dual feasible, and each pivot takes the most negative
weight out of the basis and brings in the row that keeps the reduced costs
non-negative. A pivot is one product of a basis-inverse row with the pool's
rows outside the start (and the start's rows that left the basis) and one
solve with the basis, O(m D), the inverse kept
in product form (the shared start's and one column per pivot, so that no copy
of it is made per token); a Carathéodory elimination of the token's own costs
O(m D^2).

The coordinates: each lifted coordinate is divided by its largest magnitude on
the pool (so that the units of w, b and 1 do not matter), and the points are
projected onto their leading right singular vectors. Rows of a normalised head,
and a bias that is a linear function of the rows (a LayerNorm's shift), span
fewer than D dimensions; the basis has as many rows as the span (found by an SVD
of the pool, unless the start's D rows are far from singular: then they span R^D
and the scaled coordinates serve as they are). Nothing here is
trusted: the weights found are refined once against their basis and go
through certify.check_convex like every other certificate.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.linalg
import torch

from auditor.engine.arithmetic.head import EngineHead
from auditor.engine.exact import elimination
from auditor.engine.exact.caratheodory import lifted_points
from auditor.engine.exact.elimination import lu_in_place

_SPAN = 1e-9  # singular values below this fraction of the largest: directions the pool does not span
_PIVOT = 1e-9  # entries of a pivot row below this fraction of its largest: not pivots (a near-singular basis)
_REFRESH = 64  # pivots between recomputing the basis inverse and the weights from scratch (or r / 8)


class Basis:
    """A pool of rows in working coordinates and a basis of them (as many rows as the pool spans) with
    its inverse, the start of every token's dual simplex. ``pool`` holds the pool's rows with the start's
    first (not in the order given), ``start`` their positions 0..r-1."""

    def __init__(self, head: EngineHead, pool: np.ndarray, start: np.ndarray, points: np.ndarray | None = None):
        """``points``: the pool's lifted points when the caller has them (caratheodory.Pool.points), spent:
        scaled and reordered in place to become the basis' own (at D = 4097 a pool of 2D rows is an eighth of a
        float32 head of 128256 rows, so no copy of it is made)."""
        self.head = head
        self.pool = np.asarray(pool, dtype=np.int64)
        self.start = self.inverse = None
        if self.pool.size == 0:
            return
        scaled = lifted_points(head, self.pool) if points is None else points
        self.scale = np.maximum(scaled.max(axis=0), -scaled.min(axis=0))
        self.scale[self.scale == 0] = 1.0  # a coordinate zero on every pool row
        scaled /= self.scale
        position = np.flatnonzero(np.isin(self.pool, start))
        square = position
        if 0 < position.size < scaled.shape[1]:
            # fewer start rows than D (a reduction that dropped more than it had to): completed from the pool
            # before an SVD of the pool (a minute at D = 4097) is tried (_completed)
            square = _completed(scaled, position)
        inverse = _inverse_if_well_conditioned(scaled[square]) if square.size == scaled.shape[1] else None
        if inverse is not None:
            # D start rows that span R^D: so does the pool, and the working coordinates are the scaled ones
            self.span, self.points, self.start = None, scaled, square
            self.inverse = inverse  # of the start's points as columns
        else:
            _, sigma, vt = np.linalg.svd(scaled, full_matrices=False)
            self.span = vt[:int((sigma > _SPAN * sigma[0]).sum())].T  # D x r
            self.points = scaled @ self.span  # m x r
            self.start = _independent(self.points, position)
            self.inverse = np.linalg.inv(self.points[self.start].T) if self.start is not None else None
        if self.start is not None:  # the start's rows first: the others are then one contiguous block (``rest``)
            order = np.concatenate([self.start, np.setdiff1d(np.arange(self.pool.size), self.start)])
            self.pool = self.pool[order]
            _reorder_rows(self.points, order)
            self.start = np.arange(self.start.size)
        # The pivots' arrays where the head lies: a pivot reads the start's inverse twice and the pool's points
        # once, O(m r) each. On the CPU they stay numpy arrays, whose small operations (a pivot's etas are a few
        # dozen of them) cost a tenth of torch's; on a GPU they move there as tensors, and the same steps run as
        # its kernels (the code below is written for either kind: _Arrays).
        if not elimination.steps_on_host(head.device):  # numpy on the CPU, tensors on a GPU, as eliminations
            self.scale, self.span, self.points, self.inverse = (
                torch.as_tensor(array, device=head.device) if array is not None else None
                for array in (self.scale, self.span, self.points, self.inverse))
        self.xp = _Arrays(self.points)
        if self.start is not None:
            self.rest = self.points[self.start.size:]

    def certificate(self, k: int, point: np.ndarray | None = None, max_pivots: int | None = None,
                    own: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
        """Weights on at most r pool rows other than k whose lifted combination is ``point`` (default token
        k's own, (w_k, b_k, 1)), found by pivoting from the shared basis; None when the pool's hull does not
        hold the point, when ``max_pivots`` (default r) pivots do not reach it, or when the basis cannot be
        built. ``own``: row k may carry weight too (the caller moves it to the other side: anchor.py)."""
        if self.inverse is None:
            return None
        if point is None:
            point = lifted_points(self.head, np.array([k]))[0]
        xp = self.xp
        target = xp.array(point) / self.scale
        if self.span is not None:
            target = target @ self.span
        r = self.points.shape[1]
        max_pivots = r if max_pivots is None else max_pivots
        product = _ProductForm(self.inverse, r, xp)
        basis = self.start.copy()  # positions, on the host (the pivots' choices are the host's)
        where = xp.index(basis)  # the same, where the arrays lie
        weights = product.solve(target)
        basic = np.zeros(self.pool.size, dtype=bool)
        basic[basis] = True
        banned = (self.pool == k) & (not own)  # a certificate never uses the token's own row
        open_ = xp.array(~basic & ~banned)  # the rows that may enter
        cost = xp.array(np.where(basic, 0.0, 1.0))  # reduced costs: the start is dual feasible
        row = xp.zeros(self.pool.size)
        for pivot in range(max_pivots + 1):
            own = np.flatnonzero(banned[basis])
            if own.size:  # the token's own row leaves first, whatever its weight
                leave = int(own[0])
            else:
                leave = int(weights.argmin())
                if float(weights[leave]) >= 0:
                    break
            if pivot == max_pivots:
                return None
            self._leaving_row(product.inverse_row(leave), basic, where, leave, row)
            enter = _entering(row, open_, cost, bool(own.size), float(weights[leave]), xp)
            if enter is None:
                return None  # no non-negative weights on the pool reach the point: it is outside their hull
            cost = cost - (cost[enter] / row[enter]) * row  # 0 on the new basis, -theta on the row that leaves
            cost[enter] = 0.0
            column = product.solve(self.points[enter])
            step = weights[leave] / column[leave]
            weights = weights - step * column
            weights[leave] = step
            product.etas.append((leave, column))
            basic[basis[leave]], basic[enter] = False, True
            if not banned[basis[leave]]:
                open_[int(basis[leave])] = True
            open_[enter] = False
            basis[leave] = enter
            where[leave] = enter
            if (pivot + 1) % max(_REFRESH, r // 8) == 0:  # a fresh inverse, and the etas start again
                product.inverse, product.etas = xp.linalg.inv(self.points[where].T), []
                weights = product.inverse @ target
        weights = xp.host(self._refined(product, target, where))
        weights = np.maximum(weights, 0.0)
        keep = weights > 0
        if not keep.any():
            return None
        return self.pool[basis[keep]], weights[keep] / weights[keep].sum()

    def _leaving_row(self, u, basic: np.ndarray, basis, leave: int, row):
        """``row``, filled in place with the leaving row of B^-1 A (``u`` = e_l^T B^-1); ``basic`` on the host,
        ``basis`` (the basic positions) where the arrays lie."""
        r = self.points.shape[1]
        # computed on the rows outside the start and the start's rows that left the basis; on the basic rows
        # 0 but the leaving one's 1
        row[r:] = self.rest @ u
        left_start = np.flatnonzero(~basic[:r])
        row[:r] = 0.0
        if left_start.size:
            left = self.xp.index(left_start)
            row[left] = self.points[left] @ u
        row[basis] = 0.0
        row[basis[leave]] = 1.0
        return row

    def _refined(self, product: _ProductForm, target, basis):
        """The basis' weights for ``target``, the best of a few steps of iterative refinement."""
        # iterative refinement with the inverse at hand: the weights as accurate as a fresh solve, on an
        # ill-conditioned basis too (a step shrinks the error by about cond * eps); the best kept
        spread = self.xp.zeros(self.pool.size)  # B w as (pool-sized weights) @ points: no gathered copy of B
        weights = product.solve(target)
        best, least = weights, math.inf
        for _ in range(4):
            spread[basis] = weights
            residual = target - spread @ self.points
            size = float(abs(residual).max())
            if not size < least / 2:  # no longer halving: the better of the last two stands
                if size < least:
                    best, least = weights, size
                break
            best, least = weights, size
            weights = weights + product.solve(residual)
        return best


# B^-1 = E_t ... E_1 B_0^-1, E_s the identity with column l_s replaced by the eta of column_s (B_(s-1)^-1 times
# the entering point), B_0^-1 never written. A pivot then reads B_0^-1 twice and the non-start rows once (three
# r x r passes), where updating an explicit inverse would copy it and write it as well.
class _Arrays:
    """What the pivots need of their arrays' kind, numpy's on the CPU and torch's on a GPU (the rest of the code
    is written in the operators and methods the two share): new arrays, index arrays, the linear algebra module,
    and the way back to the host."""

    def __init__(self, like):
        self.torch = isinstance(like, torch.Tensor)
        self.device = like.device if self.torch else None
        self.linalg = torch.linalg if self.torch else np.linalg
        self.inf = math.inf

    def array(self, values):
        return torch.as_tensor(values, device=self.device) if self.torch else np.asarray(values)

    def index(self, positions: np.ndarray):
        """A copy of host positions where the arrays lie (changed in place as the basis changes)."""
        return torch.as_tensor(positions, device=self.device) if self.torch else positions.copy()

    def zeros(self, size: int):
        return torch.zeros(size, dtype=torch.float64, device=self.device) if self.torch else np.zeros(size)

    def where(self, condition, a, b):
        return torch.where(condition, a, b) if self.torch else np.where(condition, a, b)

    def host(self, values) -> np.ndarray:
        return values.cpu().numpy() if self.torch else values


class _ProductForm:
    """The basis inverse in product form: the shared start's inverse and one eta column per pivot."""

    def __init__(self, inverse, r: int, xp: _Arrays):
        self.inverse, self.etas, self.r, self.xp = inverse, [], r, xp

    def solve(self, x):
        """B^-1 x."""
        y = self.inverse @ x
        for l, column in self.etas:
            f = y[l] / column[l]
            y -= f * column
            y[l] = f
        return y

    def inverse_row(self, leave: int):
        """e_l^T B^-1."""
        v = self.xp.zeros(self.r)
        v[leave] = 1.0
        for l, column in reversed(self.etas):  # v E_s changes entry l_s only
            v[l] = (v[l] - (v @ column - v[l] * column[l])) / column[l]
        return v @ self.inverse


def _entering(row, allowed, cost, own_leaves: bool, leaving_weight: float, xp: _Arrays) -> int | None:
    """The pool position that enters the basis by the dual ratio test, None where no entry of the row may."""
    threshold = _PIVOT * float(abs(row).max())
    # The dual ratio test: entering on a negative entry of the row keeps every reduced cost
    # non-negative and makes a negative weight the new row's positive one. The token's own row leaves
    # whatever its weight; its reduced cost does not matter (it never enters again), so the entries
    # of the weight's sign serve, and a positive weight passes to the entering row.
    sign = 1.0 if own_leaves and leaving_weight > 0 else -1.0
    candidates = allowed & (sign * row > threshold)
    if own_leaves and not bool(candidates.any()):
        sign = -sign
        candidates = allowed & (sign * row > threshold)
    ratio = xp.where(candidates, xp.where(cost > 0, cost, 0.0) / xp.where(candidates, sign * row, 1.0), xp.inf)
    enter = int(ratio.argmin())
    return enter if bool(candidates[enter]) else None


def _reorder_rows(array: np.ndarray, order: np.ndarray) -> None:
    """``array[:] = array[order]`` in place, one row at a time along the permutation's cycles: no copy of the
    array (m x D float64), one row's buffer per cycle."""
    done = np.zeros(order.size, dtype=bool)
    for first in range(order.size):
        if done[first]:
            continue
        done[first] = True
        if order[first] == first:
            continue
        held, j = array[first].copy(), first
        while order[j] != first:
            array[j] = array[order[j]]
            j = int(order[j])
            done[j] = True
        array[j] = held


# reciprocal condition number (1-norm estimate) from which a square start is used as it is: float64 still
# solves with it to a few digits, which the refinement step sharpens and check_convex judges (a wide head's
# start of D = 4097 rows estimates 1e-8 and spans R^D). A pool whose rows span fewer dimensions (a normalised
# head) gives an estimate at float64's rounding, and the SVD finds its span.
_CONDITION = 2.0**-40


def _inverse_if_well_conditioned(square: np.ndarray) -> np.ndarray | None:
    """The inverse of the transpose of a square matrix (rows: the start's points) far from singular, else None:
    LAPACK's estimate of its reciprocal condition number (in the 1-norm of ``square``, the infinity-norm of its
    transpose) from an LU factorisation, and the inverse from the same factors (O(D^3) once, against an SVD of
    the whole pool and two pivoted QRs). ``square`` (C-ordered, a copy) is spent: its memory is the transpose's
    column-major, and the factors, then the inverse, are written over it (no further D x D array)."""
    norm = float(np.abs(square).sum(axis=0).max())
    factors, pivots, info = lu_in_place(torch.from_numpy(square.T))  # torch: the audit's threads
    if info != 0:
        return None
    rcond, info = scipy.linalg.lapack.dgecon(factors.numpy(), norm, norm="I")
    if info != 0 or rcond < _CONDITION:
        return None
    work, _ = scipy.linalg.lapack.dgetri_lwork(len(square))  # the blocked inversion's workspace
    inverse, info = scipy.linalg.lapack.dgetri(factors.numpy(), pivots.numpy() - 1, lwork=int(work), overwrite_lu=1)
    return inverse if info == 0 else None


def _completed(points: np.ndarray, chosen: np.ndarray) -> np.ndarray:
    """``chosen`` (positions of rows of the m x D ``points``, fewer than D) and D - |chosen| more rows: the
    rows of a sample of the others (a few times as many as missing) whose parts outside the span of the
    chosen a pivoted QR picks (each the farthest outside the span of those before it). Whether the D rows
    are independent enough is for the caller's condition estimate to judge."""
    dim = points.shape[1]
    missing = dim - chosen.size
    others = np.setdiff1d(np.arange(points.shape[0]), chosen)
    if others.size < missing:
        return chosen
    sample = others if others.size <= 4 * missing + 64 else np.sort(
        np.random.default_rng(0).choice(others, size=4 * missing + 64, replace=False))
    q, _ = np.linalg.qr(points[chosen].T)  # D x |chosen|: an orthonormal basis of their span
    outside = points[sample] - (points[sample] @ q) @ q.T
    _, order = scipy.linalg.qr(outside.T, pivoting=True, mode="r", check_finite=False)
    return np.sort(np.concatenate([chosen, sample[order[:missing]]]))


def _independent(points: np.ndarray, chosen: np.ndarray) -> np.ndarray | None:
    """Positions of r linearly independent rows of the m x r ``points``, as many as possible among
    ``chosen`` (pivoted QR), the rest among the others after projecting out the span of the first;
    None when the points do not span r dimensions."""
    r = points.shape[1]
    tolerance = 1e-10 * float(np.linalg.norm(points, axis=1).max())
    picked = np.zeros(0, dtype=np.int64)
    others = np.setdiff1d(np.arange(points.shape[0]), chosen)
    for group in (np.asarray(chosen, dtype=np.int64), others):
        if picked.size == r or group.size == 0:
            continue
        columns = points[group].T
        if picked.size:
            q, _ = np.linalg.qr(points[picked].T)
            columns = columns - q @ (q.T @ columns)
        _, triangle, order = scipy.linalg.qr(columns, pivoting=True, mode="economic", check_finite=False)
        rank = int((np.abs(np.diag(triangle)) > tolerance).sum())
        picked = np.concatenate([picked, group[order[:min(rank, r - picked.size)]]])
    return picked if picked.size == r else None
