"""The maximum-entropy weights that move a head's centre onto a pool of its rows (caratheodory.py): found
for pools the size the engine draws (3D rows), where the last steps' decrease of the objective is below its
own rounding, and reproducing the target to the accuracy the reductions rely on."""

import numpy as np
import pytest

from auditor.engine.exact.pools import maximum_entropy_weights


@pytest.mark.parametrize("d, seed", [(128, 0), (384, 1)])
def test_the_centre_of_a_head_is_reached_from_a_pool_of_3d_of_its_rows(d, seed):
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((40 * d, d)) * np.exp(0.1 * rng.standard_normal(40 * d))[:, None]
    rows = rows.astype(np.float32).astype(np.float64)
    target = rows.mean(axis=0)
    pool = rows[np.sort(rng.choice(len(rows), size=3 * (d + 1), replace=False))]
    pi = maximum_entropy_weights(pool, target)
    assert pi is not None
    assert np.all(pi > 0) and abs(pi.sum() - 1) <= 1e-12
    scale = np.abs(pool - target).max()
    assert np.abs(pi @ pool - target).max() <= 1e-12 * scale


def test_the_centre_pool_of_the_real_minilm_head_with_mean_initialised_rows_is_found(vocabulary):
    """all-MiniLM-L6-v2's 30522 rows and 8 rows as transformers adds them, in the engine's normal form: the
    centre of the head is moved onto the engine's pool of 3D rows and reduced to a basis of D rows (the
    few-token route's start). There the last steps' decrease of F is below its rounding while the
    gradient is still 1e-11."""
    import torch
    from conftest import mean_initialised

    from auditor.question.domain import Unbounded
    from auditor.engine.exact.caratheodory import lifted_dimension
    from auditor.engine.exact.pools import centre_pool, spread_pool
    from auditor.engine.arithmetic.head import build_engine_head
    from auditor.engine.arithmetic.normal_form import normal_form
    from auditor.engine.screen.ties import duplicate_groups

    W = torch.from_numpy(np.vstack([vocabulary, mean_initialised(vocabulary, 8, np.random.default_rng(31))]))
    representative = duplicate_groups(W, None)
    form = normal_form(W, None, Unbounded(), torch.as_tensor(representative == np.arange(len(W))))
    head = build_engine_head(form.weight, None, representative, form.domain, 1e-10, form.row_error, None,
                             form.median, form.facts)
    found = centre_pool(head, spread_pool(head))
    assert found is not None
    pool, support = found
    assert support.size == lifted_dimension(head) and np.isin(support, pool.indices).all()


def test_a_target_outside_the_pools_hull_gets_none():
    rng = np.random.default_rng(2)
    pool = rng.standard_normal((60, 8))
    outside = pool.max(axis=0) + 1.0  # beyond every row in every coordinate
    assert maximum_entropy_weights(pool, outside) is None


def _origin_solves(head):
    """tilt.maximum_entropy for the origin to 1e-12, with the lone point's preconditioner and with the head's
    precision in its place: (the weights, the least residual, the reference weights)."""
    import torch

    from auditor.engine.solvers import tilt

    origin = torch.zeros(1, head.d, dtype=torch.float64)
    mask = torch.zeros(1, head.n, dtype=torch.float64)
    goal = torch.tensor([1e-12], dtype=torch.float64)
    pi, least, _ = tilt.maximum_entropy(head, origin, mask, goal, 40)
    real = tilt._heavy_preconditioner
    try:
        tilt._heavy_preconditioner = lambda head, pi, mean: head.precision
        reference, _, _ = tilt.maximum_entropy(head, origin, mask, goal, 40)
    finally:
        tilt._heavy_preconditioner = real
    return pi, least, reference


