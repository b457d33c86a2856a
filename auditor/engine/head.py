"""The head as the engine sees it: float64 rows on one device, plus what every stage reuses."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from auditor.domain import Domain
from auditor.engine.rounding import logit_error_factor, safe_norm, underflow_floor


@dataclass
class EngineHead:
    """float64 weight and bias on the compute device, with per-row facts computed once.

    ``competitor`` marks the rows a token must beat: one representative per
    group of exact duplicates. ``row_mask`` is 0 on competitors and -inf on the
    other copies, added to logits so that the copies never count as rivals.
    """

    weight: torch.Tensor  # n x d, float64
    bias: torch.Tensor | None  # n, float64
    representative: np.ndarray  # n, smallest id of each row's duplicate group
    competitor: torch.Tensor  # n, bool
    row_mask: torch.Tensor | None  # n, 0 or -inf; None when there are no duplicates
    row_norm: torch.Tensor  # n, ||w_i||
    max_row_norm: float  # over competitors
    typical_row_norm: float  # 10th percentile of the non-zero competitor row norms: a scale no outlier can inflate
    max_abs_bias: float  # over competitors, 0 without bias
    centre: torch.Tensor  # d, mean of the competitor rows
    centre_logits: torch.Tensor  # n, w_i . centre
    domain: Domain
    residual_tol: float  # relative tolerance for the residual of a convex certificate
    row_error: torch.Tensor | None = None  # bound on ||stored row - exact row|| when the rows were derived
    bias_error: torch.Tensor | None = None  # likewise for the bias

    @property
    def n(self) -> int:
        return self.weight.shape[0]

    @property
    def d(self) -> int:
        return self.weight.shape[1]

    @property
    def device(self) -> torch.device:
        return self.weight.device

    @property
    def error_factor(self) -> float:
        return logit_error_factor(self.d)

    @property
    def underflow_floor(self) -> float:
        return underflow_floor(self.d)

    @property
    def n_competitors(self) -> int:
        return int(self.competitor.sum())

    def residual_tolerance(self, k: int) -> float:
        """Largest residual ||sum_i alpha_i w_i - w_k|| a certificate for token k may rest on.

        residual_tol times the larger of ||w_k|| and a typical row norm: the
        token can then lead by at most that fraction of a typical logit scale.
        A few huge rows cannot loosen it, and cancelling huge rows cannot pass.
        """
        return self.residual_tol * max(float(self.row_norm[k]), self.typical_row_norm)

    def exit_tolerance(self) -> float:
        """Residual below which Frank-Wolfe stops and hands its weights to the certificate check."""
        return self.residual_tol * max(self.max_row_norm, np.finfo(np.float64).tiny)

    _precision: torch.Tensor | None = None

    @property
    def precision(self) -> torch.Tensor:
        """Pseudo-inverse of the covariance of the competitor rows (d x d), computed on first use.

        Whitening by it makes an anisotropic head round; verdicts do not change
        under invertible linear maps, but first-order methods converge faster.
        """
        if self._precision is None:
            centred = self.weight[self.competitor] - self.centre
            covariance = centred.T @ centred / max(centred.shape[0], 1)
            eigval, eigvec = torch.linalg.eigh(covariance)
            # Drop the null directions: the rows of a LayerNorm-ed head span only a subspace.
            keep = eigval > eigval.max() * self.d * np.finfo(np.float64).eps
            self._precision = (eigvec[:, keep] / eigval[keep]) @ eigvec[:, keep].T
        return self._precision

    def rows(self, ids) -> np.ndarray:
        """float64 numpy copies of some rows (for the small per-token problems)."""
        index = torch.as_tensor(np.asarray(ids, dtype=np.int64), device=self.device)
        return self.weight.index_select(0, index).cpu().numpy()

    def biases(self, ids) -> np.ndarray:
        if self.bias is None:
            return np.zeros(len(ids))
        index = torch.as_tensor(np.asarray(ids, dtype=np.int64), device=self.device)
        return self.bias.index_select(0, index).cpu().numpy()


def robust_row_norms(weight: torch.Tensor) -> torch.Tensor:
    """Euclidean row norms that do not underflow, without a rescaled copy of the whole head."""
    norms = torch.linalg.vector_norm(weight, dim=1)
    tiny = torch.nonzero(norms < 1e-150).flatten()  # only these can have underflowed
    if tiny.numel():
        norms[tiny] = safe_norm(weight.index_select(0, tiny), dim=1)
    return norms


def _low_quantile(norms: torch.Tensor) -> float:
    positive = norms[norms > 0]
    if positive.numel() == 0:
        return 0.0
    return float(torch.kthvalue(positive.cpu(), max(1, int(0.1 * positive.numel()))).values)


def build_engine_head(weight: torch.Tensor, bias: torch.Tensor | None, representative: np.ndarray,
                      domain: Domain, residual_tol: float, row_error: torch.Tensor | None = None,
                      bias_error: torch.Tensor | None = None) -> EngineHead:
    device = weight.device
    competitor_np = representative == np.arange(representative.shape[0])
    competitor = torch.as_tensor(competitor_np, device=device)
    row_mask = None
    if not competitor_np.all():
        row_mask = torch.zeros(weight.shape[0], dtype=torch.float64, device=device)
        row_mask[~competitor] = -torch.inf
    row_norm = robust_row_norms(weight)
    centre = weight[competitor].mean(dim=0)
    return EngineHead(
        weight=weight,
        bias=bias,
        representative=representative,
        competitor=competitor,
        row_mask=row_mask,
        row_norm=row_norm,
        max_row_norm=float(row_norm[competitor].max()),
        typical_row_norm=_low_quantile(row_norm[competitor]),
        max_abs_bias=0.0 if bias is None else float(bias[competitor].abs().max()),
        centre=centre,
        centre_logits=weight @ centre,
        domain=domain,
        residual_tol=residual_tol,
        row_error=row_error,
        bias_error=bias_error,
    )
