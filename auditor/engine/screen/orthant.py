"""Candidate witnesses over z >= 0 (the nonneg domains), for blocks of tokens at once.

Over the orthant a row wins where its own coordinates stand out: the candidates are the positive
parts of w_k - c (c the competitors' mean, the coordinates where w_k exceeds the typical row) and of
w_k itself as given (the coordinates it weighs positively). Each is put where it wins most easily:
without a bias any positive multiple does as well (unbounded: a unit peak, so that no product
underflows; with a radius: a hair inside the ball); with a bias, far enough out along it that every
rival it leads in slope is also passed in value, where it leads every rival in slope (unbounded), and
on the ball's boundary otherwise. certify.check_witnesses decides, as for every other witness.
"""

from __future__ import annotations

import torch

from auditor.engine.arithmetic.head import EngineHead


def candidates(head: EngineHead, ids) -> list[torch.Tensor]:
    """Candidate witnesses for tokens ``ids``: a list of B x d float64 tensors on the head's device, each
    row non-negative (a zero row where the candidate is empty)."""
    rows = head.rows64(ids)
    origin = head.origin if head.origin is not None else torch.zeros_like(head.centre, dtype=torch.float64)
    found = []
    for point in (head.centre.to(torch.float64), origin.to(torch.float64)):
        found.append(placed(head, ids, torch.clamp(rows - point[None, :], min=0.0)))
    return found


def placed(head: EngineHead, ids, Z: torch.Tensor) -> torch.Tensor:
    """The non-negative directions ``Z`` scaled where they stand the best chance (module docstring)."""
    peak = Z.abs().amax(dim=1, keepdim=True)
    Z = torch.where(peak > 0, Z / torch.where(peak > 0, peak, torch.ones_like(peak)), Z)  # unit peak
    domain = head.domain
    if domain.bounded:
        return Z * domain.largest_scales(Z)[:, None]
    if head.bias is None:
        return Z
    k = torch.as_tensor(ids, device=Z.device)
    logits = head.logits(Z)  # B x n, the directions' slopes
    if head.row_mask is not None:
        logits = logits + head.row_mask[None, :]
    rows = torch.arange(len(ids), device=Z.device)
    slopes = logits[rows, k][:, None] - logits
    intercepts = head.bias[k][:, None] - head.bias[None, :]
    rival = torch.isfinite(slopes)
    rival[rows, k] = False
    ahead = torch.where(rival, slopes > 0, torch.ones_like(rival)).all(dim=1)
    # past the last crossing: s slope_i + intercept_i > 0 for every rival once s > -intercept_i / slope_i
    crossing = torch.where(rival & (intercepts < 0), -intercepts / torch.where(rival, slopes, torch.ones_like(slopes)),
                           torch.zeros_like(slopes)).amax(dim=1)
    scale = torch.where(ahead, 2.0 * crossing + 1.0, torch.ones_like(crossing))
    return Z * scale[:, None]
