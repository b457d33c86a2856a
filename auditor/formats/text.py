"""Plain text for a terminal: the head, the counts, then the findings, grouped by verdict."""

from __future__ import annotations

import re
import textwrap
import unicodedata

from auditor.findings.gate import GateResult
from auditor.formats import json_format
from auditor.formats._common import (competitors, dual_bound_legend, evidence, failing_line, fixed_line,
                                     grouped_findings, has_token_strings, head_lines, left_out_line,
                                     token_label, verdict_counts)

# the evidence column is as wide as its longest entry within these bounds; a longer explanation wraps
# onto the following lines of its column, so the competitors stay in line
_EVIDENCE_WIDTH = (26, 48)
_NEXT_STEP_WIDTH = 100  # a summary's next step wraps at this width, under the summary


def _wrapped(evidence_text: str, width: int) -> list[str]:
    """The evidence cut into lines of the column, never inside "residual 2.7e-14" or "group argmaxable"."""
    # textwrap breaks only at ASCII whitespace: a NUL, which no explanation holds, keeps a space unbroken
    glued = re.sub(r"(?<=\w) (?=-?\d)|(?<=dual) (?=bound)|(?<=group) (?=\w)", "\0", evidence_text)
    pieces = textwrap.wrap(glued, width, break_on_hyphens=False) or [""]
    return [piece.replace("\0", " ") for piece in pieces]


def _padded(text: str, width: int) -> str:
    """``text`` filled to ``width`` terminal columns: CJK and other wide characters take two."""
    wide = sum(unicodedata.east_asian_width(ch) in "WF" for ch in text)
    return text + " " * max(0, width - len(text) - wide)


def _tags(finding: dict) -> str:
    """[allowed], and with a baseline [new] or [unchanged]."""
    tags = (["allowed"] if finding["allowed"] else []) + ([finding["baseline"]] if finding.get("baseline") else [])
    return "".join(f"  [{tag}]" for tag in tags)


def _summaries(doc: dict) -> list[str]:
    """Each summary line, followed by its next step (wrapped under it); a document without next steps has none."""
    steps = doc.get("next_steps") or []
    lines = []
    for index, summary in enumerate(doc.get("summaries", [])):
        lines.append(f"{'summary':<8} {summary}")
        if index < len(steps):
            first, *rest = textwrap.wrap(steps[index], _NEXT_STEP_WIDTH)
            lines += [f"{'next':<8} {first}"] + [f"{'':<8} {piece}" for piece in rest]
    return lines


def render_document(doc: dict) -> str:
    """The text report of a JSON document (json_format.document, or a merged one)."""
    lines = [f"{label:<8} {value}" for label, value in head_lines(doc)]
    lines.append(f"{'verdicts':<8} " + ", ".join(f"{name} {count}" for name, count in verdict_counts(doc).items()))
    lines += _summaries(doc)
    lines += [f"{'note':<8} {note}" for note in doc.get("notes", [])]
    lines += [f"{'warning':<8} {warning}" for warning in doc.get("warnings", [])]
    with_tokens = has_token_strings(doc)
    groups = grouped_findings(doc)
    if groups:
        shown = [f for _, listed, _ in groups for f in listed]
        narrowest, widest = _EVIDENCE_WIDTH
        width = max([narrowest] + [min(len(evidence(f, doc)), widest) for f in shown])
        token_header = f"{'token':<18} " if with_tokens else ""
        lines += ["", f"{'id':>8}  {token_header}{'verdict':<13} {'evidence':<{width}} main competitors (weight)"]
        indent = " " * (10 + len(token_header) + 14)  # where the evidence column starts
        for verdict, listed, left_out in groups:
            for f in listed:
                token = _padded(token_label(f["token"]), 18) + " " if with_tokens else ""
                first, *rest = _wrapped(evidence(f, doc), width)
                lines.append(f"{f['id']:>8}  {token}{f['verdict']:<13} {first:<{width}} "
                             f"{competitors(f, with_tokens)}{_tags(f)}".rstrip())
                lines += [indent + piece for piece in rest]
            if left_out:
                lines.append(f"{'':>8}  {left_out_line(verdict, left_out, doc)}")
        legend = dual_bound_legend(doc)
        if legend:
            lines += [""] + textwrap.wrap(legend, 100)
    fixed = fixed_line(doc)
    if fixed:
        lines += ["", fixed]
    lines += ["", failing_line(doc)]
    return "\n".join(lines) + "\n"


def render(result: GateResult) -> str:
    return render_document(json_format.document(result))
