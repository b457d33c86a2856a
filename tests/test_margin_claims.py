"""Stated margins are proven lower bounds, and the checker holds them to the exact value (issue 29, part 3).

Every margin a report states for a witness is at most the exact margin at that witness (the least lead
l_k(z) - l_i(z) over the rivals outside k's tie group; per unit of ||z|| for an unbounded head without a
bias; in the norm domain at the exact output of the pre-norm vector), whichever stage found it: the
float32 screen, the bfloat16 pass, the whitened witnesses, Frank-Wolfe, the bounded dual, the LP, the
probability ceilings. ``auditor.verify`` rejects a margin raised to (exact value) x (1 + 1e-6) on a
float64 head and x (1 + 1e-4) on a float32 head, naming the margin. The exact values here are Fractions;
square roots are bracketed by integer square roots to 200 bits.

A certificates file that lists a token's own id among its tie partners fails ``audit-verify`` (exit 1),
naming the token.
"""

from __future__ import annotations

import json
import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

import auditor
import auditor.engine.pipeline as pipeline
from auditor.engine import stages as engine_stages
from auditor.engine.screen import low_precision
from conftest import run_command


@pytest.fixture(autouse=True)
def _iterative_stages_in_few_dimensions(monkeypatch):
    """These heads are small enough that the exact LP (pipeline._DIRECT_LP_WIDTH) or the minimum-norm rounds
    (corrective.WIDTH) would go first, and the rounds take what they leave on wider heads (corrective.LEFTOVERS);
    the tests are of Frank-Wolfe, Newton and the exact LP, so every width takes them."""
    monkeypatch.setattr(pipeline, "_DIRECT_LP_WIDTH", 0)
    monkeypatch.setattr(pipeline.corrective, "WIDTH", 0)
    monkeypatch.setattr(pipeline.corrective, "LEFTOVERS", False)


FLOAT64_FACTOR = 1 + Fraction(1, 10**6)
FLOAT32_FACTOR = 1 + Fraction(1, 10**4)
_BITS = 200


def fractions(values) -> list[Fraction]:
    return [Fraction(float(v)) for v in np.asarray(values, dtype=np.float64).ravel()]


