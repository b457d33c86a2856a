"""Bounded-domain and biased audits against the unbounded audit, and the invariance repros, in one run.

    python bench/fast_path.py [--device cpu|cuda] [--threads N] [--embeddings FILE] [--skip-ceilings] [--other-biased] [--json]

On the real 30522 x 384 all-MiniLM-L6-v2 head with six rows appended the way
vocabularies are resized (three N(mean, 1e-9 cov) rows as resize_token_embeddings
makes them, the exact mean, and the mean plus 1e-6 and 1e-3 times N(0, 1)), each
audit is timed (wall clock and report.timings per stage, and the tokens that went
to the per-token LP) and compared with the unbounded audit of the same run:

  (a) unbounded, no bias: the reference;
  (b) norm domain, the synthetic LayerNorm of bench/norm_domain.py (gain U[0.8, 1.2],
      shift 0.05 N(0, 1), eps 1e-12, seed 8): the shift gives every row the bias
      w_i . beta, and the mean rows the mean of it;                target <= 1.5x (a), 0 LP
  (c) ball:8 with the bias 0.25 N(0, 1) (seed 9);                    target <= 2x (a)
  (d) (b) with probability_ceiling=True for every token;             target <= 3x (a)
  (f), (g) with --other-biased: the bias of (c) in the unbounded domain and in box:0.4;
  (e) invariance repros on small heads, a few seeds each: the verdicts of a head and
      its transformed twin must be identical, with no inconclusive token.

Target for every run: 0 inconclusive; for (a) and (b), 0 tokens left to the LP. The twins of (e) are exact in float64 (each
construction asserts it), so any difference is the engine's.
"""

import argparse
import json
import time

import numpy as np
import torch
from _vocabulary import load_vocabulary, mean_initialised

import auditor

SEEDS = (0, 1, 2)
TARGETS = {"norm": 1.5, "biased_ball": 2.0, "ceilings": 3.0}


