"""One audit over torchrun's ranks, and audits that resume (--work-dir): the report of one process.

What may differ from the report of one process, and why (``assert_same_report``):

- ``timing``: the stage times are summed over the blocks (the work done), not one call's.
- ``run``: it says over how many ``ranks`` and ``blocks`` the audit ran, and its ``wall_s``.
- a finding's certificate numbers, ``residual``, ``bias_gap`` and the competitors' ``weight``: the
  engine decides its tokens in batches, and which tokens share a batch changes the rounding of
  the convex weights (``--shard`` has the same property). They agree to rounding, and every
  certificate of the merged certificates file is re-checked by ``auditor.verify``.

Everything else is equal: every verdict, every finding's id, verdict, stage, competitors' ids,
support, copies, explanation and marks, the counts, the summaries and the warnings.
"""

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

import auditor
from auditor.cli.audit import main
from auditor.runs.blocks import plan_blocks
from auditor.runs.distributed import _outcome
from auditor.verdicts.certificates import merge_certificates


ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "fixtures" / "resized_demo.safetensors"
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
for _name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
    ENV.pop(_name, None)  # the tests launch their own ranks
LIMIT_S = 120  # no run here takes a tenth of this; a hang fails the test instead of the suite


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def audit(*args, cwd=None, env=None):
    return subprocess.run([sys.executable, "-m", "auditor", *map(str, args)], capture_output=True, text=True,
                          env=env or ENV, cwd=cwd, timeout=LIMIT_S)


