"""In a few tokens' audit a float32 head's rows stay as given in the engine head, with the normal form's power of
two taken where they are read (normal_form's carry): every reading must give the
numbers the scaled copy gives, bit for bit, the screen's certified margins included, and W and 2^s W the same
answers."""

from dataclasses import replace

import numpy as np
import pytest
import torch

import auditor
from auditor.engine.arithmetic import head as head_module
from auditor.engine.screen.gram import screen
from conftest import assert_same_float64_readings, engine_head


def _head_and_copy(W: np.ndarray, bias: np.ndarray | None = None):
    """The engine head as the pipeline builds it, and the same head on its scaled copy (exponent 0)."""
    head = engine_head(torch.from_numpy(W), torch.from_numpy(bias) if bias is not None else None)
    return head, replace(head, stored=head.weight, exponent=0, _scaled_copy=[])


def _rows(rng, n=300, d=12, scale=1.0):
    return (rng.standard_normal((n, d)) * scale).astype(np.float32)


@pytest.mark.parametrize("scale", [2.0**-20, 2.0**10])  # exponents a > 0 and a < 0
def test_every_reading_of_the_rows_as_given_is_that_of_the_scaled_copy(rng, scale):
    head, copy = _head_and_copy(_rows(rng, scale=scale))
    assert head.exponent != 0 and head.stored.dtype == torch.float32
    assert copy.stored.dtype == torch.float32  # the copy is exact in float32 here
    assert_same_float64_readings(head, copy, rng)


@pytest.mark.parametrize("scale", [2.0**-20, 2.0**10])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_screen_on_the_rows_as_given_certifies_what_it_does_on_the_scaled_copy_bit_for_bit(rng, scale, with_bias):
    W = _rows(rng, scale=scale)
    bias = rng.standard_normal(len(W)) if with_bias else None  # float64, as the engine holds a bias
    head, copy = _head_and_copy(W, bias)
    ids = np.arange(head.n)
    found, expected = screen(head, ids), screen(copy, ids)
    assert found.certified.any() and not found.certified.all()
    for field in ("certified", "margin", "shift", "scale", "runner_up", "threat"):
        assert np.array_equal(getattr(found, field), getattr(expected, field), equal_nan=True), field


@pytest.mark.parametrize("scale", [2.0**-80, 2.0**70])
def test_where_2_to_the_2a_leaves_float32_the_screen_reads_the_scaled_copy_and_gives_the_same_bits(rng, scale):
    """Rows near 2^-80 take a = 80 or so: 2^2a v_k is no float32 number, and the screen's products come from
    the scaled copy instead; the certified margins are those of the head at scale 1, whose exponent is small
    (the reviewer's case: W and 2^70 W)."""
    W = _rows(rng)
    head, copy = _head_and_copy(W * np.float32(scale))
    plain, _ = _head_and_copy(W)
    assert 2 * abs(head.exponent) >= 126 and abs(plain.exponent) < 8
    ids = np.arange(head.n)
    found, expected, unscaled = screen(head, ids), screen(copy, ids), screen(plain, ids)
    for field in ("certified", "margin", "shift", "scale", "runner_up"):
        assert np.array_equal(getattr(found, field), getattr(expected, field), equal_nan=True), field
        assert np.array_equal(getattr(found, field), getattr(unscaled, field), equal_nan=True), field


def test_a_head_whose_scaled_rows_fall_below_float32_s_normal_range_is_not_carried(rng):
    """One entry of 2^-120 in a head of entries near 2^10: 2^a v is subnormal there, and may round, so the
    normal form makes its scaled copy (float64 where needed) as it does for a whole audit."""
    W = _rows(rng, scale=2.0**10)
    W[3, 4] = np.float32(1 + 2.0**-23) * np.float32(2.0**-120)
    head, _ = _head_and_copy(W)
    assert head.exponent == 0 and head.stored.dtype == torch.float64
    W[3, 4] = 0.0  # zeros scale exactly
    head, _ = _head_and_copy(W)
    assert head.exponent != 0 and head.stored.dtype == torch.float32


