"""The LP stage: constraint generation for a bounded number of rounds, then the LP over all rows."""

import numpy as np
import pytest
from oracles import lp_margin

import auditor
import auditor.engine.exact.lp as lp


def _counting_solves(monkeypatch) -> list[tuple[int, int]]:
    """Record (token, rivals in its program) at every solve."""
    calls = []
    solve = lp.MarginProgram.solve

    def counted(self):
        calls.append((self.k, int(self.rivals.size)))
        return solve(self)

    monkeypatch.setattr(lp.MarginProgram, "solve", counted)
    return calls


def _interior_head(n_inside: int, seed: int = 1):
    """Rows on a sphere and rows strictly inside it, no bias: the inside rows need the exact stage."""
    rng = np.random.default_rng(seed)
    outer = rng.standard_normal((400, 6))
    outer /= np.linalg.norm(outer, axis=1, keepdims=True)
    inner = 0.5 * rng.standard_normal((n_inside, 6)) / np.sqrt(6)
    return np.vstack([outer, inner])


def test_a_token_gets_at_most_its_rounds_then_the_lp_over_all_rows(monkeypatch):
    """One round of constraint generation each (from a single rival, adding 32 a round, cannot hold the
    rows a certificate of an inside row needs), then the program over all 407 rivals: every inside
    row is decided, each token is solved at most twice, and a second solve is over every row."""
    W = _interior_head(8)
    calls = _counting_solves(monkeypatch)
    report = auditor.audit(W, progress=False, frank_wolfe_iterations=0, newton_iterations=0, lp_rounds=1)
    tokens = {k for k, _ in calls}
    assert tokens
    per_token = np.bincount([k for k, _ in calls])
    assert per_token.max() <= 2
    seconds = [size for k, size in calls if per_token[k] == 2 and size != min(s for t, s in calls if t == k)]
    assert seconds and all(size == W.shape[0] - 1 for size in seconds)
    assert report.counts["inconclusive"] == 0
    assert set(report.ids("unargmaxable")) == set(range(400, 408))


def test_no_rounds_skips_the_stage(monkeypatch):
    W = _interior_head(4)
    calls = _counting_solves(monkeypatch)
    auditor.audit(W, progress=False, frank_wolfe_iterations=0, newton_iterations=0, lp_rounds=0)
    assert calls == []


def test_the_stage_alone_agrees_with_the_plain_lp_on_a_biased_low_rank_head():
    """400 rows in 5 dimensions with a bias, every token through the LP stage alone (no Frank-Wolfe, no
    Newton): each verdict is the plain LP's (oracles.lp_margin) outside its tolerance, and nothing is
    inconclusive."""
    rng = np.random.default_rng(7)
    W = rng.standard_normal((400, 5))
    b = 0.5 * rng.standard_normal(400)
    report = auditor.audit(W, b, progress=False, frank_wolfe_iterations=0, newton_iterations=0, lp_rounds=3)
    assert report.counts["inconclusive"] == 0
    for k in range(0, 400, 7):
        margin = lp_margin(W, b, k)[0]
        if abs(margin) > 1e-7:
            assert report.tokens[k].verdict == ("argmaxable" if margin > 0 else "unargmaxable"), (k, margin)
    assert auditor.verify(report, W, b).ok


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


def test_tokens_on_several_threads_get_the_outcomes_they_get_one_after_another(monkeypatch):
    """The exact stage's tokens on two threads (HiGHS solving side by side) against the same tokens one after
    another: every verdict, margin, witness and certificate the same, each token reported done once on the
    calling thread, the plain LP agreeing; the report's stream untouched by the solvers' banners, whose
    redirections of descriptor 1 take turns."""
    import threading

    import torch

    from auditor.engine.exact import constraint_generation

    rng = np.random.default_rng(7)
    W = rng.standard_normal((400, 5))
    b = 0.5 * rng.standard_normal(400)
    used, decide_all, decide = [], constraint_generation.lp_decide_all, constraint_generation.lp_decide
    inside = []  # (thread, torch's thread count) in each token's search

    def deciding(*args):
        inside.append((threading.get_ident(), torch.get_num_threads()))
        return decide(*args)

    monkeypatch.setattr(constraint_generation, "lp_decide", deciding)
    torch.set_num_threads(2)  # the audit's count, which the stage must put back

    def recording(workers):
        def run(head, tokens, seeds, rounds, done=None):
            callers = []
            outcomes = decide_all(head, tokens, seeds, rounds, lambda k: callers.append((k, threading.get_ident())),
                                  workers=workers)
            used.append((workers, callers))
            for k in tokens:
                done(k)
            return outcomes
        return run

    reports, searches = [], []
    for workers in (1, 2):
        monkeypatch.setattr(constraint_generation, "lp_decide_all", recording(workers))
        monkeypatch.setattr("auditor.engine.stages.lp_decide_all", recording(workers))
        inside.clear()
        reports.append(auditor.audit(W, b, progress=False, frank_wolfe_iterations=0, newton_iterations=0,
                                     min_norm_rounds=0, lp_rounds=3, threads=2))
        searches.append(list(inside))
    one, two = reports
    assert {ident for ident, _ in searches[0]} == {threading.get_ident()}  # one after another, here
    assert len({ident for ident, _ in searches[1]} - {threading.get_ident()}) == 2  # two workers
    assert {count for _, count in searches[1]} == {1}  # one torch thread each inside the stage
    assert torch.get_num_threads() == 2
    alone = [call for workers, calls in used if workers == 1 for call in calls]
    shared = [call for workers, calls in used if workers == 2 for call in calls]
    tokens = [k for k, _ in shared]
    assert len(tokens) > 50 and sorted(tokens) == sorted(k for k, _ in alone)  # each once
    assert len(set(tokens)) == len(tokens)
    assert {ident for _, ident in shared} == {threading.get_ident()}
    for a, c in zip(one.tokens, two.tokens):
        assert (a.verdict, a.margin, a.stage) == (c.verdict, c.margin, c.stage)
        if a.witness is not None:
            assert np.array_equal(a.witness, c.witness)
        if a.convex_indices is not None:
            assert np.array_equal(a.convex_indices, c.convex_indices)
            assert np.array_equal(a.convex_weights, c.convex_weights)
    assert two.counts["inconclusive"] == 0
    for k in tokens[::9]:
        margin = lp_margin(W, b, k)[0]
        if abs(margin) > 1e-7:
            assert two.tokens[k].verdict == ("argmaxable" if margin > 0 else "unargmaxable"), (k, margin)
    assert auditor.verify(two, W, b).ok


def test_the_solvers_banners_never_reach_the_report_s_stream(capfd):
    """Blocks of quiet_stdout on two threads at once, overlapping every time (as the exact stage's workers build
    their HiGHS programs): every banner goes to the null device, neither thread waits for the other's block to
    end, and descriptor 1 is the report's stream again afterwards (redirections swapped on their own would have
    left the null device in its place)."""
    import os
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from auditor.util.io import quiet_stdout

    both = threading.Barrier(2)  # the two threads' blocks overlap, every time

    def quietly(j):
        with quiet_stdout():
            os.write(1, b"banner\n")
            both.wait(timeout=10)
        return j

    with ThreadPoolExecutor(max_workers=2) as pool:
        assert sorted(pool.map(quietly, range(200))) == list(range(200))
    os.write(1, b"report\n")
    out = capfd.readouterr().out
    assert "banner" not in out and out.endswith("report\n")
