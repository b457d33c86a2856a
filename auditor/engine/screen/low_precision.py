"""The bfloat16 pass of the screen: the Gram products in bfloat16 with float32 accumulation.

On CPUs with AVX512-BF16 and on GPUs a bfloat16 product runs about five times
(CPU) to fifteen times (H100) faster than a float32 one. The pass tries, for
every token k, the witness z = s y_k, y_k = w_k - c the centred self-direction
(c the head's witness centre) and s 1 when unbounded, else the largest scale
inside the domain: rival i scores s y_i . y_k + b_i plus s c . y_k, which is the
same for every rival, so the margin is s y_k . y_k + b_k - max_i (s y_i . y_k + b_i).

The products y_i . y_k come from the rows rounded to bfloat16,
y'_i = bf16(fl(w_i - c)), multiplied with float32 accumulation and rounded to
bfloat16 on output. With u_b = 2^-8 and u = 2^-24 the unit roundoffs of bfloat16
and float32, each stored entry is y_ij (1 + e), |e| <= eps = (1 + u_b)(1 + u)(1 + 2^-53) - 1
(at most three correctly rounded steps), the products of two bfloat16 numbers
are exact in float32, any order of float32 summation is within gamma_d(2u) of
the exact sum of those products (2u: summation that truncates, as some
accelerators do, as well as rounding to nearest), and the output rounding adds
u_b of the sum. Together (docs/method.md, "The bfloat16 pass"):

    |computed - y_i . y_k| <= phi |y_i|.|y_k| <= phi ||y_i|| ||y_k||,
    phi = (1 + u_b)(1 + gamma_d(2u))(1 + eps)^2 - 1   (0.0119 at d = 768),

plus a floor for underflow (subnormals flushed to zero). So the exact margin
at y_k is at least

    ||y_k||^2 - max_i computed_i - phi R ||y_k|| - floor,   R = max_i ||y_i||,

scaled by s. With a bias, the bias rides in the same product as one more column
(b_i against bf16(1/s) in the token's row), so a biased head costs what an
unbiased one does; its rounding joins phi's sum. The token is certified
argmaxable when that lower bound exceeds what the float64 re-check of the
witness needs (the float64 rounding of auditor.verify, derived rows' error
bounds and the lead of EngineHead.witness_lead). Everything
else goes on to the float32 pass, which decides it as before: the close calls
lose nothing, and the pass that proves 97-99.9 % of a real vocabulary costs a
fifth of a float32 one.

The allowance rests on float32 accumulation. The pass runs only on CPUs and
CUDA devices; CUDA may reduce in bfloat16 unless told not to
(``allow_bf16_reduced_precision_reduction``), so the products run with it off;
and on each device a probe at first use, on the call the pass makes, checks
that the backend's bfloat16 product keeps within the allowance on sums that
bfloat16 accumulation gets wrong by far. Where the probe fails the pass is
skipped (logged at debug level).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from auditor.engine.arithmetic.head import EngineHead
from auditor.engine.arithmetic.rounding import (SMALLEST_NORMAL_32, UNIT_ROUNDOFF, UNIT_ROUNDOFF_32, UNIT_ROUNDOFF_BF16,
                                                float32_towards_zero, gamma, safe_norm)
from auditor.engine.exact.certify import derived_error

_BLOCK_BUDGET = 1 << 25  # entries of one chunk x n bfloat16 block (64 MiB)
_PROBE_LENGTH = 4096

log = logging.getLogger("auditor")
_probed: dict[str, bool] = {}


def product_error_factor(d: int) -> float:
    """phi: a bfloat16 product of length d, float32 accumulation, is within phi |x|.|y| of the exact one
    of the vectors before their rounding to bfloat16 (and to float32 and float64 before that).

    Each entry carries up to three correctly rounded steps (the difference in float64 or float32, a
    float64 head's conversion through float32, bfloat16). The float32 sums are allowed a unit of 2^-23,
    not 2^-24: some accelerators add with the terms aligned and truncated (round towards zero), which
    doubles the error of each addition."""
    eps = (1 + UNIT_ROUNDOFF_BF16) * (1 + UNIT_ROUNDOFF_32) * (1 + UNIT_ROUNDOFF) - 1
    return (1 + UNIT_ROUNDOFF_BF16) * (1 + gamma(d, 2 * UNIT_ROUNDOFF_32)) * (1 + eps) ** 2 - 1


def underflow_allowance(d: int, size_i: float, size_k: torch.Tensor) -> torch.Tensor:
    """Absolute error underflow may add where the products flush subnormals to zero (AVX512-BF16 does):
    entries below 2^-126 lost (2^-126 sqrt(d) (||y_i|| + ||y_k||) in all, doubled), products and sums
    below float32's normal range each flushed on its own (2d + 4 of 2^-126, whether or not a kernel
    fuses them), and the output's rounding."""
    return 2 * SMALLEST_NORMAL_32 * np.sqrt(d) * (size_i + size_k) + (2 * d + 5) * SMALLEST_NORMAL_32


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
    """Whether this device's bfloat16 product stays within the allowance, checked once per device on the
    call the pass makes (a block of rows times the transpose of another, written into a bfloat16 block)
    with data that bfloat16 accumulation gets wrong by far: rows of one 1 and 4095 entries 1 + 2^-7, of
    ones, of alternating signs, and irregular rows with cancellation, compared in float64. The pass runs
    only on CPUs and CUDA devices, whose bfloat16 products accumulate in float32 (CUDA with the
    reduced-precision reduction switched off); the probe is the sanity check of that."""
    key = str(device)
    if key not in _probed and device.type not in ("cpu", "cuda"):
        _probed[key] = False
    if key not in _probed:
        try:
            generator = torch.Generator().manual_seed(0xBF16)
            x = torch.full((_PROBE_LENGTH,), 1 + 2.0**-7, dtype=torch.float64)
            x[0] = 1.0
            signs = torch.ones(_PROBE_LENGTH, dtype=torch.float64)
            signs[1::2] = -1.0
            irregular = torch.randn(61, _PROBE_LENGTH, generator=generator, dtype=torch.float64) * torch.exp(
                2 * torch.randn(61, 1, generator=generator, dtype=torch.float64))
            left = torch.cat([torch.ones(1, _PROBE_LENGTH, dtype=torch.float64), signs[None], x[None], irregular])
            right = torch.cat([x[None], irregular.flip(0)[:40] + 0.5, left[:3]])
            exact = left.to(torch.bfloat16).to(torch.float64) @ right.to(torch.bfloat16).to(torch.float64).T
            block = torch.empty(left.shape[0], right.shape[0], dtype=torch.bfloat16, device=device)
            with reduced_precision_off():
                torch.matmul(left.to(torch.bfloat16).to(device), right.to(torch.bfloat16).to(device).T, out=block)
            computed = block.to(torch.float64).cpu()
            allowance = product_error_factor(_PROBE_LENGTH) * (left.abs() @ right.abs().T)
            _probed[key] = bool(torch.all((computed - exact).abs() <= allowance))
        except RuntimeError as error:  # no bfloat16 product on this device
            log.debug("bfloat16 screen off on %s: %s", key, error)
            _probed[key] = False
    return _probed[key]


