"""The Newton stage: maximum-entropy convex certificates, by Newton's method.

A point p lies in the interior of the convex hull of rows R exactly when the
smooth convex function

    F(theta) = log sum_{i in R} exp(theta . (w_i - p))

has a minimiser. Its gradient is sum_i pi_i w_i - p with pi = softmax(theta . w_i),
so at the minimiser the weights pi, all positive, reproduce p: the
exponentially tilted, maximum-entropy combination. Its Hessian is the
covariance of the rows under pi, and Newton's method converges in about ten
steps where first-order methods need thousands (the spec measured 17,000
away-step Frank-Wolfe iterations for one interior token).

Rows just inside the hull are hard for any method at p = w_k: the tilt must
pile almost all weight on a few rows. So p is taken further along the ray
from one of the strongest rivals w_j at z = w_k through w_k, at the point of
those rays closest to the centre in the Mahalanobis metric; then

    w_k = (1 - 1/mu) w_j + (1/mu) p,   p = w_j + mu (w_k - w_j), mu >= 1,

and p's weights, scaled by 1/mu, plus 1 - 1/mu on w_j certify w_k. A row
swallowed by a longer copy of itself (w_j = 1.01 w_k) is settled this way in a
few steps. The Hessian is formed from the rows that carry the most weight,
which only slows convergence a little where it is inexact; every answer goes
through certify.check_convex like any other.

With a bias the certificate also needs sum_i pi_i b_i >= b_k. The weights are
then tilted by the bias as well, pi_i proportional to exp(theta . w_i + lean u_i / sigma_u)
with u the part of the bias the rows do not fix (the residual of its least-squares
fit on the rows) and sigma_u its spread: F keeps its gradient sum_i pi_i w_i - p, so
the minimiser still reproduces p, and among the weights that do it leans
towards the rows of larger bias (the fitted part of the bias is linear in w_i,
so the combinations that reproduce p all give it the same average; only u can
move). Where the gap is still positive, a stronger lean is tried (_LEANS),
which in the limit gives the largest average bias any combination reproducing
p has. A row at the mean of the rows with the mean of their biases (the bias a
LayerNorm shift gives every row is w_i . beta) then gets a bias gap below zero
by about sigma_u, instead of a tie, and so does a row a little off the mean whose
own u is a fraction of sigma_u. p is then w_k itself: the ray's rival w_j brings
its own bias into the gap.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from auditor.engine.arithmetic.head import EngineHead
from auditor.engine.arithmetic.rounding import per_unit_norm, safe_norm
from auditor.engine.exact.caratheodory import (
    Pool,
    lifted_dimension,
    lifted_points,
    lifted_tensor,
)
from auditor.engine.exact.certify import check_convex, check_witnesses
from auditor.engine.exact.pools import POOL_HESSIANS, pool_certificate, tilted_pools

_BATCH = 16
_CG_ITERATIONS = 60
_PATIENCE = 6
_ARMIJO = 1e-4
_FLAT = 2.0**-46  # a change of F this small relative to F's larger term is within its float64 rounding
_RAY_RIVALS = 16
_LEANS = (1.0, 8.0, 64.0)  # the bias's tilt, in units of its spread: tried in turn while the gap is positive
_STEP_LIMIT = 30.0  # largest spread (standard deviation over the rows) a step may add to the logits


def tilted_certificates(head: EngineHead, ids: np.ndarray, iterations: int = 40, progress=None,
                        witnesses: dict | None = None) -> dict[int, tuple[np.ndarray, np.ndarray, float, float]]:
    """Return ``{k: (indices, weights, residual, bias_gap)}`` for the tokens this settles by convex weights.

    With a ``witnesses`` dict, the tokens whose tilted point wins (``_tilted_witnesses``) are put there as
    ``{k: (witness, margin, runner_up)}`` (the margin a proven lower bound of the lead at the witness,
    certify.check_witnesses, per unit of ||z|| for an unbounded head without a bias, as set_witness takes
    it) and tried at no further lean."""
    found = {}
    if len(ids) == 0 or head.n_competitors <= head.d:
        return found
    lean_of = _bias_lean(head) if head.bias is not None else None
    for s in range(0, len(ids), _BATCH):
        batch = ids[s:s + _BATCH]
        start = None
        for lean in _LEANS if head.bias is not None else (0.0,):
            settled, reproduced, theta = _run_batch(head, batch, iterations, lean, lean_of, start)
            found.update(settled)
            won = {}
            if witnesses is not None:
                won = _tilted_witnesses(head, batch, theta, lean, lean_of, settled)
                witnesses.update(won)
            # a larger lean only helps where w_k was reproduced and the bias gap alone failed; it starts
            # from the theta that reproduced it under the smaller lean
            keep = np.array([k not in settled and k not in won and k in reproduced for k in batch.tolist()],
                            dtype=bool)
            batch, start = batch[keep], theta[torch.as_tensor(keep, device=theta.device)]
            if not len(batch):
                break
        if progress is not None:
            progress.update(min(_BATCH, len(ids) - s))
    return found


def pooled_certificates(head: EngineHead, ids: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray, float, float]]:
    """Return ``{k: (indices, weights, residual, bias_gap)}`` on at most D rows for the tokens whose row lies inside
    the hull of a pool of 3D rows drawn around it (pools.tilted_pools): the maximum-entropy weights on the pool
    and one elimination (pools.pool_certificate), m D^2 work a Hessian on m = 3D rows in place of Newton's
    passes over the whole head and a full reduction of its dense weights.

    With a bias the weights must also give the rows an average bias above b_k. Fitted on the rows (_bias_lean),
    a combination reproducing w_k gives about the bias b(w_k) = mean b + (w_k - c) . beta, give or take the
    spread sigma_u of the bias about its fit. The weights aim at the lifted point (w_k, T), T = b_k + h,
    h = max(g / 2, g - sigma_u / 2, sigma_u / 4) with g = b(w_k) - b_k: halfway to the fit, or half a spread
    below it when the fit lies further above b_k, or a quarter spread above b_k where b_k lies above the fit
    or near it; the pool leans towards larger biases by (T - b(w_k)) / sigma_u spreads where T lies above the
    fit, and the certificate holds with a bias gap of -h. A token that would need a lean above _POOL_LEAN, and a
    head whose biases no lean can move (all one, or fixed by the rows), are left to the stages that lean over
    the whole head (Newton's, the dual's)."""
    found = {}
    if len(ids) == 0:
        return found
    bias_lean = _bias_lean(head) if head.bias is not None else None
    if bias_lean is not None and not bias_lean.fitted:
        return found
    dim = lifted_dimension(head)
    for s in range(0, len(ids), _BATCH):
        batch = ids[s:s + _BATCH]
        lean, targets = None, lifted_points(head, batch)[:, :-1]
        if bias_lean is not None:
            spread = bias_lean.scale
            below = -bias_lean.direction[torch.as_tensor(batch, device=head.device)].cpu().numpy() * spread  # g
            above = np.maximum.reduce([0.5 * below, below - 0.5 * spread, np.full_like(below, 0.25 * spread)])  # h
            steps = np.maximum(above - below, 0.0) / spread  # (T - b(w_k)) / sigma_u
            keep = steps <= _POOL_LEAN
            batch, targets, above, steps = batch[keep], targets[keep], above[keep], steps[keep]
            targets[:, -1] += above
            lean = (torch.as_tensor(steps, device=head.device), bias_lean.direction)
        for j, (k, chosen) in enumerate(zip(batch.tolist(), tilted_pools(head, batch, lean=lean))):
            if chosen is None:
                continue
            points = lifted_tensor(head, chosen)  # on the head's device: the solve and elimination run there
            certificate = pool_certificate(head, Pool(chosen, None), points, k, target=targets[j],
                                           iterations=POOL_HESSIANS)
            if certificate is None or certificate[0].size > dim:
                continue
            check = check_convex(head, k, *certificate)
            if check.accepted:
                found[k] = (*certificate, check.residual, check.bias_gap)
    return found


_POOL_LEAN = 2.0  # spreads of the bias a pool may lean: beyond it the rows that carry such biases are too few


def ray_rivals(head: EngineHead, k: torch.Tensor, w_k: torch.Tensor,
               origin: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """Candidates for the rival w_j of a ray from w_j through w_k (B x 2 _RAY_RIVALS row ids): the rows with
    the largest (w_i - o) . (w_k - o), and those most nearly parallel to w_k - o (a slightly longer copy of
    a short row need not have one of the largest logits); ``origin`` (o, ||w_i - o|| for every row), o = 0
    when None."""
    if origin is None:
        logits, lengths = head.logits(w_k), head.row_norm
    else:  # the logits at w_k - o less the part common to every row
        o, lengths = origin
        logits = head.logits(w_k - o) - (o @ (w_k - o).T)[:, None]
    if head.row_mask is not None:
        logits += head.row_mask[None, :]
    logits[torch.arange(len(k), device=head.device), k] = -torch.inf
    count = min(_RAY_RIVALS, head.n - 1)
    cosine = logits / lengths.clamp(min=torch.finfo(torch.float64).tiny)[None, :]
    return torch.cat([torch.topk(logits, count, dim=1).indices, torch.topk(cosine, count, dim=1).indices], dim=1)


def _ray_points(head: EngineHead, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(j, mu, p): of the rays from the strongest rivals w_j at z = w_k through w_k, the one that passes
    closest to the centre (Mahalanobis), with mu >= 1 and p = w_j + mu (w_k - w_j) its closest point."""
    w_k = head.rows64(k)
    rivals = ray_rivals(head, k, w_k)
    metric = head.precision
    offset = (w_k - head.centre) @ metric  # B x d
    w_j = head.rows64(rivals.reshape(-1)).reshape(*rivals.shape, head.d)  # B x r x d
    u = w_k[:, None, :] - w_j
    mu_u = u @ metric
    reach = (mu_u * u).sum(dim=2)
    pull = -(mu_u * (w_j - head.centre)).sum(dim=2)
    mu = torch.where(reach > 0, pull / reach, torch.ones_like(reach)).clamp(min=1.0, max=1e6)
    p = w_j + mu[:, :, None] * u
    depth = (((p - head.centre) @ metric) * (p - head.centre)).sum(dim=2)  # squared distance to the centre
    direct = ((offset * (w_k - head.centre)).sum(dim=1))
    best = depth.argmin(dim=1)
    rows = torch.arange(len(k), device=head.device)
    use_ray = depth[rows, best] < direct
    j = torch.where(use_ray, rivals[rows, best], torch.full_like(k, -1))
    mu = torch.where(use_ray, mu[rows, best], torch.ones_like(mu[:, 0]))
    p = torch.where(use_ray[:, None], p[rows, best], w_k)
    return j, mu, p