@pytest.mark.parametrize("offset", [0.0, 2.0])
def test_a_lone_point_s_solve_reaches_the_weights_of_the_head_s_preconditioner(rng, offset):
    """tilt.maximum_entropy for one point (the origin of anchor.py) on a head of many rows: its conjugate
    gradients are preconditioned by the Hessian of the heaviest rows (tilt._heavy_preconditioner); the
    weights are the unique maximum-entropy ones all the same, those of a solve preconditioned by the head's
    precision alone, and reproduce the point."""
    import torch

    from auditor.question.domain import Unbounded
    from auditor.engine.solvers import tilt
    from auditor.engine.arithmetic.head import build_engine_head
    from auditor.engine.screen.ties import duplicate_groups

    n, d = 4000, 24
    spectrum = np.arange(1, d + 1) ** -0.7
    W = rng.standard_normal((n, d)) * np.sqrt(spectrum)
    W[:, 0] += offset * np.sqrt(spectrum[0])
    W = torch.from_numpy(W)
    head = build_engine_head(W, None, duplicate_groups(W, None), Unbounded(), 1e-10)
    assert tilt._heavy_preconditioner(head, torch.full((n,), 1.0 / n, dtype=torch.float64),
                                      head.centre) is not head.precision  # the heavy rows' Hessian is used
    pi, least, reference = _origin_solves(head)
    assert float(least[0]) <= 1e-12
    assert torch.all(pi > 0)
    assert float((pi - reference).abs().max()) <= 1e-9 * float(reference.max())
    assert float(torch.linalg.vector_norm(pi[0] @ W)) <= 1e-12


@pytest.mark.parametrize("distance", [0.05, 0.3, 0.7])
def test_the_pool_s_shared_start_reaches_the_weights_of_fresh_hessians(distance, monkeypatch):
    """A start shared by a pool's targets (the Cholesky factor of its covariance, the Hessian at theta = 0 up to
    the offsets' scale) changes the path, not the answer: the maximum-entropy weights are unique, and both
    reproduce the target. Near the pool's centre (a mean-initialised row) no fresh Hessian is formed at all;
    further out fresh ones take over."""
    import torch

    from auditor.engine.exact.pools import pool_start

    rng = np.random.default_rng(7)
    d = 64
    pool = rng.standard_normal((2 * (d + 1), d)) * np.linspace(0.2, 2.0, d)
    direction = rng.standard_normal(d)
    target = pool.mean(axis=0) + distance * direction / np.linalg.norm(direction / np.linspace(0.2, 2.0, d))
    start = pool_start(pool)
    assert start is not None
    factorise, hessians = torch.linalg.cholesky_ex, []
    monkeypatch.setattr(torch.linalg, "cholesky_ex", lambda *a, **k: hessians.append(1) or factorise(*a, **k))
    shared = maximum_entropy_weights(pool, target, start=start)
    if distance <= 0.05:
        assert not hessians
    fresh = maximum_entropy_weights(pool, target)
    assert shared is not None and fresh is not None
    assert np.abs(shared - fresh).max() <= 1e-9 * fresh.max()
    scale = np.abs(pool - target).max()
    assert np.abs(shared @ pool - target).max() <= 1e-12 * scale
    assert maximum_entropy_weights(pool, pool.max(axis=0) + 1.0, start=start) is None  # outside: still None