def square_root(x: Fraction) -> tuple[Fraction, Fraction]:
    """(low, high) with low <= sqrt(x) <= high, 2^-200 apart relative to the root."""
    shift = 4 * _BITS + max(0, x.denominator.bit_length() - x.numerator.bit_length())
    shift += shift % 2
    scaled = (x.numerator << shift) // x.denominator  # floor(x 2^shift), shift even
    root = math.isqrt(scaled)
    return Fraction(root, 1 << (shift // 2)), Fraction(root + 1, 1 << (shift // 2))


def up(value: Fraction) -> float:
    """The least float64 at or above ``value``."""
    rounded = float(value)
    return rounded if Fraction(rounded) >= value else float(np.nextafter(rounded, np.inf))


def rivals(report, k: int) -> list[int]:
    copies = set(report.tokens[k].tied_with or ())
    return [i for i in range(report.n_tokens) if i != k and i not in copies]


def exact_margin(report, W, b, k: int, final_norm=None) -> tuple[Fraction, Fraction]:
    """(low, high) bracketing the exact margin of token k at its stated witness, as the report states
    margins: per unit of ||z|| for an unbounded head without a bias; in the norm domain at the exact
    normalisation of the pre-norm vector."""
    token = report.tokens[k]
    rows = [fractions(row) for row in np.asarray(W, dtype=np.float64)]
    bias = fractions(b) if b is not None else [Fraction(0)] * len(rows)
    others = rivals(report, k)
    if final_norm is not None:
        return _exact_norm_margin(rows, bias, k, others, token.pre_norm, final_norm)
    z = fractions(token.witness)
    leads = [sum((a - c) * p for a, c, p in zip(rows[k], rows[i], z) if p) + bias[k] - bias[i] for i in others]
    least = min(leads)
    if not (str(report.domain) == "unbounded" and b is None):
        return least, least
    low, high = square_root(sum(p * p for p in z))
    return (least / high, least / low) if least >= 0 else (least / low, least / high)


def _exact_norm_margin(rows, bias, k, others, x, final_norm) -> tuple[Fraction, Fraction]:
    d = len(rows[0])
    gain = fractions(final_norm.weight) if final_norm.weight is not None else [Fraction(1)] * d
    shift = fractions(final_norm.bias) if final_norm.bias is not None else [Fraction(0)] * d
    c = fractions(x)
    if final_norm.kind == "layernorm":
        mean = sum(c) / d
        c = [v - mean for v in c]
    low, high = square_root(sum(v * v for v in c) / d + Fraction(final_norm.eps))
    lows, highs = [], []
    for i in others:  # l_k - l_i = A / r + B at the output g c / r + beta
        a = sum((p - q) * g * v for p, q, g, v in zip(rows[k], rows[i], gain, c))
        rest = sum((p - q) * s for p, q, s in zip(rows[k], rows[i], shift)) + bias[k] - bias[i]
        lows.append((a / high if a >= 0 else a / low) + rest)
        highs.append((a / low if a >= 0 else a / high) + rest)
    return min(lows), min(highs)


def witnessed(report) -> list[int]:
    return [t.id for t in report.tokens if t.margin is not None and np.isfinite(t.margin)
            and (t.witness is not None or t.pre_norm is not None)]


def assert_margins_held(report, W, b, factor: Fraction, final_norm=None) -> list[int]:
    """Every stated margin is at most the exact one; the report passes as it is; each margin raised to the
    exact value times ``factor`` fails, on exactly those tokens, naming the margin. Returns the tokens."""
    ids = witnessed(report)
    assert ids
    exact = {k: exact_margin(report, W, b, k, final_norm) for k in ids}
    for k in ids:
        low, high = exact[k]
        assert 0 < low <= high
        assert Fraction(report.tokens[k].margin) <= low, (k, report.tokens[k].stage, report.tokens[k].margin,
                                                         float(low))
    result = auditor.verify(report, W, b, final_norm=final_norm)
    assert result.ok, result.reasons
    document = report.to_dict()
    for entry in document["tokens"]:
        if entry["id"] in exact:
            entry["margin"] = up(exact[entry["id"]][1] * factor)
    result = auditor.verify(json.loads(json.dumps(document)), W, b, final_norm=final_norm)
    assert result.failed == ids
    for k in ids:
        assert result.reasons[k] and all(reason.startswith("margin: ") for reason in result.reasons[k]), \
            (k, report.tokens[k].stage, result.reasons[k])
    return ids


def stages(report, ids) -> set[str]:
    return {report.tokens[k].stage for k in ids}


# -- float64 heads ------------------------------------------------------------------------------------


@pytest.mark.parametrize("domain, with_bias", [("unbounded", False), ("unbounded", True), ("ball:2", True),
                                               ("box:1", False), ("box:0.5", True)])
def test_float64_heads_state_lower_bounds_and_a_raised_margin_fails(rng, domain, with_bias):
    W = rng.standard_normal((40, 5))
    b = rng.standard_normal(40) if with_bias else None
    report = auditor.audit(W, b, domain=domain, progress=False)
    ids = assert_margins_held(report, W, b, FLOAT64_FACTOR)
    assert "screen" in stages(report, ids)
    if domain != "unbounded" or not with_bias:
        assert "frank-wolfe" in stages(report, ids)  # the min-norm problem, or the bounded dual with a bias


def test_rows_that_share_a_large_offset_state_lower_bounds(rng):
    W = rng.standard_normal((40, 5)) + np.array([300.0, -120.0, 0.0, 55.0, 7.0])  # translated by the engine
    report = auditor.audit(W, progress=False)
    assert_margins_held(report, W, None, FLOAT64_FACTOR)


def test_lp_witnesses_state_lower_bounds(rng):
    W = rng.standard_normal((40, 5))
    report = auditor.audit(W, progress=False, frank_wolfe_iterations=0, newton_iterations=0)
    ids = assert_margins_held(report, W, None, FLOAT64_FACTOR)
    assert "lp" in stages(report, ids)


def test_probability_ceiling_witnesses_state_lower_bounds(rng):
    W = rng.standard_normal((30, 4))
    b = rng.standard_normal(30)
    report = auditor.audit(W, b, domain="ball:1", probability_ceiling=True, progress=False)
    ids = assert_margins_held(report, W, b, FLOAT64_FACTOR)
    assert "ceiling" in stages(report, ids)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_norm_domain_margins_are_lower_bounds_at_the_exact_output(rng, kind):
    d = 4
    W = rng.standard_normal((30, d))
    b = 0.3 * rng.standard_normal(30)
    final_norm = auditor.FinalNorm(kind, weight=rng.uniform(0.5, 1.5, d),
                                   bias=0.3 * rng.standard_normal(d) if kind == "layernorm" else None, eps=1e-5)
    report = auditor.audit(W, b, domain="norm", final_norm=final_norm, progress=False)
    assert_margins_held(report, W, b, FLOAT64_FACTOR, final_norm)


# -- float32 heads ------------------------------------------------------------------------------------


def test_float32_screen_states_lower_bounds(rng):
    W = rng.standard_normal((120, 12)).astype(np.float32)
    report = auditor.audit(W, progress=False)
    ids = assert_margins_held(report, W, None, FLOAT32_FACTOR)
    screened = [k for k in ids if report.tokens[k].stage == "screen"]
    assert len(screened) > 0.5 * report.n_tokens  # the float32 pass decides most tokens


@pytest.mark.parametrize("domain, with_bias", [("unbounded", True), ("ball:2", True), ("box:1", False)])
def test_float32_heads_in_other_domains_state_lower_bounds(rng, domain, with_bias):
    W = rng.standard_normal((40, 5)).astype(np.float32)
    b = rng.standard_normal(40).astype(np.float32) if with_bias else None
    report = auditor.audit(W, b, domain=domain, progress=False)
    assert_margins_held(report, W, b, FLOAT32_FACTOR)


@pytest.fixture
def proved(monkeypatch):
    """The ids the bfloat16 pass and the whitened witnesses prove, as they prove them."""
    found = {"bfloat16": set(), "whitened": set()}
    bfloat16_pass, whitened = low_precision.bfloat16_pass, engine_stages.whitened_witnesses

    def pass_(head, ids, *args, **kwargs):
        out = bfloat16_pass(head, ids, *args, **kwargs)
        found["bfloat16"].update(ids[out[0]].tolist())
        return out

    def whitened_(head, ids, *args, **kwargs):
        tried, witnesses, check = whitened(head, ids, *args, **kwargs)
        if check is not None:
            found["whitened"].update(ids[tried[check.certified]].tolist())
        return tried, witnesses, check

    monkeypatch.setattr(low_precision, "bfloat16_pass", pass_)
    monkeypatch.setattr(engine_stages, "whitened_witnesses", whitened_)
    return found


@pytest.mark.parametrize("dtype, factor", [(np.float32, FLOAT32_FACTOR), (np.float64, FLOAT64_FACTOR)])
def test_bfloat16_pass_states_lower_bounds(rng, proved, dtype, factor):
    if not low_precision.accumulates_as_assumed(torch.device("cpu")):
        pytest.skip("this CPU's bfloat16 products do not accumulate as the pass assumes")
    W = rng.standard_normal((80, 8)).astype(dtype)
    report = auditor.audit(W, progress=False, bfloat16_entries=0)
    ids = assert_margins_held(report, W, None, factor)
    assert proved["bfloat16"] and proved["bfloat16"] <= set(ids)


def test_bfloat16_pass_with_a_bias_in_a_ball_states_lower_bounds(rng, proved):
    if not low_precision.accumulates_as_assumed(torch.device("cpu")):
        pytest.skip("this CPU's bfloat16 products do not accumulate as the pass assumes")
    W = rng.standard_normal((80, 8))
    b = 0.5 * rng.standard_normal(80)
    report = auditor.audit(W, b, domain="ball:3", progress=False, bfloat16_entries=0)
    ids = assert_margins_held(report, W, b, FLOAT64_FACTOR)
    assert proved["bfloat16"] and proved["bfloat16"] <= set(ids)


@pytest.mark.parametrize("bfloat16_entries", [0, 1 << 40])  # the whitened check in bfloat16, or in float32 and float64
def test_whitened_witnesses_state_lower_bounds(rng, proved, bfloat16_entries):
    scales = np.exp(rng.uniform(-3, 3, 6))  # long and thin: the formula witnesses leave many tokens
    W = (rng.standard_normal((120, 6)) * scales).astype(np.float32)
    report = auditor.audit(W, progress=False, whitened_entries=0, bfloat16_entries=bfloat16_entries)
    ids = assert_margins_held(report, W, None, FLOAT32_FACTOR)
    assert proved["whitened"] and proved["whitened"] <= set(ids)


def test_a_margin_just_below_the_exact_one_passes_and_one_just_above_fails():
    """The check is as tight as float64 allows: the exact margin rounded down passes, up by 1e-12 fails."""
    W = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0], [0.3, 0.3]])
    report = auditor.audit(W, domain="ball:1", progress=False)
    k = 0
    low, high = exact_margin(report, W, None, k)
    document = report.to_dict()
    entry = next(e for e in document["tokens"] if e["id"] == k)
    entry["margin"] = float(low) if Fraction(float(low)) <= low else float(np.nextafter(float(low), -np.inf))
    assert auditor.verify(document, W).ok
    entry["margin"] = up(high * (1 + Fraction(1, 10**12)))
    result = auditor.verify(document, W)
    assert result.failed == [k] and result.reasons[k][0].startswith("margin: ")
    # one float64 step above the exact value: within float64's rounding, settled in rational arithmetic
    entry["margin"] = float(np.nextafter(up(high), np.inf))
    result = auditor.verify(document, W)
    assert result.failed == [k] and result.reasons[k][0].startswith("margin: ")
    assert "exact rational arithmetic" in result.reasons[k][0]


