"""Low-rank classifier heads, where unargmaxable tokens occur in released models, against the plain LP.

    python bench/real_heads.py [--cache DIR] [--sample N] [--skip-ocr] [--skip-synthetic] [--json]

Two parts, on the thread count torch is given (the figures in docs/performance.md use
OMP_NUM_THREADS=2, nothing else running):

1. The PP-OCRv3 text recogniser that the ``rapidocr-onnxruntime==1.2.13`` wheel ships
   (Apache-2.0), fetched once from the package registry into ``--cache`` with pip and read by
   the auditor's own ONNX loader: its CTC head, 6625 characters x 64 with a bias. Greedy CTC
   decoding takes the argmax at every frame, so an unargmaxable character is one the
   recogniser can never output. Prints the audit's time and stages, the verdict counts,
   whether ``auditor.verify`` accepts every certificate, and the plain LP on a sample of
   tokens: its verdicts against the audit's and its time per token, times n.
2. Synthetic low-rank heads with crowded boundaries (``--sizes``: rows with log-normal norms,
   with and without a bias) against the plain LP on a sample, and small heads (d <= 6, rows on an
   ellipsoid, a tenth pulled just inside) against Qhull on every token.

The plain LP is the reference of issue 30: for token k, maximise sum_i alpha_i b_i subject to
sum_i alpha_i w_i = w_k, sum_i alpha_i = 1, alpha >= 0 over the other rows (float64,
scipy.optimize.linprog, method "highs", default options, in this process). Infeasible, or a
maximum below b_k: argmaxable; otherwise unargmaxable. Tokens within 1e-9 (relative) of the
threshold are left out of the comparison, as the tolerance rule of docs/method.md leaves them.
"""

import argparse
import json
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np
import scipy.optimize
import scipy.spatial
import torch

import auditor

WHEEL = "rapidocr-onnxruntime==1.2.13"
MODEL = "rapidocr_onnxruntime/models/ch_PP-OCRv3_rec_infer.onnx"
_BAND = 1e-9  # relative band around the threshold the comparisons leave out


