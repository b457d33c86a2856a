"""Markdown, for pull-request comments and model cards."""

from __future__ import annotations

import html
import re

from auditor.formats._common import competitors, evidence, head_lines, token_label
from auditor.gate import GateResult


def _cell(text: str) -> str:
    """Table-cell text that renders as itself: tokens like <s> or *_* are not markup."""
    text = html.escape(text, quote=False).replace("\n", " ")
    return re.sub(r"([\\`*_\[\]|~#])", r"\\\1", text)


def render(result: GateResult) -> str:
    status = "fails" if result.failing else "passes"
    out = [f"## Argmaxability audit: {status}", "", "| | |", "| --- | --- |"]
    out += [f"| {label} | {_cell(value)} |" for label, value in head_lines(result)]
    counts = result.report.counts
    out += ["", "| verdict | tokens |", "| --- | ---: |"]
    out += [f"| {name} | {count} |" for name, count in counts.items() if count]
    if result.head.notes:
        out += [""] + [f"> {_cell(note)}" for note in result.head.notes]
    with_tokens = result.head.tokens is not None
    if result.findings:
        out += ["", "| id | token | verdict | evidence | main competitors (weight) | allowed |",
                "| ---: | --- | --- | --- | --- | --- |"]
        for f in result.findings:
            token = _cell(token_label(f.token)) if with_tokens else ""
            out.append(f"| {f.id} | {token} | {f.verdict} | {_cell(evidence(f))} | "
                       f"{_cell(competitors(f, with_tokens))} | {'yes' if f.allowed else ''} |")
    else:
        out += ["", "No token is unargmaxable, tied or inconclusive."]
    return "\n".join(out) + "\n"
