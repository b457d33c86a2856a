"""The Frank-Wolfe stage on a domain's dual (bounded domains, and biased heads in R^d): batched pairwise Frank-Wolfe.

In the ball of radius r the margin of token k is (spec, "Margin and duality")

    m_k = min over alpha in the simplex of  phi(alpha) = r ||x(alpha)|| + sum_i alpha_i (b_k - b_i),
    x(alpha) = w_k - sum_i alpha_i w_i,

and in the box of half-width r the same with the l1 norm r ||x||_1 (the box's
support function). Both are convex problems over the simplex. The gradient of
phi in alpha_i is -(w_i . z + b_i) + const at z = r x / ||x|| (ball) or
z = r sign(x) (box), so the linear minimisation oracle is the rival with the
largest logit at that point of the domain: every iterate is a candidate
witness, checked for free, as in frank_wolfe.py. The pairwise step moves weight
from the active rival with the smallest logit at z to the one with the largest,
with an exact line search along x - g u (u = w_fw - w_away): closed-form for the
ball, bisection on the derivative for the box. phi(alpha) bounds the margin
from above (weak duality).

The unbounded domain with a bias is the limit of large balls: a witness in a
ball is one in R^d, and as r grows the weights are driven to x = 0 with the
bias gap as small as it goes, which is the unbounded certificate (polished on
its support by lp.polish). The engine runs it on a short ladder of radii.

Two changes to the plain method make it fast and make it converge:

- A working set of rivals (_WorkingSet): between full passes over the head only
  the rivals that led at some full pass are scored; a full pass is made where
  only it can answer (a point that beats every working rival, a gap that closed
  on the working set) and every few iterations. The leaders change slowly
  as z moves, so most iterations score a few rivals instead of the whole head.
- Smoothing: the norm is not differentiable at x = 0 (the box's at every
  x_j = 0), which is where the weights of a row inside the hull lead, and there
  Frank-Wolfe stalls with phi just above its (negative) minimum. The iteration
  runs on r sqrt(||x||^2 + mu^2) (box: r sum_j sqrt(x_j^2 + mu^2)) instead,
  whose gradient point z = r x / sqrt(||x||^2 + mu^2) (box: coordinate-wise)
  lies inside the domain, so it stays a candidate witness; mu shrinks by 16
  each time the gap closes, down to 0.

Tokens leave as soon as an iterate's witness wins beyond rounding (at a full
pass), or phi drops to the certificate's tolerance (the weights then go to
certify.check_convex, like every other certificate), or the pairwise gap
closes over all rows with mu = 0. Whatever is left goes to the LP with the rows
found as its seeds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from auditor.engine.arithmetic.head import EngineHead
from auditor.engine.arithmetic.power_of_two import normalised_points
from auditor.engine.arithmetic.rounding import proven_lower, proves_positive, safe_norm
from auditor.engine.exact.certify import derived_error
from auditor.engine.solvers.frank_wolfe import active_support, pairwise_move, running_tokens
from auditor.question.domain import Ball, Box, Domain

_SCORE_BUDGET = 1 << 22  # float64 entries of a full evaluation's block of logits (32 MiB)


@dataclass
class DualOutcome:
    certified: bool = False
    witness: np.ndarray | None = None
    lower: float = -np.inf  # best margin of any iterate's witness (a lower bound of its exact one)
    upper: float = np.inf  # smallest phi reached: no point of the ball leads by more
    support: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    support_weights: np.ndarray = field(default_factory=lambda: np.zeros(0))


def bounded_dual(head: EngineHead, ids: np.ndarray, start: np.ndarray, iterations: int, progress=None,
                 domain: Domain | None = None) -> list[DualOutcome]:
    """Run pairwise Frank-Wolfe on the dual of ``domain`` (default: the head's, a Ball or a Box) for
    tokens ``ids`` from the rivals ``start``."""
    domain = head.domain if domain is None else domain
    norm = _SMOOTHED_SUPPORTS[type(domain)](domain, head.d)
    outcomes = [DualOutcome() for _ in ids]
    batch = max(1, min(256, _SCORE_BUDGET // max(head.n, 1)))
    for s in range(0, len(ids), batch):
        _run_batch(head, norm, ids[s:s + batch], start[s:s + batch], iterations, outcomes[s:s + batch])
        if progress is not None:
            progress.update(min(batch, len(ids) - s))
    return outcomes


def _line_search(r: float, x: torch.Tensor, u: torch.Tensor, c: torch.Tensor, limit: torch.Tensor,
                 mu: torch.Tensor | float = 0.0) -> torch.Tensor:
    """argmin over 0 <= g <= limit of r sqrt(||x - g u||^2 + mu^2) + c g, batched (rows of x and u).

    With mu > 0 this is the plain search for the point (x, mu) and the direction (u, 0).
    """
    a = (u * u).sum(dim=1)
    p = (u * x).sum(dim=1)
    q = (x * x).sum(dim=1) + mu * mu
    curvature = r * r * a - c * c
    # Stationary point of the smooth part: r (a g - p) / ||x - g u|| = -c, on the side where a g - p has c's
    # opposite sign. Where r^2 a <= c^2 the linear term wins and phi is monotone along the segment.
    safe = torch.clamp(curvature, min=torch.finfo(torch.float64).tiny)
    root = (p - c * torch.sqrt(torch.clamp(a * q - p * p, min=0.0) / safe)) / torch.clamp(a, min=torch.finfo(torch.float64).tiny)
    monotone = torch.where(c < 0, limit, torch.zeros_like(limit))
    step = torch.where((curvature > 0) & (a > 0), root, monotone)
    return torch.minimum(torch.clamp(step, min=0.0), limit)


class _BallNorm:
    """r ||x||, smoothed to r sqrt(||x||^2 + mu^2)."""

    def __init__(self, domain: Ball, d: int):
        self.domain, self.radius = domain, domain.radius
        self.reach = domain.reach(d)  # largest ||z|| of the domain

    def value(self, x: torch.Tensor) -> torch.Tensor:
        return self.domain.support_rows(x, safe_norm)

    def point(self, x: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
        size = safe_norm(x, dim=1)
        smooth = torch.sqrt(size * size + mu * mu)
        scale = self.radius * (1 - 1e-12) / torch.clamp(smooth, min=1e-300)
        return torch.where(smooth[:, None] > 0, x * scale[:, None], torch.zeros_like(x))

    def start_mu(self, x: torch.Tensor) -> torch.Tensor:
        return _MU_START * safe_norm(x, dim=1)

    def line_search(self, x, u, c, limit, mu):
        return _line_search(self.radius, x, u, c, limit, mu)


class _BoxNorm:
    """r ||x||_1, smoothed coordinate-wise to r sum_j sqrt(x_j^2 + mu^2)."""

    def __init__(self, domain: Box, d: int):
        self.domain, self.radius = domain, domain.radius
        self.reach = domain.reach(d)

    def value(self, x: torch.Tensor) -> torch.Tensor:
        return self.domain.support_rows(x)

    def point(self, x: torch.Tensor, mu: torch.Tensor) -> torch.Tensor:
        smooth = torch.sqrt(x * x + (mu * mu)[:, None])
        return torch.where(smooth > 0, x * (self.radius * (1 - 1e-12)) / torch.clamp(smooth, min=1e-300),
                           torch.zeros_like(x))

    def start_mu(self, x: torch.Tensor) -> torch.Tensor:
        return _MU_START * x.abs().amax(dim=1)

    def line_search(self, x, u, c, limit, mu):
        """argmin over [0, limit] of the smoothed r ||x - g u||_1 + c g: bisection on its derivative,
        which is increasing (the function is convex); _HALVINGS halvings leave an interval of 2^-30 limit
        (the step is a proposal: only the certificates it leads to are checked)."""
        low, high = torch.zeros_like(limit), limit.clone()
        m2 = (mu * mu)[:, None]
        for _ in range(_HALVINGS):
            g = (low + high) / 2
            y = x - g[:, None] * u
            smooth = torch.sqrt(y * y + m2)
            slope = -self.radius * (u * torch.where(smooth > 0, y / torch.clamp(smooth, min=1e-300),
                                                    torch.zeros_like(y))).sum(dim=1) + c
            rising = slope > 0
            high = torch.where(rising, g, high)
            low = torch.where(rising, low, g)
        # The ends: a step of the whole limit when the slope is negative throughout.
        return torch.where(high == limit, limit, low)


# The smoothing and the line search are the method's own; the support function is the domain's.
_SMOOTHED_SUPPORTS = {Ball: _BallNorm, Box: _BoxNorm}


class _WorkingSet:
    """The rivals a batch iterates over between full evaluations: a growing list of row ids.

    The Frank-Wolfe vertex at z is the rival with the largest logit there, and as z
    moves slowly it is almost always among the few rivals that led at the last full
    evaluation. So the batch keeps the union of those leaders (and of every active
    set) and scores only them; a full pass over all n rows is made where only it can
    answer: a point that beats every working rival (a witness must beat all rows),
    a pairwise gap that closed on the working set, and every ``_FULL_EVERY``
    iterations. Weights live on the working set's columns.
    """

    def __init__(self, head: EngineHead, members: torch.Tensor, offset: torch.Tensor):
        self.head = head
        self.offset = offset  # bias plus row mask, over all n rows
        self.members = torch.zeros(0, dtype=torch.int64, device=head.device)
        self.rows = head.stored[:0].to(head.fast_dtype)  # rows_in_storage's precision
        self.position = torch.full((head.n,), -1, dtype=torch.int64, device=head.device)
        self.add(members)

    def add(self, candidates: torch.Tensor) -> int:
        """Append the candidates not yet in the set; returns how many were new."""
        fresh = torch.unique(candidates[self.position[candidates] < 0])
        if fresh.numel():
            self.position[fresh] = torch.arange(self.members.numel(), self.members.numel() + fresh.numel(),
                                                device=fresh.device)
            self.members = torch.cat([self.members, fresh])
            self.rows = torch.cat([self.rows, self.head.rows_in_storage(fresh)])
        return fresh.numel()

    def scores(self, z: torch.Tensor, own: torch.Tensor, first: int = 0) -> torch.Tensor:
        """Logits (in the storage's precision) of the working rivals from column ``first`` on; -inf at own."""
        rows, members = self.rows[first:], self.members[first:]
        if rows.dtype == torch.float32:  # the float32 bounds hold for points of size about 1 (normalised_points)
            z, back = normalised_points(z)
            products = (z.to(rows.dtype) @ rows.T).to(torch.float64)
            if back is not None:
                products.mul_(back[:, None])
        else:
            products = z @ rows.T
        scores = products + self.offset[members][None, :]
        return scores.masked_fill(members[None, :] == own[:, None], -torch.inf)


# mu starts at 1% of the first ||x||, shrinks by 16 at each closed gap, and is 0 below 1e-6 of its start
_MU_START, _SHARPEN, _MU_FLOOR = 0.01, 16.0, 1e-6
_HALVINGS = 30
_FULL_EVERY = 8  # iterations between full evaluations of a token that asked for none
_LEADERS = 16  # rivals per token added to the working set at each full evaluation


@dataclass
class _Batch:
    """The state a batch of tokens carries from one iteration to the next."""
    count: int
    reach: float  # largest ||z|| of the domain
    k_all: torch.Tensor
    bias: torch.Tensor  # zeros without a bias
    offset: torch.Tensor  # bias plus row mask, over all n rows
    working: _WorkingSet
    alpha: torch.Tensor  # weights on the working set's columns (reallocated as it grows)
    x: torch.Tensor  # w_k - sum_i alpha_i w_i
    linear: torch.Tensor  # sum_i alpha_i (b_k - b_i)
    running: torch.Tensor
    waited: torch.Tensor  # iterations since the last full evaluation
    best_lower: torch.Tensor
    best_upper: torch.Tensor
    goal: torch.Tensor
    leaders: int
    mu: torch.Tensor
    mu_floor: torch.Tensor


def _run_batch(head: EngineHead, norm, ids: np.ndarray, start: np.ndarray, iterations: int,
               outcomes: list[DualOutcome]) -> None:
    batch = _start_batch(head, norm, ids, start)
    for live in running_tokens(batch.running, iterations):
        _iterate(head, norm, batch, live, outcomes)
    _write_outcomes(batch, outcomes)


def _start_batch(head: EngineHead, norm, ids: np.ndarray, start: np.ndarray) -> _Batch:
    """The batch's state at its start: all weight on each token's starting rival."""
    device = head.device
    reach = norm.reach
    count = len(ids)
    k_all = torch.as_tensor(ids, device=device)
    start_t = torch.as_tensor(start, device=device)
    rows = torch.arange(count, device=device)
    bias = head.bias if head.bias is not None else torch.zeros(head.n, dtype=torch.float64, device=device)
    offset = bias + head.row_mask if head.row_mask is not None else bias
    working = _WorkingSet(head, start_t, offset)
    alpha = torch.zeros(count, working.members.numel(), dtype=torch.float64, device=device)
    alpha[rows, working.position[start_t]] = 1.0
    x = head.rows64(k_all) - head.rows64(start_t)
    linear = bias[k_all] - bias[start_t]  # sum_i alpha_i (b_k - b_i)
    running = torch.ones(count, dtype=torch.bool, device=device)
    # iterations since the last full evaluation: "long enough" at first, so that the first one is full
    waited = torch.full((count,), _FULL_EVERY, dtype=torch.int64, device=device)
    best_lower = torch.full((count,), -torch.inf, dtype=torch.float64, device=device)
    best_upper = torch.full((count,), torch.inf, dtype=torch.float64, device=device)
    goal = torch.tensor([head.residual_tolerance(int(t)) * reach for t in ids], dtype=torch.float64, device=device)
    leaders = min(_LEADERS, head.n)
    mu = norm.start_mu(x)
    mu_floor = _MU_FLOOR * mu
    return _Batch(count, reach, k_all, bias, offset, working, alpha, x, linear, running, waited, best_lower,
                  best_upper, goal, leaders, mu, mu_floor)


def _pairwise_columns(scores: torch.Tensor, weights: torch.Tensor):
    """The Frank-Wolfe score and column, the away column on the working set, and their gap."""
    fw_score, fw_column = scores.max(dim=1)
    away_score, away_column = torch.where(weights > 0, scores, torch.inf).min(dim=1)
    return fw_score, fw_column, away_column, fw_score - away_score


def _iterate(head: EngineHead, norm, batch: _Batch, live: torch.Tensor, outcomes: list[DualOutcome]) -> None:
    """Nothing: one pairwise Frank-Wolfe iteration of the running slots ``live``, the batch updated in place."""
    k = batch.k_all[live]
    xs = batch.x[live]
    m = batch.mu[live]
    z = norm.point(xs, m)  # inside the domain: the smoothed gradient point
    scores = batch.working.scores(z, k)
    weights = batch.alpha[live]
    own_score = (z * head.rows64(k)).sum(dim=1) + batch.bias[k]
    fw_score, fw_column, away_column, gap = _pairwise_columns(scores, weights)
    # A full evaluation, the only one that certifies a witness or bounds the margin from below,
    # where only it can answer: a point that beats every working rival (a witness must beat all
    # rows), a gap that closed on the working set (it may be the working set's alone), and every
    # _FULL_EVERY iterations.
    full = (batch.waited[live] >= _FULL_EVERY) | (own_score > fw_score) | (gap <= 0)
    certified = torch.zeros(live.numel(), dtype=torch.bool, device=head.device)
    if full.any():
        f = torch.nonzero(full).flatten()
        first = _full_evaluation(head, batch, live, k, z, f, certified)
        if first is not None:  # new working columns: the pairwise choice is made again with them
            weights, scores = _widened(batch, live, k, z, weights, scores, first)
            fw_score, fw_column, away_column, gap = _pairwise_columns(scores, weights)
        batch.waited[live[f]] = 0
    batch.waited[live[~full]] += 1
    for j in torch.nonzero(certified).flatten().tolist():
        slot = int(live[j])
        outcomes[slot].certified = True
        outcomes[slot].witness = z[j].cpu().numpy().copy()
    batch.best_upper[live] = torch.minimum(batch.best_upper[live], norm.value(xs) + batch.linear[live])
    _pairwise_step(head, norm, batch, live, xs, m, weights, fw_column, away_column, gap)
    batch.running[live] = _still_running(norm, batch, live, m, gap, certified)


def _full_evaluation(head: EngineHead, batch: _Batch, live: torch.Tensor, k: torch.Tensor, z: torch.Tensor,
                     f: torch.Tensor, certified: torch.Tensor) -> int | None:
    """The working set's first new column where the pass over all rows added leaders to it, else None."""
    device = head.device
    reach, bias = batch.reach, batch.bias
    kf = k[f]
    everything = head.fast_logits(z[f]) + batch.offset[None, :]
    own = everything[torch.arange(f.numel(), device=device), kf].clone()
    everything[torch.arange(f.numel(), device=device), kf] = -torch.inf
    margin = own - everything.max(dim=1).values
    tolerance = (head.fast_error_factor * ((head.row_norm[kf] + head.max_row_norm) * reach
                                           + bias[kf].abs() + head.max_abs_bias) + head.fast_underflow_floor)
    certified[f] = proves_positive(margin, tolerance)
    # a lower bound of the exact margin at z (derived rows add their error)
    lower = proven_lower(margin, tolerance + derived_error(head, kf, torch.full_like(margin, reach)))
    batch.best_lower[live[f]] = torch.maximum(batch.best_lower[live[f]], lower)
    first = batch.working.members.numel()
    if batch.working.add(everything.topk(batch.leaders, dim=1).indices.flatten()):
        return first
    return None


def _widened(batch: _Batch, live: torch.Tensor, k: torch.Tensor, z: torch.Tensor, weights: torch.Tensor,
             scores: torch.Tensor, first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The weights and scores of ``live`` with the working set's columns from ``first`` on (the batch's too)."""
    grown = batch.working.members.numel() - first
    batch.alpha = torch.cat([batch.alpha, batch.alpha.new_zeros(batch.count, grown)], dim=1)
    weights = torch.cat([weights, weights.new_zeros(live.numel(), grown)], dim=1)
    scores = torch.cat([scores, batch.working.scores(z, k, first)], dim=1)
    return weights, scores


def _pairwise_step(head: EngineHead, norm, batch: _Batch, live: torch.Tensor, xs: torch.Tensor, m: torch.Tensor,
                   weights: torch.Tensor, fw_column: torch.Tensor, away_column: torch.Tensor,
                   gap: torch.Tensor) -> None:
    """Nothing: the line search's step from the away vertex to the Frank-Wolfe one, taken in place."""
    bias = batch.bias
    fw_vertex, away_vertex = batch.working.members[fw_column], batch.working.members[away_column]
    u = head.rows64(fw_vertex) - head.rows64(away_vertex)
    c = bias[away_vertex] - bias[fw_vertex]
    available = weights.gather(1, away_column[:, None]).squeeze(1)
    step = norm.line_search(xs, u, c, torch.where(gap > 0, available, torch.zeros_like(available)), m)
    batch.x[live] = xs - step[:, None] * u
    batch.linear[live] = batch.linear[live] + step * c
    pairwise_move(weights, fw_column, away_column, step, available)
    batch.alpha[live] = weights


def _still_running(norm, batch: _Batch, live: torch.Tensor, m: torch.Tensor, gap: torch.Tensor,
                   certified: torch.Tensor) -> torch.Tensor:
    """Which slots of ``live`` go on (mu sharpened in place where the gap closed for it alone)."""
    settled = norm.value(batch.x[live]) + batch.linear[live] <= batch.goal[live]
    closed = gap <= 0  # a closed gap here has seen every row
    smoothed = closed & (m > 0)  # converged for this mu only: sharpen and go on
    batch.mu[live] = torch.where(smoothed, torch.where(m > batch.mu_floor[live], m / _SHARPEN, torch.zeros_like(m)), m)
    return ~(certified | settled | (closed & ~smoothed))


def _write_outcomes(batch: _Batch, outcomes: list[DualOutcome]) -> None:
    """Nothing: each outcome takes its bounds and, when not certified, its support and weights."""
    alpha = batch.alpha
    for slot in range(batch.count):
        outcome = outcomes[slot]
        outcome.lower, outcome.upper = float(batch.best_lower[slot]), float(batch.best_upper[slot])
        if outcome.certified:
            continue
        support = active_support(alpha[slot])
        # copies: a view would keep the whole tensor it came from alive for as long as the outcome lives
        outcome.support = batch.working.members[support].cpu().numpy().copy()
        outcome.support_weights = alpha[slot, support].cpu().numpy().copy()
