"""The int8 pass of the screen (auditor/engine/screen/integer_pass.py), checked in exact rational arithmetic.

The pass puts each centred row y = w - c on a grid of step 2^(E - 7), where 2^(E - 1) <= max_j |y_j| < 2^E,
multiplies the integers exactly and bounds what the grids lost. The worst case for such a bound is a row
whose every entry lies a hair below a midpoint of its grid, so that it rounds down by almost half a step,
next to a rival that rounds to the same integers: the rival's integer product with the row then falls short
of the row's own exact product by about ||y|| times half a step per coordinate, although the rival wins.
The heads below are built from that definition (nothing reads a constant of the auditor), and every
certificate is checked exactly (test_exact_worst_cases.check_report).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

import auditor
from auditor.engine.arithmetic.head import build_engine_head
from auditor.engine.screen import integer_pass
from auditor.engine.screen import low_precision
from auditor.engine.screen import gram as screen
from auditor.question.domain import parse_domain
from oracles import qhull_argmaxable
from test_exact_worst_cases import Case, as_float, assert_combination, check_report, power, store

FORCED = dict(int8_entries=0, whitened_entries=0)  # the int8 pass (and its whitened witnesses) on a small head


@pytest.fixture(autouse=True)
def _whitened_witnesses_through_the_int8_copy(monkeypatch):
    monkeypatch.setattr(screen, "_WHITENED_COPY_ROWS", 0)


def grid_head(d=64, n=64, q=64, below=(14, 16), scale=0, storage="float32", seed=0) -> Case:
    """Row 0 = a 1 and row 1 = a2 1 with a = (q + 1/2 - 2^-below[0]) 2^-6 and a2 = (q + 1/2 - 2^-below[1]) 2^-6,
    q in [64, 127]: their largest entries lie in [1, 2), so their grid step is 2^-6, and both lie a hair below
    the midpoint between q and q + 1 on it: both round to q. Every row is also negated (the centre is 0), the
    others random multiples of 2^-10 (N(0, 0.25^2), entries below 1). Row 0 lies on the segment between row 1
    and its mirror: unargmaxable. Everything times 2^scale."""
    assert 64 <= q <= 127
    rng = np.random.default_rng(seed)
    step = power(-6)
    a = (q + Fraction(1, 2) - power(-below[0])) * step * power(scale)
    a2 = (q + Fraction(1, 2) - power(-below[1])) * step * power(scale)
    half = n // 2
    rows = np.clip(np.round(rng.normal(0.0, 0.25, size=(half - 2, d)) * 1024) / 1024, -0.99, 0.99) * 2.0**scale
    top = np.vstack([np.full(d, as_float(a)), np.full(d, as_float(a2)), rows])
    W = np.vstack([top, -top])
    stored = store(W, storage)
    t = (1 + a / a2) / 2  # row 0 = t row 1 + (1 - t) (-row 1)
    assert_combination(W, None, 0, [1, half + 1], [t, 1 - t])
    assert_combination(W, None, half, [half + 1, 1], [t, 1 - t])
    return Case(stored, W, None, [0, half], centred=([a] * d, [a2] * d), storage=storage)


def test_the_planted_row_is_a_worst_case_of_the_grid():
    """In exact arithmetic: the planted row loses to its rival at its own direction, yet the rival's product on
    the grid (both rows at q 2^-6) falls short of the row's own by about ||y||^2 / q, the most a grid of 2^7
    steps can lose: a pass without the bound's slack would certify it."""
    for q in (64, 100, 127):
        case = grid_head(d=64, q=q)
        y0, y1 = case.centred
        own = sum(v * v for v in y0)
        exact_rival = sum(p * r for p, r in zip(y0, y1))
        on_grid = sum((q * power(-6)) ** 2 for _ in y0)
        assert exact_rival > own  # the rival wins at y_0
        assert (own - on_grid) / own > Fraction(1, q + 1)  # the shortfall: almost a full half step each side
        # the pass puts both rows where the design says (a change of its grids would leave these cases easy)
        head = build_engine_head(torch.from_numpy(case.stored), None, np.arange(64), parse_domain("unbounded"), 1e-10)
        rows = integer_pass.integer_rows(head)
        for i in (0, 1):
            assert int(rows.exponent[i]) == -6
            assert set(rows.values[int(rows.position[i]), :64].tolist()) == {q}


