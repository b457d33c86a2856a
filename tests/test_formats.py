"""The text and markdown reports, rendered from the JSON document: explanations, dual bounds, long
verdict groups, baselines, warnings, and audit-merge printing every format."""

import json
from pathlib import Path

import numpy as np
import pytest

import auditor
from auditor.errors import InputError
from auditor.findings.explain import NEXT_STEPS
from auditor.findings.gate import FINDING_VERDICTS, Finding, GateResult, run_gate
from auditor.formats import DOCUMENT_FORMATS, json_format, markdown, text
from auditor.formats._common import SHOWN_PER_VERDICT
from auditor.question.head import Head
from auditor.runs.merge import merge_reports
from conftest import run_module

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
SEED = np.array([[1, 2], [2, 1], [1, 0], [0, 1], [1, 1], [1, 0]], dtype=np.float32)  # 4 inside, 2 = 5


def finding(k, verdict, **fields):
    """One finding as the JSON document has it; the fields a test does not care about are empty."""
    entry = {"id": k, "token": None, "verdict": verdict, "residual": None, "bias_gap": None, "competitors": [],
             "support": 0, "tied_with": None, "group_verdict": None, "bounds": None, "max_probability": None,
             "allowed": False, "explanation": "", "kind": None, "baseline": None}
    defaults = {"unargmaxable": {"residual": 2.7e-14, "bias_gap": 0.0},
                "tied": {"tied_with": [k + 1], "group_verdict": "argmaxable"},
                "inconclusive": {"bounds": {"margin_lower": -1e-3, "margin_upper": 2e-3}},
                "low-ceiling": {"max_probability": {"lower": 0.0123, "upper": 0.0124}}}[verdict]
    return {**entry, **defaults, **fields}


def document(findings, domain="unbounded", fail_on=FINDING_VERDICTS, baseline=None, summaries=(), warnings=()):
    """A hand-made JSON document of a 5000 x 64 head."""
    doc = {"schema_version": 1, "tool": {"name": "auditor", "version": auditor.__version__},
           "head": {"path": "model", "format": "safetensors", "weight": "lm_head.weight", "bias": None,
                    "shape": [5000, 64], "dtype": "float32", "tied": False, "final_norm": None,
                    "token_strings": None},
           "domain": domain, "shard": None, "fail_on": sorted(fail_on), "ceiling": None, "findings": findings,
           "summaries": list(summaries), "baseline": baseline, "warnings": list(warnings), "notes": [],
           "timing": {"load_s": 0.25, "total_s": 1.5}}
    failing = sum(f["verdict"] in fail_on and not f["allowed"] and f["baseline"] != "unchanged" for f in findings)
    counts = {v: sum(f["verdict"] == v for f in findings) for v in ("unargmaxable", "tied", "inconclusive")}
    doc["summary"] = {"n_tokens": 5000, "argmaxable": 5000 - sum(counts.values()), **counts, "undecided": 0,
                      "failing": failing}
    return doc


def finding_text(report: str, k: int) -> str:
    """A text report's lines for finding k (its row and the evidence wrapped below it), spaces collapsed."""
    lines = report.splitlines()
    start = next(i for i, line in enumerate(lines) if line.split()[:1] == [str(k)])
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith(" " * 10)), len(lines))
    return " ".join(" ".join(lines[start:end]).split())


def listed_ids(report: str) -> list[int]:
    """The ids of the finding lines of a text report, in order."""
    return [int(line.split()[0]) for line in report.splitlines() if line[:8].strip().isdigit()]


@pytest.fixture(scope="module")
def seed_result():
    """A gate result on a small real head with token strings, explanations, a warning and a baseline."""
    head = Head(weight=SEED, tokens=["a", "b", "c", "d", "<mid>", "c copy"], token_source="vocab.txt",
                path=Path("seed"), source_format="safetensors")
    result = run_gate(head, auditor.audit(SEED, progress=False))
    result.findings[0].allowed = True
    for f in result.findings:
        f.baseline = "unchanged" if f.id == 2 else "new"
    result.warnings = ["allow-list entry 9 matches no finding"]
    result.baseline = {"path": "base.json", "n_tokens": 6, "new": 2, "unchanged": 1,
                       "fixed": [{"id": 1, "token": "b", "verdict": "unargmaxable"}]}
    return result


@pytest.mark.parametrize("fmt", [text, markdown])
def test_a_result_renders_as_its_json_document_does(seed_result, fmt):
    doc = json.loads(json_format.render(seed_result))  # what audit-merge reads back from a file
    assert fmt.render_document(doc) == fmt.render(seed_result)
    assert DOCUMENT_FORMATS[fmt.__name__.rsplit(".", 1)[1]](doc) == fmt.render(seed_result)


