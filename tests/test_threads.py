"""threads= and --threads N: the count torch uses during an audit, put back afterwards, and stated in the report."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import auditor
import auditor.api
from auditor.util.threads import resolve_threads

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
SEED = np.array([[1, 2], [2, 1], [1, 0], [0, 1], [1, 1]], dtype=np.float32)


@pytest.fixture
def seen_inside(monkeypatch):
    """The thread counts torch had whenever the engine was asked to decide."""
    counts = []
    decide = auditor.api.decide

    def recording(*args, **kwargs):
        counts.append(torch.get_num_threads())
        return decide(*args, **kwargs)

    monkeypatch.setattr(auditor.api, "decide", recording)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    return counts


def test_threads_apply_during_the_audit_and_the_previous_count_returns(seen_inside):
    before = torch.get_num_threads()
    wanted = 1 if before != 1 else 2
    report = auditor.audit(SEED, threads=wanted, progress=False)
    assert seen_inside == [wanted] and report.threads == wanted
    assert torch.get_num_threads() == before


def test_previous_count_returns_when_the_audit_fails(seen_inside):
    before = torch.get_num_threads()
    with pytest.raises(auditor.InputError):
        auditor.audit(SEED, threads=1, domain="nowhere", progress=False)
    assert torch.get_num_threads() == before


def test_without_threads_torch_keeps_its_own_count(seen_inside):
    before = torch.get_num_threads()
    report = auditor.audit(SEED, progress=False)
    assert seen_inside == [before] and report.threads == before


def test_omp_num_threads_is_respected(seen_inside, monkeypatch):
    before = torch.get_num_threads()
    wanted = 1 if before != 1 else 2
    monkeypatch.setenv("OMP_NUM_THREADS", str(wanted))
    assert auditor.audit(SEED, progress=False).threads == wanted
    assert seen_inside == [wanted] and torch.get_num_threads() == before


def test_an_explicit_count_wins_over_omp_num_threads(seen_inside, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert auditor.audit(SEED, threads=1, progress=False).threads == 1


@pytest.mark.parametrize("threads", [0, -2, 1.5, "2", True])
def test_bad_thread_counts_are_refused(threads):
    with pytest.raises(auditor.InputError, match="threads must be a positive integer"):
        auditor.audit(SEED, threads=threads, progress=False)


@pytest.mark.parametrize("setting", ["0", "-1", "two", "2.5"])
def test_a_bad_omp_num_threads_is_refused(setting, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", setting)
    with pytest.raises(auditor.InputError, match="OMP_NUM_THREADS"):
        resolve_threads(None)


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "auditor", *map(str, args)], capture_output=True, text=True, env=env)


@pytest.mark.slow
def test_the_json_report_and_the_text_header_state_the_threads():
    done = run(FIXTURES / "seed_2d.safetensors", "--threads", "1", "--format", "json", "--quiet")
    assert done.returncode == 1
    assert json.loads(done.stdout)["run"]["threads"] == 1
    text = run(FIXTURES / "seed_2d.safetensors", "--threads", "1", "--quiet").stdout
    assert "threads  1 CPU thread\n" in text


@pytest.mark.slow
@pytest.mark.parametrize("value", ["0", "-1", "x"])
def test_the_command_refuses_a_bad_thread_count_in_one_line(value):
    done = run(FIXTURES / "seed_2d.safetensors", "--threads", value)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and "--threads" in done.stderr


@pytest.mark.slow
def test_the_command_refuses_a_bad_omp_num_threads_in_one_line():
    import os

    done = run(FIXTURES / "seed_2d.safetensors", env={**os.environ, "OMP_NUM_THREADS": "none"})
    assert done.returncode == 2 and done.stdout == ""
    assert "audit: error: OMP_NUM_THREADS='none' is not a positive integer" in done.stderr
    assert "Traceback" not in done.stderr


def _openmp_spin_count(policy: str | None) -> str | None:
    """GOMP_SPINCOUNT as libgomp took it in a fresh process that imports auditor, then torch (OMP_DISPLAY_ENV makes
    libgomp print its settings when torch loads it); None where torch's OpenMP is not libgomp."""
    root = Path(__file__).resolve().parent.parent
    env = {key: value for key, value in os.environ.items() if key != "OMP_WAIT_POLICY"}
    env.update(OMP_DISPLAY_ENV="VERBOSE", PYTHONPATH=str(root))
    if policy is not None:
        env["OMP_WAIT_POLICY"] = policy
    done = subprocess.run([sys.executable, "-c", "import auditor, torch; torch.ones(64) + 1"], env=env,
                          capture_output=True, text=True, check=True, cwd=root)
    found = re.search(r"GOMP_SPINCOUNT = '([0-9]+)'", done.stderr)
    return None if found is None else found[1]


def test_torchs_openmp_threads_wait_passively_unless_the_environment_chose():
    """A spinning thread holds a core a busy neighbour needs (bench/contention.py): after import auditor, torch's
    libgomp waits without spinning; an OMP_WAIT_POLICY already set is kept."""
    passive = _openmp_spin_count(None)
    if passive is None:
        pytest.skip("torch's OpenMP runtime is not libgomp here")
    assert passive == "0"
    assert _openmp_spin_count("ACTIVE") != "0"
