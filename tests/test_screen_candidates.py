"""The screen's whitened candidate z = s C^+ (w_k - m), for the tokens its formula witnesses leave,
checked against Qhull and against the float64 re-check of every witness."""

import functools

import numpy as np
import pytest

import auditor
from auditor.engine import stages
from auditor.engine.arithmetic import head as head_module
from auditor.engine.screen import low_precision
from auditor.engine.screen import gram as screen_module
from auditor.engine.screen import whitened
from oracles import ball_margin, qhull_argmaxable, witness_wins


def long_thin_head(rng, n=400, d=5):
    """Rows of a long, thin, tilted cloud: many rim rows do not lead at w_k or w_k - m."""
    spectrum = np.array([30.0, 6.0, 1.0, 0.3, 0.1])[:d]
    rotation, _ = np.linalg.qr(rng.standard_normal((d, d)))
    return (rng.standard_normal((n, d)) * spectrum) @ rotation.T + 4.0


def through_bfloat16(monkeypatch):
    """The bfloat16 pass on a head small enough for the oracles; returns, per call, the whitened witnesses
    the bfloat16 product proves."""
    monkeypatch.setattr(head_module, "BFLOAT16_ENTRIES", 0)
    monkeypatch.setattr(screen_module, "_WHITENED_COPY_ROWS", 0)  # the copy kept on any head
    proved = []
    original = low_precision.bfloat16_witnesses

    def counting(*args):
        out = original(*args)
        proved.append(int(out[0].sum()))
        return out

    monkeypatch.setattr(low_precision, "bfloat16_witnesses", counting)
    return proved


@functools.cache
def audited_as_it_is(seed: int):
    """The audit of long_thin_head(seed) with the module's own settings, made once for both settings of the
    test below (it reads the report, never changes it)."""
    return auditor.audit(long_thin_head(np.random.default_rng(seed)), progress=False)


# Seed 0 in the quick tier, both arithmetics; seeds 1 and 2 (a few seconds each on two cores) in the slow one.
@pytest.mark.parametrize("seed, bfloat16", [(0, False), pytest.param(1, False, marks=pytest.mark.slow),
                                            pytest.param(2, False, marks=pytest.mark.slow), (0, True),
                                            pytest.param(1, True, marks=pytest.mark.slow),
                                            pytest.param(2, True, marks=pytest.mark.slow)])
def test_the_whitened_candidate_proves_only_argmaxable_tokens_and_matches_qhull(seed, bfloat16, monkeypatch):
    W = long_thin_head(np.random.default_rng(seed))
    without = audited_as_it_is(seed)  # this head is below the size the candidate starts at
    monkeypatch.setattr(head_module, "WHITENED_ENTRIES", 0)  # on a head small enough for Qhull
    proved = through_bfloat16(monkeypatch) if bfloat16 else None
    report = auditor.audit(W, progress=False)
    if bfloat16:  # the candidates went through the bfloat16 product (at d = 5 most are close calls for float64)
        assert len(proved) == 1
    by_search = {t.id for t in without.tokens if t.verdict == "argmaxable" and t.stage != "screen"}
    now_screened = {t.id for t in report.tokens if t.verdict == "argmaxable" and t.stage == "screen"} & by_search
    assert len(now_screened) >= 3  # the candidate proves tokens the formula witnesses did not
    for k in now_screened:
        assert witness_wins(W, None, k, np.asarray(report.tokens[k].witness))
    assert set(report.ids("argmaxable")) == qhull_argmaxable(W)
    assert auditor.verify(report, W).ok


@pytest.mark.parametrize("bfloat16", [False, True])
def test_in_a_ball_the_whitened_witnesses_stay_inside_and_match_the_cone_program(bfloat16, monkeypatch):
    monkeypatch.setattr(head_module, "WHITENED_ENTRIES", 0)
    proved = through_bfloat16(monkeypatch) if bfloat16 else [1]
    W = long_thin_head(np.random.default_rng(5), n=150)
    report = auditor.audit(W, domain="ball:0.5", progress=False)
    for token in report.tokens:
        if token.stage == "screen" and token.witness is not None:
            assert np.linalg.norm(token.witness) <= 0.5
    for k in range(0, 150, 10):  # the verdict agrees with the program over the ball
        assert (ball_margin(W, None, k, 0.5) > 1e-9) == (report.tokens[k].verdict == "argmaxable"), k
    assert auditor.verify(report, W).ok
    assert len(proved) == 1


