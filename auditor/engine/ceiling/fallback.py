"""The fallback for tokens the search leaves open: an interior-point solve of min_D F_k (cvxpy, Clarabel).

Its answer is only a point: the caller evaluates and certifies it like any other.
"""

from __future__ import annotations

import numpy as np
import torch

from auditor.question.domain import Ball
from auditor.util.io import quiet_stdout


def cvxpy_point(weight, bias, k: int, domain) -> torch.Tensor | None:
    """The solver's minimiser of F_k over the domain (float64, on ``weight``'s device), or None where
    the solver fails or returns no point."""
    import cvxpy as cp

    W = weight.cpu().numpy()
    b = bias.cpu().numpy() if bias is not None else np.zeros(W.shape[0])
    rivals = np.arange(W.shape[0]) != k
    z = cp.Variable(W.shape[1])
    limit = cp.norm(z, 2) <= domain.radius if isinstance(domain, Ball) else cp.abs(z) <= domain.radius
    problem = cp.Problem(cp.Minimize(cp.log_sum_exp((W[rivals] - W[k]) @ z + (b[rivals] - b[k]))), [limit])
    try:
        with quiet_stdout():  # standard output carries the report: a solver's own lines must not reach it
            problem.solve(solver=cp.CLARABEL)
    except (cp.error.SolverError, ValueError, ArithmeticError):
        return None
    if z.value is None:
        return None
    return torch.as_tensor(np.asarray(z.value, dtype=np.float64), device=weight.device)
