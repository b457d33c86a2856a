"""An audit decided block by block, then merged into one report: for ``--work-dir`` (the blocks are kept
as files, so a stopped audit resumes) and under torchrun (the ranks share the blocks).

A block is a range of token ids, first..stop-1, of which it decides the selected ones (all, or those of
--tokens / --shard). Each block is one ``auditor.audit(..., tokens=ids)`` call and becomes a *part*:
its JSON report document (what ``audit --shard --format json`` writes) and, when wanted, its
certificates document. The parts are merged as audit-merge merges shards, into the document a
single run writes: verdicts are the same token for token. Each call repeats the audit's fixed work
on the whole head (duplicate rows, normal form, coordinate-wise medians), and that fixed work grows
with the head as a block's does: blocks of 16384 ids by default, small enough that a kill loses
little, large enough that the repeated work stays a fraction of each block's (docs/performance.md
gives the cost of blocks, measured by bench/distributed.py).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from auditor.api import audit
from auditor.findings.finding import Finding
from auditor.findings.gate import run_gate
from auditor.formats import json_format
from auditor.runs.distributed import Halted
from auditor.runs.merge import merge_reports
from auditor.runs.workdir import WorkDir, binding_for
from auditor.util.input import resolve_device
from auditor.verdicts.certificates import certificates_document, merge_certificates

DEFAULT_BLOCK_SIZE = 16384


@dataclass(frozen=True)
class Block:
    first: int  # the block covers ids first..stop-1 of the vocabulary
    stop: int
    ids: np.ndarray  # the ids among them to decide


@dataclass
class AuditJob:
    """What every block is decided with: the head and the command's settings."""

    head: object  # auditor.question.head.Head
    domain: object
    device: str
    threads: int | None
    final_norm: object
    ceiling: float | None
    fail_on: frozenset
    allow: object  # AllowList or None
    baseline: object  # Baseline or None
    allow_path: Path | None  # the files they were read from: a work folder is bound to their contents
    baseline_path: Path | None
    certificates: bool  # whether parts carry their certificates


def plan_blocks(ids: np.ndarray, size: int, origin: int = 0) -> list[Block]:
    """The non-empty blocks of ``size`` ids on the grid origin + j * size that hold the sorted ``ids``.

    A work folder's grid starts at 0 whatever --tokens selects, so that its blocks keep their names.
    """
    blocks = []
    start = 0
    while start < ids.size:
        first = origin + (int(ids[start]) - origin) // size * size
        stop = first + size
        end = int(np.searchsorted(ids, stop))
        blocks.append(Block(first, stop, ids[start:end]))
        start = end
    return blocks


def decide_part(job: AuditJob, ids: np.ndarray) -> dict:
    """One block decided: ``{"report": its JSON document, "certificates": its certificates or None}``."""
    report = audit(job.head.audited, job.head.bias, domain=job.domain, device=job.device,
                           tokens=ids.tolist(), progress=False, final_norm=job.final_norm,
                           probability_ceiling=job.ceiling is not None, threads=job.threads)
    result = run_gate(job.head, report, job.fail_on, job.allow, 0.0, job.ceiling, job.baseline)
    return {"report": json_format.document(result),
            "certificates": certificates_document(job.head, report) if job.certificates else None}


def merge_parts(job: AuditJob, blocks: list[Block], parts: dict[int, dict], ids: np.ndarray, shard: dict | None,
                load_seconds: float, ranks: int) -> tuple[dict, dict | None]:
    """The one report (and certificates document) of all blocks, as a single run writes them.

    Times are summed over the blocks (the work done, not the wall time). Raises InputError when the
    parts are not of one audit (which a work folder's binding rules out).
    """
    order = sorted(parts)
    documents = []
    for index, j in enumerate(order, start=1):
        document = dict(parts[j]["report"])
        document["shard"] = {"index": index, "count": len(order), "first": blocks[j].first, "stop": blocks[j].stop}
        documents.append(document)
    merged = merge_reports(documents, [f"block {blocks[j].first}..{blocks[j].stop - 1}" for j in order])
    merged.pop("merged_from")
    merged["shard"] = shard
    merged["run"] = {**merged["run"], "ranks": ranks, "blocks": len(order)}
    merged["timing"]["load_s"] = round(load_seconds, 6)
    if job.allow is not None:  # stale entries over the whole run, as the gate finds them in a single run
        findings = [Finding(id=f["id"], token=f["token"], verdict=f["verdict"]) for f in merged["findings"]]
        undecided = set(range(merged["summary"]["n_tokens"])) - set(ids.tolist())
        merged["warnings"] = job.allow.unused(findings, merged["summary"]["n_tokens"], undecided)
    merged = {key: merged[key] for key in [*documents[0], *merged] if key in merged}  # a single run's key order
    certificates = None
    if job.certificates:
        certificates = merge_certificates([parts[j]["certificates"] for j in order])
    return merged, certificates


