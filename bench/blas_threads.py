"""What numpy's own BLAS threads cost an audit: the few-token audits of bench/added_tokens.py (8 added rows of
the real MiniLM head, and of the Llama-3 vocabulary at width 1024) with numpy's and scipy's OpenBLAS limited
to one thread during the audit (what auditor/util/threads.py does) and with that limit lifted (their threads
left as they are: one per core unless OPENBLAS_NUM_THREADS says otherwise).

    OMP_NUM_THREADS=2 python bench/blas_threads.py [--embeddings FILE] [--repeats 5] [--skip-llama]

The pools, bases and eliminations of the few-token route are dense problems of D and 3D rows that numpy
and scipy solve; an OpenBLAS thread that waits for work spins on a core that torch's threads need. Prints
the median time of each (5 runs for MiniLM, 3 for the Llama-3 head; the two settings in turn, run by
run), the OpenBLAS thread counts, and torch's.
"""

import argparse
import contextlib
import json
import time

import numpy as np
import torch
from _vocabulary import load_vocabulary, mean_initialised
from added_tokens import llama_like
from threadpoolctl import threadpool_info

import auditor
import auditor.util.threads as threads


class _Unlimited:
    """A stand-in for the controller of numpy's BLAS that leaves its threads alone."""

    def limit(self, limits):
        return contextlib.nullcontext()


def _alternating(W, ids, repeats):
    """Medians of ``repeats`` timings with numpy's BLAS limited and lifted, the two taken in turn run by run
    (so that a drift of the machine touches both alike)."""
    limited = threads._own_blas()
    times = {"numpy_blas_1_thread": [], "numpy_blas_unlimited": []}
    for _ in range(repeats):
        for key, controller in (("numpy_blas_1_thread", limited), ("numpy_blas_unlimited", _Unlimited())):
            threads._controller = controller  # _Unlimited: what the audit would do without the limit
            time.sleep(0.3)  # no threads left spinning by the harness's own numpy work
            started = time.perf_counter()
            auditor.audit(W, tokens=ids, progress=False)
            times[key].append(time.perf_counter() - started)
    threads._controller = limited
    return {key: round(float(np.median(values)), 3) for key, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--embeddings", help="the MiniLM matrix from a .safetensors file (tensor 'weight')")
    parser.add_argument("--repeats", type=int, default=5, help="runs of each setting for MiniLM")
    parser.add_argument("--skip-llama", action="store_true")
    args = parser.parse_args()
    vocabulary = load_vocabulary(args.embeddings)
    heads = [("all-MiniLM-L6-v2 + 8 mean-initialised rows",
              np.vstack([vocabulary, mean_initialised(vocabulary, 8, np.random.default_rng(31))]), args.repeats)]
    if not args.skip_llama:
        base = llama_like()
        centre = base.astype(np.float64).mean(axis=0)
        added = (centre + 1e-5 * np.random.default_rng(32).standard_normal((8, base.shape[1]))).astype(np.float32)
        heads.append(("Llama-3 vocabulary at width 1024 + 8 near-mean rows", np.vstack([base, added]), 3))
        del base
    warm = np.random.default_rng(0).standard_normal((4096, 64)).astype(np.float32)
    auditor.audit(warm, tokens=[0, 1], progress=False)
    results = {"torch_threads": torch.get_num_threads(),
               "openblas_threads": sorted({i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}),
               "few_tokens_s": {}}
    for name, W, repeats in heads:
        results["few_tokens_s"][name] = _alternating(W, list(range(W.shape[0] - 8, W.shape[0])), repeats)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