@dataclass
class _Lean:
    """The bias's lean: the logits get ``lean * direction`` added, direction = (b - mean b - (w - c) . fit) / scale.

    Then theta . w_i + lean direction_i is lean / scale times the logit of row i at the point
    z = scale theta / lean - fit, up to a constant (``point``)."""

    direction: torch.Tensor  # n
    scale: float
    fit: torch.Tensor  # d
    fitted: bool = True  # False where no lean can move the bias: all one, or fixed by the rows up to rounding

    def point(self, theta: torch.Tensor, lean: float) -> torch.Tensor:
        return self.scale * theta / lean - self.fit[None, :]


def bias_can_lean(head: EngineHead) -> bool:
    """Whether combinations reproducing a point can differ in their average bias (_bias_lean): not where the
    biases are all one or a linear function of the rows up to rounding (a LayerNorm's shift on the norm domain's
    reduced head), where every certificate's bias gap is zero up to rounding and only an exact reduction keeps
    it; True without a bias."""
    return head.bias is None or _bias_lean(head).fitted


def _bias_lean(head: EngineHead) -> _Lean:
    """The part of the bias the rows do not fix, in units of its spread: u_i / sigma_u.

    u_i = b_i - mean b - (w_i - c) . beta, beta = C^+ cov(w, b) the least-squares fit of the
    competitors' biases on their rows, and sigma_u the standard deviation of the competitors' u.
    A lean along w_i . beta only moves theta (F's minimiser still reproduces p), so only u can raise
    the average bias; measured in the bias's whole spread, a lean is weaker by sigma_u / sigma, which
    a LayerNorm shift makes small (b_i = w_i . beta, fixed by the reduced rows but for one direction:
    0.008 on the MiniLM head), and theta must first travel far to cancel the rest. Where the rows fix
    the bias up to rounding (sigma_u at most 2^-30 sigma) no lean can help, and the bias is taken whole;
    0 when the competitors' biases are all one.
    """
    bias = head.bias[head.competitor]
    spread = float(bias.std(correction=0)) if bias.numel() > 1 else 0.0
    none = torch.zeros(head.d, dtype=torch.float64, device=head.device)
    if not spread > 0:
        return _Lean(torch.zeros_like(head.bias), 1.0, none, fitted=False)
    centred = head.bias - float(bias.mean())
    cross = head.combine(torch.where(head.competitor, centred, torch.zeros_like(centred))[None, :])[0] / bias.numel()
    beta = head.precision @ cross  # (1/m) sum_i (w_i - c) (b_i - mean b): the w_i - c sum to 0 over the competitors
    unexplained = centred - (head.logits(beta[None, :])[0] - float(head.centre @ beta))
    spread_u = float(unexplained[head.competitor].std(correction=0))
    if not spread_u > 2.0**-30 * spread:
        return _Lean(centred / spread, spread, none, fitted=False)
    return _Lean(unexplained / spread_u, spread_u, beta)


