"""``audit-verify``: re-check a certificates file against the checkpoint it claims to describe.

    audit model/ --certificates certificates.json      # the audit, anywhere
    audit-verify certificates.json model/              # the check, by anyone

The head is loaded as ``audit`` loads it (same --weight / --bias rules), must
have the file's shape, bias and domain, and every certificate is re-checked
with ``auditor.verify``: plain float64 numpy, no engine code, and so is every
number the file states (margin, residual or dual bound, bias gap, bounds,
max_probability). Exit codes: 0 every certificate and number holds, 1 some do
not (their ids are listed, each with the field that fails), 2 the file or
checkpoint cannot be read or does not fit (one line on stderr, no traceback
unless --debug).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from auditor.cli import (CommandParser, add_head_options, add_norm_unit_offset_option, add_run_options,
                         checkpoint_final_norm, guarded, shows_progress)
from auditor.errors import EXIT_CLEAN, EXIT_FINDINGS, InputError
from auditor.loader import load_head
from auditor.question.domain import Norm, parse_domain
from auditor.question.factorised import split_factors
from auditor.verdicts.certificates import Certificates, load_certificates
from auditor.verify import verify

_EPILOG = """\
exit codes:
  0  every certificate, and every number the file states, holds
  1  at least one does not: one line per failing token id naming the field
     (tie, witness, convex weights, margin, runner_up, residual, bias_gap,
     max_probability, bounds), then the list
  2  error: a missing or unreadable file, not a certificates file, a head of
     another shape, bias or domain than the file's (one line on stderr)

example:
  audit model/ --certificates certificates.json --quiet
  audit-verify certificates.json model/
"""


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="audit-verify", epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
                     description="Re-check every certificate of a file written by audit --certificates FILE\n"
                                 "against the checkpoint, in plain float64 arithmetic.")
    parser.add_argument("certificates", type=Path, metavar="CERTS", help="the certificates file (JSON)")
    parser.add_argument("path", metavar="PATH", help="the checkpoint file or model folder that was audited, or its "
                                                     "Hugging Face Hub id org/name[@revision]")
    add_head_options(parser, "the head's weight tensor (default: detected, as audit does); A@B for a factorised head")
    parser.add_argument("--domain", metavar="D",
                        help="the domain the certificates are for (default: the file's); another one is an error")
    add_norm_unit_offset_option(parser, "the final norm multiplies by 1 + weight (as for audit; detected from "
                                        "config.json)")
    parser.add_argument("--base", metavar="PATH", help="for a PEFT adapter folder: the model it was trained on, as "
                                                       "audit took it (default: the adapter's base_model_name_or_path)")
    add_run_options(parser)
    return parser


def _check_fits(certs: Certificates, head, path: Path) -> None:
    """The checkpoint must be the head the certificates describe: shape, bias and (norm domain) the norm."""
    n, d = head.shape
    if (n, d) != (certs.n_tokens, certs.hidden_size):
        hint = _tensor_hint(certs, "weight", head.weight_name)
        raise InputError(f"{path}: the head {head.weight_name!r} is {n} x {d}, but {certs.source} is for a "
                         f"{certs.n_tokens} x {certs.hidden_size} head{hint}")
    if (head.bias is not None) != certs.has_bias:
        if certs.has_bias:
            raise InputError(f"{path}: the head has no bias, but {certs.source} is for a head with one"
                             f"{_tensor_hint(certs, 'bias', None)}")
        raise InputError(f"{path}: the head has the bias {head.bias_name!r}, but {certs.source} is for a head "
                         "without one (pass --bias none if it was audited so)")


def _check_factors(certs: Certificates, head, path: Path) -> None:
    """A factorised head (--weight A@B) is checked as its factor A, which the file must say it was audited as,
    and only while B still has full row rank (a fresh float64 SVD)."""
    stated = certs.head.get("factorised")
    if head.factor is None:
        if stated:
            raise InputError(f"{path}: {certs.source} is for a factorised head W = A @ B, decided on A; name both "
                             f"factors with --weight A@B{_tensor_hint(certs, 'weight', head.weight_name)}")
        return
    if not stated:
        raise InputError(f"{path}: --weight {head.weight_name} names a factorised head, but {certs.source} is for "
                         "a plain one")
    _, factorisation = split_factors((head.weight, head.factor), certs.domain)
    if factorisation.hidden_size != stated.get("hidden_size"):
        raise InputError(f"{path}: the factor B of {head.weight_name} is {factorisation.inner_dimension} x "
                         f"{factorisation.hidden_size}, but {certs.source} is for a hidden size of "
                         f"{stated.get('hidden_size')}")


def _tensor_hint(certs: Certificates, which: str, loaded: str | None) -> str:
    """Point to the tensor the audit read, when the file names one other than the one loaded here."""
    name = certs.head.get(f"{which}_tensor")
    return f" (it was written for the tensor {name!r}: pass --{which} {name})" if name and name != loaded else ""


def _final_norm(certs: Certificates, head, args: argparse.Namespace):
    """The checkpoint's final norm for a norm-domain file, which must be the norm the file was made with."""
    if certs.domain != Norm():
        return None
    norm = checkpoint_final_norm(head, args.path, f"{certs.source} is for the norm domain", args.norm_unit_offset)
    stated = certs.final_norm
    if stated is not None:
        for key, ours in (("kind", norm.kind), ("eps", norm.eps), ("unit_offset", norm.unit_offset)):
            if key in stated and stated[key] != ours:
                hint = " (pass --norm-unit-offset)" if key == "unit_offset" and stated[key] else ""
                raise InputError(f"{args.path}: the final norm's {key} is {ours!r}, but {certs.source} was made "
                                 f"with {stated[key]!r}{hint}")
    return norm