@pytest.mark.parametrize("d, q, storage, scale, domain", [
    (64, 64, "float32", 0, "unbounded"),
    (256, 64, "float32", 0, "unbounded"),
    (64, 127, "float32", 0, "unbounded"),
    (128, 100, "float64", 0, "unbounded"),
    (128, 64, "float32", 20, "unbounded"),
    (128, 64, "float32", -20, "unbounded"),
    (64, 64, "float64", 30, "ball:2"),
    (64, 90, "float32", 0, "box:1"),
    (64, 64, "float32", 0, "ball:8"),
])
def test_rows_a_hair_below_the_grid_midpoints_are_never_certified(d, q, storage, scale, domain, monkeypatch):
    """The planted row and its rival round to the same integers; the row can never win. Every certificate of the
    audit with the int8 pass forced holds exactly, and the planted row is never called argmaxable; the pass
    did see it."""
    seen = set()
    original = integer_pass.int8_pass

    def spy(head, ids, *args, **kwargs):
        seen.update(np.asarray(ids).tolist())
        return original(head, ids, *args, **kwargs)
    monkeypatch.setattr(integer_pass, "int8_pass", spy)
    case = grid_head(d=d, n=64, q=q, storage=storage, scale=scale)
    report = case.audit(domain, **FORCED)
    verdicts = case.check(report, domain)
    assert "argmaxable" not in verdicts.values()
    assert 0 in seen


def test_without_the_grids_errors_the_planted_row_is_certified_and_the_exact_check_catches_it(monkeypatch):
    """The tests above have teeth: with the grids' errors r = y - S q taken as zero inside the pass, the
    planted row is certified argmaxable, and the exact check rejects its witness."""
    original = integer_pass._on_grid

    def no_error(values, exponent):
        q, r = original(values, exponent)
        return q, torch.zeros_like(r)
    monkeypatch.setattr(integer_pass, "_on_grid", no_error)
    case = grid_head(d=64, q=64)
    report = case.audit("unbounded", **FORCED)
    assert report.tokens[0].verdict == "argmaxable" and report.tokens[0].stage == "screen"
    with pytest.raises(AssertionError):
        case.check(report, "unbounded")


