"""Sparse certificates: every convex certificate rests on at most d + 1 rows (d + 2 with a bias),
proves the same verdicts as before, and passes the independent re-check."""

import numpy as np
import pytest
import torch

import auditor
from auditor.engine.arithmetic.head import build_engine_head
from auditor.engine.exact.caratheodory import reduce_support
from auditor.engine.screen.ties import duplicate_groups
from auditor.question.domain import Unbounded
from conftest import mean_initialised
from oracles import lp_margin, qhull_argmaxable


def anisotropic(rng, n, d, offset=0.3):
    """Rows shaped like a trained head's: a decaying spectrum and a common offset."""
    spectrum = np.arange(1, d + 1) ** -0.7
    return (rng.standard_normal((n, d)) * spectrum + offset).astype(np.float32)


def gaussian_head(rng, n, d, with_bias):
    """N(0, 1) rows (and bias), and the engine's head of them."""
    W = rng.standard_normal((n, d))
    b = rng.standard_normal(n) if with_bias else None
    head = build_engine_head(torch.from_numpy(W), None if b is None else torch.from_numpy(b),
                             duplicate_groups(torch.from_numpy(W), None), Unbounded(), 1e-10)
    return W, b, head


@pytest.mark.parametrize("with_bias", [False, True])
def test_reduction_keeps_the_combination_on_at_most_D_rows(rng, with_bias):
    n, d = 700, 12
    W, b, head = gaussian_head(rng, n, d, with_bias)
    alpha = rng.random(n)
    alpha /= alpha.sum()
    indices = np.arange(n)
    support, weights, _ = reduce_support(head, indices, alpha)
    assert support.size <= d + (2 if with_bias else 1)
    assert np.all(weights > 0) and abs(weights.sum() - 1) < 1e-12
    assert np.linalg.norm(weights @ W[support] - alpha @ W) < 1e-11 * np.linalg.norm(alpha @ W)
    if with_bias:
        assert abs(weights @ b[support] - alpha @ b) < 1e-11


def test_mean_initialised_rows_get_d_plus_one_rows_and_the_hull_oracle_agrees(rng):
    W = anisotropic(rng, 600, 6)
    W = np.vstack([W, mean_initialised(W, 3, rng)])
    report = auditor.audit(W, progress=False)
    assert set(report.ids("argmaxable")) == qhull_argmaxable(W.astype(np.float64))
    assert {600, 601, 602} <= set(report.ids("unargmaxable"))
    for k in report.ids("unargmaxable"):
        token = report.tokens[k]
        assert len(token.convex_indices) <= 7
        assert np.all(token.convex_weights > 0)
    assert auditor.verify(report, W).ok


def test_certificates_with_a_bias_in_a_ball_rest_on_at_most_d_plus_two_rows(rng):
    W = anisotropic(rng, 400, 5).astype(np.float64)
    W = np.vstack([W, W.mean(axis=0) + 1e-6 * rng.standard_normal((2, 5))])
    b = 0.1 * rng.standard_normal(402)
    b[400:] = b[:400].min() - 1.0  # low biases: deep inside whatever the radius
    report = auditor.audit(W, b, domain="ball:2", progress=False)
    flagged = report.ids("unargmaxable")
    assert {400, 401} <= set(flagged)
    for k in flagged:
        assert len(report.tokens[k].convex_indices) <= 7
    assert auditor.verify(report, W, b).ok


def test_sparse_certificates_on_a_larger_head_match_the_plain_lp(rng):
    """Rows deep inside (interior stage, dense before reduction) and rows just inside (Newton stage)."""
    d = 24
    W = anisotropic(rng, 1500, d, offset=0.0)  # the origin inside: a shorter copy of a row is inside too
    swallowed = [int(i) for i in rng.choice(1500, 3, replace=False)]
    longer = (1.01 * W[swallowed]).astype(np.float32)
    W = np.vstack([W, mean_initialised(W, 3, rng), longer])
    report = auditor.audit(W, progress=False)
    flagged = set(report.ids("unargmaxable"))
    assert {1500, 1501, 1502} | set(swallowed) <= flagged
    sample = sorted(flagged) + [int(k) for k in rng.choice(report.ids("argmaxable"), 5, replace=False)]
    W64 = W.astype(np.float64)
    for k in sample:
        t, _, _ = lp_margin(W64, None, k)
        assert (t <= 1e-9) == (k in flagged), k
    for k in flagged:
        assert len(report.tokens[k].convex_indices) <= d + 1
    assert auditor.verify(report, W).ok


