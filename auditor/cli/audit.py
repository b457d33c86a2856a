"""The ``audit`` command: loader -> engine -> gate -> format, and nothing else.

Exit codes: 0 no failing finding, 1 at least one, 2 usage, load or input
error (one line on stderr, no traceback unless --debug, no file left behind).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from auditor.api import audit
from auditor.cli import (CommandParser, add_head_options, add_norm_unit_offset_option, add_run_options,
                         checkpoint_final_norm, guarded, nonnegative_int, positive_int, positive_seconds,
                         shows_progress)
from auditor.errors import EXIT_CLEAN, EXIT_FINDINGS, InputError
from auditor.findings.baseline import Baseline
from auditor.findings.gate import DEFAULT_FAIL_ON, GATE_CLASSES, AllowList, GateResult, parse_fail_on, run_gate
from auditor.formats import DOCUMENT_FORMATS, FORMATS
from auditor.formats.html import render as render_html, require_matplotlib
from auditor.loader import has_own_checkpoint, list_tensors, load_head, trainer_checkpoints
from auditor.question.domain import Domain, Norm, parse_domain
from auditor.question.head import Head
from auditor.question.norm import FinalNorm
from auditor.runs import trend
from auditor.runs.blocks import AuditJob, audit_in_blocks
from auditor.runs.distributed import DEFAULT_TIMEOUT_S, Launch, run_on_ranks
from auditor.util.io import check_writable, write_atomically
from auditor.util.threads import resolve_threads
from auditor.verdicts.certificates import certificates_document


_EPILOG = """\
exit codes:
  0  no failing finding
  1  failing findings: of a class in --fail-on, not allowed (nor unchanged since --baseline); with
     --all-checkpoints, at the latest checkpoint
  2  usage, load or input error (one line on stderr; --debug shows the traceback)

examples:
  # audit a model folder and print a text report
  audit model/
  # a model on the Hugging Face Hub, at a branch, tag or commit (fetches only the head's files)
  audit org/name@main
  # the complete report as JSON, written atomically
  audit model/ --format json --output report.json
  # in CI: expected findings pass, every certificate is kept for re-checking
  audit model/ --allow allow.txt --certificates certs.json --format markdown --output audit.md
  # over the final norm's outputs; also flag tokens that can never reach probability 0.5
  audit model/ --domain norm --ceiling 0.5
  # fail only on findings that an earlier JSON report did not have
  audit model/ --baseline base.json
  # every checkpoint-N/ of a Trainer's output folder, in step order: when did <tool> become producible?
  audit output_dir/ --all-checkpoints --tokens '<tool>'
  # four shards (on four machines, or one after another), then one report
  audit model/ --shard 1/4 --format json --output part1.json    # ... 2/4, 3/4, 4/4
  audit-merge part1.json part2.json part3.json part4.json --format markdown
  # a resumable audit: rerun the same command after a stop and the decided blocks are kept
  audit model/ --work-dir audit-work/ --format json --output report.json
  # over 8 processes on one node (each on its own GPU when there are GPUs), one report; torchrun turns a
  # rank's exit code 1 into its ChildFailedError traceback: pass --fail-on none, then gate on the
  # report's findings (the default --fail-on: every class but tied)
  torchrun --nproc-per-node 8 -m auditor model/ --format json --output report.json --fail-on none
  python -c "import json, sys; r = json.load(open('report.json')); sys.exit(any(set(f['classes']) - {'tied'} and not f['allowed'] for f in r['findings']))"
