"""The LP stage's budget of rounds adapts to what is left, and the whole stage stays bounded."""

import numpy as np

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
