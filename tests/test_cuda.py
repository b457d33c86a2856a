"""The CUDA path against the same oracles as the CPU one. Skipped without a GPU; on a GPU machine run
``python -m pytest -m cuda``."""

import numpy as np
import pytest
import torch
from conftest import mean_initialised, rows_off_the_centre
from oracles import qhull_argmaxable, witness_wins

import auditor
from auditor.engine.arithmetic import head as head_module
from auditor.engine.screen import gram as screen_module
from auditor.engine.screen import low_precision

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def planted(rng, n=400, d=5):
    """An anisotropic head with six rows planted inside the hull (no copies: Qhull then names every vertex)."""
    W = rng.standard_normal((n, d)) * np.array([3.0, 1.5, 1.0, 0.5, 0.2])[:d] + 1.0
    inside = [rng.dirichlet(np.ones(d + 2)) @ W[rng.choice(n, d + 2, replace=False)] for _ in range(6)]
    return np.vstack([W, inside])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
def test_cuda_verdicts_match_qhull_and_the_cpu(dtype):  # half-precision heads stay so on the device too
    head = torch.tensor(planted(np.random.default_rng(0)), dtype=dtype)
    exact = head.to(torch.float64).numpy()
    on_gpu = auditor.audit(head.cuda(), device="cuda", progress=False)
    on_cpu = auditor.audit(head, progress=False)
    assert set(on_gpu.ids("argmaxable")) == qhull_argmaxable(exact)
    assert [t.verdict for t in on_gpu.tokens] == [t.verdict for t in on_cpu.tokens]
    assert on_gpu.counts["inconclusive"] == 0
    assert auditor.verify(on_gpu, exact).ok


def test_the_bfloat16_pass_runs_on_cuda_and_proves_only_what_wins(monkeypatch):
    monkeypatch.setattr(head_module, "BFLOAT16_ENTRIES", 0)
    monkeypatch.setattr(head_module, "WHITENED_ENTRIES", 0)
    rng = np.random.default_rng(1)
    W = (rng.standard_normal((3000, 64)) * np.linspace(2, 0.2, 64) + 0.5).astype(np.float32)
    assert low_precision.accumulates_as_assumed(torch.device("cuda"))
    report = auditor.audit(torch.from_numpy(W).cuda(), device="cuda", progress=False)
    assert report.counts["inconclusive"] == 0
    for token in report.tokens[:200]:
        if token.verdict == "argmaxable":
            assert witness_wins(W.astype(np.float64), None, token.id, np.asarray(token.witness, dtype=np.float64))
    assert auditor.verify(report, W).ok


def test_resized_rows_under_a_shifted_layernorm_on_cuda():
    rng = np.random.default_rng(2)
    old = (rng.standard_normal((2000, 32)) * np.linspace(1.5, 0.3, 32) + 0.2).astype(np.float32)
    W = np.vstack([old, mean_initialised(old, 3, rng)])
    norm = auditor.FinalNorm("layernorm", weight=rng.uniform(0.85, 1.15, 32), bias=0.04 * rng.standard_normal(32),
                             eps=1e-12)
    report = auditor.audit(torch.from_numpy(W).cuda(), device="cuda", domain="norm", final_norm=norm, progress=False)
    assert report.ids("unargmaxable")[-3:] == [2000, 2001, 2002]
    assert not [t.id for t in report.tokens if t.stage == "lp"]
    assert auditor.verify(report, W, final_norm=norm).ok


def test_rows_off_the_centre_take_the_pool_routes_on_the_device(monkeypatch):
    """Rows a little off the centre, stored in bfloat16 (mean-initialised rows as a bfloat16 checkpoint holds
    them), take the centre pool's routes: on the GPU their linear weights, maximum-entropy solves and batched
    eliminations run on CUDA tensors, and the verdicts are the CPU audit's and the plain LP's, every
    certificate on at most D rows and verified."""
    from oracles import lp_margin

    from auditor.engine.exact import elimination

    n, d = 1200, 64
    W = rows_off_the_centre(np.random.default_rng(3), n, d, [0.03 + 0.02 * j for j in range(6)])
    head = torch.from_numpy(W).to(torch.bfloat16)
    devices, batch = [], elimination.eliminate_batch
    monkeypatch.setattr(elimination, "eliminate_batch", lambda *a: devices.append(a[0].device.type) or batch(*a))
    on_gpu = auditor.audit(head.cuda(), device="cuda", progress=False)
    assert "cuda" in devices
    on_cpu = auditor.audit(head, progress=False)
    assert [t.verdict for t in on_gpu.tokens] == [t.verdict for t in on_cpu.tokens]
    W64 = head.to(torch.float64).numpy()
    for k in range(n - 6, n):
        assert on_gpu.tokens[k].verdict == "unargmaxable" and lp_margin(W64, None, k)[0] <= 1e-9
        assert on_gpu.tokens[k].convex_indices.size <= d + 1
    assert on_gpu.counts["inconclusive"] == 0
    assert auditor.verify(on_gpu, head).ok


def test_the_dual_simplex_pivots_on_cuda_take_the_host_s_steps():
    """A basis on a head on the GPU keeps its arrays there as tensors: for rows in its pool and out of it, the
    same answers as the host's basis (inside or not), on the same rows with the same weights up to rounding."""
    from conftest import engine_head

    from auditor.engine.exact.caratheodory import reduce_support
    from auditor.engine.exact.dual_simplex import Basis

    rng = np.random.default_rng(4)
    W = rng.standard_normal((400, 6))
    pool = np.arange(0, 400, 2)
    on_host_head, on_device_head = engine_head(W), engine_head(torch.from_numpy(W).cuda())
    start, _, _ = reduce_support(on_host_head, pool, np.full(pool.size, 1.0 / pool.size))
    on_host, on_device = Basis(on_host_head, pool, start), Basis(on_device_head, pool, start)
    assert on_device.points.is_cuda
    inside = 0
    for k in range(1, 400, 3):
        host = on_host.certificate(k, max_pivots=10_000)
        device = on_device.certificate(k, max_pivots=10_000)
        assert (host is None) == (device is None)
        if host is not None:
            inside += 1
            assert np.array_equal(host[0], device[0]) and np.abs(host[1] - device[1]).max() <= 1e-12
    assert inside > 20
