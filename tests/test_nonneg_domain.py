"""The non-negative domains ``nonneg`` (z >= 0) and ``nonneg:R`` (z >= 0, ||z|| <= R) against a plain LP (a
second-order cone with a radius) over every row, the checker on certificates that hold only over the
orthant, and the command line."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

import auditor
from auditor.cli.audit import main as audit_main
from auditor.cli.verify import main as verify_main
from auditor.errors import InputError
from auditor.question.domain import NonNeg, parse_domain
from conftest import run_command
from oracles import orthant_margin, witness_wins


def _expected(W, b, radius=None):
    """Each token's verdict from the oracle's optimum; None where the optimum is too close to 0 to tell."""
    found = []
    for k in range(W.shape[0]):
        value = orthant_margin(W, b, k, radius)
        found.append("argmaxable" if value > 1e-7 else "unargmaxable" if value < 1e-9 else None)
    return found


def _check_against_oracle(W, b, radius=None):
    domain = "nonneg" if radius is None else f"nonneg:{radius}"
    report = auditor.audit(W, b, domain=domain, progress=False)
    expected = _expected(W, b, radius)
    assert None not in expected  # the heads below keep every optimum clear of 0 or exactly at it
    for token, verdict in zip(report.tokens, expected):
        claim = token.group_verdict if token.verdict == "tied" else token.verdict
        if token.verdict == "tied" and token.id != min(token.tied_with + [token.id]):
            continue  # a tie's other members are never emitted; the group's verdict is its lowest id's
        assert claim == verdict, (token.id, claim, verdict)
        if claim == "argmaxable" and token.verdict != "tied":
            z = token.witness
            assert np.all(z >= 0) and (radius is None or np.linalg.norm(z) <= radius)
            assert witness_wins(W, b, token.id, z)
    assert auditor.verify(report, W, b).ok
    return report


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("with_bias", [False, True])
def test_random_heads_agree_with_the_lp_over_every_row(seed, with_bias):
    rng = np.random.default_rng(seed)
    W = rng.normal(size=(36, 5))
    b = rng.normal(size=36) if with_bias else None
    report = _check_against_oracle(W, b)
    counts = report.counts
    assert counts["argmaxable"] > 0 and counts["unargmaxable"] > 0  # both verdicts occur: the test can fail


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("with_bias", [False, True])
def test_a_radius_agrees_with_the_cone_program_over_every_row(seed, with_bias):
    rng = np.random.default_rng(10 + seed)
    W = rng.normal(size=(30, 4))
    b = rng.normal(size=30) if with_bias else None
    _check_against_oracle(W, b, radius=1.5)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("with_bias", [False, True])
def test_integer_heads_with_ties_and_exact_boundaries(seed, with_bias):
    """Small integers put many tokens exactly on the boundary (an optimum of exactly 0: no strict win)."""
    rng = np.random.default_rng(20 + seed)
    W = rng.integers(-2, 3, size=(30, 4)).astype(np.float64)
    b = rng.integers(-1, 2, size=30).astype(np.float64) if with_bias else None
    _check_against_oracle(W, b)


def test_the_orthant_decides_differently_from_r_d_where_it_should():
    """Row 0 lies below row 1 in every coordinate: it cannot win for z >= 0, yet z = (-1, -1) makes it win in
    R^d (it is outside the hull of the others)."""
    W = np.array([[1.0, 1.0], [2.0, 2.0], [3.0, 0.0], [0.0, 3.0]])
    plain = auditor.audit(W, progress=False)
    orthant = auditor.audit(W, domain="nonneg", progress=False)
    assert [t.verdict for t in plain.tokens] == ["argmaxable"] * 4
    assert [t.verdict for t in orthant.tokens] == ["unargmaxable", "argmaxable", "argmaxable", "argmaxable"]
    first = orthant.tokens[0]
    assert np.all(first.convex_weights @ W[first.convex_indices] >= W[0])
    assert auditor.verify(orthant, W).ok
    # the same weights are no certificate in R^d: w_0 is not a combination of other rows
    assert 0 in auditor.verify(_as_domain(orthant, "unbounded"), W).failed


def test_a_token_that_wins_on_its_bias_alone_has_the_origin_as_witness():
    W = np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, -1.0], [2.0, 2.0]])
    b = np.array([0.0, 0.0, 1.0, -0.5])
    report = _check_against_oracle(W, b)
    assert report.tokens[2].verdict == "argmaxable"
    assert np.all(report.tokens[2].witness == 0)


def _as_domain(report, domain):
    """The report's certificates document, claimed for ``domain``."""
    document = json.loads(json.dumps(report.to_dict()))
    document["domain"] = domain
    return document


