"""The pre-release gate: which findings fail the run, given --fail-on, an allow-list and a baseline; the exit code."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from auditor.errors import EXIT_CLEAN, EXIT_FINDINGS, InputError
from auditor.findings.baseline import Baseline
from auditor.findings.explain import explain, next_steps
from auditor.findings.finding import (DEFAULT_FAIL_ON, FINDING_VERDICTS, GATE_CLASSES, Finding,  # noqa: F401 (the gate's names)
                                      collect_findings)
from auditor.question.head import Head
from auditor.verdicts.report import AuditReport


@dataclass
class AllowList:
    """Token ids and exact token strings whose findings are expected.

    One entry per line; ``#`` starts a comment. A line that is an integer is a
    token id, one like ``2002-2047`` a range of ids (both ends included), and one
    like ``128000-`` every id from there on; anything else is a token string, taken literally after trimming the line,
    or written as a JSON string ("123", "2002-2047", " leading space") to say
    exactly which string is meant.
    """

    ids: set[int] = field(default_factory=set)
    strings: set[str] = field(default_factory=set)
    ranges: list[tuple[int, int | None]] = field(default_factory=list)  # (first, last), both included; last None: on

    @classmethod
    def read(cls, path: Path) -> AllowList:
        try:
            text = Path(path).read_text(encoding="utf-8")
        except OSError as error:
            raise InputError(f"{path}: cannot read the allow-list ({error.strerror or error})") from None
        allow = cls()
        decoder = json.JSONDecoder()
        for number, raw in enumerate(text.splitlines(), start=1):
            line = raw.strip()
            if line.startswith('"'):
                try:
                    string, end = decoder.raw_decode(line)
                except ValueError:
                    raise InputError(f"{path}:{number}: not a valid quoted token string: {line}") from None
                rest = line[end:].strip()
                if rest and not rest.startswith("#"):
                    raise InputError(f"{path}:{number}: unexpected text after the quoted token string: {rest}")
                allow.strings.add(string)
                continue
            # '#' starts a comment at the start of a line or after a space: "C#" is a token string
            line = re.split(r"(?:^|\s)#", line, maxsplit=1)[0].strip()
            if not line:
                continue
            if re.fullmatch(r"[0-9]+", line):
                allow.ids.add(int(line))
            elif (bounds := re.fullmatch(r"([0-9]+)\s*-\s*([0-9]*)", line)) is not None:
                first, last = int(bounds[1]), (int(bounds[2]) if bounds[2] else None)
                if last is not None and first > last:
                    raise InputError(f"{path}:{number}: the range {line} runs backwards")
                allow.ranges.append((first, last))
            else:
                allow.strings.add(line)
        return allow

    def allows(self, k: int, token: str | None) -> bool:
        return (k in self.ids or any(_within(k, first, last) for first, last in self.ranges)
                or (token is not None and token in self.strings))

    def unused(self, findings: list[Finding], n_tokens: int, undecided: set[int] = frozenset()) -> list[str]:
        """Warnings for the entries that match no finding: stale entries hide nothing and mislead.
        Ids this run did not decide (--tokens, --shard) are not stale."""
        ids = {f.id for f in findings} | set(undecided)
        strings = {f.token for f in findings if f.token is not None}
        warnings = [f"allow-list entry {k} is not a token id of this head (0..{n_tokens - 1})"
                    for k in sorted(self.ids) if k >= n_tokens]
        warnings += [f"allow-list entry {k} matches no finding" for k in sorted(self.ids - ids) if k < n_tokens]
        warnings += [f"allow-list entry {json.dumps(t, ensure_ascii=False)} matches no finding"
                     for t in sorted(self.strings - strings)]
        for first, last in self.ranges:
            entry = f"{first}-{'' if last is None else last}"
            if first >= n_tokens:
                warnings.append(f"allow-list entry {entry} is not a range of token ids of this head "
                                f"(0..{n_tokens - 1})")
            elif not any(_within(k, first, last) for k in ids):
                warnings.append(f"allow-list entry {entry} matches no finding")
        return warnings


def _within(k: int, first: int, last: int | None) -> bool:
    return first <= k and (last is None or k <= last)


@dataclass
class GateResult:
    head: Head
    report: AuditReport
    findings: list[Finding]
    fail_on: frozenset[str]
    load_seconds: float = 0.0
    ceiling: float | None = None
    shard: dict | None = None  # {"index", "count", "first", "stop"} when the command ran one shard
    summaries: list[str] = field(default_factory=list)  # one line per group of findings alike (explain.py)
    next_steps: list[str] = field(default_factory=list)  # what to do about each summary line's findings
    baseline: dict | None = None  # with --baseline: {"path", "fixed": [{"id", "token", "verdict"}]}
    warnings: list[str] = field(default_factory=list)  # e.g. allow-list entries that match no finding

    @property
    def failing(self) -> list[Finding]:
        """Findings that fail the run: of a class in --fail-on, not allowed, and (with a baseline) new."""
        return [f for f in self.findings if fails_on(f, self.fail_on) and not f.allowed and f.baseline != "unchanged"]

    @property
    def exit_code(self) -> int:
        return EXIT_FINDINGS if self.failing else EXIT_CLEAN


def fails_on(finding: Finding, fail_on) -> bool:
    """Whether one of the finding's classes (findings.gate_classes; its verdict when it has none) is in ``fail_on``."""
    return any(name in fail_on for name in finding.classes or (finding.verdict,))


def parse_fail_on(text: str) -> frozenset[str]:
    """``"unargmaxable,never-emitted"`` -> that set; ``"none"`` -> the empty set."""
    names = {part.strip() for part in text.split(",") if part.strip()}
    if names == {"none"}:
        return frozenset()
    unknown = names - set(GATE_CLASSES)
    if unknown or not names:
        raise InputError(f"--fail-on takes classes from {', '.join(GATE_CLASSES)} or 'none', got {text!r}")
    return frozenset(names)


def run_gate(head: Head, report: AuditReport, fail_on=DEFAULT_FAIL_ON, allow: AllowList | None = None,
             load_seconds: float = 0.0, ceiling: float | None = None, baseline: Baseline | None = None) -> GateResult:
    """Findings with their explanations, allow-list marks and (given a baseline) new/unchanged marks."""
    findings = collect_findings(head, report, ceiling)
    if allow is not None:
        for finding in findings:
            finding.allowed = allow.allows(finding.id, finding.token)
    result = GateResult(head, report, findings, frozenset(fail_on), load_seconds, ceiling)
    # ids past the baseline's vocabulary, or past the tokenizer model's own, were added: untrained, not rare
    first_added = baseline.n_tokens if baseline is not None else head.base_vocab
    result.summaries = explain(head, report, findings, first_added)
    result.next_steps = next_steps([{"kind": f.kind} for f in findings])
    if allow is not None:
        result.warnings += allow.unused(findings, report.n_tokens, set(report.ids("undecided")))
    if baseline is not None:
        result.baseline = baseline.mark(findings, head, report)
    return result