def fetch_ocr_model(cache: Path) -> Path:
    """The recogniser's ONNX file, downloaded with pip (no dependencies) and unpacked into ``cache`` once."""
    target = cache / "ch_PP-OCRv3_rec_infer.onnx"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", WHEEL, "-d", str(cache)],
                   check=True)
    wheel = next(cache.glob("rapidocr_onnxruntime-1.2.13-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        target.write_bytes(archive.read(MODEL))
    return target


def plain_lp(W: np.ndarray, b: np.ndarray | None, k: int) -> tuple[str, float]:
    """The reference verdict of token k and the seconds it took (see the module's docstring)."""
    started = time.perf_counter()
    others = np.delete(np.arange(W.shape[0]), k)
    A_eq = np.vstack([W[others].T, np.ones((1, others.size))])
    b_eq = np.append(W[k], 1.0)
    cost = -b[others] if b is not None else np.zeros(others.size)
    result = scipy.optimize.linprog(cost, A_eq=A_eq, b_eq=b_eq, bounds=(0, None), method="highs")
    seconds = time.perf_counter() - started
    if result.status == 2:
        return "argmaxable", seconds
    if result.status != 0:
        return "unknown", seconds
    if b is None:  # feasible: w_k is a convex combination of the other rows
        return "unargmaxable", seconds
    best, own = -result.fun, b[k]
    band = _BAND * max(1.0, float(np.abs(b).max()))
    if abs(best - own) <= band:
        return "band", seconds
    return ("unargmaxable" if best > own else "argmaxable"), seconds


def sample_tokens(report, size: int, rng: np.random.Generator) -> np.ndarray:
    """Up to ``size`` tokens: every token past the screen's first pass up to half of them (the boundary tokens
    that the later stages decide), the rest drawn at random."""
    hard = np.array([t.id for t in report.tokens if t.stage not in (None, "screen")], dtype=np.int64)
    hard = rng.permutation(hard)[:size // 2]
    rest = np.setdiff1d(np.arange(len(report.tokens)), hard)
    return np.sort(np.concatenate([hard, rng.choice(rest, size - hard.size, replace=False)]))


def against_plain_lp(report, W: np.ndarray, b: np.ndarray | None, tokens: np.ndarray) -> dict:
    agree = disagree = band = 0
    seconds = []
    mismatches = []
    for k in tokens.tolist():
        verdict, took = plain_lp(W, b, k)
        seconds.append(took)
        if verdict in ("band", "unknown"):
            band += 1
        elif verdict == report.tokens[k].verdict:
            agree += 1
        else:
            disagree += 1
            mismatches.append((k, verdict, report.tokens[k].verdict))
    return {"sample": int(tokens.size), "agree": agree, "disagree": disagree, "in_band": band,
            "mismatches": mismatches[:10], "plain_lp_s_per_token": round(float(np.mean(seconds)), 4),
            "plain_lp_all_tokens_s": round(float(np.mean(seconds)) * W.shape[0], 1)}


def audit_figures(W, b, name: str) -> tuple[dict, object]:
    started = time.perf_counter()
    report = auditor.audit(W, b, progress=False)
    seconds = time.perf_counter() - started
    stages = {}
    for token in report.tokens:
        stages[token.stage or "none"] = stages.get(token.stage or "none", 0) + 1
    verified = auditor.verify(report, W, b)
    return {"head": name, "n": W.shape[0], "d": W.shape[1], "bias": b is not None, "audit_s": round(seconds, 2),
            "stage_s": {k: round(v, 2) for k, v in report.timings.items() if k != "total"},
            "counts": {k: v for k, v in report.counts.items() if v}, "stages": stages,
            "verified": bool(verified.ok)}, report


def ocr(cache: Path, sample: int) -> dict:
    from auditor.loader import load_head

    head = load_head(fetch_ocr_model(cache))
    W = np.asarray(head.weight, dtype=np.float32)
    b = np.asarray(head.bias, dtype=np.float32)
    figures, report = audit_figures(W, b, "PP-OCRv3 recogniser (rapidocr-onnxruntime 1.2.13)")
    rng = np.random.default_rng(0)
    comparison = against_plain_lp(report, W.astype(np.float64), b.astype(np.float64),
                                  sample_tokens(report, sample, rng))
    figures.update(comparison)
    figures["fraction_of_plain_lp"] = round(figures["audit_s"] / comparison["plain_lp_all_tokens_s"], 5)
    return figures


def crowded_head(n: int, d: int, bias: bool, seed: int) -> tuple[np.ndarray, np.ndarray | None]:
    """A low-rank head with a crowded boundary: n points on an ellipsoid of width d, a tenth of them pulled in
    by a factor 1 - eps with eps log-uniform in [1e-4, 1e-1] (rows just inside the hull, as rare classes
    sit), and a bias 0.1 N(0, 1) (where a bias is asked for), in float32 as heads are stored."""
    rng = np.random.default_rng(seed)
    directions = rng.standard_normal((n, d))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    W = directions * np.linspace(1.0, 3.0, d)
    inside = rng.choice(n, n // 10, replace=False)
    W[inside] *= 1.0 - 10.0 ** rng.uniform(-4, -1, inside.size)[:, None]
    b = (0.1 * rng.standard_normal(n)).astype(np.float32) if bias else None
    return W.astype(np.float32), b


def lognormal_head(n: int, d: int, bias: bool, seed: int) -> tuple[np.ndarray, np.ndarray | None]:
    """A low-rank head as classifiers train them: directions N(0, I_d), row norms log-normal (sigma 1: rare
    classes get short rows, as the OCR head's do), a bias 0.1 N(0, 1) where one is asked for; float32. Most
    rows sit at or near the hull's boundary: the screen settles about 5 % of them."""
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((n, d)) * np.exp(rng.standard_normal(n))[:, None]
    b = (0.1 * rng.standard_normal(n)).astype(np.float32) if bias else None
    return W.astype(np.float32), b


def qhull_family(seeds: int = 3) -> list[dict]:
    """Heads of width 2 to 6 without a bias, against the vertices of their hull (Qhull) on every token."""
    out = []
    for d in (2, 4, 6):
        for seed in range(seeds):
            W, _ = crowded_head(2000, d, False, seed)
            started = time.perf_counter()
            report = auditor.audit(W, progress=False)
            seconds = time.perf_counter() - started
            vertices = set(scipy.spatial.ConvexHull(W.astype(np.float64)).vertices.tolist())
            argmaxable = set(report.ids("argmaxable"))
            out.append({"head": f"crowded {2000} x {d}, seed {seed}", "audit_s": round(seconds, 2),
                        "qhull_vertices": len(vertices), "argmaxable": len(argmaxable),
                        "inconclusive": report.counts["inconclusive"], "equal_to_qhull": argmaxable == vertices})
    return out


def synthetic(sample: int, sizes: list[tuple[int, int]]) -> list[dict]:
    out = []
    for n, d in sizes:
        for bias in (False, True):
            W, b = lognormal_head(n, d, bias, seed=n + d)
            figures, report = audit_figures(W, b, f"log-normal norms {n} x {d}" + (" + bias" if bias else ""))
            comparison = against_plain_lp(report, W.astype(np.float64), None if b is None else b.astype(np.float64),
                                          sample_tokens(report, sample, np.random.default_rng(1)))
            figures.update(comparison)
            out.append(figures)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "auditor-bench")
    parser.add_argument("--sample", type=int, default=60, help="tokens compared with the plain LP (default 60)")
    parser.add_argument("--skip-ocr", action="store_true")
    parser.add_argument("--skip-synthetic", action="store_true")
    parser.add_argument("--sizes", default="2000x32,5000x64",
                        help="synthetic heads, NxD comma-separated (default 2000x32,5000x64)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {"threads": torch.get_num_threads()}
    if not args.skip_ocr:
        results["ocr"] = ocr(args.cache, args.sample)
        print(json.dumps(results["ocr"]) if args.json else _lines(results["ocr"]), flush=True)
    if not args.skip_synthetic:
        sizes = [tuple(int(v) for v in size.split("x")) for size in args.sizes.split(",")]
        results["synthetic"] = synthetic(args.sample, sizes)
        results["qhull"] = qhull_family()
        for figures in results["synthetic"] + results["qhull"]:
            print(json.dumps(figures) if args.json else _lines(figures), flush=True)
    print(f"threads {results['threads']}")


def _lines(figures: dict) -> str:
    return "\n".join([figures["head"]] + [f"  {key}: {value}" for key, value in figures.items() if key != "head"])


if __name__ == "__main__":
    main()
