"""Heads at the edges of float64, bias gaps at the edge of zero, and certificates that must be refused."""

import math

import numpy as np
import pytest

import auditor
from oracles import qhull_argmaxable


@pytest.mark.parametrize("scale", [2.0**-537, 1e-165, 1e160, 2.0**600])
def test_verdicts_do_not_depend_on_the_head_scale(rng, scale):
    W = rng.standard_normal((40, 3))
    W = np.vstack([W, W[:5].mean(axis=0)])
    expected = qhull_argmaxable(W)
    report = auditor.audit(W * scale, progress=False)
    assert set(report.ids("argmaxable")) == expected
    assert report.ids("unargmaxable") == sorted(set(range(41)) - expected)
    assert auditor.verify(report, W * scale).ok
    for token in report.tokens:  # margins and residuals are in the units of the head as given
        if token.verdict == "argmaxable":
            assert token.margin > 0 and math.isfinite(token.margin)


def test_tiny_rows_next_to_each_other_are_decided_exactly():
    x, y = math.sqrt(0.6) * 2.0**-537, (1.4 / math.sqrt(0.6)) * 2.0**-537
    W = np.array([[x, x], [y, 0], [0, y], [0, 0]])
    assert auditor.audit(W, progress=False).tokens[0].verdict == auditor.audit(W * 2.0**600, progress=False).tokens[0].verdict


def test_three_huge_rows_in_three_dimensions_are_all_argmaxable():
    W = np.array([[1e308, 0, 0], [-1e308, 0, 0], [0, 1, 0]])
    assert auditor.audit(W, progress=False).counts["argmaxable"] == 3


EDGE = np.array([[0.25, 0.75], [0.25, -1.25], [1, 0.5], [-0.5, 0.5], [0.25, -0.25]])


def edge_midpoint_bias(gap: float) -> np.ndarray:
    """Token 4 is exactly the average of rows 0 and 1, its bias ``gap`` above theirs: it leads by exactly
    ``gap`` at z = (0, 1/4) and by no more anywhere (one of l_4 - l_0 = 1/4 - z_2 + gap and
    l_4 - l_1 = z_2 - 1/4 + gap is at most gap)."""
    return np.array([0, 0.5, -0.75, -0.25, 0.25 + gap])


@pytest.mark.parametrize("domain, gap", [("unbounded", 2.0**-34), ("unbounded", 2.0**-24), ("box:1", 2.0**-24),
                                         ("ball:1", 2.0**-24)])
def test_a_positive_bias_gap_is_never_an_unargmaxable_certificate(domain, gap):
    # unbounded: a lead of 2^-34 at |z| = 1/4 is 2^-32 |z|, above the tolerance (1e-10 of |w_4 - m| = 0.75);
    # in every domain a lead of 2^-24 is far above the tolerance (times the reach), and is found
    b = edge_midpoint_bias(gap)
    report = auditor.audit(EDGE, b, domain=domain, progress=False)
    assert report.tokens[4].verdict in (("argmaxable", "inconclusive") if gap < 2.0**-30 else ("argmaxable",))
    assert auditor.verify(report, EDGE, b).ok


@pytest.mark.parametrize("domain", ["box:1", "ball:1"])
def test_a_lead_below_the_tolerance_times_the_reach_is_unargmaxable_and_says_so(domain):
    # the best lead in D is 2^-34 (5.8e-11), under 1e-10 times the rows' spread times the reach: the
    # certificate's dual value bounds that lead, and states a number at least as large
    b = edge_midpoint_bias(2.0**-34)
    report = auditor.audit(EDGE, b, domain=domain, progress=False)
    token = report.tokens[4]
    assert token.verdict == "unargmaxable"
    assert 2.0**-34 <= token.residual <= report.tolerances["residual_tol"] * 0.75 * math.sqrt(2)
    assert auditor.verify(report, EDGE, b).ok


def test_one_huge_row_does_not_loosen_the_tolerance_for_the_others():
    rng = np.random.default_rng(4)
    W = rng.standard_normal((40, 3))
    W[0] *= 1e8
    report = auditor.audit(W, progress=False)
    assert set(report.ids("argmaxable")) == qhull_argmaxable(W)


@pytest.mark.slow
def test_interior_weights_sum_to_one_and_verify(rng):
    A = rng.standard_normal((4, 4)) * np.array([100, 1, 0.01, 1e-4])
    W = rng.standard_normal((40, 4)) @ A
    W = np.vstack([W, W.mean(axis=0)])
    b = rng.normal(scale=0.1, size=41)
    for domain in ("unbounded", "box:1", "ball:1"):
        report = auditor.audit(W, b, domain=domain, progress=False)
        for token in report.tokens:
            if token.convex_weights is not None:
                assert abs(token.convex_weights.sum() - 1) < 1e-12
        assert auditor.verify(report, W, b).ok


def test_verifier_refuses_forged_and_missing_certificates(rng):
    W = np.vstack([rng.standard_normal((30, 3)), np.zeros((1, 3))])
    b = np.zeros(31)
    report = auditor.audit(W, b, domain="ball:1", progress=False)
    k = report.ids("argmaxable")[0]
    d = report._d
    d.verdict[k] = 2  # claim unargmaxable with no certificate at all
    assert k in auditor.verify(report, W, b).failed
    d.convex[k] = (np.array([k + 1]), np.array([1.0]), 0.0, 0.0)  # a certificate that proves nothing
    assert k in auditor.verify(report, W, b).failed
    b_high = b.copy()
    b_high[30] = 5.0  # with a large bias the origin row wins: its old certificate must now fail
    assert 30 in auditor.verify(auditor.audit(W, b, progress=False), W, b_high).failed


@pytest.mark.parametrize("depth", [1e-8, 1e-9])
def test_rows_a_hair_outside_the_hull_are_proved_argmaxable(rng, depth):
    from test_oracles import crossing

    base = rng.standard_normal((80, 6))
    for k in range(3):
        W = base.copy()
        c, lam = crossing(W, k)
        W[k] = c + lam * (1 + depth) * (W[k] - c)
        token = auditor.audit(W, progress=False).tokens[k]
        assert token.verdict == "argmaxable", token
        assert 0 < token.margin < 1e-6


@pytest.mark.parametrize("bad", [{"tokens": [1.5]}, {"tokens": [True, False]}, {"residual_tol": 1.0},
                                 {"residual_tol": float("inf")}, {"lp_rounds": -1}, {"domain": "ball:1e-320"}])
def test_meaningless_options_are_refused(bad):
    with pytest.raises(auditor.InputError):
        auditor.audit(np.eye(3), progress=False, **bad)


@pytest.mark.parametrize("domain", ["unbounded", "ball:1", "box:1"])
def test_verify_accepts_a_zero_bias_gap_the_engine_accepted(domain):
    W = np.array([[1.0, 0], [-1, 0], [0, 0], [0, 1]])
    b = np.array([0, 0, 0, -5.0])
    report = auditor.audit(W, b, domain=domain, progress=False)
    assert report.tokens[2].verdict == "unargmaxable"
    assert auditor.verify(report, W, b).ok