"""


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="audit", description="Find the tokens of a language model's head that can never be its "
                                               "top prediction, and prove every verdict.",
                     epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="a checkpoint file (safetensors, a torch .bin/.pt, .npy/.npz, GGUF, ONNX, "
                                     "TensorFlow Lite, a CTranslate2 model.bin or a Kaldi nnet3 final.mdl, recognised "
                                     "by its contents), a model folder, or a model on the Hugging Face Hub: org/name "
                                     "or org/name@revision (needs auditor[hub]; only the files the head needs are "
                                     "fetched, the cache first)")
    add_head_options(parser, "the head's weight tensor (default: detected), or A@B for the head A @ B (a name ending "
                             "in .T is transposed): decided exactly on A when B has full row rank")
    parser.add_argument("--vocab", type=Path, metavar="FILE",
                        help="token strings, one per line (UTF-8; a character list): line i names id i + "
                             "--vocab-offset; replaces the tokenizer's, or an ONNX model's character list")
    parser.add_argument("--vocab-offset", type=nonnegative_int, default=0, metavar="N",
                        help="the id the --vocab file's first line names (default 0; 1 for PaddleOCR's CTC "
                             "heads, whose id 0 is the blank)")
    parser.add_argument("--base", metavar="PATH",
                        help="for a PEFT adapter folder: the model it was trained on (a folder, a checkpoint file or "
                             "a Hub id; default: the adapter's base_model_name_or_path, a folder here or a Hub model "
                             "in the local cache, never fetched); --weight and --bias name its tensors")
    parser.add_argument("--domain", default="unbounded",
                        help="unbounded (default), ball:R, box:R, norm (the outputs of the checkpoint's final norm), "
                             "or nonneg / nonneg:R (hidden states z >= 0, as a ReLU or a pooled ReLU gives, of norm at "
                             "most R)")
    add_norm_unit_offset_option(parser, "the final norm multiplies by 1 + weight (Gemma's convention; detected from "
                                        "config.json)")
    parser.add_argument("--device", default="auto", help="auto (default: CUDA when available), cpu or cuda")
    parser.add_argument("--threads", type=positive_int, metavar="N",
                        help="CPU threads for torch (default: OMP_NUM_THREADS when set, else torch's default)")
    parser.add_argument("--ceiling", type=float, metavar="P",
                        help="also compute each token's largest reachable probability (bounded domains) and report "
                             "argmaxable tokens that can never reach P as low-ceiling findings")
    parser.add_argument("--tokens", metavar="IDS", help="decide only these ids, e.g. 0-99,50256,128000- (the rest are "
                        "undecided); 'added' takes the ids past the tokenizer model's own vocabulary, 'new' those "
                        "past --baseline's, and token strings name tokens (JSON-quoted where they look like ids)")
    parser.add_argument("--shard", metavar="I/N",
                        help="decide only the I-th of N equal contiguous parts of the vocabulary (1 <= I <= N); "
                             "merge the shards' JSON reports with audit-merge")
    parser.add_argument("--work-dir", type=Path, metavar="DIR",
                        help="keep each decided block of tokens in DIR, so that the same command run again after a "
                             "stop resumes (the folder is bound to this head and these settings)")
    parser.add_argument("--block-size", type=positive_int, metavar="N",
                        help="token ids per block with --work-dir or under torchrun (default: 16384 with "
                             "--work-dir; under torchrun without it, one block per rank)")
    parser.add_argument("--dist-timeout", type=positive_seconds, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                        help="under torchrun: how long a rank waits for the others (default: "
                             f"{DEFAULT_TIMEOUT_S:g}); more than one block takes")
    parser.add_argument("--format", choices=sorted(FORMATS), default="text", help="report format (default: text)")
    parser.add_argument("--output", type=Path, metavar="FILE", help="write the report to FILE (atomically) instead of stdout")
    fail_on = ",".join(name for name in GATE_CLASSES if name in DEFAULT_FAIL_ON)
    parser.add_argument("--fail-on", default=fail_on, metavar="CLASSES",
                        help="classes of findings that fail the run: unargmaxable (tied tokens of an unargmaxable "
                             "group included), never-emitted (every token greedy decoding can never produce: "
                             "unargmaxable ones, and every tied token but its group's lowest id), tied (every "
                             f"tied token), inconclusive, low-ceiling; 'none' never fails (default: {fail_on}: the "
                             "lowest id of a tied group that can win passes, as greedy decoding emits it)")
    parser.add_argument("--allow", type=Path, metavar="FILE", help="expected findings: token ids or exact token strings, one per line")
    parser.add_argument("--baseline", type=Path, metavar="REPORT",
                        help="an earlier --format json report of the same vocabulary (the base model, the last "
                             "release): findings are marked new or unchanged, and only new ones fail")
    parser.add_argument("--certificates", type=Path, metavar="FILE", help="write every certificate as JSON, for re-checking")
    parser.add_argument("--list-tensors", action="store_true",
                        help="list the checkpoint's 2-D tensors (and pointwise convolution kernels) and exit")
    parser.add_argument("--all-checkpoints", action="store_true",
                        help="PATH is a Trainer output folder: audit each of its checkpoint-N/ folders with the same "
                             "options, in step order, and report the trend (text or json: one row per checkpoint, "
                             "and the watched tokens whose verdict changed); the exit code is the gate's for the "
                             "LATEST checkpoint")
    add_run_options(parser)
    parser.set_defaults(ranks=None)  # under torchrun: this process's auditor.runs.distributed.Ranks
    return parser


def parse_token_ids(text: str, n: int, head=None, baseline=None) -> list[int]:
    """``--tokens``: comma-separated ids (``0-99,1000,2000-``: an open range runs to the last row), ``added``
    (the ids at or past the tokenizer model's own vocabulary, and the rows past the tokenizer's length),
    ``new`` (the ids past the baseline's vocabulary) and token strings (JSON-quoted where they look like
    numbers or hold a comma: ``"2",<|im_end|>``). Returns sorted ids without repeats. ``added`` or ``new`` where
    no token was added is no mistake (a gate run on every model, whether or not it grew): it adds no id, and a
    note on ``head`` says so; the audit then decides nothing and fails nothing."""
    ids: set[int] = set()
    kinds = 0  # parts that are "added" or "new": they may stand for no id at all
    for part, quoted in _token_parts(text):
        if quoted or not re.fullmatch(r"[0-9]+(-[0-9]*)?", part):
            if not quoted and part == "added":
                kinds += 1
                ids.update(_added_ids(head, n))
            elif not quoted and part == "new":
                kinds += 1
                if baseline is None:
                    raise InputError("--tokens new needs --baseline REPORT (the ids past its vocabulary are new)")
                if baseline.n_tokens >= n and head is not None:
                    head.notes.append(f"--tokens new: the baseline has {baseline.n_tokens} tokens and this head "
                                      f"{n}: no id is new, so no token is decided")
                ids.update(range(baseline.n_tokens, n))
            else:
                ids.update(_ids_of_string(part, head))
            continue
        start, dash, stop = part.partition("-")
        first = int(start)
        last = (int(stop) if stop else n - 1) if dash else first
        if first > last:
            raise InputError(f"--tokens: the range {part!r} runs backwards")
        if first < 0 or last >= n:
            raise InputError(f"--tokens: {part!r} is outside the vocabulary 0..{n - 1}")
        ids.update(range(first, last + 1))
    if not ids and not kinds:
        raise InputError("--tokens: no token ids given")
    return sorted(ids)


def _token_parts(text: str):
    """(part, quoted) for each comma-separated part; a part starting with a double quote is a JSON string."""
    decoder = json.JSONDecoder()
    at = 0
    while at <= len(text):
        while at < len(text) and text[at] == " ":
            at += 1
        if at < len(text) and text[at] == '"':
            try:
                string, end = decoder.raw_decode(text, at)
            except ValueError:
                raise InputError(f"--tokens: not a valid quoted token string at {text[at:]!r}") from None
            rest = text.find(",", end)
            if text[end:rest if rest >= 0 else len(text)].strip():
                raise InputError(f"--tokens: unexpected text after the quoted token string {text[at:end]}")
            yield string, True
            at = len(text) + 1 if rest < 0 else rest + 1
            continue
        comma = text.find(",", at)
        part = text[at:comma if comma >= 0 else len(text)].strip()
        if part:
            yield part, False
        at = len(text) + 1 if comma < 0 else comma + 1


def _added_ids(head, n: int) -> range:
    """The ids at or past the tokenizer model's own vocabulary, through the last row (which covers the rows
    past the tokenizer's length); without tokenizer.json, the rows past the token strings' length."""
    if head is not None and head.base_vocab is not None:
        first = head.base_vocab
    elif head is not None and head.tokens is not None:
        first = len(head.tokens)
    else:
        raise InputError("--tokens added needs the model's tokenizer.json (its own vocabulary tells the added "
                         "tokens apart) or token strings; give ids instead, e.g. --tokens 50257-")
    if first >= n:  # head is not None here: without one, first could not be known
        head.notes.append(f"--tokens added: the tokenizer's own vocabulary has {first} tokens and the head {n} "
                          f"rows: no token was added, so no token is decided")
    return range(first, n)


def _ids_of_string(token: str, head) -> list[int]:
    if head is None or head.tokens is None:
        raise InputError(f"--tokens: {token!r} is not an id or a range like 10-20, and the head has no token "
                         f"strings to look it up")
    found = head.ids_of(token)
    if not found:
        raise InputError(f"--tokens: no token is the string {json.dumps(token, ensure_ascii=False)}")
    return found


def parse_shard(text: str, n: int) -> tuple[int, int, range]:
    """``"2/4"`` -> (2, 4, the ids of the second quarter of 0..n-1)."""
    index, slash, count = text.partition("/")
    try:
        i, total = int(index), int(count)
    except ValueError:
        raise InputError(f"--shard takes I/N, such as 2/4, got {text!r}") from None
    if not slash or total < 1 or not 1 <= i <= total:
        raise InputError(f"--shard {text}: I must be between 1 and N")
    return i, total, range((i - 1) * n // total, i * n // total)


def _list_tensors(path: Path) -> str:
    rows = list_tensors(path, matrices=True)
    width = max((len(info.name) for info in rows), default=4)
    return "".join(f"{info.name:<{width}}  {' x '.join(map(str, info.shape)):>14}  {info.dtype}\n" for info in rows)


@dataclass
class _Options:
    """What every audit of one command shares, checked before a checkpoint is loaded."""

    domain: Domain
    fail_on: frozenset[str]
    allow: AllowList | None
    baseline: Baseline | None
    progress: bool


@dataclass
class _Checkpoint:
    """One checkpoint's head, loaded, with the ids to decide on it (None: all) and the final norm the domain needs."""

    head: Head
    tokens: list[int] | None
    final_norm: FinalNorm | None
    load_seconds: float