@pytest.mark.parametrize("with_bias", [False, True])
def test_batched_reductions_keep_each_combination_on_at_most_D_rows(rng, with_bias):
    from auditor.engine.exact.caratheodory import reduce_supports

    n, d = 900, 10
    W, b, head = gaussian_head(rng, n, d, with_bias)
    certificates = []
    for j in range(19):  # more than one batch, of different sizes: dense, half, and just above 2D rows
        size = (n, n // 2, 2 * (d + 3) + 1)[j % 3]
        indices = np.sort(rng.choice(n, size=size, replace=False))
        alpha = rng.random(size) ** 4  # uneven weights, as a tilt gives
        certificates.append((indices, alpha / alpha.sum()))
    reduced = reduce_supports(head, certificates)
    D = d + (2 if with_bias else 1)
    for (indices, alpha), (support, weights) in zip(certificates, reduced):
        assert support.size <= D and set(support.tolist()) <= set(indices.tolist())
        assert np.all(weights > 0) and abs(weights.sum() - 1) < 1e-12
        assert np.linalg.norm(weights @ W[support] - alpha @ W[indices]) < 1e-11 * np.linalg.norm(alpha @ W[indices])
        if with_bias:
            assert abs(weights @ b[support] - alpha @ b[indices]) < 1e-11


@pytest.mark.parametrize("m, D", [(90, 30), (200, 60)])  # one panel of null vectors, and three
def test_the_batched_elimination_takes_the_steps_of_the_single_one(rng, m, D):
    from auditor.engine.exact.elimination import eliminate, eliminate_batch

    points = np.stack([np.hstack([rng.standard_normal((m, D - 1)), np.ones((m, 1))]) for _ in range(5)])
    alpha = rng.random((5, m))
    alpha /= alpha.sum(axis=1, keepdims=True)
    batched, failed = eliminate_batch(torch.from_numpy(points), torch.from_numpy(alpha))
    assert not failed.any()
    for j in range(5):
        single = eliminate(points[j], alpha[j])
        assert np.count_nonzero(batched[j].numpy()) == D
        assert np.array_equal(batched[j].numpy() > 0, single > 0)  # the same rows dropped, in the same order
        assert np.allclose(batched[j].numpy(), single, rtol=0, atol=1e-12)


def test_the_elimination_keeps_the_combination_through_zero_weights_and_tied_ratios(rng):
    """Weights already at zero (a 0 / 0 in the ratio test where a null vector is 0 there too) and points
    repeated with equal weights (ratios that tie exactly): the weights stay non-negative, on at most D
    points, and reproduce the same combination, with the single elimination and the batched one."""
    from auditor.engine.exact.elimination import eliminate, eliminate_batch

    m, D = 120, 25
    base = np.hstack([rng.integers(-3, 4, size=(m // 2, D - 1)).astype(np.float64), np.ones((m // 2, 1))])
    points = np.vstack([base, base])  # every point twice
    alpha = np.tile(rng.integers(0, 4, size=m // 2).astype(np.float64), 2)  # a quarter at zero, pairs equal
    alpha /= alpha.sum()
    batched, failed = eliminate_batch(torch.from_numpy(points[None]), torch.from_numpy(alpha[None]))
    assert not failed.any()
    for reduced in (eliminate(points, alpha), batched[0].numpy()):
        assert np.all(reduced >= 0) and np.count_nonzero(reduced) <= D
        assert np.abs(reduced @ points - alpha @ points).max() < 1e-12


@pytest.mark.parametrize("zero", [0.0, -0.0])
def test_a_null_vector_entry_that_is_only_rounding_is_no_pivot(zero):
    """The first null vector of these points has 2.2e-17 where its entry is 0 in exact arithmetic, at a point of
    weight 0 (given as 0.0 or as -0.0): dropped as a pivot, it would make every later correction divide by
    rounding and move the combination by O(1)."""
    from auditor.engine.exact.elimination import eliminate

    points = np.array([[-1.0, 0, 1], [-3, -3, 1], [3, 1, 1], [1, -3, 1], [2, -3, 1], [3, 1, 1]])
    alpha = np.array([1 / 6, 1 / 3, zero, 1 / 6, 1 / 6, 1 / 6])
    reduced = eliminate(points, alpha)
    assert np.all(reduced >= 0) and np.count_nonzero(reduced) <= 3
    assert abs(reduced.sum() - 1) < 1e-15
    assert np.abs(reduced @ points - alpha @ points).max() < 1e-15


def test_a_rounding_entry_is_set_apart_and_a_real_negative_one_at_a_zero_weight_is_kept():
    """The ratio test on its own: the only +inf ratio is a 1e-17 entry at a zero weight, rounding, so it is set to
    0 and the step goes by the first real ratio; the -2 at the other zero weight is a real direction (that
    weight grows), and stays as it is."""
    from auditor.engine.exact.elimination import _first_to_reach_zero

    alpha = np.array([0.0, 0.5, 0.5, 0.0])
    u = np.array([1e-17, 1.0, 0.5, -2.0])
    assert _first_to_reach_zero(alpha, u, np.empty(4)) == 1  # ratios 0.5 and 1.0: the first weight to reach 0
    assert u.tolist() == [0.0, 1.0, 0.5, -2.0]
    u = np.array([0.25, 1.0, 0.5, -2.0])  # a real entry at a zero weight: a step of 0, and it is the pivot
    assert _first_to_reach_zero(alpha, u, np.empty(4)) == 0 and u[0] == 0.25


def test_a_second_mean_initialised_row_is_reduced_from_the_first_ones_pool(rng):
    from auditor.engine.exact.pools import from_pool
    from auditor.engine.exact.certify import check_convex
    from auditor.engine.solvers.interior import interior_certificates

    W = anisotropic(rng, 2000, 16)
    W = torch.from_numpy(np.vstack([W, mean_initialised(W, 2, rng)]))
    head = build_engine_head(W, None, duplicate_groups(W, None), Unbounded(), 1e-10)
    found = interior_certificates(head, np.array([2000, 2001]))
    assert len(found[2000][0]) > 17  # dense: the interior stage weighs every row
    _, _, pool = reduce_support(head, *found[2000][:2])
    support, weights = from_pool(head, pool, 2001, *found[2001][:2])
    assert support.size <= 17 and 2001 not in support
    assert check_convex(head, 2001, support, weights).accepted
    W64 = W.numpy().astype(np.float64)
    assert np.linalg.norm(weights @ W64[support] - W64[2001]) < 1e-12 * np.linalg.norm(W64[2001])


def test_mean_initialised_rows_are_reduced_through_rows_drawn_around_the_centre(rng):
    from auditor.engine.exact.pools import centre_pool, from_pool, spread_pool
    from auditor.engine.exact.certify import check_convex
    from auditor.engine.solvers.interior import interior_certificates

    W = anisotropic(rng, 3000, 16)
    W = torch.from_numpy(np.vstack([W, mean_initialised(W, 2, rng)]))
    head = build_engine_head(W, None, duplicate_groups(W, None), Unbounded(), 1e-10)
    found = interior_certificates(head, np.array([3000, 3001]))
    spread = spread_pool(head)
    assert spread.indices.size == 3 * 17
    found_centre = centre_pool(head, spread)
    assert found_centre is not None
    centre, basis = found_centre
    assert centre.indices.size <= 2 * 17 and basis.size <= 17 and set(basis.tolist()) <= set(centre.indices.tolist())
    W64 = W.numpy().astype(np.float64)
    for pool in (spread, centre):
        for k in (3000, 3001):
            support, weights = from_pool(head, pool, k, *found[k][:2])
            assert support.size <= 17 and k not in support
            assert check_convex(head, k, support, weights).accepted
            assert np.linalg.norm(weights @ W64[support] - W64[k]) < 1e-12 * np.linalg.norm(W64[k])


def test_the_lu_factors_written_over_a_column_major_matrix_are_torchs(rng):
    from auditor.engine.exact.elimination import lu_in_place
    matrix = rng.standard_normal((30, 12))
    want, pivots, _ = torch.linalg.lu_factor_ex(torch.from_numpy(matrix))
    columns = torch.from_numpy(np.asfortranarray(matrix))
    factors, found, info = lu_in_place(columns)
    assert info == 0 and torch.equal(factors, want) and torch.equal(found, pivots)
    assert factors.data_ptr() == columns.data_ptr()  # written over the matrix itself


def test_the_cholesky_factor_written_over_a_symmetric_matrix_is_its_factor(rng):
    from auditor.engine.exact.elimination import cholesky_in_place
    g = rng.standard_normal((40, 25))
    matrix = torch.from_numpy(g.T @ g + np.eye(25))
    matrix = (matrix + matrix.T) / 2  # exactly symmetric
    want = torch.linalg.cholesky(matrix)
    held = matrix.clone()
    factor, info = cholesky_in_place(held)
    assert info == 0 and factor.data_ptr() == held.data_ptr()  # written over the matrix itself
    assert torch.allclose(factor, want, rtol=0, atol=1e-12) and torch.equal(factor, torch.tril(factor))
    _, info = cholesky_in_place(torch.from_numpy(-np.eye(3)))
    assert info != 0  # not positive definite


def test_triangular_solves_by_blocks_read_a_strided_triangle_and_match_torchs(rng):
    from auditor.engine.exact.elimination import _solve_by_blocks
    big = torch.from_numpy(rng.standard_normal((300, 200)))
    for upper, unit in ((False, False), (True, True)):
        t = big[:150, :150]  # rows contiguous, a leading dimension of 200: a block of a larger matrix
        rhs = torch.from_numpy(rng.standard_normal((150, 7)))
        dominant = t + torch.diag(torch.full((150,), 30.0, dtype=torch.float64))  # well conditioned
        view = big.clone()
        view[:150, :150] = dominant
        triangle = view[:150, :150]
        want = torch.linalg.solve_triangular(triangle, rhs, upper=upper, unitriangular=unit)
        x = rhs.clone()
        _solve_by_blocks(triangle, x, upper=upper, unit=unit)
        assert torch.allclose(x, want, rtol=1e-10, atol=1e-12)
