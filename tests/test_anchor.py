"""Rows on a ray through the origin (engine/solvers/anchor.py): a row swallowed by a longer copy of itself takes
the origin's certificate and the weight on the copy, on at most D rows, checked in float64 and against
an LP over all rows."""

import numpy as np
import pytest
import torch

import auditor
from auditor.engine.arithmetic.head import build_engine_head
from auditor.engine.screen.ties import duplicate_groups
from auditor.engine.solvers.anchor import anchored_certificates
from auditor.question.domain import Unbounded
from oracles import convex_residual, lp_margin
import auditor.engine.pipeline as pipeline


@pytest.fixture(autouse=True)
def _iterative_stages_in_few_dimensions(monkeypatch):
    """These heads are small enough that the exact LP (pipeline._DIRECT_LP_WIDTH) or the minimum-norm rounds
    (corrective.WIDTH) would go first, and the rounds take what they leave on wider heads (corrective.LEFTOVERS);
    the tests are of Frank-Wolfe, Newton and the exact LP, so every width takes them."""
    monkeypatch.setattr(pipeline, "_DIRECT_LP_WIDTH", 0)
    monkeypatch.setattr(pipeline.corrective, "WIDTH", 0)
    monkeypatch.setattr(pipeline.corrective, "LEFTOVERS", False)


def trained_like(rng, n, d, offset):
    """Rows with a decaying spectrum and a common offset ``offset`` standard deviations long on the first axis."""
    spectrum = np.arange(1, d + 1) ** -0.7
    rows = rng.standard_normal((n, d)) * np.sqrt(spectrum)
    rows[:, 0] += offset * np.sqrt(spectrum[0])
    return rows


def swallowed(rows, rng, count, origin=None):
    """Make ``count`` rows each the shorter copy of another, w_j - o = 1.01 (w_k - o) about the point o;
    returns the shorter rows' ids."""
    origin = np.zeros(rows.shape[1]) if origin is None else origin
    slots = rng.choice(rows.shape[0], size=2 * count, replace=False)
    for k, j in zip(slots[:count], slots[count:]):
        rows[j] = origin + 1.01 * (rows[k] - origin)
    return np.sort(slots[:count])


def engine_head(W):
    W = torch.from_numpy(W)
    return build_engine_head(W, None, duplicate_groups(W, None), Unbounded(), 1e-10)


def test_swallowed_rows_take_the_certificate_of_the_origin(rng):
    n, d = 3000, 12
    W = trained_like(rng, n, d, offset=2.0)
    planted = swallowed(W, rng, 5)
    head = engine_head(W)
    found = anchored_certificates(head, planted)
    assert set(found) == set(planted.tolist())
    for k, (indices, weights, residual, gap) in found.items():
        assert indices.size <= d + 1 and k not in indices and np.all(weights > 0)
        assert convex_residual(W, None, k, indices, weights)[0] <= 1e-12 * np.linalg.norm(W[k])
        assert lp_margin(W, None, k)[0] <= 1e-9  # the LP over all rows agrees: no z makes it win


def test_rows_at_the_origin_and_near_it_take_the_origin_s_certificate(rng):
    # Reserved rows as checkpoints leave them: at zero (a tied group, whose representative the route decides:
    # its ray from any rival reaches the origin at w_k itself), and near it off every ray, 1e-6 of the spread
    # away in a random direction; the LP over all rows is the oracle of both.
    n, d = 3000, 12
    W = trained_like(rng, n, d, offset=2.0)
    W[-3:-1] = 0.0
    W[-1] = 1e-6 * rng.standard_normal(d)
    head = engine_head(W)
    tokens = np.array([n - 3, n - 1])  # the zero group's representative (its lowest id) and the row near zero
    found = anchored_certificates(head, tokens)
    assert set(found) == set(tokens.tolist())
    for k, (indices, weights, _, _) in found.items():
        assert indices.size <= d + 1 and k not in indices and np.all(weights > 0)
        assert not np.isin(indices, [n - 3, n - 2]).any() or k == n - 1  # no copy of itself
        assert convex_residual(W, None, k, indices, weights)[0] <= 1e-12 * np.linalg.norm(W).max()
        assert lp_margin(W, None, k)[0] <= 1e-9
    report = auditor.audit(W, progress=False)
    assert [report.tokens[k].verdict for k in (n - 3, n - 2, n - 1)] == ["tied", "tied", "unargmaxable"]
    assert report.tokens[n - 3].group_verdict == "unargmaxable"
    assert auditor.verify(report, W).ok


