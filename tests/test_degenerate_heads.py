"""Degenerate heads are decided, not crashed: identical rows with a bias, one or two rows, one dimension.

Oracles: for identical rows, the hand argument (logit differences are the bias differences
for every z, so the unique top bias wins and no other row ever does); otherwise a plain LP
over all rows (HiGHS) for the unbounded domain and boxes, and a cone program over all rows
(Clarabel) for balls and the norm domain, which is a ball of radius sqrt(d) for the head
seen from the normalised vector (rows g * w_i, projected off the all-ones vector for a
LayerNorm, with bias W beta + b).
"""

import numpy as np
import pytest

import auditor
from oracles import ball_margin, lp_margin

DOMAINS = ["unbounded", "ball:0.5", "box:2", "norm-layernorm", "norm-rmsnorm"]
CLEAR = 1e-6  # a positive oracle margin below this is not used to judge a verdict
SOLVER_ZERO = 1e-9  # oracle margins up to this are zero up to the solvers' tolerances: no strict win


def _final_norm(kind: str, d: int, rng) -> auditor.FinalNorm:
    gain = rng.uniform(0.5, 1.5, d)
    shift = 0.3 * rng.standard_normal(d) if kind == "layernorm" else None
    return auditor.FinalNorm(kind, weight=gain, bias=shift, eps=1e-5)


def _audit(W, b, domain: str, rng):
    if domain.startswith("norm-"):
        norm = _final_norm(domain.split("-")[1], W.shape[1], rng)
        report = auditor.audit(W, b, domain="norm", final_norm=norm, progress=False)
        return report, norm
    return auditor.audit(W, b, domain=domain, progress=False), None


def _verified(report, W, b, norm) -> bool:
    return auditor.verify(report, W, b, final_norm=norm).ok


# -- identical rows ------------------------------------------------------------------------------


def _identical_rows(kind: str, n: int, d: int, rng) -> np.ndarray:
    if kind == "zeros":
        return np.zeros((n, d))
    if kind == "ones":
        return np.ones((n, d))
    return np.repeat(rng.standard_normal((1, d)), n, axis=0)


@pytest.mark.parametrize("domain", DOMAINS)
@pytest.mark.parametrize("kind", ["zeros", "ones", "repeated"])
@pytest.mark.parametrize("n,d", [(2, 1), (3, 1), (2, 2), (4, 3), (6, 6)])
def test_identical_rows_with_a_bias_the_top_bias_alone_wins(domain, kind, n, d):
    rng = np.random.default_rng(1000 * n + 10 * d + len(kind))
    W = _identical_rows(kind, n, d, rng)
    b = rng.permutation(n).astype(np.float64) + 0.25 * rng.uniform(size=n)  # distinct entries
    report, norm = _audit(W, b, domain, rng)
    top = int(np.argmax(b))
    assert report.ids("argmaxable") == [top]
    assert report.ids("unargmaxable") == sorted(set(range(n)) - {top})
    for k in report.ids("unargmaxable"):  # the top row alone proves it: its logit leads k's by b_top - b_k everywhere
        token = report.tokens[k]
        assert token.bias_gap < 0
    assert _verified(report, W, b, norm)


@pytest.mark.parametrize("domain", DOMAINS)
@pytest.mark.parametrize("n,d", [(2, 1), (3, 2), (5, 3)])
def test_identical_rows_tied_at_the_top_bias_form_a_group_that_wins(domain, n, d):
    rng = np.random.default_rng(7 * n + d)
    W = _identical_rows("repeated", n, d, rng)
    b = -np.arange(n, dtype=np.float64)
    b[1] = b[0]  # rows 0 and 1 are the same (w, b): tied, and together they lead every other row
    report, norm = _audit(W, b, domain, rng)
    assert report.ids("tied") == [0, 1]
    for k in (0, 1):
        assert report.tokens[k].group_verdict == "argmaxable"
        assert report.tokens[k].tied_with == [1 - k]
    assert report.ids("argmaxable") == []
    assert report.ids("unargmaxable") == list(range(2, n))
    assert _verified(report, W, b, norm)


@pytest.mark.parametrize("domain", DOMAINS)
def test_identical_rows_without_a_bias_are_one_tied_group_that_wins(domain):
    rng = np.random.default_rng(3)
    W = _identical_rows("repeated", 4, 3, rng)
    report, norm = _audit(W, None, domain, rng)
    assert report.ids("tied") == [0, 1, 2, 3]
    assert {report.tokens[k].group_verdict for k in range(4)} == {"argmaxable"}
    assert _verified(report, W, None, norm)


# -- one row, two rows, one dimension -------------------------------------------------------------


def _oracle_argmaxable(W, b, domain: str, norm) -> set[int] | None:
    """Tokens that can win, from a program over all rows; None when a margin is too near zero to judge."""
    n, d = W.shape
    if n == 1:
        return {0}
    if domain.startswith("norm-"):
        # the norm's outputs are {g u + beta : ||u|| < sqrt(d)}, u orthogonal to the ones for a LayerNorm
        rows = W * norm.weight
        if norm.kind == "layernorm":
            rows = rows - rows.mean(axis=1, keepdims=True)
        bias = (np.zeros(n) if b is None else b) + (W @ norm.bias if norm.bias is not None else 0.0)
        margins = [_ball_or_point(rows, bias, k, np.sqrt(d)) for k in range(n)]
    elif domain.startswith("ball:"):
        margins = [ball_margin(W, b, k, float(domain.split(":")[1])) for k in range(n)]
    else:
        margins = [lp_margin(W, b, k, domain)[0] for k in range(n)]
    # A margin of exactly 0 is no strict win (z = 0 ties every row in the homogenised program)
    if any(SOLVER_ZERO < m <= CLEAR for m in margins):
        return None
    return {k for k, m in enumerate(margins) if m > CLEAR}


def _ball_or_point(rows, bias, k, radius):
    """The margin over the ball; rows that are all zero (a LayerNorm in one dimension) leave the bias alone."""
    if not np.any(rows):
        return float(bias[k] - np.max(np.delete(bias, k)))
    return ball_margin(rows, bias, k, radius)


SMALL = [(1, 1, False), (1, 1, True), (1, 3, True), (2, 1, False), (2, 1, True), (2, 2, False), (2, 2, True),
         (2, 5, True), (3, 1, False), (3, 1, True), (5, 1, True)]


@pytest.mark.parametrize("domain", DOMAINS)
@pytest.mark.parametrize("n,d,with_bias", SMALL)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_small_heads_match_a_program_over_all_rows(domain, n, d, with_bias, seed):
    rng = np.random.default_rng(100 * seed + 10 * n + d)
    W = rng.standard_normal((n, d))
    b = rng.standard_normal(n) if with_bias else None
    report, norm = _audit(W, b, domain, rng)
    assert report.counts["inconclusive"] == 0
    assert report.counts["tied"] == 0
    expected = _oracle_argmaxable(W, b, domain, norm)
    if expected is not None:
        assert set(report.ids("argmaxable")) == expected
        assert set(report.ids("unargmaxable")) == set(range(n)) - expected
    assert _verified(report, W, b, norm)
