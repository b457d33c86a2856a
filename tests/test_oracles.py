"""Verdicts against oracles nobody here wrote: Qhull and a plain LP over all rows (HiGHS)."""

import numpy as np
import pytest
import scipy.optimize

import auditor
from oracles import ball_margin, convex_residual, lp_margin, qhull_argmaxable, witness_wins


def planted_head(rng, n, d, interior=5):
    """A Gaussian cloud with a few rows planted inside as random convex combinations."""
    W = rng.standard_normal((n, d)) * rng.uniform(0.5, 2.0, size=d)
    inside = [rng.dirichlet(np.ones(d + 2)) @ W[rng.choice(n, d + 2, replace=False)] for _ in range(interior)]
    return np.vstack([W, inside])


def crossing(W, k):
    """lambda* such that c + lambda* (w_k - c) is on the boundary of the hull of the other rows (c their mean)."""
    others = np.delete(W, k, axis=0)
    c = others.mean(axis=0)
    m, d = others.shape
    # variables alpha (m), lambda; maximise lambda s.t. others^T alpha - lambda (w_k - c) = c, sum alpha = 1
    A_eq = np.vstack([np.hstack([others.T, -(W[k] - c)[:, None]]), np.hstack([np.ones(m), [0.0]])])
    b_eq = np.concatenate([c, [1.0]])
    cost = np.zeros(m + 1)
    cost[-1] = -1
    res = scipy.optimize.linprog(cost, A_eq=A_eq, b_eq=b_eq, bounds=[(0, None)] * m + [(None, None)],
                                 method="highs", options={"primal_feasibility_tolerance": 1e-10})
    assert res.status == 0
    return c, -res.fun


def lp_verdict(W, b, k):
    """The plain LP's verdict in the unbounded domain: its optimum is 0 (at z = 0, s = 0) or positive."""
    t, _, _ = lp_margin(W, b, k)
    assert t > 1e-7 or abs(t) < 1e-12, f"the oracle cannot tell token {k} apart (t = {t})"
    return "argmaxable" if t > 1e-7 else "unargmaxable"