def test_every_token_argmaxable_in_the_orthant_is_argmaxable_in_r_d():
    rng = np.random.default_rng(5)
    for with_bias in (False, True):
        W = rng.normal(size=(60, 6))
        b = rng.normal(size=60) if with_bias else None
        plain = [t.verdict for t in auditor.audit(W, b, progress=False).tokens]
        orthant = [t.verdict for t in auditor.audit(W, b, domain="nonneg", progress=False).tokens]
        assert all(p == "argmaxable" for p, o in zip(plain, orthant) if o == "argmaxable")
        assert orthant.count("unargmaxable") > plain.count("unargmaxable")


def test_verdicts_keep_the_invariances():
    rng = np.random.default_rng(7)
    W = rng.normal(size=(40, 5))
    b = rng.normal(size=40)
    base = [t.verdict for t in auditor.audit(W, b, domain="nonneg", progress=False).tokens]
    shifted = W + rng.normal(size=5)[None, :]  # every logit moves by v.z: no order changes
    moved = [t.verdict for t in auditor.audit(shifted, b + 3.0, domain="nonneg", progress=False).tokens]
    scaled = [t.verdict for t in auditor.audit(W * 2.0**-7, b * 2.0**-7, domain="nonneg", progress=False).tokens]
    ball = [t.verdict for t in auditor.audit(W, b, domain="nonneg:2", progress=False).tokens]
    ball_scaled = [t.verdict for t in auditor.audit(W * 4.0, b, domain="nonneg:0.5", progress=False).tokens]
    assert base == moved == scaled
    assert ball == ball_scaled


def test_the_checker_refuses_what_holds_only_in_another_domain():
    W = np.array([[1.0, 1.0], [2.0, 2.0], [3.0, 0.0], [0.0, 3.0]])
    report = auditor.audit(W, domain="nonneg", progress=False)
    document = _as_domain(report, "nonneg")
    assert auditor.verify(document, W).ok
    # a witness with a negative coordinate is outside the domain, though it wins
    bad = json.loads(json.dumps(document))
    token = next(t for t in bad["tokens"] if t["verdict"] == "argmaxable" and t["id"] == 2)
    token["witness"] = [1.0, -1.0]
    token.pop("witness_formula", None)
    result = auditor.verify(bad, W)
    assert not result.ok and any("outside the nonneg domain" in r for r in result.reasons[2])
    # weights that fall short of w_0 in one coordinate: the positive part of the residual is not small
    bad = json.loads(json.dumps(document))
    token = next(t for t in bad["tokens"] if t["id"] == 0)
    token["convex"].update(indices=[2], weights=[1.0])
    result = auditor.verify(bad, W)
    assert not result.ok and 0 in result.failed


def test_domain_parsing_and_refusals():
    assert parse_domain("nonneg") == NonNeg() and str(parse_domain("NonNeg:2.5")) == "nonneg:2.5"
    for text in ("nonneg:", "nonneg:x", "nonneg:-1", "nonneg:0"):
        with pytest.raises(InputError):
            parse_domain(text)
    with pytest.raises(InputError, match="ceilings"):
        auditor.audit(np.eye(3), domain="nonneg:1", probability_ceiling=True, progress=False)
    with pytest.raises(InputError, match="unbounded domain"):
        auditor.audit((np.eye(3), np.eye(3)), domain="nonneg", progress=False)


