"""A float16 or bfloat16 head, as checkpoints ship it, stays in its own storage in the engine: every stage
widens a block of rows at a time (exactly) where it computes, and no float32 copy of the whole head is made.
Its readings are those of the float32 head of the same values; its fast products keep the float32 rounding
bound; its audit answers as its float32 cast's does."""

from dataclasses import replace

import numpy as np
import pytest
import torch

import auditor
from auditor.engine.arithmetic import head as head_module
from auditor.engine.screen.gram import screen
from conftest import assert_same_float64_readings, engine_head
from oracles import lp_margin

HALF = [torch.bfloat16, torch.float16]


def _half_and_twin(rng, dtype, n=300, d=12, scale=1.0):
    """The engine head of a half-precision head, and the same head with its rows widened to float32 (the same
    exponent: 2^a times them is a float32 array, the carry)."""
    rows = torch.from_numpy(rng.standard_normal((n, d)) * scale).to(dtype)
    head = engine_head(rows)
    return head, replace(head, stored=head.stored.to(torch.float32), _scaled_copy=[])


def _exact_logits(head, z: torch.Tensor) -> np.ndarray:
    """z W^T for the rows 2^a v, in exact rationals' stead float64 with the entries exact and d small: the
    float64 rounding is below 2^-50 of |z| |w_i|, far under the float32 bound checked against it."""
    rows = head.stored.to(torch.float64).numpy() * 2.0**head.exponent
    return z.numpy() @ rows.T


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("scale", [2.0**-12, 2.0**10])  # exponents a > 0 and a < 0, in float16's range too
def test_a_half_precision_head_stays_as_given_and_reads_as_its_float32_values(rng, dtype, scale):
    head, twin = _half_and_twin(rng, dtype, scale=scale)
    assert head.stored.dtype == dtype and head.half and head.exponent != 0
    assert_same_float64_readings(head, twin, rng)
    k = torch.as_tensor(rng.choice(head.n, size=17, replace=False))
    assert head.rows_in_storage(k).dtype == torch.float32
    assert torch.equal(head.rows_in_storage(k), twin.rows_in_storage(k))
    assert head.fast_error_factor == twin.fast_error_factor
    assert head.fast_underflow_floor == twin.fast_underflow_floor


@pytest.mark.parametrize("dtype,scale,tiny", [(torch.bfloat16, 2.0**-12, False), (torch.float16, 2.0**-12, False),
                                              (torch.bfloat16, 2.0**10, False), (torch.float16, 2.0**10, False),
                                              (torch.bfloat16, 2.0**10, True), (torch.bfloat16, 2.0**-131, False)])
def test_the_fast_products_of_a_half_precision_head_keep_the_float32_bound(rng, dtype, scale, tiny, monkeypatch):
    """fast_logits, by blocks of widened rows, within fast_error_factor |w_i| |z| + fast_underflow_floor of the
    exact products, as a float32 head's; a product through a narrower format (rows or z in bfloat16) misses it
    by orders of magnitude. fast_combine (steering) near the twin's. With an entry of z near 2^-120 (``tiny``)
    2^a fl32(z) is no float32 array and the rows are scaled instead; so they are at 2^-131, where 2^a itself
    (a = 129 or so) is no float32 number."""
    head, twin = _half_and_twin(rng, dtype, n=3000, d=96, scale=scale)
    z = torch.from_numpy(rng.standard_normal((5, head.d)))  # the normal form's units: its rows' spread is about 1
    if tiny:
        z[:, 0] = (1 + 2.0**-20) * 2.0**-120  # 2^a times it is a subnormal float32 with bits to lose
    scaled = []
    blocks = head_module.EngineHead.narrow_blocks
    monkeypatch.setattr(head_module.EngineHead, "narrow_blocks",
                        lambda self, on, *a: scaled.append(on) or blocks(self, on, *a))
    found = head.fast_logits(z).numpy()
    exact = _exact_logits(head, z)
    bound = (head.fast_error_factor * head.row_norm.numpy()[None, :] * torch.linalg.vector_norm(z, dim=1).numpy()[:, None]
             + head.fast_underflow_floor)
    assert np.all(np.abs(found - exact) <= bound)
    assert np.abs(found - exact).max() > 0  # float32 rounding is there to bound
    coarse = (z.to(torch.bfloat16).to(torch.float64).numpy() @ head.stored.to(torch.float64).numpy().T
              * 2.0**head.exponent)
    assert not np.all(np.abs(coarse - exact) <= bound)  # the test can tell a narrower product apart
    assert scaled[0] == (tiny or scale == 2.0**-131)  # the branch meant
    alpha = torch.from_numpy(rng.random((2, head.n)) / head.n)
    size = alpha @ head.rows64(np.arange(head.n)).abs()  # sum_i alpha_i |w_ij|: what float32 sums round against
    assert bool(((head.fast_combine(alpha) - twin.fast_combine(alpha)).abs() <= 1e-5 * size).all())