def test_the_json_document_carries_the_gate_fields(seed_result):
    doc = json.loads(json_format.render(seed_result))
    assert doc["schema_version"] == 1
    assert doc["warnings"] == ["allow-list entry 9 matches no finding"]
    assert doc["baseline"]["fixed"] == [{"id": 1, "token": "b", "verdict": "unargmaxable"}]
    assert doc["summaries"] == seed_result.summaries
    by_id = {f["id"]: f for f in doc["findings"]}
    assert by_id[2]["baseline"] == "unchanged" and by_id[4]["baseline"] == "new"
    assert all(f["explanation"] == g.explanation and f["kind"] == g.kind
               for f, g in zip(doc["findings"], seed_result.findings))
    assert doc["summary"]["failing"] == len(seed_result.failing) == sum(f["failing"] for f in doc["findings"])


def test_a_long_verdict_group_shows_twenty_then_counts_the_rest():
    allowed = [finding(k, "unargmaxable", allowed=True) for k in range(1, 24)]  # 23 allowed
    low = [finding(k, "low-ceiling", allowed=k < 103) for k in range(100, 125)]  # 3 allowed, 22 failing
    doc = document(allowed + low)
    report = text.render_document(doc)
    assert listed_ids(report) == list(range(1, 1 + SHOWN_PER_VERDICT)) + list(range(103, 103 + SHOWN_PER_VERDICT))
    lines = report.splitlines()
    assert "          … and 3 more unargmaxable findings (all of them are in --format json)" in lines
    assert ("          … and 5 more low-ceiling findings (2 of them failing; all of them are in --format json)"
            in lines)
    assert "22 failing findings (26 allowed or not in --fail-on)" in lines
    rendered = markdown.render_document(doc)
    assert "*… and 5 more low-ceiling findings (2 of them failing; all of them are in --format json)*" in rendered
    assert "### low-ceiling (25)" in rendered and rendered.count("| low-ceiling |") == SHOWN_PER_VERDICT


def test_json_lists_every_finding_that_text_leaves_out():
    head = Head(weight=np.eye(3, dtype=np.float32))
    result = GateResult(head, auditor.audit(head.weight, progress=False),
                        [Finding(k, None, "low-ceiling", probability_bounds=(0.01, 0.011)) for k in range(30)],
                        frozenset(FINDING_VERDICTS))
    assert len(listed_ids(text.render(result))) == SHOWN_PER_VERDICT
    assert [f["id"] for f in json.loads(json_format.render(result))["findings"]] == list(range(30))


def test_verdict_groups_come_in_order_and_failing_findings_first():
    findings = [finding(k, "unargmaxable", baseline="unchanged") for k in range(22)]
    findings += [finding(k, "unargmaxable", baseline="new") for k in (30, 31, 32)]
    findings += [finding(40, "tied", baseline="new"), finding(50, "inconclusive", baseline="new")]
    baseline = {"path": "base.json", "fixed": [{"id": 17, "token": "foo", "verdict": "tied"},
                                               {"id": 60, "token": None, "verdict": "unargmaxable"}]}
    report = text.render_document(document(findings, baseline=baseline))
    assert listed_ids(report) == [30, 31, 32] + list(range(SHOWN_PER_VERDICT - 3)) + [40, 50]
    lines = report.splitlines()
    assert "          … and 5 more unargmaxable findings (all of them are in --format json)" in lines
    assert next(line for line in lines if line.split()[:1] == ["30"]).endswith("[new]")
    assert next(line for line in lines if line.split()[:1] == ["0"]).endswith("[unchanged]")
    assert "fixed since the baseline: 2 findings: 17 'foo' tied, 60 unargmaxable (baseline base.json)" in lines
    assert lines[-1] == "5 failing findings (22 pass: allowed, unchanged since the baseline, or not in --fail-on)"
    rendered = markdown.render_document(document(findings, baseline=baseline))
    assert "| allowed | baseline |" in rendered
    assert "| 30 |  | unargmaxable | residual 2.7e-14 |  |  | new |" in rendered


def test_explanations_stand_in_the_evidence_column_with_their_number():
    doc = document([finding(4000, "unargmaxable", explanation="at the mean of all rows (mean-initialised)"),
                    finding(4004, "tied", tied_with=[17], explanation="copy of row 17"),
                    finding(4100, "unargmaxable")])
    report = text.render_document(doc)
    assert "at the mean of all rows (mean-initialised) (residual 2.7e-14)" in finding_text(report, 4000)
    assert "copy of row 17 (group argmaxable)" in finding_text(report, 4004)
    assert finding_text(report, 4100) == "4100 unargmaxable residual 2.7e-14"
    rendered = markdown.render_document(doc)
    assert "| at the mean of all rows (mean-initialised) (residual 2.7e-14) |" in rendered
    assert "| copy of row 17 (group argmaxable) |" in rendered


