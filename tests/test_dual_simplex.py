"""The dual simplex from a shared basis (engine/exact/dual_simplex.py): a certificate exactly when the point lies
in the hull of the pool (an LP over the pool and, in three dimensions, qhull as oracles), on at most as
many rows as the pool spans, never the token's own row, and accepted by the float64 check."""

import numpy as np
import pytest
import scipy.optimize
import scipy.spatial
import torch

from auditor.engine.arithmetic.head import build_engine_head
from auditor.engine.exact.caratheodory import lifted_points, reduce_support
from auditor.engine.exact.certify import check_convex
from auditor.engine.exact.dual_simplex import Basis
from auditor.engine.exact.pools import centre_pool, spread_pool
from auditor.engine.screen.ties import duplicate_groups
from auditor.question.domain import Unbounded
from conftest import mean_initialised


def engine_head(W, b=None):
    W, b = torch.from_numpy(W), None if b is None else torch.from_numpy(b)
    return build_engine_head(W, b, duplicate_groups(W, b), Unbounded(), 1e-10)


def in_hull_lp(points: np.ndarray, target: np.ndarray) -> bool:
    """Oracle: is ``target`` a convex combination of ``points`` (an LP feasibility problem, HiGHS)?"""
    m = points.shape[0]
    found = scipy.optimize.linprog(np.zeros(m), A_eq=np.vstack([points.T, np.ones((1, m))]),
                                   b_eq=np.append(target, 1.0), bounds=(0, None), method="highs")
    return found.status == 0


def assert_certificate(head, W, k, found, bias=None, rows_spanned=None):
    support, weights = found
    assert k not in support and np.all(weights > 0) and abs(weights.sum() - 1) < 1e-12
    assert support.size <= (rows_spanned or W.shape[1] + 1 + (bias is not None))
    assert np.linalg.norm(weights @ W[support] - W[k]) <= 1e-11 * np.linalg.norm(W[k])
    assert check_convex(head, k, support, weights).accepted


def centre_of_a_resized_head(rng, d=24):
    """3000 anisotropic rows of width d and 4 mean-initialised ones after them: (W, head, the centre pool, the
    basis' start on it)."""
    old = (rng.standard_normal((3000, d)) * np.arange(1, d + 1) ** -0.7 + 0.3).astype(np.float32)
    W = np.vstack([old, mean_initialised(old, 4, rng)])
    head = engine_head(W)
    pool, support = centre_pool(head, spread_pool(head))
    return W, head, pool, support


def test_mean_initialised_rows_take_a_few_pivots_from_the_basis_of_the_centre(rng):
    d = 24
    W, head, pool, support = centre_of_a_resized_head(rng, d)
    basis = Basis(head, pool.indices, support)
    assert basis.span is None and basis.points.shape[1] == d + 1  # the start spans R^(d+1): no SVD taken
    W64 = W.astype(np.float64)
    for k in range(3000, 3004):
        assert_certificate(head, W64, k, basis.certificate(k, max_pivots=d + 1))


def test_a_certificate_exactly_when_the_pool_holds_the_point(rng):
    # three dimensions: qhull and an LP over the pool say which points the pool's hull holds
    W = rng.standard_normal((400, 3))
    head = engine_head(W)
    pool = np.arange(0, 400, 2)  # the even rows; odd rows are the targets
    start, _, _ = reduce_support(head, pool, np.full(pool.size, 1.0 / pool.size))
    basis = Basis(head, pool, start)
    hull = scipy.spatial.Delaunay(W[pool])
    inside = 0
    for k in range(1, 400, 2):
        expected = hull.find_simplex(W[k]) >= 0
        assert expected == in_hull_lp(W[pool], W[k])
        found = basis.certificate(k, max_pivots=10_000)
        assert (found is not None) == expected, k
        if found is not None:
            inside += 1
            assert set(found[0].tolist()) <= set(pool.tolist())
            assert_certificate(head, W, k, found)
    assert 20 < inside < 180  # both kinds were tried


def test_the_tokens_own_row_leaves_the_basis(rng):
    W = rng.standard_normal((60, 4))
    W[59] = W[:59].mean(axis=0)  # inside the hull of the others
    head = engine_head(W)
    pool = np.arange(60)
    start, _, _ = reduce_support(head, np.arange(59), np.full(59, 1 / 59))
    start = np.append(start[1:], 59)  # the token's own row in the starting basis
    basis = Basis(head, pool, start)
    assert 59 in basis.pool[basis.start]
    assert_certificate(head, W, 59, basis.certificate(59, max_pivots=1000))