def _tilted_witnesses(head: EngineHead, ids: np.ndarray, theta: torch.Tensor, lean: float, lean_of: _Lean | None,
                      settled: dict) -> dict[int, tuple[np.ndarray, float, int]]:
    """``{k: (witness, margin, runner_up)}`` for the tokens of ``ids`` not ``settled`` whose tilted point wins.

    With a bias and z = scale theta / lean - fit (_Lean.point), F(theta) = (lean / scale) (G(z) + u_k), where
    G(z) = t log sum_i exp((l_i(z) - l_k(z)) / t), t = scale / lean, is a smoothed maximum of the rivals'
    leads over k and at least their maximum. Wherever Newton has driven G below 0, k leads every rival
    at z, and at F's minimiser it has whenever k's best lead in R^d exceeds t log n: a row a little off
    the mean of a LayerNorm-ed head whose bias is above what the rows around it reach. Without a bias
    F is G at z = theta with t = 1 when p = w_k (a ray's p lies beyond w_k): it has no minimiser when p is
    outside the hull, and theta runs off along a direction in which p leads, and often k (any positive
    multiple of it does too, so a bounded domain takes the one just inside). Each z is a candidate, checked like any other witness (in a
    bounded domain it must lie inside)."""
    open_ = np.array([k not in settled for k in ids.tolist()], dtype=bool)
    if not open_.any():
        return {}
    theta = theta[torch.as_tensor(open_, device=theta.device)]
    if lean_of is not None:
        points = lean_of.point(theta, lean)
    else:
        points = theta * head.domain.largest_scales(theta)[:, None] if head.domain.bounded else theta
    check = check_witnesses(head, ids[open_], points)
    margins = check.margin
    if lean_of is None and not head.domain.bounded:  # an unbounded head without a bias quotes the unit ball
        margins = per_unit_norm(margins, safe_norm(points, dim=1).cpu().numpy(), head.d)
    return {int(k): (points[j].cpu().numpy(), float(margins[j]), int(check.runner_up[j]))
            for j, k in enumerate(ids[open_].tolist()) if check.certified[j]}


