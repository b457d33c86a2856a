"""Frank-Wolfe on the ball's dual (heads with a bias, balls and the norm domain).

Oracles: a second-order cone program over all rows (cvxpy with Clarabel), and a
brute-force minimisation of the line search's one-dimensional function."""

import collections

import numpy as np
import pytest
import torch

import auditor
from auditor.engine.ball_dual import _line_search


def socp_margin(W, b, k, radius):
    """max over ||z|| <= radius of min_{i != k} (w_k - w_i) . z + b_k - b_i, over every row."""
    import cvxpy as cp

    rivals = np.arange(W.shape[0]) != k
    z, t = cp.Variable(W.shape[1]), cp.Variable()
    problem = cp.Problem(cp.Maximize(t), [(W[k] - W[rivals]) @ z + (b[k] - b[rivals]) >= t,
                                          cp.norm(z, 2) <= radius])
    problem.solve(solver=cp.CLARABEL)
    return float(t.value)


@pytest.mark.parametrize("radius", [0.5, 3.0])
def test_ball_verdicts_with_a_bias_match_a_cone_program_over_all_rows(rng, radius):
    W = rng.standard_normal((80, 4))
    b = 0.5 * rng.standard_normal(80)
    report = auditor.audit(W, b, domain=f"ball:{radius}", progress=False)
    assert report.counts["inconclusive"] == 0
    stages = collections.Counter(t.stage for t in report.tokens)
    assert stages["frank-wolfe"] > 0  # the stage under test decided some tokens
    for k, token in enumerate(report.tokens):
        t = socp_margin(W, b, k, radius)
        if abs(t) > 1e-7:
            assert token.verdict == ("argmaxable" if t > 0 else "unargmaxable"), (k, t, token.verdict)
    assert auditor.verify(report, W, b).ok


def test_the_frank_wolfe_stage_agrees_with_the_lp_alone(rng):
    W = rng.standard_normal((150, 6))
    b = 0.3 * rng.standard_normal(150)
    with_stage = auditor.audit(W, b, domain="ball:2", progress=False)
    lp_only = auditor.audit(W, b, domain="ball:2", progress=False, frank_wolfe_iterations=0)
    assert [t.verdict for t in with_stage.tokens] == [t.verdict for t in lp_only.tokens]


def test_the_line_search_finds_the_minimum_of_its_segment(rng):
    for _ in range(200):
        r = float(rng.uniform(0.1, 5))
        x = torch.as_tensor(rng.standard_normal((1, 3)))
        u = torch.as_tensor(rng.standard_normal((1, 3)))
        c = torch.as_tensor(rng.standard_normal(1) * rng.uniform(0, 10))
        limit = torch.as_tensor(rng.uniform(0, 2, 1))
        step = float(_line_search(r, x, u, c, limit)[0])
        grid = np.linspace(0, float(limit[0]), 20001)
        values = r * np.linalg.norm(x.numpy() - grid[:, None] * u.numpy(), axis=1) + float(c[0]) * grid
        found = r * np.linalg.norm(x.numpy()[0] - step * u.numpy()[0]) + float(c[0]) * step
        assert 0 <= step <= float(limit[0])
        assert found <= values.min() + 1e-9


def test_the_working_set_misses_no_rival_of_a_larger_head(rng):
    """1,500 rows against 16 leaders per full evaluation: every ball-dual verdict must match the cone
    program over all rows, so a rival outside the working set cannot have been overlooked."""
    W = rng.standard_normal((1500, 8))
    b = 0.4 * rng.standard_normal(1500)
    report = auditor.audit(W, b, domain="ball:1.5", progress=False)
    assert report.counts["inconclusive"] == 0
    decided = [k for k, t in enumerate(report.tokens) if t.stage == "frank-wolfe"]
    assert len(decided) >= 20
    for k in decided[:: max(1, len(decided) // 25)]:
        t = socp_margin(W, b, k, 1.5)
        assert abs(t) > 1e-7
        assert report.tokens[k].verdict == ("argmaxable" if t > 0 else "unargmaxable"), (k, t)
    assert auditor.verify(report, W, b).ok
