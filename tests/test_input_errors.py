"""Bad input raises one clear InputError and decides nothing."""

import numpy as np
import pytest
import torch

import auditor


def good():
    return np.random.default_rng(0).standard_normal((10, 3))


def test_nan_rows_are_named():
    W = good()
    W[4, 1] = np.nan
    W[7, 0] = np.inf
    with pytest.raises(auditor.InputError, match=r"rows 4, 7"):
        auditor.audit(W, progress=False)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_rows_whose_sum_overflows_are_finite_and_opposite_infinities_are_not(dtype):
    """The check sums each row first: a finite row whose sum overflows is looked at entry by entry and
    passes; a row holding +Inf and -Inf (whose sum is NaN) and one NaN among large entries are named."""
    big = float(torch.finfo(dtype).max)
    W = torch.ones(12, 4, dtype=dtype)
    W[3] = big  # finite, but its sum overflows
    W[5, 0], W[5, 1] = float("inf"), float("-inf")
    W[8, :3], W[8, 3] = big, float("nan")
    with pytest.raises(auditor.InputError, match=r"rows 5, 8$"):
        auditor.audit(W, progress=False)
    W[5], W[8] = 1.0, 2.0
    assert auditor.audit(W, progress=False).n_tokens == 12


def test_nan_in_bias_is_named():
    b = np.zeros(10)
    b[2] = -np.inf
    with pytest.raises(auditor.InputError, match=r"bias .* rows 2"):
        auditor.audit(good(), b, progress=False)


@pytest.mark.parametrize("shape", [(10,), (2, 3, 4)])
def test_weight_must_be_two_dimensional(shape):
    with pytest.raises(auditor.InputError, match="two-dimensional"):
        auditor.audit(np.zeros(shape), progress=False)


def test_bias_length_must_match():
    with pytest.raises(auditor.InputError, match="length 10"):
        auditor.audit(good(), np.zeros(9), progress=False)


@pytest.mark.parametrize("shape", [(0, 4), (4, 0)])
def test_empty_head_is_refused(shape):
    with pytest.raises(auditor.InputError, match="empty"):
        auditor.audit(np.zeros(shape), progress=False)


@pytest.mark.parametrize("spec", ["sphere", "ball", "ball:-1", "box:abc", "ball:nan", 3])
def test_unknown_domain_is_refused(spec):
    with pytest.raises(auditor.InputError, match="domain"):
        auditor.audit(good(), domain=spec, progress=False)


def test_integer_weights_are_refused():
    with pytest.raises(auditor.InputError, match="dtype"):
        auditor.audit(np.ones((3, 2), dtype=np.int64), progress=False)


def test_out_of_range_token_ids_are_refused():
    with pytest.raises(auditor.InputError, match="outside the vocabulary"):
        auditor.audit(good(), tokens=[0, 10], progress=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_refused():
    with pytest.raises(auditor.InputError, match="CUDA"):
        auditor.audit(good(), device="cuda", progress=False)


def test_domain_strings_parse():
    assert auditor.parse_domain("ball:2.5") == auditor.Ball(2.5)
    assert auditor.parse_domain(" BOX:1e-3 ") == auditor.Box(1e-3)
    assert auditor.parse_domain("unbounded") == auditor.Unbounded()
