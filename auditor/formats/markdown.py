"""Markdown, for pull-request comments and model cards: the head, the counts, one table per verdict."""

from __future__ import annotations

import html
import re

from auditor.findings.gate import GateResult
from auditor.formats import json_format
from auditor.formats._common import (competitors, dual_bound_legend, evidence, failing_line, fixed_line,
                                     grouped_findings, has_token_strings, head_lines, left_out_line, token_label,
                                     verdict_counts)


def _cell(text: str) -> str:
    """Table-cell text that renders as itself: tokens like <s> or *_* are not markup."""
    text = html.escape(text, quote=False).replace("\n", " ")
    return re.sub(r"([\\`*_\[\]|~#])", r"\\\1", text)


def render_document(doc: dict) -> str:
    """The markdown report of a JSON document (json_format.document, or a merged one)."""
    status = "fails" if doc["summary"]["failing"] else "passes"
    out = [f"## Argmaxability audit: {status}", "", "| | |", "| --- | --- |"]
    out += [f"| {label} | {_cell(value)} |" for label, value in head_lines(doc)]
    out += ["", "| verdict | tokens |", "| --- | ---: |"]
    out += [f"| {name} | {count} |" for name, count in verdict_counts(doc).items()]
    if doc.get("summaries"):
        steps = doc.get("next_steps") or []
        out.append("")
        for index, line in enumerate(doc["summaries"]):
            out.append(f"- {_cell(line)}")
            if index < len(steps):
                out.append(f"  - *next:* {_cell(steps[index])}")
    if doc.get("notes"):
        out += [""] + [f"> {_cell(note)}" for note in doc["notes"]]
    for warning in doc.get("warnings", []):  # one blockquote each: consecutive quoted lines would run together
        out += ["", f"> **warning:** {_cell(warning)}"]
    with_tokens = has_token_strings(doc)
    with_baseline = doc.get("baseline") is not None
    groups = grouped_findings(doc)
    for verdict, listed, left_out in groups:
        header = "| id | token | verdict | evidence | main competitors (weight) | allowed |"
        rule = "| ---: | --- | --- | --- | --- | --- |"
        if with_baseline:
            header, rule = header + " baseline |", rule + " --- |"
        out += ["", f"### {verdict} ({len(listed) + len(left_out)})"] + (["", header, rule] if listed else [])
        for f in listed:
            token = _cell(token_label(f["token"])) if with_tokens else ""
            row = (f"| {f['id']} | {token} | {f['verdict']} | {_cell(evidence(f, doc))} | "
                   f"{_cell(competitors(f, with_tokens))} | {'yes' if f['allowed'] else ''} |")
            out.append(row + (f" {f.get('baseline') or ''} |" if with_baseline else ""))
        if left_out:
            out += ["", f"*{_cell(left_out_line(verdict, left_out, doc))}*"]
    if not groups:
        out += ["", "No token is unargmaxable, tied or inconclusive."]
    legend = dual_bound_legend(doc)
    if legend:
        out += ["", _cell(legend)]
    fixed = fixed_line(doc)
    if fixed:
        out += ["", _cell(fixed)]
    out += ["", _cell(failing_line(doc))]
    return "\n".join(out) + "\n"


def render(result: GateResult) -> str:
    return render_document(json_format.document(result))
