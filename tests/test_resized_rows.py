"""Rows resized the way people resize vocabularies, in the domains that give them a bias.

``transformers``' resize_token_embeddings sets new rows to samples of N(mean, 1e-9 cov): almost
exactly the mean row. Under a final LayerNorm with a shift beta every row gets the bias w_i . beta,
and the mean row the mean of those biases: the uniform weights tie it with the others, and only
weights tilted towards the rows of larger bias prove it strictly. These tests plant the exact mean,
N(mean, 1e-9 cov) and mean plus small isotropic noise, and check that the batched stages (interior,
Newton) settle every one of them, so that none costs a per-token LP; the oracle is a plain
second-order cone program over all rows of the reduced head (W diag(g) P, W beta, radius sqrt(d)).
Rows whose coordinate means vary little (flat_rows) fix nearly all of that bias, and rows a little off
the mean then sit just below or just above what the rows around them reach; under an RMSNorm (no
shift) the reduced bias is exactly zero, and the oracle is the margin program of R^d.
"""

import numpy as np
import pytest
import torch

import auditor
from auditor.engine.arithmetic.head import build_engine_head
from auditor.engine.screen.ties import duplicate_groups
from auditor.engine.solvers.tilt import tilted_certificates
from auditor.question.domain import Ball
from oracles import ball_margin, lp_margin, witness_wins


def resized(old: np.ndarray, rng) -> np.ndarray:
    """The exact mean, one N(mean, 1e-9 cov) row, and mean + 1e-6 and 1e-3 times N(0, 1)."""
    rows = old.astype(np.float64)
    mean = rows.mean(axis=0)
    d = rows.shape[1]
    return np.vstack([mean, rng.multivariate_normal(mean, 1e-9 * np.cov(rows.T)),
                      mean + 1e-6 * rng.standard_normal(d), mean + 1e-3 * rng.standard_normal(d)])


def layernorm(d: int, rng) -> auditor.FinalNorm:
    return auditor.FinalNorm("layernorm", weight=rng.uniform(0.85, 1.15, d), bias=0.04 * rng.standard_normal(d),
                             eps=1e-12)


def reduced_head(W: np.ndarray, norm: auditor.FinalNorm):
    """The norm's outputs as a ball of radius sqrt(d) for the head W diag(g) P with the bias W beta."""
    scaled = W * norm.weight
    return scaled - scaled.mean(axis=1, keepdims=True), W @ norm.bias, np.sqrt(W.shape[1])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_mean_and_near_mean_rows_under_a_shifted_layernorm_are_settled_without_the_lp(seed):
    rng = np.random.default_rng(seed)
    n, d = 600, 24
    spectrum = np.arange(1, d + 1) ** -0.7  # anisotropic, as trained heads are
    old = rng.standard_normal((n, d)) * np.sqrt(spectrum) + 0.3 * rng.standard_normal(d)
    W = np.vstack([old, resized(old, rng)])
    planted = list(range(n, n + 4))
    norm = layernorm(d, rng)
    report = auditor.audit(W, domain="norm", final_norm=norm, progress=False)
    assert report.counts["inconclusive"] == 0
    for k in planted:
        token = report.tokens[k]
        assert token.verdict == "unargmaxable", k
        assert token.stage in ("interior", "newton"), (k, token.stage)
    assert not [t.id for t in report.tokens if t.stage == "lp"]
    assert auditor.verify(report, W, final_norm=norm).ok
    rows, bias, radius = reduced_head(W, norm)
    for k in planted:  # the plain program over all rows: no positive margin anywhere in the ball
        assert ball_margin(rows, bias, k, radius) < 1e-9


def flat_rows(rng, n: int, d: int) -> np.ndarray:
    """Anisotropic rows whose coordinate means vary little, as trained rows' do. A LayerNorm cannot see the
    all-ones direction, so the reduced rows fix all of the bias w_i . beta its shift gives but a sliver (on the
    MiniLM head the part they leave has 0.008 of the bias's spread), and a row a little off the mean has its
    own sliver: a small fraction of that spread above or below what the rows around it make."""
    spectrum = np.arange(1, d + 1) ** -0.7
    rows = rng.standard_normal((n, d)) * np.sqrt(spectrum) + 0.3 * rng.standard_normal(d)
    means = rows.mean(axis=1, keepdims=True)
    return rows - 0.997 * (means - means.mean())


def near_mean(old: np.ndarray, eps: tuple[float, ...], rng) -> np.ndarray:
    """The mean of the rows plus eps N(0, 1), one row per eps."""
    mean = old.mean(axis=0)
    return np.vstack([mean + e * rng.standard_normal(old.shape[1]) for e in eps])


