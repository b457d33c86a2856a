"""The screen's third candidate on large heads without a bias: the self-direction in the metric that rounds the head.

For the tokens the formula witnesses left, z = s C^+ (w_k - m) (C the covariance of the rows, m their
mean): where the rows are long and thin, that is where a row on the rim of the cloud leads. With the
low-precision pass's rows one int8 or bfloat16 product proves the candidates that lead beyond its
allowance; otherwise the candidates that lead in a float32 product are checked in float64.
"""

from __future__ import annotations

import numpy as np
import torch

from auditor.engine.arithmetic.head import EngineHead
from auditor.engine.arithmetic.rounding import gamma, rounded_down, safe_norm
from auditor.engine.exact.certify import WitnessCheck, check_witnesses_sharpened, derived_error
from auditor.engine.screen import integer_pass, low_precision


def tries_whitened(head: EngineHead) -> bool:
    return head.bias is None and head.n * head.d >= head.whitened_entries


def whitened_witnesses(head: EngineHead, ids: np.ndarray,
                       centred: low_precision.CentredRows | integer_pass.IntegerRows | None = None
                       ) -> tuple[np.ndarray, torch.Tensor, WitnessCheck | None]:
    """A third candidate for the tokens the formula witnesses left, on large heads without a bias:
    z = s C^+ (w_k - m), the self-direction in the metric that makes the head round (C the covariance
    of the rows, m their mean). Where the rows are long and thin, that is where a row on the rim of the
    cloud leads, and one product for these few tokens costs less than Frank-Wolfe's passes over a large
    head. With the low-precision pass's rows (``centred``) one int8 or bfloat16 product proves the
    candidates that lead beyond its allowance, and the float64 check takes those within it; otherwise candidates that
    lead in a float32 product are checked in float64 like any witness.
    Returns (the positions in ``ids`` that were checked, their witnesses, the check), the check None
    when nothing was tried."""
    none = np.zeros(0, dtype=np.int64)
    if not (len(ids) and tries_whitened(head)):
        return none, torch.zeros(0, head.d, dtype=torch.float64, device=head.device), None
    k = torch.as_tensor(ids, device=head.device)
    directions = (head.rows64(k) - head.centre) @ head.precision
    if head.domain.bounded:
        directions = directions * head.domain.largest_scales(directions)[:, None]
    if isinstance(centred, integer_pass.IntegerRows) or (centred is not None and centred.values.shape[1] == head.d):
        return _whitened_in_low_precision(head, ids, directions, centred)
    promising = []
    step = max(1, (1 << 23) // head.n)
    rows = torch.arange(len(ids), device=head.device)
    for s in range(0, len(ids), step):
        logits = head.fast_logits(directions[s:s + step])  # steering only: the check below is in float64
        if head.row_mask is not None:
            logits += head.row_mask[None, :]
        here = rows[s:s + step] - s
        own = logits[here, k[s:s + step]].clone()
        logits[here, k[s:s + step]] = -torch.inf
        promising.append((own > logits.max(dim=1).values).cpu().numpy())
    chosen = np.nonzero(np.concatenate(promising))[0]
    if not chosen.size:
        return none, directions[:0], None
    witnesses = directions[torch.as_tensor(chosen, device=head.device)]
    return chosen, witnesses, check_witnesses_sharpened(head, ids[chosen], witnesses)


def _whitened_in_low_precision(head: EngineHead, ids: np.ndarray, directions: torch.Tensor,
                               centred: low_precision.CentredRows | integer_pass.IntegerRows
                               ) -> tuple[np.ndarray, torch.Tensor, WitnessCheck | None]:
    bounds = (integer_pass.int8_witnesses if isinstance(centred, integer_pass.IntegerRows)
              else low_precision.bfloat16_witnesses)
    won, margin, runner_up, lead, allowance = bounds(head, ids, directions, centred)
    close = np.nonzero(~won & (lead > -allowance))[0]  # within the allowance either way: float64 decides
    chosen = np.sort(np.concatenate([np.nonzero(won)[0], close]))
    if not chosen.size:
        return chosen, directions[:0], None
    at = np.nonzero(won)[0]  # their lower bounds are for the rows as stored: derived rows add their error
    if at.size:
        where = torch.as_tensor(at, device=head.device)
        margin = margin.copy()
        margin[at] = less_derived_error(head, torch.as_tensor(ids[at], device=head.device),
                                         torch.as_tensor(margin[at], device=head.device),
                                         safe_norm(directions[where], dim=1) * (1 + gamma(head.d + 10))).cpu().numpy()
    check = WitnessCheck(margin=margin[chosen], certified=won[chosen].copy(), runner_up=runner_up[chosen])
    if close.size:
        again = check_witnesses_sharpened(head, ids[close], directions[torch.as_tensor(close, device=head.device)])
        at = np.searchsorted(chosen, close)
        check.margin[at], check.certified[at], check.runner_up[at] = again.margin, again.certified, again.runner_up
    return chosen, directions[torch.as_tensor(chosen, device=head.device)], check


def less_derived_error(head: EngineHead, k: torch.Tensor, lower: torch.Tensor, norm_z: torch.Tensor) -> torch.Tensor:
    """A lower bound at z of norm at most ``norm_z`` for the rows as stored, made one for the exact rows: less
    certify.derived_error (taken 2^-40 above its few roundings), the subtraction rounded down."""
    if head.row_error is None and head.bias_error is None:
        return lower
    return rounded_down(lower - derived_error(head, k, norm_z) * (1 + 2.0**-40))
