"""Norm-domain audit and probability ceilings on the real 30522 x 384 all-MiniLM-L6-v2 head.

    python bench/norm_domain.py [--device cpu|cuda] [--embeddings FILE] [--ceiling-tokens N]

The MiniLM checkpoint has no final norm in front of its tied head, so this
uses a synthetic LayerNorm (gain uniform in [0.8, 1.2], shift 0.05 N(0, 1),
eps 1e-12, seed 8) and appends three mean-initialised rows. Prints the
unbounded audit's time for reference, the norm-domain audit's time per stage,
the verdicts, and probability ceilings: for every token when --ceiling-tokens
is 0, else for the first N ids plus the appended rows.
"""

import argparse
import time

import numpy as np
from _vocabulary import load_vocabulary, mean_initialised

import auditor


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--embeddings")
    parser.add_argument("--ceiling-tokens", type=int, default=0)
    args = parser.parse_args()
    vocabulary = load_vocabulary(args.embeddings)
    rng = np.random.default_rng(8)
    added = mean_initialised(vocabulary, 3, rng)
    head = np.vstack([vocabulary, added])
    norm = auditor.FinalNorm("layernorm", weight=rng.uniform(0.8, 1.2, 384), bias=0.05 * rng.standard_normal(384),
                             eps=1e-12)

    plain = auditor.audit(head, device=args.device, progress=False)
    print(f"unbounded  {head.shape[0]} x {head.shape[1]}: {plain.timings['total']:.2f} s  "
          f"{ {k: v for k, v in plain.counts.items() if v} }")
    report = auditor.audit(head, domain="norm", final_norm=norm, device=args.device, progress=False)
    stages = {k: round(v, 2) for k, v in report.timings.items() if k != "total"}
    print(f"norm       {report.timings['total']:.2f} s  { {k: v for k, v in report.counts.items() if v} }")
    print(f"           stages {stages}")
    print(f"           unargmaxable {report.ids('unargmaxable')}")

    tokens = None if args.ceiling_tokens == 0 else list(range(args.ceiling_tokens)) + [30522, 30523, 30524]
    started = time.perf_counter()
    ceilings = auditor.audit(head, domain="norm", final_norm=norm, device=args.device, progress=False,
                             tokens=tokens, probability_ceiling=True)
    elapsed = time.perf_counter() - started
    decided = [t for t in ceilings.tokens if t.max_probability is not None]
    values = np.array([t.max_probability for t in decided])
    widths = np.array([t.probability_bounds[1] - t.probability_bounds[0] for t in decided])
    print(f"ceilings   {len(decided)} tokens, {elapsed:.2f} s in all (ceiling stage {ceilings.timings['ceilings']:.2f} s)")
    print(f"           bound width: max {widths.max():.2e}; tokens with width > 1e-4: {int((widths > 1e-4).sum())}")
    for p in (0.5, 0.9, 0.99):
        print(f"           tokens that can never reach {p:.0%}: {int((values < p).sum())}")
    print(f"           appended rows: {[round(t.max_probability, 6) for t in decided if t.id >= 30522]}")
    lowest = sorted(decided, key=lambda t: t.max_probability)[:5]
    print(f"           lowest: {[(t.id, round(t.max_probability, 4)) for t in lowest]}")


if __name__ == "__main__":
    main()