def test_the_bfloat16_whitened_route_proves_what_it_can_and_hands_the_close_calls_to_float64():
    import torch

    from auditor.question.domain import parse_domain
    from auditor.engine.exact.certify import check_witnesses_sharpened
    from auditor.engine.arithmetic.head import build_engine_head

    rng = np.random.default_rng(11)
    cloud = rng.standard_normal((2000, 48)) * np.linspace(2, 0.5, 48)
    outer = 1.3 * cloud[:300]  # each with a partner (1 - mu) as long: the leads mu z . v are close calls
    partners = (1 - rng.uniform(-0.01, 0.01, (300, 1))) * outer
    W = np.vstack([cloud, outer, partners]).astype(np.float32)
    n = W.shape[0]
    head = build_engine_head(torch.from_numpy(W), None, np.arange(n), parse_domain("unbounded"), 1e-10)
    centred = low_precision.centred_rows(head)
    ids = np.arange(n)
    directions = (head.rows64(torch.as_tensor(ids)) - head.centre) @ head.precision
    won, _, _, lead, allowance = low_precision.bfloat16_witnesses(head, ids, directions, centred)
    close = ~won & (lead > -allowance)
    assert won.sum() >= 10 and close.sum() >= 10  # both routes taken, interleaved among the ids
    chosen, witnesses, check = whitened._whitened_in_low_precision(head, ids, directions, centred)
    assert np.array_equal(chosen, np.nonzero(won | close)[0])
    assert torch.equal(witnesses, directions[torch.as_tensor(chosen)])
    float64 = check_witnesses_sharpened(head, ids[chosen], witnesses)  # the float64 check of every chosen one
    by_bfloat16 = won[chosen]
    assert np.all(float64.certified[by_bfloat16])  # what bfloat16 proved holds in float64, with a smaller margin
    assert np.all(check.margin[by_bfloat16] <= float64.margin[by_bfloat16])
    assert np.array_equal(check.certified[~by_bfloat16], float64.certified[~by_bfloat16])  # the rest: float64's
    assert np.array_equal(check.margin[~by_bfloat16], float64.margin[~by_bfloat16])
    for j in np.nonzero(check.certified)[0][::25]:
        assert witness_wins(W.astype(np.float64), None, int(chosen[j]), witnesses[j].numpy())


def test_on_a_large_head_the_bfloat16_copy_is_freed_before_the_whitened_witnesses(monkeypatch):
    # On a head of fewer than _WHITENED_COPY_ROWS rows per column the screen hands on no copy (the covariance
    # and precision are then formed without it: the audit's peak memory), and the whitened witnesses take
    # float32 products and float64 checks: the same verdicts, qhull's; from it the copy goes on
    monkeypatch.setattr(head_module, "WHITENED_ENTRIES", 0)
    monkeypatch.setattr(head_module, "BFLOAT16_ENTRIES", 0)
    handed, screen = [], screen_module.screen
    monkeypatch.setattr(stages, "screen", lambda *a: handed.append(screen(*a)) or handed[-1])
    W = long_thin_head(np.random.default_rng(3), n=200)
    n, d = W.shape
    for rows, kept in ((n / d + 0.5, False), (n / d, True)):
        monkeypatch.setattr(screen_module, "_WHITENED_COPY_ROWS", rows)
        report = auditor.audit(W, progress=False)
        assert int((~handed[-1].certified).sum()) > 0 and (handed[-1].centred is not None) == kept
        assert set(report.ids("argmaxable")) == qhull_argmaxable(W)
        assert auditor.verify(report, W).ok
