"""Witness directions from a face, with the residual formed exactly: for tokens that lead by a few tolerances.

Near a tie the point of the rivals' hull nearest w_k lies about 1e-10 of the rows' spread from it. A float64
search finds that point's face (its support) reliably, but not the point itself: weights accurate to
rounding leave the residual w_k - sum alpha_i w_i uncertain by about 1e-16 of the rows, which is 1e-6 of
the residual's own length, while the witness along it must get every rival's logit right to a few times
the tolerance. On the face's rows the affine problem is small, so it is solved here to far beyond float64:

- r = w_k - p, p the projection of w_k onto the affine hull of the face's rows: the direction along which
  w_k leads all of them equally, by |r|^2 per unit of |r| (the nearest point's direction when the face is
  the right one; without a bias, and with one far out);
- with a bias, z_e, the shortest point at which the face's rows have equal logits (z_e in the span of their
  differences, so r . z_e = 0), and the gap g = b_k - sum beta_i b_i of the affine weights beta of p. At
  z_e + s r token k leads every row of the face by g + s |r|^2, at the norm sqrt(|z_e|^2 + s^2 |r|^2); for
  g > 0 the ratio of the two is largest, sqrt(g^2 / |z_e|^2 + |r|^2), at s = |z_e|^2 / g.

The numbers are the rows as given (``exact_source``, when the normal form rounded them: a translation
moves no difference of rows, and the direction of z_e + s r is the same in the units given and in the
normal form's, where both parts scale alike), put on one integer grid per quantity (rows, bias) 2^-64 of
the largest entry apart, so that the residual of any weights held exactly is formed exactly in integers;
the weights are refined against it (_solve_face). The grid rounds only entries far smaller than the
largest, and z_e is a float64 solve (it is not small, and its rounding moves the face's logits by about
1e-16 of them, not of the lead); the answer is a candidate either way: lp.try_witness scales it and
certify.check_witnesses decides it in float64.

The face is first reduced to affinely independent rows (a pivoted QR of their differences, cut far above
float64's rounding): rows that span a subspace only up to rounding (a low-rank head written in float64)
would otherwise span everything exactly, and leave no residual.
"""

from __future__ import annotations

import math

import numpy as np
import scipy.linalg
import torch

from auditor.engine.arithmetic.head import EngineHead

FACE_ENTRIES = 1 << 16  # faces whose rows hold at most this many entries are solved (each refinement forms r
#                        exactly, in O(m d) operations on integers of a few words)
_REFINEMENTS = 3  # float64 corrections of the weights, each against the exact residual of the ones before
_SUPPORT_ENTRIES = 16 * FACE_ENTRIES  # supports (before the reduction to independent rows) of at most this many entries
_DEPENDENT = 1e-12  # a row whose difference from the others' span is below this fraction of the largest: dependent
_GRID_BITS = 64  # the integer grid: 2^-64 of the largest entry


def face_directions(head: EngineHead, k: int, support: np.ndarray) -> list[np.ndarray]:
    """Directions to try as witnesses for token k from the face on rows ``support`` (float64, in the normal
    form's coordinates, each of unit peak): r, and with a bias z_e + s r where g > 0. Empty when the face gives
    none (r = 0 and no positive gap, a singular system, or a face too large)."""
    support = np.unique(np.asarray(support, dtype=np.int64))
    support = support[support != k]
    if support.size == 0 or support.size * head.d > _SUPPORT_ENTRIES:  # the QR below would cost more than it can save
        return []
    rows, bias = _given(head, np.append(support, k))
    w_k, rows = rows[-1], rows[:-1]
    b_k, bias = (bias[-1], bias[:-1]) if bias is not None else (None, None)
    face = _independent(rows)
    if face.size * rows.shape[1] > FACE_ENTRIES:
        return []
    rows = rows[face]
    bias = bias[face] if bias is not None else None
    solved = _solve_face(rows, w_k, bias, b_k)
    if solved is None:
        return []
    r, z_e, gap = solved
    found = []
    if r is not None:
        found.append(r)
    if z_e is not None and gap > 0:  # z_e + s r at s = |z_e|^2 / g, the best ratio of lead to norm on the face
        found.append(z_e if r is None else z_e + (math.fsum(z_e ** 2) / gap) * r)
    return [v / np.abs(v).max() for v in found if np.all(np.isfinite(v)) and np.any(v)]