def near_mean(vocabulary: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """The exact mean row, and the mean plus 1e-6 and 1e-3 times N(0, 1)."""
    mean = vocabulary.astype(np.float64).mean(axis=0)
    d = mean.shape[0]
    return np.vstack([mean, mean + 1e-6 * rng.standard_normal(d), mean + 1e-3 * rng.standard_normal(d)]).astype(np.float32)


def timed_audit(weight, bias=None, **options) -> tuple[auditor.AuditReport, float]:
    started = time.perf_counter()
    report = auditor.audit(weight, bias, progress=False, **options)
    return report, time.perf_counter() - started


def run_figures(report, wall: float, reference: float | None) -> dict:
    return {
        "wall_s": round(wall, 3),
        "stages_s": {k: round(v, 3) for k, v in report.timings.items()},
        "ratio_to_unbounded": None if reference is None else round(wall / reference, 2),
        "counts": dict(report.counts),
        "lp_tokens": sum(t.stage == "lp" for t in report.tokens),
    }


def dyadic(values: np.ndarray, bits: int = 20) -> np.ndarray:
    """Round to multiples of 2^-bits, so that adding small dyadic constants stays exact."""
    return np.round(values * 2.0**bits) / 2.0**bits


def verdicts(report) -> list[tuple[str, str | None]]:
    return [(t.verdict, t.group_verdict) for t in report.tokens]


def twin_outcome(first, second) -> dict:
    return {"inconclusive": [first.counts["inconclusive"], second.counts["inconclusive"]],
            "identical": verdicts(first) == verdicts(second)}


def constant_bias(seed: int, device: str) -> dict:
    W = np.random.default_rng(seed).standard_normal((30, 4))
    return twin_outcome(auditor.audit(W, None, device=device, progress=False),
                        auditor.audit(W, np.full(30, 0.3), device=device, progress=False))


def scaled_unbounded(seed: int, device: str) -> dict:
    rng = np.random.default_rng(seed)
    W, b = rng.standard_normal((40, 4)), rng.standard_normal(40)
    base = auditor.audit(W, b, device=device, progress=False)
    out = {}
    for e in (66, -66):
        s = 2.0**e
        assert np.array_equal((W * s) / s, W) and np.array_equal((b * s) / s, b)
        out[f"2^{e}"] = twin_outcome(base, auditor.audit(W * s, b * s, device=device, progress=False))
    return out


def scaled_ball(seed: int, device: str) -> dict:
    """Head scaled by s, radius by 1/s; the bias stays (the logits W z + b are the same)."""
    rng = np.random.default_rng(seed)
    W, b = rng.standard_normal((25, 3)), rng.standard_normal(25)
    base = auditor.audit(W, b, domain=auditor.Ball(1.0), device=device, progress=False)
    out = {}
    for e in (-332, 332):
        s = 2.0**e
        assert np.array_equal((W * s) / s, W)
        twin = auditor.audit(W * s, b, domain=auditor.Ball(2.0**-e), device=device, progress=False)
        out[f"head 2^{e}, radius 2^{-e}"] = twin_outcome(base, twin)
    return out


def translated(seed: int, device: str) -> dict:
    """Rows 1e6 e1 + 1e-4 noise against the same rows minus 1e6 e1 (exact: Sterbenz)."""
    noise = 1e-4 * np.random.default_rng(seed).standard_normal((40, 4))
    shift = np.zeros(4)
    shift[0] = 1e6
    far = noise + shift
    near = far - shift
    assert np.array_equal(near + shift, far)
    return twin_outcome(auditor.audit(near, device=device, progress=False),
                        auditor.audit(far, device=device, progress=False))


def layernorm_tie(seed: int, device: str) -> dict:
    """Row 4 = row 0 + 0.5 ones, equal biases, unit gain, no shift: the same logits after the norm."""
    rng = np.random.default_rng(seed)
    W, b = dyadic(rng.standard_normal((12, 6))), dyadic(rng.standard_normal(12))
    W[4] = W[0] + 0.5
    b[4] = b[0]
    assert np.all(W[4] - W[0] == 0.5)
    norm = auditor.FinalNorm("layernorm", weight=np.ones(6), bias=None, eps=1e-5)
    report = auditor.audit(W, b, domain="norm", final_norm=norm, device=device, progress=False)
    return {"inconclusive": report.counts["inconclusive"],
            "verdicts 0, 4": [report.tokens[0].verdict, report.tokens[4].verdict],
            "group verdicts": [report.tokens[0].group_verdict, report.tokens[4].group_verdict],
            "both tied, same group verdict": report.tokens[0].verdict == report.tokens[4].verdict == "tied"
            and report.tokens[0].group_verdict == report.tokens[4].group_verdict not in (None, "inconclusive")}


def rmsnorm_copy(seed: int, device: str) -> dict:
    W = np.random.default_rng(seed).standard_normal((200, 16))
    W = np.vstack([W, W[5]])
    norm = auditor.FinalNorm("rmsnorm", weight=np.ones(16), eps=1e-6)
    report = auditor.audit(W, domain="norm", final_norm=norm, device=device, progress=False)
    first, second = report.tokens[5], report.tokens[200]
    return {"inconclusive": report.counts["inconclusive"],
            "verdicts 5, 200": [first.verdict, second.verdict],
            "group verdicts": [first.group_verdict, second.group_verdict],
            "same group verdict": first.verdict == second.verdict == "tied"
            and first.group_verdict == second.group_verdict not in (None, "inconclusive")}


FAMILIES = {
    "constant bias 0.3 (30x4, unbounded)": constant_bias,
    "scale head and bias by 2^66, 2^-66 (40x4, unbounded)": scaled_unbounded,
    "head 2^-332 / 2^332 vs ball:1 (25x3, biased)": scaled_ball,
    "rows 1e6 e1 + 1e-4 noise vs noise (40x4)": translated,
    "LayerNorm exact tie (12x6, rows 0 and 4)": layernorm_tie,
    "RMSNorm copy (201x16, rows 5 and 200)": rmsnorm_copy,
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--embeddings", help="a .safetensors file with the matrix as 'weight'")
    parser.add_argument("--skip-ceilings", action="store_true")
    parser.add_argument("--other-biased", action="store_true",
                        help="also (f) unbounded and (g) box:0.4 with the bias of (c) (no target; box takes ~40 s)")
    parser.add_argument("--json", action="store_true", help="end with one JSON line of all figures")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"device {args.device}, {torch.get_num_threads()} threads", flush=True)

    vocabulary = load_vocabulary(args.embeddings)
    rng = np.random.default_rng(8)
    head = np.vstack([vocabulary, mean_initialised(vocabulary, 3, rng), near_mean(vocabulary, rng)])
    norm = auditor.FinalNorm("layernorm", weight=rng.uniform(0.8, 1.2, 384), bias=0.05 * rng.standard_normal(384),
                             eps=1e-12)
    bias = 0.25 * np.random.default_rng(9).standard_normal(head.shape[0])
    figures = {"device": args.device, "threads": torch.get_num_threads(), "shape": list(head.shape)}
    auditor.audit(vocabulary[:2000], device=args.device, progress=False)  # warm-up

    runs = [("unbounded", "(a) unbounded, no bias", None, {}),
            ("norm", "(b) norm (LayerNorm, seed 8)", None, {"domain": "norm", "final_norm": norm}),
            ("biased_ball", "(c) ball:8, bias 0.25 N(0,1) seed 9", bias, {"domain": "ball:8"})]
    if not args.skip_ceilings:
        runs.append(("ceilings", "(d) norm + probability ceilings", None,
                     {"domain": "norm", "final_norm": norm, "probability_ceiling": True}))
    if args.other_biased:
        runs += [("biased_unbounded", "(f) unbounded, bias of (c)", bias, {}),
                 ("biased_box", "(g) box:0.4, bias of (c)", bias, {"domain": "box:0.4"})]
    reference = None
    for name, title, b, options in runs:
        report, wall = timed_audit(head, b, device=args.device, **options)
        reference = reference or wall
        f = figures[name] = run_figures(report, wall, None if name == "unbounded" else reference)
        target = f"  (target <= {TARGETS[name]}x)" if name in TARGETS else ""
        ratio = "" if f["ratio_to_unbounded"] is None else f"  {f['ratio_to_unbounded']:.2f}x unbounded{target}"
        print(f"{title}: {wall:.2f} s{ratio}", flush=True)
        print(f"    counts {f['counts']}  (target inconclusive 0), tokens settled by the LP {f['lp_tokens']}")
        print(f"    stages {f['stages_s']}", flush=True)
        if options.get("probability_ceiling"):
            reached, bound = report.ceilings()
            width = bound - reached
            f["ceiling_width_max"] = float(np.nanmax(width))
            f["ceilings_wider_than_1e-4"] = int(np.sum(width > 1e-4))
            print(f"    ceilings: widest bound {f['ceiling_width_max']:.3g}, {f['ceilings_wider_than_1e-4']} wider "
                  f"than 1e-4, {int(np.sum(reached < 0.5))} tokens never reach 50 %", flush=True)

    figures["invariance"] = {}
    print("(e) invariance repros (target: identical verdicts, inconclusive 0)")
    for title, family in FAMILIES.items():
        figures["invariance"][title] = {str(seed): family(seed, args.device) for seed in SEEDS}
        print(f"    {title}")
        for seed, outcome in figures["invariance"][title].items():
            print(f"        seed {seed}: {outcome}", flush=True)
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
