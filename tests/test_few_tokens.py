"""A few requested tokens of a large head: the same verdicts as the whole audit, without its whole-head work.

The rows are the ones vocabulary tools add (the exact mean, transformers' N(mean, 1e-9 cov), LlamaFactory's
mean plus N(0, 1/d) noise, axolotl's N(0, 0.02), a copy of a trained row) planted in heads of a few
thousand rows, so that asking for them is the few-token route (at most 1/64 of the head). Every verdict
is compared with the whole audit's and with the plain LP over all rows (tests/oracles.py), and every
certificate is re-checked by hand.
"""

from __future__ import annotations

import numpy as np
import pytest
from oracles import convex_residual, lp_margin, witness_wins

import auditor
from auditor.engine.arithmetic.head import EngineHead

ADDED = ("exact mean", "transformers", "llamafactory", "axolotl", "copy")


def _resized(rng, n: int, d: int, bias: bool, low_rank: int | None = None):
    """A trained-looking head of n rows with one row of each kind in ADDED appended; the added ids."""
    if low_rank:  # rows on a crowded low-dimensional cloud, as OCR and tagger heads have
        W = rng.standard_normal((n, low_rank)) @ rng.standard_normal((low_rank, d)) / np.sqrt(low_rank)
    else:
        W = rng.standard_normal((n, d)) * np.exp(0.1 * rng.standard_normal(n))[:, None]
    W = W.astype(np.float32).astype(np.float64)
    mean = W.mean(axis=0)
    added = np.stack([
        mean,
        rng.multivariate_normal(mean, 1e-9 * np.cov(W.T)),
        mean + rng.standard_normal(d) / np.sqrt(d),
        0.02 * rng.standard_normal(d),
        W[7],
    ]).astype(np.float32)
    W = np.vstack([W.astype(np.float32), added])
    b = None
    if bias:
        b = (0.1 * rng.standard_normal(W.shape[0])).astype(np.float32)
        b[n:] = np.float32(b[:n].astype(np.float64).mean())  # new rows get the mean bias too
        b[n + 4] = b[7]  # the copy keeps its row's bias: an exact tie
    return W, b, list(range(n, n + len(ADDED)))


def _check_certificates(W, b, report, ids):
    """Every verdict of ``ids`` proved by its own certificate, re-checked without the engine."""
    W64 = W.astype(np.float64)
    b64 = None if b is None else b.astype(np.float64)
    for k in ids:
        token = report.tokens[k]
        if token.verdict == "argmaxable":
            copies = [i for i in range(len(W)) if i != k and np.array_equal(W[i], W[k])
                      and (b is None or b[i] == b[k])]
            assert witness_wins(W64, b64, k, token.witness, exclude=copies)
        elif token.verdict == "unargmaxable":
            assert len(token.convex_indices) <= W.shape[1] + (2 if b is not None else 1)
            residual, gap = convex_residual(W64, b64, k, token.convex_indices, token.convex_weights)
            assert residual <= 1e-6 * np.linalg.norm(W64, axis=1).max() and gap <= 1e-9


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("low_rank", [None, pytest.param(4, marks=pytest.mark.slow)])
def test_a_few_added_tokens_get_the_whole_audits_verdicts_and_the_plain_lps(bias, low_rank):
    """Low-rank: a cloud of rank 4 in 12 dimensions, full rank only by float32 rounding (the whole audit
    takes seconds there: most rows are interior by a rounding's width)."""
    rng = np.random.default_rng(3100 + 2 * bool(bias) + (low_rank or 0))
    W, b, ids = _resized(rng, 400, 12, bias, low_rank) if low_rank else _resized(rng, 1600, 24, bias)
    few = auditor.audit(W, b, tokens=ids, progress=False)
    whole = auditor.audit(W, b, progress=False)
    assert [few.tokens[k].verdict for k in ids] == [whole.tokens[k].verdict for k in ids]
    for k in ids:
        if few.tokens[k].verdict == "tied":
            continue
        assert few.tokens[k].verdict == ("argmaxable" if lp_margin(W.astype(np.float64), None if b is None
                                                                   else b.astype(np.float64), k)[0] > 0
                                         else "unargmaxable")
    assert few.tokens[ids[4]].verdict == "tied"  # the copy
    assert few.tokens[ids[0]].verdict == "unargmaxable"  # the exact mean
    _check_certificates(W, b, few, ids)


@pytest.mark.parametrize("domain", ["ball:2", "box:0.5"])
def test_a_few_tokens_in_a_bounded_domain_get_the_whole_audits_verdicts(domain):
    rng = np.random.default_rng(3110)
    W, b, ids = _resized(rng, 1600, 24, True)
    few = auditor.audit(W, b, domain=domain, tokens=ids, progress=False)
    whole = auditor.audit(W, b, domain=domain, progress=False)
    assert [few.tokens[k].verdict for k in ids] == [whole.tokens[k].verdict for k in ids]


def test_mean_initialised_rows_are_decided_without_the_heads_covariance(monkeypatch):
    """The few-token route proves rows at and near the mean from the bases around the centre: the head's
    covariance (n d^2 work, the interior stage's and the whitened witnesses') is never formed."""
    rng = np.random.default_rng(3120)
    W, _, ids = _resized(rng, 4000, 48, False)
    mean_rows = ids[:2]  # the exact mean and transformers' row

    def refuse(self):
        raise AssertionError("the few-token route formed the head's covariance")

    monkeypatch.setattr(EngineHead, "covariance", property(refuse))
    few = auditor.audit(W, tokens=mean_rows, progress=False)
    assert [few.tokens[k].verdict for k in mean_rows] == ["unargmaxable"] * 2
    assert [few.tokens[k].stage for k in mean_rows] == ["interior"] * 2
    _check_certificates(W, None, few, mean_rows)


def test_asking_for_many_tokens_is_the_whole_route_and_agrees():
    """Past 1/64 of the head the usual stages run; the verdicts do not depend on the route."""
    rng = np.random.default_rng(3130)
    W, _, ids = _resized(rng, 600, 24, False)
    whole = auditor.audit(W, progress=False)
    some = list(range(0, 600, 7)) + ids
    part = auditor.audit(W, tokens=some, progress=False)
    assert [part.tokens[k].verdict for k in some] == [whole.tokens[k].verdict for k in some]