@pytest.mark.parametrize("d", [2, 3, 4, 5])
def test_no_bias_matches_qhull_vertices(rng, d):
    W = planted_head(rng, 40 + 10 * d, d)
    report = auditor.audit(W, progress=False)
    assert set(report.ids("argmaxable")) == qhull_argmaxable(W)
    assert report.counts["inconclusive"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("d", [2, 3, 4])
def test_bias_matches_qhull_of_lifted_points(rng, d):
    W = planted_head(rng, 30 + 10 * d, d)
    b = rng.normal(scale=0.7, size=W.shape[0])
    report = auditor.audit(W, b, progress=False)
    assert set(report.ids("argmaxable")) == qhull_argmaxable(W, b)
    assert report.counts["inconclusive"] == 0
    for token in report.tokens:
        if token.verdict == "argmaxable":
            assert witness_wins(W, b, token.id, token.witness)
        else:
            residual, gap = convex_residual(W, b, token.id, token.convex_indices, token.convex_weights)
            assert residual <= 1e-9 and gap <= 1e-9


@pytest.mark.slow
@pytest.mark.parametrize("depth", [1e-3, 1e-4, 1e-5, 1e-6])
def test_near_boundary_rows_get_exact_verdicts(rng, depth):
    base = rng.standard_normal((120, 8))
    for k in range(4):  # one row at a time moves onto its ray, just inside or just outside the others' hull
        W = base.copy()
        c, lam = crossing(W, k)
        inside = k % 2 == 0
        W[k] = c + lam * (1 - depth if inside else 1 + depth) * (W[k] - c)
        report = auditor.audit(W, progress=False)
        assert report.tokens[k].verdict == ("unargmaxable" if inside else "argmaxable"), (k, report.tokens[k])
        if inside:
            assert report.tokens[k].residual < 1e-12
        else:
            assert witness_wins(W, None, k, report.tokens[k].witness)
    for k in range(4, W.shape[0]):
        assert report.tokens[k].verdict == lp_verdict(W, None, k)


def test_duplicates_are_tied_and_their_group_is_decided(rng):
    W = planted_head(rng, 80, 5, interior=3)
    inner = W.shape[0] - 1  # a planted interior row
    vertex = min(qhull_argmaxable(W))
    W = np.vstack([W, W[[vertex, vertex, inner]]])
    n = W.shape[0]
    report = auditor.audit(W, progress=False)
    assert report.ids("tied") == sorted([vertex, n - 3, n - 2, inner, n - 1])
    assert report.tokens[vertex].tied_with == [n - 3, n - 2]
    assert report.tokens[vertex].group_verdict == "argmaxable"
    assert report.tokens[inner].group_verdict == "unargmaxable"
    assert witness_wins(W, None, vertex, report.tokens[n - 2].witness, exclude={n - 3, n - 2})
    # the rest of the head is decided as if each group were one row
    assert set(report.ids("argmaxable")) == qhull_argmaxable(W[:n - 3]) - {vertex}


@pytest.mark.slow
def test_random_heads_agree_with_the_plain_lp(rng):
    W = planted_head(rng, 150, 10, interior=8)
    W = np.vstack([W, W[[5, 154]]])  # a copy of an outer row and of a planted interior row
    b = rng.normal(scale=0.3, size=W.shape[0])
    b[-2:] = b[[5, 154]]
    copies = {5: 158, 158: 5, 154: 159, 159: 154}
    for bias in (None, b):
        report = auditor.audit(W, bias, progress=False)
        assert report.ids("tied") == sorted(copies)
        for k in range(W.shape[0]):
            token = report.tokens[k]
            if k in copies:  # the group as a whole, against every other row
                assert token.tied_with == [copies[k]]
                assert token.group_verdict == lp_verdict(np.delete(W, copies[k], axis=0),
                                                         None if bias is None else np.delete(bias, copies[k]),
                                                         k if k < copies[k] else k - 1)
            else:
                assert token.verdict == lp_verdict(W, bias, k), k


@pytest.mark.parametrize("radius", [0.05, 0.5, 5.0])
def test_box_domain_with_bias_matches_the_lp_with_those_bounds(rng, radius):
    W = planted_head(rng, 60, 4, interior=4)
    b = rng.normal(scale=0.5, size=W.shape[0])
    report = auditor.audit(W, b, domain=f"box:{radius}", progress=False)
    for k in range(W.shape[0]):
        t, _, _ = lp_margin(W, b, k, domain=f"box:{radius}")
        token = report.tokens[k]
        if abs(t) > 1e-7:
            assert token.verdict == ("argmaxable" if t > 0 else "unargmaxable"), (k, t, token)
        if token.verdict == "argmaxable":
            assert np.abs(token.witness).max() <= radius
            assert witness_wins(W, b, k, token.witness)
            assert token.margin <= t + 1e-9  # no witness beats the optimum


@pytest.mark.parametrize("radius", [0.1, 1.0, 10.0])
def test_ball_domain_with_bias_matches_the_cone_program(rng, radius):
    W = planted_head(rng, 40, 3, interior=3)
    b = rng.normal(scale=0.5, size=W.shape[0])
    report = auditor.audit(W, b, domain=f"ball:{radius}", progress=False)
    for k in range(W.shape[0]):
        t = ball_margin(W, b, k, radius)
        token = report.tokens[k]
        if abs(t) > 1e-6:
            assert token.verdict == ("argmaxable" if t > 0 else "unargmaxable"), (k, t, token)
        if token.verdict == "argmaxable":
            assert np.linalg.norm(token.witness) <= radius
            assert witness_wins(W, b, k, token.witness)
        if token.verdict == "unargmaxable":
            # the dual value bounds the margin of every z in the ball
            assert t <= token.residual + 1e-6


def test_bounded_domains_without_bias_give_the_unbounded_verdicts(rng):
    W = planted_head(rng, 200, 5, interior=6)
    unbounded = auditor.audit(W, progress=False)
    for domain in ("ball:0.01", "box:3"):
        report = auditor.audit(W, domain=domain, progress=False)
        assert report.ids("unargmaxable") == unbounded.ids("unargmaxable")
        assert all(report.domain.contains(t.witness) for t in report.tokens if t.witness is not None)
