"""The int8 pass of the screen: the Gram products of rows rounded to 8-bit integers, exact in int32.

An int8 product runs about 1.7 times as fast as a bfloat16 one on CPUs with
AVX512-VNNI (twice on GPUs) and its copy of the head is half the size, yet its
sums are exact: with |q| <= 127 every product of two rows of width at most
133143 is an integer below 2^31. The rounding happens once, in the rows.

The rows. Each centred row y_i = w_i - c (c the head's witness centre) is
formed in float64, y^_i = fl(w_i - c), and put on a grid of step S_i = 2^e_i
with e_i = E_i - 7, where 2^(E_i - 1) <= max_j |y^_ij| < 2^E_i:

    q_i = clamp(round(y^_i / S_i), -127, 127),   r_i = y^_i - S_i q_i,

both exact in float64 (a division by a power of two; the difference of two
floats within a factor of two of each other, or r = y^ where q = 0). Rows share
their step with every row of the same exponent, so that the steps form a few
groups of contiguous columns in the copy (the rows are stored in order of
their step, largest first, at most 8 steps: a row whose exponent lies further
below takes the eighth step, where its q are small). Then

    e_i = y_i - S_i q_i,   ||e_i|| <= ||r_i|| + u ||y_i||

(u the unit roundoff of float64: the one rounding of y^_i).

The bound. For any vector x (the token's own centred row, or a whitened
witness) on a grid of its own, x = S_x q_x + e_x, the identity

    y_i . x = S_i S_x (q_i . q_x) + S_i q_i . e_x + e_i . x

gives, over the rivals i of one step S,

    max_i y_i . x <= S S_x M + S Q ||e_x|| + E ||x||,

M the largest integer product q_i . q_x among them (exact), Q >= ||q_i|| and
E >= ||e_i|| the largest over them. S S_x M is exact in float64; the other
terms are computed with a few roundings and taken a few units above. The token
is certified when its own product, ||y_k||^2 (a float64 lower bound), exceeds
the largest bound over the steps by more than what the float64 re-check of the
witness needs (low_precision.recheck_needs), exactly as in the bfloat16 pass;
every other token goes on to the float32 pass.

The products formed once. With x the token's own row the products q_i . q_k are
the entries of a symmetric matrix: where the pass covers most of the stored rows
(self_bounds), it forms the blocks on and above the diagonal only, each giving
its rows' tokens their maxima over its columns and its columns' tokens theirs
over its rows, in an order that keeps every token's first rival among equal
products: the bounds are the plain pass's, bit for bit.

Exactness of the sums is not taken on trust: a probe at first use on each device
compares the product, on the call the pass makes, with exact float64 sums on
data that a kernel saturating 16-bit intermediate sums (AVX2's
vpmaddubsw) gets wrong. Where the probe fails, or the device has no int8
product, the pass is skipped and the bfloat16 pass runs instead.

The pass covers heads without a bias (in any domain): a bias would ride in the
product as one more column, and the bfloat16 pass keeps those.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import torch

from auditor.engine.arithmetic.head import EngineHead
from auditor.engine.arithmetic.rounding import UNIT_ROUNDOFF, float32_towards_zero, gamma, safe_norm
from auditor.engine.screen.low_precision import record_self_witnesses, witness_outcomes

LIMIT = int(torch.iinfo(torch.int8).max)  # 127: |q| <= 127, so that -q is an int8 too
_INT32_MAX = int(torch.iinfo(torch.int32).max)
_MASKED = int(torch.iinfo(torch.int32).min)  # below any product (|q_i . q_x| <= 127^2 width < 2^31 - 1)
_FRACTION_BITS = 7  # q = y / 2^(E - 7): 2^6 <= max |q| <= 2^7 before the clamp
_STEPS = 8  # at most this many grid steps, 2^e_max down to 2^(e_max - 7)
# Entries of one chunk x n int32 block: a quarter of the head's entries, at least 2^24 (64 MiB) and at most 2^26
# (256 MiB; at 128256 x 4096 the product runs at 0.67 of its speed on a block a quarter of that).
_BLOCK_LEAST, _BLOCK_MOST = 1 << 24, 1 << 26
_ROWS_BLOCK = 1024  # rows formed in float64 at once while the copy is made
_ALIGN = 8  # widths and row counts padded to multiples of this (the int8 kernels of GPUs ask for it)
_MIN_CHUNK = 32  # GPUs' int8 kernels ask for more than 16 rows on the left
_PROBE_LENGTH = 4096
# The side of the symmetric pass's square blocks: 2^22 int32 entries (16 MiB) on a CPU, where 2048 ran faster
# than 3072 and 4096 at 32768 x 512 (the blocks' reductions then stay in cache); 2^26 (256 MiB) on a GPU, where
# each block costs a dozen kernel launches.
_SIDE, _DEVICE_SIDE = 2048, 8192

log = logging.getLogger("auditor")
_probed: dict[str, bool] = {}


def _padded(count: int) -> int:
    return -(-count // _ALIGN) * _ALIGN


def exact_products(device: torch.device, rows: int = 32, width: int = _PROBE_LENGTH) -> bool:
    """Whether this device's int8 product (torch._int_mm, a block of ``rows`` rows times the transpose of a copy
    of rows, into an int32 block, as the pass calls it) returns the exact integer sums, checked once per device
    and shape against float64 sums (exact: integers below 2^53) on rows of +-127 (whose pairwise sums overflow
    16 bits), of alternating signs and irregular rows; and whether torch.ldexp scales by powers of two exactly
    over the exponents the pass uses (on CPUs and GPUs it multiplies by a computed power of two)."""
    key = f"{device}:{rows}:{width}"
    if key not in _probed and device.type not in ("cpu", "cuda"):
        _probed[key] = False
    if key not in _probed:
        try:
            generator = torch.Generator().manual_seed(0x1A8)
            extreme = torch.full((2, width), LIMIT, dtype=torch.int64)
            extreme[1, 1::2] = -LIMIT
            irregular = torch.randint(-LIMIT, LIMIT + 1, (rows + 38, width), generator=generator)
            left = torch.cat([extreme, irregular[:rows - 2]])
            right = torch.cat([extreme, -extreme, irregular.flip(0)[:36]])  # 40 rows
            exact = left.to(torch.float64) @ right.to(torch.float64).T
            block = torch.empty(left.shape[0], right.shape[0], dtype=torch.int32, device=device)
            copy = right.to(torch.int8).to(device)
            torch._int_mm(left.to(torch.int8).to(device), copy.T, out=block)
            products = torch.equal(block.cpu().to(torch.float64), exact)
            mantissas = torch.tensor([127.0, -113.0, 2.0**31 - 1, 0.5, 3.0], dtype=torch.float64)
            exponents = torch.arange(-1000, 990, dtype=torch.float64)
            scaled = torch.ldexp(mantissas.to(device)[:, None], exponents.to(device)[None, :]).cpu()
            wanted = torch.tensor([[math.ldexp(m, int(e)) for e in exponents.tolist()] for m in mantissas.tolist()],
                                  dtype=torch.float64)
            _probed[key] = bool(products and torch.equal(scaled, wanted))
        except (RuntimeError, AttributeError) as error:  # no int8 product on this device
            log.debug("int8 screen off on %s: %s", device, error)
            _probed[key] = False
    return _probed[key]


def applies(head: EngineHead) -> bool:
    """The pass covers heads without a bias of at least head.int8_entries entries (EngineOptions), with rows
    in a range where the grids stay far from float64's limits, of a width whose products fit in int32, on a
    device whose int8 product is exact."""
    return head.bias is None and head.n * head.d >= head.int8_entries and fits(head)


def fits(head: EngineHead, width: int | None = None) -> bool:
    """Rows in a range where the grids stay far from float64's limits, of a width (d, or ``width``) whose
    products fit in int32, on a device whose int8 product is exact at that width."""
    width = _padded(head.d if width is None else width)
    if not (width * LIMIT * LIMIT <= _INT32_MAX and 2.0**-40 <= head.typical_spread and head.max_row_norm <= 2.0**40):
        return False
    if not (exact_products(head.device) and exact_products(head.device, _chunk_rows(head), width)):
        log.debug("int8 screen off on %s: its int8 products are not exact; the bfloat16 pass runs instead",
                  head.device)
        return False
    return True


@dataclass
class IntegerRows:
    """The head's centred rows on their grids, in order of their step (largest first)."""

    values: torch.Tensor  # rows x width int8: q of the row at each position, zero rows and columns padding it
    order: torch.Tensor  # the row at each position (the padding positions excluded)
    position: torch.Tensor  # the position of each row
    exponent: torch.Tensor  # e_i of each row: S_i = 2^e_i
    error: torch.Tensor  # >= ||y_i - S_i q_i|| per row (float64)
    size: torch.Tensor  # >= ||y_i|| per row (float64)
    steps: list[tuple[int, int, int, float, float]]  # (first position, end, e, Q, E) of each step's rows
    padding: torch.Tensor  # the positions past the last row (masked out of every maximum)
    formation: torch.Tensor | None = None  # transformed rows: f_i >= ||y_i - y^_i|| (integer_rows)


