"""The fully corrective minimum-norm rounds (engine/solvers/corrective.py): the nearest-point solve against an
independent QP (cvxpy), and the stage's verdicts on low-rank heads with crowded boundaries against the plain LP over all
rows, with every certificate verified."""

import cvxpy as cp
import numpy as np
import pytest

import auditor
from auditor.engine.solvers.corrective import _nearest, corrective_certificates
from test_low_rank_heads import compared_with_plain_lp, plain_lp


def lognormal_head(n: int, d: int, bias: bool, seed: int):
    """Directions N(0, I_d) with log-normal norms (short rows for rare classes), a bias 0.1 N(0, 1): most rows
    sit at or near the hull's boundary and the screen settles few of them; float32."""
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((n, d)) * np.exp(rng.standard_normal(n))[:, None]
    b = (0.1 * rng.standard_normal(n)).astype(np.float32) if bias else None
    return W.astype(np.float32), b


def _nearest_by_qp(Y: np.ndarray, ray: bool) -> float:
    """The distance from the origin to conv(columns of Y) (+ cone{-e_last}), by Clarabel."""
    alpha = cp.Variable(Y.shape[1], nonneg=True)
    point = Y @ alpha
    constraints = [cp.sum(alpha) == 1]
    if ray:
        lowered = cp.Variable(nonneg=True)
        point = cp.hstack([point[:-1], point[-1] - lowered])
    problem = cp.Problem(cp.Minimize(cp.sum_squares(point)), constraints)
    problem.solve(solver=cp.CLARABEL)
    return float(np.sqrt(max(problem.value, 0.0)))


