"""The bfloat16 pass of the screen: the Gram products in bfloat16 with float32 accumulation.

On CPUs with AVX512-BF16 and on GPUs a bfloat16 product runs about five times
(CPU) to fifteen times (H100) faster than a float32 one. The pass tries, for
every token k, the centred self-direction z = y_k = w_k - c (c the head's
witness centre, a float32 vector): rival i scores w_i . z, and since every
logit moves by the same c . z, the margin is y_k . y_k - max_i y_i . y_k.

The products y_i . y_k come from the rows rounded to bfloat16,
y'_i = bf16(fl32(w_i - c)), multiplied with float32 accumulation and rounded
to bfloat16 on output. With u_b = 2^-9 and u = 2^-24 the unit roundoffs of
bfloat16 and float32, each stored entry is y_ij (1 + e), |e| <= eps = u_b + u + u_b u
(two correctly rounded operations), the products of two bfloat16 numbers are
exact in float32, any order of float32 summation is within gamma_d of the
exact sum of those products, and the output rounding adds u_b of the sum.
Together (docs/method.md, "The bfloat16 screen"):

    |computed - y_i . y_k| <= phi |y_i|.|y_k| <= phi ||y_i|| ||y_k||,
    phi = (1 + u_b)(1 + gamma_d)(1 + eps)^2 - 1   (0.0059 at d = 768),

plus a floor for gradual underflow. So the exact margin at z = y_k is at least

    ||y_k||^2 - max_i computed_i - phi R ||y_k|| - floor,   R = max_i ||y_i||,

and the token is certified argmaxable when that lower bound exceeds what the
float64 re-check of the witness needs (the float64 rounding of auditor.verify
and the lead of EngineHead.witness_lead). Everything else goes on to the float32
pass, which decides it as before: the close calls lose nothing, and the pass
that proves 97-99.9 % of a real vocabulary costs a fifth of a float32 one.

The allowance rests on float32 accumulation. CUDA may reduce in bfloat16 unless
told not to (``allow_bf16_reduced_precision_reduction``), so the products run
with it off; on every device a probe at first use checks that the backend's
bfloat16 product keeps within the allowance on a sum that bfloat16 accumulation
gets wrong by far. Where the probe fails the pass is skipped (logged at debug level).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from auditor.engine.head import EngineHead, robust_row_norms
from auditor.engine.rounding import UNIT_ROUNDOFF_32, gamma, safe_norm

UNIT_ROUNDOFF_BF16 = 2.0**-9
SMALLEST_SUBNORMAL_BF16 = 2.0**-133
_BLOCK_BUDGET = 1 << 25  # entries of one chunk x n bfloat16 block (64 MiB)
_MIN_ENTRIES = 1 << 22  # heads smaller than this are screened in float32 alone: the pass would not pay
_PROBE_LENGTH = 4096

log = logging.getLogger("auditor")
_probed: dict[str, bool] = {}


def product_error_factor(d: int) -> float:
    """phi: a bfloat16 product of length d, float32 accumulation, is within phi |x|.|y| of the exact one
    of the vectors before their rounding to bfloat16 (and to float32 before that)."""
    eps = UNIT_ROUNDOFF_BF16 + UNIT_ROUNDOFF_32 + UNIT_ROUNDOFF_BF16 * UNIT_ROUNDOFF_32
    return (1 + UNIT_ROUNDOFF_BF16) * (1 + gamma(d, UNIT_ROUNDOFF_32)) * (1 + eps) ** 2 - 1


def underflow_allowance(d: int, size_i: float, size_k: torch.Tensor) -> torch.Tensor:
    """Absolute error gradual underflow may add: entries that round to bfloat16 subnormals (at most
    half the smallest subnormal each, so 2^-134 sqrt(d) (||y_i|| + ||y_k||) in all, doubled for the
    float32 step before), products and sums below float32's range (d + 4 of 2^-149), and the output's rounding."""
    return 2.0**-132 * np.sqrt(d) * (size_i + size_k) + (d + 4) * 2.0**-149 + SMALLEST_SUBNORMAL_BF16


class reduced_precision_off:
    """Inside the block CUDA's bfloat16 products accumulate in float32 (the allowance assumes it);
    the setting found is put back on exit."""

    def __enter__(self):
        self.matmul = torch.backends.cuda.matmul
        self.saved = getattr(self.matmul, "allow_bf16_reduced_precision_reduction", None)
        if self.saved is not None:
            self.matmul.allow_bf16_reduced_precision_reduction = False
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            self.matmul.allow_bf16_reduced_precision_reduction = self.saved


def accumulates_as_assumed(device: torch.device) -> bool:
    """Whether this device's bfloat16 product stays within the allowance on a probe that bfloat16
    accumulation fails: one row of 1 followed by 4095 entries 1 + 2^-7 against rows of ones and of
    alternating signs (exact sums 4096 + 4095 2^-7 and near 0), compared in float64."""
    key = str(device)
    if key not in _probed:
        try:
            x = torch.full((_PROBE_LENGTH,), 1 + 2.0**-7, dtype=torch.float64)
            x[0] = 1.0
            signs = torch.ones(_PROBE_LENGTH, dtype=torch.float64)
            signs[1::2] = -1.0
            other = torch.stack([torch.ones(_PROBE_LENGTH, dtype=torch.float64), signs, x])
            exact = other @ x
            with reduced_precision_off():
                computed = (other.to(torch.bfloat16).to(device) @ x.to(torch.bfloat16).to(device)[:, None])
            computed = computed[:, 0].to(torch.float64).cpu()
            allowance = product_error_factor(_PROBE_LENGTH) * (other.abs() @ x.abs())
            _probed[key] = bool(torch.all((computed - exact).abs() <= allowance))
        except RuntimeError as error:  # no bfloat16 product on this device
            log.debug("bfloat16 screen off on %s: %s", key, error)
            _probed[key] = False
    return _probed[key]


def applies(head: EngineHead) -> bool:
    """The pass covers float32 heads without a bias whose rows are exact (not derived), when they are large
    enough for it to pay and the device's product accumulates as the allowance assumes."""
    if not (head.weight.dtype == torch.float32 and head.bias is None and head.row_error is None
            and head.n * head.d >= _MIN_ENTRIES):
        return False
    if not accumulates_as_assumed(head.device):
        log.debug("bfloat16 screen off on %s: its bfloat16 products do not keep within the allowance "
                  "(float32 accumulation); the float32 screen decides every token", head.device)
        return False
    return True


