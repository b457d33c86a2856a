"""The interior stage: a closed-form convex certificate for rows deep inside the hull.

Rows set to (almost) the mean of the others, as vocabulary resizing does,
sit so deep inside the hull that first-order methods crawl towards them. For
them there is an explicit convex combination. With c the centre of the points
x_i, y_i = x_i - c and C = (1/m) sum_i y_i y_i^T their covariance, put

    alpha_i = (1 + y_i^T C^+ (t - c)) / m.

These weights sum to 1 (the y_i sum to zero) and reproduce t whenever t - c
lies in the span of the y_i; they are non-negative when t is close to the
centre in the Mahalanobis sense, which is exactly the mean-initialised case.

Without a bias the points are the rows and t = w_k. With a bias they are the
lifted rows x_i = (w_i, b_i), and t = (w_k, b_k + delta) with delta > 0: weights
that reproduce w_k and give the rows a larger average bias than b_k, so the
certificate's bias gap is -delta, not zero. A row at the mean with the mean's
bias (a LayerNorm shift beta gives every row the bias w_i . beta, and the mean
row the mean of those) ties the others only under the uniform weights; tilted
within the slice sum alpha_i w_i = w_k towards the rows of larger bias, its
certificate holds by a margin no rounding can erase. The weights are affine
in delta, so the delta that keeps them non-negative form an interval; the
stage takes its midpoint, whose weights are at least half those at either end.
When the lifted rows span too little for that (a bias that is an exact linear
function of the rows), the plain weights on w are tried as well.

The token itself is among the rows; if it carries weight alpha_k < 1 we move it
to the left-hand side and rescale. Every certificate is then checked like any
other (certify.check_convex).
"""

from __future__ import annotations

import numpy as np
import torch

from auditor.engine.arithmetic.head import EngineHead
from auditor.engine.exact.certify import check_convex

_BATCH = 64


def interior_certificates(head: EngineHead, ids: np.ndarray) -> dict[int, tuple[np.ndarray, np.ndarray, float, float]]:
    """Return ``{k: (indices, weights, residual, bias_gap)}`` for the tokens this settles."""
    if len(ids) == 0:
        return {}
    rows = torch.nonzero(head.competitor).flatten()
    m = rows.numel()
    if m <= head.d:
        return {}  # too few rows for a full-dimensional cloud; leave it to the exact stages
    lifted = _Lifted(head, rows) if head.bias is not None else None

    found = {}
    position = {int(r): j for j, r in enumerate(rows.tolist())} if m < head.n else None
    for s in range(0, len(ids), _BATCH):
        batch = ids[s:s + _BATCH]
        owns = torch.as_tensor([position[t] if position is not None else t for t in batch.tolist()],
                               device=head.device)
        offsets = head.rows64(torch.as_tensor(batch, device=head.device)) - head.centre  # B x d: w_k - c
        tilted = lifted.weights(batch, offsets) if lifted is not None else None
        # Which tokens each route can prove at all, for the whole batch at once: most tokens that reach this
        # stage are nowhere near the centre, and testing their weights one token at a time cost more than
        # the products (a biased ball: 1120 tokens, 5.4 s). The tests are the per-token ones, entry by entry.
        open_tilted = tilted.possible(owns) if tilted is not None else np.zeros(len(batch), dtype=bool)
        plain = None  # the plain weights, formed only when a token needs them (one more product)
        open_plain = np.zeros(len(batch), dtype=bool)
        if not open_tilted.all():
            plain = _plain_weights(head, rows, offsets)
            open_plain = _nonnegative_without_own(plain, owns)
        for j, token in enumerate(batch.tolist()):
            if not open_tilted[j] and not open_plain[j]:
                continue  # neither route's weights are non-negative: _certificate would refuse both
            own = int(owns[j])
            certificate = None
            if open_tilted[j]:
                alpha = tilted(j, own)
                certificate = _certificate(head, rows, token, own, alpha) if alpha is not None else None
            if certificate is None:
                if plain is None:
                    plain = _plain_weights(head, rows, offsets)
                certificate = _certificate(head, rows, token, own, plain[:, j])
            if certificate is not None:
                found[token] = certificate
    return found


def _nonnegative_without_own(alpha: torch.Tensor, owns: torch.Tensor) -> np.ndarray:
    """Per column j of ``alpha`` (m x B), whether _certificate's tests pass: the own weight below 1 and every
    other weight, divided by 1 less the own weight, not negative (the same divisions as there)."""
    columns = torch.arange(alpha.shape[1], device=alpha.device)
    own_weight = alpha[owns, columns]
    scaled = alpha / (1.0 - own_weight)[None, :]
    scaled[owns, columns] = torch.inf
    return ((own_weight < 1.0) & (scaled.min(dim=0).values >= 0)).cpu().numpy()


