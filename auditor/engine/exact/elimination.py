"""One Carathéodory elimination: the null vectors of a certificate's lifted points, and the steps that zero its weights.

For lifted points p_i (rows of R^D) and weights alpha, a null vector u (sum_i u_i p_i = 0) moves
alpha along alpha - t u without changing sum alpha_i p_i; the largest t that keeps alpha >= 0 zeroes
one weight. The null vectors come from one LU factorisation of the points (written over them), and each
step corrects the later vectors by a panel of triangular solves (caratheodory.py's merge rounds and
reductions, pools.py's certificates, dual_simplex.py's bases all end here). Factorisations are written
over their matrices, so no large array is copied to be factored.
"""

from __future__ import annotations

import numpy as np
import scipy.linalg
import torch

from auditor.engine.arithmetic.budget import batch_count


_PANEL = 64  # null vectors corrected together by one triangular solve and one matrix product


def null_vectors(points: np.ndarray | torch.Tensor | list) -> np.ndarray | torch.Tensor:
    """(m - D) x m: a basis of the u with u @ points = 0, for m x D points of rank D (see eliminate), on the
    points' own device and of their kind (numpy in, numpy out; a tensor in, a tensor on its device out). The
    factorisation and the triangular solve run in torch (float64: on the CPU on the audit's threads, on a GPU
    where the points lie). ``points`` handed over in a one-element list (a merge round's group means,
    column-major) are the call's: it takes them out, scales and factors them where they lie, and lets them go
    as soon as the factors are spent."""
    spent = isinstance(points, list)
    if spent:
        points = points.pop()
    kind = np.ndarray if isinstance(points, np.ndarray) else torch.Tensor
    if kind is np.ndarray:
        # m x D arrays are let go as soon as they are spent, and none is made twice: at D = 4097 each is a
        # tenth of a head. A column-major array handed over is scaled and factored where it lies.
        reuse = spent and points.flags.f_contiguous
        points = torch.from_numpy(points)
    else:
        reuse = spent and points.stride(0) == 1
    m, dim = points.shape
    device = points.device
    columns = points if reuse else torch.empty((dim, m), dtype=torch.float64, device=device).T
    scale = torch.maximum(points.amax(dim=0), -points.amin(dim=0)).clamp_(min=float(np.finfo(np.float64).tiny))
    torch.div(points, scale, out=columns)
    del points
    factors, pivots, _ = lu_in_place(columns)  # columns[permutation] = L U, L = [L1; L2] unit lower
    del columns
    permutation = np.arange(m)
    for i, p in enumerate(pivots.cpu().numpy() - 1):  # LAPACK's row swaps, in order (D integers from the device)
        permutation[i], permutation[p] = permutation[p], permutation[i]
    # L1^T is the strict upper triangle of factors[:dim]^T with a unit diagonal (U fills the rest, unread);
    # L2 = factors[dim:] whole. L1^-T L2^T by blocks, L1^T read where it lies (no D x D copy of it).
    top = factors[dim:].T.contiguous()
    _solve_by_blocks(factors[:dim].T, top, upper=True, unit=True)
    del factors
    # the null vectors of L^T are the columns of [-L1^-T L2^T; I]; coordinate j of w is that of point permutation[j]
    order = torch.as_tensor(permutation, device=device)
    null = torch.zeros((m - dim, m), dtype=torch.float64, device=device)
    null[:, order[:dim]] = top.neg_().T
    null[torch.arange(m - dim, device=device), order[dim:]] = 1.0
    return null.numpy() if kind is np.ndarray else null


