"""The search for each token's best point: spectral projected gradient on F_k, batched over tokens.

One algorithm for every precision: it is given an evaluation ``run(k, z)`` (the steering's
uncertified estimates here, or the float32 and float64 certified ones from bounds.py) and keeps,
for each token, the best bounds seen and the point of the lower one.
"""

from __future__ import annotations

import torch

from auditor.engine.ceiling.bounds import Scale, float64_run
from auditor.engine.ceiling.objective import Buffers, dual, probability

_MEMORY = 10  # values the non-monotone acceptance test looks back over


def steering_run(evaluate, domain, gap):
    """The steering's evaluations for ``spg``: plain estimates, nothing certified."""
    def run(k, z):
        value, gradient = evaluate(k, z, lambda v: ~(probability(v) >= 1 - gap))
        upper = torch.clamp(probability(dual(domain, value, gradient, z)), max=1.0)
        return value, gradient, probability(value), upper, torch.zeros_like(upper, dtype=torch.bool)
    return run


def solve_batch(weight, bias, k, z, domain, gap, iterations, scale: Scale, buffers: Buffers | None = None):
    """Float64 spectral projected gradient with certified bounds at every point it evaluates: the best
    lower and upper bounds and the point of the lower one (numpy)."""
    lower, upper, best_z = spg(float64_run(weight, bias, domain, gap, scale, buffers), k, z, domain, gap, iterations,
                               scale.max_norm)
    return lower.cpu().numpy(), upper.cpu().numpy(), best_z.cpu().numpy()


def spg(evaluate, k, z, domain, gap, iterations, max_norm, first_step: float | None = None, start=None):
    """Spectral projected gradient (Barzilai-Borwein steps, non-monotone acceptance) on F_k, batched.

    ``evaluate(k, z)`` gives F_k, its gradient, lower and upper bounds on max p_k (certified or
    estimates, as the caller's precision allows) and a mask of the tokens whose search should end
    however wide their bounds (float32's allowance). Returns the best bounds seen and the point
    of the lower one. A point whose lower bound is already within ``gap`` of 1 ends its token's
    search, so its gradient is not needed (NaN). ``start``: what ``evaluate(k, z)`` would give, when
    it is known already."""
    value, gradient, best_lower, best_upper, stuck = start if start is not None else evaluate(k, z)
    best_upper = torch.where(torch.isfinite(best_upper), best_upper, torch.ones_like(best_upper))
    best_z = z.clone()
    step = torch.full_like(value, min(first_step or 1.0 / max(max_norm, 1e-150) ** 2, torch.finfo(z.dtype).max ** 0.5))
    recent = value[:, None].repeat(1, _MEMORY)  # the last values, for the non-monotone test
    for _ in range(iterations):
        active = (best_upper - best_lower > gap) & ~stuck
        if not bool(active.any()):
            break
        idx = torch.nonzero(active).flatten()
        zi = domain.project_rows(z[idx] - step[idx, None] * gradient[idx])
        vi, gi, li, ui, si = evaluate(k[idx], zi)
        # sufficient decrease against the worst recent value, 1e-4 of the first-order decrease: no
        # step length in it, so that the test does not change when the head or the domain is rescaled
        accept = vi <= recent[idx].max(dim=1).values - 1e-4 * (gradient[idx] * (z[idx] - zi)).sum(dim=1).abs()
        accept &= torch.isfinite(vi)
        dz, dg = zi - z[idx], gi - gradient[idx]
        curvature = (dz * dg).sum(dim=1)
        bb = (dz * dz).sum(dim=1) / torch.clamp(curvature, min=1e-300)
        spectral = torch.where((curvature > 0) & torch.isfinite(bb), bb, step[idx] * 4)
        step[idx] = torch.where(accept, spectral, step[idx] * 0.25)  # refused: the same point, a shorter step
        moved = idx[accept]
        z[moved], gradient[moved] = zi[accept], gi[accept]
        recent[moved] = torch.cat([recent[moved, 1:], vi[accept, None]], dim=1)
        stuck[idx] |= si
        better = li > best_lower[idx]
        best_lower[idx[better]] = li[better]
        best_z[idx[better]] = zi[better]
        best_upper[idx] = torch.minimum(best_upper[idx], torch.where(torch.isfinite(ui), ui, best_upper[idx]))
    return best_lower, best_upper, best_z