def test_the_centre_s_weights_move_to_a_row_near_it_in_one_linear_solve():
    """pools.linear_weights: mu_i (1 + theta . (x_i - c)) with H theta = t - c, mu the centre's
    maximum-entropy weights on the pool and H their covariance, is a convex combination reproducing t (checked
    here as a certificate is: non-negative, summing to 1, the residual in float64), for points a short way from
    the centre; None for a point the first-order weights cannot reach (some weight negative), which the
    maximum-entropy weights still reach, and for a point outside the pool's hull."""
    from auditor.engine.exact.pools import linear_weights, pool_centre

    rng = np.random.default_rng(11)
    d = 64
    scales = np.linspace(0.2, 2.0, d)
    rows = rng.standard_normal((40 * d, d)) * scales
    centre = rows.mean(axis=0)
    pool = rows[np.sort(rng.choice(len(rows), size=2 * (d + 1), replace=False))]
    lifted = np.hstack([pool, np.ones((len(pool), 1))])
    shared = pool_centre(pool, centre)
    assert shared is not None
    mu = shared.weights.numpy()  # (a tensor on the pool's device)
    assert np.all(mu > 0)
    assert np.abs(mu @ pool - centre).max() <= 1e-12 * np.abs(pool - centre).max()
    hessian = (pool - centre).T @ ((pool - centre) * mu[:, None])
    for distance in (0.01, 0.05, 0.1):
        u = rng.standard_normal(d)
        target = centre + distance * np.linalg.cholesky(hessian) @ (u / np.linalg.norm(u))  # H-metric distance
        nu = linear_weights(lifted, shared, target)
        assert nu is not None and np.all(nu > 0) and abs(nu.sum() - 1) <= 1e-14
        assert np.abs(nu @ pool - target).max() <= 1e-13 * np.abs(pool - target).max()
        # the first-order weights, not the maximum-entropy ones: the two differ at second order
        exact = maximum_entropy_weights(pool, target)
        assert exact is not None and np.abs(nu - exact).max() > 1e-9 * exact.max()
    # Further out, along the pool row that leads most: the first-order weight of the row opposite turns negative
    # while the point is still inside the hull, where the maximum-entropy weights reach it
    lead = np.argmax(np.linalg.solve(hessian, (pool - centre).T).T @ (pool[0] - centre))
    far = centre + 0.6 * (pool[lead] - centre)
    assert linear_weights(lifted, shared, far) is None
    assert maximum_entropy_weights(pool, far) is not None
    assert linear_weights(lifted, shared, pool.max(axis=0) + 1.0) is None  # outside the hull


def test_the_centre_s_weights_start_the_solve_for_rows_beyond_their_first_order_reach(monkeypatch):
    """From the centre's maximum-entropy weights on a pool (the prior) and their covariance's factor (the start),
    the solve for a row near the centre takes chord steps with that factor: the same weights as the solve from
    uniform weights (they are unique, and the prior lies in their exponential family), reproducing the row,
    with fewer Hessians formed, where the first-order weights of linear_weights turn negative."""
    import torch

    from auditor.engine.exact.pools import linear_weights, pool_centre

    rng = np.random.default_rng(11)
    d = 256
    rows = rng.standard_normal((40 * d, d)) * np.linspace(0.2, 2.0, d)
    centre = rows.mean(axis=0)
    pool = rows[np.sort(rng.choice(len(rows), size=3 * (d + 1), replace=False))]
    lifted = np.hstack([pool, np.ones((len(pool), 1))])
    shared = pool_centre(pool, centre)
    assert shared is not None
    mu = shared.weights.numpy()
    covariance = (pool - centre).T @ ((pool - centre) * mu[:, None])
    factorise, hessians = torch.linalg.cholesky_ex, []
    monkeypatch.setattr(torch.linalg, "cholesky_ex", lambda *a, **k: hessians.append(1) or factorise(*a, **k))
    for distance in (0.6, 1.0):
        u = rng.standard_normal(d)
        target = centre + distance * np.linalg.cholesky(covariance) @ (u / np.linalg.norm(u))  # H-metric distance
        assert linear_weights(lifted, shared, target) is None
        hessians.clear()
        started = maximum_entropy_weights(pool, target, start=shared.factor, prior=np.log(mu), chord=0.7)
        from_centre = len(hessians)
        hessians.clear()
        fresh = maximum_entropy_weights(pool, target)
        assert started is not None and fresh is not None
        assert from_centre < len(hessians)
        assert np.abs(started - fresh).max() <= 1e-9 * fresh.max()
        assert np.all(started > 0) and abs(started.sum() - 1) <= 1e-12
        assert np.abs(started @ pool - target).max() <= 1e-12 * np.abs(pool - target).max()
    # a prior outside the family (weights that are not maximum-entropy ones) gives other positive weights, which
    # still reproduce the target: the prior is where the solve starts, not only its factor
    other = maximum_entropy_weights(pool, target, prior=np.log(rng.uniform(0.5, 1.5, len(pool))))
    assert other is not None and np.all(other > 0) and np.abs(other - fresh).max() > 1e-6 * fresh.max()
    assert np.abs(other @ pool - target).max() <= 1e-12 * np.abs(pool - target).max()
    outside = pool.max(axis=0) + 1.0
    assert maximum_entropy_weights(pool, outside, start=shared.factor, prior=np.log(mu), chord=0.7) is None


