"""float64 checks of the two kinds of certificate (products with the head by blocks of rows).

A witness z for token k is accepted when the computed margin
min_{i != k} (l_k(z) - l_i(z)) stays positive after the worst rounding
(rounding.py) and z lies in the domain; the margin it reports is the computed one less that
rounding bound (rounding.proven_lower), a lower bound of the exact margin at z. Convex weights alpha for token k are
accepted when the residual ``||sum alpha_i w_i - w_k||`` and the bias gap
``b_k - sum alpha_i b_i`` (unbounded domain; over z >= 0 the residual is the positive part's,
``||(w_k - sum alpha_i w_i)_+||``), or the dual value
``s_D(w_k - sum alpha_i w_i) + b_k - sum alpha_i b_i`` (bounded domain), are at
most the head's tolerance. Both quantities are reported as rigorous upper
bounds: rounding in forming the combination is added, not hoped away.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from auditor.engine.arithmetic.head import EngineHead
from auditor.engine.arithmetic.rounding import UNIT_ROUNDOFF, gamma, proven_lower, proves_positive, safe_norm
from auditor.engine.decisions import on_the_simplex
from auditor.question.domain import Domain

_COLUMN_BUDGET = 1 << 23  # float64 entries of one B x n logit block (64 MiB)


@dataclass
class WitnessCheck:
    margin: np.ndarray  # a lower bound of the exact min_{i != k} (l_k(z) - l_i(z)) per witness (rounding.proven_lower)
    certified: np.ndarray  # bool: positive beyond rounding and inside the domain
    runner_up: np.ndarray  # the i attaining that minimum


def inside_domain(domain: Domain, witnesses: torch.Tensor) -> torch.Tensor:
    """Row-wise membership of a B x d block of witnesses (Euclidean norms without overflow)."""
    return domain.contains_rows(witnesses, safe_norm)  # the rows' norms without overflow


def check_witnesses(head: EngineHead, ids: np.ndarray, witnesses: torch.Tensor, exact_bound: bool = False) -> WitnessCheck:
    """Check witness ``witnesses[j]`` for token ``ids[j]`` against every competitor row.

    The rounding bound is f (||w_i|| ||z|| + |b_i|) per logit, or with ``exact_bound``
    the sharper f (|w_i|.|z| + |b_i|), at the price of a second product (used for
    the few tokens that reach the exact stage, whose margins can be tiny).
    """
    step = max(1, _COLUMN_BUDGET // max(head.n, 1))
    parts = [_check_block(head, ids[s:s + step], witnesses[s:s + step], exact_bound) for s in range(0, len(ids), step)]
    if not parts:
        empty = np.zeros(0)
        return WitnessCheck(empty, empty.astype(bool), empty.astype(np.int64))
    return WitnessCheck(*(np.concatenate([getattr(p, f) for p in parts])
                          for f in ("margin", "certified", "runner_up")))


def check_witnesses_sharpened(head: EngineHead, ids: np.ndarray, witnesses: torch.Tensor) -> WitnessCheck:
    """``check_witnesses`` with the cheap norm bound, then the sharper per-entry bound (a second
    product) for the witnesses that failed: close calls cost the extra product, nothing else does."""
    check = check_witnesses(head, ids, witnesses)
    failed = ~check.certified
    if failed.any():
        again = check_witnesses(head, ids[failed], witnesses[torch.as_tensor(failed, device=witnesses.device)],
                                exact_bound=True)
        check.certified[failed], check.margin[failed] = again.certified, again.margin
        check.runner_up[failed] = again.runner_up
    return check


def _check_block(head: EngineHead, ids: np.ndarray, witnesses: torch.Tensor, exact_bound: bool) -> WitnessCheck:
    k = torch.as_tensor(ids, device=head.device)
    rows = torch.arange(len(ids), device=head.device)
    logits = head.logits(witnesses)  # B x n in float64, reduced along contiguous rows
    if head.bias is not None:
        logits += head.bias[None, :]
    if head.row_mask is not None:
        logits += head.row_mask[None, :]
    own = logits[rows, k].clone()
    logits[rows, k] = -torch.inf
    norm_z = safe_norm(witnesses, dim=1) * (1 + gamma(head.d + 8))  # at least ||z||
    if exact_bound:
        error = _abs_products(head, witnesses.abs())  # B x n: |w_i| . |z|
        if head.bias is not None:
            error += head.bias.abs()[None, :]
        error = head.error_factor * error + head.underflow_floor
        if head.row_error is not None:  # derived rows: each logit also moves by at most row_error_i ||z||
            error += head.row_error[None, :] * norm_z[:, None]
        if head.bias_error is not None:
            error += head.bias_error[None, :]
        own_error = error[rows, k].clone()
        best, runner_up = (logits + error).max(dim=1)  # the rival's logit at its most favourable rounding
        # every rival's exact logit is at most best plus the rounding of that sum, 2 u |best|
        tolerance = own_error + 2 * UNIT_ROUNDOFF * best.abs()
        certified = proves_positive(own - best, own_error + head.witness_lead(k, norm_z))
    else:
        best, runner_up = logits.max(dim=1)
        own_bias = head.bias[k].abs() if head.bias is not None else 0.0
        tolerance = (head.error_factor * ((head.row_norm[k] + head.max_row_norm) * norm_z + own_bias
                                          + head.max_abs_bias) + head.underflow_floor + derived_error(head, k, norm_z))
        certified = proves_positive(own - best, tolerance + head.witness_lead(k, norm_z))
    margin = proven_lower(own - best, tolerance)  # the margin stated: at most the exact one at z
    certified = certified & inside_domain(head.domain, witnesses)
    return WitnessCheck(margin.cpu().numpy(), certified.cpu().numpy(), runner_up.cpu().numpy())


def derived_error(head: EngineHead, k: torch.Tensor, norm_z: torch.Tensor):
    """How far token k's lead over any rival at a point of norm ``norm_z`` may move because the
    stored rows and biases are derived (translated, normalised) and only within their error bounds."""
    error = torch.zeros_like(norm_z)
    if head.row_error is not None:
        error = error + (head.row_error[k] + head.max_row_error) * norm_z
    if head.bias_error is not None:
        error = error + head.bias_error[k] + head.max_bias_error
    return error


def _abs_products(head: EngineHead, abs_witnesses: torch.Tensor) -> torch.Tensor:
    """|W| |Z|^T by blocks of rows, so that |W| is never held whole."""
    out = torch.empty(abs_witnesses.shape[0], head.n, dtype=torch.float64, device=head.device)
    for s, e, rows in head.blocks():
        out[:, s:e] = abs_witnesses @ rows.abs().T
    return out


EXACT_GAP_ROWS = 64  # largest support whose zero-up-to-rounding gap or dual value is settled exactly


def exact_gap(weights, b_k, b) -> float:
    """sum_i alpha_i (b_k - b_i) / sum_i alpha_i in rational arithmetic, rounded up to a float: the
    sign of a bias gap that is zero up to rounding (b_k exactly a convex combination of the b_i)."""
    from fractions import Fraction

    alpha = [Fraction(float(a)) for a in np.asarray(weights).ravel()]
    top = Fraction(float(b_k))
    value = sum(a * (top - Fraction(float(v))) for a, v in zip(alpha, np.asarray(b.cpu() if hasattr(b, "cpu") else b).ravel()))
    value /= sum(alpha)
    rounded = float(value)
    return rounded if Fraction(rounded) >= value else float(np.nextafter(rounded, np.inf))


def exact_dual_at_most_zero(domain, weights, w_k, rows, b_k, b) -> bool:
    """Whether the dual value s_D(w_k - sum beta_i w_i) + sum beta_i (b_k - b_i), beta = alpha / sum(alpha),
    is at most 0, in rational arithmetic: for the ball r ||x|| <= -gap is r^2 ||x||^2 <= gap^2 with gap <= 0,
    for the box r ||x||_1 + gap <= 0. ``b`` is None without a bias."""
    from fractions import Fraction

    alpha = [Fraction(float(a)) for a in np.asarray(weights).ravel()]
    total = sum(alpha)
    rows = np.asarray(rows, dtype=np.float64)
    x = [Fraction(float(w_k[j])) - sum(a * Fraction(float(v)) for a, v in zip(alpha, rows[:, j])) / total
         for j in range(rows.shape[1])]
    gap = Fraction(0)
    if b is not None:
        top = Fraction(float(b_k))
        values = np.asarray(b.cpu() if hasattr(b, "cpu") else b, dtype=np.float64).ravel()
        gap = sum(a * (top - Fraction(float(v))) for a, v in zip(alpha, values)) / total
    return domain.support_exactly_at_most(x, -gap)


@dataclass
class ConvexCheck:
    residual: float  # unbounded: bound on ||sum alpha_i w_i - w_k||; bounded: bound on the dual value
    bias_gap: float  # bound on b_k - sum alpha_i b_i (0 without bias)
    accepted: bool


def check_convex(head: EngineHead, k: int, indices: np.ndarray, weights: np.ndarray) -> ConvexCheck:
    """Evaluate convex weights over rows ``indices`` as a certificate that k cannot win.

    Accepted when the bias gap is at most 0 and the weight residual at most
    head.residual_tolerance(k): the one approximation the spec allows, stated
    with every verdict. In a bounded domain a dual value at most 0 is accepted as well.
    """
    indices = np.asarray(indices, dtype=np.int64)
    weights = np.asarray(weights, dtype=np.float64)
    valid = (indices.size > 0 and np.all(weights >= 0) and not np.any(indices == k)
             and np.unique(indices).size == indices.size and np.all(np.isfinite(weights))
             and np.all(head.representative[indices] == indices) and weights.sum() > 0)
    if not valid:
        return ConvexCheck(math.inf, math.inf, False)
    weights = on_the_simplex(weights)  # the numbers set_convex will report, so every exact sign below is theirs
    device = head.device
    index = torch.as_tensor(indices, device=device)
    alpha = torch.as_tensor(weights, device=device)
    s = indices.size
    total = float(alpha.sum())
    w_k = head.rows64([k])[0]
    offset, error, delta = _residual_bound(head, k, index, alpha, s, total, w_k)
    if head.domain.orthant:
        # for z >= 0, (w_k - sum beta_i w_i).z <= ||(w_k - sum beta_i w_i)_+|| ||z||: only the coordinates
        # where w_k exceeds the combination count, and the positive part is 1-Lipschitz, so the
        # combination's rounding error adds as it does to the whole residual
        positive = torch.as_tensor(np.maximum(offset, 0.0))[None, :]
        delta = float(safe_norm(positive, dim=1)[0]) * (1 + gamma(head.d + 1)) + error
    gap, computed_gap = _bias_gap_bound(head, k, indices, index, alpha, weights, s, total)
    small_residual = math.isfinite(delta) and delta <= head.residual_tolerance(k)
    hull_certificate = small_residual and gap <= 0

    domain = head.domain
    if not domain.bounded:
        return ConvexCheck(delta, gap, bool(hull_certificate))
    value = domain.support_bound(offset, error, delta) + gap
    source = head.exact_source
    # a lead of at most the tolerance times the reach anywhere in D: the bounded side of witness_lead's rule
    level = head.residual_tolerance(k) * domain.reach(head.d) if head.decide_at_tolerance else 0.0
    if (level < value and not hull_certificate and s <= EXACT_GAP_ROWS and math.isfinite(value)
            and (source is not None or (head.row_error is None and head.bias_error is None))
            and _dual_exactly_nonpositive(head, k, indices, index, weights, w_k, offset, value, computed_gap)):
        return ConvexCheck(0.0, gap, True)  # 0 bounds the exact value, which is <= 0
    return ConvexCheck(value, gap, bool(math.isfinite(value) and (value <= level or hull_certificate)))


def _residual_bound(head: EngineHead, k: int, index: torch.Tensor, alpha: torch.Tensor, s: int, total: float,
                    w_k: torch.Tensor) -> tuple[np.ndarray, float, float]:
    """(w_k - sum beta_i w_i as computed, the rounding bound of its entries, a bound on its exact norm)."""
    device = head.device
    # The certificate is about beta = alpha / sum(alpha), an exact point of the simplex, and
    # sum beta_i w_i - w_k = sum beta_i (w_i - w_k): the differences are formed first, each rounded
    # relative to itself, so the error is a fraction of the rows' spread whatever offset they share.
    if 4 * s > head.n:  # a dense combination: by blocks of the head, no copy of its rows
        dense = torch.zeros(head.n, dtype=torch.float64, device=device).index_put_((index,), alpha)
        combination = head.combine_offsets(dense, w_k) / total
    else:
        combination = (alpha @ (head.rows64(index) - w_k)) / total
    offset_t = -combination  # w_k - sum beta_i w_i
    offset = offset_t.cpu().numpy()
    # ||w_i - w_k|| <= ||w_i - c|| + ||w_k - c||, bounded by the stored spreads
    involved = float(alpha @ head.spread_norm[index]) / total + float(head.spread_norm[k])
    error = 2 * gamma(s + 3) * involved
    if involved > 0:  # products of exact zeros cannot underflow
        error += head.underflow_floor
    if head.row_error is not None:  # the rows are computed from the model's; their own error counts too
        error += float(alpha @ head.row_error[index]) / total + float(head.row_error[k])
    delta = float(safe_norm(offset_t[None, :], dim=1)[0]) * (1 + gamma(head.d + 1)) + error
    return offset, error, delta


def _bias_gap_bound(head: EngineHead, k: int, indices: np.ndarray, index: torch.Tensor, alpha: torch.Tensor,
                    weights: np.ndarray, s: int, total: float) -> tuple[float, float | None]:
    """(a bound on b_k - sum beta_i b_i, 0 without a bias; the computed gap, None without a bias)."""
    gap = 0.0
    if head.bias is None:
        return gap, None
    b_k = head.bias[k]
    differences = b_k - head.bias[index]  # b_k - b_i, each rounded relative to itself
    computed = computed_gap = float(alpha @ differences) / total
    gap = computed + 2 * gamma(s + 3) * float(alpha @ differences.abs()) / total
    if bool(differences.any()):
        gap += head.underflow_floor
    if head.bias_error is not None:
        gap += float(alpha @ head.bias_error[index]) / total + float(head.bias_error[k])
    if computed - (gap - computed) <= 0 < gap and s <= EXACT_GAP_ROWS:  # zero up to rounding: settle its sign exactly
        if head.bias_error is None:
            gap = exact_gap(weights, head.bias[k], head.bias[index])
        elif head.exact_source is not None and head.exact_source[1] is not None:
            # on the bias as given: the normal form's shift cancels in b_k - b_i and its power of two
            # changes no sign, so an exact gap <= 0 there is one here, and 0 bounds it
            given = head.exact_source[1]
            if exact_gap(weights, float(given[k]), given[torch.as_tensor(indices, device=given.device)]) <= 0:
                gap = 0.0
    return gap, computed_gap


def _dual_exactly_nonpositive(head: EngineHead, k: int, indices: np.ndarray, index: torch.Tensor,
                              weights: np.ndarray, w_k: torch.Tensor, offset: np.ndarray, value: float,
                              computed_gap: float | None) -> bool:
    """Whether the dual value, zero within its rounding bound ``value``, is exactly at most 0."""
    # The dual value may be exactly 0 (a token that reaches a tie only on the domain's boundary, and
    # so never wins): when the computed value is zero within its rounding bound, settle the sign in
    # rational arithmetic, on the weights as they will be reported and the numbers as given (the
    # normal form's translated rows and bias carry rounding; its powers of two change no sign).
    domain, source = head.domain, head.exact_source
    computed = domain.support(offset) + (computed_gap if head.bias is not None else 0.0)
    if not computed <= value - computed:
        return False
    beta = weights
    if source is not None:
        weight, bias, given = source
        rows = weight[torch.as_tensor(indices, device=weight.device)].to(torch.float64).cpu().numpy()
        own = weight[k].to(torch.float64).cpu().numpy()
        b_k, b = (float(bias[k]), bias[index]) if bias is not None else (0.0, None)
    else:
        given, rows, own = domain, head.rows(indices), w_k.cpu().numpy()
        b_k, b = (head.bias[k], head.bias[index]) if head.bias is not None else (0.0, None)
    return bool(exact_dual_at_most_zero(given, beta, own, rows, b_k, b))