def test_a_unit_ball_margin_one_step_above_the_exact_one_fails_in_rational_arithmetic():
    W = np.array([[3.0, 1.0], [1.0, 3.0], [-2.0, -2.0], [0.5, 0.25]])
    report = auditor.audit(W, progress=False)
    k = 0
    low, high = exact_margin(report, W, None, k)
    assert Fraction(report.tokens[k].margin) <= low
    document = report.to_dict()
    entry = next(e for e in document["tokens"] if e["id"] == k)
    entry["margin"] = float(np.nextafter(up(high), np.inf))
    result = auditor.verify(document, W)
    assert result.failed == [k] and "exact rational arithmetic" in result.reasons[k][0], result.reasons


# -- tie partners ---------------------------------------------------------------------------------------


# Both commands run in this process (conftest.run_command): their output, not an interpreter's start-up.
def verify_cli(*args):
    from auditor.cli.verify import main

    return run_command(main, *args)


def audit_cli(*args):
    from auditor.cli.audit import main

    return run_command(main, *args)


@pytest.fixture
def head_with_copies(tmp_path, rng):
    """A small head on disk whose rows 3 and 11 are one row, with its certificates file."""
    W = rng.standard_normal((24, 3)).astype(np.float32)
    W[11] = W[3]
    path = tmp_path / "head.safetensors"
    save_file({"weight": W}, str(path))
    certificates = tmp_path / "certificates.json"
    done = audit_cli(path, "--certificates", certificates, "--quiet")
    assert done.returncode in (0, 1), done.stderr
    return path, certificates, W