def _checked_options(args: argparse.Namespace) -> _Options:
    domain = parse_domain(args.domain)  # a typo should not cost a checkpoint load
    resolve_threads(args.threads)  # nor a bad OMP_NUM_THREADS
    fail_on = parse_fail_on(args.fail_on)
    allow = AllowList.read(args.allow) if args.allow else None
    baseline = Baseline.read(args.baseline) if args.baseline else None
    if args.vocab_offset and args.vocab is None:
        raise InputError("--vocab-offset needs --vocab FILE")
    if args.vocab is not None and not args.vocab.is_file():
        raise InputError(f"--vocab {args.vocab}: no such file")
    if args.ceiling is not None and not 0 < args.ceiling <= 1:
        raise InputError(f"--ceiling takes a probability in (0, 1], got {args.ceiling}")
    return _Options(domain, fail_on, allow, baseline, shows_progress(args))


def _load_checkpoint(args: argparse.Namespace, path, options: _Options) -> _Checkpoint:
    """The head at ``path`` (a file, folder or Hub id), checked against the baseline, with --tokens' ids on it."""
    domain, baseline = options.domain, options.baseline
    started = time.perf_counter()
    head = load_head(path, weight=args.weight, bias=args.bias, progress=options.progress,
                     need_norm=domain == Norm(), vocab=args.vocab, vocab_offset=args.vocab_offset, base=args.base)
    load_seconds = time.perf_counter() - started
    if baseline is not None:
        baseline.check(head, domain, args.ceiling)
    # "--tokens ''" is a mistake to report, not a request to audit everything
    tokens = parse_token_ids(args.tokens, head.shape[0], head, baseline) if args.tokens is not None else None
    final_norm = None
    if domain == Norm():
        final_norm = checkpoint_final_norm(head, path, "--domain norm needs the final norm", args.norm_unit_offset)
    return _Checkpoint(head, tokens, final_norm, load_seconds)


