"""--baseline: findings are new or unchanged against an earlier report of the same vocabulary;
only new ones fail, fixed ones are listed, and a baseline of another vocabulary or domain is an error."""

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from auditor.cli.audit import main
from conftest import run_command

N, D = 300, 4


def audit(*args):
    return run_command(main, *args, "--quiet")  # in this process: the command's output, not its start-up


def model_folder(path, W, strings):
    path.mkdir()
    save_file({"lm_head.weight": W.astype(np.float32)}, str(path / "model.safetensors"))
    (path / "vocab.txt").write_text("\n".join(strings) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """base: N rows on a sphere (all argmaxable) and a copied pair (0 = N - 1); resized: the same plus
    two rows at the mean and a copy of row 5, with token strings for the old rows only."""
    rng = np.random.default_rng(3)
    W = rng.standard_normal((N, D))
    W /= np.linalg.norm(W, axis=1, keepdims=True)
    W[N - 1] = W[0]
    strings = [f"t{k}" for k in range(N)]
    root = tmp_path_factory.mktemp("baseline")
    base = model_folder(root / "base", W, strings)
    resized_rows = np.vstack([W, np.tile(W.mean(axis=0), (2, 1)) + 1e-7 * rng.standard_normal((2, D)), W[5:6]])
    resized = model_folder(root / "resized", resized_rows, strings)
    base_report = root / "base.json"
    done = audit(base, "--format", "json", "--output", base_report)
    assert done.returncode == 1, done.stderr  # the copied pair
    return {"base": base, "resized": resized, "base_report": base_report, "root": root, "W": W}


@pytest.mark.slow
def test_only_the_rows_added_since_the_base_model_fail(models):
    done = audit(models["resized"], "--baseline", models["base_report"], "--format", "json")
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    marks = {f["id"]: f["baseline"] for f in report["findings"]}
    assert marks == {0: "unchanged", N - 1: "unchanged", N: "new", N + 1: "new", 5: "new", N + 2: "new"}
    # 5 is the lowest id of a tied group that can win: greedy decoding emits it, so it does not fail
    assert {f["id"] for f in report["findings"] if f["failing"]} == {N, N + 1, N + 2}
    assert report["summary"]["failing"] == 3
    assert report["baseline"]["fixed"] == [] and report["baseline"]["new"] == 4


@pytest.mark.slow
def test_a_report_as_its_own_baseline_passes(models):
    own = models["root"] / "resized.json"
    assert audit(models["resized"], "--format", "json", "--output", own).returncode == 1
    done = audit(models["resized"], "--baseline", own)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[new]" not in done.stdout


def test_fixed_findings_are_listed_and_nothing_fails(models, tmp_path):
    W = models["W"].copy()
    W[N - 1] = -W[0]  # the copy is trained apart: no finding is left
    fixed = model_folder(tmp_path / "fixed", W, [f"t{k}" for k in range(N)])
    done = audit(fixed, "--baseline", models["base_report"], "--format", "json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["findings"] == []
    assert {(f["id"], f["verdict"]) for f in report["baseline"]["fixed"]} == {(0, "tied"), (N - 1, "tied")}


@pytest.mark.slow
@pytest.mark.parametrize("fmt, mark", [("text", "[new]"), ("markdown", "new")])
def test_every_format_marks_new_findings(models, fmt, mark):
    done = audit(models["resized"], "--baseline", models["base_report"], "--format", fmt)
    assert done.returncode == 1
    assert mark in done.stdout and "unchanged" in done.stdout


def test_another_vocabulary_is_an_error(models, tmp_path):
    other = model_folder(tmp_path / "other", models["W"][:N - 10], [f"t{k}" for k in range(N - 10)])
    done = audit(other, "--baseline", models["base_report"])
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "a vocabulary of 300 tokens, this head has 290" in done.stderr


def test_same_size_with_other_token_strings_is_an_error(models, tmp_path):
    renamed = model_folder(tmp_path / "renamed", models["W"], [f"other{k}" for k in range(N)])
    done = audit(renamed, "--baseline", models["base_report"])
    assert done.returncode == 2 and "another vocabulary" in done.stderr


def test_a_resized_head_must_keep_the_baseline_token_strings(models, tmp_path):
    rows = np.vstack([models["W"], models["W"][:1] * 0.5])
    grown = model_folder(tmp_path / "grown", rows, [f"x{k}" for k in range(N + 1)])
    done = audit(grown, "--baseline", models["base_report"])
    assert done.returncode == 2 and "first token strings differ" in done.stderr


def test_another_domain_is_an_error(models):
    done = audit(models["resized"], "--baseline", models["base_report"], "--domain", "ball:5")
    assert done.returncode == 2 and "domain" in done.stderr


@pytest.mark.slow
def test_files_that_are_not_reports_are_refused(models, tmp_path):
    certificates = tmp_path / "certs.json"
    assert audit(models["base"], "--certificates", certificates).returncode == 1
    for path, words in ((tmp_path / "absent.json", "no such file"), (certificates, "certificates file")):
        done = audit(models["resized"], "--baseline", path)
        assert done.returncode == 2 and words in done.stderr and done.stderr.count("\n") == 1


def test_unused_allow_list_entries_are_warned_about(models, tmp_path):
    allow = tmp_path / "allow.txt"
    allow.write_text(f"0\n{N - 1}\n17\nnot-a-token\n99999\n", encoding="utf-8")
    done = audit(models["base"], "--allow", allow, "--format", "json")
    assert done.returncode == 0
    warnings = json.loads(done.stdout)["warnings"]
    assert warnings == ["allow-list entry 99999 is not a token id of this head (0..299)",
                        "allow-list entry 17 matches no finding",
                        'allow-list entry "not-a-token" matches no finding']
    assert done.stderr.count("audit: warning: ") == 3


def test_another_ceiling_is_an_error(models):
    done = audit(models["resized"], "--baseline", models["base_report"], "--domain", "unbounded", "--ceiling", "0.5")
    assert done.returncode == 2 and "--ceiling" in done.stderr and done.stderr.count("\n") == 1


def test_allow_list_entries_for_tokens_not_audited_are_not_stale(models, tmp_path):
    allow = tmp_path / "allow.txt"
    allow.write_text(f"{N - 1}\n", encoding="utf-8")
    done = audit(models["base"], "--allow", allow, "--tokens", "0-10", "--format", "json")
    assert json.loads(done.stdout)["warnings"] == []
