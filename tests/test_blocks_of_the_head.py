"""Work on the whole head done by blocks (the coordinate-wise median, the normal form's power-of-two scaling)
gives what the whole-matrix operation gives: checked with blocks small enough to take several."""

import numpy as np
import pytest
import torch

import auditor.engine.arithmetic.head as engine_head
import auditor.engine.arithmetic.normal_form as normal_form
import auditor.engine.arithmetic.power_of_two as power_of_two
import auditor.engine.arithmetic.row_statistics as row_statistics


def test_the_median_by_blocks_of_columns_is_the_whole_matrix_median(rng, monkeypatch):
    W = torch.from_numpy(rng.standard_normal((501, 37)).astype(np.float32))
    competitor = torch.from_numpy(rng.random(501) > 0.3)
    whole = torch.kthvalue(W[competitor].T.contiguous(), (int(competitor.sum()) + 1) // 2, dim=1).values.double()
    monkeypatch.setattr(row_statistics, "_MEDIAN_ENTRIES", 1000)  # two columns a block
    monkeypatch.setattr(row_statistics, "_MEDIAN_COLUMNS", 2)
    for threads in (1, 3):  # one thread, and columns shared among three
        monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
        median, largest, smallest = row_statistics.column_statistics(W, competitor)
        assert torch.equal(median, whole) and torch.equal(row_statistics.median_row(W, competitor), whole)
        assert torch.equal(largest, W[competitor].max(dim=0).values.double())
        assert torch.equal(smallest, W[competitor].min(dim=0).values.double())


@pytest.mark.parametrize("e", [-3, 5])
def test_scaling_by_blocks_is_exact_and_falls_back_to_float64_in_a_later_block(rng, monkeypatch, e):
    monkeypatch.setattr(power_of_two, "cache_rows", lambda d: 1)  # blocks of 4 rows
    W = torch.from_numpy(rng.standard_normal((13, 3)).astype(np.float32))
    assert torch.equal(power_of_two.scaled_exactly(W, e, "head")[0], W * 2.0**e)
    centre = torch.from_numpy(rng.standard_normal(3))
    scaled, products = power_of_two.scaled_exactly(W, e, "head", centre)  # the products with the centre on the way
    assert torch.equal(products, scaled.double() @ centre.float().double())
    W[9, 1] = 2.0**-148 if e < 0 else 2.0**126  # only float64 holds it scaled: the third block finds out
    scaled, products = power_of_two.scaled_exactly(W, e, "head", centre)
    assert scaled.dtype == torch.float64
    assert torch.equal(products, scaled @ centre)  # the float64 rows' centre is the centre itself
    assert torch.equal(scaled, W.double() * 2.0**e)
    bias = torch.from_numpy(rng.standard_normal(13))
    assert torch.equal(power_of_two.scaled_exactly(bias, e, "bias")[0], bias * 2.0**e)  # one dimension


@pytest.mark.parametrize("e", [-60, -3, 5, 90])
def test_the_centre_products_of_the_rows_as_given_are_those_of_the_scaled_rows(rng, monkeypatch, e):
    """2^e (v_i . c) is bit for bit (2^e v_i) . c for float32 rows v and a float32 centre c, at scales the
    normal form takes, with entries from the smallest subnormal to 2^120 and rows that nearly cancel; and the
    smallest nonzero |v_ij| is found, zeros set apart, where e < 0 asks for it."""
    monkeypatch.setattr(power_of_two, "cache_rows", lambda d: 1)
    V = (rng.standard_normal((40, 9)) * np.exp2(rng.integers(-30, 30, size=(40, 9)))).astype(np.float32)
    V[0, :3] = [2.0**-149, -(2.0**-140), 2.0**120]
    V[3, 4] = 0.0
    V[1] = V[2]
    V[1, 0] = np.nextafter(V[2, 0], np.float32(np.inf))
    centre = torch.from_numpy(rng.standard_normal(9) * np.exp2(rng.integers(-20, 20, size=9)))
    c32 = centre.to(torch.float32).to(torch.float64)
    products, smallest = power_of_two.centre_products(torch.from_numpy(V), centre, e)
    rows = torch.from_numpy(V).double() * 2.0**e  # exact in float64
    assert torch.equal(products, rows @ c32)
    assert smallest == (2.0**-149 if e < 0 else 0.0)


def _heads(rng):
    """float32 heads as given (scaled), translated exactly, translated through float64 (a far offset), with
    duplicate rows, and a float64 head; small blocks so that every pass takes several."""
    W = rng.standard_normal((300, 9)).astype(np.float32)
    yield "float32", torch.from_numpy(W * np.float32(3.0))
    yield "exact offsets", torch.from_numpy(np.round(W * 64) / 64)
    yield "far offset", torch.from_numpy(W + np.float32(1e4))
    copied = W.copy()
    copied[50:60] = copied[7]
    yield "duplicates", torch.from_numpy(copied)
    yield "float64", torch.from_numpy(W.astype(np.float64) * 1e-3 + 0.25)


def test_the_facts_the_normal_form_measures_are_those_the_engine_head_finds(rng, monkeypatch):
    """norms, distances from the median, the centre and the centre's products: the normal form finds them on
    the head as given and scales them; build_engine_head finds them on the normal form's rows. Bit for bit."""
    from auditor.question.domain import Unbounded
    from auditor.engine.screen.ties import duplicate_groups

    monkeypatch.setattr(normal_form, "_BLOCK_ROWS", 64)
    monkeypatch.setattr(engine_head, "_BLOCK_ROWS", 64)
    monkeypatch.setattr(row_statistics, "_BLOCK_ROWS", 64)
    for name, W in _heads(rng):
        representative = duplicate_groups(W, None)
        competitor = torch.as_tensor(representative == np.arange(len(representative)))
        form = normal_form.normal_form(W, None, Unbounded(), competitor)
        given = engine_head.build_engine_head(form.weight, None, representative, form.domain, 1e-10,
                                              form.row_error, None, form.median, form.facts)
        found = engine_head.build_engine_head(form.weight, None, representative, form.domain, 1e-10,
                                              form.row_error, None, form.median)
        for field in ("row_norm", "spread_norm", "centre", "witness_centre", "centre_logits"):
            assert torch.equal(getattr(given, field), getattr(found, field)), (name, field)
        assert given.typical_spread == found.typical_spread, name
