"""What an earlier version wrote is not reused: its bfloat16 screen could certify witnesses that do not hold.

Version 0.1.0 took bfloat16's unit roundoff as 2^-9 (it is 2^-8), so its allowance was half as wide as it
must be. Its --work-dir blocks are decided again, and audit-merge refuses its shard reports.
"""

import json
from pathlib import Path

import pytest

from auditor.cli.audit import main
from auditor.errors import InputError
from auditor.runs import workdir
from auditor.runs.merge import read_shard

ROOT = Path(__file__).resolve().parent.parent
SEED = ROOT / "fixtures" / "seed_2d.safetensors"


def test_the_blocks_of_a_work_folder_written_by_0_1_0_are_decided_again(tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    args = [str(SEED), "--work-dir", str(work), "--block-size", "2", "--format", "json", "--quiet",
            "--fail-on", "none"]
    monkeypatch.setattr(workdir, "__version__", "0.1.0")
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    blocks = sorted(work.glob("block-*.json"))
    assert blocks and json.loads((work / workdir.MANIFEST).read_text())["settings"]["version"] == "0.1.0"
    old_keys = {json.loads(p.read_text())["key"] for p in blocks}
    # a block of the old version that a reuse would show: its verdicts tampered with
    tampered = json.loads(blocks[0].read_text())
    tampered["part"] = {"tampered": True}
    blocks[0].write_text(json.dumps(tampered))

    monkeypatch.undo()
    assert main(args) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["summary"] == first["summary"]
    assert json.loads((work / workdir.MANIFEST).read_text())["settings"]["version"] == workdir.__version__
    new_keys = {json.loads(p.read_text())["key"] for p in sorted(work.glob("block-*.json"))}
    assert not new_keys & old_keys  # every block decided again, under this version's key


def test_a_work_folder_of_another_setting_and_0_1_0_is_still_refused(tmp_path, monkeypatch, capsys):
    work = tmp_path / "work"
    monkeypatch.setattr(workdir, "__version__", "0.1.0")
    assert main([str(SEED), "--work-dir", str(work), "--quiet", "--fail-on", "none"]) == 0
    monkeypatch.undo()
    capsys.readouterr()
    assert main([str(SEED), "--work-dir", str(work), "--domain", "ball:2", "--quiet", "--fail-on", "none"]) == 2
    assert 'domain was "unbounded", now "ball:2"' in capsys.readouterr().err


@pytest.mark.parametrize("version, refused", [("0.1.0", True), (None, True), ("0.2.0", False), ("1.0", False)])
def test_audit_merge_refuses_shard_reports_of_0_1_0(tmp_path, version, refused):
    shard = {"summary": {}, "findings": [], "shard": {"index": 1, "count": 2},
             "tool": {"name": "auditor", "version": version}}
    path = tmp_path / "part1.json"
    path.write_text(json.dumps(shard))
    if refused:
        with pytest.raises(InputError, match="run this shard again"):
            read_shard(path)
    else:
        assert read_shard(path)["tool"]["version"] == version
