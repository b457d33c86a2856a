"""Independent answers to check the auditor against: Qhull, a plain LP over all rows, and a
hand-written certificate check. None of this imports the engine."""

from __future__ import annotations

import cvxpy as cp
import numpy as np
import scipy.optimize
import scipy.spatial

U = 2.0**-53


def qhull_argmaxable(W: np.ndarray, b: np.ndarray | None = None) -> set[int]:
    """Tokens that can win, from Qhull.

    Without a bias: the hull vertices. With a bias: the vertices of the hull of
    the points (w_i, b_i) together with the copies (w_i, b_i - 1).
    """
    if b is None:
        return set(scipy.spatial.ConvexHull(W).vertices.tolist())
    lifted = np.hstack([W, b[:, None]])
    lowered = np.hstack([W, b[:, None] - 1.0])
    hull = scipy.spatial.ConvexHull(np.vstack([lifted, lowered]))
    return {int(v) for v in hull.vertices if v < W.shape[0]}


def lp_margin(W: np.ndarray, b: np.ndarray | None, k: int, domain: str = "unbounded"):
    """Optimal value of the margin program over all rows but k (and k's exact copies), with HiGHS.

    unbounded: z in [-1, 1]^d and the bias scaled by s in [0, 1] (the homogenised
    question, positive iff k can win); box:r: z in [-r, r]^d. Returns (t, z, s).
    """
    n, d = W.shape
    c = np.zeros(n) if b is None else b[k] - b
    rivals = np.array([i for i in range(n) if i != k and not (np.array_equal(W[i], W[k]) and c[i] == 0)],
                      dtype=np.int64)
    if rivals.size == 0:  # only copies of k: nothing to beat, the group wins everywhere
        return np.inf, np.zeros(d), 1.0
    A = W[k][None, :] - W[rivals]
    # variables: z (d), s, t ; maximise t  <=>  minimise -t
    cost = np.zeros(d + 2)
    cost[-1] = -1.0
    A_ub = np.hstack([-A, -c[rivals][:, None], np.ones((len(rivals), 1))])
    b_ub = np.zeros(len(rivals))
    if domain == "unbounded":
        bounds = [(-1, 1)] * d + [(0, 0 if b is None else 1), (None, None)]
    else:
        r = float(domain.split(":")[1])
        bounds = [(-r, r)] * d + [(1, 1), (None, None)]
    res = scipy.optimize.linprog(cost, A_ub=A_ub, b_ub=b_ub, bounds=bounds, method="highs",
                                 options={"primal_feasibility_tolerance": 1e-10, "dual_feasibility_tolerance": 1e-10})
    assert res.status == 0, res.message
    return -res.fun, res.x[:d], res.x[d]


def ball_margin(W: np.ndarray, b: np.ndarray | None, k: int, radius: float) -> float:
    """Optimal margin over the ball of the given radius (a second-order cone program, Clarabel)."""
    n, d = W.shape
    c = np.zeros(n) if b is None else b[k] - b
    rivals = np.array([i for i in range(n) if i != k])
    z, t = cp.Variable(d), cp.Variable()
    problem = cp.Problem(cp.Maximize(t), [(W[k] - W[rivals]) @ z + c[rivals] >= t, cp.norm(z, 2) <= radius])
    problem.solve(solver=cp.CLARABEL)
    return float(t.value)


def witness_wins(W, b, k, z, exclude=()) -> bool:
    """Does z make row k the strict argmax, beyond any float64 rounding? A plain re-check."""
    n, d = W.shape
    b = np.zeros(n) if b is None else b
    logits = W @ z + b
    err = 1.01 * (d + 2) * U * (np.abs(W) @ np.abs(z) + np.abs(b))
    others = np.array([i for i in range(n) if i != k and i not in exclude])
    return bool(np.all(logits[k] - err[k] - (logits[others] + err[others]) > 0))


def convex_residual(W, b, k, indices, weights):
    """(||sum alpha_i w_i - w_k||, b_k - sum alpha_i b_i) after checking the weights are convex."""
    indices = np.asarray(indices)
    weights = np.asarray(weights)
    assert k not in indices
    assert np.all(weights >= 0)
    assert abs(weights.sum() - 1) < 1e-12
    residual = float(np.linalg.norm(weights @ W[indices] - W[k]))
    gap = 0.0 if b is None else float(b[k] - weights @ b[indices])
    return residual, gap


def orthant_margin(W: np.ndarray, b: np.ndarray | None, k: int, radius: float | None = None) -> float:
    """Optimal value of the margin program over z >= 0 against all rows but k and its exact copies.

    Without a radius the homogenised question (positive iff k wins for some z >= 0): z in [0, 1]^d and the
    bias scaled by s in [0, 1], with HiGHS; with one, z >= 0 and ||z|| <= radius (Clarabel)."""
    n, d = W.shape
    c = np.zeros(n) if b is None else b[k] - b
    rivals = np.array([i for i in range(n) if i != k and not (np.array_equal(W[i], W[k]) and c[i] == 0)],
                      dtype=np.int64)
    if rivals.size == 0:
        return np.inf
    A = W[k][None, :] - W[rivals]
    if radius is not None:
        z, t = cp.Variable(d), cp.Variable()
        problem = cp.Problem(cp.Maximize(t), [A @ z + c[rivals] >= t, z >= 0, cp.norm(z, 2) <= radius])
        problem.solve(solver=cp.CLARABEL)
        return float(t.value)
    cost = np.zeros(d + 2)
    cost[-1] = -1.0
    A_ub = np.hstack([-A, -c[rivals][:, None], np.ones((len(rivals), 1))])
    bounds = [(0, 1)] * d + [(0, 0 if b is None else 1), (None, None)]
    res = scipy.optimize.linprog(cost, A_ub=A_ub, b_ub=np.zeros(len(rivals)), bounds=bounds, method="highs",
                                 options={"primal_feasibility_tolerance": 1e-10, "dual_feasibility_tolerance": 1e-10})
    assert res.status == 0, res.message
    return -res.fun