@pytest.mark.parametrize("ray", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_the_nearest_point_matches_a_qp(seed, ray):
    rng = np.random.default_rng(seed)
    Y = rng.standard_normal((6, 15)) + (0.8 if seed % 2 else 0.0)  # odd seeds: the origin outside the hull
    alpha, lowered, residual = _nearest(Y, ray)
    assert np.all(alpha >= 0) and abs(alpha.sum() - 1) < 1e-12 and (lowered >= 0 if ray else lowered == 0)
    expected = Y @ alpha
    if ray:
        expected[-1] -= lowered
    np.testing.assert_allclose(residual, expected, atol=1e-12)
    assert abs(np.linalg.norm(residual) - _nearest_by_qp(Y, ray)) <= 1e-6


# Twelve dimensions, with and without a bias, in the quick tier; 24 and 32 (a few seconds each) in the slow one.
@pytest.mark.parametrize("d,bias,seed", [(12, False, 0), pytest.param(24, False, 1, marks=pytest.mark.slow),
                                         (12, True, 2), pytest.param(32, True, 3, marks=pytest.mark.slow)])
def test_the_rounds_decide_crowded_heads_as_the_plain_lp_does(d, bias, seed):
    W, b = lognormal_head(300, d, bias, seed)
    report = auditor.audit(W, b, progress=False)
    assert report.counts["inconclusive"] == 0
    assert report.counts["unargmaxable"] >= 30
    assert sum(t.stage == "min-norm" for t in report.tokens) >= 100  # the stage decides most of the boundary
    assert compared_with_plain_lp(report, W, b) >= 290
    assert auditor.verify(report, W, b).ok
    skipped = auditor.audit(W, b, progress=False, min_norm_rounds=0)  # the other stages, same verdicts
    assert all(t.stage != "min-norm" for t in skipped.tokens)
    assert [t.verdict for t in skipped.tokens] == [t.verdict for t in report.tokens]


def test_an_exact_tie_and_a_far_winner_in_twelve_dimensions():
    """Row 0 is exactly the midpoint of rows 1 and 2 with exactly their mean bias: its logit is their mean at
    every z, so it never leads (unargmaxable, exactly). Row 3 is the midpoint of rows 5 and 6 with the mean
    bias raised by 2^-10 (the plain LP says which). Row 4 is four times row 5, longer than every other row
    and so outside their hull, with a bias of -1000: it wins only far out. Every number is a dyadic
    rational, exact in float32, and the midpoints and means are formed exactly. The rounds alone (no
    Frank-Wolfe, Newton or LP) decide all three."""
    rng = np.random.default_rng(7)
    W = np.round(rng.standard_normal((60, 12)) * 64) / 64
    b = np.round(rng.standard_normal(60) * 64) / 256
    W[0], b[0] = (W[1] + W[2]) / 2, (b[1] + b[2]) / 2
    W[3], b[3] = (W[5] + W[6]) / 2, (b[5] + b[6]) / 2 + 2.0 ** -10
    W[4], b[4] = 4 * W[5], -1000.0
    W, b = W.astype(np.float32), b.astype(np.float32)
    assert np.array_equal(W[0].astype(np.float64) * 2, W[1].astype(np.float64) + W[2])
    assert float(b[0]) * 2 == float(b[1]) + float(b[2])
    expected = {0: "unargmaxable", 3: plain_lp(W, b, 3), 4: "argmaxable"}
    assert expected[3] is not None
    for options in ({}, {"frank_wolfe_iterations": 0, "newton_iterations": 0, "lp_rounds": 0}):
        report = auditor.audit(W, b, progress=False, tokens=[0, 3, 4], **options)
        assert {k: report.tokens[k].verdict for k in expected} == expected
        assert auditor.verify(report, W, b).ok


def _engine_head(W, b):
    """The engine's view of a head, as pipeline.decide builds it."""
    import torch

    from auditor.question.domain import Unbounded
    from auditor.engine.arithmetic.head import build_engine_head
    from auditor.engine.arithmetic.normal_form import normal_form
    from auditor.engine.screen.ties import duplicate_groups

    weight = torch.as_tensor(W)
    bias = None if b is None else torch.as_tensor(b, dtype=torch.float64)
    representative = duplicate_groups(weight, bias)
    form = normal_form(weight, bias, Unbounded(), torch.as_tensor(representative == np.arange(len(W))), None, None)
    return build_engine_head(form.weight, form.bias, representative, form.domain, 1e-10, form.row_error,
                             form.bias_error)


def test_a_token_that_wins_only_far_out_gets_its_witness_from_the_rounds():
    """Row 4 is four times row 5 (longer than every other row, so outside their hull) with a bias of -1000:
    it loses near the origin and wins along w_4 far out. The rounds' separating direction has y_b = 0
    there, and the witness is the best point along y_w."""
    from auditor.engine.exact.certify import check_witnesses
    import torch

    rng = np.random.default_rng(11)
    W = (np.round(rng.standard_normal((40, 12)) * 64) / 64).astype(np.float32)
    b = (np.round(rng.standard_normal(40) * 64) / 256).astype(np.float32)
    W[4], b[4] = 4 * W[5], -1000.0
    head = _engine_head(W, b)
    certificates, witnesses, _ = corrective_certificates(head, np.array([4]), np.array([5]), rounds=40)
    assert 4 in witnesses and not certificates
    witness = witnesses[4].witness
    assert check_witnesses(head, np.array([4]), torch.as_tensor(witness[None, :]), exact_bound=True).certified[0]
    assert plain_lp(W, b, 4) == "argmaxable"


def test_copies_of_one_weight_row_with_other_biases_are_decided_by_the_rounds_alone():
    """Rows 0-19 share one weight row (a vertex: four times longer than the others) with biases 0, 1/4, ...,
    19/4: row 19 outscores each of 0-18 by its bias everywhere, and wins itself far along its row. The
    nearest point is the origin for rows 0-18 with many weightings (any rows of larger bias), and the
    one NNLS picks may have a bias gap of zero only up to rounding: polishing finds the vertex of
    largest bias."""
    rng = np.random.default_rng(5)
    W = rng.standard_normal((60, 10))
    W[:20] = 4 * W[20]
    b = np.zeros(60)
    b[:20] = np.arange(20) / 4
    W, b = W.astype(np.float32), b.astype(np.float32)
    report = auditor.audit(W, b, progress=False, frank_wolfe_iterations=0, newton_iterations=0, lp_rounds=0)
    assert report.ids("unargmaxable")[:19] == list(range(19))
    assert report.tokens[19].verdict == "argmaxable"
    assert report.counts["inconclusive"] == 0
    assert auditor.verify(report, W, b).ok
    for k in range(20):
        assert report.tokens[k].verdict == plain_lp(W, b, k)


@pytest.mark.parametrize("bias", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_wider_heads_give_the_rounds_what_frank_wolfe_and_newton_leave(monkeypatch, bias):
    """A head wider than corrective.WIDTH (here WIDTH is lowered to 8 for a 12-dimensional head) skips the rounds
    before Frank-Wolfe; with Frank-Wolfe and Newton held to two iterations, the tokens they leave go to the rounds
    (corrective.LEFTOVERS) before the exact LP. The verdicts are the plain LP's, every certificate verifies, and
    without the leftovers' rounds the same tokens go to the LP with the same verdicts."""
    import auditor.engine.pipeline as pipeline

    monkeypatch.setattr(pipeline.corrective, "WIDTH", 8)
    monkeypatch.setattr(pipeline, "_DIRECT_LP_WIDTH", 0)
    W, b = lognormal_head(300, 12, bias, 5)
    budgets = dict(frank_wolfe_iterations=2, newton_iterations=2, progress=False)
    report = auditor.audit(W, b, **budgets)
    assert report.counts["inconclusive"] == 0
    assert sum(t.stage == "min-norm" for t in report.tokens) >= 20
    assert compared_with_plain_lp(report, W, b) >= 290
    assert auditor.verify(report, W, b).ok
    monkeypatch.setattr(pipeline.corrective, "LEFTOVERS", False)
    without = auditor.audit(W, b, **budgets)
    assert all(t.stage != "min-norm" for t in without.tokens)
    assert [t.verdict for t in without.tokens] == [t.verdict for t in report.tokens]