def test_a_long_explanation_wraps_in_its_column_and_keeps_its_number_whole():
    rows = [{"id": 1337, "token": None, "weight": 0.05}, {"id": 366, "token": None, "weight": 0.049}]
    long = "inside the hull of 65 rows, mainly 1337 (0.05), 366 (0.049), 2581 (0.048) and 62 more"
    doc = document([finding(1900, "unargmaxable", explanation=long, competitors=rows, support=65),
                    finding(1901, "unargmaxable", competitors=rows, support=65)])
    lines = text.render_document(doc).splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("    1900"))
    assert lines[first].index("1337 0.05") == next(line for line in lines if line.startswith("    1901")).index(
        "1337 0.05")
    assert lines[first + 2].strip() == "(residual 2.7e-14)"  # the number is never cut from its name


def test_a_bounded_domain_states_a_dual_bound_not_a_residual():
    plain = document([finding(7, "unargmaxable", residual=-1.1)], domain="ball:2")
    report = text.render_document(plain)
    assert "dual bound -1.1e+00 (no point of the ball of radius 2 lets it win)" in finding_text(report, 7)
    assert "residual" not in report and "dual bound -1.1e+00" in markdown.render_document(plain)
    explained = document([finding(7, "unargmaxable", residual=-1.1, explanation="inside the hull of 3 rows")],
                         domain="box:1")
    report = text.render_document(explained)
    assert "inside the hull of 3 rows (dual bound -1.1e+00)" in finding_text(report, 7)
    legend = " ".join(report[report.index("dual bound: "):].split())
    assert legend.startswith("dual bound: the certificate's upper bound on the token's margin (its logit minus "
                             "the largest other logit) anywhere in the box of radius 1")


def test_a_real_ball_audit_reports_the_dual_bound():
    head = Head(weight=SEED)
    result = run_gate(head, auditor.audit(SEED, domain="ball:2", progress=False))
    row = finding_text(text.render(result), 4)
    assert row.startswith("4 unargmaxable") and "dual bound" in row and "residual" not in row


def test_summaries_follow_the_counts_and_warnings_are_marked():
    doc = document([finding(4000, "unargmaxable")], summaries=["4 rows at the mean of all rows: 4000–4003"],
                   warnings=["allow-list entry 9 matches no finding"])
    lines = text.render_document(doc).splitlines()
    at = lines.index("verdicts argmaxable 4999, unargmaxable 1")
    assert lines[at + 1] == "summary  4 rows at the mean of all rows: 4000–4003"
    assert "warning  allow-list entry 9 matches no finding" in lines
    rendered = markdown.render_document(doc)
    assert "- 4 rows at the mean of all rows: 4000–4003" in rendered
    assert "> **warning:** allow-list entry 9 matches no finding" in rendered


def test_each_summary_is_followed_by_its_next_step():
    doc = document([finding(4000, "unargmaxable", kind="mean")], summaries=["4 rows at the mean of all rows: 4000"])
    doc["next_steps"] = [NEXT_STEPS["mean"]]
    lines = text.render_document(doc).splitlines()
    at = lines.index("summary  4 rows at the mean of all rows: 4000")
    assert lines[at + 1].startswith("next     the model can never produce these tokens")
    end = next(i for i in range(at + 2, len(lines)) if not lines[i].startswith(" " * 9))
    assert " ".join(line[9:] for line in lines[at + 1:end]) == NEXT_STEPS["mean"]  # wrapped under the summary
    rendered = markdown.render_document(doc)
    assert "- 4 rows at the mean of all rows: 4000\n  - *next:* the model can never produce these tokens" in rendered


def test_a_finding_fails_when_one_of_its_classes_is_in_fail_on():
    from auditor.formats._common import is_failing

    doc = document([], fail_on=("unargmaxable", "never-emitted", "inconclusive", "low-ceiling"))
    emitted = finding(17, "tied", classes=["tied"])
    never = finding(4004, "tied", tied_with=[17], classes=["never-emitted", "tied"])
    group = finding(9, "tied", group_verdict="unargmaxable", classes=["unargmaxable", "never-emitted", "tied"])
    assert [is_failing(f, doc) for f in (emitted, never, group)] == [False, True, True]
    assert is_failing(finding(4, "tied"), document([], fail_on=("tied",)))  # a document without classes


