"""Findings: the tokens a report says are not argmaxable (or below a probability ceiling), with their main rivals."""

from __future__ import annotations

from dataclasses import dataclass, field

from auditor.head import Head
from auditor.report import AuditReport

FINDING_VERDICTS = ("unargmaxable", "tied", "inconclusive", "low-ceiling")
_COMPETITORS = 5  # rows of a convex certificate named as a finding's competitors


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



def collect_findings(head: Head, report: AuditReport, ceiling: float | None = None) -> list[Finding]:
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
            findings.append(finding)
    findings.sort(key=lambda f: f.id)
    return findings
