"""The LP stage: the exact cross-check, a margin program solved with constraint generation.

For token k and a set A of rival rows it solves

    maximise t  subject to  (w_k - w_i).z + (b_k - b_i) s >= t  for i in A,  z in D',

with HiGHS (a linear program; called directly, warm between rounds) or Clarabel (a
second-order cone for the ball). D' is the domain itself when it is bounded (s = 1).
In the unbounded domain the question is homogeneous: z ranges over the box [-1, 1]^d
and the bias enters through s in [0, 1], so that a strict win at (z, s) with s > 0
gives the witness z / s and one with s = 0 gives a winning direction to scale up
(the best scale along it is found exactly: best_scale).

The optimum over A bounds the optimum over all rows from above. If it is not
positive, the dual multipliers of the rival constraints are convex weights
over A (their sum is 1 because t is free), and they certify k over the whole
vocabulary. If it is positive, the optimal z is checked against every row; the
rows it loses to join A and the program is solved again: a few small programs
usually cost far less than one over all rows (the spec gives the measurements).

Constraint generation can stall on crowded boundaries, where each round finds a few
new rivals and the program grows slowly. So a token gets at most ``rounds`` rounds,
and fewer once its rivals are a quarter of the head; then every row is added to the
program at once, which makes its next solve the plain LP over all rows, started from
the basis the rounds reached. The stage therefore decides every token the plain LP
decides, up to the float64 checks that every answer goes through.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
import scipy.optimize
import torch

from auditor._io import quiet_stdout
from auditor.engine.certify import EXACT_GAP_ROWS, check_convex, check_witnesses
from auditor.engine.head import EngineHead
from auditor.engine.rounding import per_unit_norm, safe_norm


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
        self._highs = self._new_highs() if head.domain.polyhedral else None

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
        lower = [-reach] * d + ([0.0] if self.homogeneous_bias else []) + [-inf]
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
    return float(found.x)


def _witness_from(head: EngineHead, k: int, z: np.ndarray) -> np.ndarray:
    """Turn the program's (z, s) into a point of the domain with the best scale along z."""
    if head.bias is None:
        if head.domain.bounded:
            return z * head.domain.largest_scale(z)
        return z
    zt = torch.as_tensor(z, device=head.device)
    logits = head.logits(zt[None, :])[0]
    if head.row_mask is not None:
        logits = logits + head.row_mask
    slopes = (logits[k] - logits).cpu().numpy()
    intercepts = (head.bias[k] - head.bias).cpu().numpy()
    keep = np.isfinite(slopes)
    keep[k] = False
    scale = best_scale(slopes[keep], intercepts[keep], head.domain.largest_scale(z))
    return z * scale


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
    if not best[2].accepted and best[1].size <= EXACT_GAP_ROWS:
        # A value zero only in exact arithmetic (a row exactly between others, its bias exactly between
        # theirs) needs the exact weights, which a solve gives only up to rounding: they are usually
        # fractions with small denominators, which float64 weights represent after normalisation when
        # the denominators are powers of two or the weights are equal.
        snapped = _snapped(best[1])
        if snapped is not None:
            check = check_convex(head, k, best[0], snapped)
            if check.accepted:
                return best[0], snapped, check
    return best


_AFFINE_ROWS = 2  # supports up to this many times d + 1 rows get the affine solve
_LARGE_SUPPORT = 2  # supports beyond this many times d + 2 rows take the first accepted candidate


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


def _try_witness(head: EngineHead, k: int, z: np.ndarray, outcome: LpOutcome) -> bool:
    """Check z (scaled along itself to its best point in the domain) as a witness; keep the best margin."""
    if not np.all(np.isfinite(z)) or (not np.any(z) and head.bias is None):
        return False
    if np.any(z):
        z = z / np.abs(z).max()  # a direction of unit peak: tiny directions would underflow in the products
    witness = _witness_from(head, k, z)
    check = check_witnesses(head, np.array([k]), torch.as_tensor(witness[None, :], device=head.device), exact_bound=True)
    margin = float(check.margin[0])  # a lower bound of the exact margin at the witness
    if head.bias is None and not head.domain.bounded:  # per unit of ||z||, rounded down
        norm = float(safe_norm(torch.as_tensor(witness)[None, :], dim=1)[0])
        margin = per_unit_norm(margin, norm, head.d) if norm > 0 else -math.inf
    if margin > outcome.margin or check.certified[0]:
        outcome.margin, outcome.runner_up, outcome.witness = margin, int(check.runner_up[0]), witness
    if check.certified[0]:
        outcome.verdict = "argmaxable"
    return bool(check.certified[0])


_EXACT_ROWS = 16  # supports up to which the residual is formed exactly
_EXACT_ENTRIES = 1 << 12  # and their rows' entries
_EXACT_BELOW = 1e-6  # residuals shorter than this fraction of the rows' entries: their direction is uncertain


