"""The head in a normal form, so that transformations that change no verdict change no answer.

Before deciding, the engine rewrites the question exactly (or with a stated
rounding bound) into one whose numbers sit near 1:

- the bias is taken relative to its lower median b_m (an entry of b):
  b - b_m. Adding a constant to every bias leaves this unchanged, and a
  bias that is constant becomes no bias at all (a derived one too, when its
  error bounds are all 0: it is then exactly constant). Each entry's rounding
  (found exactly by TwoSum; at most u |b_i - b_m|) is added to the bias error bound;
- the weight is scaled by 2^a so that the median distance of the rows from
  their coordinate-wise median lies in [1/2, 1), the bias by 2^c and the
  radius of a bounded domain by 2^(c - a), so that it lies in [1/2, 1) too
  (without a domain radius, c brings the median non-zero |b_i - b_m| there). Logits then scale by 2^c, a point y of the
  normal form is the point z = 2^(a - c) y of the question as given, and
  margins, residuals and bounds are scaled back by the same exact powers of
  two. Scaling the head, the bias or the radius by a power of two in any of
  the ways the spec lists gives bit-identical numbers here, hence identical
  verdicts;
- the rows are translated by their coordinate-wise lower median m: logits
  all change by m . z, so no verdict does. m is an entry of each column, so
  a common offset v of the rows that is exact in their storage moves it by
  exactly v: W and W + v give the same real numbers w_i - m, rounded
  alike, and every verdict (inconclusive included) is the same for both.
  A float64 head is always translated, each entry rounded at most once (its
  error, found exactly by TwoSum, goes into the row error bound); a float32
  head is translated when every difference is a float32 value, and through
  a float64 copy when its rows share an offset far larger than their spread
  (``_OFFSET_RATIO``); otherwise it stays as given, its own float32 rows.
  A float16 or bfloat16 head is the float32 head of its values: carried, it
  stays in its own storage (the engine head widens blocks of it where it
  computes); otherwise its scaled copy is a float32 one.

Ties are found on the rows as given, before any rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from auditor.engine.arithmetic.head import EngineHead
from auditor.engine.arithmetic.power_of_two import cache_rows, centre_products, halves, power, scaled_exactly, times_power_of_two
from auditor.engine.arithmetic.rounding import gamma, safe_norm
from auditor.engine.arithmetic.row_statistics import column_statistics, HALF_DTYPES, RowFacts
from auditor.engine.decisions import INCONCLUSIVE, Decisions
from auditor.question.domain import Domain
from auditor.util.arrays import row_blocks

_OFFSET_RATIO = 64.0  # translate when the median row is this many typical spreads from the origin
_BLOCK_ROWS = 2048
_FIRST_ROWS = 64


@dataclass
class NormalForm:
    stored: torch.Tensor  # the rows 2^a (W - translation) are 2^stored_exponent times these
    bias: torch.Tensor | None  # 2^c (b - b_m), None when b is constant
    domain: Domain  # with radius 2^(c - a) r
    row_error: torch.Tensor | None
    bias_error: torch.Tensor | None
    weight_exponent: int  # a
    logit_exponent: int  # c
    translation: torch.Tensor | None  # the offset subtracted from every row (units of the rows as given)
    # median_row of ``weight``: the given rows' median moved by the same exact steps (a translation by
    # itself gives 0; rounding and powers of two are non-decreasing maps, and commute with order statistics)
    median: torch.Tensor | None = None
    # per-row facts of ``weight`` (float64), found on the pass that found the spread: ||w_i||, ||w_i - median||,
    # the mean of the competitor rows and the rows' products with it rounded to the storage (see row_statistics.RowFacts)
    facts: RowFacts | None = None
    # a (float32 rows, kept as given or as translated, the power of two taken where they are used:
    # EngineHead.exponent), or 0 (the rows scaled already: float64 ones)
    stored_exponent: int = 0

    @property
    def weight(self) -> torch.Tensor:
        """The rows 2^a (W - translation), float32 when that is exact, else float64: a scaled (or widened) copy of
        ``stored`` when it has an exponent (then always float32) or is half-precision."""
        stored = self.stored.to(torch.float32) if self.stored.dtype in HALF_DTYPES else self.stored
        return scaled_exactly(stored, self.stored_exponent, "head")[0] if self.stored_exponent else stored

    def given_length(self, length: float) -> float:
        """A distance between rows of the normal form, in the units of the rows as given."""
        return length * power(-self.weight_exponent)


def _exponent(peak: float) -> int:
    """e such that peak * 2^e lies in [1/2, 1); 0 for a zero peak."""
    return 0 if peak == 0.0 else -math.frexp(peak)[1]


def _lower_median(values: torch.Tensor) -> float:
    ordered = torch.sort(values).values
    return float(ordered[(ordered.numel() - 1) // 2])


def normal_form(weight: torch.Tensor, bias: torch.Tensor | None, domain: Domain, competitor: torch.Tensor,
                row_error: torch.Tensor | None = None, bias_error: torch.Tensor | None = None,
                carry: bool = False) -> NormalForm:
    """Rewrite the head (``competitor`` marks one row per group of exact duplicates) in the normal form.
    ``carry``: a float32 (or float16, bfloat16) head's rows as given may stay as they are, their power of two carried
    (NormalForm.stored and stored_exponent), for the engine head to take where it reads them (the pipeline
    asks for it); otherwise, and where 2^a W may not be a float32 array, the scaled copy is made here."""
    if bias is not None:
        bias, bias_error = _relative_bias(bias, bias_error, competitor)

    # The rows less their coordinate-wise median m, an entry of each column: m moves exactly with a
    # common offset v of the rows (median(W + v) = median(W) + v when W + v is exact), so W and W + v
    # give the same real numbers w_i - m, rounded alike, and the engine sees bit-identical rows.
    centre, largest, smallest = column_statistics(weight, competitor)
    # Distances are measured on the head scaled by 2^p, p from the largest |w_ij - m_j|, so that no
    # square overflows or underflows; p, like everything below, moves exactly with the head's scale.
    p = _exponent(_peak_offset(centre, largest, smallest))
    # the sums of the offsets w_i - m serve only rows translated in float32, which the first rows rule out
    # for most heads (their differences are not float32 values)
    facts = _row_facts(weight, competitor, p, centre,
                       offsets=weight.dtype != torch.float64 and _exact_differences(weight[:_FIRST_ROWS], centre))
    spread = float(torch.median(facts.distance[competitor]))
    translation = None
    # A float64 head is always translated; a float32 head when its differences are float32 values (no
    # larger copy, nothing rounded), or through a float64 copy when its rows share an offset far larger
    # than their spread (where rounding relative to the rows' size would swamp their differences). A
    # half-precision head only in that last case, into float32 where the differences allow.
    far = spread > 0 and float(torch.linalg.vector_norm(times_power_of_two(centre, p))) > _OFFSET_RATIO * spread
    translated, rounding = _translated(weight, centre, widen=weight.dtype == torch.float64 or far)
    if translated is not None:
        if rounding is not None:
            row_error = rounding if row_error is None else row_error + rounding
        weight, translation = translated, centre
    del translated

    # Order statistics and norms move exactly with a power-of-two scaling, so the exponents do too.
    a = p + _exponent(spread) if spread > 0 else p
    c = _logit_exponent(a, bias, domain, competitor)
    if weight.dtype == torch.float64:
        # rows of float64 (a float64 head, or a float32 head translated through float64): entries the normal
        # form holds exactly may be subnormal, and rounded, at the 2^p scale, so the engine head measures
        # them on the normal form's own rows (build_engine_head)
        weight, _ = scaled_exactly(weight, a, "head")
        facts, stored_exponent = None, 0
    else:
        weight, facts, stored_exponent = _narrow_rows(weight, facts, competitor, centre, largest, smallest,
                                                      translation, a, p, carry)
    if bias is not None:
        bias, _ = scaled_exactly(bias, c, "bias")
    if row_error is not None:
        row_error = row_error * power(a)
    if bias_error is not None:
        bias_error = bias_error * power(c)
    median = torch.full_like(centre, -0.0) if translation is not None else scaled_exactly(centre, a, "head")[0]
    return NormalForm(weight, bias, domain.scaled(c - a), row_error, bias_error, a, c, translation, median, facts,
                      stored_exponent)


def _relative_bias(bias: torch.Tensor, bias_error: torch.Tensor | None, competitor: torch.Tensor
                   ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(b - b_m, its error bound with the subtraction's rounding added), or (None, None) for a constant bias."""
    reference = _lower_median(bias[competitor])
    relative = bias - reference
    if not bool(relative.any()) and (bias_error is None or not bool(bias_error.any())):
        # a constant bias moves every logit alike; so does a derived one whose error bounds are all 0
        # (the norm domain's W beta for an RMSNorm, which has no shift): it is exactly constant
        return None, None
    # |fl(b_i - b_m) - (b_i - b_m)| exactly, by Knuth's TwoSum: zero wherever the subtraction was exact
    back = relative + reference
    rounding = ((bias - back) + (-reference - (relative - back))).abs()
    if bool(rounding.any()):
        bias_error = rounding if bias_error is None else bias_error + rounding
    return relative, bias_error


