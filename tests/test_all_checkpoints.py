"""``audit OUTPUT_DIR --all-checkpoints``: every checkpoint-N/ folder of a Trainer's output folder audited alike,
in step order, as one trend table (text or JSON); the exit code is the latest checkpoint's gate."""

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from auditor.cli.audit import main

TOKENS = ["a", "b", "c", "-a", "-b", "-c", "<tool>", "copy"]
OCTAHEDRON = np.vstack([np.eye(3), -np.eye(3)])  # rows 0-5: each a vertex of the hull


def _head(tool: float, copied: bool) -> np.ndarray:
    """Row 6 (<tool>) at ``tool`` * (1, 1, 1): at 0, the exact mean of rows 0-5, inside their hull (unargmaxable);
    past the face x + y + z = 1 (tool > 1/3), a vertex that leaves rows 0-5 vertices. Row 7 (copy) is row 0
    again when ``copied`` (tied: greedy decoding never emits 7), else a row of its own outside the hull."""
    copy = OCTAHEDRON[0] if copied else np.array([0.9, -1.2, 0.6])
    return np.vstack([OCTAHEDRON, np.full(3, tool), copy]).astype(np.float32)


def _trainer_folder(root: Path, heads: dict[int, np.ndarray]) -> Path:
    """A Trainer output folder: checkpoint-N/ with model.safetensors and vocab.txt for each step N."""
    out = root / "out"
    for step, weight in heads.items():
        folder = out / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        save_file({"lm_head.weight": weight}, str(folder / "model.safetensors"))
        (folder / "vocab.txt").write_text("\n".join(TOKENS) + "\n", encoding="utf-8")
    return out


@pytest.fixture
def training_run(tmp_path) -> Path:
    """<tool> mean-initialised at step 10, trained out of the hull by step 20; the copied row re-initialised by
    step 100 (whose name sorts before checkpoint-20's: the order is the steps')."""
    return _trainer_folder(tmp_path, {10: _head(0.0, True), 20: _head(0.5, True), 100: _head(1.0, False)})


def _audit(capsys, *args) -> tuple[int, str, str]:
    code = main([*map(str, args)])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _rows(text: str) -> list[list[str]]:
    """The table's rows, cells split on spaces, the min-margin column left out (its value is checked apart)."""
    lines = text.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("checkpoint "))
    rows = []
    for line in lines[header:]:
        if not line.strip():
            break
        cells = line.replace("min margin", "min-margin").split()
        rows.append(cells[:6] + cells[7:])
    return rows


def test_one_row_per_checkpoint_in_step_order_and_the_exit_code_is_the_latest_gate(capsys, training_run):
    code, out, err = _audit(capsys, training_run, "--all-checkpoints", "--quiet")
    assert code == 0, err  # checkpoint-100 passes; the failing earlier ones do not count
    assert err == ""
    assert out.splitlines()[0] == (f"trend    {training_run}: 3 checkpoints in step order; the exit code is "
                                   f"checkpoint-100's gate")
    assert _rows(out) == [
        ["checkpoint", "step", "unargmaxable", "never-emitted", "tied", "inconclusive", "gate"],
        ["checkpoint-10", "10", "1", "2", "2", "0", "fail", "(2", "failing)"],  # <tool>, and copy 7 of row 0
        ["checkpoint-20", "20", "0", "1", "2", "0", "fail", "(1", "failing)"],
        ["checkpoint-100", "100", "0", "0", "0", "0", "pass"],
    ]
    margins = [float(line.split()[6]) for line in out.splitlines() if line.startswith("checkpoint-")]
    assert margins[:2] == [0.0, 0.0] and margins[2] > 0  # 0 while a token cannot be produced
    assert "changed" not in out  # without --tokens no token is watched


def test_watched_tokens_that_change_verdict_are_named_with_the_checkpoint(capsys, training_run):
    code, out, err = _audit(capsys, training_run, "--all-checkpoints", "--tokens", "<tool>", "--quiet")
    assert code == 0, err
    assert [row[2:5] for row in _rows(out)[1:]] == [["1", "1", "0"], ["0", "0", "0"], ["0", "0", "0"]]
    assert [line for line in out.splitlines() if line.startswith("changed")] == [
        "changed  '<tool>' (id 6) argmaxable from checkpoint-20 (unargmaxable before)"]


