"""The facts of the spec, each checked on exact token sets and on the certificates."""

import numpy as np
import pytest

import auditor
from oracles import convex_residual, witness_wins

SEED_ROWS = np.array([[1, 2], [2, 1], [1, 0], [0, 1], [1, 1]], dtype=float)


def assert_certificates(report, W, b=None):
    """Every verdict's certificate re-checked by hand, with no auditor code."""
    for token in report.tokens:
        if token.verdict == "argmaxable":
            assert token.convex_indices is None
            assert witness_wins(W, b, token.id, token.witness), token
        elif token.verdict == "unargmaxable":
            assert token.witness is None
            residual, gap = convex_residual(W, b, token.id, token.convex_indices, token.convex_weights)
            assert residual <= token.residual * (1 + 1e-9) + 1e-300
            assert residual <= 1e-9 * np.linalg.norm(W, axis=1).max()


def test_seed_example_flags_exactly_the_middle_row():
    report = auditor.audit(SEED_ROWS, progress=False)
    assert report.ids("unargmaxable") == [4]
    assert report.ids("argmaxable") == [0, 1, 2, 3]
    assert_certificates(report, SEED_ROWS)


def test_seed_example_middle_row_is_the_average_of_the_corners():
    token = auditor.audit(SEED_ROWS, progress=False).tokens[4]
    combination = token.convex_weights @ SEED_ROWS[token.convex_indices]
    np.testing.assert_allclose(combination, SEED_ROWS[4], atol=1e-14)


@pytest.mark.parametrize("n,d", [(50, 3), (400, 16), (2000, 8)])
def test_distinct_rows_of_equal_norm_are_all_argmaxable(rng, n, d):
    W = rng.standard_normal((n, d))
    W /= np.linalg.norm(W, axis=1, keepdims=True)
    report = auditor.audit(W, progress=False)
    assert report.counts["argmaxable"] == n
    assert_certificates(report, W)


@pytest.mark.parametrize("n,d", [(5, 4), (17, 16), (9, 64)])
def test_affinely_independent_rows_are_all_argmaxable(rng, n, d):
    W = rng.standard_normal((n, d)) * rng.uniform(0.01, 10, size=(n, 1))
    report = auditor.audit(W, progress=False)
    assert report.counts["argmaxable"] == n
    assert_certificates(report, W)


def test_convex_combination_of_other_rows_is_unargmaxable(rng):
    W = rng.standard_normal((60, 5))
    weights = rng.dirichlet(np.ones(7))
    W = np.vstack([W, weights @ W[:7]])
    report = auditor.audit(W, progress=False)
    assert 60 in report.ids("unargmaxable")
    assert_certificates(report, W)


def test_verdicts_are_invariant_under_an_invertible_linear_map(rng):
    W = rng.standard_normal((300, 6))
    W = np.vstack([W, 0.9 * W[:40] + 0.1 * W[40:80]])  # some rows pulled inside
    A = rng.standard_normal((6, 6)) + 3 * np.eye(6)
    before = auditor.audit(W, progress=False)
    after = auditor.audit(W @ A.T, progress=False)
    assert before.ids("unargmaxable") == after.ids("unargmaxable")
    assert before.ids("argmaxable") == after.ids("argmaxable")
    assert_certificates(after, W @ A.T)


def test_a_single_row_wins_everywhere():
    report = auditor.audit(np.array([[0.5, -1.0]]), progress=False)
    assert report.ids("argmaxable") == [0]


def test_zero_row_at_the_centre_of_a_symmetric_cloud_is_unargmaxable():
    W = np.vstack([np.eye(3), -np.eye(3), np.zeros((1, 3))])
    report = auditor.audit(W, progress=False)
    assert report.ids("unargmaxable") == [6]
    assert_certificates(report, W)
