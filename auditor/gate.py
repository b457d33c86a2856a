"""The pre-release gate: turn a report into findings, apply an allow-list, decide the exit code."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from auditor.baseline import Baseline
from auditor.errors import InputError
from auditor.head import Head
from auditor.report import AuditReport

FINDING_VERDICTS = ("unargmaxable", "tied", "inconclusive", "low-ceiling")
DEFAULT_FAIL_ON = frozenset(FINDING_VERDICTS)
EXIT_CLEAN, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2
_COMPETITORS = 5


@dataclass(frozen=True)
class Competitor:
    id: int
    token: str | None
    weight: float


@dataclass
class Finding:
    """A token whose verdict is not argmaxable, with what the reader needs to act on it."""

    id: int
    token: str | None
    verdict: str
    residual: float | None = None
    bias_gap: float | None = None
    competitors: list[Competitor] = field(default_factory=list)
    support: int = 0  # how many rows the convex certificate uses
    tied_with: list[int] | None = None
    group_verdict: str | None = None
    bounds: tuple[float, float] | None = None
    probability_bounds: tuple[float, float] | None = None  # (reached, upper bound) of the softmax probability
    allowed: bool = False
    stage: str | None = None  # the engine stage that settled it ("interior", "lp", "unbounded hull", ...)
    explanation: str = ""  # what the certificate shows, in plain words (auditor/explain.py)
    kind: str | None = None  # the explanation's category: "copy", "mean", "shorter copy", "hull", ...
    baseline: str | None = None  # with --baseline: "new" or "unchanged"


@dataclass
class AllowList:
    """Token ids and exact token strings whose findings are expected.

    One entry per line; ``#`` starts a comment. A line that is an integer is a
    token id; anything else is a token string, taken literally after trimming
    the line, or written as a JSON string ("123", " leading space") to say
    exactly which string is meant.
    """

    ids: set[int] = field(default_factory=set)
    strings: set[str] = field(default_factory=set)

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
            else:
                allow.strings.add(line)
        return allow

    def allows(self, k: int, token: str | None) -> bool:
        return k in self.ids or (token is not None and token in self.strings)

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
        return warnings


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
    baseline: dict | None = None  # with --baseline: {"path", "fixed": [{"id", "token", "verdict"}]}
    warnings: list[str] = field(default_factory=list)  # e.g. allow-list entries that match no finding

    @property
    def failing(self) -> list[Finding]:
        """Findings that fail the run: verdict in --fail-on, not allowed, and (with a baseline) new."""
        return [f for f in self.findings if f.verdict in self.fail_on and not f.allowed and f.baseline != "unchanged"]

    @property
    def exit_code(self) -> int:
        return EXIT_FINDINGS if self.failing else EXIT_CLEAN


def parse_fail_on(text: str) -> frozenset[str]:
    """``"unargmaxable,tied"`` -> that set; ``"none"`` -> the empty set."""
    names = {part.strip() for part in text.split(",") if part.strip()}
    if names == {"none"}:
        return frozenset()
    unknown = names - set(FINDING_VERDICTS)
    if unknown or not names:
        raise InputError(f"--fail-on takes verdicts from {', '.join(FINDING_VERDICTS)} or 'none', got {text!r}")
    return frozenset(names)


def collect_findings(head: Head, report: AuditReport, allow: AllowList | None = None,
                     ceiling: float | None = None) -> list[Finding]:
    """Every token that is not argmaxable; with ``ceiling``, also argmaxable tokens whose
    probability ceiling is below it (their upper bound is below ``ceiling``)."""
    findings = []
    low = []
    if ceiling is not None:  # from the arrays: building every argmaxable token's verdict would cost seconds
        upper = report.ceilings()[1]
        low = [k for k in report.ids("argmaxable") if upper[k] < ceiling]  # NaN (not computed) is never below
    for verdict in FINDING_VERDICTS:
        for k in (low if verdict == "low-ceiling" else report.ids(verdict)):
            token = report.tokens[k]
            finding = Finding(id=k, token=head.token(k), verdict=verdict, residual=token.residual,
                              bias_gap=token.bias_gap, tied_with=token.tied_with,
                              group_verdict=token.group_verdict, bounds=token.bounds,
                              probability_bounds=token.probability_bounds, stage=token.stage)
            if token.convex_indices is not None:
                finding.support = len(token.convex_indices)
                finding.competitors = [Competitor(int(i), head.token(int(i)), float(w)) for i, w in
                                       zip(token.convex_indices[:_COMPETITORS], token.convex_weights[:_COMPETITORS])]
            finding.allowed = allow is not None and allow.allows(k, finding.token)
            findings.append(finding)
    findings.sort(key=lambda f: f.id)
    return findings


def run_gate(head: Head, report: AuditReport, fail_on=DEFAULT_FAIL_ON, allow: AllowList | None = None,
             load_seconds: float = 0.0, ceiling: float | None = None, baseline: Baseline | None = None) -> GateResult:
    """Findings with their explanations, allow-list marks and (given a baseline) new/unchanged marks."""
    from auditor.explain import explain

    findings = collect_findings(head, report, allow, ceiling)
    result = GateResult(head, report, findings, frozenset(fail_on), load_seconds, ceiling)
    result.summaries = explain(head, report, findings)
    if allow is not None:
        result.warnings += allow.unused(findings, report.n_tokens, set(report.ids("undecided")))
    if baseline is not None:
        result.baseline = baseline.mark(findings, head, report)
    return result
