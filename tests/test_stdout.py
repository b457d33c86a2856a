"""Standard output carries the report and nothing else, with every stage running, the exact LP included.

The resized demo is settled partly by the LP stage (HiGHS through cvxpy), whose banner went to
standard output; the probability ceilings' fallback runs Clarabel. Their output must not reach it.
"""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from report_masks import masked

from auditor.engine.ceiling.fallback import cvxpy_point
from auditor.question.domain import Ball

ROOT = Path(__file__).resolve().parent.parent
DEMO = "fixtures/resized_demo.safetensors"  # relative to ROOT, as the golden reports name it


def audit_stdout(*args):
    done = subprocess.run([sys.executable, "-m", "auditor", DEMO, *args], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 1, done.stderr  # the demo has findings
    return done.stdout


def test_json_on_stdout_parses_when_the_lp_stage_runs():
    report = json.loads(audit_stdout("--format", "json", "--quiet"))  # json.loads refuses anything around it
    assert report["timing"]["lp_s"] > 0  # the LP stage did run
    assert report["summary"]


@pytest.mark.slow
def test_markdown_on_stdout_is_the_report_alone_with_progress_shown():
    golden = (ROOT / "tests" / "golden" / "resized_demo.markdown").read_text(encoding="utf-8")
    shown = audit_stdout("--format", "markdown", "--threads", "2")  # progress on: it goes to stderr
    assert "HiGHS" not in shown
    assert masked(shown) == masked(golden)  # the report, character for character, and nothing else


@pytest.mark.slow
def test_quiet_stdout_silences_what_native_code_writes_to_descriptor_1():
    code = ("import os; from auditor.util.io import quiet_stdout\n"
            "with quiet_stdout():\n    os.write(1, b'banner'); print('printed')\n"
            "print('report')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "report\n", done.stdout


def test_with_debug_the_solvers_own_lines_go_to_stderr_and_stdout_stays_json(tmp_path):
    # a head of two dimensions: its tokens past the screen go to the exact LP first (HiGHS)
    angles = np.linspace(0, 2 * np.pi, 40, endpoint=False)
    rows = np.vstack([np.stack([np.cos(angles), np.sin(angles)], axis=1), [[0.3, 0.2], [0.99, 0.0]]])
    np.save(tmp_path / "head.npy", rows)
    done = subprocess.run([sys.executable, "-m", "auditor", str(tmp_path / "head.npy"), "--format", "json", "--quiet",
                           "--debug"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    assert report["timing"]["lp_s"] > 0 and report["timing"]["frank_wolfe_s"] < 1e-3
    assert "HiGHS" in done.stderr  # the banner the LP solver prints on its standard output


def test_send_solver_output_to_stderr_moves_descriptor_1_inside_the_block_only():
    code = ("import os; from auditor.util.io import quiet_stdout, send_solver_output_to_stderr\n"
            "send_solver_output_to_stderr()\n"
            "with quiet_stdout():\n    os.write(1, b'banner')\n"
            "print('report')")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "report\n" and done.stderr == "banner", (done.stdout, done.stderr)


def test_the_ceilings_interior_point_fallback_prints_nothing(capfd):
    rng = np.random.default_rng(0)
    weight = torch.as_tensor(rng.standard_normal((30, 4)))
    point = cvxpy_point(weight, None, 3, Ball(2.0))
    assert point is not None and point.shape == (4,)
    assert capfd.readouterr().out == ""
