"""Wolfe's minimum-norm-point method, fully corrective, for low-rank heads in R^d.

Token k cannot win in R^d exactly when the origin lies in

    conv{ l_i - l_k : i != k } + cone{ -e },      l_i = (w_i, lambda b_i)

(the bias coordinate is left out without a bias, and so is the ray -e): a convex combination
with sum alpha_i w_i = w_k and sum alpha_i b_i >= b_k. The point of that set nearest the
origin answers the question both ways: at distance zero its weights are the certificate, and
otherwise its negative y = (y_w, y_b) separates, so that l_i . y < l_k . y for every rival i,
which makes z = y_w / (lambda y_b) a witness (y_b > 0) or y_w a direction along which k wins
far out (y_b = 0; lp.best_scale finds where). lambda only balances the two parts; every
lambda > 0 gives the same answer.

Frank-Wolfe (bounded_dual.py, frank_wolfe.py) moves one row's weight at a time. Here each
round solves the nearest-point problem exactly on a pool of rows (non-negative least
squares, the "corral" of Wolfe's method), then prices every row at the negative of the
residual and adds the rows that would shorten it most; rows that lost their weight leave the
pool. On the crowded boundaries of low-rank heads (thousands of rows in tens of dimensions,
most of them vertices) a few rounds settle a token that Frank-Wolfe needs hundreds of
iterations for; in high dimensions a pool that surrounds w_k needs more than d rows and each
solve costs O(d^3), so the stage serves every token only on heads of at most WIDTH dimensions; wider
heads give it the few tokens Frank-Wolfe and Newton leave, which would otherwise take the exact LP.

Near a tie the nearest point is within a millionth of the rows' spread of the origin, and its float64
direction is uncertain by more than the lead it stands for: its face (the pool's rows of positive weight)
is then solved beyond float64 (exact/face.py) for directions to try, and the rows those directions show
beyond the face join the pool, which float64's pricing could not show.

Like every stage it only proposes: weights go through lp.polish and certify.check_convex,
witnesses through certify.check_witnesses (lp.try_witness). What it leaves undecided (a
token within rounding of a tie, a pool that stops improving) goes on to the next stages with
its last pool as the LP's seeds.
"""

from __future__ import annotations

import numpy as np
import scipy.optimize
import torch

from auditor.engine.arithmetic.head import EngineHead
from auditor.engine.exact.face import face_directions
from auditor.engine.exact.lp import LpOutcome, polish, try_witness, try_witnesses

WIDTH = 256  # heads of at most this many dimensions get the stage before Frank-Wolfe
LEFTOVERS = True  # wider heads get it after Newton, for the tokens the iterative stages leave (pipeline.py)
_ADD = 64  # rows priced into the pool each round
_SETTLED = 1e-9  # a residual below this fraction of the rows' spread: the weights are worth polishing
# a residual below this fraction of the rows' spread has a direction float64 leaves uncertain by more than the
# lead it stands for: its face is solved exactly (face.py) for the witness
_UNCERTAIN = 1e-6


