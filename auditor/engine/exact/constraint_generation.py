"""Constraint generation for the LP stage: each token's margin program grown round by round, then over every row.

The program over a set A of rival rows (lp.py's MarginProgram) bounds the optimum over all rows from
above. If it is not positive, the dual multipliers of the rival constraints are convex weights over A
(their sum is 1 because t is free), and they certify k over the whole vocabulary. If it is positive,
the optimal z is checked against every row; the rows it loses to join A and the program is solved
again: a few small programs usually cost far less than one over all rows (the spec gives the
measurements).

Constraint generation can stall on crowded boundaries, where each round finds a few new rivals and the
program grows slowly. So a token gets at most ``rounds`` rounds, and fewer once its rivals are a
quarter of the head; then every row is added to the program at once, which makes its next solve the
plain LP over all rows, started from the basis the rounds reached. The stage therefore decides every
token the plain LP decides, up to the float64 checks that every answer goes through.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass

import numpy as np
import torch

from auditor.engine.arithmetic.head import EngineHead
from auditor.engine.exact.face import face_directions
from auditor.engine.exact.lp import LpOutcome, MarginProgram, polish, try_witness
from auditor.util.threads import torch_threads

_EXACT_BELOW = 1e-6  # residuals shorter than this fraction of the rows' entries: their direction is uncertain


def _residual_directions(head: EngineHead, k: int, indices: np.ndarray, weights: np.ndarray,
                         w_k: np.ndarray) -> list[np.ndarray]:
    """The normal of the nearest face found, w_k - sum_i alpha_i w_i, as directions to try as witnesses.

    At a token that leads by a few times the tolerance this residual is ~1e-10 of the rows, and weights
    and sums in float64 leave its direction uncertain by ~1e-6: more than the lead. Then the face on the
    weights' support is solved to far beyond float64 (face.py), with a bias its point too."""
    rows64 = head.rows(indices)
    approximate = w_k - weights @ rows64
    small = float(np.linalg.norm(approximate)) <= _EXACT_BELOW * float(np.abs(rows64).max(initial=np.abs(w_k).max()))
    if not small:
        return [approximate]  # a residual this long has a direction float64 gets right
    return face_directions(head, k, indices[weights > 0]) + [approximate]


@dataclass
class LpSearch:
    """One token's constraint generation: its program, the rivals so far and the best found."""

    k: int
    program: MarginProgram
    add: int  # rivals added per round
    outcome: LpOutcome
    rounds: int = 0  # rounds run so far
    open: bool = True  # False once decided, or once no round can change the answer (no new rival, solver failure)
    complete: bool = False  # the program holds every competitor: it is the plain LP over all rows

    @property
    def rivals(self) -> np.ndarray:
        return self.program.rivals


