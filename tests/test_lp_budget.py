"""The LP stage's budget of rounds adapts to what is left, and the whole stage stays bounded."""

import numpy as np
import pytest
from oracles import lp_margin

import auditor
import auditor.engine.lp as lp


def _counting_solves(monkeypatch) -> list[int]:
    calls = []
    solve = lp._solve

    def counted(head, k, rivals):
        calls.append(k)
        return solve(head, k, rivals)

    monkeypatch.setattr(lp, "_solve", counted)
    return calls


def _interior_head(n_inside: int, seed: int = 1):
    """Rows on a sphere and rows strictly inside it, no bias: the inside rows need the exact stage."""
    rng = np.random.default_rng(seed)
    outer = rng.standard_normal((400, 6))
    outer /= np.linalg.norm(outer, axis=1, keepdims=True)
    inner = 0.5 * rng.standard_normal((n_inside, 6)) / np.sqrt(6)
    return np.vstack([outer, inner])


def test_the_stage_runs_at_most_its_budget_of_rounds(monkeypatch):
    W = _interior_head(8)
    calls = _counting_solves(monkeypatch)
    rounds = 2
    report = auditor.audit(W, progress=False, frank_wolfe_iterations=0, newton_iterations=0, lp_rounds=rounds)
    tokens = len(set(calls))
    assert tokens > 0
    assert len(calls) <= rounds * (tokens + lp._SPARE_TOKENS)
    assert set(report.ids("unargmaxable")) >= set(range(400, 408)) - set(report.ids("inconclusive"))


def test_rounds_a_token_leaves_unused_go_to_the_tokens_still_converging(monkeypatch):
    """With one round each, a token that needs several gets them from the pool, and no more
    than the stage's budget is spent."""
    W = _interior_head(8)
    calls = _counting_solves(monkeypatch)
    auditor.audit(W, progress=False, frank_wolfe_iterations=0, newton_iterations=0, lp_rounds=1)
    per_token = np.bincount(calls)
    assert per_token.max() > 1  # some token got more than its first round
    assert per_token.max() <= lp._MOST_ALLOWANCES
    assert len(calls) <= 1 * (len(set(calls)) + lp._SPARE_TOKENS)


def test_no_rounds_skips_the_stage(monkeypatch):
    W = _interior_head(4)
    calls = _counting_solves(monkeypatch)
    auditor.audit(W, progress=False, frank_wolfe_iterations=0, newton_iterations=0, lp_rounds=0)
    assert calls == []


@pytest.mark.slow
def test_a_biased_float32_head_of_3000_rows_leaves_nothing_inconclusive():
    """3000 x 16 float32 rows N(0, 1) with a bias 0.25 N(0, 1), seed 1: four tokens (927, 1094, 2028, 2778),
    each settled by one LP over all rows in seconds, were left inconclusive by a fixed budget of rounds.
    Their verdicts agree with that LP (HiGHS, the oracle of tests/oracles.py) and every certificate verifies."""
    rng = np.random.default_rng(1)
    W = rng.standard_normal((3000, 16)).astype(np.float32)
    b = (0.25 * rng.standard_normal(3000)).astype(np.float32)
    report = auditor.audit(W, b, progress=False)
    assert report.counts["inconclusive"] == 0
    W64, b64 = W.astype(np.float64), b.astype(np.float64)
    for k in (927, 1094, 2028, 2778):
        margin = lp_margin(W64, b64, k)[0]
        assert abs(margin) > 1e-6  # the oracle is decided on these tokens
        assert report.tokens[k].verdict == ("argmaxable" if margin > 0 else "unargmaxable"), (k, margin)
    assert auditor.verify(report, W, b).ok
