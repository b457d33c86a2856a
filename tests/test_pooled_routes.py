"""Certificates on pools of rows drawn around a point: the tilted pools of the Newton stage and of the origin, and
the weighted pools that sparsify draws from a dense certificate. Verdicts against the plain LP over all rows,
certificates against the float64 residual of oracles.py, and a token's pool against the batch it came in."""

import numpy as np
import pytest
import torch

import auditor
import auditor.engine.settle as settle
import auditor.engine.stages as stages
from auditor.engine.arithmetic.head import build_engine_head
from auditor.engine.exact.pools import tilted_pools
from auditor.engine.screen.ties import duplicate_groups
from auditor.engine.solvers import anchor
from auditor.engine.solvers.tilt import pooled_certificates
from auditor.question.domain import Unbounded
from oracles import convex_residual, lp_margin

RADII = (0.3, 0.8, 1.4, 2.0)  # Mahalanobis distances of the planted rows from the rows' mean


def cloud_with_planted_rows(seed: int, n: int = 1500, d: int = 16, offset: float = 2.0):
    """Rows c + L g (covariance decaying like rank^-1, rotated, c ``offset`` standard deviations of the leading
    direction from the origin), the last rows planted at each of RADII from the rows' mean along random
    directions (three per radius), one exact copy of row 0 among them; float32. Returns W and the planted ids."""
    rng = np.random.default_rng(seed)
    spectrum = 1.0 / np.arange(1, d + 1)
    axes = np.linalg.qr(rng.standard_normal((d, d)))[0]
    mixing = (axes * np.sqrt(spectrum)).T
    planted = 3 * len(RADII)
    W = rng.standard_normal((n - planted - 1, d)) @ mixing + offset * np.sqrt(spectrum[0]) * axes[:, 0]
    mean = W.mean(axis=0)
    precision = np.linalg.inv(np.cov(W.T))
    rows = []
    for r in RADII:
        for _ in range(3):
            u = rng.standard_normal(d)
            rows.append(mean + r * u / np.sqrt(u @ precision @ u))
    W = np.vstack([W, W[:1], np.array(rows)]).astype(np.float32)
    return W, np.arange(n - planted, n)


def engine_head(W):
    W = torch.from_numpy(W)
    return build_engine_head(W, None, duplicate_groups(W, None), Unbounded(), 1e-10)


def lp_unargmaxable(W, k):
    return lp_margin(W.astype(np.float64), None, int(k))[0] <= 1e-9


def weighted_pools_taken(monkeypatch) -> list[int]:
    """The tokens whose dense certificates sparsify reduces through a weighted pool, filled as audits run."""
    taken = []
    original = settle._from_weighted_pool

    def recording(head, out, k, dim):
        done = original(head, out, k, dim)
        if done:
            taken.append(k)
        return done

    monkeypatch.setattr(settle, "_from_weighted_pool", recording)
    return taken


def test_tilted_pools_belong_to_the_token_alone_and_never_draw_its_row_or_a_copy(rng):
    W, planted = cloud_with_planted_rows(1)
    head = engine_head(W)
    copy = W.shape[0] - len(planted) - 1  # the copy of row 0: not a competitor
    together = tilted_pools(head, planted)
    for k, pool in zip(planted.tolist(), together):
        assert pool.size == 3 * (head.d + 1) and np.unique(pool).size == pool.size
        assert k not in pool and copy not in pool
        assert np.array_equal(tilted_pools(head, np.array([k]))[0], pool)  # the same pool alone
    # the draw leans towards the token: the pool's mean lies nearer its row than the head's centre does
    k, pool = int(planted[-1]), together[-1]
    centre = head.centre.numpy()
    assert np.linalg.norm(W[pool].mean(axis=0) - W[k]) < np.linalg.norm(centre - W[k])


def test_pooled_certificates_match_the_plain_lp_and_do_not_depend_on_the_batch():
    W, planted = cloud_with_planted_rows(2)
    head = engine_head(W)
    found = pooled_certificates(head, planted)
    # the rows at 0.3, 0.8 and 1.4 are found (well within sqrt(2 ln(n / D)) = 3.0, the stage's reach here)
    near = planted[: 3 * RADII.index(1.4) + 3]
    assert set(near.tolist()) <= set(found)
    for k, (indices, weights, residual, gap) in found.items():
        assert lp_unargmaxable(W, k)
        assert indices.size <= head.d + 1 and k not in indices and np.all(weights > 0)
        assert convex_residual(W, None, k, indices, weights)[0] <= 1e-12 * np.abs(W).max()
        alone = pooled_certificates(head, np.array([k]))[k]
        assert np.array_equal(alone[0], indices) and np.array_equal(alone[1], weights)


