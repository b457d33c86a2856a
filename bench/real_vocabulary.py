"""Audit time against one Gram pass (float32 and float64) on the real 30522 x 384 all-MiniLM-L6-v2 head.

    python bench/real_vocabulary.py [--device cpu|cuda] [--json] [--embeddings FILE]

``--embeddings`` reads the matrix from a .safetensors file (tensor "weight")
instead of the installed package, for machines without it.

Prints the time of one float32 and one float64 W W^T pass in the engine's layout (chunks of
rows times W^T, with a per-row max so the products are used), the audit's
total and per-stage times (single run each), its ratio to both passes and the verdict counts, for
the real head, the head with three mean-initialised rows appended, and the head with four
mean-initialised rows and a copied row appended.
"""

import argparse
import json
import time

import numpy as np
import torch
from _vocabulary import load_vocabulary, mean_initialised

import auditor


def gram_pass(weight: torch.Tensor, chunk: int = 1024) -> float:
    """One W W^T pass into a reused block (as fast as the pass gets), with a per-row max."""
    block = torch.empty(chunk, weight.shape[0], dtype=weight.dtype, device=weight.device)
    started = time.perf_counter()
    for s in range(0, weight.shape[0], chunk):
        rows = min(chunk, weight.shape[0] - s)
        torch.matmul(weight[s:s + rows], weight.T, out=block[:rows])
        block[:rows].max(dim=1)
    if weight.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--embeddings", help="a .safetensors file with the matrix as 'weight'")
    parser.add_argument("--verify", action="store_true", help="also time auditor.verify on the resized head")
    args = parser.parse_args()
    vocabulary = load_vocabulary(args.embeddings)
    rng = np.random.default_rng(5)
    added = mean_initialised(vocabulary, 4, rng)
    resized = np.vstack([vocabulary, added, vocabulary[[1037]]])
    three = np.vstack([vocabulary, mean_initialised(vocabulary, 3, np.random.default_rng(8))])

    figures = {"device": args.device, "threads": torch.get_num_threads()}
    w64 = torch.from_numpy(vocabulary).to(args.device, torch.float64)
    gram_pass(w64[:2048])  # warm-up
    auditor.audit(vocabulary[:2000], device=args.device, progress=False)  # warm-up (CUDA context, kernels)
    figures["gram_float64_s"] = round(gram_pass(w64), 3)
    del w64
    w32 = torch.from_numpy(vocabulary).to(args.device, torch.float32)
    gram_pass(w32[:2048])
    figures["gram_float32_s"] = round(gram_pass(w32), 3)
    del w32
    for name, head in (("real", vocabulary), ("three_mean_rows", three), ("resized", resized)):
        report = auditor.audit(head, device=args.device, progress=False)
        figures[name] = {
            "shape": list(head.shape),
            "audit_s": round(report.timings["total"], 3),
            "stages_s": {k: round(v, 3) for k, v in report.timings.items() if k != "total"},
            "ratio_to_gram": round(report.timings["total"] / figures["gram_float64_s"], 2),
            "ratio_to_gram32": round(report.timings["total"] / figures["gram_float32_s"], 2),
            "counts": {k: v for k, v in report.counts.items() if v},
            "unargmaxable": report.ids("unargmaxable"),
            "tied": report.ids("tied"),
            # what --certificates writes, and the largest convex certificate in it (rows named)
            "certificates_json_bytes": len(json.dumps(report.to_dict(), allow_nan=False)),
            "max_convex_rows": max((len(report.tokens[k].convex_indices) for k in report.ids("unargmaxable")),
                                   default=0),
        }
        if args.verify and name == "resized":
            started = time.perf_counter()
            result = auditor.verify(report, head)
            figures[name]["verify_s"] = round(time.perf_counter() - started, 3)
            figures[name]["verified"] = result.ok  # every token's certificate, plus each tie claim
            figures[name]["verify_checked"] = result.checked
    if args.json:
        print(json.dumps(figures))
        return
    print(f"Gram pass, {args.device}, {figures['threads']} threads: float32 {figures['gram_float32_s']:.2f} s, "
          f"float64 {figures['gram_float64_s']:.2f} s")
    for name in ("real", "three_mean_rows", "resized"):
        f = figures[name]
        print(f"{name} {f['shape'][0]} x {f['shape'][1]}: audit {f['audit_s']:.2f} s "
              f"({f['ratio_to_gram32']:.2f} x the float32 pass, {f['ratio_to_gram']:.2f} x the float64 one)  {f['counts']}")
        print(f"         stages {f['stages_s']}")
        print(f"         unargmaxable {f['unargmaxable']}  tied {f['tied']}")
        print(f"         certificates file {f['certificates_json_bytes'] / 1e6:.2f} MB, largest convex certificate "
              f"{f['max_convex_rows']} rows")
        if "verify_s" in f:
            print(f"         verify {f['verify_s']:.2f} s, {f['verify_checked']} certificates checked, "
                  f"all hold: {f['verified']}")


if __name__ == "__main__":
    main()
