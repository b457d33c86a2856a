"""The interior stage: a closed-form convex certificate for rows deep inside the hull.

Rows set to (almost) the mean of the others, as vocabulary resizing does,
sit so deep inside the hull that first-order methods crawl towards them. For
them there is an explicit convex combination. With c the centre of the rows
y_i = w_i - c and C = (1/m) sum_i y_i y_i^T their covariance, put

    alpha_i = (1 + y_i^T C^+ (w_k - c)) / m.

These weights sum to 1 (the y_i sum to zero) and reproduce w_k whenever
w_k - c lies in the span of the y_i; they are non-negative when w_k is close
to the centre in the Mahalanobis sense, which is exactly the mean-initialised
case. The token itself is among the rows; if it carries weight alpha_k < 1 we
move it to the left-hand side and rescale. Every certificate is then checked
like any other (certify.check_convex).
"""

from __future__ import annotations

import numpy as np
import torch

from auditor.engine.certify import check_convex
from auditor.engine.head import EngineHead


def interior_certificates(head: EngineHead, ids: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray, float, float]]:
    """Return ``{k: (indices, weights, residual, bias_gap)}`` for the tokens this settles."""
    if len(ids) == 0:
        return {}
    rows = torch.nonzero(head.competitor).flatten()
    m = rows.numel()
    if m <= head.d:
        return {}  # too few rows for a full-dimensional cloud; leave it to the exact stages
    inverse = head.precision

    found = {}
    position = {int(r): j for j, r in enumerate(rows.tolist())} if m < head.n else None
    for s in range(0, len(ids), 64):
        batch = ids[s:s + 64]
        k = torch.as_tensor(batch, device=head.device)
        offsets = (head.rows64(k) - head.centre) @ inverse  # B x d
        # (w_i - c) . offset for every competitor i, without a centred copy of the head
        projections = (head.logits(offsets).T - head.centre @ offsets.T)[rows]
        alpha = (1.0 + projections) / m  # m x B
        for j, token in enumerate(batch.tolist()):
            weights = alpha[:, j]
            own = position[token] if position is not None else token
            own_weight = float(weights[own])
            if own_weight >= 1.0:
                continue
            others = torch.ones(m, dtype=torch.bool, device=head.device)
            others[own] = False
            weights = weights[others] / (1.0 - own_weight)
            if float(weights.min()) < 0:
                continue
            indices = rows[others].cpu().numpy()
            weights = weights.cpu().numpy()
            check = check_convex(head, token, indices, weights)
            if check.accepted:
                found[token] = (indices, weights, check.residual, check.bias_gap)
    return found