@pytest.mark.parametrize("dtype,scale", [(torch.bfloat16, 1.0), (torch.float16, 2.0**-6),
                                         (torch.bfloat16, 2.0**-80), (torch.bfloat16, 2.0**70),
                                         (torch.bfloat16, 2.0**-131)])
def test_the_screen_of_a_half_precision_head_certifies_what_its_float32_values_do(rng, dtype, scale, monkeypatch):
    """Also where 2^2a v_k leaves float32 (rows near 2^-131, a = 129 or so: 2^a is no float32 number either):
    the rows' power is then taken on both sides."""
    head, twin = _half_and_twin(rng, dtype, scale=scale)
    scaled = []
    blocks = head_module.EngineHead.narrow_blocks
    monkeypatch.setattr(head_module.EngineHead, "narrow_blocks",
                        lambda self, on, *a: scaled.append(on) or blocks(self, on, *a))
    ids = np.arange(head.n)
    found, expected = screen(head, ids), screen(twin, ids)
    assert found.certified.any() and not found.certified.all()
    assert np.array_equal(found.certified, expected.certified)
    assert np.array_equal(found.runner_up, expected.runner_up)
    assert np.allclose(found.margin[found.certified], expected.margin[found.certified], rtol=1e-5, atol=0)
    assert scaled and all(on == (scale == 2.0**-131) for on in scaled)  # the branch meant


def _planted(rng, n=2000, d=24) -> np.ndarray:
    """Rows of a head as the fine-tuning tools leave them: mean-initialised ones, a shrunk copy, zeros."""
    W = (rng.standard_normal((n, d)) * 0.03).astype(np.float32)
    W[n - 10:n - 7] = W[:n - 10].mean(axis=0) + rng.standard_normal((3, d)).astype(np.float32) * 1e-6
    W[n - 7] = np.float32(2.0**-10) * W[7]
    W[n - 6:n - 4] = 0.0
    return W


@pytest.mark.parametrize("dtype", HALF)
def test_a_half_precision_audit_makes_no_float32_copy_and_answers_as_its_float32_cast(rng, dtype, monkeypatch):
    """The whole audit (the bfloat16 pass and the whitened witnesses switched on at this size), the engine head
    kept in the head's own dtype, its scaled float32 copy never made; the verdicts those of the float32 cast's
    audit, the planted rows' those of the LP over all rows, and every certificate verified."""
    n = 2000
    head = torch.from_numpy(_planted(rng, n)).to(dtype)
    options = {"progress": False, "bfloat16_entries": 0, "whitened_entries": 0}
    cast = auditor.audit(head.float(), **options)

    seen = []
    build = head_module.build_engine_head

    def recording(weight, *args, **kwargs):
        seen.append(weight.dtype)
        return build(weight, *args, **kwargs)

    copy = head_module.EngineHead.weight.fget

    def refuse(self):
        if self.half:
            raise AssertionError("a float32 copy of the half-precision head was made")
        return copy(self)

    from auditor.engine import pipeline
    monkeypatch.setattr(pipeline, "build_engine_head", recording)
    monkeypatch.setattr(head_module.EngineHead, "weight", property(refuse))
    report = auditor.audit(head, **options)
    assert seen == [dtype]
    verdicts = [report.tokens[k].verdict for k in range(n)]
    assert verdicts == [cast.tokens[k].verdict for k in range(n)]
    W64 = head.to(torch.float64).numpy()
    for k in range(n - 10, n - 6):
        assert verdicts[k] == "unargmaxable" and lp_margin(W64, None, k)[0] <= 1e-9
    assert verdicts[n - 6] == "tied" and report.tokens[n - 6].group_verdict == "unargmaxable"
    assert report.counts["inconclusive"] == 0
    assert auditor.verify(report, head).ok
    few = list(range(n - 10, n)) + [0, 1]  # a few tokens' audit (its own route) of the same head, in its storage
    assert [auditor.audit(head, tokens=few, progress=False).tokens[k].verdict for k in few] == [verdicts[k] for k in few]
    assert seen[-1] == dtype


def test_a_half_precision_head_whose_scaled_rows_leave_float32_s_range_is_widened_and_answers_alike(rng):
    """One entry of 2^-120 among entries near 2^10: 2^a v is subnormal in float32 there, so the carry does not
    hold; the normal form widens the head (float32, and float64 where the scaling needs it), as for its
    float32 cast, and the verdicts agree."""
    W = (rng.standard_normal((300, 12)) * 2.0**10).astype(np.float32)
    W[3, 4] = np.float32(2.0**-120)
    head = torch.from_numpy(W).to(torch.bfloat16)
    engine = engine_head(head)
    assert not engine.half and engine.exponent == 0
    found, cast = auditor.audit(head, progress=False), auditor.audit(head.float(), progress=False)
    assert [t.verdict for t in found.tokens] == [t.verdict for t in cast.tokens]
    assert found.counts["inconclusive"] == 0 and auditor.verify(found, head).ok


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("domain,biased", [("unbounded", True), ("ball:3", True), ("ball:3", False)])
def test_a_half_precision_head_with_a_bias_or_in_a_ball_answers_as_its_float32_cast(rng, dtype, domain, biased):
    """The bias's stages and the bounded dual (its working set of widened rows, the steering products)."""
    W = _planted(rng, n=600, d=10)
    head = torch.from_numpy(W).to(dtype)
    bias = rng.standard_normal(600) * 0.01 if biased else None
    found = auditor.audit(head, bias, domain=domain, progress=False)
    cast = auditor.audit(head.float(), bias, domain=domain, progress=False)
    assert [t.verdict for t in found.tokens] == [t.verdict for t in cast.tokens]
    assert found.counts["unargmaxable"] + found.counts["tied"] > 0
    assert auditor.verify(found, head, bias).ok


