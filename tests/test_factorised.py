"""Factorised heads W = U V: decided exactly on U in R^r when V has full row rank, with Qhull as the oracle."""

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

import auditor
from conftest import run_module
from oracles import qhull_argmaxable


def factorised_head(rng, n=40, r=3, d=6, planted=6):
    """U with ``planted`` rows strictly inside the hull of the others (convex weights over 5 of them), V of full
    row rank."""
    U = rng.normal(size=(n, r))
    for k in range(n - planted, n):
        chosen = rng.choice(n - planted, size=5, replace=False)
        U[k] = rng.dirichlet(np.ones(5)) @ U[chosen]
    V = rng.normal(size=(r, d))
    return U, V


def verdicts(report):
    return [report.tokens[k].verdict for k in range(report.n_tokens)]


def test_verdicts_of_the_pair_are_those_of_the_product_and_of_qhull(rng):
    U, V = factorised_head(rng)
    report = auditor.audit((U, V), progress=False)
    product = auditor.audit(U @ V, progress=False)  # formed in float64
    hull = qhull_argmaxable(U)
    expected = ["argmaxable" if k in hull else "unargmaxable" for k in range(U.shape[0])]
    assert verdicts(report) == expected == verdicts(product)
    assert set(report.ids("unargmaxable")) >= set(range(34, 40))


def test_with_a_bias_the_verdicts_are_those_of_qhull_on_u(rng):
    U, V = factorised_head(rng, planted=4)
    b = rng.normal(scale=0.3, size=U.shape[0])
    report = auditor.audit((U, V), b, progress=False)
    hull = qhull_argmaxable(U, b)
    assert verdicts(report) == ["argmaxable" if k in hull else "unargmaxable" for k in range(U.shape[0])]
    assert verdicts(report) == verdicts(auditor.audit(U @ V, b, progress=False))


def test_the_report_says_it_decided_on_u_and_its_certificates_hold_on_u(rng):
    U, V = factorised_head(rng)
    U32, V32 = U.astype(np.float32), torch.tensor(V, dtype=torch.float32)  # numpy and torch mixed
    report = auditor.audit((U32, V32), progress=False)
    assert (report.factorised.inner_dimension, report.factorised.hidden_size) == (3, 6)
    assert report.hidden_size == 3
    assert all(len(report.tokens[k].witness) == 3 for k in report.ids("argmaxable"))
    stated = report.to_dict()["head"]["factorised"]
    assert stated["inner_dimension"] == 3 and stated["hidden_size"] == 6 and "full row rank" in stated["note"]
    assert auditor.verify(report, U32).ok
    # a witness y in R^r is reached by z = V^+ y, at which W z = U y: the token wins for W too
    k = report.ids("argmaxable")[0]
    y = report.tokens[k].witness
    logits = (U32.astype(np.float64) @ V) @ np.linalg.lstsq(V, y, rcond=None)[0]
    assert int(np.argmax(logits)) == k


def test_a_plain_head_reports_no_factorisation():
    assert auditor.audit(np.eye(3), progress=False).factorised is None


def test_a_rank_deficient_v_is_refused(rng):
    U, V = factorised_head(rng)
    V[2] = V[0] - 2 * V[1]
    with pytest.raises(auditor.InputError, match="full row rank.*pass the product"):
        auditor.audit((U, V), progress=False)


def test_an_inner_dimension_above_the_hidden_size_is_refused(rng):
    with pytest.raises(auditor.InputError, match="exceeds the hidden size"):
        auditor.audit((rng.normal(size=(10, 4)), rng.normal(size=(4, 3))), progress=False)


@pytest.mark.parametrize("domain", ["ball:1", "box:2", auditor.Ball(3.0)])
def test_bounded_domains_are_refused(rng, domain):
    U, V = factorised_head(rng)
    with pytest.raises(auditor.InputError, match="only in the unbounded domain"):
        auditor.audit((U, V), domain=domain, progress=False)


def test_factors_that_do_not_multiply_are_refused(rng):
    with pytest.raises(auditor.InputError, match="do not multiply"):
        auditor.audit((rng.normal(size=(10, 3)), rng.normal(size=(4, 6))), progress=False)


def test_nan_in_v_is_refused(rng):
    U, V = factorised_head(rng)
    V[1, 2] = np.nan
    with pytest.raises(auditor.InputError, match="NaN or Inf entries in rows 1"):
        auditor.audit((U, V), progress=False)


def test_a_triple_is_refused(rng):
    U, V = factorised_head(rng)
    with pytest.raises(auditor.InputError, match="pair"):
        auditor.audit((U, V, V), progress=False)


# -- the command: --weight A@B -----------------------------------------------------------------------------


def run(*args, module="auditor"):
    return run_module(module, *args)  # in this process: the command's output, not an interpreter's start-up


@pytest.fixture
def checkpoint(tmp_path, rng):
    """down.weight (n x r) and up.weight (d x r, as nn.Linear stores it): the head is down @ up.T."""
    U, V = factorised_head(rng)
    path = tmp_path / "factorised.safetensors"
    save_file({"down.weight": U.astype(np.float32), "up.weight": V.T.astype(np.float32).copy(),
               "plain.weight": U.astype(np.float32), "square": np.eye(3, dtype=np.float32)}, str(path))
    return path, U