def _logit_exponent(a: int, bias: torch.Tensor | None, domain: Domain, competitor: torch.Tensor) -> int:
    """The exponent c of the logits' power of two, given the rows' a."""
    if domain.bounded:
        return a - math.frexp(domain.radius)[1]  # the radius, times 2^(c - a), lands in [1/2, 1)
    if bias is not None:
        sizes = bias[competitor].abs()
        sizes = sizes[sizes > 0]
        return _exponent(float(torch.median(sizes))) if sizes.numel() else 0
    return a


def _narrow_rows(weight: torch.Tensor, facts: RowFacts, competitor: torch.Tensor, centre: torch.Tensor,
                 largest: torch.Tensor, smallest: torch.Tensor, translation: torch.Tensor | None, a: int, p: int,
                 carry: bool) -> tuple[torch.Tensor, RowFacts, int]:
    """(the narrow rows, carried or scaled by 2^a, their facts in the normal form's units, their carried exponent)."""
    # The facts in the units of the normal form: its rows are 2^a (w_i - t), t = m or 0, and the pass
    # above measured 2^p (w_i - m) and 2^p w_i, so each fact is 2^(a - p) times one measured (an exact
    # step: the rows' scale lies within float64's range once 2^a W does). A sum is scaled before it is
    # divided, as a sum of the scaled rows would be. Nothing measured at 2^p lost a square to underflow:
    # p >= -130 (the peak is below 2^129) and a nonzero float32 difference or entry is at least 2^-149,
    # so every nonzero entry there is at least 2^-279 and its square a normal float64.
    ratio = a - p
    row_norm = facts.distance if translation is not None else facts.norm
    total = facts.offset_total if translation is not None else facts.total
    centre_of_rows = times_power_of_two(total, ratio) / int(competitor.sum())
    # With ``carry`` the rows as given stay as they are and the engine head takes 2^a where it reads them:
    # no scaled copy, where 2^a W is surely a float32 array (no entry overflows: the largest |w_ij|, from
    # the column extremes; for a < 0 none lands below the normal range: the smallest nonzero one, measured
    # on the products' pass). Otherwise the scaled copy, as without. (W and 2^s W may be decided apart
    # where an entry of 2^a W is subnormal; both give the same numbers.) Translated rows are a copy
    # already, which the scaled copy replaces: carried, a stage that reads the scaled rows would hold both.
    carried = False
    largest_entry = float(torch.maximum(largest.abs(), smallest.abs()).max())
    if carry and translation is None and math.ldexp(largest_entry, a) <= float(torch.finfo(torch.float32).max):
        products, least = centre_products(weight, centre_of_rows, a)
        carried = a >= 0 or math.ldexp(least, a) >= float(torch.finfo(torch.float32).tiny)
    if not carried:  # a half-precision head is widened to float32 first (exactly), its range being float32's
        weight, products = scaled_exactly(weight.to(torch.float32) if weight.dtype in HALF_DTYPES else weight, a,
                                          "head", centre_of_rows)
    stored_exponent = a if carried else 0
    facts = RowFacts(norm=times_power_of_two(row_norm, ratio), distance=times_power_of_two(facts.distance, ratio),
                     centre=centre_of_rows, centre_logits=products)
    return weight, facts, stored_exponent


