"""The LP stage: the exact cross-check, a margin program solved by cvxpy with constraint generation.

For token k and a set A of rival rows it solves

    maximise t  subject to  (w_k - w_i).z + (b_k - b_i) s >= t  for i in A,  z in D',

with HiGHS (a linear program) or Clarabel (a second-order cone for the ball).
D' is the domain itself when it is bounded (s = 1). In the unbounded domain
the question is homogeneous: z ranges over the box [-1, 1]^d and the bias
enters through s in [0, 1], so that a strict win at (z, s) with s > 0 gives the
witness z / s and one with s = 0 gives a winning direction to scale up.

The optimum over A bounds the optimum over all rows from above. If it is not
positive, the dual multipliers of the rival constraints are convex weights
over A (their sum is 1 because t is free), and they certify k over the whole
vocabulary. If it is positive, the optimal z is checked against every row; the
rows it loses to join A and the program is solved again: a few small programs
cost far less than one over all rows (the spec gives the measurements).

The rounds are one budget for all the tokens left (``lp_decide_all``): how many a
token needs depends on how far its first rivals are from the rows that decide it,
so the rounds quick tokens leave go to the slow ones while they still find new rivals.
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


def _solve(head: EngineHead, k: int, rivals: np.ndarray):
    """Solve the margin program over ``rivals``; return (t, z, s, alpha) or None on solver failure."""
    import cvxpy as cp  # imported here: it takes a second, and most audits never reach this stage

    w_k = head.rows([k])[0]
    A = w_k[None, :] - head.rows(rivals)
    c = head.biases([k])[0] - head.biases(rivals) if head.bias is not None else None
    z, t = cp.Variable(head.d), cp.Variable()
    domain = head.domain
    s = None
    if not domain.bounded:
        constraints = [z <= 1, z >= -1]
        if c is not None:
            s = cp.Variable()
            constraints += [s >= 0, s <= 1]
            rival = A @ z + c * s - t >= 0
        else:
            rival = A @ z - t >= 0
    else:
        rival = A @ z + (c if c is not None else 0.0) - t >= 0
        constraints = domain.constraints(z)
    problem = cp.Problem(cp.Maximize(t), [rival] + constraints)
    # Tight tolerances: near-boundary tokens have margins far below the solvers' defaults.
    if domain.polyhedral:
        options = {"solver": cp.HIGHS, "primal_feasibility_tolerance": 1e-10, "dual_feasibility_tolerance": 1e-10}
    else:
        options = {"solver": cp.CLARABEL, "tol_feas": 1e-11, "tol_gap_abs": 1e-11, "tol_gap_rel": 1e-11}
    try:
        with warnings.catch_warnings(), quiet_stdout():  # HiGHS prints a banner to stdout, the report's stream
            warnings.simplefilter("ignore")  # "may be inaccurate": every answer is checked in float64 anyway
            problem.solve(**options)
    except (cp.error.SolverError, ValueError, ArithmeticError):
        return None
    if problem.status not in (cp.OPTIMAL, cp.OPTIMAL_INACCURATE) or z.value is None or rival.dual_value is None:
        return None
    alpha = np.clip(np.asarray(rival.dual_value, dtype=np.float64).ravel(), 0.0, None)
    return float(t.value), np.asarray(z.value, dtype=np.float64), (float(s.value) if s is not None else 1.0), alpha


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


def polish(head: EngineHead, k: int, indices: np.ndarray, weights: np.ndarray):
    """Sharpen approximate convex weights into an exact combination on their support.

    Tries the weights as given, the affine solve on their support, and the
    non-negative least-squares solution on it; returns the accepted candidate
    with the smallest residual as (indices, weights, check), or the best
    rejected one.
    """
    keep = weights > weights.max() * 1e-12
    support = indices[keep]
    candidates = [(support, weights[keep] / weights[keep].sum())]
    rows = head.rows(support)
    w_k = head.rows([k])[0]
    Y = (rows - w_k).T  # d x |S|
    scale = max(float(np.abs(Y).max()), np.finfo(np.float64).tiny)
    system = np.vstack([Y, np.full((1, support.size), scale)])
    target = np.concatenate([np.zeros(head.d), [scale]])
    affine = np.linalg.lstsq(system, target, rcond=None)[0]
    if np.all(affine >= 0) and affine.sum() > 0:
        candidates.append((support, affine / affine.sum()))
    # min ||Y b||^2 + (sum b - 1)^2 over b >= 0 has b* = t alpha* for the min-norm weights alpha*.
    beta = scipy.optimize.nnls(system, target, maxiter=50 * max(support.size, 10))[0]
    if beta.sum() > 0:
        candidates.append((support, beta / beta.sum()))
    # A vertex of {alpha >= 0 : sum alpha_i w_i = w_k, sum alpha = 1} with the largest sum alpha_i b_i,
    # re-solved exactly on its (at most d + 1 rows) basis: sparse, and it keeps the bias gap negative.
    vertex = scipy.optimize.linprog(-head.biases(support), A_eq=system, b_eq=target, bounds=(0, None), method="highs")
    if vertex.status == 0:
        basis = vertex.x > vertex.x.max() * 1e-12
        exact = np.linalg.lstsq(system[:, basis], target, rcond=None)[0]
        if np.all(exact >= 0) and exact.sum() > 0:
            candidates.append((support[basis], exact / exact.sum()))
    best = None
    for idx, w in candidates:
        nz = w > 0
        check = check_convex(head, k, idx[nz], w[nz])
        key = (not check.accepted, check.residual)
        if best is None or key < best[0]:
            best = (key, idx[nz], w[nz], check)
    if not best[3].accepted and best[2].size <= EXACT_GAP_ROWS:
        # A value zero only in exact arithmetic (a row exactly between others, its bias exactly between
        # theirs) needs the exact weights, which a solve gives only up to rounding: they are usually
        # fractions with small denominators, which float64 weights represent after normalisation when
        # the denominators are powers of two or the weights are equal.
        snapped = _snapped(best[2])
        if snapped is not None:
            check = check_convex(head, k, best[1], snapped)
            if check.accepted:
                return best[1], snapped, check
    return best[1], best[2], best[3]


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

    rows = head.exact_source[0] if head.exact_source is not None else head.weight
    picked = rows.index_select(0, torch.as_tensor(np.append(support, k), device=rows.device)).to(torch.float64)
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
    """One token's constraint generation, resumable: the rivals so far and the best found."""

    k: int
    rivals: np.ndarray
    add: int  # rivals added per round
    outcome: LpOutcome
    rounds: int = 0  # rounds run so far
    open: bool = True  # False once decided, or once no round can change the answer (no new rival, solver failure)


