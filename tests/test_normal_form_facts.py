"""The normal form's per-row facts (norms, distances from the median, through spread_norm an upper bound the
certificate checks rely on) and its power-of-two scaling, on heads at the edges of float64's range: every
fact is compared with its exact value in rational arithmetic, and every scaled entry with 2^a times the
entry it came from. The worst cases are built from exact numbers, not from the code's constants."""

import math
from fractions import Fraction

import numpy as np
import pytest
import torch

from auditor.domain import Unbounded
from auditor.engine.head import build_engine_head
from auditor.engine.normal_form import _scaled, normal_form
from auditor.engine.ties import duplicate_groups
from auditor.errors import InputError


def _engine_head(W: torch.Tensor):
    representative = duplicate_groups(W, None)
    form = normal_form(W.clone(), None, Unbounded(), torch.as_tensor(representative == np.arange(len(W))))
    head = build_engine_head(form.weight, None, representative, form.domain, 1e-10, form.row_error, None,
                             form.median, form.facts)
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
        scaled, _ = _scaled(t, e, "head")
        assert scaled.dtype == torch.float64
        assert all(Fraction(float(s)) == Fraction(float(v)) * Fraction(2) ** e
                   for s, v in zip(scaled.flatten().tolist(), t.flatten().tolist()))
    else:
        with pytest.raises(InputError, match="orders of magnitude"):
            _scaled(t, e, "head")