def _residual(head: EngineHead, k: int, indices: np.ndarray, weights: np.ndarray, w_k: np.ndarray) -> np.ndarray:
    """The normal of the nearest face found, w_k - sum_i alpha_i w_i, as a direction to try as a witness.

    At a token that leads by a few times the tolerance this residual is ~1e-10 of the rows, and weights
    and sums in float64 leave its direction uncertain by ~1e-6: more than the lead. On a small support of
    affinely independent rows it is w_k minus its projection onto their affine hull, solved in rational
    arithmetic (from the rows as given when the normal form rounded them: the translation moves no
    difference of rows), so the one rounding left is the final one."""
    rows64 = head.rows(indices)
    approximate = w_k - weights @ rows64
    support = indices[weights > 0]
    small = float(np.linalg.norm(approximate)) <= _EXACT_BELOW * float(np.abs(rows64).max(initial=np.abs(w_k).max()))
    if not small or not 0 < support.size <= min(_EXACT_ROWS, head.d) or support.size * head.d > _EXACT_ENTRIES:
        return approximate  # a residual this long has a direction float64 gets right, or too many rows
    from fractions import Fraction

    if head.exact_source is not None:
        rows = head.exact_source[0]
        picked = rows.index_select(0, torch.as_tensor(np.append(support, k), device=rows.device)).to(torch.float64)
    else:  # the head's own rows, exact in float64 (the stored rows times their power of two)
        picked = head.rows64(np.append(support, k))
    exact = [[Fraction(float(v)) for v in row] for row in picked.cpu().numpy()]
    target = exact[-1]
    offsets = [[v - t for v, t in zip(row, target)] for row in exact[:-1]]  # w_i - w_k
    # the least ||sum beta_i (w_i - w_k)|| with sum beta_i = 1: [G 1; 1^T 0] [beta; mu] = [0; 1]
    m = len(offsets)
    system = [[sum(a * b for a, b in zip(offsets[i], offsets[j])) for j in range(m)] + [Fraction(1), Fraction(0)]
              for i in range(m)]
    system.append([Fraction(1)] * m + [Fraction(0), Fraction(1)])
    beta = _solve_exactly(system)
    if beta is None:  # affinely dependent rows
        return approximate
    return np.array([float(-sum(b * row[j] for b, row in zip(beta[:m], offsets))) for j in range(head.d)])


def _solve_exactly(augmented: list) -> list | None:
    """Gauss-Jordan elimination in rational arithmetic on an augmented square system; None when singular."""
    size = len(augmented)
    for col in range(size):
        pivot = next((r for r in range(col, size) if augmented[r][col] != 0), None)
        if pivot is None:
            return None
        augmented[col], augmented[pivot] = augmented[pivot], augmented[col]
        lead = augmented[col][col]
        augmented[col] = [v / lead for v in augmented[col]]
        for r in range(size):
            if r != col and augmented[r][col] != 0:
                factor = augmented[r][col]
                augmented[r] = [a - factor * b for a, b in zip(augmented[r], augmented[col])]
    return [row[-1] for row in augmented]


@dataclass
class LpSearch:
    """One token's constraint generation: its program, the rivals so far and the best found."""

    k: int
    program: MarginProgram
    add: int  # rivals added per round
    outcome: LpOutcome
    rounds: int = 0  # rounds run so far
    open: bool = True  # False once decided, or once no round can change the answer (no new rival, solver failure)
    complete: bool = False  # the program holds every competitor: it is the plain LP over all rows

    @property
    def rivals(self) -> np.ndarray:
        return self.program.rivals


