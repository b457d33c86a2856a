"""Bounded-domain and biased audits against the unbounded audit, and the invariance repros, in one run.

    python bench/fast_path.py [--device cpu|cuda] [--threads N] [--embeddings FILE] [--skip-ceilings] [--other-biased]
                              [--near-mean-seeds 0,1,2] [--near-mean-eps 1e-7,1e-5,1e-3,1e-1] [--near-mean-only] [--json]

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
      its transformed twin must be identical, with no inconclusive token;
  (h) the near-mean sweep, per seed of --near-mean-seeds: the real head with one row at
      its mean plus eps N(0, 1) per eps of --near-mean-eps (default 1e-7, 1e-5, 1e-3 and 1e-1),
      all of them (one seed) in one head, audited unbounded and in the
      norm domain under a LayerNorm (gain U[0.85, 1.15], shift 0.04 N(0, 1), eps 1e-12) and
      an RMSNorm (gain U[0.85, 1.15], eps 1e-6). Per norm: both times, their ratio, each
      planted row's verdict and stage, and every token that reached the per-token LP with
      its lead (margin) or residual (dual value) relative to the rows' spread (the report's
      typical_spread).                          target <= 1.5x unbounded, and no token whose
      lead or residual exceeds 1e-6 of the spread reaches the LP.

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
NEAR_MEAN_EPS = (1e-7, 1e-5, 1e-3, 1e-1)
NEAR_MEAN_TARGET = 1.5
LP_RELATIVE_FLOOR = 1e-6  # tokens whose lead or residual exceeds this fraction of the rows' spread must not reach the LP


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


def near_mean_rows(vocabulary: np.ndarray, scales: tuple[float, ...], rng: np.random.Generator) -> np.ndarray:
    """The mean of the rows plus eps N(0, 1) for each eps of ``scales``, one row each."""
    mean = vocabulary.astype(np.float64).mean(axis=0)
    return np.vstack([mean + eps * rng.standard_normal(mean.shape[0]) for eps in scales]).astype(np.float32)


def near_mean_norms(d: int, rng: np.random.Generator) -> dict[str, auditor.FinalNorm]:
    return {"layernorm": auditor.FinalNorm("layernorm", weight=rng.uniform(0.85, 1.15, d),
                                           bias=0.04 * rng.standard_normal(d), eps=1e-12),
            "rmsnorm": auditor.FinalNorm("rmsnorm", weight=rng.uniform(0.85, 1.15, d), eps=1e-6)}


def relative_size(token, spread: float) -> float:
    """|lead| (argmaxable: the margin) or |residual| (unargmaxable: the dual value) over the rows' spread; for an
    inconclusive token the larger end of its bounds."""
    if token.verdict == "argmaxable":
        value = abs(token.margin)
    elif token.verdict == "unargmaxable":
        value = abs(token.residual)
    elif token.bounds is not None:
        value = max(abs(v) for v in token.bounds if np.isfinite(v)) if any(np.isfinite(token.bounds)) else np.inf
    else:
        value = np.nan
    return value / spread


def near_mean_case(vocabulary: np.ndarray, seed: int, scales: tuple[float, ...], device: str) -> dict:
    """(h) for one seed: the unbounded audit of the head with four near-mean rows, then the norm domain under a
    LayerNorm and an RMSNorm, each against that unbounded time."""
    rng = np.random.default_rng(seed)
    n = vocabulary.shape[0]
    head = np.vstack([vocabulary, near_mean_rows(vocabulary, scales, rng)])
    planted = list(range(n, n + len(scales)))
    plain, reference = timed_audit(head, device=device)
    out = {"unbounded_s": round(reference, 3), "unbounded_stages_s": {k: round(v, 3) for k, v in plain.timings.items()},
           "unbounded_lp_tokens": sum(t.stage == "lp" for t in plain.tokens)}
    print(f"    seed {seed}: unbounded {reference:.2f} s, LP tokens {out['unbounded_lp_tokens']}", flush=True)
    for kind, norm in near_mean_norms(head.shape[1], rng).items():
        report, wall = timed_audit(head, device=device, domain="norm", final_norm=norm)
        spread = report.tolerances["typical_spread"]
        lp = [{"id": t.id, "verdict": t.verdict, "relative": relative_size(t, spread)}
              for t in report.tokens if t.stage == "lp"]
        f = out[kind] = {
            "wall_s": round(wall, 3), "ratio_to_unbounded": round(wall / reference, 2),
            "stages_s": {k: round(v, 3) for k, v in report.timings.items()}, "counts": dict(report.counts),
            "planted": [{"eps": eps, "verdict": report.tokens[k].verdict, "stage": report.tokens[k].stage,
                         "relative": relative_size(report.tokens[k], spread)} for eps, k in zip(scales, planted)],
            "lp_tokens": lp,
            "lp_tokens_beyond_floor": sum(not t["relative"] <= LP_RELATIVE_FLOOR for t in lp),
        }
        print(f"        {kind}: {wall:.2f} s, {f['ratio_to_unbounded']:.2f}x unbounded (target <= {NEAR_MEAN_TARGET}x); "
              f"LP tokens {len(lp)}, beyond {LP_RELATIVE_FLOOR:g} of the spread {f['lp_tokens_beyond_floor']} (target 0); "
              f"inconclusive {f['counts']['inconclusive']}", flush=True)
        print(f"            stages {f['stages_s']}")
        for row in f["planted"]:
            print(f"            eps {row['eps']:g}: {row['verdict']} by {row['stage']}, "
                  f"|lead or residual| / spread {row['relative']:.3g}")
        for row in lp:
            print(f"            to the LP: token {row['id']} {row['verdict']}, |lead or residual| / spread "
                  f"{row['relative']:.3g}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--embeddings", help="a .safetensors file with the matrix as 'weight'")
    parser.add_argument("--skip-ceilings", action="store_true")
    parser.add_argument("--other-biased", action="store_true",
                        help="also (f) unbounded and (g) box:0.4 with the bias of (c) (no target; box takes ~40 s)")
    parser.add_argument("--near-mean-seeds", default="0,1,2",
                        help="seeds of the near-mean sweep (h), comma-separated; empty to skip it")
    parser.add_argument("--near-mean-eps", default=",".join(f"{eps:g}" for eps in NEAR_MEAN_EPS),
                        help="the sweep's scales eps of the N(0, 1) noise, comma-separated")
    parser.add_argument("--near-mean-only", action="store_true", help="run only the near-mean sweep (h)")
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
    # warm-up: the libraries' first calls (LAPACK's eigh among them) would otherwise land in the first run timed
    small = np.vstack([vocabulary[:2000], vocabulary[:2000].astype(np.float64).mean(axis=0, keepdims=True)])
    auditor.audit(small, device=args.device, progress=False)
    auditor.audit(small, device=args.device, progress=False, domain="norm", final_norm=norm)

    runs = [] if args.near_mean_only else [("unbounded", "(a) unbounded, no bias", None, {}),
            ("norm", "(b) norm (LayerNorm, seed 8)", None, {"domain": "norm", "final_norm": norm}),
            ("biased_ball", "(c) ball:8, bias 0.25 N(0,1) seed 9", bias, {"domain": "ball:8"})]
    if runs and not args.skip_ceilings:
        runs.append(("ceilings", "(d) norm + probability ceilings", None,
                     {"domain": "norm", "final_norm": norm, "probability_ceiling": True}))
    if runs and args.other_biased:
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

    if not args.near_mean_only:
        figures["invariance"] = {}
        print("(e) invariance repros (target: identical verdicts, inconclusive 0)")
        for title, family in FAMILIES.items():
            figures["invariance"][title] = {str(seed): family(seed, args.device) for seed in SEEDS}
            print(f"    {title}")
            for seed, outcome in figures["invariance"][title].items():
                print(f"        seed {seed}: {outcome}", flush=True)

    seeds = [int(seed) for seed in args.near_mean_seeds.split(",") if seed.strip()]
    scales = tuple(float(eps) for eps in args.near_mean_eps.split(",") if eps.strip())
    if seeds and scales:
        print(f"(h) near-mean sweep: {vocabulary.shape[0]} + {len(scales)} rows at the mean plus eps N(0, 1), "
              f"eps {', '.join(f'{eps:g}' for eps in scales)}; LayerNorm and RMSNorm against the unbounded audit")
        figures["near_mean"] = {str(seed): near_mean_case(vocabulary, seed, scales, args.device) for seed in seeds}
    if args.json:
        print(json.dumps(figures))


if __name__ == "__main__":
    main()