@pytest.mark.parametrize("seed", [3, 4])
def test_audit_with_the_pooled_stage_gives_the_plain_lp_verdicts(monkeypatch, seed):
    """The whole audit decides the planted rows, and the rows the pooled stage takes, as the plain LP does, with
    and without the pooled stage, which decides at least six planted rows before Frank-Wolfe sees them."""
    import auditor.engine.pipeline as pipeline

    monkeypatch.setattr(pipeline.corrective, "WIDTH", 8)  # as on a head of d > 256, where the rounds do not go first
    W, planted = cloud_with_planted_rows(seed)
    taken = []
    original = stages.pooled_stage

    def recording(head, out, left, threat):
        kept, kept_threat = original(head, out, left, threat)
        taken.extend(sorted(set(left.tolist()) - set(kept.tolist())))
        return kept, kept_threat

    monkeypatch.setattr(stages, "pooled_stage", recording)
    report = auditor.audit(W, progress=False)
    assert report.counts["inconclusive"] == 0
    assert len(set(taken) & set(planted.tolist())) >= 6
    for k in sorted(set(planted.tolist()) | set(taken)):  # (the cloud's own rows deep inside it take it too)
        expected = "unargmaxable" if lp_unargmaxable(W, k) else "argmaxable"
        assert report.tokens[k].verdict == expected
    assert auditor.verify(report, W).ok
    monkeypatch.setattr(stages, "pooled_stage", lambda head, out, left, threat: (left, threat))
    without = auditor.audit(W, progress=False)
    assert [t.verdict for t in without.tokens] == [t.verdict for t in report.tokens]


@pytest.mark.parametrize("seed", [7, 8])
def test_with_a_bias_the_pooled_certificates_hold_a_bias_gap_below_zero(monkeypatch, seed):
    """A bias 0.25 N(0, 1) on the rows: the pooled stage's certificates reproduce w_k with an average bias above
    b_k (a bias gap below zero in the float64 check and in the oracle's residual), their tokens are the plain LP's
    unargmaxable ones, and the whole audit's verdicts are the plain LP's with and without the stage."""
    import auditor.engine.pipeline as pipeline

    monkeypatch.setattr(pipeline.corrective, "WIDTH", 8)  # as on a head of d > 256, where the rounds do not go first
    W, planted = cloud_with_planted_rows(seed)
    b = (0.25 * np.random.default_rng(seed).standard_normal(W.shape[0])).astype(np.float32)
    rows, biases = torch.from_numpy(W), torch.from_numpy(b.astype(np.float64))  # the engine's biases are float64
    head = build_engine_head(rows, biases, duplicate_groups(rows, biases), Unbounded(), 1e-10)
    found = pooled_certificates(head, planted)
    assert len(found) >= 3
    for k, (indices, weights, residual, gap) in found.items():
        assert gap < 0 and indices.size <= head.d + 2 and k not in indices
        assert lp_margin(W.astype(np.float64), b.astype(np.float64), k)[0] <= 1e-9
        oracle_residual, oracle_gap = convex_residual(W, b, k, indices, weights)
        assert oracle_residual <= 1e-12 * np.abs(W).max() and oracle_gap < 0
    report = auditor.audit(W, b, progress=False)
    assert report.counts["inconclusive"] == 0
    for k in planted.tolist():
        unargmaxable = lp_margin(W.astype(np.float64), b.astype(np.float64), k)[0] <= 1e-9
        assert report.tokens[k].verdict == ("unargmaxable" if unargmaxable else "argmaxable")
    assert auditor.verify(report, W, b).ok
    monkeypatch.setattr(stages, "pooled_stage", lambda head, out, left, threat: (left, threat))
    without = auditor.audit(W, b, progress=False)
    assert [t.verdict for t in without.tokens] == [t.verdict for t in report.tokens]


def test_sparsify_draws_a_pool_from_a_dense_certificate_and_falls_back_to_the_full_reduction(monkeypatch):
    """With the pooled stage off and Frank-Wolfe held to two iterations, Newton's dense certificates of the planted rows reach sparsify: the weighted
    pools reduce them (no full reduction runs for them); where a pool's solve fails, the full reduction does,
    and the verdicts and the bound on the support are the same."""
    import auditor.engine.pipeline as pipeline

    monkeypatch.setattr(pipeline.corrective, "WIDTH", 8)  # Newton before the rounds, as on a head of d > 256
    W, planted = cloud_with_planted_rows(5)
    monkeypatch.setattr(stages, "pooled_stage", lambda head, out, left, threat: (left, threat))
    pooled, reduced = weighted_pools_taken(monkeypatch), []
    real_reduce = settle.reduce_supports

    def reduce_recording(head, certificates):
        reduced.extend(c[0].size for c in certificates)
        return real_reduce(head, certificates)

    monkeypatch.setattr(settle, "reduce_supports", reduce_recording)
    ids = planted.tolist()  # Newton's dense weights, not Frank-Wolfe's, for the planted rows:
    report = auditor.audit(W, tokens=ids, frank_wolfe_iterations=2, progress=False)
    assert len(pooled) >= 3 and not reduced
    d = W.shape[1]
    for k in planted.tolist():
        token = report.tokens[k]
        assert token.verdict == ("unargmaxable" if lp_unargmaxable(W, k) else "argmaxable")
    supports = {k: report._d.convex[k][0].size for k in planted.tolist() if k in report._d.convex}
    assert supports and max(supports.values()) <= d + 1
    assert auditor.verify(report, W).ok

    monkeypatch.setattr(settle, "pool_certificate", lambda *args, **kwargs: None)
    pooled.clear()
    fallback = auditor.audit(W, tokens=ids, frank_wolfe_iterations=2, progress=False)
    assert not pooled and len(reduced) >= 3
    assert [fallback.tokens[k].verdict for k in ids] == [report.tokens[k].verdict for k in ids]
    assert all(fallback._d.convex[k][0].size <= d + 1 for k in supports)
    assert auditor.verify(fallback, W).ok