def test_rows_on_a_hyperplane_span_fewer_dimensions(rng):
    # normalised rows have mean zero across coordinates: (w, 1) spans d dimensions, not d + 1
    W = rng.standard_normal((500, 8))
    W -= W.mean(axis=1, keepdims=True)
    W = np.vstack([W, W.mean(axis=0)])
    head = engine_head(W)
    pool, support = centre_pool(head, spread_pool(head))
    basis = Basis(head, pool.indices, support)
    assert basis.span.shape[1] == 8 and basis.points.shape[1] == 8  # found by the SVD: the start is singular
    assert_certificate(head, W, 500, basis.certificate(500), rows_spanned=8)


@pytest.mark.parametrize("raised", [0.0, 1e-3])
def test_with_a_bias_the_target_fixes_the_weights_bias(rng, raised):
    n, d = 800, 6
    W = rng.standard_normal((n, d))
    b = 0.1 * rng.standard_normal(n)
    W[-1], b[-1] = W[:-1].mean(axis=0), b[:-1].mean() - 0.05  # inside, and below the others' mean bias
    head = engine_head(W, b)
    pool, support = centre_pool(head, spread_pool(head))
    basis = Basis(head, pool.indices, support)
    point = lifted_points(head, np.array([n - 1]))[0]
    point[-2] += raised
    support, weights = basis.certificate(n - 1, point, max_pivots=1000)
    assert np.linalg.norm(weights @ W[support] - W[-1]) <= 1e-11 * np.linalg.norm(W[-1])
    assert abs(weights @ b[support] - (b[-1] + raised)) <= 1e-12  # the bias it was asked for, exactly
    if raised:  # the weights' bias exceeds b_k by the amount asked for: a certificate in R^d
        check = check_convex(head, n - 1, support, weights)
        assert check.accepted and check.bias_gap <= -0.99 * raised


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_the_own_row_leaves_within_the_default_pivots(seed):
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((300, 6))
    W[299] = 0.6 * W[:299].mean(axis=0) + 0.4 * W[5]  # inside the hull of the others
    head = engine_head(W)
    start, _, _ = reduce_support(head, np.arange(299), np.full(299, 1 / 299))
    basis = Basis(head, np.arange(300), np.append(start[1:], 299))
    assert 299 in basis.pool[basis.start]
    assert_certificate(head, W, 299, basis.certificate(299))  # at most r = 7 pivots


def test_a_biased_mean_row_is_reduced_through_the_basis_with_half_the_dense_excess(rng):
    from auditor.engine.decisions import STAGES
    from auditor.engine.settle import CentreRoutes

    n, d = 1500, 8
    W = rng.standard_normal((n, d))
    b = 0.1 * rng.standard_normal(n)
    W[-1], b[-1] = W[:-1].mean(axis=0), b[:-1].mean() - 0.01
    head = engine_head(W, b)
    dense = np.arange(n - 1)
    alpha = np.full(n - 1, 1.0 / (n - 1))  # the uniform weights: bias excess exactly 0.01 above b_k
    gap = float(b[-1] - alpha @ b[:-1])
    reduced = CentreRoutes(head).reduce(n - 1, dense, alpha, 0.0, gap)
    assert reduced is not None and STAGES  # a certificate through the routes
    indices, weights, _, reduced_gap = reduced
    assert indices.size <= d + 2
    assert reduced_gap == pytest.approx(gap / 2, rel=1e-6)  # the basis route: half the dense excess kept


def test_an_ill_conditioned_start_that_spans_is_used_as_it_is(rng):
    # A wide head's start of D rows is far from orthogonal (its condition estimate 1e-8 at D = 4097) yet spans
    # R^D: it is inverted as it is, with no SVD of the pool, and the certificates still agree with the LP.
    d = 6
    W = rng.standard_normal((400, d))
    pool = np.arange(0, 400, 2)
    start, _, _ = reduce_support(head := engine_head(W), pool, np.full(pool.size, 1.0 / pool.size))
    a, b, last = start[0], start[1], start[-1]
    W[last] = 0.5 * W[a] + 0.5 * W[b] + 1e-9 * rng.standard_normal(d)  # nearly on the segment of two others
    head = engine_head(W)
    basis = Basis(head, pool, start)
    assert basis.span is None and basis.points.shape[1] == d + 1
    tried = inside = 0
    for k in range(1, 400, 2):
        expected = in_hull_lp(W[pool], W[k])
        found = basis.certificate(k, max_pivots=10_000)
        tried += 1
        if found is not None:
            inside += 1
            assert expected
            assert_certificate(head, W, k, found)
    assert inside > 20


