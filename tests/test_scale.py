"""The parts that make vocabulary-scale audits fast: the float32 screen, the Newton stage,
hashed duplicate detection, and sharded runs merged into one report."""

import json

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

import auditor
from auditor.engine.screen.ties import duplicate_groups
from conftest import run_module
from oracles import lp_margin


def gaussian_head(rng, n, d, offset=0.0):
    spectrum = np.arange(1, d + 1) ** -0.7
    rows = rng.standard_normal((n, d)) * np.sqrt(spectrum)
    rows[:, 0] += offset
    return rows.astype(np.float32)


@pytest.mark.slow
def test_close_calls_of_the_float32_screen_match_the_lp_and_verify(rng):
    """Rows pushed to relative depth 1e-6 and 1e-7 outside and inside the hull: margins far
    below the float32 rounding bound. Every verdict must match the LP over all rows, and every
    certificate must pass the float64 re-check."""
    W = gaussian_head(rng, 400, 6).astype(np.float64)
    # Near-boundary rows: a facet's centre pushed out (or in) a little along the facet normal.
    planted = []
    for depth in (1e-6, -1e-6, 1e-7, -1e-7):
        base = auditor.audit(W, progress=False)
        vertices = [k for k in range(W.shape[0]) if base.tokens[k].verdict == "argmaxable"]
        pick = rng.choice(vertices, size=6, replace=False)
        point = W[pick].mean(axis=0)
        normal = np.linalg.svd(W[pick[1:]] - W[pick[0]])[2][-1]
        if normal @ (point - W.mean(axis=0)) < 0:
            normal = -normal
        W = np.vstack([W, point + depth * np.linalg.norm(point) * normal])
        planted.append(W.shape[0] - 1)
    W32 = W.astype(np.float32)  # the audit sees these float32 values: a float32-stored head
    report = auditor.audit(W32, progress=False)
    W64 = W32.astype(np.float64)
    for k in planted:
        t, _, _ = lp_margin(W64, None, k)
        if abs(t) > 1e-12:  # the LP is sure of the sign
            assert report.tokens[k].verdict == ("argmaxable" if t > 0 else "unargmaxable"), k
        assert report.tokens[k].verdict in ("argmaxable", "unargmaxable", "inconclusive")
    result = auditor.verify(report, W32)
    assert result.ok and result.checked == W.shape[0] - report.counts["inconclusive"]


@pytest.mark.slow
def test_float32_storage_and_float64_storage_agree(rng):
    """The same values as a float32 head (float32 screen) and, nudged off float32, as a float64
    head (float64 screen): the verdicts agree token for token."""
    W = gaussian_head(rng, 1500, 12)
    W[-5:] = W[:-5].mean(axis=0)  # interior rows (one tie group of five)
    as32 = auditor.audit(W, progress=False)
    nudged = W.astype(np.float64) * (1 + 2.0**-40)  # no longer float32 values: kept in float64
    as64 = auditor.audit(nudged, progress=False)
    assert [t.verdict for t in as32.tokens] == [t.verdict for t in as64.tokens]
    assert auditor.verify(as32, W).ok and auditor.verify(as64, nudged).ok


@pytest.mark.slow
def test_rows_swallowed_by_a_longer_copy_are_settled_by_newton_and_match_the_lp(rng):
    """w_j = 1.01 w_k with the origin inside the cloud: w_k is in the hull (just), which first-order
    methods cannot settle in their budget; the Newton stage certifies it."""
    W = gaussian_head(rng, 3000, 24, offset=0.5)
    short = [11, 500, 1200, 2999]
    for j, k in enumerate(short):
        W[100 + j] = np.float32(1.01) * W[k]
    report = auditor.audit(W, progress=False, frank_wolfe_iterations=10)
    W64 = W.astype(np.float64)
    for k in short:
        t, _, _ = lp_margin(W64, None, k)
        assert t <= 1e-12  # no z does better than z = 0: inside the hull
        assert report.tokens[k].verdict == "unargmaxable"
        assert report.tokens[k].stage == "newton"
        assert report.tokens[k].residual <= 1e-10 * max(np.linalg.norm(W64[k]), 1e-300) * 10
    others = rng.choice([k for k in range(3000) if k not in short and not 100 <= k < 104], size=15, replace=False)
    for k in others:  # the rest of the head is decided as the LP over all rows says
        t, _, _ = lp_margin(W64, None, int(k))
        assert report.tokens[int(k)].verdict == ("argmaxable" if t > 1e-12 else "unargmaxable")
    assert auditor.verify(report, W).ok


def test_newton_leaves_argmaxable_rows_alone(rng):
    """Outside the hull the maximum-entropy problem has no minimiser: the stage must not certify."""
    W = gaussian_head(rng, 300, 5)
    vertices = set(auditor.audit(W, progress=False).ids("argmaxable"))
    from auditor.engine.arithmetic.head import build_engine_head
    from auditor.engine.screen.ties import duplicate_groups as groups
    from auditor.engine.solvers.tilt import tilted_certificates
    from auditor.question.domain import Unbounded

    weight = torch.from_numpy(W)
    head = build_engine_head(weight, None, groups(weight, None), Unbounded(), 1e-10)
    found = tilted_certificates(head, np.array(sorted(vertices))[:40])
    assert found == {}


