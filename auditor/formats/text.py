"""Plain text for a terminal: the head, the counts, then one line per finding."""

from __future__ import annotations

from auditor.formats._common import competitors, evidence, head_lines, token_label
from auditor.gate import GateResult


def render(result: GateResult) -> str:
    lines = [f"{label:<8} {value}" for label, value in head_lines(result)]
    counts = result.report.counts
    lines.append(f"{'verdicts':<8} " + ", ".join(f"{name} {count}" for name, count in counts.items() if count))
    lines += [f"{'note':<8} {note}" for note in result.head.notes]
    with_tokens = result.head.tokens is not None
    if result.findings:
        token_header = f"{'token':<18} " if with_tokens else ""
        lines += ["", f"{'id':>8}  {token_header}{'verdict':<13} {'evidence':<26} main competitors (weight)"]
        for f in result.findings:
            mark = "  [allowed]" if f.allowed else ""
            token = f"{token_label(f.token):<18} " if with_tokens else ""
            lines.append(f"{f.id:>8}  {token}{f.verdict:<13} {evidence(f):<26} {competitors(f, with_tokens)}{mark}")
    failing = len(result.failing)
    lines += ["", f"{failing} failing finding{'s' if failing != 1 else ''}"
                  + (f" ({len(result.findings) - failing} allowed or not in --fail-on)" if len(result.findings) > failing else "")]
    return "\n".join(lines) + "\n"