def test_a_lone_point_on_a_head_of_few_rows_is_preconditioned_by_the_hessian_itself(rng):
    """On a head of fewer than 8 D rows the lone point's preconditioner is formed on every row: the inverse of
    the Hessian sum_i pi_i (w_i - m)(w_i - m)^T (the head's covariance at a millionth of its weight added),
    and the solve reaches the same weights as one preconditioned by the head's precision."""
    import torch

    from auditor.question.domain import Unbounded
    from auditor.engine.solvers import tilt
    from auditor.engine.arithmetic.head import build_engine_head
    from auditor.engine.screen.ties import duplicate_groups

    n, d = 150, 24
    W = torch.from_numpy(rng.standard_normal((n, d)) + 0.05)  # the origin well inside the hull
    head = build_engine_head(W, None, duplicate_groups(W, None), Unbounded(), 1e-10)
    pi = torch.softmax(torch.from_numpy(rng.standard_normal(n)), dim=0)
    mean = pi @ W
    hessian = (W - mean).T @ ((W - mean) * pi[:, None]) + 1e-6 * head.covariance
    metric = tilt._heavy_preconditioner(head, pi, mean)
    assert float((metric @ hessian - torch.eye(d, dtype=torch.float64)).abs().max()) <= 1e-4
    found, least, reference = _origin_solves(head)
    assert float(least[0]) <= 1e-12
    assert float((found - reference).abs().max()) <= 1e-9 * float(reference.max())


def test_newton_stops_where_the_token_already_leads_and_its_theta_is_the_witness(rng, monkeypatch):
    """A row a little outside the hull of a cloud (argmaxable, and the oracle LP agrees): Newton's theta runs
    off and, once the row's own logit leads every rival's, the token stops there; that theta is the witness
    tilted_certificates reports, checked to win, after fewer steps than a run that goes on to the end."""
    import torch

    from auditor.question.domain import Unbounded
    from auditor.engine.solvers import tilt
    from auditor.engine.arithmetic.head import build_engine_head
    from auditor.engine.screen.ties import duplicate_groups
    from oracles import lp_margin, witness_wins

    n, d = 2000, 16
    spread = np.arange(1, d + 1) ** -0.3
    W = rng.standard_normal((n, d)) * spread
    direction = rng.standard_normal(d)
    W[-1] = W.mean(axis=0) + 3.0 * spread * direction / np.linalg.norm(direction)  # 3 deviations out
    assert lp_margin(W, None, n - 1)[0] > 0
    weight = torch.from_numpy(W)
    head = build_engine_head(weight, None, duplicate_groups(weight, None), Unbounded(), 1e-10)
    steps = []
    real = tilt._newton_steps
    monkeypatch.setattr(tilt, "_newton_steps", lambda *a: steps.append(1) or real(*a))
    witnesses = {}
    assert tilt.tilted_certificates(head, np.array([n - 1]), witnesses=witnesses) == {}
    z, margin, _ = witnesses[n - 1]
    assert margin > 0 and witness_wins(W, None, n - 1, z)
    early = len(steps)
    steps.clear()
    real_entropy = tilt.maximum_entropy
    monkeypatch.setattr(tilt, "maximum_entropy", lambda *a, own=None, **k: real_entropy(*a, **k))
    tilt.tilted_certificates(head, np.array([n - 1]), witnesses={})
    assert early < len(steps)
