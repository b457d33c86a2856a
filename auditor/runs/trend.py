"""A training run's trend: the gate results of its checkpoints in step order, as one table, and the watched tokens
whose verdict changed from one checkpoint to the next (``audit OUTPUT_DIR --all-checkpoints``)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from auditor.findings.gate import GateResult
from auditor.verdicts.report import AuditReport


def min_margin(report: AuditReport) -> float:
    """The smallest lead of a decided token at its witness; 0 while one of them cannot be produced (greedy
    decoding never emits it, or it is inconclusive), and 0 when none is argmaxable."""
    margins = report.margins()[report.ids("argmaxable")]
    margins = margins[np.isfinite(margins)]
    if report.never_emitted() or report.counts["inconclusive"] > 0 or margins.size == 0:
        return 0.0
    return float(margins.min())


@dataclass
class CheckpointSummary:
    """One row of the trend: what the gate found at one checkpoint."""

    name: str  # the folder's name, checkpoint-N
    step: int | None  # None: the output folder's own checkpoint, saved after the last step ("final")
    path: str
    n_tokens: int
    counts: dict[str, int]  # tokens per verdict (report.counts)
    never_emitted: int  # tokens greedy decoding can never produce
    min_margin: float  # finite: min_margin(report)
    failing: int  # findings that fail the gate
    exit_code: int
    watched: dict[int, tuple[str | None, str]] = field(default_factory=dict)  # id -> (token string, verdict)

    @property
    def gate(self) -> str:
        return "fail" if self.failing else "pass"


@dataclass(frozen=True)
class VerdictChange:
    """A watched token whose verdict at ``checkpoint`` differs from the one at the checkpoint before it."""

    id: int
    token: str | None
    checkpoint: str
    before: str
    after: str

    def describe(self) -> str:
        name = f"{self.token!r} (id {self.id})" if self.token is not None else f"id {self.id}"
        return f"{name} {self.after} from {self.checkpoint} ({self.before} before)"


def summarise(name: str, step: int | None, result: GateResult, watched: list[int] | None) -> CheckpointSummary:
    """The trend's row for one checkpoint's gate result; ``watched`` the ids --tokens named (None: every token,
    whose verdicts are then not kept)."""
    report = result.report
    verdicts = {k: (result.head.token(k), report.tokens[k].verdict) for k in watched or ()}
    return CheckpointSummary(name=name, step=step, path=str(result.head.path), n_tokens=report.n_tokens,
                             counts=report.counts, never_emitted=len(report.never_emitted()),
                             min_margin=min_margin(report), failing=len(result.failing), exit_code=result.exit_code,
                             watched=verdicts)


def verdict_changes(summaries: list[CheckpointSummary]) -> list[VerdictChange]:
    """Each watched token's changes of verdict between consecutive checkpoints, in step order, then by id."""
    changes = []
    for before, after in zip(summaries, summaries[1:]):
        for k, (token, verdict) in sorted(after.watched.items()):
            if k in before.watched and before.watched[k][1] != verdict:
                changes.append(VerdictChange(k, token, after.name, before.watched[k][1], verdict))
    return changes


def to_json(summaries: list[CheckpointSummary]) -> list[dict]:
    """One object per checkpoint, in step order; ``changed`` holds the watched tokens whose verdict differs
    from the checkpoint before."""
    changes = verdict_changes(summaries)
    return [{
        "checkpoint": summary.name,
        "step": summary.step,
        "path": summary.path,
        "summary": {"n_tokens": summary.n_tokens, **summary.counts, "never_emitted": summary.never_emitted},
        "min_margin": summary.min_margin,
        "failing": summary.failing,
        "gate": summary.gate,
        "exit_code": summary.exit_code,
        "watched": [{"id": k, "token": token, "verdict": verdict}
                    for k, (token, verdict) in sorted(summary.watched.items())],
        "changed": [{"id": c.id, "token": c.token, "before": c.before, "after": c.after}
                    for c in changes if c.checkpoint == summary.name],
    } for summary in summaries]


def render_json(summaries: list[CheckpointSummary]) -> str:
    """``to_json`` as the command writes it."""
    return json.dumps(to_json(summaries), indent=2, allow_nan=False) + "\n"


_COLUMNS = ("checkpoint", "step", "unargmaxable", "never-emitted", "tied", "inconclusive", "min margin", "gate")


def render_text(folder: str, summaries: list[CheckpointSummary]) -> str:
    """The trend as a table, one row per checkpoint, then the watched tokens' changes of verdict."""
    rows = [(s.name, str(s.step) if s.step is not None else "final", str(s.counts["unargmaxable"]),
             str(s.never_emitted), str(s.counts["tied"]), str(s.counts["inconclusive"]), f"{s.min_margin:.3g}",
             f"fail ({s.failing} failing)" if s.failing else "pass") for s in summaries]
    widths = [max(len(cell) for cell in column) for column in zip(_COLUMNS, *rows)]
    lines = [f"trend    {folder}: {len(summaries)} checkpoint{'s' if len(summaries) != 1 else ''} in step order; "
             f"the exit code is {summaries[-1].name}'s gate", ""]
    for cells in (_COLUMNS, *rows):
        lines.append("  ".join(cell.ljust(width) if i in (0, len(cells) - 1) else cell.rjust(width)
                               for i, (cell, width) in enumerate(zip(cells, widths))).rstrip())
    if any(s.watched for s in summaries):
        changes = verdict_changes(summaries)
        lines.append("")
        lines += [f"changed  {change.describe()}" for change in changes] or [
            "changed  no watched token changed verdict"]
    return "\n".join(lines) + "\n"
