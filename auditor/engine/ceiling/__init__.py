"""Probability ceilings: the largest softmax probability each token can reach in a bounded domain, certified.

max_{z in D} p_k = 1 / (1 + exp(min_D F_k)), F_k convex (objective.py). Each token's point is found
by a search in a fast steering precision whose numbers are not trusted (search.py, from start.py's
Gaussian model), then certified once (bounds.py: float32 where it holds the head, else float64).
Tokens whose bounds are still further apart than the gap go on with every iterate certified, in
float32 where its allowance leaves room, then in float64; the few still open after that get an
interior-point solve (fallback.py) whose point is certified the same way. The method:
docs/method.md, "Probability ceilings".
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from auditor.engine.ceiling.bounds import (FLOAT32_REACH, Float32Certifier, Scale, certify_float64,
                                           float64_run)
from auditor.engine.ceiling.fallback import cvxpy_point
from auditor.engine.ceiling.objective import Buffers, Steering, steering_dtype
from auditor.engine.ceiling.search import solve_batch, spg, steering_run
from auditor.engine.ceiling.start import GaussianModel
from auditor.question.domain import Ball, Box, Domain

_BLOCK_BUDGET = 1 << 25  # float64 entries per token x vocabulary block
_EXACT_LIMIT = 64  # tokens at most given the interior-point solve
_FLOAT32_ITERATIONS = 20
_STEERING_ITERATIONS = 12
_STEERING_GAP = 0.5  # of the gap: the steering's estimates are not certified, so it aims closer


@dataclass
class Ceilings:
    """Every requested token's certified bounds on its ceiling, the points of the lower ones, and the
    witnesses of argmaxability proved on the way."""

    lower: np.ndarray  # p_k at the best point found (a probability the token does reach)
    upper: np.ndarray  # a bound no point of the domain exceeds
    point: np.ndarray  # B x d: the points attaining ``lower``
    # Where the float32 certification also proved that token k's logit is the strict maximum at a point
    # (a witness of argmaxability, as the screen's): margin > 0, a lower bound on l_k - max_i l_i there
    # (-inf elsewhere), the rival closest to winning, and the point when the search went on past it.
    margin: np.ndarray
    runner_up: np.ndarray
    moved: dict[int, np.ndarray] = field(default_factory=dict)

    def witness(self, j: int) -> np.ndarray:
        """The point at which ``margin[j]`` was proved."""
        return self.moved.get(j, self.point[j])


@dataclass
class _Problem:
    """What every stage works on: the head in float64, the tokens, the domain and the gap, with the
    rounding scale, the certification's batch size, the search's first step and the float64 scratch."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    ids: np.ndarray
    domain: Domain
    gap: float
    scale: Scale
    batch: int
    first_step: float | None
    exact: Buffers