def test_translated_rows_are_not_carried(rng):
    """Rows whose differences from the median are float32 numbers are translated, a copy of the head: the scaled
    copy replaces it, as in a whole audit, so that no stage ever holds both."""
    W = (rng.integers(-40, 40, size=(300, 12)) / 8 + 1000.0).astype(np.float32)
    head, _ = _head_and_copy(W)
    assert head.exponent == 0 and float(head.stored.abs().max()) < 1.0  # translated and scaled


def test_the_scaled_copy_is_made_once_on_first_use_and_shared_with_copies_of_the_head(rng):
    head, _ = _head_and_copy(_rows(rng, scale=2.0**-20))
    twin = replace(head, bfloat16_entries=0)
    first = twin.weight
    assert head.weight is first and twin.weight is first
    assert torch.equal(first.double(), head.stored.double() * 2.0**head.exponent)
    other = replace(head, stored=head.stored * 2, exponent=head.exponent - 1)  # other rows: their own copy
    assert other.weight is not first and torch.equal(other.weight, first)


def test_an_audit_of_a_few_tokens_makes_no_copy_of_the_head(rng, monkeypatch):
    """Mean-initialised rows appended to a head whose normal form has a power of two: the few-token route
    reads the rows as given throughout, and its verdicts are the whole audit's."""
    W = _rows(rng, n=2000, d=24, scale=0.03)
    added = np.repeat(W.mean(axis=0, keepdims=True), 3, axis=0) + rng.standard_normal((3, 24)).astype(np.float32) * 1e-6
    W = np.vstack([W, added.astype(np.float32)])
    ids = list(range(2000, 2003)) + [0, 1, 2]
    whole = auditor.audit(W, progress=False)

    def refuse(*args, **kwargs):
        raise AssertionError("a scaled copy of the head was made")

    monkeypatch.setattr(head_module, "scaled_exactly", refuse)
    few = auditor.audit(W, tokens=ids, progress=False)
    assert [few.tokens[k].verdict for k in ids] == [whole.tokens[k].verdict for k in ids]
    assert [few.tokens[k].verdict for k in ids[:3]] == ["unargmaxable"] * 3


def test_a_whole_audit_makes_no_copy_of_the_head_and_answers_as_for_2_to_the_s_w(rng, monkeypatch):
    """The whole audit reads a float32 head as given too, the bfloat16 pass, the whitened witnesses and the
    stages after them included (the sizes that switch them on set to 0); its verdicts and margins are those of
    2^s W's audit, and the planted rows' verdicts those of the LP over all rows."""
    from oracles import lp_margin

    W = _rows(rng, n=2000, d=24, scale=0.03)
    W[1990:1993] = W[:1990].mean(axis=0) + rng.standard_normal((3, 24)).astype(np.float32) * 1e-6
    W[1993] = np.float32(2.0**-10) * W[7]  # a shrunk copy: inside, the origin lying inside the cloud
    W[1994:1996] = 0.0  # reserved rows at zero
    options = {"progress": False, "bfloat16_entries": 0, "whitened_entries": 0}
    scaled = auditor.audit(W * np.float32(2.0**12), **options)

    def refuse(*args, **kwargs):
        raise AssertionError("a scaled copy of the head was made")

    monkeypatch.setattr(head_module, "scaled_exactly", refuse)
    report = auditor.audit(W, **options)
    verdicts = [report.tokens[k].verdict for k in range(len(W))]
    assert verdicts == [scaled.tokens[k].verdict for k in range(len(W))]
    margins = np.array([report.tokens[k].margin for k in range(len(W))], dtype=float) * 2.0**12  # exact
    assert np.array_equal(np.nan_to_num(margins, nan=-1.0),
                          np.nan_to_num(np.array([scaled.tokens[k].margin for k in range(len(W))], dtype=float),
                                        nan=-1.0))
    W64 = W.astype(np.float64)
    for k in [1990, 1991, 1992, 1993]:
        assert verdicts[k] == "unargmaxable" and lp_margin(W64, None, k)[0] <= 1e-9
    assert verdicts[1994] == "tied" and report.tokens[1994].group_verdict == "unargmaxable"
    assert auditor.verify(report, W).ok