@pytest.mark.parametrize("seed", [2, 7, 12])
def test_near_mean_rows_whose_bias_the_rows_nearly_fix_are_settled_before_the_lp(seed):
    # Newton's lean must be measured in the part of the bias the rows leave: in the whole bias's spread
    # it is too weak by that sliver, and these rows went to the LP
    rng = np.random.default_rng(seed)
    n, d, eps = 1000, 32, (1e-4, 1e-3, 1e-2)
    old = flat_rows(rng, n, d)
    W = np.vstack([old, near_mean(old, eps, rng)])
    norm = layernorm(d, rng)
    report = auditor.audit(W, domain="norm", final_norm=norm, progress=False)
    rows, bias, radius = reduced_head(W, norm)
    spread = report.tolerances["typical_spread"]
    for k in range(n, n + len(eps)):
        margin = ball_margin(rows, bias, k, radius)  # over all rows: the best lead anywhere in the ball
        assert abs(margin) > 1e-6 * spread, (k, margin)  # a lead or residual this size must not need the LP
        token = report.tokens[k]
        assert token.verdict == ("argmaxable" if margin > 0 else "unargmaxable"), (k, margin)
        assert token.stage != "lp", k
    assert report.counts["inconclusive"] == 0
    assert auditor.verify(report, W, final_norm=norm).ok


@pytest.mark.parametrize("seed", [9, 10])
def test_newton_offers_the_tilted_point_of_a_row_just_above_the_rows_bias_as_its_witness(seed):
    # the 1e-2 row's bias lies above what any combination of the rows around it reaches: Newton's theta runs
    # off, and the point its weights are the smoothed leaders of wins for the row
    rng = np.random.default_rng(seed)
    n, d, eps = 1000, 32, (1e-4, 1e-3, 1e-2)
    old = flat_rows(rng, n, d)
    rows, bias, radius = reduced_head(np.vstack([old, near_mean(old, eps, rng)]), layernorm(d, rng))
    weight, offset = torch.from_numpy(rows), torch.from_numpy(bias)
    head = build_engine_head(weight, offset, duplicate_groups(weight, offset), Ball(radius), 1e-10)
    witnesses = {}
    convex = tilted_certificates(head, np.arange(n, n + 3), witnesses=witnesses)
    margins = {k: ball_margin(rows, bias, k, radius) for k in range(n, n + 3)}
    assert sorted(witnesses) == [k for k, m in margins.items() if m > 0] == [n + 2]
    assert sorted(convex) == [k for k, m in margins.items() if m < 0]
    z, margin, runner_up = witnesses[n + 2]
    assert np.linalg.norm(z) <= radius and witness_wins(rows, bias, n + 2, z)
    assert 0 < margin <= margins[n + 2] * (1 + 1e-6)  # a lower bound of the lead at z, at most the best lead
    lead = rows[n + 2] @ z + bias[n + 2] - np.delete(rows @ z + bias, n + 2)
    assert runner_up == np.delete(np.arange(n + 3), n + 2)[np.argmin(lead)]


@pytest.mark.parametrize("seed", [1, 2])
def test_near_mean_rows_under_an_rmsnorm_are_settled_before_the_lp(seed):
    # an RMSNorm has no shift: the reduced bias W 0 is exactly constant and must not be taken for one that
    # only rounding makes constant, whose dual values the Newton stage leaves to the LP
    rng = np.random.default_rng(seed)
    n, d, eps = 1000, 32, (1e-3, 1e-2, 3e-2)
    old = flat_rows(rng, n, d)
    W = np.vstack([old, near_mean(old, eps, rng)])
    gain = rng.uniform(0.85, 1.15, d)
    norm = auditor.FinalNorm("rmsnorm", weight=gain, eps=1e-6)
    report = auditor.audit(W, domain="norm", final_norm=norm, progress=False)
    for k in range(n, n + len(eps)):
        # no shift: the ball's verdicts are those of R^d for W diag(g), whose margin program over the box
        # is 0 (at z = 0) for a row in the hull and positive for one outside
        t, _, _ = lp_margin(W * gain, None, k)
        token = report.tokens[k]
        assert t > 1e-9 or abs(t) < 1e-12, (k, t)
        assert token.verdict == ("argmaxable" if t > 1e-9 else "unargmaxable"), (k, t)
        assert token.stage != "lp", k
    assert report.counts["inconclusive"] == 0
    assert auditor.verify(report, W, final_norm=norm).ok


@pytest.mark.slow
def test_resized_rows_of_the_real_head_under_a_shifted_layernorm_cost_no_lp(vocabulary):
    rng = np.random.default_rng(2)
    W = np.vstack([vocabulary, resized(vocabulary, rng).astype(np.float32)])
    norm = layernorm(W.shape[1], rng)
    report = auditor.audit(W, domain="norm", final_norm=norm, progress=False)
    assert report.ids("unargmaxable") == [30522, 30523, 30524, 30525]
    assert report.counts["argmaxable"] == 30522
    assert not [t.id for t in report.tokens if t.stage == "lp"]
    assert report.timings["lp"] < 0.01  # the stage had nothing to solve
    assert auditor.verify(report, W, final_norm=norm).ok
