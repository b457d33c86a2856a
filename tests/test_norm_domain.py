"""The norm domain: hidden states a final LayerNorm or RMSNorm can output.

The oracle is the norm itself: sample many pre-norm vectors (of every scale, so
that short outputs near the centre are reached too), push them through a
LayerNorm / RMSNorm written here, and see which tokens win."""

import numpy as np
import pytest

import auditor
from conftest import mean_initialised
from oracles import witness_wins


def normalise(x, kind, gain, shift, eps):
    if kind == "layernorm":
        x = x - x.mean(axis=-1, keepdims=True)
    return gain * x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) + shift


def sampled_winners(W, b, kind, gain, shift, eps, rng, count=200_000):
    d = W.shape[1]
    scales = 10.0 ** rng.uniform(-4, 1, size=(count, 1)) * np.sqrt(eps)  # from far below sqrt(eps) to far above
    Z = normalise(rng.standard_normal((count, d)) * scales, kind, gain, shift, eps)
    logits = Z @ W.T + b
    top2 = np.partition(logits, -2, axis=1)[:, -2:]
    strict = top2[:, 1] - top2[:, 0] > 1e-9
    return set(np.argmax(logits[strict], axis=1).tolist())


@pytest.mark.parametrize("d", [2, 3])
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_sampled_winners_are_argmaxable_and_witnesses_win_through_the_norm(rng, d, kind):
    W = rng.standard_normal((60, d))
    b = 0.3 * rng.standard_normal(60)
    gain = rng.uniform(0.5, 1.5, d)
    shift = 0.3 * rng.standard_normal(d) if kind == "layernorm" else np.zeros(d)
    eps = 1e-5
    norm = auditor.FinalNorm(kind, weight=gain, bias=shift if kind == "layernorm" else None, eps=eps)
    report = auditor.audit(W, b, domain="norm", final_norm=norm, progress=False)
    assert report.counts["inconclusive"] == 0
    argmaxable = set(report.ids("argmaxable"))
    assert sampled_winners(W, b, kind, gain, shift, eps, rng) <= argmaxable
    for k in argmaxable:
        token = report.tokens[k]
        z = normalise(token.pre_norm, kind, gain, shift, eps)
        assert witness_wins(W, b, k, z)
        np.testing.assert_allclose(z, token.witness, rtol=1e-12, atol=1e-12)
    assert auditor.verify(report, W, b, final_norm=norm).ok


def test_a_token_that_wins_only_near_the_centre_needs_a_tiny_variance(rng):
    # the zero row wins only where every |z_j| < 0.1: outputs that short need mean(x^2) far below eps
    W = np.array([[1.0, 0], [-1, 0], [0, 1], [0, -1], [0, 0]])
    b = np.array([0, 0, 0, 0, 0.1])
    eps = 1e-6
    norm = auditor.FinalNorm("rmsnorm", eps=eps)
    token = auditor.audit(W, b, domain="norm", final_norm=norm, progress=False).tokens[4]
    assert token.verdict == "argmaxable"
    assert np.mean(token.pre_norm ** 2) < eps
    assert witness_wins(W, b, 4, normalise(token.pre_norm, "rmsnorm", 1.0, 0.0, eps))


def test_layernorm_cannot_see_the_all_ones_direction():
    # rows 0 and 1 differ only along (1, 1, 1): after a LayerNorm their logits are always equal
    W = np.array([[1.0, 0, 0], [2, 1, 1], [0, 1, 0], [0, 0, 1], [-1, -1, -1]])
    report = auditor.audit(W, domain="norm", final_norm=auditor.FinalNorm("layernorm", eps=1e-5), progress=False)
    unbounded = auditor.audit(W, progress=False)
    assert unbounded.tokens[1].verdict == "argmaxable"
    assert report.tokens[0].verdict in ("tied", "unargmaxable", "inconclusive")
    assert report.tokens[1].verdict in ("tied", "unargmaxable", "inconclusive")
    assert report.tokens[0].verdict != "argmaxable" and report.tokens[1].verdict != "argmaxable"


def test_unit_offset_weight_is_one_plus_the_stored_weight(rng):
    W = rng.standard_normal((80, 4))
    gain = rng.uniform(0.5, 1.5, 4)
    plain = auditor.audit(W, domain="norm", final_norm=auditor.FinalNorm("rmsnorm", weight=gain), progress=False)
    offset = auditor.audit(W, domain="norm", progress=False,
                           final_norm=auditor.FinalNorm("rmsnorm", weight=gain - 1, unit_offset=True))
    assert plain.ids("argmaxable") == offset.ids("argmaxable")


@pytest.mark.parametrize("norm", [None, auditor.FinalNorm("batchnorm"), auditor.FinalNorm("layernorm", eps=0),
                                  auditor.FinalNorm("layernorm", weight=np.ones(5)),
                                  auditor.FinalNorm("rmsnorm", bias=np.ones(3))])
def test_bad_final_norms_are_refused(norm):
    with pytest.raises(auditor.InputError):
        auditor.audit(np.eye(3), domain="norm", final_norm=norm, progress=False)


@pytest.mark.slow
def test_real_vocabulary_with_a_synthetic_layernorm(vocabulary):
    rng = np.random.default_rng(8)
    head = np.vstack([vocabulary, mean_initialised(vocabulary, 3, rng)])
    norm = auditor.FinalNorm("layernorm", weight=rng.uniform(0.8, 1.2, 384), bias=0.05 * rng.standard_normal(384),
                             eps=1e-12)
    report = auditor.audit(head, domain="norm", final_norm=norm, progress=False)
    assert report.ids("unargmaxable") == [30522, 30523, 30524]
    assert report.counts["argmaxable"] == 30522
    assert auditor.verify(report, head, final_norm=norm).ok


def test_rows_equal_only_after_rounding_are_not_reported_tied():
    a = np.array([1, 1e-10, 0], dtype=np.float32)
    b = a.copy()
    b[1] = np.nextafter(b[1], np.float32(1))
    W = np.vstack([a, b, [-1, 0, 0]]).astype(np.float32)
    norm = auditor.FinalNorm("layernorm", eps=1e-5)
    report = auditor.audit(W, domain="norm", final_norm=norm, progress=False)
    for k in (0, 1):
        assert report.tokens[k].verdict != "tied" or report.tokens[k].group_verdict == "inconclusive"
    assert auditor.verify(report, W, final_norm=norm).ok


def test_norm_domain_json_gives_every_witness_as_a_pre_norm_vector(rng):
    W = rng.standard_normal((30, 3))
    norm = auditor.FinalNorm("rmsnorm", weight=rng.uniform(0.5, 1.5, 3), eps=1e-6)
    report = auditor.audit(W, domain="norm", final_norm=norm, progress=False)
    for entry in report.to_dict()["tokens"]:
        if entry["verdict"] == "argmaxable":
            assert "pre_norm" in entry and "witness" not in entry
            z = normalise(np.array(entry["pre_norm"]), "rmsnorm", norm.weight, 0.0, norm.eps)
            assert witness_wins(W, None, entry["id"], z)