def test_the_command_line_names_the_domain_and_its_certificates_verify(tmp_path):
    W = np.array([[1.0, 1.0], [2.0, 2.0], [3.0, -1.0], [-1.0, 3.0], [0.5, 0.5]], dtype=np.float32)
    path = tmp_path / "head.safetensors"
    save_file({"lm_head.weight": W}, str(path))
    certificates = tmp_path / "certs.json"
    done = run_command(audit_main, path, "--domain", "nonneg", "--quiet", "--certificates", certificates)
    assert done.returncode == 1  # tokens 0 and 4 are unargmaxable over z >= 0
    assert "domain   nonneg" in done.stdout
    done = run_command(audit_main, path, "--domain", "nonneg", "--quiet", "--format", "json")
    document = json.loads(done.stdout)
    assert document["domain"] == "nonneg"
    assert sorted(f["id"] for f in document["findings"]) == [0, 4]
    for form in ("markdown", "html"):
        assert "nonneg" in run_command(audit_main, path, "--domain", "nonneg", "--quiet", "--format", form).stdout
    assert run_command(verify_main, certificates, path).returncode == 0
    refused = run_command(verify_main, certificates, path, "--domain", "unbounded")
    assert refused.returncode == 2
    bad = run_command(audit_main, path, "--domain", "nonneg:abc", "--quiet")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_rows_whose_squares_underflow_get_no_false_certificate_with_a_radius():
    """Rows of entries near 2^-570: a norm formed from plain squares is 0 there, and a dual bound built on it
    took r ||x_+|| for 0. Token 0 wins at z = (0.075, 0.25, 0) by about 0.0375 * 2^-570."""
    tiny = 2.0**-570
    near = np.array([[1, 1.5, 0], [2, 0, 0], [2, 1.15, 0], [0.6, 1.6, 0], [0, 1.2, 0]]) * tiny
    far = np.array([[0, 0, c] for c in (1, 2, 3, -1, -2, -3)], dtype=np.float64)
    W = np.vstack([near, far])
    z = np.array([0.075, 0.25, 0.0])
    logits = W @ z
    assert logits[0] > np.delete(logits, 0).max()  # the win, in float64 (exact: the entries are dyadic)
    for domain in ("nonneg:1", "nonneg"):
        report = auditor.audit(W, domain=domain, progress=False)
        assert report.tokens[0].verdict != "unargmaxable"
        assert auditor.verify(report, W).ok


def test_the_checker_refuses_a_probability_point_outside_the_orthant():
    W = np.array([[1.0, 1.0], [2.0, 2.0], [3.0, 0.0], [0.0, 3.0]])
    document = _as_domain(auditor.audit(W, domain="nonneg", progress=False), "nonneg")
    token = next(t for t in document["tokens"] if t["id"] == 0)
    token["max_probability"] = {"lower": 0.99, "upper": 1.0, "point": [-10.0, -10.0]}
    result = auditor.verify(document, W)
    assert 0 in result.failed and any("outside the nonneg domain" in r for r in result.reasons[0])


@pytest.mark.parametrize("domain", ["nonneg:1", "ball:1", "box:1"])
def test_a_bias_gap_negative_by_rounding_alone_does_not_pay_for_a_positive_dual_value(domain):
    """Token 0 wins (by about 0.05 at its witness); weights (1/3, 2/3) on rows 1 and 2 give a bias gap of
    exactly -4.6e-18, zero up to rounding, and a dual value far above 0. The exact gap's sign must not be
    used as a value of -1."""
    b_0 = float(np.nextafter(0.1, 0))
    W = np.array([[0.25, 0.25], [0.0, 0.0], [0.0, 0.5]])
    b = np.array([b_0, 0.3, 0.0])
    document = _as_domain(auditor.audit(W, b, domain=domain, progress=False), domain)
    assert document["tokens"][0]["verdict"] == "argmaxable"
    token = document["tokens"][0]
    token.clear()
    token.update(id=0, verdict="unargmaxable",
                 convex={"indices": [1, 2], "weights": [1 / 3, 2 / 3], "residual": 5.0, "bias_gap": 0.0})
    document["counts"]["argmaxable"] -= 1
    document["counts"]["unargmaxable"] += 1
    result = auditor.verify(document, W, b)
    assert 0 in result.failed
