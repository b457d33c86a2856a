"""The CUDA path against the same oracles as the CPU one. Skipped without a GPU; on a GPU machine run
``python -m pytest -m cuda``."""

import numpy as np
import pytest
import torch

import auditor
from auditor.engine.arithmetic import head as head_module
from auditor.engine.screen import low_precision
from auditor.engine.screen import gram as screen_module
from conftest import mean_initialised
from oracles import qhull_argmaxable, witness_wins

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