def run(args: argparse.Namespace) -> int:
    certs = load_certificates(args.certificates)  # before the checkpoint: a wrong file should not cost a load
    if args.domain is not None and parse_domain(args.domain) != certs.domain:
        raise InputError(f"--domain {args.domain}: {certs.source} holds certificates for the {certs.domain} domain")
    progress = shows_progress(args)
    head = load_head(args.path, weight=args.weight, bias=args.bias, progress=progress,
                     need_norm=certs.domain == Norm(), base=args.base)
    _check_factors(certs, head, args.path)
    _check_fits(certs, head, args.path)
    result = verify(certs, head.weight, head.bias, final_norm=_final_norm(certs, head, args))

    undecided, inconclusive = len(certs.ids("undecided")), len(certs.ids("inconclusive"))
    notes = [f"{undecided} undecided tokens have none"] if undecided else []
    if inconclusive:
        notes.append(f"{inconclusive} inconclusive tokens have bounds, not certificates")
    unchecked = f" ({'; '.join(notes)})" if notes else ""
    groups = f"{result.groups} tie group{'' if result.groups == 1 else 's'}"
    checked = f"{result.tokens} token{'' if result.tokens == 1 else 's'} and {groups} checked"
    if result.ok:
        print(f"audit-verify: {checked}, all hold{unchecked}")
        return EXIT_CLEAN
    if 2 * len(result.failed) > result.tokens:
        # most certificates failing is not a few bad verdicts: the head is almost surely another one
        written = certs.head.get("path") or "another head"
        print(f"audit-verify: {len(result.failed)} of {result.tokens} certificates fail: {args.path} is probably "
              f"not the head they were written for ({written}"
              + (f", tensor {certs.head['weight_tensor']!r}" if certs.head.get("weight_tensor") else "") + ")")
    for k in result.failed[:_LISTED]:
        print(f"{k:>8}  {certs.tokens[k].verdict:<13} {'; '.join(result.reasons.get(k, ['does not hold']))}")
    if len(result.failed) > _LISTED:
        print(f"     ... and {len(result.failed) - _LISTED} more")
    print(f"audit-verify: {checked}{unchecked}, {len(result.failed)} failed: "
          f"{', '.join(map(str, result.failed))}")
    return EXIT_FINDINGS


_LISTED = 50  # failed tokens listed one a line; the last line names every one


def main(argv: list[str] | None = None) -> int:
    return guarded("audit-verify", run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