def test_a_bfloat16_head_far_from_the_origin_is_translated_in_float32(rng):
    """Rows sharing an offset far larger than their spread are translated (the normal form's rule), into float32
    where every difference is a float32 value, as its float32 cast's are: not into a float64 copy."""
    W = (rng.standard_normal((300, 12)) * 2.0**-4).astype(np.float32) + np.float32(20.0)
    head = torch.from_numpy(W).to(torch.bfloat16)
    engine = engine_head(head)
    assert engine.stored.dtype == torch.float32
    found, cast = auditor.audit(head, progress=False), auditor.audit(head.float(), progress=False)
    assert [t.verdict for t in found.tokens] == [t.verdict for t in cast.tokens]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rows_a_little_off_the_centre_take_the_centre_pool_and_one_elimination(rng, dtype, monkeypatch):
    """Mean-initialised rows as a bfloat16 checkpoint stores them sit tens of times further from the centre
    than float32 ones, beyond the reach of the centre's basis in a few pivots: rows planted 0.06 from the centre
    in the head's covariance metric (the reach is 0.25 / sqrt(D) = 0.031 here) take the centre's weights on the
    centre pool moved to them by one linear solve and one elimination (CentreRoutes.pooled), no dense
    certificate; unargmaxable as the LP over all rows says, on at most D rows, every certificate verified."""
    from auditor.engine import settle

    n, d = 1200, 64
    W = (rng.standard_normal((n, d)) * np.linspace(0.3, 1.5, d)).astype(np.float32)
    mean, covariance = W[:n - 4].astype(np.float64).mean(axis=0), np.cov(W[:n - 4].T.astype(np.float64), bias=True)
    factor = np.linalg.cholesky(covariance)
    for k in range(n - 4, n):
        u = rng.standard_normal(d)
        W[k] = (mean + 0.06 * factor @ (u / np.linalg.norm(u))).astype(np.float32)
    head = torch.from_numpy(W).to(dtype)
    pooled, route = [], settle.CentreRoutes.pooled
    def recording(self, ks):
        found = route(self, ks)
        pooled.extend(found)  # the tokens the route settled
        return found

    monkeypatch.setattr(settle.CentreRoutes, "pooled", recording)
    linear, solve = [], settle.linear_weights_batch

    def solving(*args):
        nu, positive = solve(*args)
        linear.extend(nu[:, j] if bool(positive[j]) else None for j in range(nu.shape[1]))
        return nu, positive

    monkeypatch.setattr(settle, "linear_weights_batch", solving)
    report = auditor.audit(head, progress=False)
    W64 = head.to(torch.float64).numpy()
    assert sorted(pooled) == list(range(n - 4, n))
    assert len(linear) == 4 and all(nu is not None for nu in linear)  # one linear solve each
    for k in range(n - 4, n):
        token = report.tokens[k]
        assert token.verdict == "unargmaxable" and lp_margin(W64, None, k)[0] <= 1e-9
        assert token.convex_indices.size <= d + 1
    assert auditor.verify(report, head).ok


def test_a_bfloat16_checkpoint_audits_in_bfloat16_from_the_command_line(rng, tmp_path, monkeypatch):
    """A safetensors file as a bfloat16 model ships its head: ``audit`` reads it, the engine keeps it in
    bfloat16, and the findings are those of the same values saved in float32."""
    import json

    from safetensors.torch import save_file

    from auditor.cli.audit import main
    from auditor.engine import pipeline
    from conftest import run_command

    head = torch.from_numpy(_planted(rng, n=800, d=16)).to(torch.bfloat16)
    save_file({"lm_head.weight": head}, str(tmp_path / "half.safetensors"))
    save_file({"lm_head.weight": head.float()}, str(tmp_path / "wide.safetensors"))
    seen, build = [], pipeline.build_engine_head
    monkeypatch.setattr(pipeline, "build_engine_head", lambda weight, *a, **k: seen.append(weight.dtype) or build(weight, *a, **k))
    findings = {}
    for name in ("half", "wide"):
        done = run_command(main, tmp_path / f"{name}.safetensors", "--format", "json", "--quiet")
        assert done.returncode == 1, done.stderr
        findings[name] = {entry["id"]: entry["verdict"] for entry in json.loads(done.stdout)["findings"]}
    assert seen == [torch.bfloat16, torch.float32]
    assert findings["half"] == findings["wide"] and {790, 791, 792, 793} <= set(findings["half"])
