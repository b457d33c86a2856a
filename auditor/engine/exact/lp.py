"""The LP stage: the exact cross-check, a margin program over a set of rivals (constraint_generation.py grows it).

For token k and a set A of rival rows it solves

    maximise t  subject to  (w_k - w_i).z + (b_k - b_i) s >= t  for i in A,  z in D',

with HiGHS (a linear program; called directly, warm between rounds) or Clarabel (a
second-order cone for the ball). D' is the domain itself when it is bounded (s = 1).
In the unbounded domain the question is homogeneous: z ranges over the box [-1, 1]^d
and the bias enters through s in [0, 1], so that a strict win at (z, s) with s > 0
gives the witness z / s and one with s = 0 gives a winning direction to scale up
(the best scale along it is found exactly: best_scale).

Its dual multipliers are convex weights over the rivals (polish re-solves them on their support and
checks them), its optimal z a candidate witness (try_witness).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import scipy.optimize
import torch

from auditor.engine.arithmetic.head import EngineHead
from auditor.engine.arithmetic.rounding import per_unit_norm, safe_norm
from auditor.engine.exact.certify import EXACT_GAP_ROWS, check_convex, check_witnesses
from auditor.util.io import quiet_stdout


@dataclass
class LpOutcome:
    verdict: str | None = None  # "argmaxable", "unargmaxable" or None (undecided)
    witness: np.ndarray | None = None
    margin: float = -math.inf
    runner_up: int = -1
    indices: np.ndarray | None = None
    weights: np.ndarray | None = None
    residual: float = math.inf
    bias_gap: float = math.inf
    checked: np.ndarray | None = None  # the point try_witness checked last (None: it had no direction to try)


class MarginProgram:
    """Token k's margin program over a growing set of rivals, kept in one solver between rounds.

    Polyhedral domains (R^d, boxes) go to HiGHS directly: the program is built once and each
    round adds the new rivals' rows, so the dual simplex starts from the previous optimal basis
    (the rows added cut the previous optimum off; every other row keeps its basis status) instead
    of solving from scratch. Balls are second-order cones and go to Clarabel through cvxpy, rebuilt
    each round.
    """

    def __init__(self, head: EngineHead, k: int):
        self.head, self.k = head, k
        self.w_k = head.rows([k])[0]
        self.b_k = float(head.biases([k])[0]) if head.bias is not None else 0.0
        self.rivals = np.zeros(0, dtype=np.int64)
        self.homogeneous_bias = head.bias is not None and not head.domain.bounded  # the s column
        # Without a bias, z >= 0 with ||z|| <= r wins where the orthant does (the lead scales with z): the
        # linear program over the box decides, and _witnesses_from moves its point into the ball.
        linear = head.domain.polyhedral or (head.domain.orthant and head.bias is None)
        self._highs = self._new_highs() if linear else None

    def _new_highs(self):
        import highspy

        with quiet_stdout():  # the constructor prints HiGHS's banner to descriptor 1, the report's stream
            highs = highspy.Highs()
        for option, value in (("output_flag", False), ("presolve", "off"),
                              # tight tolerances: near-boundary tokens have margins far below the defaults
                              ("primal_feasibility_tolerance", 1e-10), ("dual_feasibility_tolerance", 1e-10)):
            highs.setOptionValue(option, value)
        d, inf = self.head.d, highspy.kHighsInf
        reach = 1.0 if not self.head.domain.bounded else float(self.head.domain.radius)
        floor = 0.0 if self.head.domain.orthant else -reach  # z >= 0: the orthant's part of the box
        lower = [floor] * d + ([0.0] if self.homogeneous_bias else []) + [-inf]
        upper = [reach] * d + ([1.0] if self.homogeneous_bias else []) + [inf]
        highs.addVars(len(lower), np.array(lower), np.array(upper))
        highs.changeColCost(len(lower) - 1, 1.0)  # t
        highs.changeObjectiveSense(highspy.ObjSense.kMaximize)
        return highs

    def add(self, rivals: np.ndarray) -> None:
        rivals = np.setdiff1d(np.asarray(rivals, dtype=np.int64), self.rivals)
        if rivals.size == 0:
            return
        self.rivals = np.concatenate([self.rivals, rivals])
        if self._highs is None:
            return
        import highspy

        head = self.head
        A = self.w_k[None, :] - head.rows(rivals)  # (w_k - w_i) . z
        columns = [A]
        lower = np.zeros(rivals.size)
        if head.bias is not None:
            gap = self.b_k - head.biases(rivals)
            if self.homogeneous_bias:
                columns.append(gap[:, None])  # + (b_k - b_i) s
            else:
                lower = -gap  # (w_k - w_i) . z - t >= -(b_k - b_i)
        columns.append(-np.ones((rivals.size, 1)))  # - t
        values = np.hstack(columns)
        width = values.shape[1]
        starts = np.arange(rivals.size, dtype=np.int32) * width
        indices = np.tile(np.arange(width, dtype=np.int32), rivals.size)
        self._highs.addRows(rivals.size, lower, np.full(rivals.size, highspy.kHighsInf), values.size, starts, indices,
                            values.ravel())

    def solve(self):
        """(t, z, s, alpha) at the optimum over the rivals so far, or None when the solver fails."""
        if self._highs is None:
            return _solve_conic(self.head, self.k, self.rivals)
        import highspy

        highs = self._highs
        try:
            highs.run()
        except Exception:  # noqa: BLE001 - any solver failure leaves the token to the next stage's rules
            return None
        if highs.getModelStatus() != highspy.HighsModelStatus.kOptimal:
            return None
        solution = highs.getSolution()
        x = np.asarray(solution.col_value, dtype=np.float64)
        d = self.head.d
        z, s = x[:d], (float(x[d]) if self.homogeneous_bias else 1.0)
        alpha = np.clip(-np.asarray(solution.row_dual, dtype=np.float64), 0.0, None)  # duals of >= rows of a maximum
        return float(x[-1]), z, s, alpha


def _solve_conic(head: EngineHead, k: int, rivals: np.ndarray):
    """The margin program in a ball (a second-order cone) with Clarabel; (t, z, s, alpha) or None."""
    import cvxpy as cp  # imported here: it takes a second, and most audits never reach this stage

    w_k = head.rows([k])[0]
    A = w_k[None, :] - head.rows(rivals)
    c = head.biases([k])[0] - head.biases(rivals) if head.bias is not None else 0.0
    z, t = cp.Variable(head.d), cp.Variable()
    rival = A @ z + c - t >= 0
    problem = cp.Problem(cp.Maximize(t), [rival] + head.domain.constraints(z))
    try:
        with warnings.catch_warnings(), quiet_stdout():
            warnings.simplefilter("ignore")  # "may be inaccurate": every answer is checked in float64 anyway
            problem.solve(solver=cp.CLARABEL, tol_feas=1e-11, tol_gap_abs=1e-11, tol_gap_rel=1e-11)
    except (cp.error.SolverError, ValueError, ArithmeticError):
        return None
    if problem.status not in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE) or z.value is None or rival.dual_value is None:
        return None
    alpha = np.clip(np.asarray(rival.dual_value, dtype=np.float64).ravel(), 0.0, None)
    return float(t.value), np.asarray(z.value, dtype=np.float64), 1.0, alpha


def best_scale(slopes: np.ndarray, intercepts: np.ndarray, largest: float) -> float:
    """Maximise the concave f(s) = min_i (s slopes_i + intercepts_i) over 0 <= s <= largest."""
    if np.all(slopes > 0) and not math.isfinite(largest):
        # f grows without bound: go well past the last crossing of zero.
        need = np.max(np.where(intercepts < 0, -intercepts / slopes, 0.0))
        return 2.0 * need + 1.0
    upper = largest if math.isfinite(largest) else 1.0
    if not math.isfinite(largest):
        while np.min(upper * slopes + intercepts) < np.min(2 * upper * slopes + intercepts) and upper < 1e300:
            upper *= 2.0
        upper *= 2.0
    found = scipy.optimize.minimize_scalar(lambda s: -np.min(s * slopes + intercepts),
                                           bounds=(0.0, upper), method="bounded",
                                           options={"xatol": upper * 1e-12})
    return _to_the_kink(slopes, intercepts, float(found.x), largest)


def _to_the_kink(slopes: np.ndarray, intercepts: np.ndarray, s: float, largest: float, steps: int = 8) -> float:
    """Walk from s along the concave f(s) = min_i (s slopes_i + intercepts_i) to its maximum, one crossing of
    lines at a time. Brent's search stops about sqrt(eps) of s from the kink, where the lead is lost by that
    much times the slopes: more than a token that leads by a few tolerances has (a face's rows tie exactly at
    the kink). Each step moves to the nearest crossing of the lowest line with one that rises less (or falls
    less) and is kept only where f grows."""
    def f(x: float) -> float:
        return float(np.min(x * slopes + intercepts))

    best = f(s)
    for _ in range(steps):
        i = int(np.argmin(s * slopes + intercepts))
        if slopes[i] > 0:
            other = slopes < slopes[i]
        elif slopes[i] < 0:
            other = slopes > slopes[i]
        else:
            break
        crossings = (intercepts[other] - intercepts[i]) / (slopes[i] - slopes[other])
        ahead = crossings[(crossings > s) if slopes[i] > 0 else (crossings < s)]
        if ahead.size == 0:  # no line ends the lowest one's rise (fall) before the end of the range
            if slopes[i] < 0:
                ahead = np.array([0.0])
            elif math.isfinite(largest):
                ahead = np.array([largest])
            else:
                break
        step = float(np.min(ahead) if slopes[i] > 0 else np.max(ahead))
        step = min(max(step, 0.0), largest)
        value = f(step)
        if not value > best:
            break
        s, best = step, value
    return s


def _witnesses_from(head: EngineHead, ks: list[int], Z: np.ndarray) -> np.ndarray:
    """Turn the programs' directions (rows of Z, one per token of ``ks``) into points of the domain, each with
    the best scale along its direction (with a bias the logits of all of them in one product)."""
    if head.bias is None:
        if head.domain.bounded:
            return Z * np.array([head.domain.largest_scale(z) for z in Z])[:, None]
        return Z
    logits = head.logits(torch.as_tensor(Z, device=head.device))
    if head.row_mask is not None:
        logits = logits + head.row_mask[None, :]
    logits = logits.cpu().numpy()
    bias = head.bias.cpu().numpy()
    points = np.empty_like(Z)
    for j, (k, z) in enumerate(zip(ks, Z)):
        slopes = logits[j, k] - logits[j]
        intercepts = bias[k] - bias
        keep = np.isfinite(slopes)
        keep[k] = False
        points[j] = z * best_scale(slopes[keep], intercepts[keep], head.domain.largest_scale(z))
    return points


def polish(head: EngineHead, k: int, indices: np.ndarray, weights: np.ndarray, first_accepted: bool = False):
    """Sharpen approximate convex weights into an exact combination on their support.

    Tries the weights as given, a vertex of the combinations on their support re-solved exactly on
    its basis, the non-negative least-squares solution on it and (on small supports) the affine
    solve on it; returns the accepted candidate with the smallest residual as (indices, weights,
    check), or the best rejected one. A candidate accepted with residual zero ends the search (none
    can do better), and on a support of more than 2 (d + 2) rows any accepted one does, the least
    squares going before the vertex LP there; with ``first_accepted`` any accepted one ends it on every
    support (weights from an exact solve, whose residual is rounding already).
    """
    keep = weights > weights.max() * 1e-12
    support = indices[keep]
    if head.domain.orthant:
        return _polish_orthant(head, k, support, weights[keep])
    best = None

    def tried(idx, w):
        nonlocal best
        nz = w > 0
        check = check_convex(head, k, idx[nz], w[nz])
        if best is None or (not check.accepted, check.residual) < (not best[2].accepted, best[2].residual):
            best = (idx[nz], w[nz], check)
        return check.accepted and (check.residual == 0 or enough)

    # on a large support (Frank-Wolfe's) any accepted candidate ends the search: Carathéodory reduces it later,
    # and the vertex LP on hundreds of rows is the costly candidate
    large = support.size > _LARGE_SUPPORT * (head.d + 2)
    enough = large or first_accepted  # any accepted candidate ends the search
    if tried(support, weights[keep] / weights[keep].sum()):
        return best
    rows = head.rows(support)
    w_k = head.rows([k])[0]
    Y = (rows - w_k).T  # d x |S|
    # the sum's row at the rows' scale; rows all equal to w_k (copies of its weights, other biases) leave Y zero
    scale = float(np.abs(Y).max()) or 1.0
    system = np.vstack([Y, np.full((1, support.size), scale)])
    target = np.concatenate([np.zeros(head.d), [scale]])

    def least_squares() -> bool:
        # min ||Y b||^2 + (sum b - 1)^2 over b >= 0 has b* = t alpha* for the min-norm weights alpha*.
        beta = scipy.optimize.nnls(system, target, maxiter=50 * max(support.size, 10))[0]
        return beta.sum() > 0 and tried(support, beta / beta.sum())

    def vertex() -> bool:
        # A vertex of {alpha >= 0 : sum alpha_i w_i = w_k, sum alpha = 1} with the largest sum alpha_i b_i,
        # re-solved exactly on its (at most d + 1 rows) basis: sparse, and it keeps the bias gap negative.
        found = scipy.optimize.linprog(-head.biases(support), A_eq=system, b_eq=target, bounds=(0, None),
                                       method="highs")
        if found.status != 0:
            return False
        basis = found.x > found.x.max() * 1e-12
        exact = np.linalg.lstsq(system[:, basis], target, rcond=None)[0]
        return bool(np.all(exact >= 0) and exact.sum() > 0 and tried(support[basis], exact / exact.sum()))

    for candidate in ((least_squares, vertex) if large else (vertex, least_squares)):
        if candidate():
            return best
    if support.size <= _AFFINE_ROWS * (head.d + 1):  # on many rows the least-norm solve is rarely non-negative
        affine = np.linalg.lstsq(system, target, rcond=None)[0]
        if np.all(affine >= 0) and affine.sum() > 0 and tried(support, affine / affine.sum()):
            return best
    return _snapped_if_better(head, k, best)


def _polish_orthant(head: EngineHead, k: int, support: np.ndarray, weights: np.ndarray):
    """polish over z >= 0, where the certificate is sum alpha_i w_i >= w_k entrywise (not equal): tries the
    weights as given, then a vertex of {alpha >= 0 : sum alpha_i (w_i - w_k) >= u 1, sum alpha = 1} with the
    largest sum alpha_i b_i (a bias) or the largest u (none), re-solved exactly on its basis and the
    coordinates it holds tight, where the combination meets w_k and rounding decides the sign."""
    best = None

    def tried(idx, w) -> bool:
        nonlocal best
        nz = w > 0
        check = check_convex(head, k, idx[nz], w[nz])
        if best is None or (not check.accepted, check.residual) < (not best[2].accepted, best[2].residual):
            best = (idx[nz], w[nz], check)
        return check.accepted

    if tried(support, weights / weights.sum()):
        return best
    Y = (head.rows(support) - head.rows([k])[0]).T  # d x |S|: sum alpha_i (w_i - w_k) >= 0
    scale = float(np.abs(Y).max()) or 1.0
    m = support.size
    if head.bias is not None:  # variables alpha; maximise sum alpha_i b_i
        cost, rows = -head.biases(support), -Y
        bounds = [(0, None)] * m
        equality = np.ones((1, m))
    else:  # variables (alpha, u); maximise u, at most the rows' scale
        cost = np.concatenate([np.zeros(m), [-1.0]])
        rows = np.hstack([-Y, np.ones((Y.shape[0], 1))])
        bounds = [(0, None)] * m + [(None, scale)]
        equality = np.concatenate([np.ones(m), [0.0]])[None, :]
    found = scipy.optimize.linprog(cost, A_ub=rows, b_ub=np.zeros(Y.shape[0]), A_eq=equality, b_eq=[1.0],
                                   bounds=bounds, method="highs")
    if found.status == 0:
        alpha = np.clip(found.x[:m], 0.0, None)
        if alpha.sum() > 0 and tried(support, alpha / alpha.sum()):
            return best
        basis = alpha > alpha.max() * 1e-12
        tight = Y @ alpha <= 1e-9 * scale  # the coordinates where the combination meets w_k
        system = np.vstack([Y[np.ix_(tight, basis)], np.full((1, int(basis.sum())), scale)])
        target = np.concatenate([np.zeros(int(tight.sum())), [scale]])
        exact = np.linalg.lstsq(system, target, rcond=None)[0]
        if np.all(exact >= 0) and exact.sum() > 0 and tried(support[basis], exact / exact.sum()):
            return best
    return _snapped_if_better(head, k, best)


_AFFINE_ROWS = 2  # supports up to this many times d + 1 rows get the affine solve
_LARGE_SUPPORT = 2  # supports beyond this many times d + 2 rows take the first accepted candidate


def _snapped_if_better(head: EngineHead, k: int, best):
    """``best`` (indices, weights, check), or its weights snapped to small fractions where only those pass.

    A value zero only in exact arithmetic (a row exactly between others, its bias exactly between
    theirs) needs the exact weights, which a solve gives only up to rounding: they are usually
    fractions with small denominators, which float64 weights represent after normalisation when
    the denominators are powers of two or the weights are equal."""
    if not best[2].accepted and best[1].size <= EXACT_GAP_ROWS:
        snapped = _snapped(best[1])
        if snapped is not None:
            check = check_convex(head, k, best[0], snapped)
            if check.accepted:
                return best[0], snapped, check
    return best


def _snapped(weights: np.ndarray, denominator: int = 1 << 12) -> np.ndarray | None:
    """The nearest fractions with denominators at most ``denominator``, summing to 1 exactly, as float64
    (None when no weight moves, or when one would vanish)."""
    from fractions import Fraction

    fractions = [Fraction(float(w)).limit_denominator(denominator) for w in weights / weights.sum()]
    total = sum(fractions)
    if total <= 0 or any(f <= 0 for f in fractions):
        return None
    snapped = np.array([float(f / total) for f in fractions])
    return None if np.array_equal(snapped, weights) else snapped


def try_witness(head: EngineHead, k: int, z: np.ndarray, outcome: LpOutcome) -> bool:
    """Check z (scaled along itself to its best point in the domain) as a witness; keep the best margin."""
    return try_witnesses(head, [k], [z], [outcome])[0]


def try_witnesses(head: EngineHead, ks: list[int], directions: list[np.ndarray], outcomes: list[LpOutcome]
                  ) -> list[bool]:
    """try_witness for several tokens at once, each with its own direction and outcome: the directions (their
    positive parts over z >= 0) at unit peak, scaled along themselves to their best points in the domain, and
    checked in one product. ``outcomes[j].checked`` is the point checked for token j (None: its direction is
    none to try)."""
    prepared = []
    for z in directions:
        if head.domain.orthant:  # the program's z lies in the orthant; a residual's direction: its positive part
            z = np.maximum(z, 0.0)
        if not np.all(np.isfinite(z)) or (not np.any(z) and head.bias is None):
            prepared.append(None)
            continue
        prepared.append(z / np.abs(z).max() if np.any(z) else z)  # unit peak: tiny ones would underflow
    proved = [False] * len(ks)
    for outcome in outcomes:
        outcome.checked = None
    live = [j for j, z in enumerate(prepared) if z is not None]
    if not live:
        return proved
    ids = [ks[j] for j in live]
    witnesses = _witnesses_from(head, ids, np.stack([prepared[j] for j in live]))
    check = check_witnesses(head, np.array(ids), torch.as_tensor(witnesses, device=head.device), exact_bound=True)
    norms = safe_norm(torch.as_tensor(witnesses), dim=1).numpy() if head.bias is None else None
    for i, j in enumerate(live):
        outcome, witness = outcomes[j], witnesses[i]
        outcome.checked = witness
        margin = float(check.margin[i])  # a lower bound of the exact margin at the witness
        if head.bias is None and not head.domain.bounded:  # per unit of ||z||, rounded down
            margin = per_unit_norm(margin, float(norms[i]), head.d) if norms[i] > 0 else -math.inf
        certified = bool(check.certified[i])
        if margin > outcome.margin or certified:
            outcome.margin, outcome.runner_up, outcome.witness = margin, int(check.runner_up[i]), witness
        if certified:
            outcome.verdict = "argmaxable"
        proved[j] = certified
    return proved


