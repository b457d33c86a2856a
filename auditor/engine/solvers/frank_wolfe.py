"""The Frank-Wolfe stage without a bias: batched pairwise Frank-Wolfe on the min-norm problem.

For token k it minimises ||x||, x = w_k - p, over points p of the convex hull
of the other rows; the optimum ||x*|| is the distance from w_k to that hull,
which is the best margin on the unit ball. The parts, after FrankWolfe.jl:

- the linear minimisation oracle, ``_rival_scores``: the scores x.w_i of every
  row. Its maximiser is the Frank-Wolfe vertex, and the same scores are the
  logits at z = x, so every iterate is checked as a witness for free;
- the active set: the convex weights alpha over rows, kept densely per token,
  with its three operations (``running_tokens``, ``pairwise_move``,
  ``active_support``), which the dual's iteration (bounded_dual.py) shares;
- the pairwise step: move weight from the worst active row (away vertex) to
  the Frank-Wolfe vertex with an exact line search, which converges linearly
  on polytopes where plain Frank-Wolfe does not.

The norm is the Mahalanobis one, ||x||_M^2 = x^T M x with M the precision of
the rows (head.precision): the same as running Frank-Wolfe on the whitened
head, which is round where trained heads are long and thin. Verdicts are
invariant under that change of coordinates; the candidate witness is z = M x.

Tokens leave the batch as soon as they are certified, when x shrinks to the
residual tolerance (w_k is then inside the hull: the later stages prove it), or
when the pairwise gap closes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from auditor.engine.arithmetic.head import EngineHead
from auditor.engine.arithmetic.rounding import gamma, per_unit_norm, proven_lower, proves_positive, safe_norm
from auditor.engine.exact.certify import derived_error

_ALPHA_BUDGET = 1 << 22  # float64 entries of the dense active-set block (32 MiB; scores take as much again)


@dataclass
class FrankWolfeOutcome:
    certified: bool = False
    witness: np.ndarray | None = None
    margin: float = -np.inf  # best unit-ball margin of any iterate (a lower bound of its exact one)
    runner_up: int = -1
    support: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    support_weights: np.ndarray = field(default_factory=lambda: np.zeros(0))


def _rival_scores(head: EngineHead, directions: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores x.w_i of all rows; the token's own score is returned and masked out."""
    scores = head.fast_logits(directions)  # a float32 head's own precision: the witnesses are re-checked in float64
    if head.row_mask is not None:
        scores += head.row_mask[None, :]
    rows = torch.arange(len(k), device=head.device)
    own = scores[rows, k].clone()
    scores[rows, k] = -torch.inf
    return scores, own