def _grid_exponents(maxima: torch.Tensor) -> torch.Tensor:
    """E - 7 with 2^(E-1) <= m < 2^E for each row's largest entry m (torch.frexp: m = f 2^E, f in [1/2, 1))."""
    _, exponent = torch.frexp(maxima)
    return exponent.to(torch.int64) - _FRACTION_BITS


def _on_grid(values: torch.Tensor, exponent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, r): q = clamp(round(v / 2^e), -127, 127) and r = v - 2^e q per row, both exact in float64."""
    q = torch.round(torch.ldexp(values, -exponent[:, None].to(values.dtype))).clamp_(-LIMIT, LIMIT)
    return q, values - torch.ldexp(q, exponent[:, None].to(values.dtype))


def integer_rows(head: EngineHead, transform: torch.Tensor | None = None) -> IntegerRows:
    """The pass's copy of the head (a quarter of a float32 head), made by blocks of rows formed in float64
    (EngineHead.rows64: rows stored as 2^a v are scaled there, exactly), each row formed once (again only
    where the eighth step's clamp moves its grid); the integers are kept in row order, then copied into the
    order of the steps (for that copy's moment, two int8 copies: half a float32 head).

    With ``transform`` A (r x d) the copy is of the rows y_i = A (w_i - c) instead (the whitened head,
    whitened_integer.py), formed as y^_i = fl(A fl(w_i - c)) in float64: with a_i = w_i - c and its computed
    a^_i, |a^_i - a_i| <= u |a_i| and |fl(A a^_i) - A a^_i| <= gamma_d |A| |a^_i| entrywise, so

        ||y^_i - y_i|| <= (gamma_d + u / (1 - u)) ||A||_F ||a^_i|| = f_i   (``formation``),

    which ``error`` and ``size`` then carry in place of the one rounding u ||y_i|| of the plain rows."""
    device, n, d = head.device, head.n, head.d
    r = d if transform is None else transform.shape[0]
    width, rows = _padded(r), _padded(n)
    formation = None
    if transform is not None:
        frobenius = float(safe_norm(transform.reshape(-1), dim=0)) * (1 + gamma(r * d + 2))
        factor = (gamma(d) + 2 * UNIT_ROUNDOFF) * frobenius * (1 + gamma(d + 2)) * (1 + 2.0**-40)
        formation = torch.empty(n, dtype=torch.float64, device=device)

    def formed(ids: torch.Tensor) -> torch.Tensor:
        offsets = head.rows64(ids) - head.witness_centre
        if transform is None:
            return offsets
        # (with a product's underflow, at most 2^-1075 each: sqrt(r) d 2^-1075 more in norm)
        formation[ids] = safe_norm(offsets, dim=1) * factor + r * d * 2.0**-1074
        return offsets @ transform.T

    # One formation of each row (for a whitened copy, a float64 product with A): its largest entry, its norm
    # and its integers on its own grid, kept in row order; the few rows whose step the clamp below moves are
    # formed again, and the integers are then put in the order of their steps.
    maxima = torch.empty(n, dtype=torch.float64, device=device)
    size = torch.empty(n, dtype=torch.float64, device=device)
    raw = torch.zeros(n, width, dtype=torch.int8, device=device)
    residual_norm = torch.empty(n, dtype=torch.float64, device=device)
    length = torch.empty(n, dtype=torch.float64, device=device)

    def on_grids(ids: torch.Tensor, offsets: torch.Tensor, exponent: torch.Tensor) -> None:
        q, residual = _on_grid(offsets, exponent)
        raw[ids, :r] = q.to(torch.int8)
        residual_norm[ids] = safe_norm(residual, dim=1) * (1 + gamma(r + 2))
        # ||q_i||: an integer sum of squares, exact in float64; its square root one rounding
        length[ids] = torch.sqrt((q * q).sum(dim=1)) * (1 + 2 * UNIT_ROUNDOFF)

    for s in range(0, n, _ROWS_BLOCK):
        ids = torch.arange(s, min(s + _ROWS_BLOCK, n), device=device)
        offsets = formed(ids)
        maxima[ids] = offsets.abs().amax(dim=1)
        size[ids] = safe_norm(offsets, dim=1)
        on_grids(ids, offsets, _grid_exponents(maxima[ids]))
    size *= 1 + gamma(r + 2)  # >= ||y^_i|| and so, with the one rounding of each entry, >= ||y_i||
    if formation is not None:  # >= ||y^_i|| + f_i >= ||y_i||
        size = (size + formation) * (1 + 2 * UNIT_ROUNDOFF)
    exponent = _grid_exponents(maxima)
    top = int(exponent[head.competitor].max()) if bool(head.competitor.any()) else int(exponent.max())
    moved = torch.nonzero((exponent < top - _STEPS + 1) | (exponent > top)).flatten()
    exponent.clamp_(min=top - _STEPS + 1, max=top)  # the eighth step takes every row further below
    for s in range(0, moved.numel(), _ROWS_BLOCK):
        # (formed again: any computed y^_i is within f_i of y_i, so r_i of this computation bounds e_i with f_i)
        ids = moved[s:s + _ROWS_BLOCK]
        on_grids(ids, formed(ids), exponent[ids])
    error = residual_norm + (UNIT_ROUNDOFF * size * (1 + 2 * UNIT_ROUNDOFF) if formation is None
                             else formation * (1 + 2 * UNIT_ROUNDOFF))
    del residual_norm
    order = torch.argsort(-exponent, stable=True)
    position = torch.empty_like(order)
    position[order] = torch.arange(n, device=device)
    values = torch.zeros(rows, width, dtype=torch.int8, device=device)
    values.index_copy_(0, position, raw)
    del raw
    steps = []
    sorted_exponent = exponent[order]
    for e in torch.unique(sorted_exponent).tolist()[::-1]:
        at = torch.nonzero(sorted_exponent == e).flatten()
        first, end = int(at[0]), int(at[-1]) + 1
        steps.append((first, end, int(e), float(length[order[first:end]].max()),
                      float(error[order[first:end]].max())))
    return IntegerRows(values, order, position, exponent, error, size, steps,
                       torch.arange(n, rows, device=device), formation)


def _upper_bounds(rows: IntegerRows, left_exponent: torch.Tensor, left_error: torch.Tensor, left_norm: torch.Tensor,
                  block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Upper bounds on max_i y_i . x over the unmasked rivals, for vectors x = 2^e_x q_x + e_x whose integer
    products with every stored row ``block`` holds (the masks already set), ``left_exponent`` e_x,
    ``left_error`` >= ||e_x|| and ``left_norm`` >= ||x||. Returns (bound, the rival of the step that gives it,
    the slack of that step's bound above its integer part); -inf where every rival is masked."""
    best, at = _step_maxima(rows, block)
    return _bounds(rows, best, at, left_exponent, left_error, left_norm)


def _bounds(rows: IntegerRows, best: torch.Tensor, at: torch.Tensor, left_exponent: torch.Tensor,
            left_error: torch.Tensor, left_norm: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """_upper_bounds from each step's largest integer product ``best`` (count x steps, _MASKED where every
    rival of the step is masked) and the position ``at`` of its first rival."""
    count = best.shape[0]
    bound = torch.full((count,), -torch.inf, dtype=torch.float64, device=best.device)
    chosen_slack = torch.zeros(count, dtype=torch.float64, device=best.device)
    rival = torch.zeros(count, dtype=torch.int64, device=best.device)
    for j, (_, _, e, length, error) in enumerate(rows.steps):
        exact = torch.ldexp(best[:, j].to(torch.float64), (left_exponent + e).to(torch.float64))  # S S_x M, exact
        exact = torch.where(best[:, j] == _MASKED, torch.full_like(exact, -torch.inf), exact)
        # S Q ||e_x|| + E ||x||: three roundings, taken up by 4u; the sum's rounding by 2u of its terms' size
        slack = (torch.ldexp(length * left_error, torch.full_like(left_error, e)) + error * left_norm) * (1 + 4 * UNIT_ROUNDOFF)
        here = exact + slack + 2 * UNIT_ROUNDOFF * (exact.abs() + slack) + 2.0**-1000
        here = torch.where(torch.isfinite(exact), here, exact)
        better = here > bound
        bound = torch.where(better, here, bound)
        chosen_slack = torch.where(better, here - exact, chosen_slack)
        rival = torch.where(better, at[:, j], rival)
    return bound, rows.order[rival.clamp_(max=rows.order.numel() - 1)], chosen_slack


_GROUP = 64  # entries reduced together before the first maximum is looked for among them


def _first_maxima(part: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The largest entry of each row (dim 1) or column (dim 0) of a 2-D block and the index of its first
    occurrence, as Tensor.max(dim) gives them. Tensor.max with indices runs several times slower than amax on
    int32 (it is not vectorised); here amax takes groups of _GROUP entries, the first group holding the largest
    is found among the groups' maxima, and its first occurrence inside that group."""
    if dim == 0:
        part = part.T  # (reshapes below are views either way)
    length = part.shape[1]
    full = length // _GROUP * _GROUP
    if full == 0:
        return part.max(dim=1)
    offsets = torch.arange(_GROUP, device=part.device)
    if dim == 1:
        groups = part[:, :full].reshape(part.shape[0], full // _GROUP, _GROUP).amax(dim=2)
        best, group = groups.max(dim=1)
        within = part.gather(1, group[:, None] * _GROUP + offsets).max(dim=1)[1]
    else:  # reduce across rows of the stored block (contiguous along its rows)
        stored = part.T
        groups = stored[:full].reshape(full // _GROUP, _GROUP, stored.shape[1]).amax(dim=1)
        best, group = groups.max(dim=0)
        within = stored.gather(0, group[None, :] * _GROUP + offsets[:, None]).max(dim=0)[1]
    at = group * _GROUP + within
    if full < length:
        tail, tail_at = part[:, full:].max(dim=1)
        later = tail > best  # strictly: the first occurrence stays first
        best, at = torch.where(later, tail, best), torch.where(later, tail_at + full, at)
    return best, at


def _step_maxima(rows: IntegerRows, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each step's largest product in every row of ``block`` (left vectors x every stored row) and the position
    of its first rival: (count x steps int32, count x steps int64)."""
    best = torch.full((block.shape[0], len(rows.steps)), _MASKED, dtype=torch.int32, device=block.device)
    at = torch.zeros(block.shape[0], len(rows.steps), dtype=torch.int64, device=block.device)
    _merge_rows(rows, block, 0, best, at)
    return best, at


def _merge(best: torch.Tensor, at: torch.Tensor, values: torch.Tensor, found: torch.Tensor) -> None:
    """Keeps the larger of ``best`` and ``values`` in place, ``at`` following; on a tie the earlier (``best``:
    positions are visited in increasing order)."""
    larger = values > best
    best.copy_(torch.where(larger, values, best))
    at.copy_(torch.where(larger, found, at))


def _side(device: torch.device) -> int:
    return _SIDE if device.type == "cpu" else _DEVICE_SIDE


def _symmetric(rows: IntegerRows, count: int) -> bool:
    """Whether the self-products of ``count`` tokens take the symmetric pass: it forms the products of P stored
    rows in about P (P + side) / 2 entries, where blocks of tokens form count x P of them, but reduces each
    block twice, by rows and by columns (the second about twice the cost of the first): from about two
    thirds of the rows on (bench/int8_blocks.py measures both ways on both sides of the rule)."""
    return 3 * count > 2 * rows.values.shape[0] + _side(rows.values.device)


def _symmetric_maxima(head: EngineHead, rows: IntegerRows, masked: torch.Tensor):
    """The step maxima of every stored row's own x (its own q, as int8_pass takes it) against every other row,
    from the products q_i . q_j with i <= j only: each square block of them gives the maxima of its rows'
    tokens over its columns and, off the diagonal, of its columns' tokens over its rows. Blocks are visited
    row band by row band, each band from the diagonal on, so every token's rivals come in increasing position
    and the first of equal products is kept, as in the plain pass; a token's maxima are the plain pass's, bit
    for bit. Yields (first, end, best, at) for the positions [first, end) whose rivals are all seen."""
    device = head.device
    values = rows.values
    total, width = values.shape
    side = _side(device)
    steps = rows.steps
    best = torch.full((total, len(steps)), _MASKED, dtype=torch.int32, device=device)
    at = torch.zeros(total, len(steps), dtype=torch.int64, device=device)
    hidden = torch.zeros(total, dtype=torch.bool, device=device)
    hidden[masked] = True
    buffer = torch.empty(side * side, dtype=torch.int32, device=device)
    for a in range(0, total, side):
        a_end = min(a + side, total)
        left = values[a:a_end]
        if left.shape[0] < side:  # the last band: padded to the shape the probe checked (exact_products)
            padded_left = torch.zeros(side, width, dtype=torch.int8, device=device)
            padded_left[:left.shape[0]] = left
            left = padded_left
        band_hidden = torch.nonzero(hidden[a:a_end]).flatten()
        for b in range(a, total, side):
            b_end = min(b + side, total)
            block = buffer[:left.shape[0] * (b_end - b)].view(left.shape[0], b_end - b)
            torch._int_mm(left, values[b:b_end].T, out=block)
            block = block[:a_end - a]
            if band_hidden.numel():
                block.index_fill_(0, band_hidden, _MASKED)
            column_hidden = torch.nonzero(hidden[b:b_end]).flatten()
            if column_hidden.numel():
                block.index_fill_(1, column_hidden, _MASKED)
            if b == a:  # the token's own product
                block.fill_diagonal_(_MASKED)
            _merge_rows(rows, block, b, best[a:a_end], at[a:a_end])  # the band's tokens over these columns
            for j, (first, end, _, _, _) in enumerate(steps):
                lo, hi = max(first, a), min(end, a_end)
                if b > a and lo < hi:  # the columns' tokens over the band's rows
                    values_j, found = _first_maxima(block[lo - a:hi - a], 0)
                    _merge(best[b:b_end, j], at[b:b_end, j], values_j, found + lo)
        yield a, a_end, best[a:a_end], at[a:a_end]


def self_bounds(head: EngineHead, ids: np.ndarray, rows: IntegerRows):
    """For tokens ``ids`` (each x its own stored row), by chunks: (positions into ids, k, bound, rival, slack) as
    _upper_bounds gives them. Where the tokens are most of the stored rows, all of them competitors, the
    symmetric pass forms each product once; otherwise blocks of tokens times every row (square blocks where
    the tokens are more than one left block, _tiled_maxima). The bounds are the same every way (the integer
    maxima are exact; ties keep the first rival)."""
    device = head.device
    masked = _masked_positions(head, rows)
    count = len(ids)
    k_all = torch.as_tensor(ids, device=device)
    if (count and _symmetric(rows, count) and bool(head.competitor[k_all].all())
            and exact_products(device, _side(device), rows.values.shape[1])):
        position = rows.position[k_all].cpu().numpy()
        order = np.argsort(position, kind="stable")
        sorted_position = position[order]
        for first, end, best, at in _symmetric_maxima(head, rows, masked):
            lo, hi = np.searchsorted(sorted_position, [first, end])
            if lo == hi:
                continue
            part = order[lo:hi]
            k = k_all[torch.as_tensor(part, device=device)]
            local = torch.as_tensor(sorted_position[lo:hi] - first, device=device)
            yield (part, k) + _bounds(rows, best[local], at[local], rows.exponent[k], rows.error[k], rows.size[k])
        return
    if count > _chunk_rows(head) and exact_products(device, _side(device), rows.values.shape[1]):
        side = _side(device)
        hidden = torch.zeros(rows.values.shape[0], dtype=torch.bool, device=device)
        hidden[masked] = True
        left = torch.zeros(side, rows.values.shape[1], dtype=torch.int8, device=device)
        buffer = torch.empty(side * side, dtype=torch.int32, device=device)
        for start in range(0, count, side):
            part = np.arange(start, min(start + side, count))
            k = k_all[start:start + part.size]
            best, at = _tiled_maxima(rows, rows.position[k], hidden, left, buffer)
            yield (part, k) + _bounds(rows, best, at, rows.exponent[k], rows.error[k], rows.size[k])
        return
    chunk, gram, left = _blocks(head, count, rows)
    for start in range(0, count, chunk):
        part = np.arange(start, min(start + chunk, count))
        k = k_all[start:start + part.size]
        position = rows.position[k]
        left[:part.size] = rows.values.index_select(0, position)
        left[part.size:] = 0
        _product(rows, left, gram, position, masked)
        yield (part, k) + _upper_bounds(rows, rows.exponent[k], rows.error[k], rows.size[k], gram[:part.size])


def _tiled_maxima(rows: IntegerRows, position: torch.Tensor, hidden: torch.Tensor, left: torch.Tensor,
                  buffer: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """_step_maxima for the tokens at ``position`` (at most the side of ``left``) against every stored row, the
    products formed in square blocks of the symmetric pass's side and reduced while they are in cache (one
    block of tokens x every row runs the product about a third slower on a CPU, and its reductions read it
    from memory); blocks in increasing position, so the first of equal products stays the rival."""
    count, side = position.numel(), left.shape[0]
    total = rows.values.shape[0]
    best = torch.full((count, len(rows.steps)), _MASKED, dtype=torch.int32, device=left.device)
    at = torch.zeros(count, len(rows.steps), dtype=torch.int64, device=left.device)
    left[:count] = rows.values.index_select(0, position)
    left[count:] = 0
    tokens = torch.arange(count, device=left.device)
    for b in range(0, total, side):
        b_end = min(b + side, total)
        block = buffer[:side * (b_end - b)].view(side, b_end - b)
        torch._int_mm(left, rows.values[b:b_end].T, out=block)
        block = block[:count]
        column_hidden = torch.nonzero(hidden[b:b_end]).flatten()
        if column_hidden.numel():
            block.index_fill_(1, column_hidden, _MASKED)
        own = (position >= b) & (position < b_end)  # the token's own product
        block[tokens[own], position[own] - b] = _MASKED
        _merge_rows(rows, block, b, best, at)
    return best, at


def _merge_rows(rows: IntegerRows, block: torch.Tensor, b: int, best: torch.Tensor, at: torch.Tensor) -> None:
    """Merges into ``best`` and ``at`` (tokens x steps) each step's first maximum of the rows of ``block``, whose
    columns are the stored positions b, b + 1, ..."""
    for j, (first, end, _, _, _) in enumerate(rows.steps):
        lo, hi = max(first, b), min(end, b + block.shape[1])
        if lo < hi:
            values_j, found = _first_maxima(block[:, lo - b:hi - b], 1)
            _merge(best[:, j], at[:, j], values_j, found + lo)


def _product(rows: IntegerRows, left: torch.Tensor, block: torch.Tensor, positions: torch.Tensor,
             masked: torch.Tensor) -> None:
    """block = left q_x . every stored row, the token's own position (``positions``, per left row) and
    ``masked`` positions set below every product."""
    torch._int_mm(left, rows.values.T, out=block)
    count = positions.numel()
    block[torch.arange(count, device=block.device), positions] = _MASKED
    if masked.numel():
        block.index_fill_(1, masked, _MASKED)


def _chunk_rows(head: EngineHead) -> int:
    """The rows of the left block of every product the pass makes on this head (the probe's shape too)."""
    budget = min(_BLOCK_MOST, max(_BLOCK_LEAST, head.n * head.d // 4))
    return max(_MIN_CHUNK, _padded(max(1, min(4096, budget // _padded(head.n)))))


def _blocks(head: EngineHead, count: int, rows: IntegerRows) -> tuple[int, torch.Tensor, torch.Tensor]:
    """The chunk of tokens per product, the int32 block and the left block (padded for GPUs' kernels): the
    left block has _chunk_rows rows whatever the count, the shape the probe checked."""
    n_rows = rows.values.shape[0]
    padded = _chunk_rows(head)
    chunk = max(1, min(count, padded))
    block = torch.empty(padded, n_rows, dtype=torch.int32, device=head.device)
    left = torch.zeros(padded, rows.values.shape[1], dtype=torch.int8, device=head.device)
    return chunk, block, left


def _masked_positions(head: EngineHead, rows: IntegerRows) -> torch.Tensor:
    """Copies of duplicated rows (never rivals) and the padding."""
    others = torch.nonzero(~head.competitor).flatten()
    return torch.cat([rows.position[others], rows.padding])


def int8_pass(head: EngineHead, ids: np.ndarray, progress=None, rows: IntegerRows | None = None):
    """(certified, margin, scale, runner_up) for tokens ``ids`` at the witnesses z = s (w_k - c), as
    low_precision.bfloat16_pass returns them (s = 1 when unbounded, else the largest scale inside the domain;
    ``margin`` a lower bound on the exact margin, per unit of ||z|| when unbounded). The token's own row is its
    x, on its own grid."""
    device, d = head.device, head.d
    count = len(ids)
    certified = np.zeros(count, dtype=bool)
    margin = np.full(count, -np.inf)
    scale = np.ones(count)
    runner_up = np.full(count, -1, dtype=np.int64)
    rows = rows if rows is not None else integer_rows(head)
    for part, k, top, rival, _ in self_bounds(head, ids, rows):
        size = k.numel()
        directions = head.rows64(k) - head.witness_centre
        s_k = (float32_towards_zero(head.domain.largest_scales(directions)) if head.domain.bounded
               else torch.ones(size, dtype=torch.float64, device=device))
        valid = torch.isfinite(s_k) & (s_k > 0)
        own = rows.size[k] / (1 + gamma(d + 2))  # the computed norm of y^_k, within gamma_{d+2} of ||y_k||
        lead = own * own * (1 - 4 * gamma(d + 4))  # <= ||y_k||^2
        # at z = s_k y_k: both terms scaled (one rounding each), the difference one more
        lead, top = s_k * lead, s_k * top
        lower = lead - top - 4 * UNIT_ROUNDOFF * (lead.abs() + top.abs())
        record_self_witnesses(head, k, lower, top, valid, directions, s_k, rows.size[k], rival, part,
                              (certified, margin, scale, runner_up), progress)
    log.debug("int8 screen on %s: %d of %d tokens proved, the float32 pass takes the rest",
              device, int(certified.sum()), count)
    return certified, margin, scale, runner_up


def int8_witnesses(head: EngineHead, ids: np.ndarray, witnesses: torch.Tensor, rows: IntegerRows):
    """Given witnesses z_k (B x d, float64) of tokens ``ids`` on a head without a bias: (certified, margin,
    runner_up, lead, allowance) as numpy arrays, as low_precision.bfloat16_witnesses returns them. Each z goes
    on a grid of its own as the rows do; the own term z . (w_k - c) is a float64 product within
    gamma_{d+2} ||z|| ||y_k|| of the exact one; ``lead`` is the computed gap to the largest integer product
    and ``allowance`` the bound's slack above it plus that rounding."""
    device, d = head.device, head.d
    k = torch.as_tensor(ids, device=device)
    own = ((head.rows64(k) - head.witness_centre) * witnesses).sum(dim=1)
    # (safe_norm's last product may round down in the subnormal range: 2^-1000 is far above what it loses)
    norm_z = safe_norm(witnesses, dim=1) * (1 + gamma(d + 2)) + 2.0**-1000
    exponent = _grid_exponents(witnesses.abs().amax(dim=1))
    top = torch.empty(len(ids), dtype=torch.float64, device=device)
    slack = torch.empty(len(ids), dtype=torch.float64, device=device)
    rival = torch.empty(len(ids), dtype=torch.int64, device=device)
    masked = _masked_positions(head, rows)
    chunk, gram, left = _blocks(head, len(ids), rows)
    for start in range(0, len(ids), chunk):
        part = slice(start, min(start + chunk, len(ids)))
        size = part.stop - part.start
        q, r = _on_grid(witnesses[part], exponent[part])
        error = safe_norm(r, dim=1) * (1 + gamma(d + 2)) + 2.0**-1000
        left[:size, :d] = q.to(torch.int8)
        left[size:] = 0
        _product(rows, left, gram, rows.position[k[part]], masked)
        top[part], rival[part], slack[part] = _upper_bounds(rows, exponent[part], error, norm_z[part], gram[:size])
    own_error = gamma(d + 2) * norm_z * rows.size[k]
    lower = own - own_error - top - 4 * UNIT_ROUNDOFF * (own.abs() + own_error + top.abs())
    # the split of the rest (ids the float64 check takes): the gap to the integer part of the bound, and
    # the bound's slack above it with the own term's rounding
    lead = own - (top - slack)
    allowance = slack + own_error + 4 * UNIT_ROUNDOFF * (own.abs() + own_error + top.abs())
    return witness_outcomes(head, k, witnesses, norm_z, lower, top, exponent.abs() < 900, rival, lead, allowance,
                            "int8")