def fr(x) -> Fraction:
    return Fraction(float(x))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_grids_are_exact_and_the_bound_holds_in_rational_arithmetic(seed):
    """On a head of mixed row sizes (entries spread over 2^-30 .. 2^10, some at zero, a few subnormal) and some
    entries exactly on grid midpoints: 2^e q + r == y^ exactly for every row, |q| <= 127, the steps are powers
    of two in decreasing order over contiguous positions, ||e_i|| <= the stored error and ||y_i|| <= the stored
    size (in rationals, through squares); and for every row as x, the bound is at least the exact largest
    product with an unmasked rival."""
    rng = np.random.default_rng(seed)
    n, d = 40, 24
    W = rng.standard_normal((n, d)) * np.exp2(rng.integers(-30, 10, size=(n, 1)))
    W[3] = 0.0
    W[5, :4] = 2.0**-1070  # float64 subnormals
    W[7] = (np.round(rng.standard_normal(d) * 64) + 0.5) * 2.0**-6  # midpoints of the step 2^-6 grid
    if seed == 2:
        W = W.astype(np.float32).astype(np.float64)
    head = build_engine_head(torch.from_numpy(W), None, np.arange(n), parse_domain("unbounded"), 1e-10)
    rows = integer_pass.integer_rows(head)
    c = [fr(v) for v in head.witness_centre.tolist()]
    y = [[fr(W[i, j]) - c[j] for j in range(d)] for i in range(n)]
    values = rows.values.to(torch.int64).tolist()
    previous = None
    for first, end, e, length, error in rows.steps:
        assert previous is None or e < previous
        previous = e
        assert set(rows.exponent[rows.order[first:end]].tolist()) == {e}
    for i in range(n):
        p = int(rows.position[i])
        e = int(rows.exponent[i])
        q = values[p][:d]
        assert all(abs(v) <= 127 for v in q) and not any(values[p][d:])
        y_hat = [fr(v) for v in (head.rows64(torch.tensor([i])) - head.witness_centre)[0].tolist()]
        r = [y_hat[j] - power(e) * q[j] for j in range(d)]
        err = [y[i][j] - power(e) * q[j] for j in range(d)]
        assert sum(v * v for v in err) <= fr(rows.error[i]) ** 2
        assert sum(v * v for v in y[i]) <= fr(rows.size[i]) ** 2
        assert all(abs(v) <= power(e) for v in r)  # at most a step (half a step unless clamped)
    block = torch.empty(n, rows.values.shape[0], dtype=torch.int32)
    masked = integer_pass._masked_positions(head, rows)
    k = torch.arange(n)
    left = rows.values.index_select(0, rows.position[k])
    integer_pass._product(rows, left, block, rows.position[k], masked)
    bound, rival, _ = integer_pass._upper_bounds(rows, rows.exponent[k], rows.error[k], rows.size[k], block)
    exact = [max(sum(a * b for a, b in zip(y[i], y[x])) for i in range(n) if i != x) for x in range(n)]
    for x in range(n):
        assert fr(bound[x]) >= exact[x], x
    # the pass's margins: per unit of ||y_k||, at most the exact lead over the strongest rival
    certified, margin, _, _ = integer_pass.int8_pass(head, np.arange(n), rows=rows)
    assert certified.sum() >= 3  # the large rows (the small ones sit near the centre and lose at y_k)
    for k in np.nonzero(certified)[0]:
        lead = sum(v * v for v in y[k]) - exact[k]
        assert lead > 0 and fr(margin[k]) ** 2 * sum(v * v for v in y[k]) <= lead ** 2, k
    # witnesses off every grid: rows' directions with entries put on midpoints of their own grids, and scaled
    Z = np.array([(np.round(np.array(y[k], dtype=float) * 2.0**12) + 0.5) * 2.0**-12 * 2.0**(7 * (k % 5 - 2))
                  for k in range(n)])
    won, margin, _, lead, allowance = integer_pass.int8_witnesses(head, np.arange(n), torch.from_numpy(Z), rows)
    for k in range(n):
        z = [fr(v) for v in Z[k]]
        gaps = [sum(z[j] * (y[k][j] - y[i][j]) for j in range(d)) for i in range(n) if i != k]
        assert abs(fr(lead[k]) - min(gaps)) <= fr(allowance[k]) or fr(lead[k]) < min(gaps), k  # the split's lead
        if won[k]:
            assert 0 < fr(margin[k]) <= min(gaps), k
    assert won.sum() >= 3


def test_audits_through_the_int8_pass_match_qhull():
    """A low-dimensional head with a crowded boundary, the int8 pass forced: the argmaxable set is Qhull's."""
    rng = np.random.default_rng(5)
    W = rng.standard_normal((400, 5)) * np.array([1.0, 0.5, 0.3, 0.2, 0.1])
    W = np.vstack([W, W[:60] * 0.999]).astype(np.float32)
    report = auditor.audit(W, progress=False, **FORCED)
    assert report.counts["inconclusive"] == 0
    assert set(report.ids("argmaxable")) == qhull_argmaxable(W.astype(np.float64))
    assert auditor.verify(report, W).ok


