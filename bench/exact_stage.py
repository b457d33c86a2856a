"""The exact stage's tokens side by side: its time with one thread and with the audit's threads.

    python bench/exact_stage.py [--rows 20000] [--width 16] [--inside 8] [--threads 1,2] [--json]

The head: ``--rows`` rows on the unit sphere in ``--width`` dimensions (every one a vertex) and ``--inside``
rows strictly inside it (0.5 / sqrt(width) N(0, I) / 2, seed 1: unargmaxable). The stages before the exact one
are given no iterations (``frank_wolfe_iterations=0, newton_iterations=0, min_norm_rounds=0``) and it one round
of constraint generation (``lp_rounds=1``), so the inside rows each take the LP over all rows, the heavy case
the exact stage exists for. For each thread count the audit runs twice and the script prints the exact
stage's time (the report's ``lp`` timing), the whole audit's, and the verdicts; the exact stage runs as many
tokens at once as the audit has threads.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

import auditor


def head(rows: int, width: int, inside: int) -> np.ndarray:
    rng = np.random.default_rng(1)
    outer = rng.standard_normal((rows, width))
    outer /= np.linalg.norm(outer, axis=1, keepdims=True)
    return np.vstack([outer, 0.25 * rng.standard_normal((inside, width)) / np.sqrt(width)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=20000)
    parser.add_argument("--width", type=int, default=16)
    parser.add_argument("--inside", type=int, default=8)
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    W = head(args.rows, args.width, args.inside)
    results = []
    for threads in map(int, args.threads.split(",")):
        for _ in range(2):
            started = time.perf_counter()
            report = auditor.audit(W, progress=False, threads=threads, frank_wolfe_iterations=0, newton_iterations=0,
                                   min_norm_rounds=0, lp_rounds=1)
            seconds = time.perf_counter() - started
            figures = {"threads": threads, "exact_stage_s": round(report.timings.get("lp", 0.0), 3),
                       "audit_s": round(seconds, 3), "lp_tokens": sum(t.stage == "lp" for t in report.tokens),
                       "counts": {k: v for k, v in report.counts.items() if v}}
            results.append(figures)
            print(f"threads {threads}: exact stage {figures['exact_stage_s']:.2f} s for {figures['lp_tokens']} tokens, "
                  f"audit {seconds:.2f} s, {figures['counts']}", flush=True)
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
