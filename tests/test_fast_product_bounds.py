"""The float32 products that steer Frank-Wolfe and the bounded dual (EngineHead.fast_logits and the dual's
working set) against their stated bound, fast_error_factor ||w_i|| ||z|| + fast_underflow_floor, checked in
exact rational arithmetic (fractions.Fraction of every float64 entry, products and sums exact).

Those iterations report lower bounds for the tokens they leave inconclusive from that bound, so it must hold
for every point they meet, tiny ones included: near a token's hull the residual z can be tiny, and its
entries would round to float32 subnormals, an absolute error a far row's ||w_i||_1 multiplies (the case
here: a row 64 times the typical and points of size 2^-140). The products are checked for float32 and
bfloat16 storage, with and without the normal form's power of two."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from auditor.engine.solvers.bounded_dual import _WorkingSet
from conftest import engine_head


def _exact_excess(head, z: torch.Tensor, found: np.ndarray, ids: np.ndarray) -> float:
    """The largest |found - exact| / bound over points and rows, in rationals (the bound's own few float64
    operations are taken as they are: 2^-40 of slack would not change what this test tells apart)."""
    rows = head.rows64(ids).numpy()  # exact: 2^a times the stored values
    worst = 0.0
    for p, point in enumerate(z.numpy()):
        size = Fraction(float(torch.linalg.vector_norm(z[p]))) * (1 + Fraction(1, 2**40))  # ||z||, rounded up
        exact_point = [Fraction(float(x)) for x in point]
        for j, i in enumerate(ids):
            exact = sum(Fraction(float(w)) * x for w, x in zip(rows[j], exact_point))
            bound = (Fraction(head.fast_error_factor) * Fraction(float(head.row_norm[i])) * size
                     + Fraction(head.fast_underflow_floor))
            worst = max(worst, float(abs(Fraction(float(found[p, j])) - exact) / bound))
    return worst


def _head(rng, dtype, scale):
    W = rng.standard_normal((60, 8)).astype(np.float32) * np.float32(scale)
    W[5] *= np.float32(64.0)  # a far row: its ||w||_1 multiplies whatever rounding the point suffers
    return engine_head(torch.from_numpy(W).to(dtype))


@pytest.mark.parametrize("dtype,scale", [(torch.float32, 1.0), (torch.float32, 2.0**-20), (torch.bfloat16, 1.0),
                                         (torch.bfloat16, 2.0**30)])
@pytest.mark.parametrize("size", [1.0, 2.0**-60, 2.0**-140, 2.0**-1000])
def test_fast_logits_keep_their_bound_for_points_of_any_size(rng, dtype, scale, size):
    head = _head(rng, dtype, scale)
    assert head.stored.dtype == dtype  # the rows as given, their power of two carried
    z = torch.from_numpy(rng.standard_normal((3, head.d)) * size)
    ids = np.arange(head.n)
    assert _exact_excess(head, z, head.fast_logits(z).numpy(), ids) <= 1.0


def _worst_point(head, far: int = 5) -> torch.Tensor:
    """Entries (2 + 1/2 - 2^-20) 2^-149 with the far row's signs: each rounds to float32 (a subnormal) by just
    under half a unit of 2^-149, all in the direction that adds up along the far row, whose entries are 64 or
    so: its product then errs by about ||w||_1 2^-150, ten times the floor at d = 8, while ||z|| is too small
    for the relative term to cover it."""
    signs = torch.sign(head.rows64([far])[0])
    return (signs * ((2 + 0.5 - 2.0**-20) * 2.0**-149))[None, :]


def _signed_head(dtype):
    rng = np.random.default_rng(3)
    W = rng.standard_normal((60, 8)).astype(np.float32)
    W[5] = np.float32(64.0) * np.sign(W[5])
    return engine_head(torch.from_numpy(W).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_worst_tiny_point_keeps_the_bound_and_would_break_it_unscaled(dtype):
    """The case the scaling is for: float32 products of the point as given (fl32(z)) miss the bound on the
    far row, so the exact check can fail; fast_logits and the dual's working set keep it."""
    head = _signed_head(dtype)
    z = _worst_point(head)
    ids = np.arange(head.n)
    rows = head.rows_in_storage(torch.arange(head.n))
    plain = (z.to(torch.float32) @ rows.T).to(torch.float64).numpy()
    assert _exact_excess(head, z, plain, ids) > 2.0
    assert _exact_excess(head, z, head.fast_logits(z).numpy(), ids) <= 1.0
    working = _WorkingSet(head, torch.arange(head.n), torch.zeros(head.n, dtype=torch.float64))
    assert _exact_excess(head, z, working.scores(z, torch.full((1,), -1)).numpy(), working.members.numpy()) <= 1.0


@pytest.mark.parametrize("size", [1.0, 2.0**-140])
def test_the_dual_s_working_set_keeps_the_bound(rng, size):
    head = _head(rng, torch.bfloat16, 1.0)
    members = torch.arange(head.n)
    working = _WorkingSet(head, members, torch.zeros(head.n, dtype=torch.float64))
    z = torch.from_numpy(rng.standard_normal((2, head.d)) * size)
    scores = working.scores(z, torch.full((2,), -1)).numpy()
    assert _exact_excess(head, z, scores, working.members.numpy()) <= 1.0