def cholesky_in_place(matrix: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The lower Cholesky factor of a symmetric row-major ``matrix`` written over it (at D = 4097 a D x D float64
    array is a fifteenth of a float32 head of 128256 rows): LAPACK factors the column-major view of its
    transpose, the same matrix, where it lies (torch's ``out=`` takes the input itself; a row-major ``out``
    would go through a column-major copy). Where this torch declines the aliasing, a new tensor. Returns
    (factor, info: 0 unless not positive definite)."""
    info = torch.empty((), dtype=torch.int32, device=matrix.device)
    columns = matrix.mT
    try:
        factor, info = torch.linalg.cholesky_ex(columns, out=(columns, info))
    except RuntimeError:
        factor, info = torch.linalg.cholesky_ex(matrix)
    return factor, int(info)


def lu_in_place(matrix: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """LAPACK's LU factors with partial pivoting of ``matrix`` written over it (a column-major one: no second
    copy; torch's ``out=`` takes the input itself), or, where this torch declines the aliasing, into a new
    tensor. Returns (factors, pivots counted from 1, info)."""
    pivots = torch.empty(min(matrix.shape), dtype=torch.int32, device=matrix.device)
    info = torch.empty((), dtype=torch.int32, device=matrix.device)
    try:
        factors, pivots, info = torch.linalg.lu_factor_ex(matrix, out=(matrix, pivots, info))
    except RuntimeError:
        factors, pivots, info = torch.linalg.lu_factor_ex(matrix)
    return factors, pivots, int(info)


def eliminate(points: np.ndarray | list[np.ndarray], alpha: np.ndarray, null: np.ndarray | None = None
              ) -> np.ndarray:
    """Carathéodory by null-space steps: non-negative weights on at most D of the m points with
    ``weights @ points == alpha @ points`` (up to rounding). ``points`` is m x D, ``alpha`` >= 0.

    Step j moves along null vector u_j until a weight reaches zero; every later null vector must
    first lose the coordinates already dropped (``null``: the null vectors of ``points`` when the caller
    shares them among the weights of one pool; they are read, not changed). Rather than updating all later vectors after each
    step (m r^2 work in rank-one updates), each vector is corrected when its turn comes: with V the
    vectors used so far and t their dropped coordinates, V[i][t_l] = 0 for i > l, so the correction
    x solves the lower-triangular system T x = u[t] with T[l, i] = V[i][t_l]. The corrections by the
    vectors of earlier panels are applied to a whole panel at once. ``points`` in a one-element list: the
    call's to spend (null_vectors).
    """
    alpha = alpha + 0.0  # a copy, with any -0.0 made +0.0 (the ratio test below divides by the weights)
    m, dim = (points[0] if isinstance(points, list) else points).shape
    if m <= dim:
        return alpha
    # Null vectors from an LU factorisation with partial pivoting, points = L[order] U: sum_i u_i points_i
    # = 0 iff L^T w = 0 with u = w[order], and with L = [L1; L2] (|entries| <= 1) the vectors [-L1^-T L2^T e_j; e_j]
    # span those (a quarter of the work of a complete QR). Each coordinate is scaled first so that the
    # units of w, b and 1 do not matter.
    # The vectors used are kept for the later corrections: in the null vectors' own rows when they are this
    # call's (vector j is stored at row j or before, once its row has been read), else in an array of their own
    if null is None:
        null = null_vectors(points)
        used = null
    else:
        used = np.zeros((null.shape[0], m))
    triangle = np.zeros((null.shape[0], null.shape[0]))
    dropped = np.zeros(null.shape[0], dtype=np.int64)  # the first j entries: the coordinates dropped so far
    j = 0
    reach = np.empty(m)
    for start in range(0, null.shape[0], _PANEL):
        # The corrections by every vector used before this panel, for the whole panel at once (BLAS-3).
        panel = null[start:start + _PANEL].copy()
        first = j
        if first:  # in torch: the audit's threads (numpy's BLAS has one)
            x = _lower_solve(triangle, first, panel[:, dropped[:first]].T)
            panel -= (x.T @ torch.from_numpy(used[:first])).numpy()
        for u in panel:
            if j > first:  # and by those used within this panel (LAPACK's solver called directly: a step is small)
                # as solve_triangular passes a C-ordered matrix: its transpose, transposed solve, same rounding
                x, _ = _triangular_solve(triangle[first:j, first:j].T, u[dropped[first:j]], trans=1, lower=0)
                u -= x @ used[first:j]
            u[dropped[:j]] = 0.0  # zero on the dropped coordinates: no dropped row comes back
            out = _first_to_reach_zero(alpha, u, reach)
            if out < 0:
                u = -u
                out = _first_to_reach_zero(alpha, u, reach)
                if out < 0:  # u is 0
                    continue
            alpha -= (alpha[out] / u[out]) * u  # one weight reaches zero; the combination does not move
            alpha[out] = np.inf  # dropped: held at +inf until the end (see _first_to_reach_zero), u is 0 there
            np.maximum(alpha, 0.0, out=alpha)  # rounding may leave -1e-17 where the ratios tied
            used[j] = u
            dropped[j] = out
            triangle[j, :j + 1] = used[:j + 1, out]
            j += 1
    alpha[dropped[:j]] = 0.0
    return alpha


def steps_on_host(device: torch.device) -> bool:
    """Whether eliminations on ``device`` take their steps on the host (``eliminate``: numpy's small operations
    cost less than torch's on the CPU) rather than as batched tensor operations where the points lie."""
    return device.type == "cpu"


def eliminate_on(device: torch.device, points: np.ndarray | list[np.ndarray], alpha: np.ndarray) -> np.ndarray:
    """``eliminate`` for one certificate whose points are on the host (``points`` as there, a one-element list
    for points the call may spend), taken on ``device``: on the CPU ``eliminate`` itself; elsewhere the points go
    to the device once and ``eliminate_batch`` takes the steps there (the host again where one found no
    direction)."""
    if steps_on_host(torch.device(device)):
        return eliminate(points, alpha)
    array = points.pop() if isinstance(points, list) else points
    if array.shape[0] <= array.shape[1]:
        return eliminate(array, alpha)
    on_device = torch.as_tensor(array, device=device)[None]
    del array, points  # (a spent array is let go here, as the host's elimination lets it go once factored)
    kept, failed = eliminate_batch(on_device, torch.as_tensor(alpha, device=device)[None])
    return eliminate(on_device[0].cpu().numpy(), alpha) if failed[0] else kept[0].cpu().numpy()


def eliminate_where(points: torch.Tensor, alpha: torch.Tensor, null: torch.Tensor | None = None) -> np.ndarray:
    """``eliminate`` for one certificate whose points (m x D) and weights are tensors, where they lie
    (eliminate_on_pool's one-certificate case). Weights as numpy."""
    return eliminate_on_pool(points, alpha[None, :], null)[0]


def eliminate_on_pool(points: torch.Tensor, alphas: torch.Tensor, null: torch.Tensor | None) -> list[np.ndarray]:
    """One elimination per row of ``alphas`` (B x m weights on a pool's m lifted points, a tensor on their
    device), on the pool's shared null vectors ``null`` (shared_null_vectors): weights on at most D of its rows
    for each, as numpy. On the CPU one ``eliminate`` after another (numpy views, no copy); on another device
    batches of them at once (eliminate_batch: no step waits on the host), as many as a quarter of its free memory
    holds, and on the host those where a step found no direction."""
    if steps_on_host(points.device) or points.shape[0] <= points.shape[1]:
        host_points, host_null = points.cpu().numpy(), null.cpu().numpy() if null is not None else None
        return [eliminate(host_points, alpha, host_null) for alpha in alphas.cpu().numpy()]
    m, dim = points.shape
    r = m - dim
    size = batch_count(points.device, _ELIMINATION_BYTES, 8 * (r * m + r * r + 4 * m), _ELIMINATION_BATCH)
    kept: list[np.ndarray] = []
    host: list = []  # the points and null vectors on the host, copied there once if a step fails
    for s in range(0, alphas.shape[0], size):
        block = alphas[s:s + size]
        weights, failed = eliminate_batch(points, block, null)
        weights = weights.cpu().numpy()
        for j in range(block.shape[0]):
            if failed[j] and not host:
                host.extend([points.cpu().numpy(), null.cpu().numpy() if null is not None else None])
            kept.append(eliminate(host[0], block[j].cpu().numpy(), host[1]) if failed[j] else weights[j])
    return kept


_ELIMINATION_BYTES = 1 << 27  # a batch of eliminations' null vectors and triangles at most, off the CPU's budget
_ELIMINATION_BATCH = 64  # and at most this many certificates a batch


def _lower_solve(triangle: np.ndarray, size: int, rhs: np.ndarray) -> torch.Tensor:
    """T^-1 rhs for the lower triangle T = triangle[:size, :size] (``rhs``: size x k)."""
    x = torch.from_numpy(np.ascontiguousarray(rhs))
    _solve_by_blocks(torch.from_numpy(triangle)[:size, :size], x, upper=False, unit=False)
    return x


def _solve_by_blocks(t: torch.Tensor, x: torch.Tensor, upper: bool, unit: bool) -> None:
    """x = T^-1 x in place, for a square triangular T whose rows are contiguous (a block of a larger matrix), by
    blocks of _PANEL rows: each block row of T is read where it lies (a product with a strided view), where a
    triangular solve would first copy the whole of T (at D = 4097, 134 MiB, once a panel of an elimination)."""
    size = t.shape[0]
    starts = range(0, size, _PANEL)
    for s in (reversed(starts) if upper else starts):
        e = min(s + _PANEL, size)
        if upper and e < size:
            x[s:e] -= t[s:e, e:] @ x[e:]
        elif not upper and s:
            x[s:e] -= t[s:e, :s] @ x[:s]
        x[s:e] = torch.linalg.solve_triangular(t[s:e, s:e], x[s:e], upper=upper, unitriangular=unit)


def _first_to_reach_zero(alpha: np.ndarray, u: np.ndarray, reach: np.ndarray) -> int:
    """argmin of alpha_i / u_i over u_i > 0 (alpha >= 0), the first weight that alpha - t u brings to zero as t
    grows; -1 when no u_i is positive. Found as argmax of u_i / alpha_i in one pass, with no mask: a weight at 0
    where u_i > 0 gives +inf, a step of 0, as it should (the largest such u_i is taken). An entry of u that is
    only rounding at a weight that is only rounding is no pivot. The caller holds its dropped coordinates at
    +inf (so u_i / alpha_i = 0 there); a 0 / 0 elsewhere (u_i = 0 where the weight is 0) gives NaN, no
    candidate. ``reach`` is scratch."""
    with np.errstate(divide="ignore", invalid="ignore"):
        np.divide(u, alpha, out=reach)
    out = int(np.argmax(reach))
    value = reach[out]
    if value != value:  # a 0 / 0: u_i = 0 at a weight at 0, no candidate
        reach[np.isnan(reach)] = 0.0
        out = int(np.argmax(reach))
        value = reach[out]
    if value == np.inf:  # weights at 0 with u_i > 0: a step of 0 whichever is dropped; the largest u_i is
        zero = np.flatnonzero(reach == np.inf)  # the pivot the later corrections divide by
        out = int(zero[np.argmax(u[zero])])
    if not value > 0:
        return -1
    if u[out] > _NEGLIGIBLE * np.abs(u).max() or alpha[out] > _NEGLIGIBLE:
        return out
    # u_i only rounding where the weight is only rounding too (0, or what a tie left): such entries are set to
    # 0 (their weights do not move) and the test is made again on the rest
    u[(np.abs(u) <= _NEGLIGIBLE * np.abs(u).max()) & (alpha <= _NEGLIGIBLE)] = 0.0
    return _first_to_reach_zero(alpha, u, reach)


# a null vector's entry this far below its largest is rounding where the weight is below it too (weights sum to 1)
_NEGLIGIBLE = 2.0**-30


_triangular_solve = scipy.linalg.lapack.dtrtrs  # what solve_triangular calls, without its checks' overhead


_BATCH_PANEL = 64  # the batched steps' panel: each step re-reads its panel's earlier vectors


def eliminate_batch(points: torch.Tensor, alpha: torch.Tensor, null: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, np.ndarray]:
    """``eliminate`` for a batch, on the points' device: points B x m x D (m > D), or one m x D array that every
    certificate of the batch shares (a pool's rows: ``null``, their null vectors, may then be given), weights
    B x m >= 0.

    The same steps as ``eliminate``, taken for every certificate of the batch together: null vectors
    from an LU factorisation of each (or the shared ones), then m - D steps, each dropping one row per
    certificate, with the corrections by earlier panels applied by batched triangular solves and products.
    No step waits on the host. Returns the new weights and, per certificate, whether a step found no direction
    to move in (rounding); those are done again by ``eliminate``.
    """
    batch, m = alpha.shape
    dim = points.shape[-1]
    r = m - dim
    device = alpha.device
    if points.dim() == 2:  # one pool's rows: their null vectors once, a copy per certificate for its corrections
        shared = null if null is not None else null_vectors(points)
        null = shared.expand(batch, r, m).clone()
        del shared
    else:  # the null vectors one certificate at a time (an LU factorisation each: a fraction of the steps' cost)
        null = torch.stack([null_vectors(p) for p in points])
    alpha = alpha.clone()
    triangle = torch.zeros(batch, r, r, dtype=points.dtype, device=device)
    dropped = torch.zeros(batch, r, dtype=torch.int64, device=device)
    alive = torch.ones(batch, m, dtype=torch.bool, device=device)
    failed = torch.zeros(batch, dtype=torch.bool, device=device)
    for start in range(0, r, _BATCH_PANEL):
        panel = null[:, start:start + _BATCH_PANEL].clone()
        if start:
            seen = dropped[:, :start]
            x = torch.linalg.solve_triangular(triangle[:, :start, :start],
                                              panel.gather(2, seen[:, None, :].expand(-1, panel.shape[1], -1)).mT,
                                              upper=False)
            panel -= x.mT @ null[:, :start]
        for i in range(panel.shape[1]):
            j = start + i
            u = panel[:, i]
            if i:
                x = torch.linalg.solve_triangular(triangle[:, start:j, start:j], u.gather(1, dropped[:, start:j])[..., None],
                                                  upper=False)
                u = u - (x.mT @ null[:, start:j])[:, 0]
            u = u.masked_fill(~alive, 0.0)
            u = torch.where((u.amax(dim=1) <= 0)[:, None], -u, u)
            # as in eliminate: an entry of u far below its largest, where the weight is only rounding, is no pivot
            rounding = (alpha <= _NEGLIGIBLE) & (u <= _NEGLIGIBLE * u.abs().amax(dim=1, keepdim=True))
            positive = alive & (u > 0) & ~rounding
            ratios = torch.where(positive, alpha / torch.where(positive, u, torch.ones_like(u)), torch.inf)
            step, out = ratios.min(dim=1)
            # as in eliminate: among weights already at 0 (steps of 0) the largest entry of u is the pivot,
            # which the later corrections divide by
            at_zero = positive & (alpha == 0)
            out = torch.where(at_zero.any(dim=1), torch.where(at_zero, u, -torch.inf).argmax(dim=1), out)
            stuck = ~torch.isfinite(step)
            failed |= stuck
            step = torch.where(stuck, torch.zeros_like(step), step)
            alpha = (alpha - step[:, None] * u).clamp_(min=0.0)  # rounding may leave -1e-17 where ratios tied
            alpha.scatter_(1, out[:, None], 0.0)
            alive.scatter_(1, out[:, None], False)
            null[:, j] = u  # its null vector is spent: the corrected one takes its place
            dropped[:, j] = out
            triangle[:, j, :j + 1] = null[:, :j + 1].gather(2, out[:, None, None].expand(-1, j + 1, 1))[..., 0]
    return alpha, failed.cpu().numpy()