def saturating_int_mm(left, right, out=None):
    """An int8 product that saturates pairwise sums to 16 bits, as AVX2's vpmaddubsw does (u8 x s8 pairs)."""
    a = left.to(torch.int64) + 128  # the unsigned operand of that instruction
    b = right.to(torch.int64)
    pairs = (a[:, None, 0::2] * b.T[None, :, 0::2] + a[:, None, 1::2] * b.T[None, :, 1::2]).clamp(-32768, 32767)
    result = pairs.sum(dim=2) - 128 * b.sum(dim=0)[None, :]
    if out is not None:
        out.copy_(result.to(torch.int32))
        return out
    return result.to(torch.int32)


def test_the_probe_turns_the_pass_off_where_products_are_not_exact(monkeypatch):
    """The probe passes on this backend; with a saturating product in its place it fails, the pass is skipped and
    the bfloat16 pass screens instead, with certificates that hold."""
    W = np.random.default_rng(3).standard_normal((3000, 1400)).astype(np.float32)  # above the size threshold
    head = build_engine_head(torch.from_numpy(W), None, np.arange(3000), parse_domain("unbounded"), 1e-10)
    assert integer_pass.exact_products(head.device) and integer_pass.applies(head)
    monkeypatch.setattr(integer_pass, "_probed", {})
    monkeypatch.setattr(torch, "_int_mm", saturating_int_mm)
    assert not integer_pass.exact_products(head.device) and not integer_pass.applies(head)
    used = []
    original = low_precision.bfloat16_pass
    monkeypatch.setattr(low_precision, "bfloat16_pass", lambda *a, **k: used.append(1) or original(*a, **k))
    small = W[:1500, :64]
    report = auditor.audit(small, progress=False, int8_entries=0, bfloat16_entries=0)
    assert used and auditor.verify(report, small).ok


def test_the_pass_is_taken_where_it_applies_and_leaves_biased_heads_to_the_bfloat16_pass(monkeypatch):
    calls = []
    for module, name in ((integer_pass, "int8_pass"), (low_precision, "bfloat16_pass")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _o=original, _n=name, **k: calls.append(_n) or _o(*a, **k))
    rng = np.random.default_rng(1)
    W = rng.standard_normal((600, 16)).astype(np.float32)
    b = rng.standard_normal(600).astype(np.float32)
    auditor.audit(W, progress=False, int8_entries=0, bfloat16_entries=0)
    assert calls == ["int8_pass"]
    calls.clear()
    auditor.audit(W, b, domain="ball:2", progress=False, int8_entries=0, bfloat16_entries=0)
    assert calls == ["bfloat16_pass"]


def _bounds_by_token(head, ids, rows) -> dict:
    """self_bounds as {position in ids: (bound, rival, slack)}."""
    found = {}
    for part, _, top, rival, slack in integer_pass.self_bounds(head, ids, rows):
        found.update(zip(part.tolist(), zip(top.tolist(), rival.tolist(), slack.tolist())))
    return found


