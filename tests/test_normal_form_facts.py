"""The normal form's per-row facts (norms, distances from the median, through spread_norm an upper bound the
certificate checks rely on) and its power-of-two scaling, on heads at the edges of float64's range: every
fact is compared with its exact value in rational arithmetic, and every scaled entry with 2^a times the
entry it came from. The worst cases are built from exact numbers, not from the code's constants."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from auditor.engine.arithmetic.head import build_engine_head
from auditor.engine.arithmetic.normal_form import normal_form
from auditor.engine.arithmetic.power_of_two import scaled_exactly
from auditor.engine.screen.ties import duplicate_groups
from auditor.errors import InputError
from auditor.question.domain import Unbounded


def _engine_head(W: torch.Tensor):
    representative = duplicate_groups(W, None)
    form = normal_form(W.clone(), None, Unbounded(), torch.as_tensor(representative == np.arange(len(W))))
    head = build_engine_head(form.stored, None, representative, form.domain, 1e-10, form.row_error, None,
                             form.median, form.facts, form.stored_exponent)  # as the engine builds it
    return form, head


def _exact_square(row: torch.Tensor, centre: torch.Tensor) -> Fraction:
    return sum((Fraction(float(x)) - Fraction(float(c))) ** 2 for x, c in zip(row.tolist(), centre.tolist()))


def _near_the_median(far: float, small: float, seed: int) -> torch.Tensor:
    """Row 0 is every column's lower median (0); row 7 lies ``far`` out, row 8 ``small`` above the median."""
    rng = np.random.default_rng(seed)
    W = rng.uniform(0.5, 1.0, (9, 4)) * rng.choice([-1.0, 1.0], (9, 4))
    W[0] = 0.0
    W[1:5] = -np.abs(W[1:5])
    W[5:7] = np.abs(W[5:7])
    W[7] = far * np.array([1.0, 1.5, 1.25, 1.75])
    W[8] = small * (1 + rng.uniform(0, 1, 4))
    return torch.from_numpy(W)


@pytest.mark.parametrize("far, small", [(2.0**100, 2.0**-1000), (2.0**40, 2.0**-1000), (2.0**40, 2.0**-990)])
def test_spread_norm_bounds_the_exact_distance_of_rows_near_the_median(far, small):
    """One row far out sets a large exponent, so a row a hair from the median is subnormal, and rounded, at
    the peak's scale while the normal form holds it exactly: its facts come from the normal form's rows."""
    form, head = _engine_head(_near_the_median(far, small, 0))
    median = form.median.double()
    for i in range(form.weight.shape[0]):
        exact = _exact_square(form.weight[i].double(), median)
        assert math.isfinite(float(head.spread_norm[i]))
        assert Fraction(float(head.spread_norm[i])) ** 2 >= exact, i
        assert (exact == 0) == (float(head.spread_norm[i]) == 0), i
        norm = _exact_square(form.weight[i].double(), torch.zeros_like(median))
        assert abs(Fraction(float(head.row_norm[i])) ** 2 - norm) <= Fraction(1, 10**13) * norm, i


def test_a_float64_column_far_above_the_rest_neither_overflows_nor_breaks_translation_invariance():
    W = torch.from_numpy(np.random.default_rng(1).standard_normal((7, 4)) * 2.0**-100)
    W[:, 0] = 2.0**1000
    form, head = _engine_head(W)
    assert torch.isfinite(head.row_norm).all() and torch.isfinite(head.spread_norm).all()
    shifted = W + torch.tensor([2.0**999, 0.0, 0.0, 0.0], dtype=torch.float64)  # exact: a common offset
    assert torch.equal(shifted - torch.tensor([2.0**999, 0.0, 0.0, 0.0], dtype=torch.float64), W)
    _, other = _engine_head(shifted)
    for field in ("weight", "spread_norm", "centre_logits"):
        assert torch.equal(getattr(head, field), getattr(other, field)), field