def _audit_and_gate(args: argparse.Namespace, checkpoint: _Checkpoint, options: _Options) -> GateResult:
    """One process's audit of the checkpoint, through the gate."""
    head = checkpoint.head
    try:
        report = audit(head.audited, head.bias, domain=options.domain, device=args.device, tokens=checkpoint.tokens,
                       progress=options.progress, final_norm=checkpoint.final_norm,
                       probability_ceiling=args.ceiling is not None, threads=args.threads)
    except InputError as error:
        raise InputError(_named(head, str(error))) from None
    return run_gate(head, report, options.fail_on, options.allow, checkpoint.load_seconds, args.ceiling,
                    options.baseline)


def _named(head, message: str) -> str:
    """An input error about the weight or the bias as read from a file, with the file and the tensor named."""
    where = f"{head.path}: " if head.path is not None else ""
    for part, name in (("the weight", head.weight_name), ("the bias", head.bias_name)):
        if message.startswith(part) and name:
            return f"{where}{part} {name!r}{message[len(part):]}"
    return message


def run(args: argparse.Namespace) -> int:
    if args.list_tensors:
        listing = _list_tensors(args.path)
        if args.ranks is None or args.ranks.is_root:  # under torchrun, once
            sys.stdout.write(listing)
        return 0
    if args.all_checkpoints:
        return _run_all_checkpoints(args)
    in_blocks = args.work_dir is not None or args.ranks is not None
    if args.format == "html":  # its plots need matplotlib: say so before the audit, not after
        if in_blocks:  # its plots need every token's margin, which the blocks' reports do not carry
            raise InputError("--format html needs the whole audit in one process: with --work-dir or under "
                             "torchrun write --format json, text or markdown")
        require_matplotlib()
    for target in (args.output, args.certificates):
        if target is not None and (args.ranks is None or args.ranks.is_root):  # only rank 0 writes them
            check_writable(target)
    options = _checked_options(args)
    checkpoint = _load_checkpoint(args, args.path, options)
    head, tokens = checkpoint.head, checkpoint.tokens
    shard = None
    if args.shard:
        index, count, part = parse_shard(args.shard, head.shape[0])
        tokens = [k for k in tokens if k in part] if tokens is not None else list(part)
        shard = {"index": index, "count": count, "first": part.start, "stop": part.stop}
        if not tokens:
            raise InputError(f"--shard {args.shard}: no tokens to decide in ids {part.start}..{part.stop - 1}")
        checkpoint.tokens = tokens
    if in_blocks:
        job = AuditJob(head, options.domain, args.device, args.threads, checkpoint.final_norm, args.ceiling,
                       options.fail_on, options.allow, options.baseline, allow_path=args.allow,
                       baseline_path=args.baseline,
                       certificates=args.certificates is not None or args.work_dir is not None)
        merged = audit_in_blocks(job, tokens, shard, checkpoint.load_seconds, work_dir=args.work_dir,
                                 block_size=args.block_size, ranks=args.ranks, progress=options.progress)
        if merged is None:  # another rank writes the report
            return EXIT_CLEAN
        document, certificates = merged
        warnings, rendered = document["warnings"], DOCUMENT_FORMATS[args.format](document)
        exit_code = EXIT_FINDINGS if document["summary"]["failing"] else EXIT_CLEAN
    else:
        result = _audit_and_gate(args, checkpoint, options)
        result.shard = shard
        # the page's footer gives the command that reproduces it, which names the files this run writes
        rendered = (render_html(result, output=args.output, certificates=args.certificates) if args.format == "html"
                    else FORMATS[args.format](result))
        warnings, exit_code = result.warnings, result.exit_code
        certificates = certificates_document(head, result.report) if args.certificates else None
    _deliver(args, rendered, warnings, certificates)
    return exit_code


