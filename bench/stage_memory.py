"""Where an audit's memory goes: the resident set sampled per engine function, on vocabulary_scale.py's head.

    python bench/stage_memory.py [--shape gpt2|llama3|gemma2|N,D] [--width D] [--dtype float32|bfloat16] [--top 20]
                                 [--family MEMBER]

Builds the head of bench/vocabulary_scale.py (same construction, same seed, so
the same rows and planted verdicts), audits it once on the CPU, and samples
the resident set every 2 ms, attributing each sample to the chain of engine
functions running at that moment (the stages, and within them the pools,
maximum-entropy solves, eliminations, bases and factorisations). Prints the
audit's time and stages, whether the planted verdicts are exact, the peak beyond
the level before the audit (as a multiple of the head's size), and the
functions with the highest peaks, each with the level at its first entry.

The wrappers and the sampler (which takes Python's lock every 2 ms) cost a few
per cent of the time: vocabulary_scale.py gives the timings, this its memory.
No floor is run, so the Llama-3 shape takes about 9 minutes on 2 threads. ``--family MEMBER`` audits
that member of bench/families.py at the shape instead (N,D; its planted rows as that bench checks them).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import threading
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import auditor  # noqa: E402
from auditor.engine import pipeline, settle, stages  # noqa: E402
from auditor.engine.exact import caratheodory, dual_simplex, elimination, pools  # noqa: E402
from auditor.engine.solvers import anchor, interior  # noqa: E402
from vocabulary_scale import SHAPES, make_head  # noqa: E402

# the engine functions a sample is attributed to: (module or class, attribute, label)
_WATCHED = (
    [(stages, name, name) for name in ("screen_stage", "whitened_stage", "centre_first", "centre_distance",
                                       "interior_stage", "anchored_stage", "frank_wolfe_stage", "newton_stage",
                                       "min_norm_stage", "lp_stage")]
    + [(pipeline, name, name) for name in ("sparsify", "normal_form", "to_given_units")]
    + [(settle.CentreRoutes, name, "routes." + name) for name in ("__init__", "direct", "pooled", "reduce", "_basis")]
    + [(module, name, name) for module in (caratheodory, elimination, pools, settle, anchor)
       for name in ("spread_pool", "centre_pool", "from_pool", "maximum_entropy_weights", "reduce_support",
                    "reduce_supports", "eliminate", "null_vectors", "pool_centre", "pool_start", "pool_certificate",
                    "linear_weights", "shared_null_vectors", "lifted_points", "_hessian")]
    + [(anchor, name, name) for name in ("_pooled", "_whole_head")]
    + [(anchor._Origin, "__init__", "origin"), (dual_simplex.Basis, "__init__", "Basis"),
       (dual_simplex, "_inverse_if_well_conditioned", "_inverse_if_well_conditioned"),
       (interior, "interior_certificates", "interior_certificates")]
)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class StageMemory:
    """Peak resident set per chain of watched functions, and the level at each chain's first entry."""

    def __init__(self):
        self.stack, self.peaks, self.entry = ["audit"], {}, {}
        self._stop = threading.Event()
        for owner, name, label in _WATCHED:
            if hasattr(owner, name):  # in every module that calls it by that name (imported names included)
                setattr(owner, name, self._wrap(getattr(owner, name), label))

    def _wrap(self, function, label):
        @functools.wraps(function)
        def watched(*args, **kwargs):
            chain = "/".join(self.stack + [label])
            self.entry.setdefault(chain, _rss())
            self.stack.append(label)
            try:
                return function(*args, **kwargs)
            finally:
                self.stack.pop()
        return watched

    def _sample(self):
        while not self._stop.is_set():
            level, chain = _rss(), "/".join(self.stack)
            self.peaks[chain] = max(self.peaks.get(chain, 0), level)
            time.sleep(0.002)

    def __enter__(self):
        self.base = _rss()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="gpt2", help="gpt2, llama3, gemma2 or N,D")
    parser.add_argument("--width", type=int, help="the hidden width instead of the shape's own")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--top", type=int, default=20, help="functions listed, highest peak first")
    parser.add_argument("--family", help="a member of bench/families.py (its --list)")
    args = parser.parse_args()
    n, d = SHAPES[args.shape] if args.shape in SHAPES else map(int, args.shape.split(","))
    d = args.width or d
    options = {}
    if args.family:
        import families
        member = next(m for m in families.MEMBERS if m.name == args.family)
        weight, bias, final_norm, accepted = families.build(member, n, d, args.seed)
        options = dict(bias=bias, domain=member.domain, final_norm=final_norm)
        planted = {k: next(iter(v)) for k, v in accepted.items() if len(v) == 1}
        groups = {}
        args.dtype = member.dtype
    else:
        weight, planted, groups = make_head(n, d, args.seed, args.dtype)
    head = torch.from_numpy(weight)
    if args.dtype == "bfloat16":
        head = head.to(torch.bfloat16)
    head_bytes = head.numel() * head.element_size()
    auditor.audit(head[:2000], progress=False)  # warm-up (threads), before the wrappers

    with StageMemory() as memory:
        started = time.perf_counter()
        report = auditor.audit(head, progress=False, **options)
        audit_s = time.perf_counter() - started
    wrong = [k for k, want in planted.items() if report.tokens[k].verdict != want]
    wrong += [k for k, want in groups.items() if report.tokens[k].group_verdict != want]
    unplanted = [k for k in report.ids("unargmaxable") + report.ids("tied") + report.ids("inconclusive")
                 if k not in planted]
    peak = max(memory.peaks.values()) - memory.base
    print(f"head       {n} x {d} {args.dtype}, {head_bytes / 2**20:.0f} MiB, {torch.get_num_threads()} threads")
    print(f"audit      {audit_s:.1f} s (sampled and attributed); stages "
          + ", ".join(f"{k} {v:.1f}" for k, v in report.timings.items() if k != "total"))
    print(f"planted    exact: {not wrong and not unplanted}")
    print(f"peak       {peak / 2**20:.0f} MiB beyond the head = {peak / head_bytes:.3f} x its size")
    print("   peak MiB  heads  entry MiB  where")
    for chain, level in sorted(memory.peaks.items(), key=lambda item: -item[1])[:args.top]:
        entry = memory.entry.get(chain, memory.base) - memory.base
        print(f"  {(level - memory.base) / 2**20:9.0f} {(level - memory.base) / head_bytes:6.3f} "
              f"{entry / 2**20:10.0f}  {chain}")


if __name__ == "__main__":
    main()
