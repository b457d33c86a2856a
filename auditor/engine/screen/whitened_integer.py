"""The whitened witnesses priced in the int8 pass: the self-direction of the head made round.

A head whose spectrum falls steeply (or with a few rogue directions) has rows that lead only where the
thin directions are weighted up: at z = C^+ (w_k - c) (C the rows' covariance) rather than at w_k - c.
With A (r x d) such that A^T A = C^+ (EngineHead.whitening), the rows y_i = A (w_i - c) are the head made
round, and at z* = A^T y_k

    (w_k - w_i) . z* = (A (w_k - c) - A (w_i - c)) . y_k = y_k . y_k - y_i . y_k,

the int8 pass's own question on the rows y: the token's own product against the largest of its rivals'.
So integer_rows(head, A) puts the rows y on their grids (a copy of n r bytes, alive beside the plain
copy while the screen compares the two passes on a sample) and the same integer products and bounds (integer_pass._upper_bounds) price every token's
whitened witness at once, where a float32 pass over the head would take its rivals a few dozen tokens at
a time.

The witness stated. z* is exact only on paper: the copy holds y^_i = fl(A fl(w_i - c)), within f_i of y_i
(integer_rows' ``formation``), which the bound already carries. The witness recorded is z^ = fl(A^T y^_k)
(y^_k formed again here: any computation of it is within f_k of y_k), and

    ||z^ - z*|| <= ||fl(A^T y^_k) - A^T y^_k|| + ||A^T (y^_k - y_k)|| <= (gamma_r ||y^_k|| + f_k) ||A||_F = g_k,

which moves each logit gap (w_k - w_i) . z by at most g_k (||w_k|| + max_i ||w_i||) (the products'
underflow, at most 2^-1075 each, is added to f_k and g_k). The lower bound at z^ less that term must
exceed what the float64 re-check of z^ needs (low_precision.recheck_needs), as every low-precision witness
must. In a bounded domain z^ is scaled by a power of two s inside it: the gaps at s z* are s times those at
z*, and s z^ is within s g_k of s z* plus 2^-1075 an entry for any that falls below the normal range. The
candidates whose lead lies within the bound's slack either way are handed to
the float64 check (certify.check_witnesses_sharpened), as whitened.py does with its candidates.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from auditor.engine.arithmetic.head import EngineHead
from auditor.engine.arithmetic.rounding import UNIT_ROUNDOFF, gamma, rounded_down, rounded_up, safe_norm
from auditor.engine.screen import integer_pass
from auditor.engine.screen.low_precision import witness_outcomes
from auditor.engine.screen.whitened import less_derived_error


@dataclass
class WhitenedOutcome:
    """The whitened witnesses of the tokens the pass took (positions into its ``ids``)."""

    proved: np.ndarray  # positions whose witness the bound proves
    witnesses: torch.Tensor  # their witnesses z (proved x d, float64)
    margin: np.ndarray  # lower bounds of the exact margins at them
    runner_up: np.ndarray
    close: np.ndarray  # positions within the bound's slack: the float64 check decides them
    close_witnesses: torch.Tensor


def applies(head: EngineHead) -> bool:
    """Heads of at least head.whitened_entries entries (with a bias or without) whose whitened rows the int8
    grids hold, on a device whose int8 product is exact at the whitened copy's width (r, the directions kept)."""
    return (head.n * head.d >= head.whitened_entries and head.n * head.d >= head.int8_entries
            and integer_pass.fits(head, head.whitening.shape[0]))


def whitened_rows(head: EngineHead) -> integer_pass.IntegerRows:
    """The int8 copy of the whitened rows A (w_i - c) (integer_pass.integer_rows with A = head.whitening)."""
    return integer_pass.integer_rows(head, head.whitening)


def whitened_int8(head: EngineHead, ids: np.ndarray, progress=None,
                  rows: integer_pass.IntegerRows | None = None) -> WhitenedOutcome:
    """The whitened witnesses of tokens ``ids`` (a head without a bias on which the int8 pass applies), on
    ``rows`` (whitened_rows, made here when not given)."""
    device, d = head.device, head.d
    transform = head.whitening
    r = transform.shape[0]
    frobenius = float(safe_norm(transform.reshape(-1), dim=0)) * (1 + gamma(r * d + 2))
    rows = rows if rows is not None else whitened_rows(head)
    proved, witnesses, margin, runner_up, close, close_witnesses = [], [], [], [], [], []
    for part, k, top, rival, slack in integer_pass.self_bounds(head, ids, rows):
        won, lower, best, lead, allowance, z = _outcomes(head, k, rows, transform, frobenius, top, rival, slack)
        # only the witnesses kept leave the chunk: a float64 witness per token is twice a float32 row
        at, near = np.nonzero(won)[0], np.nonzero(~won & (lead > -allowance))[0]
        if at.size:  # lower bounds for the rows as stored: derived rows add their error
            chosen = torch.as_tensor(at, device=device)
            witnesses.append(z[chosen])
            margin.append(less_derived_error(head, k[chosen], torch.as_tensor(lower[at], device=device),
                                             safe_norm(z[chosen], dim=1) * (1 + gamma(d + 10))).cpu().numpy())
            proved.append(part[at])
            runner_up.append(best[at])
        if near.size:
            close.append(part[near])
            close_witnesses.append(z[torch.as_tensor(near, device=device)])
        if progress is not None:
            progress.update(int(at.size))
    none = np.zeros(0, dtype=np.int64)
    proved, close = (np.concatenate(proved) if proved else none), (np.concatenate(close) if close else none)
    # in the order of ids, whichever order self_bounds visited the tokens in
    first, near_first = np.argsort(proved, kind="stable"), np.argsort(close, kind="stable")
    empty = torch.zeros(0, d, dtype=torch.float64, device=device)
    return WhitenedOutcome(proved[first],
                           torch.cat(witnesses)[torch.as_tensor(first, device=device)] if witnesses else empty,
                           np.concatenate(margin)[first] if margin else np.zeros(0),
                           np.concatenate(runner_up)[first] if runner_up else none,
                           close[near_first],
                           torch.cat(close_witnesses)[torch.as_tensor(near_first, device=device)]
                           if close_witnesses else empty)


