"""Stage 1: the screening pass, one batched Gram product over the vocabulary.

For every token k it tries the candidate witnesses z = s (w_k - t c), t in
{0, 1}, where c is the centre (mean) of the rows: the row itself, and the row
seen from the centre, which is what wins for anisotropic heads whose rows
share a large common component. By linearity all logits come from the single
product W W_K^T and the vector W c:

    l_i(z) = s (w_i.w_k - t w_i.c) + b_i.

The pass is itself the float64 check of these witnesses: the margin it
computes is compared with the rigorous rounding bound of rounding.py, which
already allows for the extra operations and for storing z.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from auditor.domain import Ball, Box
from auditor.engine.certify import inside_domain
from auditor.engine.head import EngineHead
from auditor.engine.rounding import proves_positive

_BLOCK_BUDGET = 1 << 25  # float64 entries per n x chunk block (256 MiB); three blocks live at once
_SHIFTS = (0.0, 1.0)
_BOUNDED_LADDER = (1.0, 1 / 4, 1 / 16, 1 / 64)  # fractions of the largest scale, with a bias
_UNBOUNDED_LADDER = (1.0, 64.0, 4096.0)  # logit scale relative to the bias spread


@dataclass
class ScreenResult:
    certified: np.ndarray  # bool per token
    margin: np.ndarray  # margin of the witness (on the unit ball for an unbounded head without bias)
    shift: np.ndarray  # t of the witness s (w_k - t c)
    scale: np.ndarray  # s of the witness
    runner_up: np.ndarray  # the rival closest to winning at the witness
    threat: np.ndarray  # the strongest rival at z = w_k (starts Frank-Wolfe)


def screen(head: EngineHead, ids: np.ndarray, progress=None) -> ScreenResult:
    count = len(ids)
    result = ScreenResult(
        certified=np.zeros(count, dtype=bool),
        margin=np.full(count, -np.inf),
        shift=np.zeros(count),
        scale=np.ones(count),
        runner_up=np.full(count, -1, dtype=np.int64),
        threat=np.full(count, -1, dtype=np.int64),
    )
    chunk = max(1, min(count, 4096, _BLOCK_BUDGET // max(head.n, 1)))
    # Reused blocks: a fresh quarter-gigabyte allocation per chunk costs more in page faults than the reductions.
    gram = torch.empty(chunk, head.n, dtype=torch.float64, device=head.device)
    scratch = torch.empty_like(gram) if head.bias is not None else None
    for start in range(0, count, chunk):
        part = slice(start, min(start + chunk, count))
        rows = part.stop - part.start
        _screen_chunk(head, ids[part], result, part, gram[:rows], scratch[:rows] if scratch is not None else None)
        if progress is not None:
            progress.update(rows)
    return result
def _candidate_scales(head: EngineHead, directions: torch.Tensor) -> list[torch.Tensor]:
    """Scales s to try for each direction (one tensor of per-token scales per rung)."""
    domain = head.domain
    ones = torch.ones(directions.shape[0], dtype=torch.float64, device=head.device)
    if domain.bounded:
        if isinstance(domain, Ball):
            reach = torch.linalg.vector_norm(directions, dim=1)
        else:
            reach = directions.abs().amax(dim=1)
        largest = torch.where(reach > 0, (1 - 1e-12) * domain.radius / reach, ones)
        if head.bias is None:
            return [largest]  # without a bias the verdict is scale-free
        return [largest * f for f in _BOUNDED_LADDER]
    if head.bias is None:
        return [ones]
    spread = float(head.bias[head.competitor].max() - head.bias[head.competitor].min())
    spread = max(spread, head.max_abs_bias, np.finfo(np.float64).tiny)
    reach = torch.linalg.vector_norm(directions, dim=1) * head.max_row_norm
    base = torch.where(reach > 0, spread / reach, ones)
    return [base * f for f in _UNBOUNDED_LADDER]


def _screen_chunk(head: EngineHead, ids: np.ndarray, result: ScreenResult, part: slice,
                  gram: torch.Tensor, scratch: torch.Tensor | None) -> None:
    """Screen one chunk of tokens; ``gram`` (and ``scratch`` with a bias) are chunk x n work blocks."""
    device = head.device
    k = torch.as_tensor(ids, device=device)
    cols = torch.arange(len(ids), device=device)
    rows_k = head.weight.index_select(0, k)
    torch.matmul(rows_k, head.weight.T, out=gram)  # chunk x n: w_k . w_i, reduced along contiguous rows
    norm_k = head.row_norm[k]
    own_gram = gram[cols, k].clone()
    gram[cols, k] = -torch.inf  # the token is not its own rival
    if head.row_mask is not None:
        gram += head.row_mask[None, :]
    own_bias = head.bias[k] if head.bias is not None else None
    centre_norm = float(torch.linalg.vector_norm(head.centre))

    best_quality = torch.full((len(ids),), -torch.inf, dtype=torch.float64, device=device)
    chosen = {name: torch.as_tensor(getattr(result, name)[part], device=device)
              for name in ("certified", "margin", "shift", "scale", "runner_up")}

    for t in _SHIFTS:
        if t:
            gram -= head.centre_logits[None, :]  # now w_i . (w_k - c); the masked entries stay -inf
        directions = rows_k - t * head.centre if t else rows_k
        own_base = own_gram - t * head.centre_logits[k]
        norm_z = torch.linalg.vector_norm(directions, dim=1)
        for rung, scale in enumerate(_candidate_scales(head, directions)):
            if head.bias is None:
                rival, runner_up = gram.max(dim=1)
                own = own_base
            else:
                torch.mul(gram, scale[:, None], out=scratch)
                scratch += head.bias[None, :]
                rival, runner_up = scratch.max(dim=1)
                own = own_base * scale + own_bias
            margin = own - rival
            # ||z|| <= s (||w_k|| + t ||c||): the size the rounding bound needs.
            size = (scale if head.bias is not None else 1.0) * (norm_k + t * centre_norm)
            tolerance = head.error_factor * ((norm_k + head.max_row_norm) * size + head.max_abs_bias) + head.underflow_floor
            if own_bias is not None:
                tolerance = tolerance + head.error_factor * own_bias.abs()
            certified = proves_positive(margin, tolerance) & inside_domain(head.domain, directions * scale[:, None])
            if head.bias is None:
                reported = margin * scale if head.domain.bounded else margin / norm_z
            else:
                reported = margin
            quality = torch.where(certified, reported, torch.full_like(reported, -torch.inf))
            better = quality > best_quality
            best_quality = torch.where(better, quality, best_quality)
            chosen["certified"] |= better
            chosen["margin"] = torch.where(better, reported, chosen["margin"])
            chosen["shift"] = torch.where(better, torch.full_like(reported, t), chosen["shift"])
            chosen["scale"] = torch.where(better, scale * torch.ones_like(reported), chosen["scale"])
            chosen["runner_up"] = torch.where(better, runner_up, chosen["runner_up"])
            if t == 0 and rung == 0:  # the strongest rival at z = w_k itself
                result.threat[part] = runner_up.cpu().numpy()
    for name, values in chosen.items():
        getattr(result, name)[part] = values.cpu().numpy()