def _shard(index, findings, **fields):
    doc = document(findings, **fields)
    doc["shard"] = {"index": index, "count": 2, "first": (index - 1) * 2500, "stop": index * 2500}
    return doc


def test_merge_summarises_groups_that_straddle_shards_and_keeps_the_run_s_warnings_and_one_baseline():
    base = {"path": "base.json", "n_tokens": 5000}
    mean = {"kind": "mean"}
    first = _shard(1, [finding(7, "unargmaxable", baseline="new", kind="hull"),
                       finding(2498, "unargmaxable", **mean), finding(2499, "unargmaxable", **mean)],
                   summaries=["stale: shard 1 alone"],
                   warnings=["allow-list entry 3000 matches no finding", "allow-list entry 9999 is not a token id",
                             "allow-list entry 12 matches no finding", 'allow-list entry "<pad>" matches no finding'],
                   baseline={**base, "new": 1, "unchanged": 0, "fixed": [{"id": 5, "token": None, "verdict": "tied"}]})
    second = _shard(2, [finding(2500, "unargmaxable", **mean),
                        finding(3000, "tied", baseline="unchanged", kind="copy")],
                    warnings=["allow-list entry 9999 is not a token id"],
                    baseline={**base, "new": 0, "unchanged": 1,
                              "fixed": [{"id": 2600, "token": None, "verdict": "unargmaxable"}]})
    merged = merge_reports([second, first])
    assert merged["summaries"] == [
        "1 row inside the hull of other rows: 7",
        "3 rows at the mean of all rows: 2498–2500, typical of a vocabulary resized with mean initialisation",
        "1 row in 1 group of identical rows (3000 = 3001): greedy decoding emits only the lowest id of a group that "
        "can win"]
    assert merged["next_steps"] == [NEXT_STEPS["hull"], NEXT_STEPS["mean"], NEXT_STEPS["copy"]]
    # shard 2 reports token 3000; only shard 1 decided id 12 (shard 2 does not warn about ids it leaves
    # undecided); a token string is stale only when no shard's findings have it
    assert merged["warnings"] == ["allow-list entry 9999 is not a token id", "allow-list entry 12 matches no finding"]
    assert merged["baseline"] == {**base, "new": 1, "unchanged": 1,
                                  "fixed": [{"id": 5, "token": None, "verdict": "tied"},
                                            {"id": 2600, "token": None, "verdict": "unargmaxable"}]}
    other = _shard(2, [], baseline={"path": "other.json", "n_tokens": 5000, "new": 0, "unchanged": 0, "fixed": []})
    with pytest.raises(InputError, match="baseline differs"):
        merge_reports([first, other], ["part1.json", "part2.json"])


def _command(module, *args):
    return run_module(module, *args)  # in this process: the command's output, not an interpreter's start-up


@pytest.fixture(scope="module")
def demo_shards(tmp_path_factory):
    folder = tmp_path_factory.mktemp("demo_shards")
    parts = [folder / f"part{i}.json" for i in (1, 2)]
    for i, part in enumerate(parts, start=1):
        done = _command("auditor", FIXTURES / "resized_demo.safetensors", "--shard", f"{i}/2", "--format", "json",
                        "--quiet", "--output", part)
        assert done.returncode in (0, 1), done.stderr
    return parts


@pytest.mark.slow
def test_merge_prints_the_merged_report_as_text(demo_shards):
    done = _command("auditor.cli.merge", *demo_shards, "--format", "text")
    assert done.returncode == 1, done.stderr
    rows = {line.split()[0]: line.split()[1] for line in done.stdout.splitlines() if line[:8].strip().isdigit()}
    expected = {"1900", "2631", "4000", "4001", "4002", "4003"}
    assert rows == {**{k: "unargmaxable" for k in expected}, "17": "tied", "4004": "tied"}
    # 17 is the lowest id of its group, which can win: greedy decoding emits it, so it passes, after 4004
    assert listed_ids(done.stdout) == [1900, 2631, 4000, 4001, 4002, 4003, 4004, 17]
    assert "shards   2 merged; the times are their sum" in done.stdout
    assert done.stdout.splitlines()[-1] == "7 failing findings (1 allowed or not in --fail-on)"


@pytest.mark.slow
def test_merge_writes_markdown_to_its_output(demo_shards, tmp_path):
    out = tmp_path / "merged.md"
    done = _command("auditor.cli.merge", *demo_shards, "--format", "markdown", "--output", out)
    assert done.returncode == 1 and done.stdout == "", done.stderr
    rendered = out.read_text()
    assert rendered.startswith("## Argmaxability audit: fails")
    assert "### unargmaxable (6)" in rendered and "### tied (2)" in rendered
    assert "| 4004 |  | tied |" in rendered