def _objective(head: EngineHead, theta: torch.Tensor, p: torch.Tensor, mask: torch.Tensor):
    """F(theta) per token and the masked logits theta . w_i (float64)."""
    logits = head.logits(theta) + mask
    return torch.logsumexp(logits, dim=1) - (theta * p).sum(dim=1), logits


def _run_batch(head: EngineHead, ids: np.ndarray, iterations: int, lean: float, lean_of: _Lean | None,
               start: torch.Tensor | None = None) -> tuple[dict, set[int], torch.Tensor]:
    """({k: certificate} for the tokens settled, the tokens whose point p was reproduced to the goal, and
    the final theta of each token), from theta = ``start`` (zero when None); with a bias the logits lean by
    ``lean`` times ``lean_of.direction`` (_bias_lean)."""
    device = head.device
    k = torch.as_tensor(ids, device=device)
    batch = len(ids)
    if head.bias is None:
        j, mu, p = _ray_points(head, k)
    else:
        j, mu, p = torch.full_like(k, -1), torch.ones(batch, dtype=torch.float64, device=device), head.rows64(k)
    rows = torch.arange(batch, device=device)
    # Rivals only: the token itself and the copies of duplicated rows are masked out.
    mask = torch.zeros(batch, head.n, dtype=torch.float64, device=device)
    if head.row_mask is not None:
        mask += head.row_mask[None, :]
    if head.bias is not None:
        mask += lean * lean_of.direction[None, :]
    mask[rows, k] = -torch.inf
    # The residual the certificate may rest on; the check adds its rounding bound, about 2 n u ||w||.
    goal = torch.tensor([head.residual_tolerance(int(t)) for t in ids], dtype=torch.float64, device=device)
    # p carries 1/mu of the certificate: its residual counts 1/mu
    pi, least, theta = maximum_entropy(head, p, mask, goal * mu, iterations, start,
                                       own=head.rows64(k) if head.bias is None else None)

    found = {}
    reproduced = {int(t) for t, r in zip(ids.tolist(), (least / mu <= goal).tolist()) if r}
    for b, token in enumerate(ids.tolist()):
        weights = pi[b] / mu[b]
        if int(j[b]) >= 0:
            weights[j[b]] += 1.0 - 1.0 / mu[b]
        support = torch.nonzero(weights > 0).flatten()
        indices = support.cpu().numpy()
        values = weights[support].cpu().numpy()
        check = check_convex(head, token, indices, values)
        # With a bias the lean is there to push a bounded domain's dual value below zero; a value that is
        # zero up to the tolerance (a tie) is left to the exact stage, which finds the tie's own weights.
        if check.accepted and not (lean and head.domain.bounded and check.residual > 0):
            found[token] = (indices, values, check.residual, check.bias_gap)
    return found, reproduced, theta


