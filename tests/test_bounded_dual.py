"""Frank-Wolfe on the bounded domains' duals (balls, boxes, the norm domain; with a bias) and on
large balls for the unbounded domain with a bias.

Oracles: a second-order cone program over all rows (cvxpy with Clarabel), the margin LP over all
rows (HiGHS, tests/oracles.py), and brute-force minimisation of the line searches' functions."""

import collections

import numpy as np
import pytest
import torch

import auditor
from oracles import lp_margin
import auditor.engine.pipeline as pipeline
from auditor.engine.solvers.bounded_dual import _BoxNorm, _line_search


@pytest.fixture(autouse=True)
def _iterative_stages_in_few_dimensions(monkeypatch):
    """These heads are small enough that the exact LP (pipeline._DIRECT_LP_WIDTH) or the minimum-norm rounds
    (corrective.WIDTH) would go first, and the rounds take what they leave on wider heads (corrective.LEFTOVERS);
    the tests are of Frank-Wolfe, Newton and the exact LP, so every width takes them."""
    monkeypatch.setattr(pipeline, "_DIRECT_LP_WIDTH", 0)
    monkeypatch.setattr(pipeline.corrective, "WIDTH", 0)
    monkeypatch.setattr(pipeline.corrective, "LEFTOVERS", False)


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


@pytest.mark.slow
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


@pytest.mark.slow
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


def _lp_verdict(W, b, k, domain):
    """The LP's verdict; its homogenised unbounded margin is 0 (at z = 0, s = 0) exactly when k cannot win."""
    t = lp_margin(W, b, k, domain)[0]
    assert abs(t) > 1e-7 or (domain == "unbounded" and abs(t) < 1e-9), (k, t)  # not a near tie
    return "argmaxable" if t > 1e-7 else "unargmaxable"


def _stage_agrees_with_the_lp_oracle(W, b, domain, report, least):
    decided = [k for k, t in enumerate(report.tokens) if t.stage == "frank-wolfe"]
    assert len(decided) >= least, collections.Counter(t.stage for t in report.tokens)
    for k in decided:
        assert report.tokens[k].verdict == _lp_verdict(W, b, k, domain), k
    assert auditor.verify(report, W, b).ok


@pytest.mark.slow
def test_box_verdicts_with_a_bias_match_the_lp_over_all_rows(rng):
    W = rng.standard_normal((400, 5))
    b = 0.4 * rng.standard_normal(400)
    report = auditor.audit(W, b, domain="box:0.6", progress=False)
    assert report.counts["inconclusive"] == 0
    verdicts = collections.Counter(t.verdict for t in report.tokens if t.stage == "frank-wolfe")
    assert verdicts["argmaxable"] > 0 and verdicts["unargmaxable"] > 0
    _stage_agrees_with_the_lp_oracle(W, b, "box:0.6", report, 100)


def test_unbounded_verdicts_with_a_bias_come_from_large_balls_and_match_the_lp(rng):
    """Rows inside the hull with a bias above or below that of the combination they are planted at
    (some win only far out, some never), besides random rows."""
    W = rng.standard_normal((120, 4))
    b = 0.5 * rng.standard_normal(120)
    for j in range(20):
        picks = rng.choice(120, size=5, replace=False)
        weights = rng.dirichlet(np.ones(5))
        W = np.vstack([W, weights @ W[picks]])
        b = np.append(b, weights @ b[picks] + (0.3 if j % 2 else -0.3))
    report = auditor.audit(W, b, progress=False)
    assert report.counts["inconclusive"] == 0
    _stage_agrees_with_the_lp_oracle(W, b, "unbounded", report, 5)
    for k in range(120, 140):  # the planted rows, whichever stage decided them
        assert report.tokens[k].verdict == _lp_verdict(W, b, k, "unbounded"), k


