"""Stage 4 for balls (with or without a bias): batched pairwise Frank-Wolfe on the ball's dual.

In the ball of radius r the margin of token k is (spec, "Margin and duality")

    m_k = min over alpha in the simplex of  phi(alpha) = r ||x(alpha)|| + sum_i alpha_i (b_k - b_i),
    x(alpha) = w_k - sum_i alpha_i w_i,

a convex problem over the simplex. The gradient of phi in alpha_i is
-(w_i . z + b_i) + const at z = r x / ||x||, so the linear minimisation
oracle is the rival with the largest logit at that point of the sphere: every
iterate is a candidate witness, checked for free, as in frank_wolfe.py. The
pairwise step moves weight from the active rival with the smallest logit at z
to the one with the largest, with an exact line search: along
x - g u (u = w_fw - w_away) the function r ||x - g u|| + c g has a closed-form
minimiser. phi(alpha) bounds the margin from above (weak duality) and
phi - (Frank-Wolfe gap) from below.

Tokens leave as soon as an iterate's witness wins beyond rounding, or phi
drops to the certificate's tolerance (the weights then go to
certify.check_convex, like every other certificate), or the pairwise gap
closes. Whatever is left goes to the LP with the rows found as its seeds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from auditor.domain import Ball
from auditor.engine.head import EngineHead
from auditor.engine.rounding import proves_positive, safe_norm

_ALPHA_BUDGET = 1 << 22  # float64 entries of the dense active-set block (32 MiB)


@dataclass
class BallDualOutcome:
    certified: bool = False
    witness: np.ndarray | None = None
    lower: float = -np.inf  # best computed margin of any iterate's witness
    upper: float = np.inf  # smallest phi reached: no point of the ball leads by more
    support: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    support_weights: np.ndarray = field(default_factory=lambda: np.zeros(0))


def ball_dual(head: EngineHead, ids: np.ndarray, start: np.ndarray, iterations: int,
              progress=None) -> list[BallDualOutcome]:
    """Run pairwise Frank-Wolfe on the ball's dual for tokens ``ids`` from the rivals ``start``."""
    assert isinstance(head.domain, Ball)
    outcomes = [BallDualOutcome() for _ in ids]
    batch = max(1, min(256, _ALPHA_BUDGET // max(head.n, 1)))
    for s in range(0, len(ids), batch):
        _run_batch(head, ids[s:s + batch], start[s:s + batch], iterations, outcomes[s:s + batch])
        if progress is not None:
            progress.update(min(batch, len(ids) - s))
    return outcomes


def _line_search(r: float, x: torch.Tensor, u: torch.Tensor, c: torch.Tensor, limit: torch.Tensor) -> torch.Tensor:
    """argmin over 0 <= g <= limit of r ||x - g u|| + c g, batched (rows of x and u)."""
    a = (u * u).sum(dim=1)
    p = (u * x).sum(dim=1)
    q = (x * x).sum(dim=1)
    curvature = r * r * a - c * c
    # Stationary point of the smooth part: r (a g - p) / ||x - g u|| = -c, on the side where a g - p has c's
    # opposite sign. Where r^2 a <= c^2 the linear term wins and phi is monotone along the segment.
    safe = torch.clamp(curvature, min=torch.finfo(torch.float64).tiny)
    root = (p - c * torch.sqrt(torch.clamp(a * q - p * p, min=0.0) / safe)) / torch.clamp(a, min=torch.finfo(torch.float64).tiny)
    monotone = torch.where(c < 0, limit, torch.zeros_like(limit))
    step = torch.where((curvature > 0) & (a > 0), root, monotone)
    return torch.minimum(torch.clamp(step, min=0.0), limit)


def _run_batch(head: EngineHead, ids: np.ndarray, start: np.ndarray, iterations: int,
               outcomes: list[BallDualOutcome]) -> None:
    device = head.device
    r = head.domain.radius
    count = len(ids)
    k_all = torch.as_tensor(ids, device=device)
    start_t = torch.as_tensor(start, device=device)
    rows = torch.arange(count, device=device)
    alpha = torch.zeros(count, head.n, dtype=torch.float64, device=device)
    alpha[rows, start_t] = 1.0
    bias = head.bias if head.bias is not None else torch.zeros(head.n, dtype=torch.float64, device=device)
    x = head.rows64(k_all) - head.rows64(start_t)
    linear = bias[k_all] - bias[start_t]  # sum_i alpha_i (b_k - b_i)
    running = torch.ones(count, dtype=torch.bool, device=device)
    best_lower = torch.full((count,), -torch.inf, dtype=torch.float64, device=device)
    best_upper = torch.full((count,), torch.inf, dtype=torch.float64, device=device)
    goal = torch.tensor([head.residual_tolerance(int(t)) * r for t in ids], dtype=torch.float64, device=device)

    for _ in range(iterations):
        live = torch.nonzero(running).flatten()
        if live.numel() == 0:
            break
        k = k_all[live]
        xs = x[live]
        size = safe_norm(xs, dim=1)
        z = torch.where(size[:, None] > 0, xs * (r * (1 - 1e-12) / torch.clamp(size, min=1e-300))[:, None],
                        torch.zeros_like(xs))
        scores = head.fast_logits(z) + bias[None, :]
        if head.row_mask is not None:
            scores += head.row_mask[None, :]
        own = scores[torch.arange(live.numel(), device=device), k].clone()
        scores[torch.arange(live.numel(), device=device), k] = -torch.inf
        fw_score, fw_vertex = scores.max(dim=1)

        # The iterate's point as a witness: wins when its own logit beats every rival beyond rounding.
        margin = own - fw_score
        tolerance = (head.fast_error_factor * ((head.row_norm[k] + head.max_row_norm) * r
                                               + bias[k].abs() + head.max_abs_bias) + head.underflow_floor)
        certified = proves_positive(margin, tolerance)
        best_lower[live] = torch.maximum(best_lower[live], margin)
        phi = r * size + linear[live]
        best_upper[live] = torch.minimum(best_upper[live], phi)
        for j in torch.nonzero(certified).flatten().tolist():
            slot = int(live[j])
            outcomes[slot].certified = True
            outcomes[slot].witness = z[j].cpu().numpy().copy()

        weights = alpha[live]
        away_score, away_vertex = torch.where(weights > 0, scores, torch.full_like(scores, torch.inf)).min(dim=1)
        gap = fw_score - away_score
        u = head.rows64(fw_vertex) - head.rows64(away_vertex)
        c = bias[away_vertex] - bias[fw_vertex]
        available = weights.gather(1, away_vertex[:, None]).squeeze(1)
        step = _line_search(r, xs, u, c, available)
        x[live] = xs - step[:, None] * u
        linear[live] = linear[live] + step * c
        weights.scatter_add_(1, fw_vertex[:, None], step[:, None])
        drop = step == available
        weights.scatter_add_(1, away_vertex[:, None], -step[:, None])
        weights[drop, away_vertex[drop]] = 0.0
        alpha[live] = weights

        settled = r * safe_norm(x[live], dim=1) + linear[live] <= goal[live]
        running[live] = ~(certified | settled | (gap <= 0))

    for slot in range(count):
        outcome = outcomes[slot]
        outcome.lower, outcome.upper = float(best_lower[slot]), float(best_upper[slot])
        if outcome.certified:
            continue
        outcome.support = torch.nonzero(alpha[slot] > 0).flatten().cpu().numpy()
        outcome.support_weights = alpha[slot, outcome.support].cpu().numpy()
