"""The ``audit`` command on the committed fixtures: exit codes, text and JSON."""

import errno
import json
import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from auditor.cli.audit import main
from auditor.errors import InputError
from auditor.util.io import write_atomically
from conftest import run_command

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def run(*args):
    return run_command(main, *args)  # in this process; test_stdout.py runs `python -m auditor` itself


@pytest.mark.slow
def test_demo_head_findings_are_the_resized_rows_the_copy_and_nothing_else():
    done = run(FIXTURES / "resized_demo.safetensors", "--format", "json", "--quiet")
    assert done.returncode == 1
    report = json.loads(done.stdout)
    findings = {entry["id"]: entry["verdict"] for entry in report["findings"]}
    added = {k: "unargmaxable" for k in (4000, 4001, 4002, 4003)}
    assert {k: v for k, v in findings.items() if k >= 4000 or v == "tied"} == {**added, 17: "tied", 4004: "tied"}
    assert done.stderr == ""


@pytest.mark.slow
def test_seed_fixture_text_report_names_the_middle_row():
    done = run(FIXTURES / "seed_2d.safetensors", "--quiet")
    assert done.returncode == 1
    assert "unargmaxable 1" in done.stdout
    assert any(line.split()[:2] == ["4", "unargmaxable"] for line in done.stdout.splitlines())


def test_a_clean_head_exits_zero(tmp_path):
    path = tmp_path / "clean.safetensors"
    save_file({"weight": np.eye(4, dtype=np.float32)}, str(path))
    assert run(path, "--quiet").returncode == 0


def test_missing_file_is_one_line_and_exit_two(tmp_path):
    done = run(tmp_path / "absent.safetensors")
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "no such file" in done.stderr


@pytest.mark.slow
def test_truncated_file_is_exit_two_without_traceback(tmp_path):
    path = tmp_path / "cut.safetensors"
    path.write_bytes((FIXTURES / "resized_demo.safetensors").read_bytes()[:1000])
    done = run(path)
    assert done.returncode == 2 and "Traceback" not in done.stderr


@pytest.mark.slow
def test_nan_weights_name_the_row_and_exit_two(tmp_path):
    weight = np.ones((5, 3), dtype=np.float32)
    weight[3, 2] = np.nan
    path = tmp_path / "nan.safetensors"
    save_file({"weight": weight}, str(path))
    done = run(path)
    assert done.returncode == 2 and "rows 3" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow
def test_an_empty_token_list_is_an_error_not_the_whole_vocabulary():
    for empty in ("", " , "):
        done = run(FIXTURES / "seed_2d.safetensors", "--tokens", empty, "--quiet")
        assert done.returncode == 2 and "--tokens: no token ids given" in done.stderr, repr(empty)
        assert done.stdout == ""


@pytest.mark.slow
def test_help_ends_with_the_exit_codes_and_examples():
    done = run("--help")
    assert done.returncode == 0
    epilog = done.stdout[done.stdout.index("exit codes:"):]
    for line in ("0  no failing finding", "1  failing findings", "2  usage, load or input error"):
        assert line in epilog
    assert "audit model/ --domain norm --ceiling 0.5" in epilog and "audit-merge part1.json" in epilog


def test_a_failed_write_names_the_file_and_leaves_nothing_behind(tmp_path, monkeypatch):
    def refuse(source, target):  # as a rename into a folder we may not write to fails (root passes access checks)
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(os, "replace", refuse)
    target = tmp_path / "report.md"
    with pytest.raises(InputError, match=f"cannot write {target}: Permission denied"):
        write_atomically({target: "# report\n"})
    assert list(tmp_path.iterdir()) == []