def start_search(head: EngineHead, k: int, seed_rivals: np.ndarray, add_per_round: int | None = None) -> LpSearch:
    """Token k's search, its first rivals from ``seed_rivals`` (the most threatening rows when there are none)."""
    add = add_per_round or max(32, head.d // 2)
    rivals = np.unique(seed_rivals[(seed_rivals != k) & (seed_rivals >= 0)])
    rivals = rivals[head.representative[rivals] == rivals]
    if rivals.size == 0:
        rivals = _top_rivals(head, k, head.rows([k])[0] - head.centre.cpu().numpy(), set(), add)
    program = MarginProgram(head, k)
    program.add(rivals)
    return LpSearch(k, program, add, LpOutcome())


def _every_rival(head: EngineHead, k: int) -> np.ndarray:
    competitors = np.flatnonzero(head.competitor.cpu().numpy())
    return competitors[competitors != k]


def run_rounds(head: EngineHead, search: LpSearch, rounds: int) -> int:
    """Run up to ``rounds`` rounds of token k's constraint generation; returns the rounds used."""
    k, outcome = search.k, search.outcome
    w_k = search.program.w_k
    used = 0
    while used < rounds and search.open:
        used += 1
        search.rounds += 1
        solved = search.program.solve()
        if solved is None:
            search.open = False
            break
        t, z, s, alpha = solved
        if head.bias is not None and not head.domain.bounded and s > 0:
            z = z / s
        # z is the program's point; with s = 0 (or nearly) it is a direction along which k wins far out,
        # and try_witness finds the scale along it where the lead is largest
        if try_witness(head, k, z, outcome):
            search.open = False
            break
        # The duals certify k only when the optimum over the rivals is (about) zero or below; well above
        # it they are no certificate, and the rivals that beat z are what the next round needs.
        if alpha.sum() > 0 and t <= _CLOSE * max(head.typical_spread, np.finfo(np.float64).tiny):
            indices, weights, convex = polish(head, k, search.rivals, alpha)
            if convex.accepted or convex.residual < outcome.residual:
                outcome.indices, outcome.weights = indices, weights
                outcome.residual, outcome.bias_gap = convex.residual, convex.bias_gap
            if convex.accepted:
                outcome.verdict = "unargmaxable"
                search.open = False
                break
            # The polished weights' residual w_k - sum alpha_i w_i is the normal of the nearest
            # face found so far: an exact direction where the solver's z is only accurate to its tolerance.
            if any(try_witness(head, k, z, outcome) for z in _residual_directions(head, k, indices, weights, w_k)):
                search.open = False
                break
        if search.complete:  # the plain LP over all rows has answered: nothing is left to add
            search.open = False
            break
        new = _top_rivals(head, k, z, set(search.rivals.tolist()), search.add)
        if new.size == 0:  # the program already holds every row that beats its optimum: no round can add one
            search.open = False
            break
        search.program.add(new)
    return used


def complete(head: EngineHead, search: LpSearch) -> None:
    """Add every competitor row to the token's program (warm: the basis of the rounds so far stays), so
    that its next solve is the plain LP over all rows."""
    search.program.add(_every_rival(head, search.k))
    search.complete = True
    search.open = search.outcome.verdict is None


def lp_decide_all(head: EngineHead, tokens: list[int], seeds: dict[int, np.ndarray], rounds: int,
                  done=None, workers: int | None = None) -> dict[int, LpOutcome]:
    """Decide ``tokens`` (``lp_decide`` each); ``done(k)`` is called as each token leaves, on the calling thread.

    Constraint generation stops after ``rounds`` rounds, or sooner once its rivals are a quarter
    of the head (``_LARGEST_SHARE``: the rounds would then cost more than the plain LP); a token still
    open then gets the program over all rows, started from the basis its rounds reached. So the
    stage decides every token the plain LP decides (up to the float64 checks), at a bounded
    multiple of its cost. ``rounds`` = 0 skips the stage.

    The tokens run side by side on ``workers`` threads (by default lp_workers: one a core of the audit, within
    the memory the programs over all rows take): HiGHS lets go of the interpreter while it solves, and each
    token's search is its own (its program, its rivals, its checks against the head, which only reads), so
    that its outcome does not depend on the tokens beside it or on the order they finish in. Each thread then
    takes one of the audit's cores: torch's products inside the searches run on one thread each for the
    stage (a single token's on the audit's threads; products on more threads may round their last bits
    differently), and come back to the audit's count after it. An error, or an interrupt, cancels the tokens
    not yet started."""
    if rounds <= 0:
        outcomes = {k: LpOutcome() for k in tokens}
        for k in tokens:
            if done is not None:
                done(k)
        return outcomes
    workers = lp_workers(head, len(tokens), workers)
    if workers == 1:
        outcomes = {}
        for k in tokens:
            outcomes[k] = lp_decide(head, k, seeds[k], rounds)
            if done is not None:
                done(k)
        return outcomes
    found: dict[int, LpOutcome] = {}
    with torch_threads(1):
        pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="auditor-lp")
        try:
            running = {pool.submit(lp_decide, head, k, seeds[k], rounds): k for k in tokens}
            for future in as_completed(running):
                k = running[future]
                found[k] = future.result()
                if done is not None:
                    done(k)
        except BaseException:
            pool.shutdown(wait=True, cancel_futures=True)  # the running ones finish their solve; no new one starts
            raise
        pool.shutdown(wait=True)
    return {k: found[k] for k in tokens}


def lp_decide(head: EngineHead, k: int, seed_rivals: np.ndarray, rounds: int) -> LpOutcome:
    """One token's exact stage: constraint generation for at most ``rounds`` rounds, then the program over all
    rows where it is still open (lp_decide_all)."""
    search = start_search(head, k, seed_rivals)
    while search.open and search.rounds < rounds and search.rivals.size < _LARGEST_SHARE * head.n_competitors:
        run_rounds(head, search, 1)
    if search.outcome.verdict is None and not search.complete:  # stalled, stopped or failed
        complete(head, search)
        run_rounds(head, search, 1)
    search.program = None  # the solver's memory goes with it
    return search.outcome


def lp_workers(head: EngineHead, tokens: int, wanted: int | None = None) -> int:
    """Threads for the exact stage: ``wanted``, else one a core of the audit (torch's thread count); at most one
    a token, and at most as many as the host's free memory holds programs over all rows (each about
    _PROGRAM_BYTES a row of a competitor per dimension, HiGHS's copies included); one where the program is
    conic (bounded domains other than boxes: cvxpy and Clarabel, whose setup is neither thread-safe nor free of
    the interpreter)."""
    linear = head.domain.polyhedral or (head.domain.orthant and head.bias is None)
    if not linear or tokens < 2:
        return 1
    count = min(torch.get_num_threads() if wanted is None else wanted, tokens)
    program = _PROGRAM_BYTES * head.n_competitors * (head.d + 2)
    return max(1, min(count, _free_memory() // max(program, 1)))


_PROGRAM_BYTES = 64  # a program over all rows: its n x (d + 2) values and indices, and HiGHS's own copies


def _free_memory() -> int:
    """The host's free physical memory in bytes (Linux and macOS), or a very large number where the system does
    not say."""
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


_LARGEST_SHARE = 0.25


_CLOSE = 1e-6  # optima below this fraction of the rows' typical spread get their duals polished  # constraint generation stops when its rivals reach this share of the head


def _top_rivals(head: EngineHead, k: int, z: np.ndarray, exclude: set, count: int) -> np.ndarray:
    """The ``count`` rows with the largest logits at z, among competitors not in ``exclude``."""
    logits = head.logits(torch.as_tensor(z, device=head.device)[None, :])[0]
    if head.bias is not None:
        logits = logits + head.bias
    if head.row_mask is not None:
        logits = logits + head.row_mask
    logits[k] = -torch.inf
    if exclude:
        logits[torch.as_tensor(sorted(exclude), device=head.device)] = -torch.inf
    top = torch.topk(logits, min(count, head.n)).indices
    top = top[torch.isfinite(logits[top])]
    return np.sort(top.cpu().numpy())