def bfloat16_pass(head: EngineHead, ids: np.ndarray, progress=None):
    """(certified, margin, scale, runner_up) for tokens ``ids`` at the witnesses z = s (w_k - c): ``margin`` a
    lower bound on the exact margin (unit-ball margin when unbounded, as the float32 pass reports it)."""
    device, n, d = head.device, head.n, head.d
    count = len(ids)
    certified = np.zeros(count, dtype=bool)
    margin = np.full(count, -np.inf)
    scale = np.ones(count)
    runner_up = np.full(count, -1, dtype=np.int64)
    centre = head.witness_centre.to(torch.float32)
    rows = torch.empty(n, d, dtype=torch.bfloat16, device=device)
    for s in range(0, n, 4096):
        rows[s:s + 4096] = (head.weight[s:s + 4096] - centre).to(torch.bfloat16)
    size = robust_row_norms(head.weight, head.witness_centre) * (1 + gamma(d + 2))  # >= ||w_i - c||
    reach = float(size[head.competitor].max())
    phi = product_error_factor(d)
    others = torch.nonzero(~head.competitor).flatten()  # copies of duplicated rows: never rivals
    chunk = max(1, min(count, 4096, _BLOCK_BUDGET // n))
    gram = torch.empty(chunk, n, dtype=torch.bfloat16, device=device)
    with reduced_precision_off():
        for start in range(0, count, chunk):
            part = slice(start, min(start + chunk, count))
            k = torch.as_tensor(ids[part], device=device)
            cols = torch.arange(k.numel(), device=device)
            block = gram[:k.numel()]
            torch.matmul(rows.index_select(0, k), rows.T, out=block)
            block[cols, k] = -torch.inf  # the token is not its own rival
            if others.numel():
                block.index_fill_(1, others, -torch.inf)
            top, rival = block.max(dim=1)
            own = size[k] / (1 + gamma(d + 2))  # the computed norm, within gamma_{d+2} of ||y_k||
            own_low = own * own * (1 - 4 * gamma(d + 4))  # <= ||y_k||^2
            top = top.to(torch.float64)
            allowance = phi * reach * size[k] + underflow_allowance(d, reach, size[k])
            # and the rounding of this float64 arithmetic itself (a few operations on these magnitudes)
            lower = own_low - top - allowance - 8 * 2.0**-53 * (own_low + top.abs() + allowance)
            directions = head.rows64(k) - head.witness_centre
            s_k = head.domain.largest_scales(directions) if head.domain.bounded else torch.ones_like(lower)
            # what the float64 re-check of z = s y_k needs: its rounding bound and the verdict rule's lead
            norm_z = s_k * safe_norm(directions, dim=1) * (1 + 2.0**-20)
            needed = (head.error_factor * (head.row_norm[k] + head.max_row_norm) * norm_z + head.underflow_floor
                      + head.witness_lead(k, norm_z))
            won = (s_k * lower * (1 - 2.0**-52) > needed) & torch.isfinite(top)
            if head.domain.bounded:
                won &= head.domain.contains_rows(directions * s_k[:, None], safe_norm)
            won_np = won.cpu().numpy()
            certified[part] = won_np
            reported = (lower * s_k) if head.domain.bounded else lower / (size[k])
            margin[part] = np.where(won_np, reported.cpu().numpy(), -np.inf)
            scale[part] = s_k.cpu().numpy()
            runner_up[part] = rival.cpu().numpy()
            if progress is not None:
                progress.update(int(won_np.sum()))
    log.debug("bfloat16 screen on %s: %d of %d tokens proved, the float32 pass takes the rest",
              device, int(certified.sum()), count)
    return certified, margin, scale, runner_up