def maximum_entropy(head: EngineHead, p: torch.Tensor, mask: torch.Tensor, goal: torch.Tensor, iterations: int,
                    start: torch.Tensor | None = None, own: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Newton's method on F for a batch of points ``p`` (B x d), the logits offset by ``mask`` (B x n: -inf
    for rows a point may not use), until each point is reproduced to ``goal``: (the weights pi, B x n, the
    least residual ||sum pi_i w_i - p|| seen, the final theta), from theta = ``start`` (zero when None).

    With ``own`` (B x d: each token's row, its logit masked out, on a head without a bias) a token stops as
    soon as its own logit at theta leads every rival by 2^-30 of their size: p lies outside the hull, no
    weights reproduce it, and theta is the witness the caller checks (the steps after that only run theta
    further out, each a few passes over the head)."""
    device = head.device
    batch = p.shape[0]
    theta = torch.zeros(batch, head.d, dtype=torch.float64, device=device) if start is None else start.clone()
    value, logits = _objective(head, theta, p, mask)
    running = torch.ones(batch, dtype=torch.bool, device=device)
    pi = torch.softmax(logits, dim=1)
    rival_top = logits.max(dim=1).values if own is not None else None
    best = torch.full((batch,), torch.inf, dtype=torch.float64, device=device)
    least = best.clone()  # the smallest residual seen (best moves only when it halves)
    since = torch.zeros(batch, dtype=torch.int64, device=device)
    for _ in range(iterations):
        if own is not None:
            own_logit = (own * theta).sum(dim=1)
            leads = own_logit - rival_top > 2.0**-30 * (own_logit.abs() + rival_top.abs())
            running &= ~leads
        live = torch.nonzero(running).flatten()
        if live.numel() == 0:
            break
        mean = head.combine(pi[live])
        gradient = mean - p[live]
        residual = torch.linalg.vector_norm(gradient, dim=1)
        # Give up on tokens whose residual has not halved in a while: p is on or outside the hull.
        least[live] = torch.minimum(least[live], residual)
        improved = residual < 0.5 * best[live]
        best[live] = torch.where(improved, residual, best[live])
        since[live] = torch.where(improved, torch.zeros_like(since[live]), since[live] + 1)
        # Done when p is reproduced to 1e-3 of the tolerance, or to 5e-2 of it once Newton's steps
        # stop halving the residual (float64 rounding of the gradient is then what is left).
        done = ((residual <= 1e-3 * goal[live]) | ((residual <= 0.05 * goal[live]) & ~improved)
                | (since[live] > _PATIENCE))
        running[live[done]] = False
        live, mean, gradient, residual = live[~done], mean[~done], gradient[~done], residual[~done]
        if live.numel() == 0:
            break
        step = _newton_steps(head, pi[live], mean, gradient)
        # Damped Newton: where the weights sit on very few rows the Hessian is nearly singular and
        # the step enormous; cap how much one step can change the logits.
        spread = ((step @ head.covariance) * step).sum(dim=1).clamp(min=0).sqrt()
        step = step * (_STEP_LIMIT / spread.clamp(min=_STEP_LIMIT))[:, None]
        slope = (gradient * step).sum(dim=1)

        eta = torch.ones(live.numel(), dtype=torch.float64, device=device)
        pending = torch.ones(live.numel(), dtype=torch.bool, device=device)
        for _ in range(30):  # backtracking (Armijo) line search, batched over the tokens still searching
            where = torch.nonzero(pending).flatten()
            if where.numel() == 0:
                break
            b = live[where]
            trial = theta[b] + eta[where, None] * step[where]
            new_value, new_logits = _objective(head, trial, p[b], mask[b])
            accept = torch.isfinite(new_value) & (new_value <= value[b] + _ARMIJO * eta[where] * slope[where])
            # Near the solution F changes by about the residual squared, below float64's resolution of F
            # itself: a step the value test cannot judge is taken when it cuts the residual, which is
            # what the loop is after (the test alone can stop a solve a few times short of its goal).
            # (F = lse - theta . p rounds relative to its larger term, not to F itself)
            theta_p = (trial * p[b]).sum(dim=1)
            size = torch.maximum((new_value + theta_p).abs(), theta_p.abs()).clamp(min=1.0)
            flat = torch.isfinite(new_value) & ~accept & ((new_value - value[b]).abs() <= _FLAT * size)
            if bool(flat.any()):
                moved = head.combine(torch.softmax(new_logits[flat], dim=1)) - p[b[flat]]
                accept[flat] = torch.linalg.vector_norm(moved, dim=1) < 0.5 * residual[where[flat]]
            ok = where[accept]
            theta[live[ok]] = trial[accept]
            value[live[ok]] = new_value[accept]
            pi[live[ok]] = torch.softmax(new_logits[accept], dim=1)
            if rival_top is not None:
                rival_top[live[ok]] = new_logits[accept].max(dim=1).values
            pending[ok] = False
            eta[where[~accept]] *= 0.5
        running[live[pending]] = False  # no decrease along a Newton direction: F is flat or unbounded here

    return pi, least, theta


def _newton_steps(head: EngineHead, pi: torch.Tensor, mean: torch.Tensor, gradient: torch.Tensor) -> torch.Tensor:
    """Approximately -H^{-1} g for a batch, H the covariance of the rows under pi (B x n weights).

    Preconditioned conjugate gradients with Hessian-vector products
    H v = W^T (pi * (W v)) - m (m . v): two passes over the head per product
    (in its storage precision: the products only steer the steps), batched
    over the tokens, never a d x d Hessian per token. The preconditioner is the
    head's precision matrix, the exact inverse Hessian at theta = 0; for a lone point (the origin's solve of
    anchor.py) on a head of many rows, the inverse of the Hessian of the rows that carry the most weight
    (_heavy_preconditioner), which a tilt far from theta = 0 needs.
    """
    metric = head.precision if pi.shape[0] > 1 else _heavy_preconditioner(head, pi[0], mean[0])

    def product(v, rows):
        m = mean[rows]
        return head.fast_combine(head.fast_logits(v) * pi[rows]) - m * (m * v).sum(dim=1, keepdim=True)

    x = torch.zeros_like(gradient)
    r = -gradient
    z = r @ metric
    direction = z.clone()
    rz = (r * z).sum(dim=1)
    goal = rz * 1e-6  # relative accuracy 1e-3 in the preconditioned norm
    for _ in range(_CG_ITERATIONS):
        active = rz > goal
        if not bool(active.any()):
            break
        hd = torch.zeros_like(direction)
        hd[active] = product(direction[active], active)
        curvature = (direction * hd).sum(dim=1)
        step = torch.where(active & (curvature > 0), rz / curvature.clamp(min=torch.finfo(torch.float64).tiny),
                           torch.zeros_like(rz))
        x = x + step[:, None] * direction
        r = r - step[:, None] * hd
        z = r @ metric
        rz_new = (r * z).sum(dim=1)
        beta = torch.where(rz > 0, rz_new / rz.clamp(min=torch.finfo(torch.float64).tiny), torch.zeros_like(rz))
        direction = z + beta[:, None] * direction
        rz = torch.where(active, rz_new, rz)
    return x


_HEAVY_ROWS = 2  # times D: the rows of largest weight the lone point's preconditioner is formed on


def _heavy_preconditioner(head: EngineHead, pi: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """The inverse of sum_{i in T} pi_i (w_i - m)(w_i - m)^T + (1 - pi(T)) C over the 2D rows T of largest
    weight (C the head's covariance, m the weighted mean): the Hessian itself where T holds nearly all the
    weight, as it does once the tilt has moved far from the centre, and C's share for the rest.

    Formed in float32 (it only steers the conjugate gradients, whose products and residuals are the
    Hessian's own), in 2 D d^2 operations. On a head of fewer than 8 D rows it is formed on every row: the
    Hessian itself, in at most 8 D d^2 operations, where the head's precision as the preconditioner leaves
    the conjugate gradients 40-50 products a step, each a memory-bound pass over the head (the origin's
    solve on the 4096 x 512 member of bench/families.py takes about 40 steps)."""
    d = head.d
    count = _HEAVY_ROWS * (d + 1) if head.n >= 4 * _HEAVY_ROWS * (d + 1) else head.n
    weights, rows = torch.topk(pi, count)
    # Rows of weight below 2^-60 of the largest change the Hessian by less than that share of it; their
    # float32 terms would be subnormal, which CPUs multiply many times slower
    kept = weights >= weights[0] * 2.0**-60
    weights, rows = weights[kept], rows[kept]
    hessian = torch.zeros(d, d, dtype=torch.float32, device=head.device)
    for s in range(0, rows.numel(), 1024):  # centred and weighted in float64, by blocks, then rounded
        part = slice(s, s + 1024)
        heavy = ((head.rows64(rows[part]) - mean) * weights[part].sqrt()[:, None]).to(torch.float32)
        hessian.addmm_(heavy.T, heavy)
    hessian = hessian.to(torch.float64)
    hessian += max(float(1.0 - weights.sum()), 1e-6) * head.covariance
    factor, info = torch.linalg.cholesky_ex(hessian)
    if int(info) != 0:
        return head.precision
    return torch.cholesky_inverse(factor)