def _deliver(args: argparse.Namespace, rendered: str, warnings: list[str], certificates: dict | None = None) -> None:
    """Warnings on stderr; the report (and the certificates) written atomically, or the report on stdout."""
    for warning in warnings:
        print(f"audit: warning: {warning}", file=sys.stderr)
    files: dict[Path, str] = {}
    if args.certificates:
        files[args.certificates] = json.dumps(certificates, allow_nan=False) + "\n"
    if args.output:
        files[args.output] = rendered
    write_atomically(files)
    if not args.output:
        sys.stdout.write(rendered)


def _run_all_checkpoints(args: argparse.Namespace) -> int:
    """--all-checkpoints: each checkpoint-N/ folder of a Trainer's output folder audited alike, in step order, and
    their trend rendered (auditor/runs/trend.py). Returns the gate's exit code for the latest checkpoint."""
    if args.shard or args.work_dir is not None or args.ranks is not None or args.certificates is not None:
        raise InputError("--all-checkpoints audits each checkpoint whole, in one process: it takes no --shard, "
                         "--work-dir, --certificates or torchrun (audit one checkpoint-N/ folder for those)")
    if args.format not in ("text", "json"):
        raise InputError(f"--all-checkpoints writes --format text or json, not {args.format}")
    checkpoints: list[tuple[int | None, Path]] = list(trainer_checkpoints(args.path, with_own=True))
    if not checkpoints:
        if not Path(args.path).exists():
            raise InputError(f"{args.path}: no such file or folder")
        raise InputError(f"{args.path}: not a Trainer output folder (checkpoint-N/ folders), which "
                         f"--all-checkpoints needs; leave the option out to audit it alone")
    if has_own_checkpoint(args.path):  # the final model (or adapter) saved beside them: the last row, "final"
        checkpoints.append((None, Path(args.path)))
    if args.output is not None:
        check_writable(args.output)
    options = _checked_options(args)
    summaries, warnings = [], []
    for number, (step, folder) in enumerate(checkpoints, start=1):
        name = folder.name if step is not None else "final"
        checkpoint = _load_checkpoint(args, folder, options)
        result = _audit_and_gate(args, checkpoint, options)
        summary = trend.summarise(name, step, result, checkpoint.tokens)  # --tokens' ids are the watched ones
        summaries.append(summary)
        warnings += [f"{name}: {warning}" for warning in result.warnings]
        if not args.quiet:
            print(f"audit: {name} ({number}/{len(checkpoints)}): {summary.counts['unargmaxable']} "
                  f"unargmaxable, {summary.never_emitted} never emitted, gate {summary.gate}", file=sys.stderr)
    rendered = (trend.render_json(summaries) if args.format == "json"
                else trend.render_text(str(args.path), summaries))
    _deliver(args, rendered, warnings)
    return summaries[-1].exit_code


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if Launch.from_environment() is not None:  # a rank of a torchrun launch: one audit over all ranks
        return run_on_ranks("audit", run, args)
    return guarded("audit", run, args)