@pytest.mark.slow
def test_the_command_audits_a_named_product_and_says_so(checkpoint):
    path, U = checkpoint
    done = run(path, "--weight", "down.weight@up.weight.T", "--format", "json", "--quiet")
    assert done.returncode == 1, done.stderr
    document = json.loads(done.stdout)
    assert document["head"]["weight"] == "down.weight@up.weight.T"
    assert document["head"]["shape"] == [40, 3]
    assert document["head"]["factorised"]["inner_dimension"] == 3
    assert document["head"]["factorised"]["hidden_size"] == 6
    hull = qhull_argmaxable(U.astype(np.float32).astype(np.float64))
    assert {f["id"] for f in document["findings"]} == set(range(40)) - hull
    text = run(path, "--weight", "down.weight@up.weight.T", "--quiet").stdout
    assert "factors  W = U V with V 3 x 6 of full row rank" in text


def test_a_clean_factorised_head_exits_zero(tmp_path):
    angles = np.linspace(0, 2 * np.pi, 7)[:-1]
    U = np.stack([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)  # distinct rows of equal norm
    path = tmp_path / "clean.safetensors"
    save_file({"a": U, "b": np.array([[1, 0, 0, 1], [0, 1, 1, 0]], dtype=np.float32)}, str(path))
    done = run(path, "--weight", "a@b", "--quiet")
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_the_transpose_suffix_is_needed_when_the_factors_do_not_multiply(checkpoint):
    path, _ = checkpoint
    done = run(path, "--weight", "down.weight@up.weight")
    assert done.returncode == 2 and "do not multiply" in done.stderr and "add or drop a .T" in done.stderr
    assert done.stderr.count("\n") == 1


@pytest.mark.slow
def test_a_name_that_is_a_tensor_is_not_read_as_a_transpose(tmp_path, rng):
    U, V = factorised_head(rng)
    path = tmp_path / "named.safetensors"
    save_file({"u": U.astype(np.float32), "v.T": V.astype(np.float32), "v": V.T.astype(np.float32).copy()},
              str(path))
    # "v.T" is a tensor (r x d), so it is taken as it is, not as v transposed
    done = run(path, "--weight", "u@v.T", "--format", "json", "--quiet")
    assert done.returncode == 1, done.stderr
    assert json.loads(done.stdout)["head"]["factorised"]["hidden_size"] == 6


@pytest.mark.parametrize("weight, message", [("down.weight@absent", "no tensor named 'absent'"),
                                             ("down.weight@", "name one tensor, or two as A@B"),
                                             ("down.weight@up.weight.T", "only in the unbounded domain")])
@pytest.mark.slow
def test_bad_products_are_one_line_errors(checkpoint, weight, message):
    path, _ = checkpoint
    done = run(path, "--weight", weight, "--domain", "ball:1")
    assert done.returncode == 2 and message in done.stderr and done.stderr.count("\n") == 1


@pytest.mark.slow
def test_a_rank_deficient_factor_is_a_one_line_error(tmp_path, rng):
    path = tmp_path / "deficient.safetensors"
    V = rng.normal(size=(3, 6))
    V[2] = V[0]
    save_file({"u": rng.normal(size=(10, 3)).astype(np.float32), "v": V.astype(np.float32)}, str(path))
    done = run(path, "--weight", "u@v")
    assert done.returncode == 2 and "does not have full row rank" in done.stderr


@pytest.mark.slow
def test_certificates_state_the_factorisation_and_audit_verify_checks_them_on_u(checkpoint, tmp_path):
    path, _ = checkpoint
    certificates = tmp_path / "certificates.json"
    done = run(path, "--weight", "down.weight@up.weight.T", "--certificates", certificates, "--quiet")
    assert done.returncode == 1, done.stderr
    document = json.loads(certificates.read_text())
    assert document["head"]["factorised"]["hidden_size"] == 6 and document["head"]["hidden_size"] == 3
    verified = run(certificates, path, "--weight", "down.weight@up.weight.T", module="auditor.cli.verify")
    assert verified.returncode == 0 and "all hold" in verified.stdout, verified.stderr
    # the same certificates against the plain U: refused, pointing at the product the audit read
    refused = run(certificates, path, "--weight", "plain.weight", module="auditor.cli.verify")
    assert refused.returncode == 2 and "--weight down.weight@up.weight.T" in refused.stderr


@pytest.mark.slow
def test_audit_verify_refuses_a_product_for_certificates_of_a_plain_head(checkpoint, tmp_path):
    path, _ = checkpoint
    certificates = tmp_path / "certificates.json"
    assert run(path, "--weight", "plain.weight", "--certificates", certificates, "--quiet").returncode == 1
    refused = run(certificates, path, "--weight", "down.weight@up.weight.T", module="auditor.cli.verify")
    assert refused.returncode == 2 and "is for a plain one" in refused.stderr