def test_a_row_of_the_origin_s_basis_moves_its_own_weight_across_instead_of_pivoting(rng):
    # A swallowed row that is one of the rows the origin's certificate rests on: p's combination puts weight a
    # on w_k itself, and w_k = sum_i c_i w_i / (1 - a) needs no pivot to take w_k out of the basis. The longer
    # copy is appended; the first row of the origin's basis that stays in it with the copy there is the token.
    from auditor.engine.solvers import anchor

    n, d = 3000, 12
    W = trained_like(rng, n, d, offset=2.0)
    first = anchor._Origin(engine_head(W), 40).basis
    tried = 0
    for k in first.pool[first.start].tolist():
        longer = np.vstack([W, 1.01 * W[k]])
        head = engine_head(longer)
        basis = anchor._Origin(head, 40).basis
        if k not in basis.pool[basis.start]:
            continue
        tried += 1
        p = longer[n] + (1.01 / 0.01) * (longer[k] - longer[n])
        if basis.certificate(k, np.append(p, 1.0), max_pivots=0) is not None:
            continue  # its weight in p's combination happens to be 0: nothing to move
        found = anchored_certificates(head, np.array([k]))
        indices, weights, _, _ = found[k]
        assert k not in indices and indices.size <= d + 1 and np.all(weights > 0)
        assert convex_residual(longer, None, k, indices, weights)[0] <= 1e-11 * np.linalg.norm(longer[k])
        assert lp_margin(longer, None, k)[0] <= 1e-9
        break
    else:
        pytest.fail(f"no row of the origin's basis stayed in it ({tried} tried)")


def test_the_route_leaves_rows_whose_ray_misses_the_origin(rng):
    n, d = 500, 8  # the row inside goes on to Frank-Wolfe at any size
    W = trained_like(rng, n, d, offset=1.0)
    inside = np.array([n - 1])
    W[-1] = 0.5 * W[3] + 0.5 * W[7]  # inside the hull, but its rays from rivals miss the origin
    head = engine_head(W)
    assert anchored_certificates(head, inside) == {}
    report = auditor.audit(W, progress=False)
    assert report.tokens[n - 1].verdict == "unargmaxable"


def test_an_origin_outside_the_hull_leaves_the_tokens_to_the_newton_stage(rng):
    # 600 rows: the planted rows are of both kinds (the oracle's margins 0, > 0.008, > 0.067), and the
    # Newton stage decides some of them
    n, d = 600, 8
    W = trained_like(rng, n, d, offset=12.0)  # every row far on one side of the origin
    planted = swallowed(W, rng, 3)
    head = engine_head(W)
    assert anchored_certificates(head, planted) == {}  # the origin has no certificate: nothing guessed
    report = auditor.audit(W, progress=False)
    expected = {k: lp_margin(W, None, k)[0] <= 1e-9 for k in planted.tolist()}
    assert set(expected.values()) == {True, False}  # a shorter copy may still win when the origin is outside
    for k in planted.tolist():  # the oracle decides; the audit agrees
        assert (report.tokens[k].verdict == "unargmaxable") == expected[k]


def test_the_origin_is_the_one_the_rows_were_given_in(rng):
    # The normal form translates a head whose rows sit far from the origin; the route's origin is then
    # the given one, in the head's own coordinates (head.origin).
    n, d = 3000, 10
    W = trained_like(rng, n, d, offset=2.0)
    planted = swallowed(W, rng, 4)
    shift = np.full(d, 3.0)
    head = engine_head(W + shift)
    head.origin = torch.from_numpy(shift)  # what the pipeline sets for a translated head
    found = anchored_certificates(head, planted)
    assert set(found) == set(planted.tolist())
    for k, (indices, weights, _, _) in found.items():
        assert convex_residual(W + shift, None, k, indices, weights)[0] <= 1e-11 * np.linalg.norm(W[k] + shift)