def frank_wolfe(head: EngineHead, ids: np.ndarray, start: np.ndarray, iterations: int,
                progress=None) -> list[FrankWolfeOutcome]:
    """Run pairwise Frank-Wolfe for tokens ``ids`` from the vertices ``start``."""
    outcomes = [FrankWolfeOutcome() for _ in ids]
    batch = max(1, min(256, _ALPHA_BUDGET // max(head.n, 1)))
    for s in range(0, len(ids), batch):
        _run_batch(head, ids[s:s + batch], start[s:s + batch], iterations, outcomes[s:s + batch])
        if progress is not None:
            progress.update(min(batch, len(ids) - s))
    return outcomes


def _run_batch(head: EngineHead, ids: np.ndarray, start: np.ndarray, iterations: int,
               outcomes: list[FrankWolfeOutcome]) -> None:
    device = head.device
    k_all = torch.as_tensor(ids, device=device)
    start_t = torch.as_tensor(start, device=device)
    alpha = torch.zeros(len(ids), head.n, dtype=torch.float64, device=device)
    alpha[torch.arange(len(ids), device=device), start_t] = 1.0
    x = head.rows64(k_all) - head.rows64(start_t)
    running = torch.ones(len(ids), dtype=torch.bool, device=device)
    best_margin = torch.full((len(ids),), -torch.inf, dtype=torch.float64, device=device)
    tiny = head.exit_tolerance()
    metric = head.precision

    for live in running_tokens(running, iterations):
        k = k_all[live]
        xs = x[live]
        zs = xs @ metric
        scores, own = _rival_scores(head, zs, k)
        fw_score, fw_vertex = scores.max(dim=1)

        # Every iterate is a candidate witness: z = M x wins if its own score beats every rival.
        norm_z = safe_norm(zs, dim=1)
        margin = own - fw_score
        tolerance = head.fast_error_factor * (head.row_norm[k] + head.max_row_norm) * norm_z + head.fast_underflow_floor
        certified = proves_positive(margin, tolerance)
        # a lower bound of the exact unit-ball margin of this iterate (derived rows add their error)
        lower = proven_lower(margin, tolerance + derived_error(head, k, norm_z * (1 + gamma(head.d + 8))))
        unit_margin = torch.where(norm_z > 0, per_unit_norm(lower, norm_z, head.d), torch.full_like(margin, -torch.inf))
        best_margin[live] = torch.maximum(best_margin[live], unit_margin)
        for j in torch.nonzero(certified).flatten().tolist():
            slot = int(live[j])
            outcomes[slot].certified = True
            outcomes[slot].witness = zs[j].cpu().numpy().copy()
            outcomes[slot].margin = float(unit_margin[j])
            outcomes[slot].runner_up = int(fw_vertex[j])

        # Pairwise step: shift weight from the away vertex to the Frank-Wolfe vertex.
        weights = alpha[live]
        away_score, away_vertex = torch.where(weights > 0, scores, torch.full_like(scores, torch.inf)).min(dim=1)
        gap = fw_score - away_score
        direction = head.rows64(fw_vertex) - head.rows64(away_vertex)
        length2 = ((direction @ metric) * direction).sum(dim=1)
        available = weights.gather(1, away_vertex[:, None]).squeeze(1)
        step = torch.where(length2 > 0, gap / length2, torch.zeros_like(gap)).clamp(min=0)
        step = torch.minimum(step, available)
        x[live] = xs - step[:, None] * direction
        pairwise_move(weights, fw_vertex, away_vertex, step, available)
        alpha[live] = weights

        inside = torch.linalg.vector_norm(x[live], dim=1) <= tiny
        stalled = gap <= 0
        running[live] = ~(certified | inside | stalled)

    for slot in range(len(ids)):
        outcome = outcomes[slot]
        if outcome.certified:
            continue
        outcome.margin = float(best_margin[slot])
        # copies: a view would keep the whole tensor it came from alive for as long as the outcome lives
        outcome.support = active_support(alpha[slot]).cpu().numpy().copy()
        outcome.support_weights = alpha[slot, outcome.support].cpu().numpy().copy()


# The active set: convex weights per token (rows of a batch), their columns rows of the head or of a
# working set of rivals. The weights with a positive entry are the rows a certificate rests on.

def running_tokens(running: torch.Tensor, iterations: int) -> Iterator[torch.Tensor]:
    """The slots of a batch still running, once per iteration, until none is or ``iterations`` have passed.

    ``running`` is read afresh at every iteration: the caller clears the slots that finish.
    """
    for _ in range(iterations):
        live = torch.nonzero(running).flatten()
        if live.numel() == 0:
            return
        yield live


def pairwise_move(weights: torch.Tensor, toward: torch.Tensor, away: torch.Tensor, step: torch.Tensor,
                  available: torch.Tensor) -> None:
    """Move ``step[j]`` of row j's weight from column ``away[j]`` to column ``toward[j]``, in place.

    ``available`` is the weight the away column held; a column the move empties is set to an
    exact zero, so that it leaves the active set rather than linger as a rounding residue.
    """
    weights.scatter_add_(1, toward[:, None], step[:, None])
    drop = (step == available) & (step > 0)
    weights.scatter_add_(1, away[:, None], -step[:, None])
    weights[drop, away[drop]] = 0.0


def active_support(weights: torch.Tensor) -> torch.Tensor:
    """The columns where one token's weights are positive."""
    return torch.nonzero(weights > 0).flatten()
