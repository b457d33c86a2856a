"""``auditor.verify`` accepts every certificate that holds exactly (issue: a checker that never cries wolf).

Three families that a float64 rounding bound on the raw numbers rejects: witnesses whose
rivals share a huge bias, witnesses of rows that share a huge offset, and convex weights
whose bias gap is negative in exact arithmetic but rounds to a positive float64 value.
A hypothesis property then audits small heads, and their twins under the spec's
invariances, and checks every issued certificate.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import auditor


def exact_lead(W, b, k: int, z) -> Fraction:
    """min_{i != k} (l_k(z) - l_i(z)) in rational arithmetic."""
    point = [Fraction(float(v)) for v in z]

    def logit(i):
        return sum(Fraction(float(w)) * p for w, p in zip(W[i], point)) + Fraction(float(b[i]))

    return min(logit(k) - logit(i) for i in range(len(W)) if i != k)


def test_witnesses_whose_rivals_share_a_huge_bias_verify():
    W = np.array([[1.0, 0.0], [-1.0, 0.0], [0.0, 1.0]])
    b = np.array([1e6, 1e6, 0.0])
    report = auditor.audit(W, b, domain=auditor.Ball(1e-12), progress=False)
    assert report.ids("argmaxable") == [0, 1] and report.ids("unargmaxable") == [2]
    for k in (0, 1):  # margins of 2e-12 under logits of 1e6: exact, yet far below |b| times a roundoff
        assert 0 < exact_lead(W, b, k, report.tokens[k].witness) < Fraction(1, 10**11)
    result = auditor.verify(report, W, b)
    assert result.ok, result.reasons


def polygon_with_rows_just_outside_its_edges(push: float) -> np.ndarray:
    """12 points of the unit circle and, beyond each edge's midpoint, a row pushed out by ``push``."""
    angles = np.linspace(0, 2 * np.pi, 13)[:-1]
    corners = np.c_[np.cos(angles), np.sin(angles)]
    middles = (corners + np.roll(corners, -1, axis=0)) / 2
    return np.vstack([corners, middles + push * middles / np.linalg.norm(middles, axis=1, keepdims=True)])


@pytest.mark.parametrize("offset", [1e6, 2.0**20])
def test_witnesses_of_rows_that_share_a_huge_offset_verify(offset):
    W = polygon_with_rows_just_outside_its_edges(4e-10)
    W[:, 0] += offset
    report = auditor.audit(W, progress=False)
    assert report.counts["argmaxable"] == 24  # every row is a vertex: the pushed ones barely
    result = auditor.verify(report, W)
    assert result.ok, result.reasons
    assert result.tokens == 24


def test_a_certificate_that_is_not_a_witness_still_fails_with_a_shared_offset():
    """The sharper re-check is not a loophole: a witness of the wrong token fails."""
    W = polygon_with_rows_just_outside_its_edges(4e-10)
    W[:, 0] += 2.0**20
    document = auditor.audit(W, progress=False).to_dict()
    entries = {entry["id"]: entry for entry in document["tokens"]}
    entries[12]["witness"] = entries[13]["witness"]  # rows 12 and 13 lie beyond neighbouring edges
    result = auditor.verify(document, W)
    assert result.failed == [12]


def biased_head_with_a_gap_that_rounds_up() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows 0-2 and a bias in float32, row 3 their combination with weights ``alpha``, and b_3 the
    float64 just below sum beta_i b_i: the exact bias gap is about -3e-18, its float64 value +4e-17."""
    rng = np.random.default_rng(4)
    bias = rng.standard_normal(3).astype(np.float32).astype(np.float64)
    alpha = rng.random(3)
    alpha /= alpha.sum()
    exact = sum(Fraction(a) * Fraction(v) for a, v in zip(alpha, bias)) / sum(Fraction(a) for a in alpha)
    top = float(exact)
    if Fraction(top) >= exact:
        top = float(np.nextafter(top, -np.inf))
    rows = np.random.default_rng(5).standard_normal((3, 8)).astype(np.float32).astype(np.float64)
    W = np.vstack([rows, alpha @ rows / alpha.sum()])
    return W, np.append(bias, top), alpha


def exact_mean_bias(alpha, bias) -> Fraction:
    return sum(Fraction(a) * Fraction(v) for a, v in zip(alpha, bias)) / sum(map(Fraction, alpha))


def with_convex_certificate(document: dict, k: int, indices, weights) -> dict:
    """The document with token k's certificate replaced by the given convex weights, counts to match."""
    for entry in document["tokens"]:
        if entry["id"] == k:
            entry.update(verdict="unargmaxable", witness=None, margin=None,
                         convex={"indices": list(indices), "weights": list(weights), "residual": None,
                                 "bias_gap": None})
    listed = [entry["verdict"] for entry in document["tokens"]]
    document["counts"].update({verdict: listed.count(verdict) for verdict in ("argmaxable", "unargmaxable")})
    return document


