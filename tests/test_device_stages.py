"""The stages after the screen where the head lies: their arrays are tensors on the head's device, and the paths
a GPU takes (batched eliminations with no step waiting on the host, the pool's solves on device tensors) run
here on the CPU, forced, against the same oracles as the host's paths: the plain LP over all rows, exact
residuals of the certificates, and auditor.verify."""

import numpy as np
import pytest
import torch
from conftest import rows_off_the_centre
from oracles import lp_margin

import auditor
from auditor.engine.exact import elimination


def _cloud(rng, m, d, scales=None):
    rows = rng.standard_normal((m, d)) * (scales if scales is not None else 1.0)
    return rows


def test_null_vectors_of_a_tensor_are_those_of_its_array(rng):
    """null_vectors on a tensor (the device's path) and on the numpy array (the host's): the same vectors, of
    the input's kind, and each a null vector of the points."""
    points = np.hstack([rng.standard_normal((70, 20)), np.ones((70, 1))])
    on_host = elimination.null_vectors(points)
    on_device = elimination.null_vectors(torch.from_numpy(points))
    assert isinstance(on_host, np.ndarray) and isinstance(on_device, torch.Tensor)
    assert on_device.shape == (49, 70)
    assert np.array_equal(on_device.numpy(), on_host)
    assert np.abs(on_host @ points).max() <= 1e-12 * np.abs(on_host).max() * np.abs(points).max() * 70


@pytest.mark.parametrize("m, D", [(90, 30), (200, 60)])
def test_eliminations_on_one_shared_pool_take_the_steps_of_the_single_one(rng, m, D):
    """eliminate_batch on one pool's points shared by every certificate, with the pool's null vectors given
    once: the rows each certificate keeps and its weights are those eliminate gives it on its own."""
    points = np.hstack([rng.standard_normal((m, D - 1)), np.ones((m, 1))])
    alpha = rng.random((6, m)) ** 3
    alpha /= alpha.sum(axis=1, keepdims=True)
    null = elimination.null_vectors(torch.from_numpy(points))
    given = null.clone()
    batched, failed = elimination.eliminate_batch(torch.from_numpy(points), torch.from_numpy(alpha), null)
    assert not failed.any()
    assert torch.equal(null, given)  # the shared vectors are read, not corrected in place
    shared = elimination.null_vectors(points)
    for j in range(6):
        single = elimination.eliminate(points, alpha[j], shared)
        assert np.count_nonzero(batched[j].numpy()) <= D
        assert np.array_equal(batched[j].numpy() > 0, single > 0)
        assert np.allclose(batched[j].numpy(), single, rtol=0, atol=1e-12)
        assert np.abs(batched[j].numpy() @ points - alpha[j] @ points).max() <= 1e-12


def test_the_device_path_of_a_pool_s_eliminations_runs_on_the_cpu(rng, monkeypatch):
    """eliminate_on_pool as a GPU runs it (batches, no step on the host), forced on the CPU, against the host's
    one-by-one eliminations: the same supports, the same combinations."""
    m, D = 160, 41
    points = torch.from_numpy(np.hstack([rng.standard_normal((m, D - 1)), np.ones((m, 1))]))
    alphas = torch.from_numpy(rng.random((5, m)))
    alphas /= alphas.sum(dim=1, keepdim=True)
    null = elimination.null_vectors(points)
    on_host = elimination.eliminate_on_pool(points, alphas, null)
    monkeypatch.setattr(elimination, "steps_on_host", lambda device: False)
    monkeypatch.setattr(elimination, "_ELIMINATION_BATCH", 2)  # three batches, the last of one
    on_device = elimination.eliminate_on_pool(points, alphas, null)
    for host, device, alpha in zip(on_host, on_device, alphas.numpy()):
        assert np.array_equal(host > 0, device > 0) and np.count_nonzero(device) <= D
        assert np.abs(device @ points.numpy() - alpha @ points.numpy()).max() <= 1e-12


def test_linear_weights_of_a_block_are_each_target_s_own(rng):
    """linear_weights_batch for a block of targets against linear_weights for each alone: the same weights up
    to the rounding of the block's products, the same verdict on positivity, and each a convex combination
    reproducing its target."""
    from auditor.engine.exact.pools import (
        linear_weights,
        linear_weights_batch,
        pool_centre,
    )

    d = 48
    scales = np.linspace(0.2, 2.0, d)
    rows = _cloud(rng, 40 * d, d, scales)
    centre = rows.mean(axis=0)
    pool = rows[np.sort(rng.choice(len(rows), size=3 * (d + 1), replace=False))]  # around the centre (Wendel)
    lifted = np.hstack([pool, np.ones((len(pool), 1))])
    shared = pool_centre(torch.from_numpy(pool), torch.from_numpy(centre))
    assert shared is not None and isinstance(shared.weights, torch.Tensor)
    directions = rng.standard_normal((7, d))
    distances = np.array([0.0, 0.01, 0.05, 0.1, 0.6, 3.0, 0.02])[:, None]
    targets = centre + distances * directions / np.linalg.norm(directions, axis=1, keepdims=True) * scales
    nu, positive = linear_weights_batch(torch.from_numpy(lifted), shared, torch.from_numpy(targets))
    # the first-order weights in numpy, from the factor's H = L L^T: mu_i (1 + theta . (x_i - c)), H theta = t - c,
    # then one refinement against the residual
    mu, c, L = shared.weights.numpy(), shared.point.numpy(), shared.factor.numpy()
    H = L @ L.T

    def first_order(target):
        w = mu * (1 + (pool - c) @ np.linalg.solve(H, target - c))
        w = w / w.sum()
        return w + mu * ((pool - c) @ np.linalg.solve(H, target - w @ pool)), w

    for j, target in enumerate(targets):
        refined, unrefined = first_order(target)
        assert bool(positive[j]) == bool(np.all(unrefined > 0) and np.all(refined > 0))
        alone = linear_weights(lifted, shared, target)
        assert bool(positive[j]) == (alone is not None)
        if alone is None:
            continue
        column = nu[:, j].numpy()
        assert np.array_equal(column, alone)  # the same whether solved in a block or alone
        assert np.abs(column - refined).max() <= 1e-12 * refined.max()
        assert np.all(column > 0) and abs(column.sum() - 1) <= 1e-14
        assert np.abs(column @ pool - target).max() <= 1e-12 * np.abs(pool - target).max()
    assert positive[:4].all() and not positive[5]  # near the centre reached, far outside not