def test_the_box_line_search_finds_the_minimum_of_its_segment(rng):
    for _ in range(100):
        r = float(rng.uniform(0.1, 5))
        x = torch.as_tensor(rng.standard_normal((1, 4)))
        u = torch.as_tensor(rng.standard_normal((1, 4)))
        c = torch.as_tensor(rng.standard_normal(1) * rng.uniform(0, 10))
        limit = torch.as_tensor(rng.uniform(0, 2, 1))
        mu = torch.as_tensor(rng.choice([0.0, 0.05], size=1))
        step = float(_BoxNorm(auditor.Box(r), 4).line_search(x, u, c, limit, mu)[0])
        grid = np.linspace(0, float(limit[0]), 20001)
        y = x.numpy() - grid[:, None] * u.numpy()
        values = r * np.sqrt(y * y + float(mu[0]) ** 2).sum(axis=1) + float(c[0]) * grid
        at = r * np.sqrt((x.numpy()[0] - step * u.numpy()[0]) ** 2 + float(mu[0]) ** 2).sum() + float(c[0]) * step
        assert at <= values.min() + 1e-9


@pytest.mark.parametrize("domain", ["ball:0.25", "box:0.25"])
def test_a_token_that_ties_only_on_the_boundary_is_unargmaxable_with_an_exact_certificate(domain):
    """Found by hypothesis (test_invariance): token 2 leads row 10 only where z_4 < -0.25, so on the
    domain its best margin is exactly 0, reached on the boundary, and it never wins. Its dual value is
    exactly 0 (row 10 alone: 0.25 * 0.125 - 1/32), which float64 bounds cannot show to be <= 0."""
    W = np.zeros((31, 4))
    W[2, 3], W[10, 3] = -0.375, -0.25
    b = np.zeros(31)
    b[10] = 0.03125
    report = auditor.audit(W, b, domain=domain, progress=False)
    assert report.counts["inconclusive"] == 0
    assert report.tokens[2].verdict == "unargmaxable"
    if domain.startswith("box"):  # the LP over all rows agrees: the best margin is 0
        assert abs(lp_margin(W, b, 2, domain)[0]) < 1e-12
    assert auditor.verify(report, W, b).ok
    for shift, verdict in ((-2.0**-10, "argmaxable"), (2.0**-10, "unargmaxable")):  # clear of the tie
        nudged = b.copy()
        nudged[10] += shift
        assert auditor.audit(W, nudged, domain=domain, progress=False).tokens[2].verdict == verdict, shift


@pytest.mark.parametrize("domain, rows", [
    ("ball:2", {2: [0, 0, 0, -0.34375], 6: [-1 / 32, 0, 0, 0], 10: [0, 0, 0, -0.25], 11: [0, 0, 0, -0.125]}),
    ("ball:7.25", {2: [0, 0, 0, 0.15625], 3: [0, 1 / 32, 0, 0.125], 9: [0, 0, 0, -1 / 32], 10: [0, 0, 0, 1 / 32],
                   11: [0, 0, 0, 0.09375]}),
])
def test_a_row_exactly_between_two_rows_with_its_bias_between_theirs_is_unargmaxable(domain, rows):
    """Found by hypothesis (test_invariance): row 11 is the midpoint of rows 10 and 2 (or 10 and
    a row of zeros), its bias the midpoint of theirs, so at best it ties both: the dual value is exactly
    0, certified by the weights (1/2, 1/2), which a float64 solve gives only up to rounding: the dual
    value of what it gives is within the tolerance times the radius (or settled exactly at 0)."""
    W = np.zeros((34, 4))
    for k, row in rows.items():
        W[k] = row
    b = np.zeros(34)
    b[10], b[11] = 1 / 32, 1 / 64
    report = auditor.audit(W, b, domain=domain, progress=False)
    assert report.counts["inconclusive"] == 0
    token = report.tokens[11]
    assert token.verdict == "unargmaxable"
    assert np.allclose(sorted(np.asarray(token.convex_weights).tolist()), [0.5, 0.5], rtol=0, atol=1e-12)
    assert auditor.verify(report, W, b).ok
    assert lp_margin(W, b, 11, domain)[0] < 1e-9  # the LP over all rows: no positive margin
    for shift, verdict in ((-2.0**-10, "argmaxable"), (2.0**-10, "unargmaxable")):  # clear of the tie
        nudged = b.copy()
        nudged[11] -= shift
        assert auditor.audit(W, nudged, domain=domain, progress=False).tokens[11].verdict == verdict, shift
