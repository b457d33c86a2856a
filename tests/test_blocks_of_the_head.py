"""Work on the whole head done by blocks (the coordinate-wise median, the normal form's power-of-two scaling)
gives what the whole-matrix operation gives: checked with blocks small enough to take several."""

import numpy as np
import pytest
import torch

import auditor.engine.head as engine_head
import auditor.engine.normal_form as normal_form


def test_the_median_by_blocks_of_columns_is_the_whole_matrix_median(rng, monkeypatch):
    W = torch.from_numpy(rng.standard_normal((501, 37)).astype(np.float32))
    competitor = torch.from_numpy(rng.random(501) > 0.3)
    whole = torch.kthvalue(W[competitor].T.contiguous(), (int(competitor.sum()) + 1) // 2, dim=1).values.double()
    monkeypatch.setattr(engine_head, "_MEDIAN_ENTRIES", 1000)  # two columns a block
    assert torch.equal(engine_head.median_row(W, competitor), whole)


@pytest.mark.parametrize("e", [-3, 5])
def test_scaling_by_blocks_is_exact_and_falls_back_to_float64_in_a_later_block(rng, monkeypatch, e):
    monkeypatch.setattr(normal_form, "_BLOCK_ROWS", 4)
    W = torch.from_numpy(rng.standard_normal((13, 3)).astype(np.float32))
    assert torch.equal(normal_form._scaled(W, e, "head"), W * 2.0**e)
    W[9, 1] = 2.0**-148 if e < 0 else 2.0**126  # only float64 holds it scaled: the third block finds out
    scaled = normal_form._scaled(W, e, "head")
    assert scaled.dtype == torch.float64
    assert torch.equal(scaled, W.double() * 2.0**e)
    bias = torch.from_numpy(rng.standard_normal(13))
    assert torch.equal(normal_form._scaled(bias, e, "bias"), bias * 2.0**e)  # one dimension