def test_a_token_listed_as_its_own_tie_partner_fails_on_the_command_line(head_with_copies, tmp_path):
    path, certificates, W = head_with_copies
    assert verify_cli(certificates, path).returncode == 0
    document = json.loads(certificates.read_text())
    entries = {entry["id"]: entry for entry in document["tokens"]}
    assert entries[3]["tied_with"] == [11]
    entries[3]["tied_with"] = [11, 3]
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(document))
    done = verify_cli(edited, path)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.strip().splitlines()
    assert [int(line.split()[0]) for line in lines[:-1]] == [3], done.stdout
    assert "tie: lists token 3 itself" in lines[0]
    result = auditor.verify(auditor.load_certificates(edited), W)
    assert result.failed == [3] and result.reasons[3][0].startswith("tie: ")


def test_a_token_tied_only_with_itself_fails(head_with_copies, tmp_path):
    """A tie claim that names no other row: the token claims it never wins strictly, with nothing to show."""
    path, certificates, W = head_with_copies
    document = json.loads(certificates.read_text())
    entry = next(e for e in document["tokens"] if e["verdict"] == "argmaxable" and isinstance(e.get("witness"), dict))
    k = entry["id"]
    entry.update(verdict="tied", tied_with=[k], group_verdict="argmaxable")
    document["counts"]["argmaxable"] -= 1
    document["counts"]["tied"] += 1
    edited = tmp_path / "edited.json"
    edited.write_text(json.dumps(document))
    done = verify_cli(edited, path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert [int(line.split()[0]) for line in done.stdout.strip().splitlines()[:-1]] == [k]
    result = auditor.verify(auditor.load_certificates(edited), W)
    assert result.failed == [k] and result.reasons[k] == [f"tie: lists token {k} itself as its copy"]


def test_a_runner_up_that_names_the_token_itself_fails(rng):
    W = rng.standard_normal((12, 3))
    report = auditor.audit(W, progress=False)
    document = report.to_dict()
    entry = next(e for e in document["tokens"] if e["verdict"] == "argmaxable")
    entry["runner_up"] = entry["id"]
    result = auditor.verify(document, W)
    assert result.failed == [entry["id"]] and result.reasons[entry["id"]][0].startswith("runner_up: ")


def test_the_checker_states_no_bound_where_the_norm_s_sum_of_squares_overflows():
    """A pre-norm vector whose squares overflow float64 has no computed output to hold a margin to: the checker's
    normalisation says so (an infinite error bound) instead of returning the shift as the output."""
    from auditor.verify.numbers import normalise

    for kind in ("layernorm", "rmsnorm"):
        _, error, floor = normalise(np.array([1e200, -3e200]), kind, np.ones(2), np.array([0.5, -0.25]), 1e-5)
        assert error == np.inf and floor == np.inf
        z, error, _ = normalise(np.array([1.0, -3.0]), kind, np.ones(2), np.array([0.5, -0.25]), 1e-5)
        assert np.isfinite(error) and error < 1e-12 and abs(z[0] - 0.5) > 0.1


def test_the_translation_s_rounding_bound_moves_with_a_power_of_two_scaling():
    """The translated rows' error bound is a scaled norm: errors below 2^-511 do not square to 0, so a head and
    the head times 2^-600 get the same bound times 2^-600."""
    import torch

    from auditor.engine.arithmetic.normal_form import normal_form
    from auditor.question.domain import Unbounded

    W = np.array([[0.0, 1.0], [2.0**-60, 0.5], [1 + 2.0**-52, 0.25]])
    forms = [normal_form(torch.from_numpy(W * factor), None, Unbounded(), torch.ones(3, dtype=torch.bool))
             for factor in (1.0, 2.0**-600)]
    assert forms[0].row_error is not None and forms[1].row_error is not None
    assert torch.equal(forms[0].weight, forms[1].weight)
    assert torch.equal(forms[0].row_error, forms[1].row_error)
