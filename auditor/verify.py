"""Re-check a report's certificates from scratch, the way a third party would.

Nothing here reuses the engine: plain float64 numpy on the caller's weights.
A witness z of token k passes when, for every row i outside k's tie group,
fl(l_k) - fl(l_i) exceeds the rounding bound gamma_{d+2} (||w_i|| ||z|| + |b_i|)
summed for both logits, and z lies in the domain. Convex weights pass when
they are non-negative, avoid k's group, sum to 1 and give a residual (or dual
value) no larger than the one the report states, up to the rounding of this
recomputation, and within the report's tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from auditor.domain import Ball, Box
from auditor.report import AuditReport

_U = 2.0**-53


def _gamma(n: int) -> float:
    return n * _U / (1 - n * _U)


@dataclass
class Verification:
    checked: int = 0
    failed: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failed


def _as_float64(array) -> np.ndarray:
    try:
        import torch

        if isinstance(array, torch.Tensor):
            return array.detach().to(torch.float64).cpu().numpy()
    except ImportError:  # pragma: no cover - torch is a dependency
        pass
    array = np.asarray(array)
    if array.dtype.name == "bfloat16":
        array = array.astype(np.float32)
    return array.astype(np.float64)


def verify(report: AuditReport, weight, bias=None, chunk: int = 512) -> Verification:
    """Check every certificate in ``report`` against ``weight`` and ``bias``; returns a Verification."""
    W = _as_float64(weight)
    b = _as_float64(bias) if bias is not None else np.zeros(W.shape[0])
    n, d = W.shape
    row_norm = np.linalg.norm(W, axis=1)
    result = Verification()
    group = {}
    for k in range(n):
        token = report.tokens[k]
        if token.tied_with:
            group[k] = set(token.tied_with)

    with_witness = [k for k in range(n) if report.tokens[k].witness is not None]
    for start in range(0, len(with_witness), chunk):
        ks = np.array(with_witness[start:start + chunk])
        Z = np.stack([report.tokens[int(k)].witness for k in ks])
        rows = np.arange(len(ks))
        logits = Z @ W.T + b[None, :]
        z_norm = np.linalg.norm(Z, axis=1)
        bound = _gamma(d + 2) * (z_norm[:, None] * row_norm[None, :] * (1 + _gamma(d)) + np.abs(b)[None, :])
        diff = logits[rows, ks][:, None] - logits
        tolerance = bound[rows, ks][:, None] + bound + _U * np.abs(diff)
        wins = diff > tolerance
        wins[rows, ks] = True  # a token is not its own rival, nor are its exact copies
        for j, k in enumerate(ks.tolist()):
            for other in group.get(k, ()):
                wins[j, other] = True
        for j, k in enumerate(ks.tolist()):
            result.checked += 1
            if not (_inside(report.domain, Z[j]) and wins[j].all()):
                result.failed.append(k)

    for k in range(n):
        token = report.tokens[k]
        if token.convex_indices is None:
            continue
        result.checked += 1
        if not _convex_ok(report, W, b, k, token, group.get(k, set())):
            result.failed.append(k)
    result.failed.sort()
    return result


def _inside(domain, z: np.ndarray) -> bool:
    if isinstance(domain, Ball):
        return float(np.linalg.norm(z)) <= domain.radius
    if isinstance(domain, Box):
        return bool(np.all(np.abs(z) <= domain.radius))
    return True


def _convex_ok(report: AuditReport, W, b, k, token, group: set) -> bool:
    idx = np.asarray(token.convex_indices, dtype=np.int64)
    alpha = np.asarray(token.convex_weights, dtype=np.float64)
    if idx.size == 0 or np.any(alpha < 0) or k in idx or group.intersection(idx.tolist()):
        return False
    if abs(alpha.sum() - 1.0) > 1e-9:
        return False
    alpha = alpha / alpha.sum()
    offset = W[k] - alpha @ W[idx]
    gap = b[k] - alpha @ b[idx]
    slack = 4 * _gamma(idx.size + d_plus(W)) * (alpha @ np.linalg.norm(W[idx], axis=1) + np.linalg.norm(W[k]))
    domain = report.domain
    if not domain.bounded:
        residual = np.linalg.norm(offset)
        tol = report.tolerances["weight_tolerance"]
        return residual <= token.residual + slack and token.residual <= tol and gap <= token.bias_gap + slack
    value = domain.support(offset) + gap
    reach = domain.radius * (np.sqrt(W.shape[1]) if isinstance(domain, Box) else 1.0)
    return value <= token.residual + reach * slack + slack


def d_plus(W) -> int:
    return W.shape[1] + 2
