"""Low-rank heads with crowded boundaries, where unargmaxable tokens occur in released classifiers: every
verdict against Qhull (no bias, small width) or the plain LP over all rows, nothing inconclusive, every
certificate verified; and the real PP-OCRv3 recogniser's head (fixtures/NOTICE.md)."""

from pathlib import Path

import numpy as np
import pytest
import scipy.optimize
import scipy.spatial
from safetensors.numpy import load_file

import auditor

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def crowded_head(n: int, d: int, bias: bool, seed: int):
    """n points on an ellipsoid, a tenth pulled in by 1 - eps (eps log-uniform in [1e-4, 1e-1]), float32."""
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((n, d))
    W /= np.linalg.norm(W, axis=1, keepdims=True)
    W *= np.linspace(1.0, 3.0, d)
    inside = rng.choice(n, n // 10, replace=False)
    W[inside] *= 1.0 - 10.0 ** rng.uniform(-4, -1, inside.size)[:, None]
    b = (0.1 * rng.standard_normal(n)).astype(np.float32) if bias else None
    return W.astype(np.float32), b


def plain_lp(W: np.ndarray, b: np.ndarray | None, k: int) -> str | None:
    """The plain LP of issue 30 in float64: max sum alpha_i b_i s.t. sum alpha_i (w_i, 1) = (w_k, 1), alpha >= 0
    over the other rows. None within 1e-9 of the threshold (the tolerance band)."""
    W, others = W.astype(np.float64), np.delete(np.arange(W.shape[0]), k)
    cost = np.zeros(others.size) if b is None else -b.astype(np.float64)[others]
    for method in ("highs", "highs-ipm"):  # HiGHS's simplex now and then ends with an unknown status
        result = scipy.optimize.linprog(cost, A_eq=np.vstack([W[others].T, np.ones(others.size)]),
                                        b_eq=np.append(W[k], 1.0), bounds=(0, None), method=method)
        if result.status in (0, 2):
            break
    if result.status == 2:
        return "argmaxable"
    assert result.status == 0, result.message
    if b is None:
        return "unargmaxable"
    gap = -result.fun - float(b[k])
    return None if abs(gap) <= 1e-9 else ("unargmaxable" if gap > 0 else "argmaxable")


def compared_with_plain_lp(report, W, b) -> int:
    """Assert every token's verdict equals the plain LP's outside its band; return how many were compared."""
    compared = 0
    for k in range(W.shape[0]):
        expected = plain_lp(W, b, k)
        if expected is not None:
            assert report.tokens[k].verdict == expected, k
            compared += 1
    return compared


# Two to four dimensions in the quick tier; five and six (the same exact-LP route) in the slow one.
@pytest.mark.parametrize("d,seed", [(2, 0), (3, 1), (4, 2), pytest.param(5, 3, marks=pytest.mark.slow),
                                    pytest.param(6, 4, marks=pytest.mark.slow)])
def test_crowded_heads_without_bias_match_qhull_on_every_token(d, seed):
    W, _ = crowded_head(400, d, False, seed)
    report = auditor.audit(W, progress=False)
    vertices = set(scipy.spatial.ConvexHull(W.astype(np.float64)).vertices.tolist())
    assert report.counts["inconclusive"] == 0
    assert set(report.ids("argmaxable")) == vertices
    assert set(report.ids("unargmaxable")) == set(range(400)) - vertices
    assert auditor.verify(report, W).ok


@pytest.mark.parametrize("d,seed", [(3, 5), (8, 6), (16, 7)])
def test_crowded_heads_with_a_bias_match_the_plain_lp_on_every_token(d, seed):
    W, b = crowded_head(300, d, True, seed)
    report = auditor.audit(W, b, progress=False)
    assert report.counts["inconclusive"] == 0
    assert compared_with_plain_lp(report, W, b) >= 290
    assert auditor.verify(report, W, b).ok


def test_the_exact_stage_alone_matches_the_plain_lp_on_a_crowded_biased_head():
    """Every token past the screen goes straight to the LP stage (no minimum-norm rounds, Frank-Wolfe or Newton), whose
    constraint generation then falls back to all rows: same verdicts as the plain LP, nothing inconclusive."""
    W, b = crowded_head(250, 12, True, 8)
    report = auditor.audit(W, b, progress=False, frank_wolfe_iterations=0, newton_iterations=0, lp_rounds=2,
                           min_norm_rounds=0)
    assert report.counts["inconclusive"] == 0
    assert {t.stage for t in report.tokens} <= {"screen", "interior", "lp"}
    compared_with_plain_lp(report, W, b)
    assert auditor.verify(report, W, b).ok


@pytest.mark.slow
def test_the_ppocrv3_recogniser_head_is_decided_in_full():
    """The CTC head of a real OCR model (6625 characters x 64, with a bias): nothing inconclusive, every
    certificate verified, and the verdicts of 40 boundary tokens (past the screen) and 20 others equal
    the plain LP's."""
    tensors = load_file(str(FIXTURES / "ppocrv3_rec_head.safetensors"))
    W, b = tensors["linear_21.w_0"], tensors["linear_21.b_0"]
    report = auditor.audit(W, b, progress=False)
    assert report.counts["inconclusive"] == 0
    assert report.counts["argmaxable"] + report.counts["unargmaxable"] == 6625
    assert auditor.verify(report, W, b).ok
    rng = np.random.default_rng(0)
    boundary = np.array([t.id for t in report.tokens if t.stage not in ("screen",)])
    others = np.setdiff1d(np.arange(6625), boundary)
    sample = np.concatenate([rng.choice(boundary, 40, replace=False), rng.choice(others, 20, replace=False)])
    compared = 0
    for k in sample.tolist():
        expected = plain_lp(W, b, k)
        if expected is not None:
            assert report.tokens[k].verdict == expected, k
            compared += 1
    assert compared >= 55