def _reference_bounds(head, ids, rows) -> dict:
    """The bounds from Tensor.max over the full product of each token with every stored row, in float64 numpy
    (exact: integer sums below 2^53), the token itself and the masked rows left out."""
    values = rows.values.to(torch.int64).numpy()
    masked = set(integer_pass._masked_positions(head, rows).tolist())
    found = {}
    for at, k in enumerate(ids):
        p = int(rows.position[k])
        products = (values @ values[p]).astype(np.float64)
        products[[p] + sorted(masked)] = -np.inf
        best = torch.full((1, len(rows.steps)), integer_pass._MASKED, dtype=torch.int32)
        first = torch.zeros(1, len(rows.steps), dtype=torch.int64)
        for j, (lo, hi, *_) in enumerate(rows.steps):
            if np.isfinite(products[lo:hi]).any():
                first[0, j] = lo + int(np.argmax(products[lo:hi]))  # numpy's argmax: the first occurrence
                best[0, j] = int(products[first[0, j]])
        kt = torch.tensor([k])
        top, rival, slack = integer_pass._bounds(rows, best, first, rows.exponent[kt], rows.error[kt], rows.size[kt])
        found[at] = (float(top[0]), int(rival[0]), float(slack[0]))
    return found


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("side", (16, 40))
@pytest.mark.parametrize("group", (4, 64))
def test_the_symmetric_pass_gives_the_plain_pass_bounds_and_first_rivals(seed, side, group, monkeypatch):
    """Each product of two stored rows formed once (blocks of ``side``, several bands and steps), and the
    tokens in blocks against square blocks of rows: every token's bound, rival and slack are those of the
    products with every row, the first of equal products the rival; rows of half-integers make many ties,
    and copied rows are masked."""
    rng = np.random.default_rng(seed)
    n, d = (203, 16) if seed % 2 else (331, 24)
    W = rng.standard_normal((n, d)) * np.exp(1.5 * rng.standard_normal((n, 1)))  # several grid steps
    if seed >= 2:
        W = np.round(W * 2) / 2
    representative = np.arange(n)
    W[5], representative[5] = W[3], 3
    W[n - 1], representative[n - 1] = W[2], 2
    head = build_engine_head(torch.from_numpy(W), None, representative, parse_domain("unbounded"), 1e-10)
    rows = integer_pass.integer_rows(head)
    ids = rng.permutation(np.nonzero(representative == np.arange(n))[0])
    monkeypatch.setattr(integer_pass, "_SIDE", side)
    monkeypatch.setattr(integer_pass, "_GROUP", group)
    assert len(rows.steps) >= 4 and integer_pass._symmetric(rows, len(ids))
    taken = []
    original = integer_pass._symmetric_maxima
    monkeypatch.setattr(integer_pass, "_symmetric_maxima", lambda *a: taken.append(1) or original(*a))
    symmetric = _bounds_by_token(head, ids, rows)
    assert taken
    reference = _reference_bounds(head, ids, rows)
    assert symmetric == reference
    monkeypatch.setattr(integer_pass, "_symmetric", lambda rows, count: False)
    assert _bounds_by_token(head, ids, rows) == reference  # one block of tokens x every row
    monkeypatch.setattr(integer_pass, "_chunk_rows", lambda head: 32)
    original_tiled = integer_pass._tiled_maxima
    monkeypatch.setattr(integer_pass, "_tiled_maxima", lambda *a: taken.append(2) or original_tiled(*a))
    assert _bounds_by_token(head, ids, rows) == reference  # blocks of tokens x square blocks of rows
    assert 2 in taken


def test_audits_through_the_symmetric_pass_match_qhull_and_the_plain_pass(monkeypatch):
    """A crowded low-dimensional head, the int8 pass forced and its blocks small: Qhull's argmaxable set, and
    the same report as the plain pass gives."""
    rng = np.random.default_rng(7)
    W = rng.standard_normal((500, 5)) * np.array([1.0, 0.5, 0.3, 0.2, 0.1])
    W = np.vstack([W, W[:60] * 0.999, W[60:64]]).astype(np.float32)  # near-copies and copies
    monkeypatch.setattr(integer_pass, "_SIDE", 64)
    taken = []
    original = integer_pass._symmetric_maxima
    monkeypatch.setattr(integer_pass, "_symmetric_maxima", lambda *a: taken.append(1) or original(*a))
    symmetric = auditor.audit(W, progress=False, **FORCED)
    assert taken
    assert symmetric.counts["inconclusive"] == 0
    assert set(symmetric.ids("argmaxable")) == qhull_argmaxable(W.astype(np.float64))
    assert auditor.verify(symmetric, W).ok
    monkeypatch.setattr(integer_pass, "_symmetric", lambda rows, count: False)
    plain = auditor.audit(W, progress=False, **FORCED)
    assert [(t.verdict, t.stage, t.runner_up) for t in symmetric.tokens] == \
        [(t.verdict, t.stage, t.runner_up) for t in plain.tokens]
    # the same witnesses and margins up to the last bits: a product's rounding may depend on the shape of the
    # block it is formed in (AVX-512 kernels on AMD EPYC), and each margin is its own witness's checked bound
    assert [t.margin for t in symmetric.tokens] == pytest.approx([t.margin for t in plain.tokens], rel=1e-12)