def audit_in_blocks(job: AuditJob, tokens: list[int] | None, shard: dict | None, load_seconds: float, *,
                    work_dir: Path | None = None, block_size: int | None = None, ranks=None,
                    progress: bool = False) -> tuple[dict, dict | None] | None:
    """Decide ``tokens`` (None: every id) block by block, on this process or over ``ranks``; the merged report
    and certificates document on rank 0 (None on the other ranks, which write nothing).

    With ``work_dir`` blocks already there are taken as they are and each block decided is written there
    as soon as it is. Under torchrun the ranks claim the blocks one at a time from a counter in the
    rendezvous store. Raises InputError for a work folder of another audit.
    """
    started = time.perf_counter()
    ids = np.unique(np.asarray(tokens if tokens is not None else range(job.head.shape[0]), dtype=np.int64))
    world = ranks.world_size if ranks is not None else 1
    root = ranks is None or ranks.is_root
    if block_size is None and work_dir is None:  # one block per rank: the fixed work once on each
        span = int(ids[-1]) - int(ids[0]) + 1
        blocks = plan_blocks(ids, -(-span // world), origin=int(ids[0]))
    else:
        blocks = plan_blocks(ids, block_size or DEFAULT_BLOCK_SIZE)
    folder = WorkDir(work_dir) if work_dir is not None else None
    # the head's digest and settings: hashed once, for the folder and for the ranks to compare
    binding = _binding(job, block_size) if folder is not None or ranks is not None else None
    done, plan = _taken_from(folder, binding, blocks, job.certificates) if root else ({}, None)
    if ranks is not None:  # rank 0's list of the blocks to decide, once every rank holds the same head
        plan = ranks.ready(plan, binding.key)
        if folder is not None and not root:
            folder.prepare(plan["key"])
    decided = _decide(job, blocks, plan["pending"], folder, ranks, progress and root)
    if ranks is not None:
        gathered = ranks.collect(decided)
        if gathered is None:
            return None
        mine, decided = decided, {j: part for parts in gathered for j, part in parts.items()}
        if folder is not None:  # a rank on a node that does not share the folder wrote its blocks elsewhere
            for j in decided.keys() - mine.keys():
                if not folder.block_path(blocks[j].first, blocks[j].stop).exists():
                    folder.save(blocks[j].first, blocks[j].stop, blocks[j].ids, decided[j])
    if folder is not None:
        print(f"audit: work dir {work_dir}: {len(decided)} of {len(blocks)} blocks decided now, "
              f"{len(done)} taken from earlier runs", file=sys.stderr)
    merged, certificates = merge_parts(job, blocks, {**done, **decided}, ids, shard, load_seconds, world)
    merged["run"]["wall_s"] = round(time.perf_counter() - started, 3)  # this run's, while timing sums all blocks'
    return merged, certificates


def _binding(job: AuditJob, block_size: int | None):
    """The head's fingerprint and every setting that shapes a block's report (workdir.binding_for)."""
    return binding_for(job.head, domain=job.domain, final_norm=job.final_norm, ceiling=job.ceiling,
                       fail_on=job.fail_on, allow=job.allow_path, baseline=job.baseline_path,
                       block_size=block_size or DEFAULT_BLOCK_SIZE, device=resolve_device(job.device).type)


def _taken_from(folder, binding, blocks: list[Block], certificates: bool) -> tuple[dict[int, dict], dict]:
    """Rank 0: the parts a work folder already holds (with their certificates when ``certificates``), and the
    plan: the blocks still to decide, and the folder's key for the other ranks. Raises InputError for a folder
    of another audit."""
    done: dict[int, dict] = {}
    if folder is not None:
        folder.bind(binding)
        folder.remove_stale_temporaries()
        for j, block in enumerate(blocks):
            part = folder.load(block.first, block.stop, block.ids)
            if part is not None and (part.get("certificates") is not None or not certificates):
                done[j] = part
    plan = {"pending": [j for j in range(len(blocks)) if j not in done],
            "key": folder.key if folder is not None else None}
    return done, plan


def _decide(job: AuditJob, blocks: list[Block], pending: list[int], folder, ranks, progress: bool) -> dict[int, dict]:
    """The parts of the pending blocks this process decides, each saved to the folder as soon as decided."""
    decided: dict[int, dict] = {}
    with tqdm(total=len(pending), desc="blocks", file=sys.stderr, disable=not progress, leave=False,
              unit="block") as bar:
        for j in _claimed(pending, ranks):
            if ranks is not None and ranks.halted():
                raise Halted()
            block = blocks[j]
            decided[j] = decide_part(job, block.ids)
            if folder is not None:
                folder.save(block.first, block.stop, block.ids, decided[j])
            bar.update(1)
    return decided


def _claimed(pending: list[int], ranks):
    """The pending blocks this process decides: all of them, or under torchrun those it claims."""
    if ranks is None:
        yield from pending
        return
    while (index := ranks.claim()) < len(pending):
        yield pending[index]
