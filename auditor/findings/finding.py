"""Findings: the tokens a report says are not argmaxable (or below a probability ceiling), with their main rivals."""

from __future__ import annotations

from dataclasses import dataclass, field

from auditor.question.head import Head
from auditor.verdicts.report import AuditReport

FINDING_VERDICTS = ("unargmaxable", "tied", "inconclusive", "low-ceiling")
# what --fail-on names: the verdicts, and "never-emitted", every token greedy decoding can never produce
GATE_CLASSES = ("unargmaxable", "never-emitted", "tied", "inconclusive", "low-ceiling", "padding")
# "padding": rows past the tokenizer's length (padded vocabularies): no text names their ids, so they fail only
# when asked for
# fails on every token greedy decoding can never produce and on none it can; "tied" is left out because the
# lowest id of a tied group that can win is emitted (a tied row greedy decoding never emits is never-emitted)
DEFAULT_FAIL_ON = frozenset({"unargmaxable", "never-emitted", "inconclusive", "low-ceiling"})
_COMPETITORS = 5  # rows of a convex certificate named as a finding's competitors


@dataclass(frozen=True)
class Competitor:
    id: int
    token: str | None
    weight: float
    can_win: bool | None = None  # whether this row can itself be the argmax (None: this run did not decide it)


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
    explanation: str = ""  # what the certificate shows, in plain words (auditor/findings/explain.py)
    kind: str | None = None  # the explanation's category: "copy", "mean", "shorter copy", "hull", ...
    baseline: str | None = None  # with --baseline: "new" or "unchanged"
    next_step: str = ""  # what people usually do about a finding of its kind (auditor/findings/explain.py)
    # can greedy decoding (the first maximal logit, as torch.argmax) produce it: "emits", "never" or "unknown"
    greedy: str = "unknown"
    classes: tuple[str, ...] = ()  # the --fail-on classes it belongs to (gate_classes)

    @property
    def group_lowest(self) -> int | None:
        """A tied token's lowest id, which greedy decoding emits whenever the group leads; None if untied."""
        return None if self.tied_with is None else min(self.id, *self.tied_with)


def greedy_decoding(verdict: str, group_verdict: str | None, lowest: bool) -> str:
    """Whether greedy decoding can produce a finding's token: "emits", "never" or "unknown".

    Greedy decoding returns the first maximal logit, so of a group of identical rows it can emit only
    the lowest id, and only when the group can win; a low-ceiling token is argmaxable.
    """
    if verdict == "tied":
        if not lowest or group_verdict == "unargmaxable":
            return "never"
        return "emits" if group_verdict == "argmaxable" else "unknown"
    return {"unargmaxable": "never", "low-ceiling": "emits"}.get(verdict, "unknown")


def gate_classes(verdict: str, group_verdict: str | None, greedy: str) -> tuple[str, ...]:
    """The --fail-on classes of a finding: its verdict; "never-emitted" when greedy decoding never produces it;
    for a tied token, also "unargmaxable" when its group is, and "inconclusive" when it is the lowest id of an
    inconclusive group (whether it can be emitted is then undecided)."""
    classes = {verdict}
    if greedy == "never":
        classes.add("never-emitted")
    if verdict == "tied" and group_verdict == "unargmaxable":
        classes.add("unargmaxable")
    if verdict == "tied" and greedy == "unknown":
        classes.add("inconclusive")
    return tuple(c for c in GATE_CLASSES if c in classes)



def collect_findings(head: Head, report: AuditReport, ceiling: float | None = None) -> list[Finding]:
    """Every token that is not argmaxable; with ``ceiling``, also argmaxable tokens whose
    probability ceiling is below it (their upper bound is below ``ceiling``)."""
    findings = []
    # rows that can never be the argmax, and rows this run did not settle (undecided, inconclusive): a rival's
    # "can win" is said only where the audit proved it
    cannot_win = set(report.ids("unargmaxable", groups=True))
    unsettled = set(report.ids("inconclusive", groups=True)) | (
        set(report.ids("undecided", groups=True)) if report.counts.get("undecided") else set())
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
            lowest = token.tied_with is None or k < min(token.tied_with)
            finding.greedy = greedy_decoding(verdict, token.group_verdict, lowest)
            finding.classes = gate_classes(verdict, token.group_verdict, finding.greedy)
            if token.convex_indices is not None:
                finding.support = len(token.convex_indices)
                finding.competitors = _competitors(head, token, cannot_win, unsettled)
            findings.append(finding)
    findings.sort(key=lambda f: f.id)
    return findings


def _competitors(head, token, cannot_win: set[int], unsettled: set[int]) -> list[Competitor]:
    """The rows of a convex certificate named as a finding's rivals, by weight, each marked with whether it can
    win itself (a padding row the certificate leans on can never outscore the token where it matters);
    ``can_win`` is None for a row the run did not settle. The order is the certificate's alone, so an audit
    in blocks names the rivals a whole audit names."""
    return [Competitor(int(i), head.token(int(i)), float(w), None if i in unsettled else i not in cannot_win)
            for i, w in zip(token.convex_indices[:_COMPETITORS].tolist(), token.convex_weights[:_COMPETITORS].tolist())]