def torchrun(*args, port, cwd=None):
    launcher = [sys.executable, "-m", "torch.distributed.run", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    return subprocess.run([*launcher, *map(str, args)], capture_output=True, text=True, env=ENV, cwd=cwd,
                          timeout=LIMIT_S)


def rank_process(rank: int, world: int, port: int, *args, cwd) -> subprocess.Popen:
    """One rank started as torchrun starts it (the env:// variables), so that its own exit code is seen:
    torchrun ends the other ranks as soon as one exits non-zero, and exits 1 itself."""
    env = {**ENV, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    return subprocess.Popen([sys.executable, "-m", "auditor", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A 1500 x 16 head with a copy (700 = 10), three mean-initialised rows and a row inside the hull, and
    its report and certificates from one process."""
    folder = tmp_path_factory.mktemp("planted")
    rng = np.random.default_rng(11)
    W = (rng.standard_normal((1500, 16)) * np.arange(1, 17) ** -0.5).astype(np.float32)
    W[700] = W[10]
    W[900] = W[100:110].mean(axis=0)
    W[-3:] = W[:-3].mean(axis=0) + 1e-7 * rng.standard_normal((3, 16)).astype(np.float32)
    path = folder / "head.safetensors"
    save_file({"lm_head.weight": W}, str(path))
    done = audit(path, "--format", "json", "--output", folder / "whole.json", "--certificates",
                 folder / "whole_certificates.json", "--quiet")
    assert done.returncode == 1, done.stderr
    whole = json.loads((folder / "whole.json").read_text())
    assert {f["id"] for f in whole["findings"]} >= {10, 700, 900, 1497, 1498, 1499}
    return {"path": path, "weight": W, "report": whole,
            "certificates": json.loads((folder / "whole_certificates.json").read_text())}


def _close(a, b, what):
    if a is None or b is None:
        assert a is None and b is None, what
    else:
        assert abs(a - b) <= 1e-9 * max(1.0, abs(b)), what


def assert_same_report(parted: dict, whole: dict) -> None:
    """Equal but for the fields the module's docstring names."""
    assert [k for k in parted if k not in ("run", "timing")] == [k for k in whole if k not in ("run", "timing")]
    for key in whole:
        if key not in ("run", "timing", "findings"):
            assert parted[key] == whole[key], key
    assert parted["run"]["threads"] == whole["run"]["threads"]
    assert [f["id"] for f in parted["findings"]] == [f["id"] for f in whole["findings"]]
    for mine, theirs in zip(parted["findings"], whole["findings"]):
        k = theirs["id"]
        numbers = ("residual", "bias_gap", "competitors")
        assert {f: v for f, v in mine.items() if f not in numbers} == {f: v for f, v in theirs.items()
                                                                     if f not in numbers}, k
        _close(mine["residual"], theirs["residual"], k)
        _close(mine["bias_gap"], theirs["bias_gap"], k)
        assert [c["id"] for c in mine["competitors"]] == [c["id"] for c in theirs["competitors"]], k
        for c, d in zip(mine["competitors"], theirs["competitors"]):
            _close(c["weight"], d["weight"], k)


def assert_same_certificates(path: Path, whole: dict, weight) -> None:
    """The same verdicts, groups and stages token for token, and every certificate holds."""
    parted = json.loads(path.read_text())
    for key in ("head", "domain", "counts", "tolerances", "centre", "final_norm"):
        assert parted[key] == whole[key], key

    def verdicts(document):
        return [(t["id"], t["verdict"], t["stage"], t.get("tied_with"), t.get("group_verdict"))
                for t in document["tokens"]]

    assert verdicts(parted) == verdicts(whole)
    assert auditor.verify(auditor.load_certificates(path), weight).ok


@pytest.mark.distributed
def test_two_ranks_write_the_report_of_one_process(planted, tmp_path):
    out, certificates = tmp_path / "report.json", tmp_path / "certificates.json"
    done = torchrun("--nproc-per-node", "2", "-m", "auditor", planted["path"], "--format", "json", "--output", out,
                    "--certificates", certificates, "--quiet", "--fail-on", "none", port=free_port())
    assert done.returncode == 0, done.stderr
    report = json.loads(out.read_text())
    assert report["run"]["ranks"] == 2 and report["run"]["blocks"] == 2
    expected = dict(planted["report"], fail_on=[], summary={**planted["report"]["summary"], "failing": 0},
                    findings=[{**f, "failing": False} for f in planted["report"]["findings"]])
    assert_same_report(report, expected)
    assert_same_certificates(certificates, planted["certificates"], planted["weight"])


@pytest.mark.distributed
def test_two_nodes_on_loopback_write_the_report_of_one_process(planted, tmp_path):
    port = free_port()
    nodes = []
    for node in (0, 1):
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
                    "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port)]
        nodes.append(subprocess.Popen([*launcher, "-m", "auditor", str(planted["path"]), "--format", "json",
                                       "--output", str(tmp_path / f"node{node}.json"), "--quiet", "--fail-on", "none"],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV))
    outputs = [node.communicate(timeout=LIMIT_S) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    assert not (tmp_path / "node1.json").exists()  # the ranks of node 1 write nothing
    report = json.loads((tmp_path / "node0.json").read_text())
    assert report["run"]["ranks"] == 2
    expected = dict(planted["report"], fail_on=[], summary={**planted["report"]["summary"], "failing": 0},
                    findings=[{**f, "failing": False} for f in planted["report"]["findings"]])
    assert_same_report(report, expected)


def _ranks(port, rank_args, cwds):
    processes = [rank_process(rank, len(cwds), port, *args, cwd=cwd) for rank, (args, cwd)
                 in enumerate(zip(rank_args, cwds))]
    started = time.monotonic()
    outputs = [p.communicate(timeout=LIMIT_S) for p in processes]
    return [p.returncode for p in processes], outputs, time.monotonic() - started


@pytest.mark.distributed
def test_a_checkpoint_missing_on_one_node_stops_every_rank_with_one_line(planted, tmp_path):
    """Rank 1 runs where the relative path names nothing, as on a node without the checkpoint."""
    here, elsewhere = planted["path"].parent, tmp_path
    args = [planted["path"].name, "--format", "json", "--output", tmp_path / "report.json", "--quiet"]
    codes, outputs, _ = _ranks(free_port(), [args, args], [here, elsewhere])
    assert codes == [2, 2], outputs
    (out0, err0), (out1, err1) = outputs
    assert err0.count("\n") == 1 and err0.startswith("audit: error: rank 1: ") and "no such file" in err0, err0
    assert out0 == out1 == err1 == ""
    assert not (tmp_path / "report.json").exists()


@pytest.mark.distributed
def test_a_rank_whose_partner_never_comes_gives_up_within_the_timeout(tmp_path):
    started = time.monotonic()
    alone = rank_process(0, 2, free_port(), DEMO, "--dist-timeout", "2", "--quiet", cwd=tmp_path)
    out, err = alone.communicate(timeout=LIMIT_S)
    assert alone.returncode == 2 and out == ""
    assert err.startswith("audit: error: rank 0: cannot join the other ranks (") and err.count("\n") == 1, err
    assert time.monotonic() - started < 30


@pytest.mark.distributed
def test_a_rank_that_fails_while_deciding_stops_the_others_early(tmp_path):
    """Rank 1's --work-dir is a file on its node: it fails after the ranks met, while rank 0 decides its
    blocks; rank 0 stops after its current block instead of deciding all the blocks of the demo head."""
    node0, node1 = tmp_path / "node0", tmp_path / "node1"
    node0.mkdir()
    node1.mkdir()
    (node1 / "work").write_text("not a folder\n")
    args = [DEMO, "--work-dir", "work", "--block-size", "250", "--format", "json", "--output", "report.json", "--quiet"]
    codes, outputs, seconds = _ranks(free_port(), [args, args], [node0, node1])
    assert codes == [2, 2], outputs
    (_, err0), (_, err1) = outputs
    assert err0.count("\n") == 1 and err0.startswith("audit: error: rank 1: --work-dir work: "), err0
    assert err1 == ""
    assert len(list((node0 / "work").glob("block-*.json"))) < 17  # stopped early: 17 blocks in all
    assert not (node0 / "report.json").exists()


@pytest.mark.distributed
def test_ranks_share_a_work_dir_and_a_rerun_decides_nothing(planted, tmp_path):
    work = tmp_path / "work"
    first, again = tmp_path / "first.json", tmp_path / "again.json"
    done = torchrun("--nproc-per-node", "2", "-m", "auditor", planted["path"], "--work-dir", work, "--block-size",
                    "400", "--format", "json", "--output", first, "--quiet", "--fail-on", "none", port=free_port())
    assert done.returncode == 0, done.stderr
    assert "4 of 4 blocks decided now, 0 taken from earlier runs" in done.stderr
    assert len(list(work.glob("block-*.json"))) == 4
    rerun = audit(planted["path"], "--work-dir", work, "--block-size", "400", "--format", "json", "--output", again,
                  "--quiet", "--fail-on", "none")
    assert rerun.returncode == 0, rerun.stderr
    assert rerun.stderr == f"audit: work dir {work}: 0 of 4 blocks decided now, 4 taken from earlier runs\n"
    report, resumed = json.loads(first.read_text()), json.loads(again.read_text())
    assert {**resumed["run"], "wall_s": None} == {**report["run"], "ranks": 1, "wall_s": None}
    assert {k: v for k, v in resumed.items() if k not in ("run", "timing")} == \
        {k: v for k, v in report.items() if k not in ("run", "timing")}  # the very same blocks: every number


@pytest.mark.distributed
def test_a_killed_audit_resumes_from_its_blocks(planted, tmp_path):
    work = tmp_path / "work"
    command = [sys.executable, "-m", "auditor", str(planted["path"]), "--work-dir", str(work), "--block-size", "100",
               "--format", "json", "--certificates", str(tmp_path / "certificates.json"), "--quiet"]
    victim = subprocess.Popen([*command, "--output", str(tmp_path / "never.json")], env=ENV,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + LIMIT_S
    while len(list(work.glob("block-*.json"))) < 2 and victim.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    kept = len(list(work.glob("block-*.json")))
    assert 2 <= kept < 15  # 15 blocks of 100 ids in 1500
    resumed = subprocess.run([*command, "--output", str(tmp_path / "resumed.json")], capture_output=True, text=True,
                             env=ENV, timeout=LIMIT_S)
    assert resumed.returncode == 1, resumed.stderr
    assert f"{15 - kept} of 15 blocks decided now, {kept} taken from earlier runs" in resumed.stderr
    assert_same_report(json.loads((tmp_path / "resumed.json").read_text()), planted["report"])
    assert_same_certificates(tmp_path / "certificates.json", planted["certificates"], planted["weight"])


@pytest.mark.slow
def test_a_work_dir_of_another_head_or_other_settings_is_refused_in_one_line(planted, tmp_path, capsys):
    work = tmp_path / "work"
    assert main([str(DEMO), "--tokens", "0-9", "--work-dir", str(work), "--quiet"]) == 0
    capsys.readouterr()
    assert main([str(planted["path"]), "--tokens", "0-9", "--work-dir", str(work), "--quiet"]) == 2
    other_head = capsys.readouterr()
    assert other_head.out == ""
    assert other_head.err == (f"audit: error: --work-dir {work}: holds blocks of another head (its weights "
                              "differ); give a new folder or empty this one\n")
    assert main([str(DEMO), "--tokens", "0-9", "--work-dir", str(work), "--domain", "ball:2", "--quiet"]) == 2
    other_domain = capsys.readouterr().err
    assert other_domain.count("\n") == 1 and 'domain was "unbounded", now "ball:2"' in other_domain


def test_stale_allow_list_entries_are_warned_about_as_in_one_process(tmp_path, capsys):
    """A block that does not hold an allowed id cannot tell whether it is stale; the whole run can."""
    seed = ROOT / "fixtures" / "seed_2d.safetensors"
    allow = tmp_path / "allow.txt"
    allow.write_text("0\n4\n")  # 0 is argmaxable (stale), 4 is the finding
    reports = []
    for extra in ([], ["--work-dir", str(tmp_path / "work"), "--block-size", "2"]):
        assert main([str(seed), "--allow", str(allow), "--format", "json", "--quiet", *extra]) == 0
        reports.append(json.loads(capsys.readouterr().out))
    assert reports[1]["run"]["blocks"] > 1
    assert reports[1]["warnings"] == reports[0]["warnings"] == ["allow-list entry 0 matches no finding"]


def test_html_needs_one_process(tmp_path, capsys):
    assert main([str(DEMO), "--work-dir", str(tmp_path / "work"), "--format", "html"]) == 2
    assert "--format html needs the whole audit in one process" in capsys.readouterr().err
    assert not (tmp_path / "work").exists()


def test_blocks_lie_on_a_grid_from_zero_whatever_the_selection():
    ids = np.array([3, 5, 250, 251, 999, 1000], dtype=np.int64)
    blocks = plan_blocks(ids, 250)
    assert [(b.first, b.stop, b.ids.tolist()) for b in blocks] == [
        (0, 250, [3, 5]), (250, 500, [250, 251]), (750, 1000, [999]), (1000, 1250, [1000])]


def test_rank_0_says_which_rank_failed_and_says_a_common_error_once():
    ok, stopped = ("ok", None), ("stopped", None)
    assert _outcome([ok, ok]) == (0, None)
    assert _outcome([stopped, ("error", "boom")]) == (2, "rank 1: boom")
    assert _outcome([("error", "x: no such file")] * 2) == (2, "x: no such file")
    assert _outcome([("exit", 0), ("exit", 0)]) == (0, None)
    assert _outcome([("exit", 0), ok])[0] == 2


def test_the_head_fingerprint_sees_one_bit_in_any_array_and_dtype():
    import torch

    from auditor.question.head import Head
    from auditor.runs.workdir import head_fingerprint

    weight = torch.arange(24, dtype=torch.float32).reshape(6, 4).to(torch.bfloat16)
    flipped = weight.clone()
    flipped.view(torch.int16)[5, 3] ^= 1
    fingerprints = {head_fingerprint(Head(weight=weight)), head_fingerprint(Head(weight=flipped)),
                    head_fingerprint(Head(weight=weight.float())),
                    head_fingerprint(Head(weight=weight, bias=np.zeros(6, dtype=np.float32)))}
    assert len(fingerprints) == 4
    assert head_fingerprint(Head(weight=weight.float().numpy())) == head_fingerprint(Head(weight=weight.float().numpy()))


def test_merged_certificates_list_every_token_once_with_counts_summed():
    def part(tokens, undecided):
        counts = {"argmaxable": sum(t["verdict"] == "argmaxable" for t in tokens),
                  "unargmaxable": sum(t["verdict"] == "unargmaxable" for t in tokens), "tied": 0,
                  "inconclusive": 0, "undecided": undecided}
        return {"schema_version": 1, "kind": "auditor-certificates", "head": {"n_tokens": 4}, "domain": "unbounded",
                "centre": [0.0], "tolerances": {}, "counts": counts, "timings": {"screen": 1.0}, "tokens": tokens}

    merged = merge_certificates([part([{"id": 2, "verdict": "unargmaxable"}], 3),
                                 part([{"id": 0, "verdict": "argmaxable"}], 3)])
    assert [t["id"] for t in merged["tokens"]] == [0, 2]
    assert merged["counts"] == {"argmaxable": 1, "unargmaxable": 1, "tied": 0, "inconclusive": 0, "undecided": 2}
    assert merged["timings"] == {"screen": 2.0}


@pytest.mark.distributed
def test_ranks_on_nodes_holding_different_heads_stop_with_one_line(planted, tmp_path):
    """Same file name and shape on both "nodes", another planted row on the second: merging the two halves
    would report neither node's findings, so the ranks must refuse at their first meeting."""
    other = tmp_path / "node1"
    other.mkdir()
    W = planted["weight"].copy()
    W[300] = W[310:320].mean(axis=0)
    save_file({"lm_head.weight": W}, str(other / planted["path"].name))
    args = [planted["path"].name, "--format", "json", "--output", tmp_path / "report.json", "--quiet"]
    codes, outputs, _ = _ranks(free_port(), [args, args], [planted["path"].parent, other])
    assert codes == [2, 2], outputs
    (out0, err0), (out1, err1) = outputs
    assert err0.count("\n") == 1 and err0.startswith("audit: error: rank 1: it loaded another head"), err0
    assert out0 == out1 == err1 == ""
    assert not (tmp_path / "report.json").exists()


def test_a_work_dir_is_refused_when_the_head_was_read_otherwise(tmp_path, capsys):
    """The same bytes, but config.json now names another norm epsilon: every block's report would carry the
    old one, so the folder must not be resumed (found in review: it was, silently)."""
    folder = tmp_path / "model"
    folder.mkdir()
    rng = np.random.default_rng(5)
    save_file({"lm_head.weight": rng.standard_normal((60, 8)).astype(np.float32),
               "model.norm.weight": np.ones(8, dtype=np.float32)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"rms_norm_eps": 1e-6}))
    work = tmp_path / "work"
    assert main([str(folder), "--work-dir", str(work), "--quiet", "--fail-on", "none"]) == 0
    capsys.readouterr()
    (folder / "config.json").write_text(json.dumps({"rms_norm_eps": 1e-5}))
    assert main([str(folder), "--work-dir", str(work), "--quiet", "--fail-on", "none"]) == 2
    err = capsys.readouterr().err
    assert err == (f"audit: error: --work-dir {work}: holds blocks of an audit with other settings "
                   "(head.final_norm.eps was 1e-06, now 1e-05); give a new folder or empty this one\n")


@pytest.mark.distributed
def test_the_readmes_torchrun_example_works_as_printed_on_a_head_with_findings(tmp_path):
    """docs/cli.md's one-machine torchrun line and its gate one-liner, run as printed on the demo head (which has
    findings) with 2 processes for 8: torchrun exits 0 with no traceback, the gate exits 1."""
    cli_doc = (Path(__file__).resolve().parent.parent / "docs" / "cli.md").read_text(encoding="utf-8")
    block = cli_doc.split("### torchrun", 1)[1].split("```sh", 1)[1].split("```", 1)[0]
    lines = [line for line in block.splitlines() if line and not line.startswith("#")]
    launch, gate = shlex.split(lines[0], comments=True), shlex.split(lines[1], comments=True)
    demo = "fixtures/resized_demo.safetensors"
    assert launch[:4] == ["torchrun", "--standalone", "--nproc-per-node", "8"] and demo in launch
    fixture = Path(__file__).resolve().parent.parent / demo
    args = ["--standalone", "--nproc-per-node", "2", *[str(fixture) if a == demo else a for a in launch[4:]]]
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", *args], capture_output=True, text=True,
                          env=ENV, cwd=tmp_path, timeout=LIMIT_S)  # --standalone: torchrun picks a free port
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "ChildFailedError" not in done.stderr
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["summary"]["unargmaxable"] == 6 and (tmp_path / "certs.json").exists()
    assert gate[:2] == ["python", "-c"] and len(gate) == 3
    gated = subprocess.run([sys.executable, "-c", gate[2]], cwd=tmp_path, capture_output=True, text=True)
    assert gated.returncode == 1, gated.stderr  # the demo's findings fail the default gate