def test_json_is_a_list_of_per_checkpoint_summaries(capsys, training_run):
    code, out, err = _audit(capsys, training_run, "--all-checkpoints", "--tokens", "<tool>,copy", "--format",
                            "json", "--quiet")
    assert code == 0, err
    trend = json.loads(out)
    assert [(c["checkpoint"], c["step"], c["gate"], c["exit_code"], c["failing"]) for c in trend] == [
        ("checkpoint-10", 10, "fail", 1, 2), ("checkpoint-20", 20, "fail", 1, 1), ("checkpoint-100", 100, "pass", 0, 0)]
    assert trend[0]["summary"] == {"n_tokens": 8, "argmaxable": 0, "unargmaxable": 1, "tied": 1, "inconclusive": 0,
                                   "undecided": 6, "never_emitted": 2}
    assert trend[0]["path"] == str(training_run / "checkpoint-10")
    assert [[w["verdict"] for w in c["watched"]] for c in trend] == [
        ["unargmaxable", "tied"], ["argmaxable", "tied"], ["argmaxable", "argmaxable"]]
    assert [c["changed"] for c in trend] == [
        [],
        [{"id": 6, "token": "<tool>", "before": "unargmaxable", "after": "argmaxable"}],
        [{"id": 7, "token": "copy", "before": "tied", "after": "argmaxable"}],
    ]
    assert [c["min_margin"] for c in trend][:2] == [0.0, 0.0] and trend[2]["min_margin"] > 0


def test_a_latest_checkpoint_that_regressed_fails_the_run(capsys, tmp_path):
    out = _trainer_folder(tmp_path, {1: _head(1.0, False), 2: _head(0.0, False)})
    code, text, err = _audit(capsys, out, "--all-checkpoints", "--tokens", "<tool>", "--quiet")
    assert code == 1, err
    assert "changed  '<tool>' (id 6) unargmaxable from checkpoint-2 (argmaxable before)" in text


def test_progress_is_one_line_per_checkpoint_on_stderr_and_the_trend_can_go_to_a_file(capsys, training_run, tmp_path):
    target = tmp_path / "trend.json"
    code, out, err = _audit(capsys, training_run, "--all-checkpoints", "--format", "json", "--output", target)
    assert code == 0 and out == ""
    assert err.splitlines() == [
        "audit: checkpoint-10 (1/3): 1 unargmaxable, 2 never emitted, gate fail",
        "audit: checkpoint-20 (2/3): 0 unargmaxable, 1 never emitted, gate fail",
        "audit: checkpoint-100 (3/3): 0 unargmaxable, 0 never emitted, gate pass",
    ]
    assert [c["step"] for c in json.loads(target.read_text())] == [10, 20, 100]


@pytest.mark.parametrize("where,message", [
    ("checkpoint-10", "not a Trainer output folder (checkpoint-N/ folders), which --all-checkpoints needs"),
    ("checkpoint-10/model.safetensors", "not a Trainer output folder"),
    ("absent", "no such file or folder"),
])
def test_a_path_that_is_not_a_trainer_output_folder_is_one_error_line(capsys, training_run, where, message):
    code, out, err = _audit(capsys, training_run / where, "--all-checkpoints", "--quiet")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith(f"audit: error: {training_run / where}: ") and message in err


def test_the_final_model_saved_beside_the_checkpoints_is_the_last_row(capsys, training_run):
    """trainer.save_model(output_dir) writes the final model beside the checkpoint-N/ folders: it is the row
    "final", after them, and its gate is the exit code (here it regressed: <tool> back at the mean)."""
    save_file({"lm_head.weight": _head(0.0, False)}, str(training_run / "model.safetensors"))
    (training_run / "vocab.txt").write_text("\n".join(TOKENS) + "\n", encoding="utf-8")
    code, out, err = _audit(capsys, training_run, "--all-checkpoints", "--tokens", "<tool>", "--quiet")
    assert code == 1, err
    assert out.splitlines()[0].endswith("4 checkpoints in step order; the exit code is final's gate")
    assert [row[:3] for row in _rows(out)[1:]] == [["checkpoint-10", "10", "1"], ["checkpoint-20", "20", "0"],
                                                   ["checkpoint-100", "100", "0"], ["final", "final", "1"]]
    assert "changed  '<tool>' (id 6) unargmaxable from final (argmaxable before)" in out
    code, out, _ = _audit(capsys, training_run, "--quiet", "--format", "json")  # a plain audit reads its own model
    assert code == 1 and json.loads(out)["summary"]["unargmaxable"] == 1


def test_options_that_need_a_single_checkpoint_are_refused(capsys, training_run):
    code, _, err = _audit(capsys, training_run, "--all-checkpoints", "--format", "markdown")
    assert code == 2 and err == "audit: error: --all-checkpoints writes --format text or json, not markdown\n"
    code, _, err = _audit(capsys, training_run, "--all-checkpoints", "--shard", "1/2")
    assert code == 2 and "takes no --shard" in err
