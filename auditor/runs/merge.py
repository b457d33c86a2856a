"""Merging the JSON reports of ``audit --shard I/N`` into the report of the whole vocabulary.

    audit --shard 1/4 --format json --output part1.json model/   # on four machines, or one after another
    ...
    audit-merge part1.json part2.json part3.json part4.json [--format text|markdown|json] [--output merged.json]

The shards must be the N parts of one run: the same head (path, tensors,
shape, dtype), domain, --fail-on and tool version, every index 1..N exactly
once. The merged report has the schema of a whole-vocabulary report
(``"shard": null``, summed counts, all findings by id, per-stage times
summed over the shards, the summary lines of all shards each once, the
warnings every shard gave, one baseline comparison) and prints as JSON
(default), text or markdown, rendered by the same code as ``audit``'s
reports. The command is auditor/cli/merge.py.
"""

from __future__ import annotations

import re
from pathlib import Path

from auditor._version import SOUND_SINCE, version_tuple
from auditor.errors import InputError
from auditor.findings.explain import next_steps, summary_lines
from auditor.util.io import read_json_report

_SAME = ("schema_version", "tool", "head", "domain", "fail_on", "ceiling")
_DECIDED = ("argmaxable", "unargmaxable", "tied", "inconclusive")


def read_shard(path: Path) -> dict:
    """One shard's JSON report; raises InputError when it is not a report of ``audit --shard I/N``."""
    document = read_json_report(path, str(path))
    if not isinstance(document, dict) or "summary" not in document or "findings" not in document:
        raise InputError(f"{path}: not a JSON report of audit (use --format json)")
    if not isinstance(document.get("shard"), dict):
        raise InputError(f"{path}: not a shard (it was written without --shard I/N)")
    version = (document.get("tool") or {}).get("version") if isinstance(document.get("tool"), dict) else None
    if version_tuple(version) < SOUND_SINCE:
        raise InputError(f"{path}: written by auditor {version}, whose bfloat16 screen could certify witnesses "
                         "that do not hold; run this shard again")
    return document


def _merged_warnings(lists, found: set[int]) -> list[str]:
    """The warnings of the whole run, in the shards' order.

    A warning about an allow-listed id ("allow-list entry 4004 matches no finding") comes from the
    shard that decided 4004 (the others leave it undecided and say nothing), so one shard saying it
    is enough, unless some shard reports 4004 (``found``: the ids of all findings). Every other
    warning is a claim about the whole run, such as "allow-list entry "<pad>" matches no finding",
    which a shard makes about its own findings only: it stands when every shard makes it."""
    lists = [list(lines) for lines in lists]
    merged = []
    for line in dict.fromkeys(line for shard in lists for line in shard):
        about_id = _ID_WARNING.fullmatch(line)
        if about_id and int(about_id.group(1)) not in found or not about_id and all(line in s for s in lists):
            merged.append(line)
    return merged


_ID_WARNING = re.compile(r"allow-list entry (\d+) matches no finding")
_BASELINE_COUNTS = ("new", "unchanged")  # per shard, so summed


def _merge_baselines(documents: list[dict], names: list[str]) -> dict | None:
    """One baseline comparison for the merged report: the shards' counts summed, their fixed findings
    together (each shard lists those among its own tokens), everything else the same in every shard."""
    baselines = [d.get("baseline") for d in documents]
    if all(b is None for b in baselines):
        return None

    def shared(baseline):
        return None if baseline is None else {k: v for k, v in baseline.items()
                                              if k != "fixed" and k not in _BASELINE_COUNTS}

    for name, baseline in zip(names, baselines):
        if shared(baseline) != shared(baselines[0]):
            raise InputError(f"{name}: its baseline differs from {names[0]}'s; run every shard with the same "
                             "--baseline")
    merged = dict(baselines[0])
    for key in _BASELINE_COUNTS:
        if key in merged:
            merged[key] = sum(b.get(key, 0) for b in baselines)
    fixed = {entry["id"]: entry for b in baselines for entry in b.get("fixed") or []}
    merged["fixed"] = [fixed[k] for k in sorted(fixed)]
    return merged


def merge_reports(documents: list[dict], names: list[str] | None = None) -> dict:
    """Merge the JSON documents of all N shards of one audit into one document."""
    names = names or [f"report {j + 1}" for j in range(len(documents))]
    if not documents:
        raise InputError("no reports to merge")
    first = documents[0]
    for name, document in zip(names, documents):
        for key in _SAME:
            if document.get(key) != first.get(key):
                raise InputError(f"{name}: its {key!r} differs from {names[0]}'s; these are not shards of one audit")
    count = first["shard"]["count"]
    seen: dict[int, str] = {}
    for name, document in zip(names, documents):
        shard = document["shard"]
        if shard["count"] != count:
            raise InputError(f"{name}: shard of {shard['count']}, but {names[0]} is a shard of {count}")
        if shard["index"] in seen:
            raise InputError(f"{name}: shard {shard['index']}/{count} again (also {seen[shard['index']]})")
        seen[shard["index"]] = name
    missing = sorted(set(range(1, count + 1)) - set(seen))
    if missing:
        raise InputError(f"shards {', '.join(f'{i}/{count}' for i in missing)} are missing")

    n = first["summary"]["n_tokens"]
    summary = {"n_tokens": n, **{v: sum(d["summary"].get(v, 0) for d in documents) for v in _DECIDED}}
    summary["undecided"] = n - sum(summary[v] for v in _DECIDED)
    findings = sorted((f for d in documents for f in d["findings"]), key=lambda f: f["id"])
    failing = sum(d["summary"]["failing"] for d in documents)
    summary["failing"] = failing
    timing: dict[str, float] = {}
    for document in documents:
        for key, seconds in document.get("timing", {}).items():
            timing[key] = round(timing.get(key, 0.0) + seconds, 6)
    merged = {key: first[key] for key in first if key not in ("summary", "findings", "timing", "shard", "notes")}
    merged.update(shard=None, summary=summary, findings=findings,
                  summaries=summary_lines(findings, first["domain"]),  # groups that straddle shards, whole
                  next_steps=next_steps(findings),
                  baseline=_merge_baselines(documents, names),
                  warnings=_merged_warnings((d.get("warnings", []) for d in documents), {f["id"] for f in findings}),
                  notes=first.get("notes", []), timing=timing, merged_from=count)
    return merged
