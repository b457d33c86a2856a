"""The interior stage's batch tests (engine/solvers/interior.py) say of every token exactly what its per-token
tests say: which tokens the tilted weights exist for, and whose plain weights are non-negative without its own."""

import numpy as np
import pytest
import torch

from auditor.engine.solvers import interior
from test_min_norm_rounds import _engine_head


def _head_with_near_mean_rows(bias: bool, seed: int):
    """200 rows in 6 dimensions and 12 rows at the mean plus 10^-3 to 1 times N(0, I): some tokens near the
    centre (weights of both signs in the batch), most far from it."""
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((200, 6)) * np.linspace(2.0, 0.5, 6)
    near = W.mean(axis=0) + np.logspace(-3, 0, 12)[:, None] * rng.standard_normal((12, 6))
    W = np.vstack([W, near])
    b = 0.1 * rng.standard_normal(len(W)) if bias else None
    return W, b


@pytest.mark.parametrize("seed", range(3))
def test_the_tilted_weights_exist_where_the_batch_says(seed):
    W, b = _head_with_near_mean_rows(True, seed)
    head = _engine_head(W, b)
    rows = torch.nonzero(head.competitor).flatten()
    lifted = interior._Lifted(head, rows)
    batch = np.arange(len(W))
    offsets = head.rows64(torch.as_tensor(batch)) - head.centre
    of = lifted.weights(batch, offsets)
    owns = torch.as_tensor(batch)
    expected = np.array([of(j, j) is not None for j in range(len(batch))])
    assert expected.any() and not expected.all()
    assert np.array_equal(of.possible(owns), expected)


@pytest.mark.parametrize("bias", [False, True])
def test_the_plain_weights_are_non_negative_where_the_batch_says(bias):
    W, b = _head_with_near_mean_rows(bias, 4)
    head = _engine_head(W, b)
    rows = torch.nonzero(head.competitor).flatten()
    batch = np.arange(len(W))
    alpha = interior._plain_weights(head, rows, head.rows64(torch.as_tensor(batch)) - head.centre)
    expected = []
    for j in batch.tolist():  # _certificate's own tests, before its float64 check
        own = float(alpha[j, j])
        others = torch.ones(len(W), dtype=torch.bool)
        others[j] = False
        expected.append(own < 1.0 and float((alpha[others, j] / (1.0 - own)).min()) >= 0)
    expected = np.array(expected)
    assert expected.any() and not expected.all()
    assert np.array_equal(interior._nonnegative_without_own(alpha, torch.as_tensor(batch)), expected)
