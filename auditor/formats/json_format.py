"""JSON for machines: a stable schema (see docs/cli.md) with one object per finding.

``document(result)`` is the report as a dict; the text and markdown formats render from it too, so a
merged report (audit-merge has only the shards' documents) looks like a whole-vocabulary one."""

from __future__ import annotations

import json
import math

from auditor._version import __version__
from auditor.findings.baseline import vocabulary_fingerprint
from auditor.findings.gate import GateResult

SCHEMA_VERSION = 1


def _number(value):
    return float(value) if value is not None and math.isfinite(value) else None


def head_section(head, factorised=None) -> dict:
    """The report's description of the head: where it came from and what was read."""
    norm = head.final_norm
    return {
        "path": str(head.path) if head.path else None,
        "format": head.source_format,
        "weight": head.weight_name,
        "bias": head.bias_name or ("bias" if head.bias is not None else None),
        "shape": list(head.shape),
        "dtype": head.dtype,
        "tied": head.tied,
        "final_norm": {"kind": norm.kind, "tensors": list(norm.names), "eps": norm.eps,
                       "unit_offset": norm.unit_offset} if norm else None,
        "token_strings": head.token_source or ("given" if head.tokens is not None else None),
        "vocabulary_sha256": vocabulary_fingerprint(head),  # lets --baseline tell one vocabulary from another
        # W = U @ V audited as U: shape and dtype above are U's
        "factorised": factorised.to_dict() if factorised else None,
    }


def document(result: GateResult) -> dict:
    """The JSON report of a gate result (schema_version 1; fields are only ever added)."""
    head, report = result.head, result.report
    failing = {id(f) for f in result.failing}  # the gate decides what fails; the document records it
    return {
        "schema_version": SCHEMA_VERSION,
        "tool": {"name": "auditor", "version": __version__},
        "head": head_section(head, report.factorised),
        "run": {"threads": report.threads, "device": report.device},
        "domain": str(report.domain),
        "shard": result.shard,
        "summary": {"n_tokens": report.n_tokens, **report.counts, "failing": len(result.failing)},
        "fail_on": sorted(result.fail_on),
        "ceiling": result.ceiling,
        "findings": [
            {
                "id": f.id,
                "token": f.token,
                "verdict": f.verdict,
                "stage": f.stage,
                "residual": _number(f.residual),
                "bias_gap": _number(f.bias_gap),
                "competitors": [{"id": c.id, "token": c.token, "weight": c.weight, "can_win": c.can_win}
                                for c in f.competitors],
                "support": f.support,
                "tied_with": f.tied_with,
                "group_verdict": f.group_verdict,
                "bounds": None if f.bounds is None else {"margin_lower": _number(f.bounds[0]),
                                                         "margin_upper": _number(f.bounds[1])},
                "max_probability": None if f.probability_bounds is None else {
                    "lower": f.probability_bounds[0], "upper": f.probability_bounds[1]},
                "allowed": f.allowed,
                "failing": id(f) in failing,
                "explanation": f.explanation,
                "kind": f.kind,
                "baseline": f.baseline,
                "greedy": f.greedy,
                "classes": list(f.classes or (f.verdict,)),
                "next_step": f.next_step,
            }
            for f in result.findings
        ],
        "summaries": list(result.summaries),
        "next_steps": list(result.next_steps),
        "baseline": result.baseline,
        "warnings": list(result.warnings),
        "notes": head.notes,
        "timing": {"load_s": round(result.load_seconds, 6),
                   **{f"{name}_s": round(seconds, 6) for name, seconds in report.timings.items()}},
    }


def dumps(doc: dict) -> str:
    """A document as the JSON text the command writes."""
    return json.dumps(doc, indent=2, allow_nan=False) + "\n"


def render(result: GateResult) -> str:
    return dumps(document(result))