def _given(head: EngineHead, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """float64 rows and biases of ``ids``: the caller's exact numbers where the normal form rounded them."""
    if head.exact_source is not None:
        weight, given_bias = head.exact_source[0], head.exact_source[1]
        index = torch.as_tensor(ids, device=weight.device)
        rows = weight.index_select(0, index).to(torch.float64).cpu().numpy()
        if head.bias is None:
            return rows, None
        if given_bias is not None:
            return rows, given_bias.index_select(0, index.to(given_bias.device)).to(torch.float64).cpu().numpy()
    else:
        rows = head.rows(ids)
    return rows, None if head.bias is None else head.bias[torch.as_tensor(ids, device=head.bias.device)].cpu().numpy()


def _independent(rows: np.ndarray) -> np.ndarray:
    """Indices of affinely independent rows spanning the others' affine hull up to _DEPENDENT of their size."""
    if rows.shape[0] == 1:
        return np.array([0])
    differences = (rows[1:] - rows[0]).T  # d x (m - 1)
    if not np.any(differences):
        return np.array([0])
    _, R, order = scipy.linalg.qr(differences, mode="economic", pivoting=True)
    diagonal = np.abs(np.diag(R))
    rank = int(np.count_nonzero(diagonal > _DEPENDENT * diagonal[0]))
    return np.concatenate([[0], 1 + np.sort(order[:rank])])


def _grid(values: np.ndarray) -> tuple[list[int], int]:
    """Integers n_i and an exponent e with values_i = n_i 2^e (up to 2^-64 of the largest |value|)."""
    largest = float(np.abs(values).max(initial=0.0))
    if largest == 0.0:
        return [0] * values.size, 0
    e = math.frexp(largest)[1] - _GRID_BITS
    return [round(math.ldexp(float(v), -e)) for v in values.ravel()], e


def _solve_face(rows: np.ndarray, w_k: np.ndarray, bias: np.ndarray | None, b_k):
    """(r, z_e, g) on affinely independent rows, each in the units of the grid (r as the rows', g as the
    bias', z_e as the bias' over the rows'): r and z_e float64 (None where zero), g a float (0 without a bias).
    Only the directions of r and of z_e + (|z_e|^2 / g) r are used, and the grid's powers of two scale both
    parts of the latter alike, so they are left out.

    The affine weights gamma of the projection (w_k - w_0 = sum_j gamma_j (w_j - w_0) + r, r orthogonal to
    every w_j - w_0) are refined: each step forms r for the current gamma exactly (integers), and corrects
    gamma by the float64 least-squares fit of that r's rounding. gamma is kept exact (a sum of float64
    numbers), so each step shrinks the part of r inside the face's span by about the condition number
    times float64's unit roundoff, where one float64 solve would leave it at that roundoff times the rows."""
    m, d = rows.shape
    numbers, _ = _grid(np.concatenate([rows.ravel(), w_k]))
    base = numbers[:d]
    D = [[numbers[i * d + c] - base[c] for c in range(d)] for i in range(1, m)]  # w_j - w_0, j >= 1
    t = [numbers[m * d + c] - base[c] for c in range(d)]  # w_k - w_0
    bias_ints = _grid(np.append(bias, b_k))[0] if bias is not None else None
    if m == 1:  # one row: r = w_k - w_0, and a single row's logit needs no point to equal itself
        gap = float(bias_ints[1] - bias_ints[0]) if bias is not None else 0.0
        return (np.array(t, dtype=np.float64) if any(t) else None), None, gap
    Q, R = np.linalg.qr(np.array(D, dtype=np.float64).T)  # D^T = Q R, d x (m - 1); R non-singular (independent rows)
    if not np.all(np.abs(np.diag(R)) > 0):
        return None
    gamma, shift = [0] * (m - 1), 0  # gamma_j = gamma[j] 2^-shift, exactly

    def residual() -> np.ndarray | None:
        # r = t - sum_j gamma_j D_j, exactly: 2^shift r in integers, then each entry rounded once
        return _quotients([(t[c] << shift) - sum(g * D[j][c] for j, g in enumerate(gamma)) for c in range(d)],
                          1 << shift)

    r = residual()
    for _ in range(_REFINEMENTS):
        if r is None:
            break
        step = scipy.linalg.solve_triangular(R, Q.T @ r)  # the least-squares fit of r by the D_j
        if not np.all(np.isfinite(step)) or not np.any(step):
            break
        gamma, shift = _add_exactly(gamma, shift, step)
        r = residual()
    if bias is None:
        return r, None, 0.0
    b_rhs = np.array([float(bias_ints[0] - v) for v in bias_ints[1:m]])  # b_0 - b_j: the face's logits equal at z_e
    z_e = Q @ scipy.linalg.solve_triangular(R, b_rhs, trans="T")  # D z = b_rhs with z in the span of the D_j
    # g = b_k - b_0 + sum_j gamma_j (b_0 - b_j), exactly, then rounded once
    gap_scaled = ((bias_ints[m] - bias_ints[0]) << shift) + sum(g * (bias_ints[0] - v)
                                                               for g, v in zip(gamma, bias_ints[1:m]))
    return r, (z_e if np.any(z_e) and np.all(np.isfinite(z_e)) else None), gap_scaled / (1 << shift)


def _add_exactly(gamma: list[int], shift: int, step: np.ndarray) -> tuple[list[int], int]:
    """gamma 2^-shift + step, exactly, as integers over a (possibly larger) power of two."""
    parts = [float(v).as_integer_ratio() for v in step]  # (numerator, power-of-two denominator)
    new_shift = max([shift] + [q.bit_length() - 1 for _, q in parts])
    return [(g << (new_shift - shift)) + p * ((1 << new_shift) // q) for g, (p, q) in zip(gamma, parts)], new_shift


def _quotients(numerators: list[int], denominator: int) -> np.ndarray | None:
    """numerators_i / denominator, each rounded once (Python's integer true division is correctly rounded);
    None when all are zero or one overflows."""
    if not any(numerators):
        return None
    try:
        return np.array([n / denominator for n in numerators], dtype=np.float64)
    except OverflowError:
        return None
