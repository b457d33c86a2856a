"""What the three commands share: a parser whose usage errors are one line, common options, one-line failures.

The commands themselves (``audit``, ``audit-verify``, ``audit-merge``) live in
``cli/audit.py``, ``cli/verify.py`` and ``cli/merge.py``: each wires the
layers below it together and holds no logic of its own.
"""

from __future__ import annotations

import argparse
import logging
import sys

from auditor._version import __version__
from auditor.errors import EXIT_ERROR, AuditorError, InputError
from auditor.util.io import send_solver_output_to_stderr

# where a final norm is looked for, as the error says when none is found
_NORM_TENSORS = "model.norm.weight, transformer.ln_f.weight, output_norm.weight, ..."


class CommandParser(argparse.ArgumentParser):
    """argparse, but a usage error exits 2 with one line, like every other error."""

    def error(self, message):
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def add_head_options(parser: argparse.ArgumentParser, weight_help: str) -> None:
    """--weight and --bias: which tensors of the checkpoint are the head."""
    parser.add_argument("--weight", metavar="NAME", help=weight_help)
    parser.add_argument("--bias", metavar="NAME", help="the head's bias tensor (default: detected; 'none' for no bias)")


def add_norm_unit_offset_option(parser: argparse.ArgumentParser, help_text: str) -> None:
    parser.add_argument("--norm-unit-offset", action="store_true", help=help_text)


def add_run_options(parser: argparse.ArgumentParser) -> None:
    """--quiet, --debug and --version."""
    parser.add_argument("--quiet", action="store_true", help="no progress bars (they show only when stderr is a terminal)")
    parser.add_argument("--debug", action="store_true",
                        help="show tracebacks, the LP solvers' own output and the engine's debug lines on stderr")
    parser.add_argument("--version", action="version", version=f"auditor {__version__}")


def shows_progress(args: argparse.Namespace) -> bool:
    """Progress bars in a terminal, never in CI logs, and never with --quiet."""
    return not args.quiet and sys.stderr.isatty()


def checkpoint_final_norm(head, path, needed_by: str, unit_offset: bool):
    """The checkpoint's final norm, which ``needed_by`` (the start of the error line) needs; --norm-unit-offset applied."""
    if head.final_norm is None:
        raise InputError(f"{path}: {needed_by}, but no known final-norm tensor was found ({_NORM_TENSORS})")
    norm = head.final_norm
    if unit_offset:
        norm.unit_offset = True
    return norm


def show_debug_log() -> None:
    """The engine's debug lines (which arithmetic a stage ran in, and why) on stderr, once."""
    logger = logging.getLogger("auditor")
    if not any(isinstance(h, _StderrHandler) for h in logger.handlers):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter("auditor: debug: %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a line is logged (not the stream found at start-up)."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def guarded(prog: str, run, args: argparse.Namespace) -> int:
    """``run(args)``, with every failure turned into one line on stderr and exit 2 (a traceback
    only with --debug, which also sends the solvers' own lines to stderr). Shared by the commands so that
    they fail alike."""
    send_solver_output_to_stderr(bool(getattr(args, "debug", False)))
    if getattr(args, "debug", False):
        show_debug_log()
    try:
        return run(args)
    except AuditorError as error:
        if args.debug:
            raise
        print(f"{prog}: error: {error}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_ERROR
    except Exception as error:  # an unexpected failure still gets one line; --debug shows where
        if args.debug:
            raise
        print(f"{prog}: error: {type(error).__name__}: {error} (run with --debug for the traceback)", file=sys.stderr)
        return EXIT_ERROR


def _positive(text: str, parse, what: str):
    try:
        value = parse(text)
    except ValueError:
        value = 0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"takes a positive {what}, got {text!r}")
    return value


def positive_int(text: str) -> int:
    """argparse type: a positive integer."""
    return _positive(text, int, "integer")


def nonnegative_int(text: str) -> int:
    """argparse type: an integer, 0 or more."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"takes an integer, 0 or more, got {text!r}")
    return value


def positive_seconds(text: str) -> float:
    """argparse type: a positive, finite number of seconds."""
    return _positive(text, float, "number of seconds")