def start_search(head: EngineHead, k: int, seed_rivals: np.ndarray, add_per_round: int | None = None) -> LpSearch:
    """Token k's search, its first rivals from ``seed_rivals`` (the most threatening rows when there are none)."""
    add = add_per_round or max(32, head.d // 2)
    rivals = np.unique(seed_rivals[(seed_rivals != k) & (seed_rivals >= 0)])
    rivals = rivals[head.representative[rivals] == rivals]
    if rivals.size == 0:
        rivals = _top_rivals(head, k, head.rows([k])[0] - head.centre.cpu().numpy(), set(), add)
    return LpSearch(k, rivals, add, LpOutcome())


def rounds_to_exhaust(head: EngineHead, search: LpSearch) -> int:
    """Rounds after which the rivals are every competitor, so the program is the exact one over all rows."""
    return -(-max(head.n_competitors - 1 - search.rivals.size, 0) // search.add) + 1


def run_rounds(head: EngineHead, search: LpSearch, rounds: int) -> int:
    """Run up to ``rounds`` rounds of token k's constraint generation; returns the rounds used."""
    k, outcome = search.k, search.outcome
    w_k = head.rows([k])[0]
    used = 0
    while used < rounds and search.open:
        used += 1
        search.rounds += 1
        solved = _solve(head, k, search.rivals)
        if solved is None:
            search.open = False
            break
        t, z, s, alpha = solved
        if head.bias is not None and not head.domain.bounded and s > 0:
            z = z / s
        if _try_witness(head, k, z, outcome):
            search.open = False
            break
        if alpha.sum() > 0:
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
        new = _top_rivals(head, k, z, set(search.rivals.tolist()), search.add)
        if new.size == 0:  # the program already holds every row that beats its optimum: no round can add one
            search.open = False
            break
        search.rivals = np.union1d(search.rivals, new)
    return used


def lp_decide(head: EngineHead, k: int, seed_rivals: np.ndarray, max_rounds: int = 30,
              add_per_round: int | None = None) -> LpOutcome:
    """Decide token k by constraint generation, starting from ``seed_rivals``, in at most ``max_rounds`` rounds."""
    search = start_search(head, k, seed_rivals, add_per_round)
    run_rounds(head, search, max_rounds)
    return search.outcome


def lp_decide_all(head: EngineHead, tokens: list[int], seeds: dict[int, np.ndarray], rounds: int,
                  done=None) -> dict[int, LpOutcome]:
    """Decide ``tokens`` by constraint generation under one budget of rounds that adapts to what is left.

    Each token first gets ``rounds`` rounds. The rounds a token leaves unused when it
    is decided early, together with a reserve of ``_SPARE_TOKENS`` tokens' worth, form
    a pool, shared evenly among the tokens still converging (their last round found new
    rivals). No token gets more than it needs to hold every row, nor more than
    ``_MOST_ALLOWANCES`` times ``rounds`` in all (each round's program grows with its
    rivals). So a few slow tokens get many rounds, many slow tokens keep the first
    allowance, and the stage runs at most ``rounds`` (len(tokens) + ``_SPARE_TOKENS``)
    rounds. ``done(k)`` is called as each token leaves the stage.
    """
    searches = {k: start_search(head, k, seeds[k]) for k in tokens}
    pool = rounds * _SPARE_TOKENS if rounds > 0 else 0
    most = rounds * _MOST_ALLOWANCES

    def room(search: LpSearch) -> int:
        return min(pool, most - search.rounds, rounds_to_exhaust(head, search)) if search.open else 0

    for search in searches.values():
        pool += rounds - run_rounds(head, search, rounds)
    waiting = list(searches.values())
    while True:
        leaving = [search.k for search in waiting if room(search) == 0]
        waiting = [search for search in waiting if room(search) > 0]
        for k in leaving:
            if done is not None:
                done(k)
        if not waiting:
            break
        share = max(1, pool // len(waiting))
        for search in waiting:
            pool -= run_rounds(head, search, min(share, room(search)))
    return {k: search.outcome for k, search in searches.items()}


_SPARE_TOKENS = 4  # the pool beyond the first allowances, in tokens' worth of rounds
_MOST_ALLOWANCES = 8  # the most rounds one token gets, in first allowances


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