def _plain_weights(head: EngineHead, rows: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """(1 + y_i . C^+ (w_k - c)) / m for every competitor i and token of the batch: m x B."""
    direction = offsets @ head.precision  # B x d
    # (w_i - c) . direction for every competitor i, without a centred copy of the head
    projections = (head.logits(direction).T - head.centre @ direction.T)[rows]
    return (1.0 + projections) / rows.numel()


class _Lifted:
    """The covariance of the lifted rows (w_i, s b_i) and the weights it gives; s scales the bias to
    the rows' spread, which changes no weight in exact arithmetic and keeps the eigenvalues comparable."""

    def __init__(self, head: EngineHead, rows: torch.Tensor):
        self.head, self.rows = head, rows
        m, d = rows.numel(), head.d
        bias = head.bias[rows]
        self.bias_centre = float(bias.mean())
        centred_bias = torch.zeros(head.n, dtype=torch.float64, device=head.device)
        centred_bias[rows] = bias - self.bias_centre
        spread = float(torch.sqrt(torch.trace(head.covariance) / d))
        deviation = float(torch.sqrt((centred_bias**2).sum() / m))
        self.scale = spread / deviation if deviation > 0 and spread > 0 else 1.0
        self.centred_bias = centred_bias * self.scale
        cross = head.combine(self.centred_bias[None, :])[0] / m  # (1/m) sum_i (w_i - c) s (b_i - b_c): the y_i sum to 0
        covariance = torch.zeros(d + 1, d + 1, dtype=torch.float64, device=head.device)
        covariance[:d, :d] = head.covariance
        covariance[:d, d] = covariance[d, :d] = cross
        covariance[d, d] = float((self.centred_bias**2).sum()) / m
        eigval, eigvec = torch.linalg.eigh(covariance)
        keep = eigval > eigval.max() * (d + 1) * np.finfo(np.float64).eps
        self.precision = (eigvec[:, keep] / eigval[keep]) @ eigvec[:, keep].T
        # how each weight moves per unit of delta: y_i . C^+ e, with e the lifted bias axis
        self.tilt = self._projections(self.precision[:, d:].T)[:, 0]

    def _projections(self, directions: torch.Tensor) -> torch.Tensor:
        """(x_i - c) . direction for every competitor i and every lifted direction: m x B."""
        head, d = self.head, self.head.d
        rows = head.logits(directions[:, :d]).T - head.centre @ directions[:, :d].T
        rows = rows + self.centred_bias[:, None] * directions[:, d][None, :]
        return rows[self.rows]

    def weights(self, batch: np.ndarray, offsets: torch.Tensor):
        """A function (j, own) -> the tilted weights of token batch[j], whose own row is competitor
        ``own`` (m, summing to 1), or None when no positive delta keeps the others' non-negative; its
        ``possible(owns)`` says for the whole batch which tokens it returns weights for."""
        head, m = self.head, self.rows.numel()
        targets = torch.cat([offsets, (head.bias[torch.as_tensor(batch, device=head.device)][:, None]
                                       - self.bias_centre) * self.scale], dim=1)
        base = 1.0 + self._projections(targets @ self.precision)  # m x B: m alpha_i at delta = 0
        tilt = self.tilt
        rising, falling = tilt > 0, tilt < 0

        def of(j: int, own: int):
            others = torch.ones(m, dtype=torch.bool, device=head.device)
            others[own] = False
            a = base[:, j]
            # delta >= -a_i / tilt_i where tilt_i > 0, delta <= a_i / -tilt_i where tilt_i < 0, delta >= 0
            low = torch.clamp((-a[rising & others] / tilt[rising & others]).max(), min=0.0) \
                if bool((rising & others).any()) else torch.tensor(0.0, dtype=torch.float64)
            high = (a[falling & others] / -tilt[falling & others]).min() if bool((falling & others).any()) else None
            if high is None or not float(high) > float(low):
                return None
            delta = 0.5 * (float(low) + float(high))
            return (a + delta * tilt) / m

        def possible(owns: torch.Tensor) -> np.ndarray:
            """For every token of the batch, whether ``of`` returns weights: the same bounds, all columns at once."""
            columns = torch.arange(base.shape[1], device=head.device)
            others = torch.ones_like(base, dtype=torch.bool)
            others[owns, columns] = False
            up, down = rising[:, None] & others, falling[:, None] & others
            low = torch.where(up, -base / torch.where(up, tilt[:, None], 1.0), -torch.inf).max(dim=0).values
            low = torch.clamp(low, min=0.0)
            high = torch.where(down, base / torch.where(down, -tilt[:, None], 1.0), torch.inf).min(dim=0).values
            return (down.any(dim=0) & (high > low)).cpu().numpy()

        of.possible = possible
        return of


def _certificate(head: EngineHead, rows: torch.Tensor, token: int, own: int, alpha: torch.Tensor):
    """The weights without the token's own (rescaled), checked; None when they do not prove it."""
    own_weight = float(alpha[own])
    if own_weight >= 1.0:
        return None
    others = torch.ones(rows.numel(), dtype=torch.bool, device=head.device)
    others[own] = False
    weights = alpha[others] / (1.0 - own_weight)
    if float(weights.min()) < 0:
        return None
    indices = rows[others].cpu().numpy()
    weights = weights.cpu().numpy()
    check = check_convex(head, token, indices, weights)
    return (indices, weights, check.residual, check.bias_gap) if check.accepted else None
