"""Audit time over a family of heads, the slowest member as the figure.

    python bench/families.py [--size N,D] [--members NAME,...] [--skip NAME,...] [--list] [--threads T]
                             [--device cpu|cuda] [--verify first|all|none] [--seed S] [--pool-bytes B]
                             [--repeats R] [--json]

A benchmark's head is one head; users' heads differ from it in their spectrum,
their shape, the rows planted in them, their storage and their domain. This
bench builds, for one size n x d, one member per such difference from a base
head, and audits each against one float32 W W^T pass over the same member
measured in the same run (bench/vocabulary_scale.py's floor). Its summary is
the worst member, the median and the best.

The base head: rows c + s_i L g_i, g_i standard normal, L a random rotation
times standard deviations rank^(-a/2) (the covariance decays like rank^-a,
a = 0.68, all-MiniLM-L6-v2's slope), s_i log-normal with sigma 0.29 and c an
offset two standard deviations of the leading direction long. Planted in every
member: four zero rows (reserved tokens: tied), three exact-mean rows (tied, the
group unargmaxable) and, alone, one row mean + s N(0, I) and one mean + s N(0, C)
(C the rows' covariance) for each s in 1e-9, 1e-7, 1e-5, 1e-3, 1e-2 and 1e-1.
A row within 1e-6 of the mean is unargmaxable (or tied with the mean where
float32 rounds it onto it): the cloud is far deeper around its mean than that;
every other planted row must be decided, and the certificates are re-checked by
auditor.verify (--verify). The members, one difference from the base each:

- decay a = 0.3, 1.0, 1.2 and 1.6 with rotated axes, 1.2 and 1.6 axis-aligned;
- 4 rogue directions with 10 and with 100 times the largest variance;
- row norms with sigma 0 and 0.6; offsets 0 and 10;
- the near-mean rows by the dozen (twelve per s and kind);
- n / d = 8, 32, 63, 65 and 200 at the same d (the screen's size rules:
  64 rows per column for the whitened candidates' low-precision copy, 2^22
  entries for the low-precision passes);
- bfloat16 storage;
- the norm domain (a LayerNorm: gain U[0.85, 1.15], shift 0.04 N(0, 1), eps 1e-12);
- a bias 0.25 N(0, 1), unbounded and in the ball of radius 8;
- and the steep spectrum (a = 1.2) in bfloat16, in the norm domain and with rogue directions.

``--repeats R`` runs the floor pass and the audit R times per member and takes the fastest of each (the
spread in ``floor_range_s`` and ``audit_range_s``): a shared machine's speed moves by half between runs.

``--pool-bytes`` sets the memory a pool drawn around a point may take (auditor.engine.exact.pools._POOL_BYTES,
128 MiB, D <= 1672): 0 turns the pools off, a large value turns them on for wider heads, to measure the
size rule from both sides.

For each member it prints the floor, the audit, their ratio, the time per stage,
the tokens each stage decided, peak memory beyond the head (as a fraction of a
float32 head), inconclusive tokens and whether the planted verdicts came out.
``--json`` ends with one JSON line of every figure.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass, field, replace

import numpy as np
import torch
from vocabulary_scale import PeakMemory, floor_pass

import auditor
from auditor.engine.decisions import STAGES

NEAR_SCALES = (1e-9, 1e-7, 1e-5, 1e-3, 1e-2, 1e-1)
DEEP_INSIDE = 1e-6  # planted rows within this many units of the mean are unargmaxable


@dataclass(frozen=True)
class Member:
    name: str
    decay: float = 0.68
    rotated: bool = True
    rogue: int = 0  # directions with ``rogue_factor`` times the largest variance
    rogue_factor: float = 1.0
    norm_sigma: float = 0.29
    offset: float = 2.0  # in standard deviations of the leading direction
    near_count: int = 1  # planted rows per scale and kind
    rows_per_column: float | None = None  # n / d; None keeps the size's n
    dtype: str = "float32"
    domain: str = "unbounded"  # unbounded, norm, ball:8
    bias: bool = False
    notes: dict = field(default_factory=dict)


BASE = Member("base")
MEMBERS = [
    BASE,
    *(replace(BASE, name=f"decay {a}", decay=a) for a in (0.3, 1.0, 1.2, 1.6)),
    *(replace(BASE, name=f"decay {a} axis-aligned", decay=a, rotated=False) for a in (1.2, 1.6)),
    *(replace(BASE, name=f"rogue 4 x {f}", rogue=4, rogue_factor=f) for f in (10.0, 100.0)),
    *(replace(BASE, name=f"norms sigma {s}", norm_sigma=s) for s in (0.0, 0.6)),
    *(replace(BASE, name=f"offset {o}", offset=o) for o in (0.0, 10.0)),
    replace(BASE, name="near-mean by the dozen", near_count=12),
    *(replace(BASE, name=f"n/d {r}", rows_per_column=r) for r in (8, 32, 63, 65, 200)),
    replace(BASE, name="bfloat16", dtype="bfloat16"),
    replace(BASE, name="norm domain", domain="norm"),
    replace(BASE, name="bias", bias=True),
    replace(BASE, name="ball:8 with bias", domain="ball:8", bias=True),
    replace(BASE, name="decay 1.2 bfloat16", decay=1.2, dtype="bfloat16"),
    replace(BASE, name="decay 1.2 norm domain", decay=1.2, domain="norm"),
    replace(BASE, name="decay 1.2 rogue 4 x 100", decay=1.2, rogue=4, rogue_factor=100.0),
]


def build(member: Member, n: int, d: int, seed: int):
    """The member's head (float32 values, rounded to bfloat16 for that storage), its bias or None, the final norm
    or None, and the planted rows: {id: set of verdicts accepted} (an empty set: any decided verdict)."""
    rng = np.random.default_rng(seed)
    if member.rows_per_column is not None:
        n = int(round(member.rows_per_column * d))
    planted_count = 2 * member.near_count * len(NEAR_SCALES) + 7
    base = n - planted_count
    spectrum = np.arange(1, d + 1, dtype=np.float64) ** -member.decay
    spectrum /= spectrum.sum()
    if member.rogue:
        spectrum[rng.choice(d, member.rogue, replace=False)] = member.rogue_factor * spectrum.max()
    axes = np.linalg.qr(rng.standard_normal((d, d)))[0] if member.rotated else np.eye(d)
    mixing = (axes * np.sqrt(spectrum)).T  # rows of g @ mixing have covariance axes diag(spectrum) axes^T
    leading = int(np.argmax(spectrum))
    offset = member.offset * np.sqrt(spectrum[leading]) * axes[:, leading]
    weight = np.empty((n, d), dtype=np.float32)
    for s in range(0, base, 8192):
        e = min(base, s + 8192)
        g = rng.standard_normal((e - s, d))
        scale = np.exp(member.norm_sigma * rng.standard_normal((e - s, 1)))
        weight[s:e] = offset + scale * (g @ mixing)
    mean = weight[:base].astype(np.float64).mean(axis=0)
    covariance = np.cov(weight[:base].astype(np.float64).T)
    root = np.linalg.cholesky(covariance + 1e-12 * np.trace(covariance) / d * np.eye(d))
    planted: dict[int, set[str]] = {}
    k = base
    weight[k:k + 4] = 0.0
    for j in range(k, k + 4):
        planted[j] = {"tied"}
    k += 4
    weight[k:k + 3] = mean
    for j in range(k, k + 3):
        planted[j] = {"tied"}
    k += 3
    for s in NEAR_SCALES:
        for kind in ("identity", "covariance"):
            noise = rng.standard_normal((member.near_count, d))
            if kind == "covariance":
                noise = noise @ root.T
            weight[k:k + member.near_count] = mean + s * noise
            for j in range(k, k + member.near_count):
                planted[j] = {"unargmaxable", "tied"} if s <= DEEP_INSIDE else set()
            k += member.near_count
    if member.dtype == "bfloat16":
        for s in range(0, n, 8192):
            weight[s:s + 8192] = torch.from_numpy(weight[s:s + 8192]).to(torch.bfloat16).float().numpy()
    if member.domain != "unbounded" or member.bias:
        planted = {j: set() for j in planted}  # the verdicts move with the domain: decided is what is asked
    bias = 0.25 * rng.standard_normal(n) if member.bias else None
    final_norm = None
    if member.domain == "norm":
        final_norm = auditor.FinalNorm("layernorm", weight=rng.uniform(0.85, 1.15, d),
                                       bias=0.04 * rng.standard_normal(d), eps=1e-12)
    return weight, bias, final_norm, planted


def run_member(member: Member, n: int, d: int, seed: int, device: str, verify: bool, repeats: int = 1) -> dict:
    weight, bias, final_norm, planted = build(member, n, d, seed)
    head = torch.from_numpy(weight)
    if member.dtype == "bfloat16":
        head = head.to(torch.bfloat16)
    figures = {"member": member.name, "shape": list(weight.shape), "dtype": member.dtype, "domain": member.domain,
               "bias": member.bias}
    on_device = torch.from_numpy(weight).to(device)
    floor_pass(on_device[:2048])  # warm-up
    floors = [floor_pass(on_device) for _ in range(repeats)]
    figures["floor_s"] = round(min(floors), 3)
    del on_device
    with PeakMemory(device) as memory:
        started = time.perf_counter()
        report = auditor.audit(head, bias, domain=member.domain, final_norm=final_norm, device=device,
                               progress=False)
        audit_s = time.perf_counter() - started
    audits, timings = [audit_s], report.timings
    for _ in range(repeats - 1):  # the fastest run's time and stages (the first run's peak and verdicts)
        started = time.perf_counter()
        again = auditor.audit(head, bias, domain=member.domain, final_norm=final_norm, device=device,
                              progress=False)
        audits.append(time.perf_counter() - started)
        if audits[-1] < audit_s:
            audit_s, timings = audits[-1], again.timings
    figures["audit_s"] = round(audit_s, 3)
    if repeats > 1:
        figures["floor_range_s"] = [round(min(floors), 3), round(max(floors), 3)]
        figures["audit_range_s"] = [round(min(audits), 3), round(max(audits), 3)]
    figures["ratio"] = round(audit_s / figures["floor_s"], 2)
    figures["stages_s"] = {k: round(v, 3) for k, v in timings.items() if k != "total" and v >= 0.005}
    stage = np.bincount(report._d.stage.astype(np.int64), minlength=len(STAGES))
    figures["stage_tokens"] = {STAGES[i] or "none": int(c) for i, c in enumerate(stage) if c}
    figures["peak_over_head"] = round(memory.extra / (4 * weight.size), 2)  # float32 heads beyond the head
    figures["counts"] = {k: v for k, v in report.counts.items() if v}
    figures["inconclusive"] = report.counts.get("inconclusive", 0)
    wrong = {}
    for k, accepted in planted.items():
        verdict = report.tokens[k].verdict
        if verdict in ("inconclusive", "undecided") or (accepted and verdict not in accepted):
            wrong[k] = verdict
        elif accepted == {"unargmaxable", "tied"} and verdict == "tied" and report.tokens[k].group_verdict != "unargmaxable":
            wrong[k] = f"tied, the group {report.tokens[k].group_verdict}"
    figures["planted_exact"] = not wrong
    figures["planted_wrong"] = {str(k): v for k, v in list(wrong.items())[:6]}
    figures["near_mean_verdicts"] = _near_mean_verdicts(report, planted, member)
    if verify:
        started = time.perf_counter()
        result = auditor.verify(report, head, bias, final_norm=final_norm)
        figures["verify_s"] = round(time.perf_counter() - started, 2)
        figures["verified"] = bool(result.ok)
    return figures


def _near_mean_verdicts(report, planted: dict[int, set[str]], member: Member) -> dict[str, str]:
    """Per scale and kind, the verdicts of the near-mean rows (letters: a argmaxable, u unargmaxable, t tied)."""
    ids = sorted(planted)[7:]
    out = {}
    for i, s in enumerate(NEAR_SCALES):
        for j, kind in enumerate(("I", "C")):
            start = (2 * i + j) * member.near_count
            letters = "".join(report.tokens[k].verdict[0] for k in ids[start:start + member.near_count])
            out[f"{s:g} {kind}"] = letters
    return out


def summary(results: list[dict]) -> dict:
    ordered = sorted(results, key=lambda r: r["ratio"])
    middle = ordered[len(ordered) // 2]
    return {"worst": [ordered[-1]["member"], ordered[-1]["ratio"]], "median": [middle["member"], middle["ratio"]],
            "best": [ordered[0]["member"], ordered[0]["ratio"]],
            "all_planted_exact": all(r["planted_exact"] for r in results),
            "inconclusive": sum(r["inconclusive"] for r in results),
            "worst_peak_over_head": max(r["peak_over_head"] for r in results),
            "verified": [r["member"] for r in results if r.get("verified")],
            "not_verified": [r["member"] for r in results if r.get("verified") is False]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", default="32768,512", help="N,D of the base head")
    parser.add_argument("--members", help="comma-separated member names (default: all; --list shows them)")
    parser.add_argument("--skip", help="comma-separated member names to leave out")
    parser.add_argument("--list", action="store_true")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--verify", default="first", choices=("first", "all", "none"))
    parser.add_argument("--repeats", type=int, default=1,
                        help="floor passes and audits per member; the fastest of each is the figure")
    parser.add_argument("--pool-bytes", type=float, help="the memory a drawn pool may take (0: no pools)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.pool_bytes is not None:
        import auditor.engine.exact.pools as pools
        pools._POOL_BYTES = int(args.pool_bytes)
    if args.list:
        print("\n".join(m.name for m in MEMBERS))
        return
    torch.set_num_threads(args.threads)
    n, d = map(int, args.size.split(","))
    members = MEMBERS
    if args.members:
        wanted = [name.strip() for name in args.members.split(",")]
        unknown = [name for name in wanted if name not in {m.name for m in MEMBERS}]
        if unknown:
            raise SystemExit(f"unknown members {unknown}; --list shows them")
        members = [m for m in MEMBERS if m.name in wanted]
    if args.skip:
        skipped = {name.strip() for name in args.skip.split(",")}
        unknown = skipped - {m.name for m in MEMBERS}
        if unknown:
            raise SystemExit(f"unknown members {sorted(unknown)}; --list shows them")
        members = [m for m in members if m.name not in skipped]
    auditor.audit(torch.randn(2000, d), device=args.device, progress=False)  # warm-up (threads, probes)
    print(f"size {n} x {d}, {args.device}, {torch.get_num_threads()} threads; ratio = audit / one float32 W W^T pass")
    results = []
    for i, member in enumerate(members):
        verify = args.verify == "all" or (args.verify == "first" and i == 0)
        r = run_member(member, n, d, args.seed, args.device, verify, args.repeats)
        results.append(r)
        check = f" verified {r['verified']}" if "verified" in r else ""
        print(f"{r['member']:<26} {r['shape'][0]:>6} x {r['shape'][1]:<5} floor {r['floor_s']:7.2f} s  audit "
              f"{r['audit_s']:7.2f} s  {r['ratio']:5.2f}x  peak {r['peak_over_head']:.2f}  "
              f"inconclusive {r['inconclusive']}  planted {'exact' if r['planted_exact'] else r['planted_wrong']}{check}")
        print(f"{'':<26} stages {r['stages_s']}  tokens {r['stage_tokens']}")
        sys.stdout.flush()
    s = summary(results)
    print(f"worst {s['worst'][1]:.2f}x ({s['worst'][0]}), median {s['median'][1]:.2f}x ({s['median'][0]}), "
          f"best {s['best'][1]:.2f}x ({s['best'][0]}); planted exact: {s['all_planted_exact']}, inconclusive "
          f"{s['inconclusive']}, peak {s['worst_peak_over_head']:.2f} float32 heads beyond the head")
    if args.json:
        print(json.dumps({"size": [n, d], "threads": torch.get_num_threads(), "members": results, "summary": s}))


if __name__ == "__main__":
    main()