def _outcomes(head: EngineHead, k: torch.Tensor, rows: integer_pass.IntegerRows, transform: torch.Tensor,
              frobenius: float, top: torch.Tensor, rival: torch.Tensor, slack: torch.Tensor):
    """For one chunk of tokens k: the witnesses z^ (scaled into a bounded domain), the lower bounds of their
    margins and what witness_outcomes makes of them."""
    r = transform.shape[0]
    formation = rows.formation[k]
    whitened = (head.rows64(k) - head.witness_centre) @ transform.T  # y^_k: any computation is within f_k of y_k
    # ||y_k|| >= ||y^_k|| - f_k, ||y^_k|| >= its computed norm / (1 + gamma_{r+2}); 2^-40 low for the roundings
    own_norm = ((safe_norm(whitened, dim=1) / (1 + gamma(r + 2)) - formation) * (1 - 2.0**-40)).clamp(min=0)
    own = own_norm * own_norm * (1 - 4 * gamma(r + 4))  # <= ||y_k||^2
    witnesses = whitened @ transform  # z^ = fl(A^T y^_k)
    # (and the products' underflow in fl(A^T y^_k), at most r 2^-1075 an entry)
    moved = ((gamma(r) * safe_norm(whitened, dim=1) * (1 + gamma(r + 2)) + formation) * frobenius
             + r * head.d * 2.0**-1074)
    gap = own - top - 4 * UNIT_ROUNDOFF * (own.abs() + top.abs())  # <= the least gap at z* = A^T y_k
    lead = own - (top - slack)
    allowance = slack + 4 * UNIT_ROUNDOFF * (own.abs() + top.abs())
    bias_gap = None
    if head.bias is not None:  # max_i (b_i - b_k) <= B - b_k, B the largest competitor's bias (one rounding up)
        bias_gap = rounded_up(head.bias[head.competitor].max() - head.bias[k])
    if head.domain.bounded:  # the largest power of two s inside the domain: the gaps at s z* are s times those
        largest = head.domain.largest_scales(witnesses)
    elif bias_gap is not None:  # unbounded with a bias: s with s (gap - drift) about 4 (B - b_k) at least
        room = gap - (moved * (head.row_norm[k] + head.max_row_norm) * (1 + gamma(head.d + 4)))
        largest = torch.where(room > 0, (8 * bias_gap / room.clamp(min=2.0**-1000)).clamp(min=1.0),
                              torch.zeros_like(room))
    if head.domain.bounded or bias_gap is not None:
        _, exponent = torch.frexp(largest)
        scale = torch.ldexp(torch.ones_like(largest), (exponent - 1).to(torch.float64))
        scale = torch.where(torch.isfinite(largest) & (largest > 0), scale, torch.zeros_like(largest))
        witnesses = witnesses * scale[:, None]
        # s z^ is s times z^ but where an entry falls below float64's normal range: at most 2^-1075 an entry
        moved = moved * scale + head.d * 2.0**-1074
        gap, lead, allowance = rounded_down(gap * scale), lead * scale, allowance * scale
    # the logit gaps at z^ against those at s z*: (w_k - w_i) . (z^ - s z*) (the computed row norms, low by at
    # most gamma_{d+4} of the exact ones, taken up by that)
    drift = moved * (head.row_norm[k] + head.max_row_norm) * (1 + gamma(head.d + 4)) * (1 + 2.0**-40)
    lower = rounded_down(gap - drift)
    allowance = allowance + drift
    if bias_gap is not None:  # l_k - l_i = (w_k - w_i) . z + b_k - b_i >= lower - (B - b_k)
        lower, lead = rounded_down(lower - bias_gap), lead - bias_gap
    norm_z = safe_norm(witnesses, dim=1) * (1 + gamma(head.d + 2)) + 2.0**-1000
    valid = torch.isfinite(lower) & (norm_z > 2.0**-1000)
    won, margin, runner_up, lead, allowance = witness_outcomes(head, k, witnesses, norm_z, lower, top, valid, rival,
                                                               lead, allowance, "whitened int8")
    return won, margin, runner_up, lead, allowance, witnesses