def corrective_certificates(head: EngineHead, ids: np.ndarray, threat: np.ndarray,
                            rounds: int, add: int = _ADD, done=None) -> tuple[dict, dict, dict]:
    """Run the rounds for tokens ``ids`` (``threat``: each one's strongest rival from the screen).

    Returns (certificates, witnesses, pools): k -> (indices, weights, residual, bias_gap) for the
    tokens it proves unargmaxable, k -> LpOutcome for those it proves argmaxable, and k -> the
    last pool of rows for every token it leaves.

    The tokens go in blocks, in lockstep: each round solves every open token's pool on its own (the
    non-negative least squares, on the host), then prices all their residuals against the head in one
    product, where one product with one residual each would be as many passes over the head."""
    problem = _Lifted(head)
    certificates, witnesses, pools = {}, {}, {}
    pairs = list(zip(np.asarray(ids).tolist(), np.asarray(threat).tolist()))
    block = max(1, min(_BLOCK_TOKENS, _BLOCK_GAINS // max(head.n, 1)))
    for start in range(0, len(pairs), block):
        searches = [_Search(problem, k, t, add) for k, t in pairs[start:start + block]]
        _start(problem, searches)
        for _ in range(rounds):
            open_ = [search for search in searches if search.open]
            if not open_:
                break
            priced = [search for search in open_ if search.solve()]
            if priced:
                gains = problem.gains_of([search.y for search in priced], [search.k for search in priced])
                separated = [search for search, gain in zip(priced, gains) if search.advance(gain)]
                if separated:  # the block's separating directions, checked as witnesses in one product
                    proved = try_witnesses(head, [search.k for search in separated],
                                           [search.y[:head.d] for search in separated],
                                           [search.outcome for search in separated])
                    for search, won in zip(separated, proved):
                        search.separated(won)
        for search in searches:
            if search.verdict == "unargmaxable":
                certificates[search.k] = search.found
            elif search.verdict == "argmaxable":
                witnesses[search.k] = search.found
            else:
                pools[search.k] = search.pool
            if done is not None:
                done(search.k)
    return certificates, witnesses, pools


_BLOCK_TOKENS = 256  # tokens in lockstep
_BLOCK_GAINS = 1 << 22  # and their gains (float64) at most this many entries: 32 MiB (with a float32 head's
#                         product before it is widened, 48 MiB at its peak)


class _Lifted:
    """The head's rows as the points l_i = (w_i, lambda b_i), and pricing over all of them."""

    def __init__(self, head: EngineHead):
        self.head = head
        self.has_bias = head.bias is not None
        # rows all one point have no spread: any positive scale will do (the bias alone decides)
        spread = head.typical_spread or head.max_spread or 1.0
        # the bias coordinate at the rows' scale: neither part then dominates the residual's length
        self.scale = spread / head.max_abs_bias if self.has_bias and head.max_abs_bias > 0 else 1.0
        self.spread = spread
        self.bias = head.bias.cpu().numpy() if self.has_bias else None
        self.mask = head.row_mask.cpu().numpy() if head.row_mask is not None else None
        self.centre = head.centre.cpu().numpy()

    def points(self, ids: np.ndarray) -> np.ndarray:
        rows = self.head.rows(ids)
        if not self.has_bias:
            return rows
        return np.hstack([rows, self.scale * self.bias[ids][:, None]])

    def gains_of(self, ys: list[np.ndarray], ks: list[int]) -> np.ndarray:
        """l_i . y for every row and each y (one row of gains per y, the token's own and the rows that are not
        competitors at -inf): the rows with the largest gain shorten that token's residual most. One product
        with the head for all of them, in the storage's precision (pricing only steers)."""
        head = self.head
        d = head.d
        Y = np.stack(ys)
        gain = head.fast_logits(torch.as_tensor(Y[:, :d], device=head.device)).cpu().numpy()
        if self.has_bias:
            gain += (self.scale * Y[:, d])[:, None] * self.bias[None, :]
        if self.mask is not None:
            gain += self.mask[None, :]
        gain[np.arange(len(ks)), ks] = -np.inf
        return gain


def _start(problem: _Lifted, searches: list) -> None:
    """Every token's first pool: the rows of the largest gains at k's offset from the centre (the screen's
    direction), priced in one product, and the screen's strongest rival."""
    head = problem.head
    starts = []
    for search in searches:
        start = head.rows([search.k])[0] - problem.centre
        starts.append(np.concatenate([start, [0.0]]) if problem.has_bias else start)
    for search, gain in zip(searches, problem.gains_of(starts, [search.k for search in searches])):
        pool = _top(gain, search.add)
        if 0 <= search.threat != search.k and head.representative[search.threat] == search.threat:
            pool = np.union1d(pool, [search.threat])
        search.pool = pool


class _Search:
    """One token's rounds: its pool, and what it has found. ``solve`` runs the part of a round that is the
    token's own (the nearest point on its pool, the weights' polish, the exact face); ``advance`` the part
    after the block's pricing (the separation test, the pool's update)."""

    def __init__(self, problem: _Lifted, k: int, threat: int, add: int):
        self.problem, self.k, self.threat, self.add = problem, k, threat, add
        self.l_k = problem.points(np.array([k]))[0]
        self.pool = np.zeros(0, dtype=np.int64)
        self.outcome = LpOutcome()
        self.faces_tried = set()
        self.open = True
        self.verdict = None
        self.found = None
        self.y = None
        self.support = None
        self.rivals = None

    def _finish(self, verdict=None, found=None) -> bool:
        self.open, self.verdict, self.found = False, verdict, found
        return False

    def solve(self) -> bool:
        """The token's part of a round; True when its residual is to be priced (self.y)."""
        problem, head, k = self.problem, self.problem.head, self.k
        if self.pool.size == 0:
            return self._finish()
        Y = (problem.points(self.pool) - self.l_k).T  # (d or d + 1) x |pool|
        alpha, _, residual = _nearest(Y, problem.has_bias)
        if alpha is None:
            return self._finish()
        support = alpha > 0
        pool = self.pool
        if np.linalg.norm(residual) <= _SETTLED * problem.spread:
            indices, weights, check = polish(head, k, pool[support], alpha[support], first_accepted=True)
            if check.accepted:
                return self._finish("unargmaxable", (indices, weights, check.residual, check.bias_gap))
        self.rivals = np.zeros(0, dtype=np.int64)  # rows that beat the face's own witness
        if np.linalg.norm(residual) <= _UNCERTAIN * problem.spread:
            face = tuple(pool[support].tolist())
            if face not in self.faces_tried:
                self.faces_tried.add(face)
                for z in face_directions(head, k, pool[support]):
                    if try_witness(head, k, z, self.outcome):
                        return self._finish("argmaxable", self.outcome)
                    # the exact direction prices the rows that float64's could not: a row whose logit at its
                    # point is above every face row's lies beyond the face, and joins the pool
                    self.rivals = np.union1d(self.rivals, _beyond_face(problem, k, self.outcome.checked,
                                                                       pool[support], self.add))
        self.support, self.y = support, -residual
        return True

    def advance(self, gain: np.ndarray) -> bool:
        """The rest of the round, with the block's gains at y: True where y separates (the block then checks
        it as a witness and calls ``separated``), else the pool grown by the rows that most violate the
        separation (Wolfe's rule)."""
        pool, support = self.pool, self.support
        gain_k = float(self.l_k @ self.y)
        if np.max(gain) < gain_k:  # y separates l_k from every rival: a witness, or a direction to scale along
            # z = y_w / (lambda y_b) when y_b > 0, y_w itself when y_b = 0: either way the direction y_w, along
            # which try_witness finds the best scale
            return True
        gain[pool] = -np.inf
        self._grow(np.union1d(_top(gain, self.add, above=gain_k), np.setdiff1d(self.rivals, pool[support])))
        return False

    def separated(self, won: bool) -> None:
        """After the witness check of a separating y: argmaxable, or (separated only up to rounding) the pool
        grown by the rows an exact face showed beyond it, if any."""
        if won:
            self._finish("argmaxable", self.outcome)
            return
        self._grow(np.setdiff1d(self.rivals, self.pool[self.support]))  # nothing priced above y: none from gains

    def _grow(self, fresh: np.ndarray) -> None:
        if fresh.size == 0:
            self._finish()  # no row can shorten the residual: the next stages decide it
            return
        self.pool = np.union1d(self.pool[self.support], fresh)


def _beyond_face(problem: _Lifted, k: int, point: np.ndarray | None, face: np.ndarray, count: int) -> np.ndarray:
    """Up to ``count`` rows whose logit at ``point`` is above every face row's (in float64: at an exact face's
    point the face's rows all trail k by one amount, and a row that comes closer to k, or beats it, is one the
    nearest point has yet to take in)."""
    if point is None:
        return np.zeros(0, dtype=np.int64)
    head = problem.head
    logits = head.logits(torch.as_tensor(point, device=head.device)[None, :])[0].cpu().numpy()
    if problem.has_bias:
        logits = logits + problem.bias
    if problem.mask is not None:
        logits = logits + problem.mask
    logits[k] = -np.inf
    return _top(logits, count, above=float(np.max(logits[face])))


def _top(gain: np.ndarray, count: int, above: float = -np.inf) -> np.ndarray:
    """Up to ``count`` rows of the largest finite gains above ``above``, sorted by id."""
    finite = np.isfinite(gain) & (gain > above)
    candidates = np.flatnonzero(finite)
    if candidates.size > count:
        candidates = candidates[np.argpartition(-gain[candidates], count - 1)[:count]]
    return np.sort(candidates)


def _nearest(Y: np.ndarray, ray: bool):
    """The point of conv(columns of Y) (+ cone{-e_last} when ``ray``) nearest the origin.

    min ||Y b - g e||^2 + (s (sum b - 1))^2 over b, g >= 0 has b = t alpha for the nearest point's
    weights alpha (t > 0), so one non-negative least squares gives them; s, the rows' scale, keeps
    the sum's equation as stiff as the others. Returns (alpha, g / t, residual Y alpha - (g / t) e),
    or (None, None, None) when the solve fails."""
    dims, m = Y.shape
    scale = float(np.abs(Y).max()) or 1.0
    columns = [Y]
    if ray:
        down = np.zeros((dims, 1))
        down[-1, 0] = -scale
        columns.append(down)
    system = np.vstack([np.hstack(columns), np.append(np.full(m, scale), [0.0] if ray else [])[None, :]])
    target = np.append(np.zeros(dims), scale)
    try:
        beta = scipy.optimize.nnls(system, target, maxiter=50 * system.shape[1])[0]
    except (RuntimeError, ValueError):  # the iteration limit, or a non-finite entry: left to the next stages
        return None, None, None
    total = beta[:m].sum()
    if not total > 0:
        return None, None, None
    alpha = beta[:m] / total
    lowered = beta[m] * scale / total if ray else 0.0
    residual = Y @ alpha
    if ray:
        residual[-1] -= lowered
    return alpha, lowered, residual
