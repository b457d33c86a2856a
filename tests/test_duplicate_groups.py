"""Exact duplicate rows are grouped by value: the hash only proposes candidates (a collision costs a
comparison, never a wrong group). Checked against numpy's grouping of the rows by value."""

import numpy as np
import pytest
import torch

import auditor.engine.screen.ties as ties


def _oracle(W: np.ndarray, b: np.ndarray | None) -> np.ndarray:
    """The smallest id of each row's group of equal rows (and biases), -0.0 equal to 0.0."""
    keys = [tuple((W[i] + 0.0).tolist()) + ((float(b[i]) + 0.0,) if b is not None else ()) for i in range(len(W))]
    first: dict = {}
    return np.array([first.setdefault(key, i) for i, key in enumerate(keys)])


def _head(rng, dtype):
    W = rng.standard_normal((300, 7)).astype(dtype)
    W[10:20] = W[3]  # a group of eleven
    W[40] = W[41] = W[42]  # a group of three
    W[50, 2] = -0.0
    W[51] = W[50]
    W[51, 2] = 0.0  # equal in value to row 50
    W[60] = W[61]
    W[60, 0] = np.nextafter(W[61, 0], np.inf)  # one ulp apart: not a copy
    return W


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("with_bias", [False, True])
def test_groups_are_the_rows_equal_in_value(rng, dtype, with_bias):
    W = _head(rng, dtype)
    b = None
    if with_bias:
        b = rng.standard_normal(300)
        b[10:20] = b[3]
        b[15] = b[3] + 1.0  # same row, another bias: not a copy
        b[[40, 41, 42, 50, 51]] = 0.5
    expected = _oracle(W, b)
    got = ties.duplicate_groups(torch.from_numpy(W), None if b is None else torch.from_numpy(b))
    assert np.array_equal(got, expected)
    assert got[51] == 50 and got[60] == 60 and got[15] == 15 if with_bias else got[15] == 3


def test_every_row_colliding_still_gives_the_groups_by_value(rng, monkeypatch):
    W = _head(rng, np.float32)
    monkeypatch.setattr(ties, "_row_hashes", lambda weight: np.zeros(weight.shape[0], dtype=np.int64))
    assert np.array_equal(ties.duplicate_groups(torch.from_numpy(W), None), _oracle(W, None))
