"""Probability ceilings against cvxpy's log_sum_exp minimisation (Clarabel), on small heads."""

import cvxpy as cp
import numpy as np
import pytest

import auditor


def cvxpy_ceiling(W, b, k, constraint):
    z = cp.Variable(W.shape[1])
    rivals = [i for i in range(W.shape[0]) if i != k]
    problem = cp.Problem(cp.Minimize(cp.log_sum_exp((W[rivals] - W[k]) @ z + (b[rivals] - b[k]))), constraint(z))
    problem.solve(solver=cp.CLARABEL)
    return 1.0 / (1.0 + np.exp(problem.value))


def assert_ceilings_match(report, W, b, constraint, softmax_point):
    for token in report.tokens:
        expected = cvxpy_ceiling(W, b, token.id, constraint)
        lower, upper = token.probability_bounds
        assert upper - lower <= 1e-4
        assert lower - 1e-6 <= expected <= upper + 1e-6, (token.id, expected, token.probability_bounds)
        assert abs(token.max_probability - expected) <= 1e-4 + 1e-6
        # the point attains the lower value
        assert softmax_point(token) == pytest.approx(lower, abs=1e-9)


def softmax_at(W, b, z, k):
    logits = W @ z + b
    logits -= logits.max()
    return float(np.exp(logits[k]) / np.exp(logits).sum())


@pytest.mark.parametrize("domain,radius", [("ball", 0.5), ("ball", 3.0), ("box", 0.4), ("box", 2.0)])
def test_ceilings_match_cvxpy_in_balls_and_boxes(rng, domain, radius):
    W = rng.standard_normal((40, 3))
    W = np.vstack([W, W[:4].mean(axis=0), W[7]])  # an interior row and a copy
    b = 0.4 * rng.standard_normal(42)
    b[41] = b[7]
    report = auditor.audit(W, b, domain=f"{domain}:{radius}", probability_ceiling=True, progress=False)
    if domain == "ball":
        constraint = lambda z: [cp.norm(z, 2) <= radius]  # noqa: E731
    else:
        constraint = lambda z: [cp.abs(z) <= radius]  # noqa: E731
    assert_ceilings_match(report, W, b, constraint, lambda t: softmax_at(W, b, t.probability_point, t.id))
    assert report.tokens[41].max_probability <= 0.5 + 1e-12  # tied with row 7: never above one half


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_ceilings_in_the_norm_domain_match_cvxpy_over_the_normalised_ball(rng, kind):
    d = 4
    W = rng.standard_normal((30, d))
    b = 0.3 * rng.standard_normal(30)
    gain = rng.uniform(0.5, 1.5, d)
    shift = 0.2 * rng.standard_normal(d) if kind == "layernorm" else np.zeros(d)
    norm = auditor.FinalNorm(kind, weight=gain, bias=shift if kind == "layernorm" else None, eps=1e-5)
    report = auditor.audit(W, b, domain="norm", final_norm=norm, probability_ceiling=True, progress=False)
    ones = np.ones(d)

    def constraint(z):  # z = g u + beta with ||u|| <= sqrt(d) (and u . 1 = 0 for LayerNorm)
        u = cp.multiply(1.0 / gain, z - shift)
        return [cp.norm(u, 2) <= np.sqrt(d)] + ([ones @ u == 0] if kind == "layernorm" else [])

    assert_ceilings_match(report, W, b, constraint, lambda t: softmax_at(W, b, t.probability_point, t.id))


def test_ceilings_need_a_bounded_domain():
    with pytest.raises(auditor.InputError, match="bounded"):
        auditor.audit(np.eye(3), probability_ceiling=True, progress=False)


def test_anisotropic_heads_still_get_bounds_within_the_gap(rng):
    W = rng.normal(size=(100, 4)) * np.array([10, 1, 0.3, 0.05])
    b = 0.5 * rng.normal(size=100)
    report = auditor.audit(W, b, domain="ball:2", probability_ceiling=True, progress=False)
    for token in report.tokens:
        lower, upper = token.probability_bounds
        assert upper - lower <= 1e-4
        assert np.linalg.norm(token.probability_point) <= 2.0


def test_a_single_row_reaches_probability_one():
    token = auditor.audit(np.ones((1, 3)), domain="ball:1", probability_ceiling=True, progress=False).tokens[0]
    assert token.probability_bounds == (1.0, 1.0)


@pytest.mark.parametrize("steering", ["bfloat16", "float32", "float64"])
@pytest.mark.parametrize("iterations", [0, 12])
def test_the_steering_precision_and_effort_change_no_certified_bound(rng, monkeypatch, steering, iterations):
    """The search runs in a fast precision (bfloat16 where the hardware has it) and only its point is
    used: with any steering precision, and with no steering at all (the float64 solver then does
    everything), the certified bounds still hold the cvxpy optimum and lie within the gap."""
    import torch

    import auditor.engine.ceiling as ceiling

    monkeypatch.setattr(ceiling, "steering_dtype", lambda device: getattr(torch, steering))
    monkeypatch.setattr(ceiling, "_STEERING_ITERATIONS", iterations)
    W = rng.standard_normal((60, 5))
    W = np.vstack([W, W[:6].mean(axis=0)])  # an interior row: its ceiling stays below one half
    b = 0.3 * rng.standard_normal(61)
    report = auditor.audit(W, b, domain="ball:1.5", probability_ceiling=True, progress=False)
    assert_ceilings_match(report, W, b, lambda z: [cp.norm(z, 2) <= 1.5],
                          lambda t: softmax_at(W, b, t.probability_point, t.id))
    assert report.tokens[60].max_probability < 0.5



def test_a_token_that_never_reaches_probability_one_is_not_reported_as_reaching_it():
    """At z = (5, 0) token 0 leads token 1 by 100: p = 1 - e^-100 rounds to 1.0 in float64, but 1 is
    never reached; the lower bound is rounded down below the sigmoid's rounding, the upper bound is 1."""
    W = np.array([[10.0, 0.0], [-10.0, 0.0]])
    lower, upper = auditor.audit(W, domain="ball:5", probability_ceiling=True, progress=False).tokens[0].probability_bounds
    assert 1 - 1e-4 <= lower < 1.0 and upper == 1.0