def test_the_origin_takes_a_tilted_pool_where_the_rows_beyond_it_are_too_many(monkeypatch):
    """The origin one standard deviation from the centre: more than a quarter of the rows lead it along the first
    Newton step, so anchor._pooled declines; the tilted pool holds it, and the zero rows' certificates on it
    check without the whole head's solve."""
    W, _ = cloud_with_planted_rows(6, offset=1.0)
    W = np.vstack([W, np.zeros((2, W.shape[1]), dtype=np.float32)])
    zero = [W.shape[0] - 2, W.shape[0] - 1]
    calls = []
    monkeypatch.setattr(anchor, "_whole_head", lambda *args: calls.append(1))
    head = engine_head(W)
    assert anchor._pooled(head, anchor._given_origin(head)) is None
    assert anchor._tilted(head, anchor._given_origin(head)) is not None
    report = auditor.audit(W, progress=False)
    assert not calls
    assert lp_unargmaxable(W, zero[0])
    assert report.tokens[zero[0]].verdict == "tied" and report.tokens[zero[0]].group_verdict == "unargmaxable"
    assert auditor.verify(report, W).ok


def test_heads_too_wide_for_pools_take_the_whole_head_path(monkeypatch):
    """Where a pool's arrays would not fit (the budget lowered to nothing here), no pool is drawn: the pooled
    stage, the origin's tilted pool and sparsify's weighted pools step aside, and the verdicts are unchanged."""
    import auditor.engine.exact.pools as pools

    W, planted = cloud_with_planted_rows(9)
    ids = planted.tolist()
    with_pools = auditor.audit(W, tokens=ids, progress=False)
    monkeypatch.setattr(pools, "_POOL_BYTES", 0)
    head = engine_head(W)
    assert not pools.drawn_pools_fit(head) and tilted_pools(head, planted) == [None] * len(planted)
    assert pooled_certificates(head, planted) == {}
    without = auditor.audit(W, tokens=ids, progress=False)
    assert [without.tokens[k].verdict for k in ids] == [with_pools.tokens[k].verdict for k in ids]
    assert all(without._d.convex[k][0].size <= W.shape[1] + 1 for k in ids if k in without._d.convex)
    assert auditor.verify(without, W).ok


def test_biases_no_lean_can_move_skip_the_pools():
    """All biases one (a constant the normal form does not see here, as a derived head's may be) or a bias that is
    a linear function of the rows: no combination reproducing w_k has an average bias other than b_k's fit, so
    no pool is solved for a gap it cannot have."""
    W, planted = cloud_with_planted_rows(10)
    rows = torch.from_numpy(W)
    for biases in (torch.full((W.shape[0],), 0.5, dtype=torch.float64), rows.double() @ torch.linspace(-1, 1, W.shape[1]).double()):
        head = build_engine_head(rows, biases, duplicate_groups(rows, biases), Unbounded(), 1e-10)
        assert pooled_certificates(head, planted) == {}


def test_a_biased_dense_certificate_reduces_through_its_weighted_pool_with_a_gap_below_zero(monkeypatch):
    """With a bias, Newton's dense certificates (pooled stage off, Frank-Wolfe held to two iterations) reduce
    through pools drawn from their weights, aiming at b_k less half the dense gap: the reduced certificates keep a
    bias gap below zero, and the verdicts are the plain LP's."""
    import auditor.engine.pipeline as pipeline

    monkeypatch.setattr(pipeline.corrective, "WIDTH", 8)
    W, planted = cloud_with_planted_rows(11)
    b = (0.25 * np.random.default_rng(11).standard_normal(W.shape[0])).astype(np.float32)
    monkeypatch.setattr(stages, "pooled_stage", lambda head, out, left, threat: (left, threat))
    pooled = weighted_pools_taken(monkeypatch)
    ids = planted.tolist()
    report = auditor.audit(W, b, tokens=ids, frank_wolfe_iterations=2, progress=False)
    assert pooled
    for k in ids:
        unargmaxable = lp_margin(W.astype(np.float64), b.astype(np.float64), k)[0] <= 1e-9
        assert report.tokens[k].verdict == ("unargmaxable" if unargmaxable else "argmaxable")
    for k in pooled:
        indices, weights = report._d.convex[k][:2]
        assert indices.size <= W.shape[1] + 2 and convex_residual(W, b, k, indices, weights)[1] < 0
    assert auditor.verify(report, W, b).ok