def applies(head: EngineHead) -> bool:
    """The pass covers heads without a bias in any domain and heads with one in a bounded domain (the norm
    domain's reduced head among them), of at least head.bfloat16_entries entries (EngineOptions), with rows
    and biases in a range where bfloat16 keeps its relative precision, on a device whose product
    accumulates as assumed."""
    if not (head.n * head.d >= head.bfloat16_entries and (head.bias is None or head.domain.bounded)
            and 2.0**-40 <= head.typical_spread and head.max_row_norm <= 2.0**40 and head.max_abs_bias <= 2.0**60):
        return False
    if not accumulates_as_assumed(head.device):
        log.debug("bfloat16 screen off on %s: its bfloat16 products do not keep within the allowance "
                  "(float32 accumulation); the float32 screen decides every token", head.device)
        return False
    return True


@dataclass
class CentredRows:
    """The head's rows less the witness centre, y'_i = bf16(fl(w_i - c)); with a bias one more column
    holds bf16(b~_i), b~ = b - b0 with b0 the midpoint of the rivals' biases, and zero columns pad the
    width to a multiple of 16 (they add exact zeros to every product)."""

    values: torch.Tensor  # n x width, bfloat16
    size: torch.Tensor  # >= ||w_i - c|| per row (float64)
    reach: float  # R >= every rival's ||w_i - c||
    shifted: torch.Tensor | None  # b~ (float64), None without a bias
    spread: float  # >= max |b~_i| over the rivals, 0 without a bias