def _peak_offset(centre: torch.Tensor, largest: torch.Tensor, smallest: torch.Tensor) -> float:
    """max_ij |w_ij - m_j| (each difference rounded to float64), from each column's largest and smallest
    entry: rounding is non-decreasing, so max_i fl(w_ij - m_j) = fl(max_i w_ij - m_j) and max_i fl(m_j - w_ij)
    = fl(m_j - min_i w_ij); no float64 copy of the rows is formed. The extremes of the competitor rows are
    those of all rows: the others are copies of them."""
    if centre.numel() == 0:
        return 0.0
    return float(torch.maximum(largest - centre, centre - smallest).max())


def _two_difference(rows: torch.Tensor, centre: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fl(rows - centre) and its exact rounding error (Knuth's TwoSum, float64)."""
    difference = rows - centre
    back = difference - rows
    return difference, (rows - (difference - back)) + (-centre - back)


def _exact_differences(rows: torch.Tensor, centre: torch.Tensor) -> bool:
    """Whether every float32 row less ``centre`` is a float32 array, exactly."""
    difference, error = _two_difference(rows.to(torch.float64), centre)
    return not bool(error.any()) and torch.equal(difference.to(torch.float32).to(torch.float64), difference)


def _translated(weight: torch.Tensor, centre: torch.Tensor, widen: bool
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the rows less ``centre``, a bound on each translated row's rounding or None where nothing was
    rounded). A float32 head whose differences are all float32 values stays float32, the same size;
    otherwise, when ``widen``, they are float64, each entry rounded at most once, its error found
    exactly; else (None, None): the head stays as given."""
    # a half-precision head only where it must be translated (its float32 translation is a larger copy)
    if weight.dtype == torch.float32 or (weight.dtype in HALF_DTYPES and widen):
        narrow = torch.empty(weight.shape, dtype=torch.float32, device=weight.device)
        # a first block of a few rows: most float32 heads have inexact differences, and show it there
        starts = [0] + list(range(_FIRST_ROWS, weight.shape[0], _BLOCK_ROWS))
        for s, e in zip(starts, starts[1:] + [weight.shape[0]]):
            difference, error = _two_difference(weight[s:e].to(torch.float64), centre)
            narrow[s:e] = difference.to(torch.float32)
            if bool(error.any()) or not torch.equal(narrow[s:e].to(torch.float64), difference):
                del narrow
                break
        else:
            return narrow, None
    if not widen:
        return None, None
    wide = torch.empty(weight.shape, dtype=torch.float64, device=weight.device)
    bound = torch.empty(weight.shape[0], dtype=torch.float64, device=weight.device)
    for s, e, rows in row_blocks(weight, _BLOCK_ROWS):
        wide[s:e], error = _two_difference(rows, centre)
        bound[s:e] = safe_norm(error, dim=1)  # scaled first: errors below 2^-511 must not square to 0
    if bool(bound.any()):
        return wide, bound * (1 + gamma(weight.shape[1] + 4))  # and the norm's own rounding
    return wide, None


@dataclass
class _Measured:
    """What one float64 pass over the rows as given measures, on the head scaled by 2^p."""

    distance: torch.Tensor  # ||2^p (w_i - m)||
    norm: torch.Tensor | None  # ||2^p w_i|| (float32 rows only, as the two sums)
    total: torch.Tensor | None  # sum of 2^p w_i over the competitors
    offset_total: torch.Tensor | None  # sum of 2^p (w_i - m) over the competitors


_UNDERFLOW = 1e-150  # a norm below this may have lost its squares to underflow: found again by safe_norm


def _row_facts(weight: torch.Tensor, competitor: torch.Tensor, p: int, centre: torch.Tensor,
               offsets: bool = True) -> _Measured:
    """The distances of the rows from ``centre`` on the head scaled by 2^p (in [1/2, 1) at its largest offset
    from ``centre``: no square overflows), in one pass: fl(w_i - m) first, then 2^p in two exact steps
    (nothing can overflow, and the difference is the one an exact translation leaves alike). For float32
    rows also their norms and the competitors' sums of rows and offsets: 2^p w_i is exact in float64 there
    (|2^p w_ij| lies within 2^+-277); the sum of the offsets only with ``offsets`` (else None). Only the
    distances of a float64 head are wanted (its spread): its facts are measured on the normal form's rows
    (None here).

    For float32 rows the pass measures the rows as they are and scales the results instead: a power of two
    commutes with every rounding of a norm or a sum whose terms and partial results stay normal, and they do
    here. Every nonzero entry, difference fl(w_ij - m_j) and partial sum is a multiple of 2^-149 (so at least
    2^-149, and 2^-279 after the scaling; its square at least 2^-558), and none is near overflow (an entry or
    difference is below 2^129, a sum of squares below 2^258 d, a column sum below 2^129 n): so the results are
    bit for bit those measured on 2^p w_i."""
    first, second = halves(p)
    narrow = weight.dtype != torch.float64
    n = weight.shape[0]
    distance = torch.empty(n, dtype=torch.float64, device=weight.device)
    norm = torch.empty(n, dtype=torch.float64, device=weight.device) if narrow else None
    total = torch.zeros(weight.shape[1], dtype=torch.float64, device=weight.device) if narrow else None
    offset_total = (torch.zeros(weight.shape[1], dtype=torch.float64, device=weight.device) if narrow and offsets
                    else None)
    every = bool(competitor.all())  # then no copy of the competitor rows for the sums
    step = cache_rows(weight.shape[1])
    rows = torch.empty(step, weight.shape[1], dtype=torch.float64, device=weight.device)
    offsets = torch.empty_like(rows)
    for s in range(0, n, step):
        block = weight[s:s + step]
        x, y = rows[:block.shape[0]], offsets[:block.shape[0]]
        x.copy_(block)  # into the buffer: a float64 head's block is its own rows
        torch.sub(x, centre, out=y)
        if not narrow:
            y.mul_(first).mul_(second)
        torch.linalg.vector_norm(y, dim=1, out=distance[s:s + step])
        if narrow:
            chosen = slice(None) if every else competitor[s:s + step]
            if offset_total is not None:
                offset_total += y[chosen].sum(dim=0)
            torch.linalg.vector_norm(x, dim=1, out=norm[s:s + step])
            total += x[chosen].sum(dim=0)
    if narrow:  # measured on the rows as given: now scaled, exactly (see above)
        distance, norm, total = (times_power_of_two(t, p) for t in (distance, norm, total))
        offset_total = times_power_of_two(offset_total, p) if offset_total is not None else None
    # a float64 head's distances (its spread) may have lost squares to underflow: those found again
    for i in torch.nonzero(distance < _UNDERFLOW).flatten().tolist():
        distance[i] = times_power_of_two(safe_norm(weight[i:i + 1].to(torch.float64) - centre, dim=1)[0], p)
    return _Measured(distance, norm, total, offset_total)


def _in_given_units(z: np.ndarray, e: int) -> tuple[np.ndarray, np.ndarray]:
    """(z 2^e, whether each point, a row of z, is held exactly): one that overflows, or falls below
    float64's normal range and is rounded there, would not be the point that was checked."""
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        given = times_power_of_two(z, e)
        exact = np.all(np.isfinite(given), axis=-1) & np.all(times_power_of_two(given, -e) == z, axis=-1)
    return given, exact


def _left_open(out: Decisions, k: int) -> None:
    """Token k's witness cannot be stated: it is left inconclusive, its margin found as the lower bound."""
    out.explicit_witness.pop(k, None)
    out.verdict[k] = INCONCLUSIVE
    out.bounds[k] = (float(out.margin[k]) if np.isfinite(out.margin[k]) else -np.inf, np.inf)
    out.margin[k] = np.nan
    out.runner_up[k] = -1
    out.witness_scale[k] = np.nan


def to_given_units(out: Decisions, form: NormalForm, head: EngineHead) -> None:
    """Report margins, residuals, witnesses and the centre in the units of the head as given.

    The normal form's logits are 2^c times the given ones, its rows 2^a times the given
    (translated) rows, and its point y is the point z = 2^(a - c) y.
    """
    a, c = form.weight_exponent, form.logit_exponent
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        given = times_power_of_two(out.margin, -c)
        # a lower bound that lands below the normal range is rounded there: downwards, so it stays one
        inexact = np.isfinite(out.margin) & (times_power_of_two(given, c) != out.margin)
        out.margin = np.where(inexact, np.nextafter(given, -np.inf), given)
    unstated = []
    stated = list(out.explicit_witness)
    for s in range(0, len(stated), _BLOCK_ROWS):  # by blocks of tokens, each block in one numpy call
        ks = stated[s:s + _BLOCK_ROWS]
        for shape in {out.explicit_witness[k].shape for k in ks}:
            same = [k for k in ks if out.explicit_witness[k].shape == shape]
            given, exact = _in_given_units(np.stack([out.explicit_witness[k] for k in same]), a - c)
            for j, k in enumerate(same):
                if exact[j]:
                    out.explicit_witness[k] = given[j]
                else:
                    unstated.append(k)
    # The formula witness s (w_k - t c) refers to the rows as given: z = 2^(a-c) s 2^a (w_k - t c)
    # takes the scale 2^(2a-c) s. Where that leaves the normal float range, or the rows were
    # translated (the formula's rows are then not the given ones), store the very point checked.
    with np.errstate(over="ignore", under="ignore"):
        scaled = times_power_of_two(out.witness_scale, 2 * a - c)
    normal = ~np.isfinite(out.witness_scale) | (np.isfinite(scaled) & (np.abs(scaled) >= np.finfo(np.float64).tiny))
    if form.translation is not None:
        normal = ~np.isfinite(out.witness_scale)
    stored = np.nonzero(~normal)[0]
    for s in range(0, stored.size, _BLOCK_ROWS):  # by blocks of tokens: a translated head states them all
        ks = stored[s:s + _BLOCK_ROWS]
        shift = torch.as_tensor(out.witness_shift[ks], device=head.device)[:, None]
        rows = head.rows64(ks)
        directions = torch.where(shift != 0, rows - shift * head.witness_centre, rows)
        points = (directions * torch.as_tensor(out.witness_scale[ks], device=head.device)[:, None]).cpu().numpy()
        given, exact = _in_given_units(points, a - c)
        for j, k in enumerate(ks.tolist()):
            if exact[j]:
                out.explicit_witness[k] = given[j]
            else:
                unstated.append(k)
    scaled[stored] = np.nan
    out.witness_scale = scaled
    out.centre = times_power_of_two(out.centre, -a)
    with np.errstate(over="ignore", invalid="ignore"):  # a formula witness whose entries would overflow
        reach = np.abs(scaled) * (times_power_of_two(head.row_norm.cpu().numpy(), -a)
                                  + np.abs(out.witness_shift) * float(np.linalg.norm(out.centre)))
    unstated += np.nonzero(np.isfinite(scaled) & ~(reach < np.finfo(np.float64).max / 4))[0].tolist()
    if form.translation is not None:
        out.centre = out.centre + form.translation.cpu().numpy()
    residual_unit = -c if head.domain.bounded else -a
    for k, (indices, weights, residual, gap) in out.convex.items():
        out.convex[k] = (indices, weights, times_power_of_two(residual, residual_unit), times_power_of_two(gap, -c))
    for k, (lower, upper) in out.bounds.items():
        out.bounds[k] = (times_power_of_two(lower, -c),
                         times_power_of_two(upper, -c if head.domain.bounded or head.bias is None else -a))
    for k in unstated:  # in the units as given already
        _left_open(out, k)
