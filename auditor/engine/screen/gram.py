"""The screen stage: one batched Gram product over the vocabulary.

A large head (without a bias in any domain, or with one in a bounded domain) is
first screened in int8 (integer_pass.py, heads without a bias) or bfloat16
(low_precision.py): the centred self-direction z = s (w_k - c) with a rigorous
allowance for that arithmetic proves most tokens at a fraction of the cost.
Without a bias the whitened self-direction C^+ (w_k - c) is priced in a second
int8 pass (whitened_integer.py), first where a sample of the head's rows says it
proves more; the pass below then runs on the tokens both left.

For every token k it tries the candidate witnesses z = s (w_k - t c), t in
{0, 1}, where c is the centre (mean) of the rows: the row itself, and the row
seen from the centre, which is what wins for anisotropic heads whose rows
share a large common component. By linearity all logits come from the single
product W W_K^T and the vector W c:

    l_i(z) = s (w_i.w_k - t w_i.c) + b_i.

The pass is itself the check of these witnesses: the margin it computes is
compared with the rigorous rounding bound of rounding.py, which already
allows for the extra operations and for storing z, and the margin it reports
is the computed one less that bound (rounding.proven_lower): a lower bound of
the exact margin at z, as every stage reports.

A float32 head (any float16, bfloat16 or float32 head: the storage is then
exact) is screened in float32 arithmetic, the floor's own precision, with the
float32 rounding bound: about 5e-5 of |w_i| |z| at d = 768, far below the
margins of all but a few tokens, which the later stages take. The centre c and
every scale s are float32 values then, so that z is exactly the vector whose
logits the pass bounds; its float64 rounding is allowed for as well, so a
float64 re-check of the reported witness (auditor.verify) passes too.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from auditor.engine.arithmetic.head import EngineHead
from auditor.engine.arithmetic.power_of_two import float32_times_power
from auditor.engine.arithmetic.rounding import (SMALLEST_SUBNORMAL_32, UNIT_ROUNDOFF, UNIT_ROUNDOFF_32,
                                                float32_towards_zero, gamma, ieee_float32_products, logit_error_factor,
                                                per_unit_norm, proven_lower, proves_positive, rounded_down, rounded_up,
                                                safe_norm, underflow_floor)
from auditor.engine.exact.certify import check_witnesses_sharpened, derived_error, inside_domain
from auditor.engine.screen import integer_pass, low_precision
from auditor.engine.screen.whitened import less_derived_error, tries_whitened
from auditor.engine.screen import whitened_integer
from auditor.engine.screen.whitened_integer import WhitenedOutcome

_BLOCK_BUDGET = 1 << 24  # entries per chunk x n block (64 MiB in float32); two blocks live at once with a bias
_SHIFTS = (0.0, 1.0)
_LARGE_HEAD = 1 << 20  # entries from which a float64 head is screened through a float32 copy
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
    close_shift: np.ndarray  # for uncertified tokens: the candidate that won by less than its
    close_scale: np.ndarray  # rounding bound (nan where none won at all), re-checked in float64
    # the low-precision pass's copy of the rows, for the whitened witnesses
    centred: low_precision.CentredRows | integer_pass.IntegerRows | None = None
    whitened: WhitenedOutcome | None = None  # the whitened witnesses the int8 pass priced (positions into ids)


def screen(head: EngineHead, ids: np.ndarray, progress=None) -> ScreenResult:
    """A low-precision pass first where one applies: the int8 pass (integer_pass.py) on heads without a bias
    whose device multiplies int8 exactly, else the bfloat16 pass (low_precision.py); the float32 (or float64)
    pass for the rest."""
    count = len(ids)
    whitened = None
    rest = np.ones(count, dtype=bool)
    if count and integer_pass.applies(head):
        copy = integer_pass.integer_rows(head)
        # The whitened witnesses are priced in a second int8 pass (whitened_integer.py), on a copy of the head
        # made round: on a head whose spectrum falls steeply the self-direction leaves most of the vocabulary,
        # and these witnesses take it. Which pass goes first (on every token; the other on the tokens it
        # leaves) is the one that proves more of a sample of the head's rows.
        round_copy = (whitened_integer.whitened_rows(head) if tries_whitened(head) and whitened_integer.applies(head)
                      else None)
        if round_copy is not None and _whitened_first(head, copy, round_copy):
            whitened = whitened_integer.whitened_int8(head, ids, progress, round_copy)
            round_copy = None
            rest[whitened.proved] = False
            won, margin, scale, runner_up = _int8_on(head, ids, rest, progress, copy)
            open_calls = ~won[whitened.close]  # the close calls the plain pass did not prove
            whitened.close = whitened.close[open_calls]
            whitened.close_witnesses = whitened.close_witnesses[torch.as_tensor(open_calls, device=head.device)]
            rest &= ~won
        else:
            won, margin, scale, runner_up = integer_pass.int8_pass(head, ids, progress, copy)
            rest = ~won
            if round_copy is not None and rest.any():
                copy = None  # let go before the float32 pass
                pending = np.nonzero(rest)[0]
                whitened = whitened_integer.whitened_int8(head, ids[pending], progress, round_copy)
                whitened.proved, whitened.close = pending[whitened.proved], pending[whitened.close]
                rest[whitened.proved] = False
            round_copy = None
    elif count and low_precision.applies(head):
        copy = low_precision.centred_rows(head)
        won, margin, scale, runner_up = low_precision.bfloat16_pass(head, ids, progress, copy)
        rest = ~won
        if head.bias is not None and rest.any() and whitened_integer.applies(head):
            # with a bias: the whitened witnesses in the int8 pass (the bias taken as its largest gap), on the
            # tokens the bfloat16 pass left, before the float32 pass
            copy = None
            whitened = _whitened_on(head, ids, rest, progress)
    elif count and head.bias is not None and whitened_integer.applies(head):
        # a bias in the unbounded domain: the whitened witnesses first, at a scale where the bias cannot
        # overturn them; the float32 pass (a product per scale of its ladder) on the rest
        won, margin = np.zeros(count, dtype=bool), np.full(count, -np.inf)
        scale, runner_up = np.ones(count), np.full(count, -1, dtype=np.int64)
        whitened = _whitened_on(head, ids, rest, progress)
    else:
        return _screen(head, ids, progress)
    margin = _exact_rows_margin(head, ids, won, margin, scale)
    result = _screen(head, ids[rest], progress)
    merged = ScreenResult(certified=won.copy(), margin=margin, shift=np.where(won, 1.0, 0.0), scale=scale,
                          runner_up=runner_up, threat=np.full(count, -1, dtype=np.int64),
                          close_shift=np.full(count, np.nan), close_scale=np.full(count, np.nan), whitened=whitened)
    for name in ("certified", "margin", "shift", "scale", "runner_up", "threat", "close_shift", "close_scale"):
        getattr(merged, name)[rest] = getattr(result, name)
    # The copy (a quarter or half of a float32 head) goes on to the whitened witnesses where the d x d float64
    # arrays formed beside it (the covariance, its eigenvectors, the precision: about 32 d^2 bytes) are at most
    # a quarter of a bfloat16 copy (2 n d bytes), n >= _WHITENED_COPY_ROWS d: one low-precision product for
    # their rivals. On wider heads it is let go here, and those arrays are formed without it (the audit's peak
    # memory); the whitened witnesses then take float32 products and float64 checks. A rule of the head alone,
    # so that a token's witness does not depend on the tokens screened with it. (The int8 pass has priced them
    # already: see above.)
    if whitened is None and tries_whitened(head) and head.n >= _WHITENED_COPY_ROWS * head.d:
        merged.centred = copy
    return merged


_WHITENED_COPY_ROWS = 64  # rows per column from which the whitened witnesses use the bfloat16 copy
_SAMPLE = 256  # rows of the head on which the two int8 passes are compared
_WHITENED_LEAD = 0.1  # the share of the sample by which the whitened pass must prove more to go first (its
#                       witnesses are explicit: d float64 numbers a token, where the plain pass states a formula)


def _whitened_first(head: EngineHead, plain: integer_pass.IntegerRows, round_copy: integer_pass.IntegerRows) -> bool:
    """Whether the whitened int8 pass proves more of a sample of the head's rows than the plain one: a rule of
    the head alone (every _SAMPLE-th competitor row), so that the order does not depend on the tokens asked."""
    competitors = torch.nonzero(head.competitor).flatten().cpu().numpy()
    sample = competitors[::max(1, competitors.size // _SAMPLE)][:_SAMPLE]
    plain_won = integer_pass.int8_pass(head, sample, None, plain)[0].sum()
    whitened_won = whitened_integer.whitened_int8(head, sample, None, round_copy).proved.size
    return whitened_won > plain_won + _WHITENED_LEAD * sample.size


def _whitened_on(head: EngineHead, ids: np.ndarray, rest: np.ndarray, progress) -> WhitenedOutcome:
    """The whitened int8 pass on ids[rest], its positions made positions in ``ids``; ``rest`` loses what it
    proves."""
    pending = np.nonzero(rest)[0]
    outcome = whitened_integer.whitened_int8(head, ids[pending], progress)
    outcome.proved, outcome.close = pending[outcome.proved], pending[outcome.close]
    rest[outcome.proved] = False
    return outcome


def _int8_on(head: EngineHead, ids: np.ndarray, chosen: np.ndarray, progress, copy: integer_pass.IntegerRows):
    """int8_pass on ids[chosen], its outcomes spread to full-length arrays (not proved elsewhere)."""
    count = len(ids)
    won, margin = np.zeros(count, dtype=bool), np.full(count, -np.inf)
    scale, runner_up = np.ones(count), np.full(count, -1, dtype=np.int64)
    at = np.nonzero(chosen)[0]
    if at.size:
        won[at], margin[at], scale[at], runner_up[at] = integer_pass.int8_pass(head, ids[at], progress, copy)
    return won, margin, scale, runner_up


def _exact_rows_margin(head: EngineHead, ids: np.ndarray, won: np.ndarray, margin: np.ndarray,
                       scale: np.ndarray) -> np.ndarray:
    """The bfloat16 pass's margins as lower bounds for the exact rows: its lower bound holds for the rows
    as stored, which derived rows (the norm domain's reduced head, translated rows) miss by their error
    bounds (certify.derived_error); on the unit ball per unit of ||z||, and that division rounded down."""
    margin = margin.copy()
    at = np.nonzero(won)[0]
    if not at.size:
        return margin
    k = torch.as_tensor(ids[at], device=head.device)
    lower = torch.as_tensor(margin[at], device=head.device)
    # The pass bounds the margin at the exact point s (w_k - c); the witness stated is that point as float64
    # computes it, fl(s fl(w_k - c)), within (2u + u^2) ||z|| of it, which moves each logit gap by at most
    # that times ||w_k|| + ||w_i||
    stored = 2.01 * UNIT_ROUNDOFF * (head.row_norm[k] + head.max_row_norm)
    if head.domain.bounded:  # ||s (w_k - c)||, by blocks of tokens: no float64 copy of the rows proved
        norm_z = torch.cat([safe_norm(head.rows64(k[j:j + 2048]) - head.witness_centre, dim=1)
                            for j in range(0, k.numel(), 2048)])
        norm_z = torch.as_tensor(scale[at], device=head.device) * norm_z * (1 + gamma(head.d + 10))
        lower = less_derived_error(head, k, rounded_down(lower - rounded_up(stored * norm_z)), norm_z)
    else:  # per unit of ||z||: derived_error(norm_z) / norm_z, and the pass's division by its bound on ||z||
        lower = rounded_down(rounded_down(lower) - rounded_up(stored))
        if head.row_error is not None:
            lower = rounded_down(lower - rounded_up(head.row_error[k] + head.max_row_error))
    margin[at] = lower.cpu().numpy()
    return margin


def _screen(head: EngineHead, ids: np.ndarray, progress=None) -> ScreenResult:
    count = len(ids)
    result = ScreenResult(
        certified=np.zeros(count, dtype=bool),
        margin=np.full(count, -np.inf),
        shift=np.zeros(count),
        scale=np.ones(count),
        runner_up=np.full(count, -1, dtype=np.int64),
        threat=np.full(count, -1, dtype=np.int64),
        close_shift=np.full(count, np.nan),
        close_scale=np.full(count, np.nan),
    )
    arithmetic = _Arithmetic(head)
    chunk = max(1, min(count, 4096, _BLOCK_BUDGET // max(head.n, 1)))
    # Reused blocks: a fresh large allocation per chunk costs more in page faults than the reductions.
    gram = torch.empty(chunk, head.n, dtype=arithmetic.dtype, device=head.device)
    scratch = torch.empty_like(gram) if head.bias is not None else None
    with ieee_float32_products():
        for start in range(0, count, chunk):
            part = slice(start, min(start + chunk, count))
            rows = part.stop - part.start
            _screen_chunk(head, arithmetic, ids[part], result, part, gram[:rows],
                          scratch[:rows] if scratch is not None else None)
            if progress is not None:
                progress.update(rows)
    if arithmetic.dtype == torch.float32:
        _recheck_close_calls(head, ids, result)
    return result


def _recheck_close_calls(head: EngineHead, ids: np.ndarray, result: ScreenResult) -> None:
    """Candidates that won by less than the float32 rounding bound, checked again in float64.

    The float64 bound is about 2^29 times smaller; the product costs one float64
    row of W W^T per token, for the few tokens whose margins are that small.
    """
    close = np.nonzero(~result.certified & np.isfinite(result.close_scale))[0]
    for s in range(0, close.size, 256):
        part = close[s:s + 256]
        rows = head.rows64(ids[part])
        shift = torch.as_tensor(result.close_shift[part], device=head.device)
        scale = torch.as_tensor(result.close_scale[part], device=head.device)
        witnesses = scale[:, None] * (rows - shift[:, None] * head.witness_centre)
        check = check_witnesses_sharpened(head, ids[part], witnesses)
        won = part[check.certified]
        margin = check.margin[check.certified]  # a lower bound at z (certify.check_witnesses)
        if head.bias is None and not head.domain.bounded:  # the unit-ball margin, as the pass reports it
            margin = per_unit_norm(margin, safe_norm(witnesses[torch.as_tensor(check.certified)], dim=1).cpu().numpy(),
                                   head.d)
        result.certified[won] = True
        result.margin[won] = margin
        result.shift[won] = result.close_shift[won]
        result.scale[won] = result.close_scale[won]
        result.runner_up[won] = check.runner_up[check.certified]


class _Arithmetic:
    """The precision the pass computes in, and the rounding bounds that go with it."""

    def __init__(self, head: EngineHead):
        finite = head.bias is None or head.max_abs_bias <= 2.0**60
        in_range = 2.0**-40 <= head.typical_spread and head.max_row_norm <= 2.0**40 and finite
        large = head.n * head.d >= _LARGE_HEAD
        stored32 = head.stored.dtype != torch.float64  # float32, or float16 / bfloat16 widened by blocks
        self.dtype = torch.float32 if (stored32 or large) and in_range else torch.float64
        # A float32 head is its own stored rows, its power of two taken on the tokens' side (gram); one out of
        # range is screened in float64.
        self.half = head.half and self.dtype == torch.float32
        if self.dtype == torch.float32 and stored32:
            self.weight, self.exponent = head.stored, head.exponent
        elif head.half:  # screened in float64: the rows 2^a v formed there at once (exact), no float32 copy first
            self.weight, self.exponent = head.stored.to(torch.float64).mul_(head.power), 0
        else:
            self.weight, self.exponent = head.weight.to(self.dtype), 0
        # A large float64 head (the norm domain's reduced head, a float64 checkpoint) is screened through
        # a float32 copy: |w_i.w_k - v_i.v_k| <= e_i ||w_k|| + ||w_i|| e_k + e_i e_k, e_i = ||w_i - v_i||.
        self.copy_error = None
        if self.dtype == torch.float32 and head.stored.dtype == torch.float64:
            self.copy_error = torch.empty(head.n, dtype=torch.float64, device=head.device)
            for s in range(0, head.n, 2048):
                self.copy_error[s:s + 2048] = safe_norm(
                    head.weight[s:s + 2048] - self.weight[s:s + 2048].to(torch.float64), dim=1) * (1 + gamma(head.d + 4))
            self.max_copy_error = float(self.copy_error.max())
        if self.dtype == torch.float32:
            self.unit = UNIT_ROUNDOFF_32
            # float32 products, plus the float64 rounding of the reported witness
            self.error_factor = logit_error_factor(head.d, UNIT_ROUNDOFF_32) + head.error_factor
            self.underflow_floor = underflow_floor(head.d, SMALLEST_SUBNORMAL_32) + head.underflow_floor
            self.centre_logits = head.centre_logits.to(torch.float32)
            # rounding w_i . c and the bias to float32, once, for every row
            self.centre_error = float((head.centre_logits - self.centre_logits.to(torch.float64)).abs().max())
            self.bias = head.bias.to(torch.float32) if head.bias is not None else None
            self.bias_error = (float((head.bias - self.bias.to(torch.float64)).abs().max())
                               if head.bias is not None else 0.0)
        else:
            self.unit = UNIT_ROUNDOFF
            self.error_factor, self.underflow_floor = head.error_factor, head.underflow_floor
            self.centre_logits, self.centre_error = head.centre_logits, 0.0
            self.bias, self.bias_error = head.bias, 0.0

    def gram(self, head: EngineHead, k: torch.Tensor, out: torch.Tensor) -> None:
        """out = the products w_k . w_i of tokens k with every row, in the pass's precision. With an exponent
        the rows are w = 2^a v (v the stored rows, w a float32 array: normal_form's carry), and (2^2a v_k) . v_i
        is computed: its products are the same real numbers as w_k . w_i, so every rounding is the same, where
        2^2a v_k = 2^a w_k is itself a float32 array (checked: scaled in float64, it is finite and its float32
        rounding exact); else w_k . w_i on the scaled copy (EngineHead.weight), the same numbers again."""
        rows = self.weight.index_select(0, k)
        if self.half:  # the rows widened block by block: the products of a float32 copy, without the copy
            rows = rows.to(torch.float32)
            left = float32_times_power(rows, 2 * self.exponent) if self.exponent else rows
            scaled = left is None
            if scaled:  # 2^a v_k on the left and 2^a v_i on the right: both float32 arrays (the carry)
                left = head.rows_in_storage(k)
            for s, e, block in head.narrow_blocks(scaled):
                out[:, s:e] = left @ block.T
            return
        if self.exponent:
            narrow = float32_times_power(rows, 2 * self.exponent)
            if narrow is not None:
                torch.matmul(narrow, self.weight.T, out=out)
            else:
                copy = head.weight
                torch.matmul(copy.index_select(0, k), copy.T, out=out)
            return
        torch.matmul(rows, self.weight.T, out=out)

    def scales(self, scale: torch.Tensor) -> torch.Tensor:
        """Scales the pass can use exactly: rounded towards zero to its precision, so none leaves the domain."""
        return scale if self.dtype == torch.float64 else float32_towards_zero(scale)


def _candidate_scales(head: EngineHead, directions: torch.Tensor) -> list[torch.Tensor]:
    """Scales s to try for each direction (one tensor of per-token scales per rung)."""
    domain = head.domain
    ones = torch.ones(directions.shape[0], dtype=torch.float64, device=head.device)
    if domain.bounded:
        largest = domain.largest_scales(directions)
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


def _screen_chunk(head: EngineHead, arithmetic: _Arithmetic, ids: np.ndarray, result: ScreenResult, part: slice,
                  gram: torch.Tensor, scratch: torch.Tensor | None) -> None:
    """Screen one chunk of tokens; ``gram`` (and ``scratch`` with a bias) are chunk x n work blocks."""
    device = head.device
    k = torch.as_tensor(ids, device=device)
    cols = torch.arange(len(ids), device=device)
    arithmetic.gram(head, k, gram)  # chunk x n: w_k . w_i, reduced along contiguous rows
    rows_k = head.rows64(k)
    norm_k = head.row_norm[k]
    own_gram = gram[cols, k].clone()
    gram[cols, k] = -torch.inf  # the token is not its own rival
    if head.row_mask is not None:
        gram += head.row_mask[None, :].to(gram.dtype)
    bias = arithmetic.bias
    own_bias = bias[k] if bias is not None else None
    centre = head.witness_centre
    centre_norm = float(torch.linalg.vector_norm(centre))
    unit = arithmetic.unit

    best_quality = torch.full((len(ids),), -torch.inf, dtype=torch.float64, device=device)
    chosen = {name: torch.as_tensor(getattr(result, name)[part], device=device)
              for name in ("certified", "margin", "shift", "scale", "runner_up", "close_shift", "close_scale")}
    best_slack = torch.full((len(ids),), -torch.inf, dtype=torch.float64, device=device)

    for t in _SHIFTS:
        if t:
            gram -= arithmetic.centre_logits[None, :]  # now w_i . (w_k - c); the masked entries stay -inf
        directions = rows_k - t * centre if t else rows_k
        own_base = own_gram - t * arithmetic.centre_logits[k]
        norm_z = torch.linalg.vector_norm(directions, dim=1)
        for rung, scale in enumerate(_candidate_scales(head, directions)):
            scale = arithmetic.scales(scale)
            leads = _rival_logits(gram, scratch, bias, own_base, own_bias, scale, rung, chosen["certified"])
            if leads is None:
                continue
            own, rival, runner_up = leads
            margin = (own - rival).to(torch.float64)
            error = _rounding_bound(head, arithmetic, k, norm_k, t, centre_norm, scale)
            tolerance = error + _witness_lead(head, k, norm_z, scale)
            certified = (proves_positive(margin, tolerance, unit) & torch.isfinite(own).to(torch.bool)
                         & inside_domain(head.domain, directions * scale[:, None]))
            # the margin stated: the computed one less its rounding bound, a lower bound of the exact one
            reported = _reported_margin(head, proven_lower(margin, error, unit), scale, directions)
            best_quality = _keep_best(chosen, best_quality, certified, reported, runner_up, t, scale)
            best_slack = _keep_closest(chosen, best_slack, margin, own, tolerance, reported, t, scale)
            if t == 0 and rung == 0:  # the strongest rival at z = w_k itself
                result.threat[part] = runner_up.cpu().numpy()
    for name, values in chosen.items():
        getattr(result, name)[part] = values.cpu().numpy()


def _rival_logits(gram: torch.Tensor, scratch: torch.Tensor | None, bias: torch.Tensor | None,
                  own_base: torch.Tensor, own_bias: torch.Tensor | None, scale: torch.Tensor, rung: int,
                  certified: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(the tokens' own logits, their strongest rivals' and those rivals' rows) at this scale; None: none pending."""
    if bias is None:
        rival, runner_up = gram.max(dim=1)
        return own_base, rival, runner_up
    if rung == 0:
        torch.mul(gram, scale.to(gram.dtype)[:, None], out=scratch)
        scratch += bias[None, :]
        rival, runner_up = scratch.max(dim=1)
        return own_base * scale.to(gram.dtype) + own_bias, rival, runner_up
    # the smaller scales of the ladder, for the tokens no candidate has certified yet
    pending = torch.nonzero(~certified).flatten()
    if pending.numel() == 0:
        return None
    block = scratch[:pending.numel()]
    torch.index_select(gram, 0, pending, out=block)
    block *= scale.to(gram.dtype)[pending, None]
    block += bias[None, :]
    rival = torch.full_like(own_base, torch.inf)
    runner_up = torch.zeros(own_base.shape[0], dtype=torch.int64, device=own_base.device)
    rival[pending], runner_up[pending] = block.max(dim=1)
    return own_base * scale.to(gram.dtype) + own_bias, rival, runner_up


def _rounding_bound(head: EngineHead, arithmetic: _Arithmetic, k: torch.Tensor, norm_k: torch.Tensor, t: float,
                    centre_norm: float, scale: torch.Tensor) -> torch.Tensor:
    """A bound on the rounding error of each computed margin at the scale and shift."""
    # ||z|| <= s (||w_k|| + t ||c||): the size the rounding bound needs.
    size = (scale if head.bias is not None else 1.0) * (norm_k + t * centre_norm)
    error = (arithmetic.error_factor * ((norm_k + head.max_row_norm) * size + head.max_abs_bias)
             + arithmetic.underflow_floor + 2 * arithmetic.bias_error
             + 2 * t * arithmetic.centre_error * (scale if head.bias is not None else 1.0))
    if arithmetic.bias is not None:
        error = error + arithmetic.error_factor * head.bias[k].abs()
    error = error + derived_error(head, k, size * torch.ones_like(norm_k))
    if arithmetic.copy_error is not None:  # the products were of the float32 copy's rows
        e_k = arithmetic.copy_error[k]
        error = error + 2 * (scale if head.bias is not None else 1.0) * (
            arithmetic.max_copy_error * (norm_k + e_k) + head.max_row_norm * e_k)
    return error


def _witness_lead(head: EngineHead, k: torch.Tensor, norm_z: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The lead the verdict rule asks of each witness (EngineHead.witness_lead), at ||z|| rounded up."""
    # without a bias the margin is the direction's, and the lead at z = s d is s times it
    lead = head.witness_lead(k, norm_z * (scale if head.bias is not None else 1.0) * (1 + 2.0**-20))
    if head.bias is None and head.domain.bounded:
        lead = lead / scale * (1 + 2.0**-50)
    return lead


def _reported_margin(head: EngineHead, lower: torch.Tensor, scale: torch.Tensor,
                     directions: torch.Tensor) -> torch.Tensor:
    """The margin reported for a candidate: ``lower`` at z itself (per unit norm in R^d without a bias)."""
    if head.bias is None:  # the margin was computed at the direction; z is s times it
        return (rounded_down(lower * scale) if head.domain.bounded
                else per_unit_norm(lower, safe_norm(directions, dim=1), head.d))
    return lower


def _keep_best(chosen: dict[str, torch.Tensor], best_quality: torch.Tensor, certified: torch.Tensor,
               reported: torch.Tensor, runner_up: torch.Tensor, t: float, scale: torch.Tensor) -> torch.Tensor:
    """The best certified margin so far; ``chosen`` takes the candidates that improve on it."""
    quality = torch.where(certified, reported, torch.full_like(reported, -torch.inf))
    better = quality > best_quality
    best_quality = torch.where(better, quality, best_quality)
    chosen["certified"] |= better
    chosen["margin"] = torch.where(better, reported, chosen["margin"])
    chosen["shift"] = torch.where(better, torch.full_like(reported, t), chosen["shift"])
    chosen["scale"] = torch.where(better, scale * torch.ones_like(reported), chosen["scale"])
    chosen["runner_up"] = torch.where(better, runner_up, chosen["runner_up"])
    return best_quality


def _keep_closest(chosen: dict[str, torch.Tensor], best_slack: torch.Tensor, margin: torch.Tensor,
                  own: torch.Tensor, tolerance: torch.Tensor, reported: torch.Tensor, t: float,
                  scale: torch.Tensor) -> torch.Tensor:
    """The largest relative slack so far; ``chosen`` takes the close calls that improve on it."""
    # relative slack of a candidate that won in the computed numbers: a close call if not certified
    slack = torch.where((margin > 0) & torch.isfinite(own).to(torch.bool), margin / tolerance - 1,
                        torch.full_like(margin, -torch.inf))
    closer = slack > best_slack
    best_slack = torch.where(closer, slack, best_slack)
    chosen["close_shift"] = torch.where(closer, torch.full_like(reported, t), chosen["close_shift"])
    chosen["close_scale"] = torch.where(closer, scale * torch.ones_like(reported), chosen["close_scale"])
    return best_slack