def test_convex_weights_whose_gap_rounds_positive_but_is_negative_exactly_verify():
    W, b, alpha = biased_head_with_a_gap_that_rounds_up()
    assert float(alpha / alpha.sum() @ (b[3] - b[:3])) > 0  # what float64 says
    assert Fraction(b[3]) - exact_mean_bias(alpha, b[:3]) < 0  # what holds
    document = with_convex_certificate(auditor.audit(W, b, progress=False).to_dict(), 3, [0, 1, 2], alpha.tolist())
    result = auditor.verify(document, W, b)
    assert result.ok, result.reasons
    above = b.copy()  # the same weights with b_3 just above the combination: a positive gap, which must fail
    above[3] = float(np.nextafter(float(exact_mean_bias(alpha, b[:3])), np.inf))
    assert Fraction(above[3]) > exact_mean_bias(alpha, b[:3])
    failing = auditor.verify(document, W, above)
    assert failing.failed == [3] and "bias gap" in failing.reasons[3][0], failing.reasons


# --- every certificate the audit issues verifies, on a head and on its twins --------------------------

UNIT = 2.0**-5


@st.composite
def twins(draw):
    """A head of small dyadic numbers with planted means and copies, and one exact twin: its rows
    permuted, offset by 2^20 v, its bias shifted by 2^20 c, or both scaled by 2^p."""
    n, d = draw(st.integers(3, 14)), draw(st.integers(1, 4))
    small = st.integers(-64, 64)
    W = np.array(draw(st.lists(st.lists(small, min_size=d, max_size=d), min_size=n, max_size=n)), float) * UNIT
    b = np.array(draw(st.lists(small, min_size=n, max_size=n)), float) * UNIT if draw(st.booleans()) else None
    for k in draw(st.lists(st.integers(0, n - 1), max_size=3)):
        sources = draw(st.lists(st.integers(0, n - 1).filter(lambda i: i != k), min_size=1, max_size=4,
                                unique=True).filter(lambda s: len(s) in (1, 2, 4)))
        W[k] = W[sources].sum(axis=0) / len(sources)
        if b is not None:
            b[k] = b[sources].sum() / len(sources)
    kind = draw(st.sampled_from(["permute", "offset", "bias", "scale"]))
    W2, b2 = W.copy(), None if b is None else b.copy()
    if kind == "permute":
        order = np.array(draw(st.permutations(range(n))))
        W2 = W[order]
        b2 = None if b is None else b[order]
    elif kind == "offset":
        W2 = W + np.array(draw(st.lists(small, min_size=d, max_size=d)), float) * 2.0**20
    elif kind == "bias" and b is not None:
        b2 = b + draw(small) * 2.0**20
    elif kind == "scale":
        p = draw(st.integers(-40, 40))
        W2, b2 = W * 2.0**p, None if b is None else b * 2.0**p
    domain = draw(st.sampled_from(["unbounded", auditor.Ball(0.5), auditor.Ball(4.0), auditor.Box(1.0)]))
    return W, b, W2, b2, domain


@settings(max_examples=40, deadline=None, database=None, print_blob=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(twins())
def test_every_certificate_the_audit_issues_verifies_under_the_invariances(case):
    W, b, W2, b2, domain = case
    for weight, bias in ((W, b), (W2, b2)):
        report = auditor.audit(weight, bias, domain=domain, progress=False)
        result = auditor.verify(report, weight, bias)
        assert result.ok, result.reasons
        assert result.tokens == weight.shape[0] - report.counts["inconclusive"]


def test_a_gap_settled_exactly_bounds_the_gap_of_the_weights_as_reported():
    # row 3 is the mean of rows 0, 2, 4 and 6, and b_3 the mean of their biases: the gap is zero up to
    # rounding, so its bound is settled in rational arithmetic, and must be for the reported weights
    # (normalised to sum 1), not for the solver's before normalisation, which differ in the last bits
    W = np.array([[-2, 2, 1, 0], [-2, 2, 1, 0], [0, 4.25, 11.5, -18], [0.25, 1.5625, 14.375, -22.25],
                  [0, 1, 0, -26], [0, 0, 0, -10], [3, -1, 45, -45]]) / 32
    b = np.array([0, 0, -10.5, -13.125, 0, 0, -42]) / 32
    report = auditor.audit(W, b, progress=False)
    assert report.ids("unargmaxable") == [3]
    result = auditor.verify(report, W, b)
    assert result.ok, result.reasons
    entry = next(t for t in report.to_dict()["tokens"] if t["id"] == 3)
    alpha = [Fraction(a) for a in entry["convex"]["weights"]]
    exact = sum(a * (Fraction(b[3]) - Fraction(b[i])) for a, i in zip(alpha, entry["convex"]["indices"]))
    assert Fraction(entry["convex"]["bias_gap"]) >= exact / sum(alpha)


def test_the_audit_settles_such_a_gap_exactly_instead_of_leaving_the_token_inconclusive():
    W, b, _ = biased_head_with_a_gap_that_rounds_up()
    report = auditor.audit(W, b, progress=False)
    assert report.ids("unargmaxable") == [3] and report.ids("argmaxable") == [0, 1, 2]
    assert auditor.verify(report, W, b).ok
