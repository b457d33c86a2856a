"""The ``audit`` command: wires a checkpoint file to the engine and prints a report.

Exit codes: 0 no finding, 1 some token is unargmaxable, tied or inconclusive,
2 usage, load or input error (one line on stderr).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import auditor
from auditor.errors import AuditorError, InputError

EXIT_CLEAN, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2
_FINDINGS = ("unargmaxable", "tied", "inconclusive")


def _load_safetensors(path: Path):
    """The head in a .safetensors file: tensors named weight/bias, else the only 2-D tensor."""
    from safetensors import SafetensorError, safe_open

    if not path.exists():
        raise InputError(f"{path}: no such file")
    try:
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
            shapes = {name: f.get_slice(name).get_shape() for name in names}
            matrices = [name for name in names if len(shapes[name]) == 2]
            if "weight" in names:
                weight_name = "weight"
            elif len(matrices) == 1:
                weight_name = matrices[0]
            else:
                listed = ", ".join(matrices) or "none"
                raise InputError(f"{path}: cannot tell which 2-D tensor is the head (candidates: {listed})")
            weight = f.get_tensor(weight_name)
            bias = f.get_tensor("bias") if "bias" in names else None
    except (SafetensorError, OSError) as error:
        raise InputError(f"{path}: not a readable safetensors file ({error})") from None
    return weight_name, weight, bias


def _text(report, path: Path, weight_name: str) -> str:
    lines = [
        f"head      {path} [{weight_name}] {report.n_tokens} x {report.hidden_size} {report.dtype}"
        f"{' with bias' if report.has_bias else ''}",
        f"domain    {report.domain}",
        "verdicts  " + ", ".join(f"{name} {count}" for name, count in report.counts.items() if count),
        f"time      {report.timings['total']:.2f} s",
    ]
    findings = [t for name in _FINDINGS for t in (report.tokens[k] for k in report.ids(name))]
    if findings:
        lines += ["", f"{'id':>8}  {'verdict':<13} {'evidence':<28} main competitors"]
    for token in sorted(findings, key=lambda t: t.id):
        if token.verdict == "tied":
            evidence = f"same row as {', '.join(map(str, token.tied_with))}"
            rivals = f"group {token.group_verdict}"
        elif token.verdict == "unargmaxable":
            evidence = f"residual {token.residual:.2e}"
            top = list(zip(token.convex_indices[:3], token.convex_weights[:3]))
            rivals = ", ".join(f"{i} ({w:.2g})" for i, w in top) + (" ..." if len(token.convex_indices) > 3 else "")
        else:
            lower, upper = token.bounds
            evidence, rivals = f"margin in [{lower:.1e}, {upper:.1e}]", ""
        lines.append(f"{token.id:>8}  {token.verdict:<13} {evidence:<28} {rivals}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="audit", description="Find the tokens of a head that can never be the top prediction.")
    parser.add_argument("path", type=Path, help="a .safetensors file holding the head")
    parser.add_argument("--domain", default="unbounded", help="unbounded (default), ball:R or box:R")
    parser.add_argument("--device", default="auto", help="auto (default), cpu or cuda")
    parser.add_argument("--json", action="store_true", help="print the JSON report with every certificate")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    parser.add_argument("--version", action="version", version=f"auditor {auditor.__version__}")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        weight_name, weight, bias = _load_safetensors(args.path)
        report = auditor.audit(weight, bias, domain=args.domain, device=args.device, progress=not args.quiet)
    except AuditorError as error:
        if args.debug:
            raise
        print(f"audit: error: {error}", file=sys.stderr)
        return EXIT_ERROR
    if args.json:
        print(json.dumps(report.to_dict(), allow_nan=False))
    else:
        print(_text(report, args.path, weight_name))
    return EXIT_FINDINGS if any(report.counts[name] for name in _FINDINGS) else EXIT_CLEAN