def centred_rows(head: EngineHead) -> CentredRows:
    """The pass's copy of the head, by blocks: w_i - c formed in float64 from the rows as the engine holds
    them (EngineHead.rows64: rows stored as 2^a v are scaled there, exactly, so no scaled copy of the head is
    made), rounded to float32 and then to bfloat16: three rounding steps, as product_error_factor allows (for
    a float32 head and c a float32 vector the float64 difference is exact but where their exponents lie
    more than 29 apart, and its float32 rounding the float32 difference). It is half a float32 head; the
    screen keeps it for the whitened witnesses too. The norms are those of the same float64 offsets."""
    shifted, spread = None, 0.0
    if head.bias is not None:
        rival_bias = head.bias[head.competitor]
        shifted = head.bias - 0.5 * (float(rival_bias.max()) + float(rival_bias.min()))
        spread = float(shifted[head.competitor].abs().max()) * (1 + 2.0**-50)  # >= max |b~_i|, exact or computed
    width = head.d if shifted is None else -(-(head.d + 1) // 16) * 16
    values = torch.empty(head.n, width, dtype=torch.bfloat16, device=head.device)
    size = torch.empty(head.n, dtype=torch.float64, device=head.device)
    for s in range(0, head.n, 4096):
        offsets = head.rows64(torch.arange(s, min(s + 4096, head.n), device=head.device)) - head.witness_centre
        values[s:s + 4096, :head.d] = offsets.to(torch.float32).to(torch.bfloat16)
        size[s:s + 4096] = torch.linalg.vector_norm(offsets, dim=1)
    tiny = torch.nonzero(size < 1e-150).flatten()  # only these can have underflowed
    if tiny.numel():
        size[tiny] = safe_norm(head.rows64(tiny) - head.witness_centre, dim=1)
    if shifted is not None:
        values[:, head.d + 1:] = 0
        values[:, head.d] = shifted.to(torch.bfloat16)
    size = size * (1 + gamma(head.d + 2))
    return CentredRows(values, size, float(size[head.competitor].max()), shifted, spread)


def _strongest_rivals(left: torch.Tensor, rows: CentredRows, k: torch.Tensor, others: torch.Tensor,
                      block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest product of each left row with a rival's centred row, and that rival: the products go
    into ``block`` (bfloat16, one row per token), with the token's own column and the copies of duplicated
    rows (``others``) masked out."""
    torch.matmul(left, rows.values.T, out=block)
    block[torch.arange(block.shape[0], device=block.device), k] = -torch.inf  # the token is not its own rival
    if others.numel():
        block.index_fill_(1, others, -torch.inf)
    return block.max(dim=1)


def recheck_needs(head: EngineHead, k: torch.Tensor, norm_z: torch.Tensor) -> torch.Tensor:
    """What the float64 re-check of a witness of norm at most ``norm_z`` for tokens k needs it to lead by:
    its rounding bound, the derived rows' error bounds (the norm domain's) and the verdict rule's lead."""
    own_bias = head.bias[k].abs() if head.bias is not None else 0.0
    return (head.error_factor * ((head.row_norm[k] + head.max_row_norm) * norm_z + head.max_abs_bias + own_bias)
            + head.underflow_floor + derived_error(head, k, norm_z) + head.witness_lead(k, norm_z))


def bias_allowance(phi: float, s_k: torch.Tensor, sigma: torch.Tensor, spread: float,
                   own: torch.Tensor) -> torch.Tensor:
    """What the bias column adds to the pass's allowance: its share of the product's error,
    s phi sigma |b~_i| <= s phi sigma B; the scale's mismatch, |s sigma - 1| B (s sigma is exact in
    float64: a float32 value times a bfloat16 one); and the float64 rounding of b~ (own the token's)."""
    return s_k * phi * sigma * spread + ((s_k * sigma - 1).abs() + 2.0**-50) * spread + 2.0**-50 * (own.abs() + spread)


def _proved(head: EngineHead, k: torch.Tensor, z: torch.Tensor, norm_z: torch.Tensor, lower: torch.Tensor,
            top: torch.Tensor, valid: torch.Tensor) -> np.ndarray:
    """Which witnesses z (tokens k, ``norm_z`` >= ||z||) a low-precision bound proves: the lower bound ``lower``
    of the margin exceeds what the float64 re-check needs, ``top`` is finite, ``valid`` holds and z lies in the
    domain."""
    won = (lower * (1 - 2.0**-52) > recheck_needs(head, k, norm_z)) & torch.isfinite(top) & valid
    if head.domain.bounded:
        won &= head.domain.contains_rows(z, safe_norm)
    return won.cpu().numpy()


def record_self_witnesses(head: EngineHead, k: torch.Tensor, lower: torch.Tensor, top: torch.Tensor,
                          valid: torch.Tensor, directions: torch.Tensor, s_k: torch.Tensor, size_k: torch.Tensor,
                          rival: torch.Tensor, part: slice, out: tuple, progress=None) -> None:
    """A low-precision pass's verdicts for one chunk of tokens k at z = s_k (w_k - c): certified where the lower
    bound ``lower`` of the margin there exceeds what the float64 re-check needs, ``top`` is finite and z lies in
    the domain; recorded into ``out`` = (certified, margin, scale, runner_up) at ``part``, the margin per unit
    of ||z|| when unbounded (``size_k`` >= ||w_k - c||)."""
    certified, margin, scale, runner_up = out
    norm_z = s_k * safe_norm(directions, dim=1) * (1 + 2.0**-20)  # >= ||z||, z = s y_k
    won_np = _proved(head, k, directions * s_k[:, None], norm_z, lower, top, valid)
    certified[part] = won_np
    reported = lower if head.domain.bounded else lower / size_k
    margin[part] = np.where(won_np, reported.cpu().numpy(), -np.inf)
    scale[part] = s_k.cpu().numpy()
    runner_up[part] = rival.cpu().numpy()
    if progress is not None:
        progress.update(int(won_np.sum()))


def witness_outcomes(head: EngineHead, k: torch.Tensor, witnesses: torch.Tensor, norm_z: torch.Tensor,
                     lower: torch.Tensor, top: torch.Tensor, valid: torch.Tensor, rival: torch.Tensor,
                     lead: torch.Tensor, allowance: torch.Tensor, name: str):
    """A low-precision check of given witnesses z (tokens k, ``norm_z`` >= ||z||) as (certified, margin,
    runner_up, lead, allowance) numpy arrays: certified where the lower bound ``lower`` of the margin at z
    exceeds what the float64 re-check needs, ``top`` is finite, ``valid`` holds and z lies in the domain;
    ``margin`` is ``lower`` there. ``lead`` and ``allowance`` split the rest for the float64 check."""
    won_np = _proved(head, k, witnesses, norm_z, lower, top, valid)
    log.debug("%s witnesses on %s: %d of %d proved, the float64 check takes the close calls",
              name, head.device, int(won_np.sum()), len(won_np))
    return (won_np, np.where(won_np, lower.cpu().numpy(), -np.inf), rival.cpu().numpy(),
            lead.cpu().numpy(), allowance.cpu().numpy())


def bfloat16_pass(head: EngineHead, ids: np.ndarray, progress=None, rows: CentredRows | None = None):
    """(certified, margin, scale, runner_up) for tokens ``ids`` at the witnesses z = s (w_k - c), s = 1 when
    unbounded and otherwise the largest scale inside the domain: ``margin`` a lower bound on the exact
    margin (the unit-ball margin when unbounded, as the float32 pass reports it). ``rows`` is the
    head's centred_rows, made here when not given.

    With a bias b the logits at z are s y_i . y_k + b_i + s c . y_k; the last term is common to all, and
    so is any constant taken from every bias: the pass uses b~ = b - b0. The bias rides in the product
    as one more column: [y_k, sigma_k] . [y_i, b~_i] with sigma_k = bf16(1 / s_k), so that s_k times the
    product is the logit up to (s_k sigma_k - 1) b~_i, and the allowance of the product covers the
    bias's rounding with the rest."""
    device, n, d = head.device, head.n, head.d
    count = len(ids)
    certified = np.zeros(count, dtype=bool)
    margin = np.full(count, -np.inf)
    scale = np.ones(count)
    runner_up = np.full(count, -1, dtype=np.int64)
    biased = head.bias is not None
    rows = rows if rows is not None else centred_rows(head)
    shifted, spread, size, reach = rows.shifted, rows.spread, rows.size, rows.reach
    width = rows.values.shape[1]
    phi = product_error_factor(width)
    others = torch.nonzero(~head.competitor).flatten()  # copies of duplicated rows: never rivals
    chunk = max(1, min(count, 4096, _BLOCK_BUDGET // n))
    gram = torch.empty(chunk, n, dtype=torch.bfloat16, device=device)
    with reduced_precision_off():
        for start in range(0, count, chunk):
            part = slice(start, min(start + chunk, count))
            k = torch.as_tensor(ids[part], device=device)
            block = gram[:k.numel()]
            left = rows.values.index_select(0, k)
            directions = head.rows64(k) - head.witness_centre
            s_k = (float32_towards_zero(head.domain.largest_scales(directions)) if head.domain.bounded
                   else torch.ones(k.numel(), dtype=torch.float64, device=device))
            valid = torch.isfinite(s_k) & (s_k > 0)
            if biased:
                sigma = torch.where(valid, 1 / s_k, torch.ones_like(s_k)).to(torch.bfloat16)
                valid &= (sigma.to(torch.float64) >= 2.0**-120) & (sigma.to(torch.float64) <= 2.0**120)
                left[:, d] = sigma
                sigma = sigma.to(torch.float64)
            top, rival = _strongest_rivals(left, rows, k, others, block)
            top = s_k * top.to(torch.float64)
            own = size[k] / (1 + gamma(d + 2))  # the computed norm, within gamma_{d+2} of ||y_k||
            own_low = own * own * (1 - 4 * gamma(d + 4))  # <= ||y_k||^2
            lead = s_k * own_low
            if biased:
                lead = lead + shifted[k]
                # |g_ik - (y_i . y_k + sigma_k b~_i)| <= phi (|y_i|.|y_k| + sigma_k |b~_i|) + underflow; the
                # logit gap is s_k (own - g_ik) + b~_k - b~_i ... less (s_k sigma_k - 1) b~_i, and b~'s own
                # float64 rounding
                slack = (s_k * (phi * reach * size[k] + underflow_allowance(width, reach + spread, size[k] + sigma))
                         + bias_allowance(phi, s_k, sigma, spread, shifted[k]))
            else:
                slack = s_k * (phi * reach * size[k] + underflow_allowance(d, reach, size[k]))
            # and the rounding of this float64 arithmetic itself (a few operations on these magnitudes)
            lower = lead - top - slack - 8 * UNIT_ROUNDOFF * (lead.abs() + top.abs() + slack)
            record_self_witnesses(head, k, lower, top, valid, directions, s_k, size[k], rival, part,
                                  (certified, margin, scale, runner_up), progress)
    log.debug("bfloat16 screen on %s: %d of %d tokens proved, the float32 pass takes the rest",
              device, int(certified.sum()), count)
    return certified, margin, scale, runner_up


def bfloat16_witnesses(head: EngineHead, ids: np.ndarray, witnesses: torch.Tensor, rows: CentredRows):
    """Given witnesses z_k (B x d, float64) of tokens ``ids`` on a head without a bias, from one bfloat16
    product with the centred rows: (certified, margin, runner_up, lead, allowance) as numpy arrays.

    The logit gap to rival i is z . (y_k - y_i) (the centre's logit is common to all). The own term is
    a float64 product of fl(w_k - c) and z, within gamma_{d+2} ||z|| ||y_k|| of z . y_k; each rival's
    comes from the bfloat16 product within phi ||z|| R plus the underflow term, z's own rounding to
    bfloat16 being one of the entries' roundings. ``lead`` is the computed gap and ``allowance`` the sum
    of those bounds; a token is certified when lead - allowance exceeds what the float64 re-check of z
    needs (as in the pass), and z lies in the domain. ``margin`` is then that lower bound of the exact
    gap; the rest (the close calls among them) are for the float64 check to decide."""
    device, n, d = head.device, head.n, head.d
    k = torch.as_tensor(ids, device=device)
    own = ((head.rows64(k) - head.witness_centre) * witnesses).sum(dim=1)
    norm_z = safe_norm(witnesses, dim=1) * (1 + 2.0**-20)
    top = torch.empty(len(ids), dtype=torch.float64, device=device)
    rival = torch.empty(len(ids), dtype=torch.int64, device=device)
    others = torch.nonzero(~head.competitor).flatten()
    chunk = max(1, min(len(ids), 4096, _BLOCK_BUDGET // n))
    gram = torch.empty(chunk, n, dtype=torch.bfloat16, device=device)
    with reduced_precision_off():
        for start in range(0, len(ids), chunk):
            part = slice(start, min(start + chunk, len(ids)))
            block = gram[:part.stop - part.start]
            best, rival[part] = _strongest_rivals(witnesses[part].to(torch.bfloat16), rows, k[part], others, block)
            top[part] = best.to(torch.float64)
    lead = own - top
    allowance = (product_error_factor(d) * rows.reach * norm_z + underflow_allowance(d, rows.reach, norm_z)
                 + gamma(d + 2) * norm_z * rows.size[k])
    # and the rounding of this float64 arithmetic itself
    lower = lead - allowance - 8 * UNIT_ROUNDOFF * (own.abs() + top.abs() + allowance)
    return witness_outcomes(head, k, witnesses, norm_z, lower, top, torch.ones_like(top, dtype=torch.bool), rival,
                            lead, allowance, "bfloat16")
