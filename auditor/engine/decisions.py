"""The engine's answer per token: verdict codes, stages, and the ``Decisions`` every stage writes to.

A stage that proves a token records either a witness (``set_witness``) or
convex weights (``set_convex``); ``spread_to_groups`` finally gives each
requested token the answer of its group of tied rows.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

UNDECIDED, ARGMAXABLE, UNARGMAXABLE, TIED, INCONCLUSIVE = range(5)
VERDICT_NAMES = ("undecided", "argmaxable", "unargmaxable", "tied", "inconclusive")
STAGES = ("", "single row", "screen", "interior", "frank-wolfe", "lp", "unbounded hull", "newton", "ceiling", "min-norm")


@dataclass
class Decisions:
    """Per-token verdicts and certificates, indexed by token id (length n arrays)."""

    verdict: np.ndarray  # int8 codes, VERDICT_NAMES
    margin: np.ndarray  # float64 lower bound of the witness's exact margin, nan where it does not apply
    runner_up: np.ndarray  # int64, -1 where unknown
    stage: np.ndarray  # int8 index into STAGES
    witness_shift: np.ndarray  # witness = scale * (w_k - shift * centre) unless explicit
    witness_scale: np.ndarray  # nan where there is no formula witness
    representative: np.ndarray
    centre: np.ndarray
    explicit_witness: dict[int, np.ndarray] = field(default_factory=dict)
    convex: dict[int, tuple[np.ndarray, np.ndarray, float, float]] = field(default_factory=dict)
    bounds: dict[int, tuple[float, float]] = field(default_factory=dict)
    group_verdict: dict[int, int] = field(default_factory=dict)  # tied token -> its group's verdict code
    ceiling: dict[int, tuple[float, float, np.ndarray]] = field(default_factory=dict)  # k -> (lower, upper, point)
    timings: dict[str, float] = field(default_factory=dict)
    tolerances: dict[str, float] = field(default_factory=dict)


def undecided(representative: np.ndarray, centre: np.ndarray, tolerances: dict[str, float]) -> Decisions:
    """Decisions for every row of a head, all still undecided."""
    n = representative.shape[0]
    return Decisions(
        verdict=np.zeros(n, dtype=np.int8), margin=np.full(n, np.nan), runner_up=np.full(n, -1, dtype=np.int64),
        stage=np.zeros(n, dtype=np.int8), witness_shift=np.zeros(n), witness_scale=np.full(n, np.nan),
        representative=representative, centre=centre, tolerances=tolerances,
    )


def set_witness(out: Decisions, k: int, witness: np.ndarray, margin: float, runner_up: int, stage: str) -> None:
    """Token k is argmaxable: ``witness`` is a point where it wins by at least ``margin`` (a proven lower bound
    of its exact lead there, per unit of ||z|| for an unbounded head without a bias) over ``runner_up``."""
    out.verdict[k] = ARGMAXABLE
    out.explicit_witness[k] = witness
    out.margin[k] = margin
    out.runner_up[k] = runner_up
    out.stage[k] = STAGES.index(stage)


def on_the_simplex(weights) -> np.ndarray:
    """alpha / sum(alpha) in float64: the weights a convex certificate is checked on and reported with.
    The same float64 numbers on both sides matter: a gap settled exactly holds for these weights only."""
    weights = np.asarray(weights, dtype=np.float64)
    return weights / weights.sum()


def set_convex(out: Decisions, k: int, indices, weights, residual: float, gap: float, stage: str) -> None:
    """Token k is unargmaxable: convex ``weights`` on rows ``indices`` reproduce it (normalised, largest first)."""
    out.verdict[k] = UNARGMAXABLE
    weights = on_the_simplex(weights)  # what check_convex checked, given the weights it was given
    order = np.argsort(-weights, kind="stable")  # largest weights first: the main competitors
    out.convex[k] = (np.asarray(indices)[order], np.asarray(weights)[order], float(residual), float(gap))
    out.stage[k] = STAGES.index(stage)


def spread_to_groups(out: Decisions, ids: np.ndarray) -> None:
    """Give every requested token its representative's answer; duplicates become ``tied``.

    A representative that was decided only on behalf of its group, but was not
    itself requested, goes back to undecided.
    """
    rep = out.representative
    requested = np.zeros(rep.shape[0], dtype=bool)
    requested[ids] = True
    duplicated = np.bincount(rep, minlength=rep.shape[0])[rep] > 1
    for k in np.nonzero(requested & duplicated)[0].tolist():
        r = int(rep[k])
        out.group_verdict[k] = int(out.verdict[r])
        if k == r:
            continue
        for array in (out.margin, out.runner_up, out.stage, out.witness_shift, out.witness_scale):
            array[k] = array[r]
        for table in (out.explicit_witness, out.convex, out.bounds):
            if r in table:
                table[k] = table[r]
    for k in np.nonzero(~requested & (out.verdict != UNDECIDED))[0].tolist():
        out.verdict[k] = UNDECIDED
        out.margin[k], out.runner_up[k], out.stage[k], out.witness_scale[k] = np.nan, -1, 0, np.nan
        for table in (out.explicit_witness, out.convex, out.bounds):
            table.pop(k, None)
    for k in out.group_verdict:
        out.verdict[k] = TIED
