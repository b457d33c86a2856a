"""The bfloat16 pass of the screen (auditor/engine/screen/low_precision.py) against plain float64 oracles.

The pass may certify a token only when the exact margin at its witness z = w_k - c is positive beyond
the float64 re-check. Close calls are planted around the allowance: pairs of rows y_j = (1 - mu) y_k
along one direction from the centre, with mu spread over a range where bfloat16 rounding decides the
computed sign. With the allowance as derived no certificate is wrong; with it shrunk, the same pass
certifies tokens that cannot win there, which is what the allowance is for.
"""

import json

import numpy as np
import pytest
import torch

import auditor
from auditor.engine.arithmetic import head as head_module
from auditor.engine.arithmetic.head import build_engine_head
from auditor.engine.screen import low_precision
from auditor.question.domain import parse_domain
from oracles import qhull_argmaxable, witness_wins


def close_call_head(rng, d=48, base=600, pairs=150, spread=0.05):
    """Rows symmetric about a centre c0 (so the mean is c0), and planted pairs (c0 +- v, c0 +- (1 - mu) v)
    with mu uniform in [-spread, spread]: token c0 + v leads its pair by mu ||v||^2 at z = v."""
    c0 = 3.0 * rng.standard_normal(d)
    half = rng.standard_normal((base // 2, d)) * (1 + 0.1 * rng.standard_normal((base // 2, 1)))
    directions = rng.standard_normal((pairs, d))
    # lengths about sqrt(d), not equal: own logits ||v||^2 then fall anywhere between bfloat16's grid points
    directions *= rng.uniform(0.9, 1.1, size=(pairs, 1)) * np.sqrt(d) / np.linalg.norm(directions, axis=1, keepdims=True)
    mu = rng.uniform(-spread, spread, size=pairs)
    shorter = (1 - mu)[:, None] * directions
    offsets = np.vstack([half, -half, directions, -directions, shorter, -shorter])
    W = (c0 + offsets).astype(np.float32)
    planted = base + np.arange(pairs)  # the tokens c0 + v
    return W, planted


def exact_margins(W, k_ids, centre):
    """min_{i != k} (w_k - w_i) . (w_k - c) in float64 (error ~1e-13 of the products, far below the planted leads)."""
    W64 = W.astype(np.float64)
    out = []
    for k in k_ids:
        z = W64[k] - centre
        logits = W64 @ z
        logits[k] = -np.inf
        out.append(W64[k] @ z - logits.max())
    return np.array(out)


def run_pass(W):
    head = build_engine_head(torch.from_numpy(W), None, np.arange(W.shape[0]), parse_domain("unbounded"), 1e-10)
    ids = np.arange(W.shape[0])
    certified, margin, scale, _ = low_precision.bfloat16_pass(head, ids)
    return head, ids, certified, margin


def test_the_allowance_bounds_every_bfloat16_product_and_is_not_loose(rng):
    worst = 0.0
    for d in (16, 384, 4096):
        x = torch.from_numpy(rng.standard_normal((64, d)).astype(np.float32))
        y = torch.from_numpy((rng.standard_normal((200, d)) + 0.5).astype(np.float32))
        exact = x.double() @ y.double().T
        with low_precision.reduced_precision_off():
            computed = (x.to(torch.bfloat16) @ y.to(torch.bfloat16).T).double()
        allowance = low_precision.product_error_factor(d) * (x.double().abs() @ y.double().abs().T)
        assert torch.all((computed - exact).abs() <= allowance)
        worst = max(worst, float(((computed - exact).abs() / allowance).max()))
    assert worst > 0.05  # the bound is of the size of the error, not a vacuous one


def bfloat16_margins(W, k_ids, centre):
    """||y_k||^2 - max_{i != k} of the bfloat16 products, computed here on their own."""
    Y = (torch.from_numpy(W) - torch.from_numpy(centre).to(torch.float32)).to(torch.bfloat16)
    with low_precision.reduced_precision_off():
        products = (Y[k_ids] @ Y.T).double()
    products[np.arange(len(k_ids)), k_ids] = -np.inf
    own = ((W[k_ids].astype(np.float64) - centre) ** 2).sum(axis=1)
    return own - products.max(dim=1).values.numpy()


def test_close_calls_at_the_allowance_get_no_certificate_the_pass_cannot_prove(rng):
    W, planted = close_call_head(rng)
    head, ids, certified, margin = run_pass(W)
    centre = head.witness_centre.numpy()
    exact = exact_margins(W, planted, centre)
    computed = bfloat16_margins(W, planted, centre)
    norm_z = np.linalg.norm(W[planted].astype(np.float64) - centre, axis=1)
    allowance = low_precision.product_error_factor(W.shape[1]) * float(
        np.linalg.norm(W.astype(np.float64) - centre, axis=1).max()) * norm_z
    # planted on both sides of the allowance, and below zero
    assert np.sum((exact > 0) & (exact < allowance)) >= 10
    assert np.sum(exact > 2 * allowance) >= 10
    assert np.sum(exact < 0) >= 10
    assert np.sum((exact < 0) & (computed > 0)) >= 1  # bfloat16 rounding flips some signs
    got = certified[planted]
    assert not np.any(got & (computed <= allowance))  # only what the computed lead proves beyond the allowance
    assert np.all(got[computed > 1.001 * allowance])
    assert np.all(got[exact > 2 * allowance])
    assert not np.all(got[(exact > 0) & (exact < allowance)])  # some true leads are too close to prove here
    for k in ids[certified]:  # every certificate holds, with its stated margin a lower bound
        z = W[k].astype(np.float64) - centre
        assert witness_wins(W.astype(np.float64), None, k, z)
    assert np.all(margin[planted][got] * norm_z[got] <= exact[got])


def test_with_the_allowance_shrunk_the_pass_certifies_tokens_that_cannot_win_there(rng, monkeypatch):
    W, planted = close_call_head(rng, spread=0.004)
    phi = low_precision.product_error_factor
    monkeypatch.setattr(low_precision, "product_error_factor", lambda d: phi(d) / 256)
    head, ids, certified, _ = run_pass(W)
    exact = exact_margins(W, planted, head.witness_centre.numpy())
    wrong = certified[planted] & (exact < 0)
    assert wrong.sum() >= 1  # certificates of tokens that lose at their witness: the allowance prevents these


def biased_close_call_head(rng, radius=2.0, spread=0.05):
    """close_call_head with a bias in ball:radius: each planted token's partner gets its bias plus a gap, so
    the leads s_k (mu ||v||^2) + b_k - b_j at z = s_k y_k straddle the allowance through bias and rows alike."""
    W, planted = close_call_head(rng, spread=spread)
    n, pairs = W.shape[0], planted.size
    b = 0.3 * rng.standard_normal(n) + 5.0  # a common offset the pass takes out, and a spread it keeps
    partners = planted + 2 * pairs
    b[partners] = b[planted] + 0.05 * rng.standard_normal(pairs)
    head = build_engine_head(torch.from_numpy(W), torch.from_numpy(b), np.arange(n), parse_domain(f"ball:{radius}"),
                             1e-10)
    return W, b, planted, head


def exact_biased_leads(W, b, k_ids, centre, scale):
    """min_{i != k} of the logit gap at z = s_k (w_k - c), in float64."""
    W64 = W.astype(np.float64)
    out = []
    for k, s in zip(k_ids, scale):
        logits = W64 @ (s * (W64[k] - centre)) + b
        lead = logits[k]
        logits[k] = -np.inf
        out.append(lead - logits.max())
    return np.array(out)


def test_the_bias_column_keeps_every_product_within_its_allowance(rng):
    W, b, planted, head = biased_close_call_head(rng)
    centred = low_precision.centred_rows(head)
    rows, shifted = centred.values, centred.shifted
    assert abs(float(shifted.mean())) < 0.2 and centred.spread >= float(shifted.abs().max())  # the offset 5 taken out
    width = rows.shape[1]
    assert width % 16 == 0 and width > W.shape[1] and torch.all(rows[:, W.shape[1] + 1:] == 0)
    Y = torch.from_numpy(W.astype(np.float64)) - head.witness_centre
    sigma = torch.tensor([0.37, 1.0, 3.5, 1e-3], dtype=torch.float64).to(torch.bfloat16)
    left = rows[planted[:4]].clone()
    left[:, W.shape[1]] = sigma
    sigma = sigma.double()
    with low_precision.reduced_precision_off():
        computed = (left @ rows.T).double()
    exact = Y[planted[:4]] @ Y.T + sigma[:, None] * shifted[None, :]
    size = Y[planted[:4]].abs() @ Y.abs().T + sigma[:, None] * shifted.abs()[None, :]
    excess = (computed - exact).abs() / (low_precision.product_error_factor(width) * size)
    assert float(excess.max()) <= 1 and float(excess.max()) > 0.02  # within the bound, and the bound not vacuous


def test_biased_close_calls_get_no_certificate_the_pass_cannot_prove(rng):
    W, b, planted, head = biased_close_call_head(rng)
    ids = np.arange(W.shape[0])
    certified, margin, scale, _ = low_precision.bfloat16_pass(head, ids)
    centre = head.witness_centre.numpy()
    exact = exact_biased_leads(W, b, planted, centre, scale[planted])
    size = np.linalg.norm(W[planted].astype(np.float64) - centre, axis=1)
    reach = float(np.linalg.norm(W.astype(np.float64) - centre, axis=1).max())
    allowance = low_precision.product_error_factor(W.shape[1]) * scale[planted] * reach * size
    assert np.sum((exact > 0) & (exact < allowance)) >= 10  # planted on both sides of the allowance
    assert np.sum(exact > 2 * allowance) >= 10 and np.sum(exact < 0) >= 10
    got = certified[planted]
    assert np.all(got[exact > 2.5 * allowance])
    assert not np.all(got[(exact > 0) & (exact < allowance)])
    assert certified.sum() > W.shape[0] // 2
    for k in ids[certified]:  # every certificate wins at its witness, by at least the margin stated
        lead = exact_biased_leads(W, b, [k], centre, [scale[k]])[0]
        assert np.linalg.norm(scale[k] * (W[k].astype(np.float64) - centre)) <= 2.0
        assert lead > 0 and margin[k] <= lead, k


def test_with_the_biased_allowance_shrunk_the_pass_certifies_tokens_that_cannot_win_there(rng, monkeypatch):
    W, b, planted, head = biased_close_call_head(rng, spread=0.004)
    phi = low_precision.product_error_factor
    monkeypatch.setattr(low_precision, "product_error_factor", lambda d: phi(d) / 256)
    certified, _, scale, _ = low_precision.bfloat16_pass(head, np.arange(W.shape[0]))
    exact = exact_biased_leads(W, b, planted, head.witness_centre.numpy(), scale[planted])
    assert (certified[planted] & (exact < 0)).sum() >= 1  # what the allowance is there to prevent


def bias_decided_head(rng, d=16, base=300, pairs=80, clear=16):
    """Planted tokens whose rival is a partner row (1 - 1e-3) times as long with a bias lower by delta: at
    z = s y_k in ball:2 the lead over it is delta plus a row term of about 1e-3 s ||y_k||^2, and the biases sit
    near +-400, where bfloat16 keeps them to within 1 (spacing 2 in [256, 512)): the bias terms of the
    allowance are what stands between the computed leads and the planted ones. Most deltas are within
    +-1.5 (decided by rounding). The last ``clear`` tokens have deltas of 10 to 15, beyond the bias terms,
    and rows of length 12 along +-e_i, orthogonal or opposite to each other: at s y_k their row term over
    every other planted row (bias within 2 of theirs) is at least 14, so their exact lead is the delta's."""
    half = rng.standard_normal((base // 2, d))
    directions = rng.standard_normal((pairs, d))
    directions[pairs - clear:] = 0
    directions[pairs - clear + np.arange(clear), np.arange(clear) // 2] = 12.0 * np.tile([1.0, -1.0], clear // 2)
    rows = np.vstack([half, -half, directions, (1 - 1e-3) * directions]).astype(np.float32)
    n = rows.shape[0]
    b = 0.3 * rng.standard_normal(n)
    planted = base + np.arange(pairs)
    b[planted] = 400.0 + rng.uniform(-1, 1, pairs)
    delta = np.concatenate([rng.uniform(-1.5, 1.5, pairs - clear), rng.uniform(10, 15, clear)])
    b[planted + pairs] = b[planted] - delta
    b[0] = -400.0  # the rivals' biases span [-400, 401]: B about 400 after the midpoint is taken out
    head = build_engine_head(torch.from_numpy(rows), torch.from_numpy(b), np.arange(n), parse_domain("ball:2"), 1e-10)
    return rows, b, planted, head


@pytest.mark.parametrize("drop_bias_terms", [False, True])
def test_where_the_bias_decides_only_its_allowance_stands_between_rounding_and_a_wrong_certificate(
        drop_bias_terms, rng, monkeypatch):
    if drop_bias_terms:
        monkeypatch.setattr(low_precision, "bias_allowance", lambda phi, s_k, *rest: torch.zeros_like(s_k))
    W, b, planted, head = bias_decided_head(rng)
    assert np.all(head.row_norm.numpy() < 2**7)  # the row products are exact: only the biases round
    certified, margin, scale, _ = low_precision.bfloat16_pass(head, np.arange(W.shape[0]))
    exact = exact_biased_leads(W, b, planted, head.witness_centre.numpy(), scale[planted])
    got = certified[planted]
    wrong = got & (exact <= 0)
    if drop_bias_terms:
        assert wrong.sum() >= 1  # bfloat16's rounding of the biases flips the sign of some planted leads
    else:
        assert not wrong.any() and np.all(margin[planted][got] <= exact[got])
        # the leads of 10 to 15 clear the bias terms: with u = 2^-8, s phi sigma B + |s sigma - 1| B is at most
        # about 3u B + u B, 6.3 for B about 400 (s sigma about 1)
        assert np.sum(exact > 10) >= 12 and np.all(got[exact > 10])
        assert not got[np.abs(exact) < 1.5].any()


def perturbed_witnesses(rng, W, planted, centre, scale=0.02):
    """z_k = y_k plus noise of a fiftieth of its length: leads that still straddle the allowance."""
    Y = W[planted].astype(np.float64) - centre
    noise = rng.standard_normal(Y.shape) * np.linalg.norm(Y, axis=1, keepdims=True) / np.sqrt(Y.shape[1])
    return Y + scale * noise


def exact_witness_leads(W, k_ids, witnesses):
    W64 = W.astype(np.float64)
    out = []
    for k, z in zip(k_ids, witnesses):
        logits = W64 @ z
        lead = logits[k]
        logits[k] = -np.inf
        out.append(lead - logits.max())
    return np.array(out)


def test_given_witnesses_are_proved_from_the_bfloat16_product_only_beyond_its_allowance(rng):
    W, planted = close_call_head(rng)
    head = build_engine_head(torch.from_numpy(W), None, np.arange(W.shape[0]), parse_domain("unbounded"), 1e-10)
    centred = low_precision.centred_rows(head)
    Z = perturbed_witnesses(rng, W, planted, head.witness_centre.numpy())
    won, margin, runner_up, lead, allowance = low_precision.bfloat16_witnesses(head, planted, torch.from_numpy(Z),
                                                                               centred)
    exact = exact_witness_leads(W, planted, Z)
    assert np.all(np.abs(lead - exact) <= allowance)  # the computed lead is within its allowance of the exact one
    assert np.sum((exact > 0) & (exact < allowance)) >= 10 and np.sum(exact > 2 * allowance) >= 10
    assert np.sum(exact < 0) >= 10
    assert np.all(won[exact > 2.5 * allowance])
    assert not np.any(won & (lead <= allowance))
    assert np.all(exact[won] > 0) and np.all(margin[won] <= exact[won])  # every certificate, and its margin
    for j in np.nonzero(won)[0][:20]:
        assert witness_wins(W.astype(np.float64), None, planted[j], Z[j])


def test_with_the_witnesses_allowance_shrunk_the_product_proves_witnesses_that_lose(rng, monkeypatch):
    W, planted = close_call_head(rng, spread=0.004)
    head = build_engine_head(torch.from_numpy(W), None, np.arange(W.shape[0]), parse_domain("unbounded"), 1e-10)
    Z = perturbed_witnesses(rng, W, planted, head.witness_centre.numpy(), scale=0.002)
    phi = low_precision.product_error_factor
    monkeypatch.setattr(low_precision, "product_error_factor", lambda d: phi(d) / 256)
    won = low_precision.bfloat16_witnesses(head, planted, torch.from_numpy(Z), low_precision.centred_rows(head))[0]
    assert (won & (exact_witness_leads(W, planted, Z) < 0)).sum() >= 1  # what the allowance prevents


@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.slow)])  # a second head: the slow tier
def test_audits_through_the_bfloat16_pass_match_qhull(seed, monkeypatch):
    monkeypatch.setattr(head_module, "BFLOAT16_ENTRIES", 0)  # the pass on a head small enough for Qhull
    rng = np.random.default_rng(seed)
    W, planted = close_call_head(rng, d=5, base=300, pairs=60, spread=0.01)
    report = auditor.audit(W, progress=False)
    assert report.counts["inconclusive"] == 0
    assert set(report.ids("argmaxable")) == qhull_argmaxable(W.astype(np.float64))
    assert auditor.verify(report, W).ok


def test_the_pass_runs_where_its_probe_passes_and_is_skipped_where_it_fails(monkeypatch):
    W = np.random.default_rng(3).standard_normal((3000, 1400)).astype(np.float32)  # above the size threshold
    head = build_engine_head(torch.from_numpy(W), None, np.arange(3000), parse_domain("unbounded"), 1e-10)
    assert low_precision.accumulates_as_assumed(head.device)  # this backend accumulates in float32
    assert low_precision.applies(head)
    monkeypatch.setattr(low_precision, "_probed", {str(head.device): False})
    assert not low_precision.applies(head)


def test_debug_says_which_arithmetic_the_screen_used(tmp_path, monkeypatch, capsys):
    from safetensors.numpy import save_file

    from auditor.cli.audit import main

    import logging

    logger = logging.getLogger("auditor")
    monkeypatch.setattr(logger, "handlers", [])  # what --debug adds is taken away after the test
    monkeypatch.setattr(logger, "level", logger.level)
    monkeypatch.setattr(head_module, "BFLOAT16_ENTRIES", 0)
    W = np.random.default_rng(4).standard_normal((400, 8)).astype(np.float32)
    save_file({"lm_head.weight": W}, str(tmp_path / "head.safetensors"))
    main([str(tmp_path / "head.safetensors"), "--debug", "--quiet", "--fail-on", "none", "--format", "json"])
    first = capsys.readouterr()
    assert "bfloat16 screen on cpu:" in first.err and "tokens proved" in first.err
    monkeypatch.setattr(low_precision, "_probed", {"cpu": False})
    main([str(tmp_path / "head.safetensors"), "--debug", "--quiet", "--fail-on", "none", "--format", "json"])
    captured = capsys.readouterr()
    assert "bfloat16 screen off on cpu" in captured.err and "float32 screen decides every token" in captured.err
    assert "tokens proved" not in captured.err
    assert json.loads(captured.out)["summary"] == json.loads(first.out)["summary"]  # the same verdicts either way


def test_with_a_bias_in_a_ball_the_pass_certifies_only_what_wins_there(rng, monkeypatch):
    from oracles import ball_margin

    monkeypatch.setattr(head_module, "BFLOAT16_ENTRIES", 0)
    W, planted = close_call_head(rng, d=24, base=300, pairs=60)
    b = 0.3 * rng.standard_normal(W.shape[0])
    head = build_engine_head(torch.from_numpy(W), torch.from_numpy(b), np.arange(W.shape[0]), parse_domain("ball:2"),
                             1e-10)
    assert low_precision.applies(head)
    ids = np.arange(W.shape[0])
    certified, margin, scale, _ = low_precision.bfloat16_pass(head, ids)
    assert certified.sum() > W.shape[0] // 2  # most tokens, and not the close calls alone
    centre = head.witness_centre.numpy()
    W64 = W.astype(np.float64)
    for k in ids[certified]:
        z = scale[k] * (W64[k] - centre)
        assert np.linalg.norm(z) <= 2.0
        logits = W64 @ z + b
        lead = logits[k] - np.delete(logits, k).max()
        assert lead > 0 and margin[k] <= lead  # it wins there, by at least the margin stated
    report = auditor.audit(W, b, domain="ball:2", progress=False)
    assert report.counts["inconclusive"] == 0
    for k in planted[:12]:  # the close calls against the cone program over all rows
        assert (ball_margin(W64, b, k, 2.0) > 1e-9) == (report.tokens[k].verdict == "argmaxable"), k
    assert auditor.verify(report, W, b).ok


def test_the_norm_domain_is_screened_in_bfloat16_and_its_witnesses_win_through_the_norm(monkeypatch):
    monkeypatch.setattr(head_module, "BFLOAT16_ENTRIES", 0)
    calls = []
    original = low_precision.bfloat16_pass
    monkeypatch.setattr(low_precision, "bfloat16_pass", lambda *a, **k: calls.append(1) or original(*a, **k))
    rng = np.random.default_rng(6)
    W = (rng.standard_normal((500, 16)) * np.linspace(2, 0.3, 16) + 0.4).astype(np.float32)
    norm = auditor.FinalNorm("layernorm", weight=rng.uniform(0.85, 1.15, 16), bias=0.04 * rng.standard_normal(16),
                             eps=1e-12)
    report = auditor.audit(W, domain="norm", final_norm=norm, progress=False)
    assert calls  # the reduced head (float64, derived rows, a bias) went through the pass
    assert report.counts["inconclusive"] == 0
    assert auditor.verify(report, W, final_norm=norm).ok
    monkeypatch.setattr(head_module, "BFLOAT16_ENTRIES", 1 << 60)
    without = auditor.audit(W, domain="norm", final_norm=norm, progress=False)
    assert [t.verdict for t in without.tokens] == [t.verdict for t in report.tokens]