@pytest.mark.parametrize("offset", [0.0, 2.0])
def test_audits_of_swallowed_rows_match_the_lp(rng, offset):
    n, d = 600, 10  # the planted rows take the route at any size
    W = trained_like(rng, n, d, offset)
    planted = swallowed(W, rng, 4)
    report = auditor.audit(W.astype(np.float32), progress=False)
    W32 = W.astype(np.float32).astype(np.float64)
    for k in planted.tolist():
        token = report.tokens[k]
        assert token.verdict == "unargmaxable" and token.convex_indices.size <= d + 1
        assert lp_margin(W32, None, k)[0] <= 1e-9
    assert auditor.verify(report, W.astype(np.float32)).ok


def test_swallowed_rows_are_settled_before_frank_wolfe_and_the_rest_still_reach_it(rng, monkeypatch):
    from auditor.engine import stages

    seen = []
    original = stages.frank_wolfe
    monkeypatch.setattr(stages, "frank_wolfe", lambda head, ids, *rest: seen.extend(ids.tolist())
                        or original(head, ids, *rest))
    W = trained_like(rng, 600, 10, 0.0)
    planted = swallowed(W, rng, 4)
    W[7] = 0.98 * W[8] + 0.02 * W[9]  # inside the hull near its boundary, on no ray through the origin
    # With this row (at 2500 rows, when the origin's route was added) the origin's Newton solve reached a
    # point where F is flat to float64 three times short of its goal: steps are then judged by the residual
    # they leave. 600 rows keep every assertion below (the 2500 rows no longer reach that flat point either).
    from auditor.engine.solvers.anchor import _Origin
    assert _Origin(engine_head(W.astype(np.float32)), 40).basis is not None
    report = auditor.audit(W.astype(np.float32), progress=False)
    assert all(report.tokens[k].verdict == "unargmaxable" and report.tokens[k].stage == "newton"
               for k in planted.tolist())
    assert not set(seen) & set(planted.tolist())  # Frank-Wolfe never ran on them
    assert 7 in seen and report.tokens[7].verdict == "unargmaxable"  # the others still take Frank-Wolfe
    assert auditor.verify(report, W.astype(np.float32)).ok


def test_a_translated_head_takes_the_route_through_the_origin_it_was_given_in(rng, monkeypatch):
    # A tight cloud far from the origin (the normal form translates it) and a few rows around the origin
    # keep the origin inside the hull; rows swallowed towards the given origin are settled by the route
    # alone: Frank-Wolfe and the per-token Newton solves are switched off.
    from auditor.engine import stages

    n, d = 250, 6  # the cloud's rows all go to the exact LP: its cost grows with n
    far = 1000.0 * np.eye(d)[0] + trained_like(rng, n, d, offset=0.0)
    around = 3000.0 * np.vstack([np.eye(d), -np.eye(d)])
    W = np.vstack([far, around])
    planted = swallowed(W[:n], rng, 3)
    monkeypatch.setattr(stages, "tilted_certificates", lambda *args, **kwargs: {})
    report = auditor.audit(W, progress=False, frank_wolfe_iterations=0)
    for k in planted.tolist():
        token = report.tokens[k]
        assert token.verdict == "unargmaxable" and token.stage == "newton" and token.convex_indices.size <= d + 1
    assert auditor.verify(report, W).ok