@pytest.mark.parametrize("dtype, bits, smallest", [(torch.float32, 24, -126), (torch.float64, 53, -1022)])
@pytest.mark.parametrize("e", [-3, -40])
def test_a_product_that_rounds_up_to_the_smallest_normal_is_not_taken_as_exact(dtype, bits, smallest, e):
    """x = (1 - 2^-bits) 2^(smallest - e): x 2^e lies half a subnormal step below the smallest normal, a tie
    that rounds to the smallest normal itself. float32 falls back to float64 and scales exactly there;
    float64 has nowhere to go and says so."""
    x = math.ldexp(1 - 2.0**-bits, smallest - e)
    t = torch.tensor([[x, 1.0, -0.75], [0.5, x, 0.25]], dtype=dtype)
    assert float(t[0, 0]) == x
    if dtype == torch.float32:
        scaled, _ = scaled_exactly(t, e, "head")
        assert scaled.dtype == torch.float64
        assert all(Fraction(float(s)) == Fraction(float(v)) * Fraction(2) ** e
                   for s, v in zip(scaled.flatten().tolist(), t.flatten().tolist()))
    else:
        with pytest.raises(InputError, match="orders of magnitude"):
            scaled_exactly(t, e, "head")


def _float32_edges():
    """float32 heads at the edges of their range: (name, rows)."""
    rng = np.random.default_rng(2)
    B = rng.standard_normal((7, 3))
    W = np.zeros((7, 3))
    W[:, 0] = 2.0**127
    W[:, 1:] = np.round(B[:, 1:] * 8) * 2.0**-149
    yield "a column at 2^127, a subnormal spread", W
    huge = B * 2.0**100
    huge[0, 0], huge[1, 1] = 2.0**-140, -(2.0**-149)
    yield "2^100 entries beside subnormals", huge
    yield "every entry subnormal", np.round(B * 4) * 2.0**-149
    yield "near float32's largest", np.clip(B, -1, 1) * 2.0**127
    yield "a far common offset", B * 1e-3 + 1000.0
    tiny = B * 2.0**-140
    tiny[0], tiny[1] = 2.0**120, [1e-30, 3e-30, 0.0]
    yield "one far row, the others tiny", tiny
    grid = np.round(B * 8) * 2.0**-149
    grid[0] = [2.0**100, 2.0**101, 2.0**99]
    yield "a far row beside a subnormal grid", grid
    yield "every row equal", np.tile(B[0] * 2.0**120, (4, 1))


@pytest.mark.parametrize("name, W", list(_float32_edges()), ids=[name for name, _ in _float32_edges()])
def test_float32_facts_at_the_edges_of_the_range_are_exact_bounds_and_those_the_engine_head_finds(name, W):
    W = torch.from_numpy(np.asarray(W, dtype=np.float32))
    form, head = _engine_head(W)
    representative = duplicate_groups(W, None)
    found = build_engine_head(form.weight, None, representative, form.domain, 1e-10, form.row_error, None,
                              form.median)
    for field in ("row_norm", "spread_norm", "centre"):
        assert torch.equal(getattr(head, field), getattr(found, field)), field
    # the rows' products with the head's witness centre, the centre rounded to the rows' storage: float32 rows
    # as given with their power of two, or, where 2^a W leaves float32's range, its float64 copy
    assert head.exponent == 0 or head.stored.dtype == torch.float32
    assert torch.equal(head.witness_centre, head.centre.to(head.stored.dtype).double())
    assert torch.equal(head.centre_logits, form.weight.double() @ head.witness_centre)
    median = form.median.double()
    for i in range(W.shape[0]):
        distance = _exact_square(form.weight[i].double(), median)
        assert Fraction(float(head.spread_norm[i])) ** 2 >= distance, i
        norm = _exact_square(form.weight[i].double(), torch.zeros_like(median))
        assert abs(Fraction(float(head.row_norm[i])) ** 2 - norm) <= Fraction(1, 10**12) * norm, i


def test_zeros_of_the_input_pass_the_quick_exactness_test_and_an_underflow_to_zero_does_not():
    """A translated head has a zero in every column: zeros scale exactly, so they do not send a block to the
    slow check; a nonzero entry that underflows to zero is a rounding, and fails it."""
    from auditor.engine.arithmetic.power_of_two import surely_exact

    e = -3
    tiny = float(torch.finfo(torch.float32).tiny)
    clean = torch.tensor([[0.0, 1.5, -0.25], [0.0, 0.0, 3.0]], dtype=torch.float32)
    assert surely_exact(clean, clean * 2.0**e, e, tiny, torch.empty_like(clean))
    lost = clean.clone()
    lost[1, 1] = math.ldexp(1.0, -148)  # 2^-151 is below float32's smallest subnormal: rounds to 0
    scaled = lost * 2.0**e
    assert float(scaled[1, 1]) == 0.0
    assert not surely_exact(lost, scaled, e, tiny, torch.empty_like(lost))
