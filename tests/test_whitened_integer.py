"""The whitened witnesses priced in the int8 pass (auditor/engine/screen/whitened_integer.py), checked exactly.

The pass puts the rows y_i = A (w_i - c) of the head made round on int8 grids, bounds max_i y_i . y_k from
the integer products and states the witness z^ = fl(A^T fl(A (w_k - c))). Here A is read as the float64
matrix the engine uses, every y_i, every product and every logit gap at z^ is taken in rational arithmetic,
and the bounds are compared with those. The heads are the ones the pass is for: spectra falling steeply,
axis-aligned, with a near-null direction (so that ||A||_F, and with it the formation error, is large).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

import auditor
from auditor.engine.arithmetic.head import build_engine_head
from auditor.engine.screen import integer_pass, whitened_integer
from auditor.question.domain import parse_domain
from oracles import lp_margin
from test_exact_worst_cases import check_report

FORCED = dict(int8_entries=0, whitened_entries=0)


def fr(x) -> Fraction:
    return Fraction(float(x))


def steep_head(n: int, d: int, decay: float, seed: int, thin: float | None = None, rotated: bool = False) -> np.ndarray:
    """Gaussian rows whose standard deviations fall like rank^(-decay/2) along the axes, log-normal row norms,
    a common offset; ``thin``: the last axis scaled down to that (a near-null direction); ``rotated``: the
    axes turned by a random rotation (so that the near-null direction mixes every coordinate)."""
    rng = np.random.default_rng(seed)
    spread = np.arange(1, d + 1, dtype=np.float64) ** (-decay / 2)
    if thin is not None:
        spread[-1] = thin
    W = rng.standard_normal((n, d)) * spread * np.exp(0.3 * rng.standard_normal((n, 1)))
    W[:, 0] += 2.0
    if rotated:
        W = W @ np.linalg.qr(rng.standard_normal((d, d)))[0]
    return W.astype(np.float32).astype(np.float64)


@pytest.mark.parametrize("seed, decay, thin, rotated, domain, biased", [
    (0, 1.6, None, False, "unbounded", False),
    (1, 2.4, 1e-6, True, "unbounded", False),
    (2, 1.2, None, True, "ball:0.5", False),
    (3, 1.6, None, True, "unbounded", True),
    (4, 1.2, None, False, "ball:2", True),
])
def test_the_whitened_rows_and_every_proved_margin_hold_in_rational_arithmetic(seed, decay, thin, rotated, domain,
                                                                             biased):
    """||e_i|| <= error and ||y_i|| <= size with y_i = A (w_i - c) exact; the bound is at least the exact
    largest rival product; and every witness the pass proves wins by at least its stated margin, exactly
    (with a bias: the logits w_i . z + b_i, b about a tenth of the rows' spread)."""
    n, d = 48, 12
    W = steep_head(n, d, decay, seed, thin, rotated)
    b = np.random.default_rng(seed + 10).standard_normal(n) * 0.05 if biased else None
    head = build_engine_head(torch.from_numpy(W), None if b is None else torch.from_numpy(b), np.arange(n),
                             parse_domain(domain), 1e-10)
    A = head.whitening
    r = A.shape[0]
    a = [[fr(v) for v in row] for row in A.tolist()]
    c = [fr(v) for v in head.witness_centre.tolist()]
    y = [[sum(a[p][j] * (fr(W[i, j]) - c[j]) for j in range(d)) for p in range(r)] for i in range(n)]
    rows = integer_pass.integer_rows(head, A)
    values = rows.values.to(torch.int64).tolist()
    for i in range(n):
        e = Fraction(2) ** int(rows.exponent[i])
        q = values[int(rows.position[i])][:r]
        assert all(abs(v) <= 127 for v in q)
        assert sum((y[i][p] - e * q[p]) ** 2 for p in range(r)) <= fr(rows.error[i]) ** 2, i
        assert sum(v * v for v in y[i]) <= fr(rows.size[i]) ** 2, i
    k = torch.arange(n)
    block = torch.empty(n, rows.values.shape[0], dtype=torch.int32)
    integer_pass._product(rows, rows.values.index_select(0, rows.position[k]), block, rows.position[k],
                          integer_pass._masked_positions(head, rows))
    bound, _, _ = integer_pass._upper_bounds(rows, rows.exponent[k], rows.error[k], rows.size[k], block)
    for x in range(n):
        assert fr(bound[x]) >= max(sum(u * v for u, v in zip(y[i], y[x])) for i in range(n) if i != x), x
    outcome = whitened_integer.whitened_int8(head, np.arange(n))
    assert outcome.proved.size >= n // 3
    for j, t in enumerate(outcome.proved.tolist()):
        z = [fr(v) for v in outcome.witnesses[j].tolist()]
        logits = [sum(fr(W[i, m]) * z[m] for m in range(d)) + (fr(b[i]) if biased else 0) for i in range(n)]
        lead = logits[t] - max(logits[i] for i in range(n) if i != t)
        assert 0 < fr(outcome.margin[j]) <= lead, t
        if domain != "unbounded":
            assert sum(v * v for v in z) <= fr(float(domain.split(":")[1])) ** 2


def test_the_drift_of_the_stated_witness_is_needed(monkeypatch):
    """The test above has teeth: with the formation error f_i taken as zero, the bounds on a head with a
    near-null direction (||A||_F about 1e6) fail the rational check."""
    n, d = 48, 12
    W = steep_head(n, d, 2.4, 1, thin=1e-6, rotated=True)
    head = build_engine_head(torch.from_numpy(W), None, np.arange(n), parse_domain("unbounded"), 1e-10)
    A = head.whitening
    real = integer_pass.integer_rows

    def without_formation(head, transform=None):
        rows = real(head, transform)
        rows.error = rows.error - rows.formation * (1 + 2.0**-50)
        rows.size = rows.size - rows.formation * (1 + 2.0**-50)
        rows.formation = torch.zeros_like(rows.formation)
        return rows
    monkeypatch.setattr(integer_pass, "integer_rows", without_formation)
    rows = integer_pass.integer_rows(head, A)
    a = [[fr(v) for v in row] for row in A.tolist()]
    c = [fr(v) for v in head.witness_centre.tolist()]
    short = 0
    for i in range(n):
        y = [sum(a[p][j] * (fr(W[i, j]) - c[j]) for j in range(d)) for p in range(A.shape[0])]
        short += sum(v * v for v in y) > fr(rows.size[i]) ** 2
    assert short > 0


@pytest.mark.parametrize("biased", [False, True])
def test_a_steep_head_is_decided_in_the_screen_and_matches_the_lp(biased, monkeypatch):
    """A steep axis-aligned head with the passes forced: the whitened int8 pass proves a good share of the
    tokens the plain pass left (with a bias, in the unbounded domain: at a scale where the bias cannot
    overturn them), every certificate holds exactly, and the verdicts are the plain LP's."""
    proved = []
    real = whitened_integer.whitened_int8

    def spy(head, ids, progress=None, rows=None):
        outcome = real(head, ids, progress, rows)
        proved.append(outcome.proved.size)
        return outcome
    monkeypatch.setattr(whitened_integer, "whitened_int8", spy)
    n, d = 600, 10
    W = steep_head(n, d, 1.6, 4)
    W = np.vstack([W, W[:8].mean(axis=0)[None, :], W[:30].mean(axis=0)[None, :] + 1e-4])
    b = np.random.default_rng(5).standard_normal(len(W)) * 0.1 if biased else None
    report = auditor.audit(W, b, progress=False, **FORCED)
    assert report.counts["inconclusive"] == 0
    assert proved and max(proved) >= 100
    for k in range(len(W)):
        margin = lp_margin(W, b, k)[0]
        assert (report.tokens[k].verdict == "argmaxable") == (margin > 0), (k, margin)
    check_report(report, W, W, b, "unbounded")


@pytest.mark.parametrize("domain, biased", [("unbounded", False), ("ball:0.5", False), ("unbounded", True)])
def test_the_symmetric_pass_gives_the_same_whitened_witnesses(domain, biased, monkeypatch):
    """The whitened pass over most of a head through the symmetric pass (small blocks) and through blocks of
    tokens x every row: the same tokens proved, with the same witnesses, margins and rivals, the same close
    calls, in the order of the tokens asked."""
    n, d = 300, 12
    W = steep_head(n, d, 1.6, 5, rotated=True)
    b = np.random.default_rng(5).standard_normal(n) * 0.1 if biased else None
    head = build_engine_head(torch.from_numpy(W), None if b is None else torch.from_numpy(b), np.arange(n),
                             parse_domain(domain), 1e-10)
    ids = np.random.default_rng(6).permutation(n)
    monkeypatch.setattr(integer_pass, "_SIDE", 40)
    rows = whitened_integer.whitened_rows(head)
    assert integer_pass._symmetric(rows, n)
    symmetric = whitened_integer.whitened_int8(head, ids, None, rows)
    monkeypatch.setattr(integer_pass, "_symmetric", lambda rows, count: False)
    plain = whitened_integer.whitened_int8(head, ids, None, rows)
    assert symmetric.proved.size >= n // 3
    for name in ("proved", "margin", "runner_up", "close"):
        assert np.array_equal(getattr(symmetric, name), getattr(plain, name)), name
    for name in ("witnesses", "close_witnesses"):
        assert torch.equal(getattr(symmetric, name), getattr(plain, name)), name
