"""The head's covariance (EngineHead.covariance), which steers whitening, Newton's preconditioners and the
routes around the centre: on a large float32 or half-precision head its products are float32's. Checked
against numpy's float64 covariance of the rows' exact values, and the precision's null directions against
a head whose rows span a hyperplane."""

import numpy as np
import pytest
import torch

import auditor
from auditor.engine.arithmetic import head as head_module
from auditor.engine.arithmetic.rounding import UNIT_ROUNDOFF, UNIT_ROUNDOFF_32
from conftest import engine_head


def _exact_covariance(head) -> np.ndarray:
    """numpy's float64 covariance of the competitor rows, from their exact values (2^a times the stored ones)."""
    rows = head.stored.to(torch.float64).numpy() * 2.0**head.exponent
    return np.cov(rows[head.competitor.numpy()].T, bias=True)


@pytest.mark.parametrize("dtype, scale", [(dtype, scale) for dtype in (torch.float32, torch.bfloat16, torch.float16)
                                          for scale in (1.0, 2.0**-12, 2.0**10)]
                         + [(dtype, scale) for dtype in (torch.float32, torch.bfloat16) for scale in (1e20, 1e-30)])
def test_a_float32_covariance_is_the_float64_one_to_float32_rounding(rng, dtype, scale, monkeypatch):
    # (rows of 1e20 and 1e-30 are read as the engine's 2^a times them: products of the stored values would
    # overflow, or underflow to 0)
    n, d = 700, 24
    spectrum = np.arange(1, d + 1) ** -1.5  # eigenvalues over three decades
    rows = rng.standard_normal((n, d)) * np.sqrt(spectrum) + 3.0 * np.sqrt(spectrum[0]) * np.eye(d)[0]
    rows[5] = rows[9]  # a copy: not a competitor
    weight = torch.from_numpy(rows * scale).to(dtype)
    monkeypatch.setattr(head_module, "FLOAT32_COVARIANCE_WORK", 0)
    head = engine_head(weight)
    covariance = head.covariance
    assert head._covariance_unit == UNIT_ROUNDOFF_32
    exact = _exact_covariance(head)
    top = np.linalg.eigvalsh(exact)[-1]
    assert np.linalg.norm(covariance.numpy() - exact, 2) <= 64 * UNIT_ROUNDOFF_32 * top
    # and above float64's rounding, as float32 products leave it: the float64 arithmetic was not taken
    assert np.linalg.norm(covariance.numpy() - exact, 2) > 2**10 * UNIT_ROUNDOFF * top
    monkeypatch.setattr(head_module, "FLOAT32_COVARIANCE_WORK", 1 << 62)
    again = engine_head(weight)
    assert np.linalg.norm(again.covariance.numpy() - exact, 2) <= 2**10 * UNIT_ROUNDOFF * top
    assert again._covariance_unit == UNIT_ROUNDOFF
    # the precision whitens alike: every direction kept (the smallest eigenvalue is 1e-2 of the largest)
    offsets = torch.from_numpy(rows[:40] * scale).to(dtype).to(torch.float64) - head.centre
    fast, slow = offsets @ head.precision, offsets @ again.precision
    cosine = (fast * slow).sum(dim=1) / (fast.norm(dim=1) * slow.norm(dim=1))
    assert float(cosine.min()) >= 1 - 1e-6


@pytest.mark.parametrize("work", [0, 1 << 62])
def test_rows_on_a_hyperplane_leave_its_normal_out_of_the_precision(rng, work, monkeypatch):
    # A LayerNorm-ed head: every row sums to zero (up to float32 rounding), so the covariance is singular along
    # (1, ..., 1) in exact arithmetic; the rounding of either arithmetic must not bring that direction back
    n, d = 600, 16
    rows = rng.standard_normal((n, d))
    rows -= rows.mean(axis=1, keepdims=True)
    monkeypatch.setattr(head_module, "FLOAT32_COVARIANCE_WORK", work)
    head = engine_head(torch.from_numpy(rows.astype(np.float32)))
    precision = head.precision.numpy()
    assert np.linalg.matrix_rank(precision, tol=1e-9 * np.abs(precision).max()) == d - 1
    normal = np.ones(d) / np.sqrt(d)  # the float32 rows' own null direction, to their rounding
    assert np.linalg.norm(precision @ normal) <= 1e-5 * np.linalg.norm(precision, 2)


def test_an_audit_with_a_float32_covariance_decides_as_with_a_float64_one(rng, monkeypatch):
    # The covariance only steers: the same verdicts, and every certificate holds
    n, d = 900, 12
    rows = rng.standard_normal((n, d)) * np.arange(1, d + 1) ** -0.7
    rows[-1] = rows[:n - 1].mean(axis=0)  # a mean-initialised row
    rows[-2] = 0.0  # a reserved row
    rows[-3] = 0.99 * rows[4]  # a row swallowed by a longer copy
    weight = rows.astype(np.float32)
    verdicts = {}
    for work in (0, 1 << 62):
        monkeypatch.setattr(head_module, "FLOAT32_COVARIANCE_WORK", work)
        report = auditor.audit(weight, progress=False)
        assert auditor.verify(report, weight).ok
        verdicts[work] = [token.verdict for token in report.tokens]
    assert verdicts[0] == verdicts[1 << 62]
    assert verdicts[0][-3:] == ["unargmaxable"] * 3
