"""Tokens a few tolerances from the threshold get a verdict, and it is the exact one.

The rule (docs/method.md, "One verdict per head"): in R^d token k is argmaxable iff it leads somewhere by
more than tau_k ||z||, tau_k = 1e-10 max(||w_k - m||, t). Each head here plants rows at c tau_k either
side of that threshold, c from 2.5 to 1000, where float64 weights leave the nearest point's direction
uncertain by more than the lead. The expected verdict is not taken from the engine or a float solver:
each planted row comes with its own certificate, checked here in rational arithmetic (fractions) on
the numbers as stored: a witness whose exact lead exceeds tau_k ||z||, or convex weights whose exact
residual is at most tau_k with a bias gap <= 0.
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import scipy.optimize

import auditor

TAU = 1e-10  # the documented residual_tol


def _tau(W: np.ndarray, k: int) -> float:
    """tau_k as docs/method.md defines it: 1e-10 max(||w_k - m||, t), m the coordinate-wise lower median of
    the distinct rows, t the 10th percentile of their non-zero distances from m."""
    rows = np.unique(W.astype(np.float64), axis=0)
    m = np.sort(rows, axis=0)[(rows.shape[0] - 1) // 2]
    distances = np.sort(np.linalg.norm(rows - m, axis=1))
    distances = distances[distances > 0]
    t = distances[max(1, int(0.1 * distances.size)) - 1]  # the 10th percentile, as the k-th smallest
    return TAU * max(float(np.linalg.norm(W[k].astype(np.float64) - m)), float(t))


def _exact(values) -> list[Fraction]:
    return [Fraction(float(v)) for v in np.asarray(values, dtype=np.float64).ravel()]


def _leads_exactly(W, b, k, z, tau) -> bool:
    """The exact lead of row k at z over every other row exceeds tau ||z|| (compared squared)."""
    zq = _exact(z)
    logits = [sum(a * c for a, c in zip(_exact(row), zq)) + (Fraction(float(b[i])) if b is not None else 0)
              for i, row in enumerate(W)]
    lead = min(logits[k] - v for i, v in enumerate(logits) if i != k)
    return lead > 0 and lead * lead > Fraction(tau) ** 2 * sum(c * c for c in zq)


def _weights_certify_exactly(W, b, k, indices, weights, tau) -> bool:
    """Exact convex weights (fractions summing to 1) with residual at most tau and bias gap <= 0."""
    assert sum(weights) == 1 and all(w >= 0 for w in weights)
    target = _exact(W[k])
    residual = list(target)
    for i, w in zip(indices, weights):
        residual = [r - w * v for r, v in zip(residual, _exact(W[i]))]
    gap = Fraction(float(b[k])) - sum(w * Fraction(float(b[i])) for i, w in zip(indices, weights)) if b is not None else 0
    return sum(r * r for r in residual) <= Fraction(tau) ** 2 and gap <= 0


def _planted_head(rng, d: int, n_other: int, bias: bool, degenerate: bool):
    """Rows on a 2^-8 grid: a cross-polytope of 2 (d - 1) rows in the face w_1 = 0 (the facet F), the row
    -e_1, and others with w_1 in [-1, -1/16]. With a bias, b_i = a w_i2 on F for a power of two a (every
    facet row's logit is then w_i . (z + a e_2)), and at most that on the other rows. ``degenerate``: every
    row has w_d = 0 as well (the hull is flat)."""
    facet = []
    for j in range(1, d - (1 if degenerate else 0)):
        size = 1 + rng.integers(0, 64) / 256
        for sign in (1.0, -1.0):
            row = np.zeros(d)
            row[j] = sign * size
            facet.append(row)
    others = np.round(rng.uniform(-1, 1, (n_other, d)) * 256) / 256
    others[:, 0] = -np.round(rng.uniform(1 / 16, 1, n_other) * 256) / 256
    if degenerate:
        others[:, -1] = 0.0
    down = np.zeros((1, d))
    down[0, 0] = -1.0
    W = np.vstack([np.array(facet), down, others])
    a = 2.0 ** int(rng.integers(-2, 3))
    b = None
    if bias:
        b = a * W[:, 1]
        b[len(facet):] -= np.round(rng.uniform(0, 1, W.shape[0] - len(facet)) * 16) / 16
    return W, b, a


def _facet_weights(rng, n_facet: int, symmetric: bool) -> list[Fraction]:
    """Convex weights over the facet's rows, multiples of 1/16 and all positive (a point inside F); the pair on
    e_2 always weighs its two rows alike (the point has w_2 = 0), and with ``symmetric`` every pair does (the
    point is F's centre, the origin)."""
    pairs = n_facet // 2
    counts = np.ones((pairs, 2), dtype=int)
    for _ in range((16 - 2 * pairs) // 2):  # two sixteenths at a time: to both rows of a pair, or to two rows
        j = int(rng.integers(0, pairs))
        if symmetric or j == 0:
            counts[j] += 1
        else:
            for _ in range(2):
                counts[int(rng.integers(1, pairs)), int(rng.integers(0, 2))] += 1
    return [Fraction(int(v), 16) for v in counts.ravel()]


def _plant(W, b, a, kind: str, c: float, tau: float, beta: list[Fraction], n_facet: int):
    """Row k (appended last) at the facet's point q = sum beta_i f_i, planted c tau from the threshold: 'out'
    beyond F along e_1 (no bias), 'off' off the flat hull along e_d, 'in' inside the hull along -e_1 (the
    point delta (-e_1) + (1 - delta) q); with a bias 'above' / 'below' the lifted facet by c tau |a|."""
    q = sum(float(w) * W[i] for i, w in enumerate(beta))
    row = q.copy()
    planted_bias = 0.0
    if kind == "out":
        row[0] = c * tau
    elif kind == "off":
        row[-1] = c * tau
    elif kind == "in":
        row = (1 - c * tau) * q
        row[0] = -c * tau
    elif kind == "above":
        planted_bias = c * tau * abs(a)
    elif kind == "below":
        planted_bias = -c * tau * abs(a)
    W = np.vstack([W, row])
    b = None if b is None else np.append(b, planted_bias)
    return W, b


def _expected(W, b, a, kind: str, tau: float, n_facet: int, rotation: np.ndarray, beta: list[Fraction],
              delta: float) -> str:
    """The planted row's verdict, proved in rational arithmetic on the numbers as stored (rows rotated by
    ``rotation`` after the construction: the witness turns with them, the weights stay)."""
    k = W.shape[0] - 1
    d = W.shape[1]
    if kind in ("out", "off", "above"):
        z = np.zeros(d)
        if kind == "out":
            z[0] = 1.0
        elif kind == "off":
            z[-1] = 1.0
        else:
            z[1] = -a  # the facet's rows and k all have logit b_i - a w_i2 here: k leads by its planted bias
        # without a bias (1 - 2^-20) z: inside the unit ball whatever the rotation's rounding, the lead (linear in
        # z then) cut by as little; with one the point itself (the unbounded domain only)
        assert _leads_exactly(W, b, k, (rotation @ z) * (1 - 2.0 ** -20 if b is None else 1.0), tau)
        return "argmaxable"
    if kind == "in":  # delta (-e_1) + (1 - delta) sum beta_i f_i
        share = 1 - Fraction(delta)
        weights = [share * w for w in beta] + [Fraction(delta)]
        indices = list(range(n_facet)) + [n_facet]
    else:  # below: w_k = sum beta_i f_i, its bias gap the planted one
        weights, indices = beta, list(range(n_facet))
    assert _weights_certify_exactly(W, b, k, indices, weights, tau)
    return "unargmaxable"


CASES = [(kind, bias, degenerate) for kind, bias, degenerate in [
    ("out", False, False), ("in", False, False), ("off", False, True),
    ("above", True, False), ("below", True, False), ("above", True, True), ("below", True, True)]]


# the unit ball too, for the rows without a bias: there the threshold is tau_k times the reach 1, the planted
# witnesses have norm 1 (taken a hair inside), and convex weights certify in every domain
DOMAINS = [(case, "unbounded") for case in range(len(CASES))] + [
    (case, "ball:1") for case, (_, bias, _) in enumerate(CASES) if not bias]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("case,domain", DOMAINS)
def test_rows_planted_a_few_tolerances_from_the_threshold_get_the_exact_verdict(dtype, case, domain):
    kind, bias, degenerate = CASES[case]
    rng = np.random.default_rng(2 * case + (dtype == np.float32))
    d = 6
    for c in (2.5, 4.0, 16.0, 100.0, 1000.0):
        W, b, a = _planted_head(rng, d, 40, bias, degenerate)
        n_facet = 2 * (d - 1 - (1 if degenerate else 0))
        # float32 rows stay on the grid, where a point inside F other than its centre would round by far more
        # than the planted distances when moved inwards; float64 ones take any point of F
        beta = _facet_weights(rng, n_facet, symmetric=dtype == np.float32 and kind == "in")
        tau = _tau(np.vstack([W, np.zeros(d)]), W.shape[0])
        W, b = _plant(W, b, a, kind, c, tau, beta, n_facet)
        delta = c * tau
        # float64 rows turned by a random rotation, so that no face is aligned with the axes (its rounding,
        # 1e-16 of the rows, moves every lead and residual by far less than the tolerance); float32 rows, whose
        # rounding would bury the planted distances, stay on the grid
        rotation = np.linalg.qr(rng.standard_normal((d, d)))[0] if dtype == np.float64 else np.eye(d)
        W = W @ rotation.T
        W, b = W.astype(dtype), None if b is None else b.astype(dtype)
        # the oracle's certificates hold with a quarter to spare on the tolerance either way
        tau = _tau(W, W.shape[0] - 1)
        expected = _expected(W, b, a, kind, tau * 1.25 if kind in ("out", "off", "above") else tau / 1.25, n_facet,
                             rotation, beta, delta)
        report = auditor.audit(W, b, domain=domain, progress=False)
        token = report.tokens[W.shape[0] - 1]
        assert token.verdict == expected, (c, token.verdict, token.bounds)
        assert report.counts["inconclusive"] == 0
        assert auditor.verify(report, W, b).ok


def test_the_documented_midpoint_example_is_decided_as_the_docs_say():
    """docs/method.md: a row at the midpoint of a hull edge with a bias 2^-34 above its ends' average leads by
    2^-34 and is argmaxable in R^d; with 2^-45 it is unargmaxable; in box:1 the 2^-34 one is unargmaxable too.
    An exact common offset of the rows changes nothing."""
    W = np.array([[1, 0], [0, 1], [-1, -1], [0.5, 0.5]], dtype=np.float64)
    for offset in (0.0, 1e6):
        shifted = W + np.array([offset, 0.0])
        b = np.array([0.25, 0.75, 0.0, 0.5 + 2.0 ** -34])
        report = auditor.audit(shifted, b, progress=False)
        assert [t.verdict for t in report.tokens] == ["argmaxable"] * 4
        assert _leads_exactly(shifted, b, 3, report.tokens[3].witness, 0.0)
        assert auditor.verify(report, shifted, b).ok
        b_low = np.array([0.25, 0.75, 0.0, 0.5 + 2.0 ** -45])
        low = auditor.audit(shifted, b_low, progress=False)
        assert low.tokens[3].verdict == "unargmaxable"
        assert auditor.verify(low, shifted, b_low).ok
    box = auditor.audit(W, b, domain="box:1", progress=False)
    assert box.tokens[3].verdict == "unargmaxable"


def _flat_head(seed: int, zero_sum: bool):
    """400 x 40 float64 rows spanning a rank-10 affine subspace (up to rounding), and rows at their mean moved
    off it, each along its own direction orthogonal to the subspace and to the others', by 2e-10 to 1e-3 of
    the rows' spread."""
    rng = np.random.default_rng(seed)
    n, d, rank = 400, 40, 10
    basis = np.linalg.qr(rng.standard_normal((d, rank)))[0]
    rows = rng.standard_normal((n, rank)) @ basis.T + rng.standard_normal(d)
    mean = rows.mean(0)
    spread = np.sqrt(((rows - mean) ** 2).sum(1).mean())
    offsets = [2e-10, 5e-10, 1e-9, 3e-9, 1e-8, 1e-6, 1e-3]
    normals = np.linalg.qr(np.hstack([basis, rng.standard_normal((d, len(offsets)))]))[0][:, rank:]
    W = np.vstack([rows] + [mean + o * spread * normals[:, j] for j, o in enumerate(offsets)])
    if zero_sum:
        W = W - W.mean(0)
    return W, n, normals


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("zero_sum", [False, True])
def test_rows_just_off_a_flat_hull_are_argmaxable(seed, zero_sum):
    W, n, normals = _flat_head(seed, zero_sum)
    planted = list(range(n, W.shape[0]))
    report = auditor.audit(W, None, progress=False, tokens=planted)
    for j, k in enumerate(planted):
        # the oracle: its own normal is a witness, its lead checked in rational arithmetic
        assert _leads_exactly(W, None, k, normals[:, j], _tau(W, k) * 1.25)
        assert report.tokens[k].verdict == "argmaxable", (k, report.tokens[k].bounds)
    assert auditor.verify(report, W, None).ok


def _distance_to_the_others(W: np.ndarray, k: int) -> float:
    """|w_k - p| for p the float64 NNLS's nearest point of the other rows' hull: convex weights, so an upper
    bound of the distance up to the rounding of its sums (about 1e-16 of the rows)."""
    others = np.delete(np.arange(W.shape[0]), k)
    system = np.vstack([(W[others] - W[k]).T, np.ones((1, others.size))])
    beta = scipy.optimize.nnls(system, np.append(np.zeros(W.shape[1]), 1.0), maxiter=50 * others.size)[0]
    return float(np.linalg.norm(W[k] - (beta / beta.sum()) @ W[others]))


def test_one_large_entry_a_row_with_tiny_noise_leaves_no_token_open():
    """Rows of one entry in [1, 2] on a random axis plus 2^-30 noise, forced through the int8 pass: the middle
    rows of each axis lie 1e-9 of the rows (about ten tolerances) off the segment of its ends."""
    rng = np.random.default_rng(0)
    n, d = 330, 64
    W = np.zeros((n, d))
    W[np.arange(n), rng.integers(0, d, n)] = rng.uniform(1, 2, n)
    W += rng.standard_normal((n, d)) * 2.0 ** -30
    report = auditor.audit(W, None, progress=False, int8_entries=0, bfloat16_entries=0, whitened_entries=0)
    assert report.counts["inconclusive"] == 0
    assert auditor.verify(report, W, None).ok
    # the argmaxable verdicts rest on their witnesses, which verify re-checked; a token that convex weights put
    # within half a tolerance of the others' hull must not be one of them
    for k in [t.id for t in report.tokens if t.stage not in ("screen",)][:40]:
        if _distance_to_the_others(W, k) < 0.5 * _tau(W, k):
            assert report.tokens[k].verdict == "unargmaxable", k


@pytest.mark.parametrize("c,expected", [(1 - 1e-3, "unargmaxable"), (1.0, "inconclusive"), (1 + 1e-3, "argmaxable")])
def test_a_row_exactly_at_the_threshold_is_the_one_left_inconclusive(c, expected):
    """A row c tau_k beyond a facet (axis-aligned, so that its distance is c tau_k to rounding): at c = 1 neither
    certificate exists (convex weights need a residual a hair below tau_k, a witness a lead above tau_k ||z||),
    which docs/method.md names as where inconclusive remains; a thousandth either side is decided."""
    rng = np.random.default_rng(11)
    d = 5
    W, _, _ = _planted_head(rng, d, 30, bias=False, degenerate=False)
    n_facet = 2 * (d - 1)
    beta = _facet_weights(rng, n_facet, symmetric=False)
    q = sum(float(w) * W[i] for i, w in enumerate(beta))
    row = q.copy()
    for _ in range(3):  # the tolerance depends on the row's own distance from the median: settle it
        row[0] = c * _tau(np.vstack([W, row]), W.shape[0])
    W = np.vstack([W, row])
    k = W.shape[0] - 1
    tau = _tau(W, k)
    assert abs(W[k, 0] / tau - c) < 1e-12
    report = auditor.audit(W, None, progress=False)
    assert report.tokens[k].verdict == expected, report.tokens[k].bounds
    assert report.counts["inconclusive"] == (1 if expected == "inconclusive" else 0)
    if expected == "inconclusive":
        low, high = report.tokens[k].bounds  # per unit ||z||: the margin tau_k sits between them
        assert low <= tau <= high
    assert auditor.verify(report, W, None).ok


def test_the_best_scale_along_a_direction_is_the_kink_itself_not_brents_estimate():
    """Two lines crossing at s* = 1 + 2^-40 with slopes +-2^20: Brent's search stops about sqrt(eps) s* away, which
    would lose 2^20 * 1e-8 of the lead; the walk to the kink loses none (the lead there is exactly 2^-20)."""
    from auditor.engine.exact.lp import best_scale

    s_star = 1 + 2.0 ** -40
    slopes = np.array([2.0 ** 20, -(2.0 ** 20)])
    intercepts = np.array([2.0 ** -20 - 2.0 ** 20 * s_star, 2.0 ** -20 + 2.0 ** 20 * s_star])
    s = best_scale(slopes, intercepts, float("inf"))
    assert np.min(s * slopes + intercepts) >= 2.0 ** -20 * (1 - 1e-6)
    # a falling lowest line with no crossing to its left: the best is the range's start
    assert best_scale(np.array([-1.0, -2.0]), np.array([1.0, 3.0]), 4.0) == 0.0
