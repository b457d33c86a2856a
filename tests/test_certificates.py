"""Certificates: mutually exclusive (weak duality), re-checkable, serialisable."""

import json

import numpy as np
import pytest
import torch

import auditor
from oracles import convex_residual, lp_margin, qhull_argmaxable, witness_wins
from test_oracles import planted_head


def test_no_token_carries_both_certificates(rng):
    W = planted_head(rng, 300, 6, interior=10)
    report = auditor.audit(W, progress=False)
    for token in report.tokens:
        assert (token.witness is None) != (token.convex_indices is None), token


def test_weak_duality_the_oracle_cannot_contradict_a_verdict(rng):
    """A witness from the LP never beats an unargmaxable certificate, and no witness margin exceeds its bound."""
    W = planted_head(rng, 150, 5, interior=10)
    report = auditor.audit(W, progress=False)
    scale = np.linalg.norm(W, axis=1).max()
    for token in report.tokens:
        t, z, _ = lp_margin(W, None, token.id)
        if token.verdict == "unargmaxable":
            # for every z: l_k(z) - max_i l_i(z) <= delta ||z||, so the oracle's best z cannot win
            assert not witness_wins(W, None, token.id, z)
            assert t <= token.residual * np.sqrt(W.shape[1]) + 1e-12
        else:
            # the distance from w_k to the others' hull is at least the unit-ball margin of the witness
            assert token.margin > 0
            others = np.delete(np.arange(W.shape[0]), token.id)
            assert token.margin <= np.linalg.norm(W[token.id] - W[others], axis=1).min() + 1e-12 * scale


def test_every_certificate_passes_the_independent_verifier(rng):
    W = planted_head(rng, 400, 12, interior=12)
    b = rng.normal(scale=0.2, size=W.shape[0])
    for bias in (None, b):
        report = auditor.audit(W, bias, progress=False)
        result = auditor.verify(report, W, bias)
        assert result.ok and result.checked == W.shape[0]


def test_verifier_rejects_a_forged_certificate(rng):
    W = planted_head(rng, 100, 4, interior=3)
    report = auditor.audit(W, progress=False)
    k = report.ids("argmaxable")[0]
    report._d.explicit_witness[k] = -report.tokens[k].witness  # a witness pointing the wrong way
    assert k in auditor.verify(report, W).failed


def test_report_serialises_to_strict_json_with_recheckable_witnesses(rng):
    W = planted_head(rng, 200, 6, interior=5)
    W = np.vstack([W, W[:1]])
    report = auditor.audit(W, progress=False)
    data = json.loads(json.dumps(report.to_dict(), allow_nan=False))
    assert data["counts"] == report.counts
    assert data["head"] == {"n_tokens": W.shape[0], "hidden_size": 6, "dtype": "float64", "bias": False,
                            "factorised": None}
    centre = np.array(data["centre"])
    for entry in data["tokens"]:
        k = entry["id"]
        if entry["verdict"] == "argmaxable":
            w = entry["witness"]
            z = np.array(w) if isinstance(w, list) else w["scale"] * (W[w["row"]] - w["minus_centre"] * centre)
            assert witness_wins(W, None, k, z)
        if entry["verdict"] == "unargmaxable":
            residual, _ = convex_residual(W, None, k, entry["convex"]["indices"], entry["convex"]["weights"])
            assert residual <= entry["convex"]["residual"] * (1 + 1e-9)
    tied = [e for e in data["tokens"] if e["verdict"] == "tied"]
    assert [e["id"] for e in tied] == [0, W.shape[0] - 1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_heads_are_decided_on_their_exact_values(rng, dtype):
    W = torch.tensor(planted_head(rng, 120, 4, interior=6), dtype=dtype)
    exact = W.to(torch.float64).numpy()
    report = auditor.audit(W, progress=False)
    assert report.dtype == str(dtype).replace("torch.", "")
    rounded_ties = report.ids("tied")
    vertices = qhull_argmaxable(np.unique(exact, axis=0)) if rounded_ties else qhull_argmaxable(exact)
    if not rounded_ties:
        assert set(report.ids("argmaxable")) == vertices
    assert auditor.verify(report, W).ok
    assert report.ids("unargmaxable") == auditor.audit(exact, progress=False).ids("unargmaxable")


def test_tokens_argument_decides_only_those(rng):
    W = planted_head(rng, 100, 5, interior=4)
    report = auditor.audit(W, tokens=[3, 101, 103], progress=False)
    assert report.counts["undecided"] == W.shape[0] - 3
    assert report.tokens[0].verdict == "undecided" and report.tokens[0].witness is None
    full = auditor.audit(W, progress=False)
    for k in (3, 101, 103):
        assert report.tokens[k].verdict == full.tokens[k].verdict


def test_the_exact_stage_alone_reaches_the_same_verdicts(rng):
    W = planted_head(rng, 120, 6, interior=6)
    fast = auditor.audit(W, progress=False)
    exact_only = auditor.audit(W, progress=False, frank_wolfe_iterations=0)
    assert fast.ids("unargmaxable") == exact_only.ids("unargmaxable")
    assert exact_only.counts["inconclusive"] == 0


def test_an_exhausted_budget_gives_inconclusive_with_bounds_not_a_guess(rng):
    base = rng.standard_normal((200, 8))
    W = np.vstack([base, 0.999 * base[0] + 0.001 * base[1:9].mean(axis=0)])  # just inside, near a vertex
    report = auditor.audit(W, progress=False, frank_wolfe_iterations=3, newton_iterations=0, lp_rounds=0,
                           min_norm_rounds=0)
    token = report.tokens[200]
    assert token.verdict == "inconclusive"
    assert token.witness is None and token.convex_indices is None
    lower, upper = token.bounds  # the best witness margin and the best residual: 0 lies between them
    assert -np.inf < lower <= 0 <= upper < np.inf


def test_progress_goes_to_stderr_and_can_be_silenced(rng, capsys):
    W = planted_head(rng, 300, 8, interior=3)
    auditor.audit(W, progress=False)
    assert capsys.readouterr().err == ""
    auditor.audit(W, progress=True)
    captured = capsys.readouterr()
    assert "screening" in captured.err and captured.out == ""