def test_maximum_entropy_weights_of_a_tensor_are_those_of_its_array(rng):
    """The solve on a tensor (where the head lies) and on its numpy array: the same weights, of the input's
    kind, reproducing the target."""
    from auditor.engine.exact.pools import maximum_entropy_weights

    d = 32
    pool = rng.standard_normal((3 * (d + 1), d)) * np.linspace(0.3, 1.7, d)
    direction = rng.standard_normal(d)
    target = pool.mean(axis=0) + 0.1 * pool.std(axis=0) * direction / np.linalg.norm(direction)
    on_host = maximum_entropy_weights(pool, target)
    on_device = maximum_entropy_weights(torch.from_numpy(pool.copy()), torch.from_numpy(target))
    assert isinstance(on_host, np.ndarray) and isinstance(on_device, torch.Tensor)
    assert np.array_equal(on_device.numpy(), on_host)
    assert np.abs(on_host @ pool - target).max() <= 1e-12 * np.abs(pool - target).max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_audit_whose_pool_routes_take_the_device_path_matches_the_lp(rng, dtype, monkeypatch):
    """Rows a little off the centre (as a bfloat16 checkpoint stores mean-initialised rows) take the centre
    pool's routes: with every elimination forced onto the device's path (batched, on the pool's tensors), the
    audit's verdicts are the plain LP's over all rows and the host path's, every certificate on at most D rows
    and verified."""
    n, d = 1200, 64
    W = rows_off_the_centre(rng, n, d, [0.03 + 0.02 * j for j in range(6)])
    head = torch.from_numpy(W).to(dtype)
    on_host = auditor.audit(head, progress=False)
    batches = []
    batch = elimination.eliminate_batch
    monkeypatch.setattr(elimination, "steps_on_host", lambda device: False)
    monkeypatch.setattr(elimination, "eliminate_batch", lambda *a: batches.append(a[0].dim()) or batch(*a))
    on_device = auditor.audit(head, progress=False)
    assert 2 in batches  # the device's path ran: eliminations on one pool's shared points
    W64 = head.to(torch.float64).numpy()
    assert [t.verdict for t in on_device.tokens] == [t.verdict for t in on_host.tokens]
    for k in range(n - 6, n):
        token = on_device.tokens[k]
        assert token.verdict == "unargmaxable" and lp_margin(W64, None, k)[0] <= 1e-9
        assert token.convex_indices.size <= d + 1
    assert on_device.counts["inconclusive"] == 0
    assert auditor.verify(on_device, head).ok


def test_a_batched_step_that_finds_no_direction_is_taken_again_on_the_host(rng, monkeypatch):
    """Where the device's batched steps report a certificate as stuck, eliminate_on_pool and eliminate_on take
    it again with the host's single elimination: the same weights as the host path gives."""
    m, D = 120, 31
    points = np.hstack([rng.standard_normal((m, D - 1)), np.ones((m, 1))])
    alphas = rng.random((3, m))
    alphas /= alphas.sum(axis=1, keepdims=True)
    batch = elimination.eliminate_batch

    def stuck(*args):
        weights, failed = batch(*args)
        return weights.fill_(-1.0), np.ones_like(failed)  # every one stuck: its weights must not be used

    monkeypatch.setattr(elimination, "steps_on_host", lambda device: False)
    monkeypatch.setattr(elimination, "eliminate_batch", stuck)
    null = elimination.null_vectors(points)
    pooled = elimination.eliminate_on_pool(torch.from_numpy(points), torch.from_numpy(alphas),
                                           torch.from_numpy(null))
    for alpha, found in zip(alphas, pooled):
        assert np.array_equal(found, elimination.eliminate(points, alpha, null))
    single = elimination.eliminate_on(torch.device("cpu"), [points.copy(order="F")], alphas[0])
    assert np.array_equal(single, elimination.eliminate(points, alphas[0]))


def test_a_token_s_centre_pool_certificate_does_not_depend_on_the_tokens_beside_it(rng):
    """CentreRoutes.pooled for rows a little off the centre, all together and each alone: the same rows and the
    same weights, bit for bit (ranks and blocks of ids give the certificates of one whole run)."""
    from conftest import engine_head

    from auditor.engine.settle import CentreRoutes

    n, d = 1200, 48
    W = rows_off_the_centre(rng, n, d, [0.02 + 0.01 * j for j in range(8)])
    head = engine_head(torch.from_numpy(W))
    planted = list(range(n - 8, n))
    routes = CentreRoutes(head)
    together = routes.pooled(planted)
    assert len(together) >= 6
    for k, (indices, weights, _, _) in together.items():
        alone = CentreRoutes(head).pooled([k])[k]
        assert np.array_equal(alone[0], indices) and np.array_equal(alone[1], weights)