def test_a_start_of_fewer_than_d_rows_is_completed_from_the_pool(rng):
    # A reduction may leave fewer than D rows; the start is completed from the pool's rows outside their span,
    # with no SVD of the pool, and certificates agree with the LP.
    d = 6
    W = rng.standard_normal((400, d))
    head = engine_head(W)
    pool = np.arange(0, 400, 2)
    start, _, _ = reduce_support(head, pool, np.full(pool.size, 1.0 / pool.size))
    basis = Basis(head, pool, start[:-2])
    assert basis.span is None and basis.start.size == d + 1
    assert set(start[:-2].tolist()) <= set(basis.pool[basis.start].tolist())  # the given rows are kept
    inside = 0
    for k in range(1, 400, 2):
        found = basis.certificate(k, max_pivots=10_000)
        assert (found is not None) == in_hull_lp(W[pool], W[k])
        if found is not None:
            inside += 1
            assert_certificate(head, W, k, found)
    assert inside > 20


def test_a_basis_given_its_points_spends_them_and_answers_as_one_that_gathers_them(rng):
    # the pool's points, when the caller hands them over, are scaled and reordered where they lie: the basis is
    # the same as one gathering its own copy, down to the bit
    d = 24
    _, head, pool, support = centre_of_a_resized_head(rng, d)
    given = lifted_points(head, pool.indices)
    spent = Basis(head, pool.indices, support, given)
    gathered = Basis(head, pool.indices, support)
    assert np.shares_memory(spent.points, given)
    assert np.array_equal(spent.points, gathered.points) and np.array_equal(spent.pool, gathered.pool)
    assert np.array_equal(spent.inverse, gathered.inverse)
    # the start's inverse is that of its points as columns
    start = spent.points[spent.start]
    assert np.abs(spent.inverse @ start.T - np.eye(d + 1)).max() < 1e-8
    for k in range(3000, 3004):
        a, b = spent.certificate(k, max_pivots=d + 1), gathered.certificate(k, max_pivots=d + 1)
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


@pytest.mark.parametrize("m", [1, 2, 7, 64])
def test_rows_reordered_in_place_as_by_a_gather(rng, m):
    from auditor.engine.exact.dual_simplex import _reorder_rows
    for _ in range(20):
        rows = rng.standard_normal((m, 5))
        order = rng.permutation(m)
        want = rows[order]
        _reorder_rows(rows, order)
        assert np.array_equal(rows, want)


def test_the_inverse_written_over_its_matrix_is_the_inverse_of_its_transpose(rng):
    from auditor.engine.exact.dual_simplex import _inverse_if_well_conditioned
    square = rng.standard_normal((40, 40))
    want = np.linalg.inv(square.T)
    copy = square.copy()
    found = _inverse_if_well_conditioned(copy)
    assert np.shares_memory(found, copy)  # no second 40 x 40 array
    assert np.abs(found - want).max() <= 1e-10 * np.abs(want).max()
    singular = square.copy()
    singular[3] = singular[5] * 2.0  # a row twice another: rank 39, refused rather than inverted
    assert _inverse_if_well_conditioned(singular) is None


def test_the_pivots_on_device_tensors_take_the_host_s_steps(rng, monkeypatch):
    """The pivots as a GPU takes them (the basis' arrays as torch tensors, the same code), forced on the CPU,
    against the host's numpy arrays: for rows in the pool and out of it, the same answer (inside or not, as the
    LP over the pool's other rows says), on the same rows with the same weights up to rounding, every
    certificate checked."""
    from auditor.engine.exact import elimination

    d = 6
    W = rng.standard_normal((400, d))
    head = engine_head(W)
    pool = np.arange(0, 400, 2)
    start, _, _ = reduce_support(head, pool, np.full(pool.size, 1.0 / pool.size))
    on_host = Basis(head, pool, start)
    monkeypatch.setattr(elimination, "steps_on_host", lambda device: False)
    on_device = Basis(head, pool, start)
    assert isinstance(on_device.points, torch.Tensor) and isinstance(on_host.points, np.ndarray)
    inside = 0
    for k in range(1, 400, 3):
        host = on_host.certificate(k, max_pivots=10_000)
        device = on_device.certificate(k, max_pivots=10_000)
        assert (host is None) == (device is None) == (not in_hull_lp(W[pool[pool != k]], W[k]))
        if host is not None:
            inside += 1
            assert np.array_equal(host[0], device[0])
            assert np.abs(host[1] - device[1]).max() <= 1e-12
            assert_certificate(head, W, k, device)
    assert inside > 20
