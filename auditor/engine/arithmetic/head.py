"""The head as the engine sees it: its rows on one device, plus what every stage reuses.

The rows are kept as given when they are float16 or bfloat16 (every entry is
a float32 value: the stages widen a block of rows at a time, exactly, where
they compute), in float32 when every entry is a float32 value, otherwise in
float64. Nothing holds a float64 copy of the whole head, nor a float32 copy
of a half-precision one: the products are formed by blocks of rows
(``logits``, ``combine``, ``fast_logits``, ``narrow_blocks``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from auditor.engine.arithmetic.power_of_two import float32_times_power, normalised_points, scaled_exactly
from auditor.engine.arithmetic.rounding import (SMALLEST_SUBNORMAL_32, UNIT_ROUNDOFF, UNIT_ROUNDOFF_32, gamma,
                                                ieee_float32_products, logit_error_factor, underflow_floor)
from auditor.engine.arithmetic.row_statistics import (_BLOCK_ROWS, HALF_DTYPES, RowFacts, low_quantile, median_row,
                                                      row_facts)
from auditor.question.domain import Domain
from auditor.util.arrays import row_blocks

# The head sizes (n d) from which the screen runs the bfloat16 pass and tries whitened witnesses: below
# them neither pays for itself. Defaults of EngineOptions and EngineHead, read when those are made.
BFLOAT16_ENTRIES = 1 << 22
WHITENED_ENTRIES = 1 << 22
# From this size a head without a bias is screened by the int8 pass (integer_pass.py) where the device's int8
# product is exact, and by the bfloat16 pass otherwise.
INT8_ENTRIES = 1 << 22
# The covariance's work (n d^2) from which its products are float32's on a float32 or half-precision head
# (EngineHead.covariance): the Llama-3 shape's at width 1024 and up, not the GPT-2 shape's.
FLOAT32_COVARIANCE_WORK = 1 << 36


@dataclass
class EngineHead:
    """The weight (float32 or float64) and a float64 bias on the compute device, with per-row facts computed once.

    ``competitor`` marks the rows a token must beat: one representative per
    group of exact duplicates. ``row_mask`` is 0 on competitors and -inf on the
    other copies, added to logits so that the copies never count as rivals.
    """

    # n x d: float16 or bfloat16 as given, float32 when that is exact, else float64; the rows are 2^exponent
    # times these (for half-precision ones, 2^exponent times their float32 values, itself a float32 array)
    stored: torch.Tensor
    bias: torch.Tensor | None  # n, float64
    representative: np.ndarray  # n, smallest id of each row's duplicate group
    competitor: torch.Tensor  # n, bool
    row_mask: torch.Tensor | None  # n, 0 or -inf; None when there are no duplicates
    row_norm: torch.Tensor  # n, ||w_i||
    max_row_norm: float  # over competitors
    spread_norm: torch.Tensor  # n, an upper bound on ||w_i - m||, m the coordinate-wise median row
    typical_spread: float  # 10th percentile of the non-zero competitor spreads: a scale no outlier can inflate
    max_spread: float  # over competitors
    max_abs_bias: float  # over competitors, 0 without bias
    centre: torch.Tensor  # d, mean of the competitor rows
    witness_centre: torch.Tensor  # d, the centre c of formula witnesses s (w_k - t c): rounded to the storage
    centre_logits: torch.Tensor  # n, w_i . witness_centre
    domain: Domain
    residual_tol: float  # relative tolerance for the residual of a convex certificate
    row_error: torch.Tensor | None = None  # bound on ||stored row - exact row|| when the rows were derived
    bias_error: torch.Tensor | None = None  # likewise for the bias
    # (weight, bias, domain) as the caller gave them, when those numbers are exact (not the norm domain's
    # derived rows) but the normal form rounded them: a dual value zero up to rounding has its sign
    # settled on them in rational arithmetic (on the head's own rows when they carry no error)
    exact_source: tuple | None = None
    decide_at_tolerance: bool = True  # see EngineOptions; witnesses then lead by more than witness_lead
    # the origin of the coordinates the rows were given in, in this head's (normal form) coordinates; None: 0
    origin: torch.Tensor | None = None
    # the sizes (n d) from which the screen runs the bfloat16 pass and tries whitened witnesses (EngineOptions)
    bfloat16_entries: int = field(default_factory=lambda: BFLOAT16_ENTRIES)
    whitened_entries: int = field(default_factory=lambda: WHITENED_ENTRIES)
    int8_entries: int = field(default_factory=lambda: INT8_ENTRIES)
    # the rows are 2^exponent ``stored``: a float32 head kept as it is in a few tokens' audit (the normal form's
    # carry), 2^exponent ``stored`` a float32 array; the passes such an audit makes take the power of two on
    # their side (rows64, blocks, the screen's products), and ``weight`` makes the scaled copy for any other,
    # once, shared with the copies dataclasses.replace makes of this head
    exponent: int = 0
    _scaled_copy: list = field(default_factory=list, repr=False)

    @property
    def weight(self) -> torch.Tensor:
        """The rows (n x d) in float32 or float64: ``stored``, or with an exponent (or half-precision storage)
        its scaled float32 copy, made on first use. The stages read the rows through the methods below, which
        make no such copy."""
        if self.exponent == 0 and not self.half:
            return self.stored
        made = [rows for source, exponent, rows in self._scaled_copy if source is self.stored and exponent == self.exponent]
        if made:
            return made[0]
        rows, _ = scaled_exactly(self.stored.to(torch.float32) if self.half else self.stored, self.exponent, "head")
        self._scaled_copy.append((self.stored, self.exponent, rows))
        return rows

    @property
    def half(self) -> bool:
        """Whether the rows are stored in float16 or bfloat16 (widened by blocks where products are formed)."""
        return self.stored.dtype in HALF_DTYPES

    @property
    def fast_dtype(self) -> torch.dtype:
        """The precision of the fast products (fast_logits, the screen's pass): float32 unless the rows are
        float64."""
        return torch.float64 if self.stored.dtype == torch.float64 else torch.float32

    def narrow_blocks(self, scaled: bool, start: int = 0, stop: int | None = None):
        """(start, stop, float32 rows) over rows start..stop-1 of a half-precision head, a block at a time:
        the stored rows widened (exact), times 2^exponent with ``scaled`` (exact too: 2^exponent times the
        widened rows is a float32 array, normal_form's carry)."""
        stop = self.n if stop is None else stop
        step = _narrow_rows(self.d)
        buffer = torch.empty(min(step, max(stop - start, 0)), self.d, dtype=torch.float32, device=self.device)
        for s in range(start, stop, step):  # one buffer, reused: each block is spent before the next is read
            e = min(stop, s + step)
            rows = buffer[:e - s]
            if scaled and self.exponent:  # 2^a in float64, where it is a number whatever a (not so in float32)
                rows.copy_(self.stored[s:e].to(torch.float64).mul_(self.power))
            else:
                rows.copy_(self.stored[s:e])
            yield s, e, rows

    @property
    def max_row_error(self) -> float:
        return float(self.row_error[self.competitor].max()) if self.row_error is not None else 0.0

    @property
    def max_bias_error(self) -> float:
        return float(self.bias_error[self.competitor].max()) if self.bias_error is not None else 0.0

    @property
    def n(self) -> int:
        return self.stored.shape[0]

    @property
    def d(self) -> int:
        return self.stored.shape[1]

    @property
    def device(self) -> torch.device:
        return self.stored.device

    @property
    def power(self) -> float:
        """2^exponent: a float64 (|exponent| stays far inside its range), exact times any float32 entry."""
        return math.ldexp(1.0, self.exponent)

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

        residual_tol times the larger of ||w_k - m|| and a typical ||w_i - m||,
        m the coordinate-wise median row: the token can then lead by at most that
        fraction of the logit differences the rows make. Measured from m, not the origin,
        so that a common offset of all rows (which changes no verdict) cannot
        loosen it; a few far rows cannot either. A hair below the rule
        auditor.verify applies, so that its own rounding cannot disagree.
        """
        return _STRICTER * self.residual_tol * max(float(self.spread_norm[k]), self.typical_spread)

    def witness_lead(self, k: torch.Tensor, norm_z: torch.Tensor) -> torch.Tensor:
        """How much more than 0 the exact margin of token k at a witness of norm ``norm_z`` must be for the
        token to be argmaxable. Without it a token that leads by a hair would hold a witness and, within
        residual_tolerance, convex weights too, and its verdict would depend on which the search met first.
        The rule is one of the head, not the search: k is argmaxable iff it leads somewhere by more than
        residual_tol * max(||w_k - m||, t) times ||z|| (unbounded) or times the domain's reach (bounded).
        Unbounded, the largest such ratio is the least residual of convex weights with a bias gap <= 0;
        bounded, the largest lead is the least dual value: the two certificates meet at one threshold
        (convex weights are accepted a hair below it, residual_tolerance)."""
        if not self.decide_at_tolerance:
            return torch.zeros_like(norm_z)
        scale = self.residual_tol * torch.clamp(self.spread_norm[k], min=self.typical_spread)
        return scale * (self.domain.reach(self.d) if self.domain.bounded else norm_z)

    def exit_tolerance(self) -> float:
        """Residual below which Frank-Wolfe stops and hands its weights to the certificate check."""
        return self.residual_tol * max(self.max_spread, np.finfo(np.float64).tiny)

    _precision: torch.Tensor | None = None
    _covariance: torch.Tensor | None = None
    _covariance_unit: float = UNIT_ROUNDOFF  # the unit roundoff of the covariance's products

    @property
    def covariance(self) -> torch.Tensor:
        """Covariance of the competitor rows (d x d), computed on first use.

        It only steers (whitening, Newton's preconditioners and step limits, the routes around the centre),
        so on a large float32 or half-precision head, where its n d^2 products cost as much as a stage, they
        are float32's: float64 sums of the float32 products of blocks of rows less the centre (rounded to
        float32), about twice as fast as float64's (at 32768 x 4096 the two differ by 6e-9 of the largest
        eigenvalue). ``precision`` drops directions by the arithmetic's own rounding."""
        if self._covariance is None:
            if self.stored.dtype != torch.float64 and self.n * self.d * self.d >= FLOAT32_COVARIANCE_WORK:
                self._covariance = self._float32_covariance()
                self._covariance_unit = UNIT_ROUNDOFF_32
                return self._covariance
            covariance = torch.zeros(self.d, self.d, dtype=torch.float64, device=self.device)
            for s, e, rows in self.blocks():  # by blocks: no centred copy of the head
                centred = rows[self.competitor[s:e]] - self.centre
                covariance += centred.T @ centred
            self._covariance = covariance / max(self.n_competitors, 1)
        return self._covariance

    def _float32_covariance(self) -> torch.Tensor:
        """The covariance from float32 products of the rows as the engine reads them, 2^exponent times the
        stored ones (a float32 array: normal_form's carry), less the centre rounded to float32: blocks of
        _BLOCK_ROWS rows made float32 (exactly; the power taken in float64, where it is a number whatever the
        exponent), their products summed in float64. No copy of the head."""
        centre = self.centre.to(torch.float32)
        covariance = torch.zeros(self.d, self.d, dtype=torch.float64, device=self.device)
        with ieee_float32_products():  # float32's own rounding, not TF32's or bfloat16's
            for s in range(0, self.n, _BLOCK_ROWS):
                e = min(self.n, s + _BLOCK_ROWS)
                rows = (self.stored[s:e].to(torch.float64).mul_(self.power).to(torch.float32) if self.exponent
                        else self.stored[s:e].to(torch.float32))
                centred = rows[self.competitor[s:e]] - centre
                covariance.add_(centred.T @ centred)  # widened as it is added: no float64 copy of the product
        return covariance / max(self.n_competitors, 1)

    @property
    def precision(self) -> torch.Tensor:
        """Pseudo-inverse of the covariance of the competitor rows (d x d), computed on first use.

        Whitening by it makes an anisotropic head round; verdicts do not change
        under invertible linear maps, but first-order methods converge faster.
        """
        if self._precision is None:
            covariance = self.covariance
            eigval, eigvec = torch.linalg.eigh(covariance)
            # Drop the null directions: the rows of a LayerNorm-ed head span only a subspace. A float32
            # covariance leaves its products' rounding there (about 6e-9 of the largest eigenvalue at 32768 x
            # 4096, against 0 in float64): its threshold, 2 u_32 sqrt(d) of it, stays well above that.
            unit = self._covariance_unit
            keep = eigval > eigval.max() * (self.d if unit == UNIT_ROUNDOFF else math.sqrt(self.d)) * 2 * unit
            if not bool(keep.all()):  # (a selection copies: only where directions are dropped)
                eigval, eigvec = eigval[keep], eigvec[:, keep]
            self._precision = (eigvec / eigval) @ eigvec.T
            self._whitening = (eigvec / eigval.sqrt()).T.contiguous()
        return self._precision

    _whitening: torch.Tensor | None = None

    @property
    def whitening(self) -> torch.Tensor:
        """A (r x d, r the directions ``precision`` keeps) with A^T A = ``precision`` (up to its rounding): the
        rows A (w_i - c) are the head made round. It only steers: the witness A^T A (w_k - c) it leads to is
        bounded where it is used (screen/whitened_integer.py)."""
        if self._whitening is None:
            self._precision = None
            _ = self.precision
        return self._whitening

    def rows64(self, ids) -> torch.Tensor:
        """float64 copies of some rows on the device (exact: the storage converts exactly, and a float32 entry
        times 2^exponent is a float64 number)."""
        index = torch.as_tensor(ids, dtype=torch.int64, device=self.device)
        rows = self.stored.index_select(0, index.reshape(-1)).to(torch.float64)
        return rows.mul_(self.power) if self.exponent else rows

    def rows(self, ids) -> np.ndarray:
        """float64 numpy copies of some rows (for the small per-token problems)."""
        return self.rows64(np.asarray(ids, dtype=np.int64)).cpu().numpy()

    def blocks(self):
        """(start, stop, float64 rows) over the head, a few thousand rows at a time."""
        if self.stored.dtype == torch.float64:  # a float64 head is its own copy (and has no exponent)
            yield from row_blocks(self.weight, self.n)
            return
        for s, e, rows in row_blocks(self.stored, _BLOCK_ROWS):
            yield s, e, rows.mul_(self.power) if self.exponent else rows

    def logits(self, z: torch.Tensor) -> torch.Tensor:
        """z W^T in float64 (B x n for B x d points z), by blocks of rows."""
        if self.stored.dtype == torch.float64:
            return z @ self.weight.T
        out = torch.empty(z.shape[0], self.n, dtype=torch.float64, device=self.device)
        for s, e, rows in self.blocks():
            out[:, s:e] = z @ rows.T
        return out

    def fast_logits(self, z: torch.Tensor) -> torch.Tensor:
        """z W^T in the storage's precision (float32 for a float32 head), returned as float64.

        For search directions only (Frank-Wolfe's vertex choice): every witness
        found this way is checked again with ``logits``. ``fast_error_factor``
        bounds its error like ``error_factor`` bounds that of ``logits``, with ``fast_underflow_floor`` for
        the float32 products' underflow (each point first scaled by a power of two, normalised_points, so
        that its float32 rounding errs relatively and its products underflow no more than those of a point
        of size 1) (rows stored as 2^a v: the power is taken on z's side where
        2^a fl32(z) is a float32 array, so the products are those of the scaled rows bit for bit; else the
        scaled copy is read).
        """
        if self.stored.dtype == torch.float64:
            return z @ self.weight.T
        z, back = normalised_points(z)
        out = self._fast_logits(z)
        return out if back is None else out.mul_(back[:, None])

    def _fast_logits(self, z: torch.Tensor) -> torch.Tensor:
        narrow = float32_times_power(z, self.exponent) if self.exponent else None
        if self.half:  # by blocks of widened rows: the same products as on a float32 copy of the head
            left, scaled = (narrow, False) if narrow is not None else (z.to(torch.float32), True)
            out = torch.empty(z.shape[0], self.n, dtype=torch.float64, device=self.device)
            for s, e, rows in self.narrow_blocks(scaled):
                out[:, s:e] = left @ rows.T
            return out
        if narrow is not None:  # fl32(z) (2^a v)^T = (2^a fl32(z)) v^T, where 2^a fl32(z) is itself a float32 array
            return (narrow @ self.stored.T).to(torch.float64)
        return (z.to(self.weight.dtype) @ self.weight.T).to(torch.float64)

    def fast_combine(self, alpha: torch.Tensor) -> torch.Tensor:
        """alpha W in the storage's precision, returned as float64 (steering only, like fast_logits)."""
        if self.stored.dtype == torch.float64:
            return alpha @ self.weight
        if self.half:  # by blocks of widened rows, summed in float32, the power taken as below
            narrow = float32_times_power(alpha, self.exponent) if self.exponent else alpha.to(torch.float32)
            weights = narrow if narrow is not None else alpha.to(torch.float32)
            total = torch.zeros(alpha.shape[0], self.d, dtype=torch.float32, device=self.device)
            for s, e, rows in self.narrow_blocks(False):
                total.addmm_(weights[:, s:e], rows)
            if narrow is not None:
                return total.to(torch.float64)
            if bool(torch.isfinite(total).all()):
                return total.to(torch.float64).mul_(self.power)
            total.zero_()  # alpha v left float32's range: on the scaled rows, a float32 array (the carry)
            for s, e, rows in self.narrow_blocks(True):
                total.addmm_(weights[:, s:e], rows)
            return total.to(torch.float64)
        if self.exponent:  # likewise; else (alpha v) 2^a: the same products but where they leave float32's range
            narrow = float32_times_power(alpha, self.exponent)
            if narrow is not None:
                return (narrow @ self.stored).to(torch.float64)
            total = (alpha.to(torch.float32) @ self.stored).to(torch.float64)
            if bool(torch.isfinite(total).all()):
                return total.mul_(self.power)
        return (alpha.to(self.weight.dtype) @ self.weight).to(torch.float64)

    def rows_in_storage(self, ids: torch.Tensor) -> torch.Tensor:
        """Some rows in the storage's precision (steering products: bounded_dual's working set), from the stored
        rows and the power of two: no scaled copy of the head."""
        rows = self.stored.index_select(0, ids)
        if self.half:
            rows = rows.to(torch.float32)
        if not self.exponent or rows.dtype != torch.float32:
            return rows
        scaled = float32_times_power(rows, self.exponent)
        return scaled if scaled is not None else self.rows64(ids).to(torch.float32)  # exact: the carry's array

    @property
    def fast_underflow_floor(self) -> float:
        """What underflow may add to a fast_logits logit: float32's floor for a float32 head, float64's for
        a float64 one."""
        if self.stored.dtype == torch.float64:
            return self.underflow_floor
        return underflow_floor(self.d, SMALLEST_SUBNORMAL_32) + self.underflow_floor

    @property
    def fast_error_factor(self) -> float:
        if self.stored.dtype == torch.float64:
            return self.error_factor
        return logit_error_factor(self.d, UNIT_ROUNDOFF_32) + 2 * UNIT_ROUNDOFF_32  # and z rounded to float32

    def combine(self, alpha: torch.Tensor) -> torch.Tensor:
        """alpha W in float64 (B x d for B x n weights), by blocks of rows."""
        if self.stored.dtype == torch.float64:
            return alpha @ self.weight
        total = torch.zeros(alpha.shape[0], self.d, dtype=torch.float64, device=self.device)
        for s, e, rows in self.blocks():
            total += alpha[:, s:e] @ rows
        return total

    def combine_offsets(self, alpha: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """sum_i alpha_i (w_i - w) in float64 (d, for n weights alpha), differences first, by blocks of rows.

        Each difference is rounded relative to itself, so the error is a
        fraction of the spread of the rows, whatever offset they share.
        """
        total = torch.zeros(self.d, dtype=torch.float64, device=self.device)
        for s, e, rows in row_blocks(self.stored, _BLOCK_ROWS):  # blocks of a float64 head too: rows - w is a copy
            total += alpha[s:e] @ ((rows.mul_(self.power) if self.exponent else rows) - w)
        return total

    def biases(self, ids) -> np.ndarray:
        if self.bias is None:
            return np.zeros(len(ids))
        index = torch.as_tensor(np.asarray(ids, dtype=np.int64), device=self.device)
        return self.bias.index_select(0, index).cpu().numpy()


def _narrow_rows(d: int) -> int:
    """Rows of a half-precision head widened to float32 at a time: 1 MiB, a block that stays in cache while
    a product reads it."""
    return max(64, (1 << 18) // max(d, 1))
_STRICTER = 1 - 2.0**-20


def build_engine_head(weight: torch.Tensor, bias: torch.Tensor | None, representative: np.ndarray,
                      domain: Domain, residual_tol: float, row_error: torch.Tensor | None = None,
                      bias_error: torch.Tensor | None = None, median: torch.Tensor | None = None,
                      facts: RowFacts | None = None, exponent: int = 0) -> EngineHead:
    """The engine's head; ``median`` is median_row(weight, competitors) and ``facts`` the rows' facts when the
    caller has them already (the normal form, which moved the median it found exactly and measured the rows
    on its own passes). With an ``exponent`` (float32 rows only, with their facts) the head's rows are
    2^exponent ``weight``."""
    if exponent and (facts is None or facts.centre_logits is None
                     or weight.dtype not in (torch.float32,) + HALF_DTYPES):
        raise ValueError("an exponent needs float32 (or half-precision) rows and the scaled rows' facts")
    device = weight.device
    competitor_np = representative == np.arange(representative.shape[0])
    competitor = torch.as_tensor(competitor_np, device=device)
    row_mask = None
    if not competitor_np.all():
        row_mask = torch.zeros(weight.shape[0], dtype=torch.float64, device=device)
        row_mask[~competitor] = -torch.inf
    if facts is None:
        facts = row_facts(weight, competitor, median if median is not None else median_row(weight, competitor))
    row_norm, distance, centre = facts.norm, facts.distance, facts.centre
    # rows exactly at the median keep 0: their differences with each other are exact zeros
    spread_norm = torch.where(distance > 0, distance * (1 + gamma(weight.shape[1] + 2)) + underflow_floor(weight.shape[1]),
                              distance)
    # a float32 (or half-precision) head's screen uses it as it is, in float32
    witness_centre = centre.to(torch.float64 if weight.dtype == torch.float64 else torch.float32).to(torch.float64)
    centre_logits = facts.centre_logits
    if centre_logits is None:
        centre_logits = torch.empty(weight.shape[0], dtype=torch.float64, device=device)
        for s, e, rows in row_blocks(weight, _BLOCK_ROWS):
            centre_logits[s:e] = rows @ witness_centre
    return EngineHead(
        stored=weight, exponent=exponent, bias=bias, representative=representative, competitor=competitor, row_mask=row_mask,
        row_norm=row_norm, max_row_norm=float(row_norm[competitor].max()), spread_norm=spread_norm,
        typical_spread=low_quantile(distance[competitor]),  # of the rows that are not at the median itself
        max_spread=float(spread_norm[competitor].max()),
        max_abs_bias=0.0 if bias is None else float(bias[competitor].abs().max()),
        centre=centre, witness_centre=witness_centre, centre_logits=centre_logits, domain=domain,
        residual_tol=residual_tol, row_error=row_error, bias_error=bias_error,
    )