def start_search(head: EngineHead, k: int, seed_rivals: np.ndarray, add_per_round: int | None = None) -> LpSearch:
    """Token k's search, its first rivals from ``seed_rivals`` (the most threatening rows when there are none)."""
    add = add_per_round or max(32, head.d // 2)
    rivals = np.unique(seed_rivals[(seed_rivals != k) & (seed_rivals >= 0)])
    rivals = rivals[head.representative[rivals] == rivals]
    if rivals.size == 0:
        rivals = _top_rivals(head, k, head.rows([k])[0] - head.centre.cpu().numpy(), set(), add)
    program = MarginProgram(head, k)
    program.add(rivals)
    return LpSearch(k, program, add, LpOutcome())


def _every_rival(head: EngineHead, k: int) -> np.ndarray:
    competitors = np.flatnonzero(head.competitor.cpu().numpy())
    return competitors[competitors != k]


def run_rounds(head: EngineHead, search: LpSearch, rounds: int) -> int:
    """Run up to ``rounds`` rounds of token k's constraint generation; returns the rounds used."""
    k, outcome = search.k, search.outcome
    w_k = search.program.w_k
    used = 0
    while used < rounds and search.open:
        used += 1
        search.rounds += 1
        solved = search.program.solve()
        if solved is None:
            search.open = False
            break
        t, z, s, alpha = solved
        if head.bias is not None and not head.domain.bounded and s > 0:
            z = z / s
        # z is the program's point; with s = 0 (or nearly) it is a direction along which k wins far out,
        # and _try_witness finds the scale along it where the lead is largest
        if _try_witness(head, k, z, outcome):
            search.open = False
            break
        # The duals certify k only when the optimum over the rivals is (about) zero or below; well above
        # it they are no certificate, and the rivals that beat z are what the next round needs.
        if alpha.sum() > 0 and t <= _CLOSE * max(head.typical_spread, np.finfo(np.float64).tiny):
            indices, weights, convex = polish(head, k, search.rivals, alpha)
            if convex.accepted or convex.residual < outcome.residual:
                outcome.indices, outcome.weights = indices, weights
                outcome.residual, outcome.bias_gap = convex.residual, convex.bias_gap
            if convex.accepted:
                outcome.verdict = "unargmaxable"
                search.open = False
                break
            # The polished weights' residual w_k - sum alpha_i w_i is the normal of the nearest
            # face found so far: an exact direction where the solver's z is only accurate to its tolerance.
            if _try_witness(head, k, _residual(head, k, indices, weights, w_k), outcome):
                search.open = False
                break
        if search.complete:  # the plain LP over all rows has answered: nothing is left to add
            search.open = False
            break
        new = _top_rivals(head, k, z, set(search.rivals.tolist()), search.add)
        if new.size == 0:  # the program already holds every row that beats its optimum: no round can add one
            search.open = False
            break
        search.program.add(new)
    return used


def complete(head: EngineHead, search: LpSearch) -> None:
    """Add every competitor row to the token's program (warm: the basis of the rounds so far stays), so
    that its next solve is the plain LP over all rows."""
    search.program.add(_every_rival(head, search.k))
    search.complete = True
    search.open = search.outcome.verdict is None


def lp_decide(head: EngineHead, k: int, seed_rivals: np.ndarray, max_rounds: int = 30,
              add_per_round: int | None = None) -> LpOutcome:
    """Decide token k: at most ``max_rounds`` rounds of constraint generation from ``seed_rivals``, then,
    when they have not decided it, the program over all rows."""
    search = start_search(head, k, seed_rivals, add_per_round)
    run_rounds(head, search, max_rounds)
    if search.outcome.verdict is None and max_rounds > 0:
        complete(head, search)
        run_rounds(head, search, 1)
    return search.outcome


def lp_decide_all(head: EngineHead, tokens: list[int], seeds: dict[int, np.ndarray], rounds: int,
                  done=None) -> dict[int, LpOutcome]:
    """Decide ``tokens`` one after another (``lp_decide``); ``done(k)`` is called as each token leaves.

    Constraint generation stops after ``rounds`` rounds, or sooner once its rivals are a quarter
    of the head (``_LARGEST_SHARE``: the rounds would then cost more than the plain LP); a token still
    open then gets the program over all rows, started from the basis its rounds reached. So the
    stage decides every token the plain LP decides (up to the float64 checks), at a bounded
    multiple of its cost. ``rounds`` = 0 skips the stage."""
    outcomes = {}
    for k in tokens:
        if rounds <= 0:
            outcomes[k] = LpOutcome()
        else:
            search = start_search(head, k, seeds[k])
            while search.open and search.rounds < rounds and search.rivals.size < _LARGEST_SHARE * head.n_competitors:
                run_rounds(head, search, 1)
            if search.outcome.verdict is None and not search.complete:  # stalled, stopped or failed
                complete(head, search)
                run_rounds(head, search, 1)
            outcomes[k] = search.outcome
            search.program = None  # the solver's memory goes with it
        if done is not None:
            done(k)
    return outcomes


_LARGEST_SHARE = 0.25
_CLOSE = 1e-6  # optima below this fraction of the rows' typical spread get their duals polished  # constraint generation stops when its rivals reach this share of the head


def _top_rivals(head: EngineHead, k: int, z: np.ndarray, exclude: set, count: int) -> np.ndarray:
    """The ``count`` rows with the largest logits at z, among competitors not in ``exclude``."""
    logits = head.logits(torch.as_tensor(z, device=head.device)[None, :])[0]
    if head.bias is not None:
        logits = logits + head.bias
    if head.row_mask is not None:
        logits = logits + head.row_mask
    logits[k] = -torch.inf
    if exclude:
        logits[torch.as_tensor(sorted(exclude), device=head.device)] = -torch.inf
    top = torch.topk(logits, min(count, head.n)).indices
    top = top[torch.isfinite(logits[top])]
    return np.sort(top.cpu().numpy())