@pytest.mark.parametrize("radius", [None, 0.5])
def test_newton_offers_the_direction_its_theta_runs_off_along_as_a_witness(rng, radius):
    """Outside the hull theta runs off along a direction in which the row leads: each vertex gets it as a
    witness (moved into a ball), checked against Qhull and a plain re-check; rows inside get weights."""
    from auditor.question.domain import Ball, Unbounded
    from auditor.engine.arithmetic.head import build_engine_head
    from auditor.engine.solvers.tilt import tilted_certificates
    from oracles import qhull_argmaxable, witness_wins

    W = gaussian_head(rng, 300, 5)
    vertices = sorted(qhull_argmaxable(W))
    inside = sorted(set(range(300)) - set(vertices))
    weight = torch.from_numpy(W)
    domain = Unbounded() if radius is None else Ball(radius)
    head = build_engine_head(weight, None, duplicate_groups(weight, None), domain, 1e-10)
    witnesses = {}
    found = tilted_certificates(head, np.array(vertices[:40] + inside[:10]), witnesses=witnesses)
    assert sorted(witnesses) == vertices[:40] and sorted(found) == inside[:10]
    for k, (z, margin, runner_up) in witnesses.items():
        assert witness_wins(W, None, k, z) and margin > 0
        assert radius is None or np.linalg.norm(z) <= radius


def test_hashed_duplicate_groups_match_numpy_unique(rng):
    W = rng.standard_normal((2000, 7)).astype(np.float32)
    copies = rng.integers(0, 2000, size=(150, 2))
    for a, b in copies:
        W[b] = W[a]
    W[5] = 0.0
    W[6] = -0.0  # equal in value to row 5
    groups = duplicate_groups(torch.from_numpy(W), None)
    _, first, inverse = np.unique(W + np.float32(0.0), axis=0, return_index=True, return_inverse=True)
    expected = np.array([min(np.nonzero(inverse.ravel() == g)[0]) for g in inverse.ravel()])
    assert np.array_equal(groups, expected)
    assert groups[6] == 5
    bias = torch.zeros(2000, dtype=torch.float64)
    bias[6] = 1.0  # same row, different bias: different tokens
    assert duplicate_groups(torch.from_numpy(W), bias)[6] == 6
    assert np.array_equal(duplicate_groups(torch.from_numpy(W).to(torch.bfloat16), None),
                          duplicate_groups(torch.from_numpy(W).to(torch.bfloat16).float(), None))


def _run(*args, command="auditor"):
    module = "auditor" if command == "auditor" else "auditor.cli.merge"
    return run_module(module, *args)  # in this process: the command's output, not an interpreter's start-up


@pytest.fixture(scope="module")
def sharded_head(tmp_path_factory):
    rng = np.random.default_rng(9)
    W = gaussian_head(rng, 1200, 32)
    W[-3:] = W[:-3].mean(axis=0) + 1e-6 * rng.standard_normal((3, 32)).astype(np.float32)
    W[700] = W[10]
    path = tmp_path_factory.mktemp("shards") / "head.safetensors"
    save_file({"lm_head.weight": W}, str(path))
    return path


@pytest.mark.slow
def test_shards_merge_into_the_whole_report(sharded_head, tmp_path):
    whole = json.loads(_run(sharded_head, "--format", "json", "--quiet").stdout)
    parts = []
    for i in (1, 2, 3):
        out = tmp_path / f"part{i}.json"
        done = _run(sharded_head, "--shard", f"{i}/3", "--format", "json", "--quiet", "--output", out)
        assert done.returncode in (0, 1), done.stderr
        parts.append(out)
        shard = json.loads(out.read_text())["shard"]
        assert (shard["index"], shard["count"]) == (i, 3)
    merged_path = tmp_path / "merged.json"
    done = _run(*reversed(parts), "--output", merged_path, command="merge")
    assert done.returncode == 1  # the tie and the interior rows fail the gate
    merged = json.loads(merged_path.read_text())
    assert merged["summary"] == whole["summary"]
    assert [(f["id"], f["verdict"]) for f in merged["findings"]] == [(f["id"], f["verdict"]) for f in whole["findings"]]
    assert {f["id"] for f in merged["findings"]} == {10, 700, 1197, 1198, 1199}


@pytest.mark.slow
def test_merge_refuses_missing_repeated_and_foreign_shards(sharded_head, tmp_path):
    paths = []
    for i in (1, 2):
        out = tmp_path / f"p{i}.json"
        _run(sharded_head, "--shard", f"{i}/2", "--format", "json", "--quiet", "--output", out)
        paths.append(out)
    missing = _run(paths[0], command="merge")
    assert missing.returncode == 2 and "2/2 are missing" in missing.stderr
    repeated = _run(paths[0], paths[0], command="merge")
    assert repeated.returncode == 2 and "again" in repeated.stderr
    foreign = json.loads(paths[1].read_text())
    foreign["head"]["shape"] = [5, 5]
    (tmp_path / "foreign.json").write_text(json.dumps(foreign))
    mixed = _run(paths[0], tmp_path / "foreign.json", command="merge")
    assert mixed.returncode == 2 and "not shards of one audit" in mixed.stderr
    for bad in ("0/2", "3/2", "x/2", "2"):
        done = _run(sharded_head, "--shard", bad, "--quiet")
        assert done.returncode == 2 and done.stderr.count("\n") == 1, bad
