"""The ``audit-merge`` command: one report from the JSON reports of ``audit --shard I/N`` (see auditor/runs/merge.py).

Exit codes as for ``audit``: 0 clean, 1 failing findings, 2 when the shards do
not fit together or cannot be read (one line on stderr).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from auditor.cli import CommandParser, guarded
from auditor.errors import EXIT_CLEAN, EXIT_FINDINGS
from auditor.formats import DOCUMENT_FORMATS
from auditor.runs.merge import merge_reports, read_shard
from auditor.util.io import check_writable, write_atomically


def run(args: argparse.Namespace) -> int:
    merged = merge_reports([read_shard(path) for path in args.reports], [str(path) for path in args.reports])
    text = DOCUMENT_FORMATS[args.format](merged)
    if args.output:
        check_writable(args.output)
        write_atomically({args.output: text})
    else:
        sys.stdout.write(text)
    summary = merged["summary"]
    print(f"audit-merge: {len(args.reports)} shards, {summary['n_tokens']} tokens, "
          f"{summary['failing']} failing findings", file=sys.stderr)
    return EXIT_FINDINGS if summary["failing"] else EXIT_CLEAN


def main(argv: list[str] | None = None) -> int:
    parser = CommandParser(prog="audit-merge", description="Merge the JSON reports of audit --shard I/N.")
    parser.add_argument("reports", nargs="+", type=Path, help="the N shard reports (audit --shard I/N --format json)")
    parser.add_argument("--format", choices=sorted(DOCUMENT_FORMATS), default="json",
                        help="report format (default: json)")
    parser.add_argument("--output", type=Path, metavar="FILE", help="write the merged report to FILE (atomically)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    return guarded("audit-merge", run, parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