def probability_ceilings(weight: torch.Tensor, bias: torch.Tensor | None, ids: np.ndarray, domain: Domain,
                         start: torch.Tensor | None = None, gap: float = 1e-4, iterations: int = 2000, progress=None,
                         row_error: float = 0.0, bias_error: float = 0.0,
                         steering: torch.dtype | None = None) -> Ceilings:
    """Bound max_{z in D} softmax_k(W z + b) for tokens ``ids`` to within ``gap``, starting from points ``start``
    (default: the minimiser of a Gaussian model of the rivals, ``GaussianModel``).

    ``row_error`` / ``bias_error`` bound how far the rows and biases may be from
    exact ones (the norm domain's reduced head); they widen the bounds like rounding does.
    ``steering``: the search's precision (default: ``steering_dtype`` of the device).
    Returns every token's bounds, points and witnesses; raises ValueError for an unbounded domain.
    """
    if not isinstance(domain, (Ball, Box)):
        raise ValueError("probability ceilings need a bounded domain")
    count = len(ids)
    if weight.shape[0] == 1:  # no rival: the only token has probability 1 everywhere
        point = weight[torch.as_tensor(ids, device=weight.device)] if start is None else start
        return Ceilings(np.ones(count), np.ones(count), domain.project_rows(point.to(torch.float64)).cpu().numpy(),
                        np.full(count, -np.inf), np.full(count, -1, dtype=np.int64))
    weight = weight.to(torch.float64)
    bias = bias.to(torch.float64) if bias is not None else None
    found = Ceilings(np.zeros(count), np.ones(count), np.zeros((count, weight.shape[1])),
                     np.full(count, -np.inf), np.full(count, -1, dtype=np.int64))
    batch = max(1, min(512, _BLOCK_BUDGET // max(weight.shape[0], 1)))
    scale = Scale(weight, bias, row_error, bias_error, domain)
    # a point or logits past float32's range: the steering too in float64
    fast = Steering(weight, bias, steering or (steering_dtype(weight.device) if _fits_float32(scale) else torch.float64))
    model = GaussianModel(weight, bias) if start is None else None
    problem = _Problem(weight, bias, ids, domain, gap, scale, batch, model.first_step() if model is not None else None,
                       Buffers())
    # float32 certification where rows, points and logits stay far from its range's ends (its
    # products are kept IEEE ones by ``ieee_float32_products`` around every use)
    single = Float32Certifier(weight, bias, scale) if _fits_float32(scale) else None
    beyond, first = _steer_and_certify(problem, found, fast, model, start, single, progress)
    # where the steering's point is not close enough: on in float32 where its allowance leaves room
    # (the steering's bfloat16 estimates cannot resolve the last 1e-4 of p in mid-range), then in
    # float64 for what is still open
    if single is not None:
        _go_on(problem, found, np.nonzero((found.upper - found.lower > gap) & ~beyond)[0],
               lambda k, z: single.evaluate(k, z, domain, gap, problem.exact), _FLOAT32_ITERATIONS, first)
        first.clear()
    _go_on(problem, found, np.nonzero(found.upper - found.lower > gap)[0],
           float64_run(weight, bias, domain, gap, scale, problem.exact), iterations)
    _solve_interior(problem, found)
    return found


def _fits_float32(scale: Scale) -> bool:
    """Rows, points and logits well inside float32's normal range (2^-126 .. 2^128)."""
    return (2.0**-60 < scale.max_norm < 2.0**60 and 2.0**-60 < scale.reach < 2.0**60
            and scale.max_norm * scale.reach + scale.max_bias < 2.0**60)


def _steer_and_certify(problem: _Problem, found: Ceilings, fast: Steering, model: GaussianModel | None,
                       start: torch.Tensor | None, single: Float32Certifier | None, progress):
    """Every token: the steering search from its start, then one certification at the point it found, into
    ``found``. Returns the tokens whose float32 allowance alone is too wide for the gap, and F_k and its
    gradient where float32 certified a token still open (the float32 search starts there)."""
    weight, ids, domain, gap, batch, scale = (problem.weight, problem.ids, problem.domain, problem.gap,
                                              problem.batch, problem.scale)
    count = len(ids)
    beyond = np.zeros(count, dtype=bool)  # float32's allowance alone too wide for the gap
    first: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # F_k and its gradient where float32 certified
    # the steering in larger batches than the certification: its searches leave fewer tokens active at
    # each step, and products of a few hundred rows run well below the full batch's rate
    steering_batch = batch * max(1, min(2, _BLOCK_BUDGET // max(weight.shape[0] * batch, 1)))
    for s in range(0, count, steering_batch):
        block = slice(s, min(s + steering_batch, count))
        k = torch.as_tensor(ids[block], device=weight.device)
        z = model.start(k, domain) if model is not None else start[block].to(torch.float64)
        z = domain.project_rows(z)
        z = spg(steering_run(fast.evaluate, domain, gap * _STEERING_GAP), k, z.to(fast.compute), domain,
                gap * _STEERING_GAP, _STEERING_ITERATIONS, scale.max_norm, problem.first_step)[2]
        steered = domain.project_rows(z.to(torch.float64))
        for t in range(block.start, block.stop, batch):
            part = slice(t, min(t + batch, block.stop))
            k = torch.as_tensor(ids[part], device=weight.device)
            z = steered[part.start - block.start:part.stop - block.start]
            if single is not None:
                certified = single.certify(k, z, domain, gap, problem.exact)
                found.lower[part], found.upper[part] = certified.lower.cpu().numpy(), certified.upper.cpu().numpy()
                found.point[part] = z.cpu().numpy()
                found.margin[part], found.runner_up[part] = (certified.margin.cpu().numpy(),
                                                             certified.runner_up.cpu().numpy())
                beyond[part] = (certified.floor > FLOAT32_REACH * gap).cpu().numpy()
                for j in np.nonzero((found.upper[part] - found.lower[part] > gap) & ~beyond[part])[0].tolist():
                    first[part.start + j] = (certified.value[j], certified.gradient[j])
            else:
                found.lower[part], found.upper[part], found.point[part] = certify_float64(
                    weight, problem.bias, k, z, domain, gap, scale, problem.exact)
            if progress is not None:
                progress.update(part.stop - part.start)
    return beyond, first


def _go_on(problem: _Problem, found: Ceilings, left: np.ndarray, run, limit: int,
           known: dict[int, tuple[torch.Tensor, torch.Tensor]] | None = None) -> None:
    """The search on from tokens ``left``'s best points with ``run``, every iterate certified, in full
    batches, for at most ``limit`` steps; ``known``: F_k and its gradient at those points (the float32
    certification's), rather than a first evaluation. Improves ``found`` in place."""
    for s in range(0, left.size, problem.batch):
        part = left[s:s + problem.batch]
        k = torch.as_tensor(problem.ids[part], device=problem.weight.device)
        z = torch.as_tensor(found.point[part], device=problem.weight.device)
        start = None
        if known is not None:
            value = torch.stack([known[j][0] for j in part.tolist()])
            start = (value, torch.stack([known[j][1] for j in part.tolist()]), torch.as_tensor(found.lower[part]),
                     torch.as_tensor(found.upper[part]), torch.zeros_like(value, dtype=torch.bool))
        lo, up, zz = (t.cpu().numpy() for t in spg(run, k, z, problem.domain, problem.gap, limit,
                                                     problem.scale.max_norm, problem.first_step, start))
        better = lo > found.lower[part]
        found.lower[part] = np.maximum(lo, found.lower[part])
        found.upper[part] = np.minimum(up, found.upper[part])
        for j in part[better & (found.margin[part] > 0)].tolist():  # the witness stays where it was proved
            found.moved.setdefault(j, found.point[j].copy())
        found.point[part[better]] = zz[better]


def _solve_interior(problem: _Problem, found: Ceilings) -> None:
    """The few tokens that first-order steps leave open: an interior-point solve, its point certified
    (a short float64 search from it). Improves ``found`` in place."""
    weight, bias, ids, domain, gap = problem.weight, problem.bias, problem.ids, problem.domain, problem.gap
    wide = np.nonzero(found.upper - found.lower > gap)[0][:_EXACT_LIMIT]
    for j in wide.tolist():
        z = cvxpy_point(weight, bias, int(ids[j]), domain)
        if z is not None:
            k = torch.as_tensor(ids[j:j + 1], device=weight.device)
            lo, up, zz = solve_batch(weight, bias, k, domain.project_rows(z[None, :]), domain, gap, 50, problem.scale)
            if lo[0] > found.lower[j]:  # the point stays with the bound reached at it
                if found.margin[j] > 0:  # the witness stays where it was proved
                    found.moved.setdefault(j, found.point[j].copy())
                found.lower[j], found.point[j] = lo[0], zz[0]
            found.upper[j] = min(up[0], found.upper[j])