def test_the_origin_s_weights_come_from_the_rows_leading_towards_it(rng):
    # Off the centre the origin's weights are found on the rows that lead along the first Newton step
    # (anchor._pooled: 2D or more, few of the head's): its certificate rests on those rows alone, and the
    # tokens' certificates built on it agree with the LP over all rows.
    from auditor.engine.solvers import anchor

    n, d = 3000, 12
    W = trained_like(rng, n, d, offset=2.0)
    planted = swallowed(W, rng, 4)
    W[-1] = 0.0  # a reserved row at the origin
    head = engine_head(W)
    pooled = anchor._pooled(head, anchor._given_origin(head))
    assert pooled is not None
    chosen, weights = pooled
    assert 2 * (d + 1) <= chosen.size <= n // 4 and np.all(weights > 0) and abs(weights.sum() - 1) <= 1e-12
    assert np.abs(weights @ W[chosen]).max() <= 1e-12 * np.abs(W).max()  # the origin, in float64
    basis = anchor._Origin(head, 40).basis
    assert set(basis.pool.tolist()) <= set(chosen.tolist())
    found = anchored_certificates(head, np.append(planted, n - 1))
    assert set(found) == set(planted.tolist()) | {n - 1}
    for k, (indices, weights, _, _) in found.items():
        assert indices.size <= d + 1 and k not in indices
        assert convex_residual(W, None, k, indices, weights)[0] <= 1e-11 * max(np.linalg.norm(W[k]), 1.0)
        assert lp_margin(W, None, k)[0] <= 1e-9


@pytest.mark.parametrize("n, d, offset, pool_tried", [(3000, 12, 2.6, True), (2000, 8, 3.0, False)])
def test_an_origin_the_leading_rows_do_not_hold_takes_the_whole_head_s_solve(n, d, offset, pool_tried, monkeypatch):
    # 2.6 standard deviations off the centre a few rows lie beyond the origin along the first Newton step (at
    # least D / 2, so the pool is tried): the 2D rows that lead towards it do not surround it and their
    # maximum-entropy solve fails (None). At 3 standard deviations fewer than D / 2 lie beyond: no pool is tried
    # (its solve would miss at the cost of its Hessians). Either way the whole head's Newton solve finds the
    # origin's certificate, on which a row at the origin is decided as the LP over all rows decides it.
    from auditor.engine.solvers import anchor

    W = trained_like(np.random.default_rng(0), n, d, offset=offset)
    W[-1] = 0.0
    head = engine_head(W)
    tried = []
    solve = anchor.maximum_entropy_weights
    monkeypatch.setattr(anchor, "maximum_entropy_weights", lambda *a, **k: tried.append(solve(*a, **k)) or tried[-1])
    assert anchor._pooled(head, anchor._given_origin(head)) is None
    assert tried == ([None] if pool_tried else [])  # the pool's solve ran and missed, or never ran
    assert anchor._Origin(head, 40).basis is not None
    found = anchored_certificates(head, np.array([n - 1]))
    indices, weights, _, _ = found[n - 1]
    assert n - 1 not in indices and indices.size <= d + 1
    assert convex_residual(W, None, n - 1, indices, weights)[0] <= 1e-12
    assert lp_margin(W, None, n - 1)[0] <= 1e-9


def test_rows_at_the_origin_stay_out_of_its_solve_which_stops_once_a_theta_separates_it(rng, monkeypatch):
    # Reserved rows at zero with every other row on one side of the origin: the origin is a row, a vertex of
    # the hull, so weights that rest on that row alone reproduce it and certify nothing. Without the rows at
    # the origin a theta soon puts the origin's logit above every row's: the solve stops there (a handful of
    # Newton steps in place of the iteration limit) and the route finds no basis; the zero rows are decided
    # as the LP over all rows decides them (a group that can win together).
    from auditor.engine.solvers import anchor, tilt

    n, d = 600, 8
    W = trained_like(rng, n, d, offset=4.0)
    W[-3:] = 0.0
    assert lp_margin(W[:-2], None, n - 3)[0] > 1e-3  # the zero row's group wins along some z
    head = engine_head(W)
    steps = []
    newton = tilt._newton_steps
    monkeypatch.setattr(tilt, "_newton_steps", lambda *a: steps.append(1) or newton(*a))
    assert anchor._whole_head(head, anchor._given_origin(head), 40, torch.from_numpy(np.arange(n) >= n - 3)) is None
    assert 1 <= len(steps) <= 10
    assert anchor._Origin(head, 40).basis is None
    assert anchored_certificates(head, np.array([n - 3])) == {}
    report = auditor.audit(W, progress=False)
    assert [report.tokens[k].verdict for k in range(n - 3, n)] == ["tied"] * 3
    assert report.tokens[n - 3].group_verdict == "argmaxable"
    assert auditor.verify(report, W).ok
