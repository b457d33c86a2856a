"""Small pieces the formats share."""

from __future__ import annotations

from auditor.gate import Finding, GateResult


def head_lines(result: GateResult) -> list[tuple[str, str]]:
    """(label, value) pairs describing the audited head, in reading order."""
    head, report = result.head, result.report
    n, d = head.shape
    names = head.weight_name + (f" + {head.bias_name}" if head.bias_name else "")
    return [
        ("model", str(head.path) if head.path else "(array)"),
        ("head", f"{names} [{head.source_format}]"),
        ("shape", f"{n} x {d} {head.dtype}"),
        ("bias", "yes" if head.bias is not None else "no"),
        ("tied", "yes, the input embedding is the head" if head.tied else "no"),
        ("domain", str(report.domain) + (f", probability ceiling {result.ceiling:g}" if result.ceiling else "")),
        ("time", f"{result.load_seconds + report.timings['total']:.2f} s "
                 f"(load {result.load_seconds:.2f} s, audit {report.timings['total']:.2f} s)"),
    ]


def token_label(token: str | None) -> str:
    return "(no string)" if token is None else repr(token)


def evidence(finding: Finding) -> str:
    """The number a finding rests on."""
    if finding.verdict == "unargmaxable":
        return f"residual {finding.residual:.1e}"
    if finding.verdict == "tied":
        return f"group {finding.group_verdict}"
    if finding.verdict == "low-ceiling":
        lower, upper = finding.probability_bounds
        return f"max probability {lower:.4f}"
    lower, upper = finding.bounds
    return f"margin in [{lower:.1e}, {upper:.1e}]"


def competitors(finding: Finding, with_tokens: bool) -> str:
    """The largest convex weights (id, token string, weight), or the tie group."""
    if finding.verdict == "tied":
        return "same row as " + ", ".join(str(i) for i in finding.tied_with)
    if not finding.competitors:
        return ""
    shown = ", ".join(f"{c.id}{' ' + token_label(c.token) if with_tokens else ''} {c.weight:.2g}"
                      for c in finding.competitors[:3])
    more = finding.support - min(3, len(finding.competitors))
    return shown + (f" (+{more} more)" if more > 0 else "")
