"""Heads whose tokens lead or trail by a few tolerances: time, verdicts and what is left inconclusive.

Three families, each where float64 leaves a nearest point's direction uncertain by more than the lead:

- ``flat``: 400 x 40 float64 rows spanning a rank-10 affine subspace, and 7 rows at their mean moved off it
  (each along its own orthogonal direction) by 2e-10 to 1e-3 of the rows' spread; as given and zero-sum;
- ``one-entry``: 330 x 64 rows of one entry in [1, 2] on a random axis plus 2^-30 noise, with the default
  passes and forced through the int8 pass (``int8_entries=0, bfloat16_entries=0, whitened_entries=0``);
- ``midpoint``: docs/method.md's row at the midpoint of a hull edge with a bias 2^-34 above its ends'
  average, with and without an exact offset of 1e6 on the first coordinate.

Every report is checked with auditor.verify.

    OMP_NUM_THREADS=2 python bench/near_ties.py [--seeds 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

import auditor


def flat_head(seed: int, zero_sum: bool) -> tuple[np.ndarray, list[int]]:
    rng = np.random.default_rng(seed)
    n, d, rank = 400, 40, 10
    basis = np.linalg.qr(rng.standard_normal((d, rank)))[0]
    rows = rng.standard_normal((n, rank)) @ basis.T + rng.standard_normal(d)
    mean = rows.mean(0)
    spread = np.sqrt(((rows - mean) ** 2).sum(1).mean())
    offsets = [2e-10, 5e-10, 1e-9, 3e-9, 1e-8, 1e-6, 1e-3]
    normals = np.linalg.qr(np.hstack([basis, rng.standard_normal((d, len(offsets)))]))[0][:, rank:]
    W = np.vstack([rows] + [mean + o * spread * normals[:, j] for j, o in enumerate(offsets)])
    return (W - W.mean(0) if zero_sum else W), list(range(n, n + len(offsets)))


def one_entry_head(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    n, d = 330, 64
    W = np.zeros((n, d))
    W[np.arange(n), rng.integers(0, d, n)] = rng.uniform(1, 2, n)
    return W + rng.standard_normal((n, d)) * 2.0 ** -30


def measure(name: str, W, b=None, tokens=None, **options) -> None:
    started = time.perf_counter()
    report = auditor.audit(W, b, progress=False, tokens=tokens, **options)
    seconds = time.perf_counter() - started
    counts = {k: v for k, v in report.counts.items() if v and k != "undecided"}
    ok = auditor.verify(report, W, b).ok
    print(f"{name:48s} {seconds:7.2f} s  {counts}  verified {ok}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args()
    for seed in range(args.seeds):
        for zero_sum in (False, True):
            W, planted = flat_head(seed, zero_sum)
            measure(f"flat 407 x 40{' zero-sum' if zero_sum else ''}, seed {seed} (7 planted rows)", W, tokens=planted)
    for seed in range(args.seeds):
        W = one_entry_head(seed)
        measure(f"one-entry 330 x 64, seed {seed}", W)
        measure(f"one-entry 330 x 64, seed {seed}, int8 pass forced", W, int8_entries=0, bfloat16_entries=0,
                whitened_entries=0)
    W = np.array([[1, 0], [0, 1], [-1, -1], [0.5, 0.5]], dtype=np.float64)
    b = np.array([0.25, 0.75, 0.0, 0.5 + 2.0 ** -34])
    for offset in (0.0, 1e6):
        measure(f"midpoint + 2^-34, offset {offset:g}", W + np.array([offset, 0.0]), b)
    print(f"threads {torch.get_num_threads()}")


if __name__ == "__main__":
    main()
