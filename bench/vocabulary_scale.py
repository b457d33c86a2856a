"""Audit time at real vocabulary shapes against the floor of any exact audit.

    python bench/vocabulary_scale.py [--shape gpt2|llama3|gemma2|N,D] [--width D] [--dtype float32|bfloat16]
                                     [--device cpu|cuda] [--lp-tokens 2] [--verify] [--json]

Builds a synthetic head of the given shape that is anisotropic the way trained
heads are, plants rows whose verdicts are known, and prints in one run:

- the floor: one float32 W W^T pass with a per-row top-2, on the same device
  (blocks of rows times W^T into a reused block: the layout any exact audit
  needs, since every token must be compared with every other);
- the audit's total and per-stage times, the ratio to the floor;
- peak memory during the audit beyond what was held before it, next to the
  head's own size (CPU: resident set sampled every 2 ms; CUDA: the allocator's peak);
- whether every planted verdict came out exactly, and the verdict counts;
- the per-token exact LP baseline: one HiGHS LP over all rows per token, timed
  on ``--lp-tokens`` tokens and extrapolated to the vocabulary.

``--json`` ends the output with one JSON line of these figures.

The head. Rows are c + s_i L g_i with g_i standard normal, L a random rotation
times a spectrum decaying like rank^-0.68 (the slope fitted to the covariance of
the real all-MiniLM-L6-v2 embeddings), s_i log-normal with sigma 0.29 (that
head's spread of row norms) and c a common offset two standard deviations
long along the leading direction. Planted, about 0.1 % of the rows in all, as
the fine-tuning tools and the released checkpoints leave them:

- reserved rows at the end of the original vocabulary: rows left at zero (a
  group of identical rows: tied, and the group unargmaxable, the origin lying
  inside the cloud) and rows near zero, 2^-10 times an earlier row (a shrunk
  copy: unargmaxable);
- added tokens appended after them, initialised from the old rows (reserved rows
  included) as the tools do: N(mean, 1e-9 cov) as ``resize_token_embeddings``
  makes them (unargmaxable); the exact mean, several rows of it (tied, the
  group unargmaxable); the mean plus N(0, 1/sqrt(d)) noise per coordinate as
  LlamaFactory's noisy mean makes them (argmaxable here: the noise reaches the
  directions the cloud is thin in, so the row leads at z = cov^-1 (w_k - mean),
  which the bench checks itself in float64 before it plants that verdict);
- rows copied bit for bit from earlier rows: both copies tied;
- rows swallowed by a slightly longer copy of themselves, w_j = 1.01 w_k:
  the origin lies inside the cloud, so w_k = (w_j + 0.01 * 0) / 1.01 is a convex
  combination of the others: unargmaxable.

``--dtype bfloat16`` audits the head as a bfloat16 checkpoint holds it: every
row rounded to bfloat16 (the tools' new rows computed in float32 and then
stored, as they are in a bfloat16 model), the audit given the bfloat16 tensor
itself. Rounding would move a swallowed row's copy by about 2^-9 of its length,
more than the 1 % that swallows it, so there the copy is w_j = 2 w_k, exact in
any binary format; the noisy-mean rows are checked after the rounding.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import numpy as np
import torch

import auditor

SHAPES = {"gpt2": (50257, 768), "llama3": (128256, 4096), "gemma2": (256000, 2304)}


def make_head(n: int, d: int, seed: int = 0, dtype: str = "float32"):
    """The synthetic head (float32, n x d; with ``dtype`` bfloat16 its values rounded to bfloat16), the planted
    verdicts {id: verdict} and, for the tied groups whose verdict as a group is known, {id: group verdict}."""
    rng = np.random.default_rng(seed)
    planted_total = max(16, n // 1000)
    n_zero = n_small = n_exact = max(2, planted_total // 16)
    n_mean = planted_total // 4
    n_noisy = n_swallow = n_copy = max(2, planted_total // 8)  # n_copy pairs
    n_added = n_mean + n_exact + n_noisy
    base = n - n_added - n_zero - n_small  # the trained rows; reserved rows follow them, added tokens come last
    spectrum = np.arange(1, d + 1, dtype=np.float64) ** -0.68
    spectrum *= 1.0 / spectrum.sum()  # total variance 1
    rotation, _ = np.linalg.qr(rng.standard_normal((d, d)))
    mixing = (rotation * np.sqrt(spectrum)).T.astype(np.float32)  # rows of g @ mixing have that covariance
    offset = (2.0 * np.sqrt(spectrum[0]) * rotation[:, 0]).astype(np.float32)
    weight = np.empty((n, d), dtype=np.float32)
    for s in range(0, base, 8192):
        e = min(base, s + 8192)
        g = rng.standard_normal((e - s, d), dtype=np.float32)
        scale = np.exp(0.29 * rng.standard_normal((e - s, 1))).astype(np.float32)
        weight[s:e] = offset + scale * (g @ mixing)
    planted, groups = {}, {}
    slots = rng.choice(base // 2, size=n_copy + 2 * n_swallow + n_small, replace=False)
    for j in range(n_copy):  # a later row becomes a copy of an earlier one
        a, b = int(slots[j]), int(slots[j] + base // 2)
        weight[b] = weight[a]
        planted[a] = planted[b] = "tied"
    for j in range(n_swallow):
        k = int(slots[n_copy + 2 * j])
        longer = int(slots[n_copy + 2 * j + 1] + base // 2)
        weight[longer] = np.float32(1.01 if dtype == "float32" else 2.0) * weight[k]
        planted[k] = "unargmaxable"
    reserved = base
    weight[reserved:reserved + n_zero] = 0.0
    for k in range(reserved, reserved + n_zero):
        planted[k], groups[k] = "tied", "unargmaxable"
    for j, k in enumerate(range(reserved + n_zero, reserved + n_zero + n_small)):
        weight[k] = np.float32(2.0**-10) * weight[int(slots[n_copy + 2 * n_swallow + j])]  # exact: a power of two
        planted[k] = "unargmaxable"

    old = n - n_added  # the rows the tools initialise from: every row before the added ones
    mean = np.zeros(d)
    for s in range(0, old, 8192):
        mean += weight[s:s + 8192].astype(np.float64).sum(axis=0)
    mean /= old
    covariance = np.zeros((d, d))
    for s in range(0, old, 8192):
        centred = weight[s:s + 8192].astype(np.float64) - mean
        covariance += centred.T @ centred
    covariance /= old
    added = old
    noise = rng.multivariate_normal(np.zeros(d), 1e-9 * covariance, size=n_mean)
    weight[added:added + n_mean] = (mean + noise).astype(np.float32)
    for k in range(added, added + n_mean):
        planted[k] = "unargmaxable"
    added += n_mean
    weight[added:added + n_exact] = mean.astype(np.float32)
    for k in range(added, added + n_exact):
        planted[k], groups[k] = "tied", "unargmaxable"
    added += n_exact
    noisy = np.arange(added, added + n_noisy)
    weight[noisy] = (mean + rng.normal(0.0, 1.0 / np.sqrt(d), size=(n_noisy, d))).astype(np.float32)
    if dtype == "bfloat16":  # the head as a bfloat16 checkpoint stores it, by blocks of rows
        for s in range(0, n, 8192):
            weight[s:s + 8192] = torch.from_numpy(weight[s:s + 8192]).to(torch.bfloat16).float().numpy()
    if not all(_leads(weight, noisy, covariance)):
        raise SystemExit("a noisy-mean row does not lead at its own direction: pick another --seed")
    for k in noisy.tolist():
        planted[k] = "argmaxable"
    return weight, planted, groups


def _leads(weight: np.ndarray, ids: np.ndarray, covariance: np.ndarray) -> list[bool]:
    """Whether row k leads every other row at z_k = cov^-1 (w_k - mean) by more than 1e-6 of the logits'
    size, in float64 (exact products of float32 entries, summed with an error far below that margin)."""
    rows = weight[ids].astype(np.float64)
    mean = weight.astype(np.float64).mean(axis=0) if weight.shape[0] <= 8192 else None
    if mean is None:
        mean = np.zeros(weight.shape[1])
        for s in range(0, weight.shape[0], 8192):
            mean += weight[s:s + 8192].astype(np.float64).sum(axis=0)
        mean /= weight.shape[0]
    z = np.linalg.solve(covariance, (rows - mean).T)  # d x r
    logits = np.empty((weight.shape[0], ids.size))
    for s in range(0, weight.shape[0], 8192):
        logits[s:s + 8192] = weight[s:s + 8192].astype(np.float64) @ z
    own = logits[ids, np.arange(ids.size)]
    logits[ids, np.arange(ids.size)] = -np.inf
    size = np.abs(weight).max() * np.abs(z).sum(axis=0)
    return [bool(o - r > 1e-6 * t) for o, r, t in zip(own, logits.max(axis=0), size)]


def floor_pass(weight: torch.Tensor, chunk: int = 1024) -> float:
    """One float32 W W^T pass in blocks of rows into a reused block, with a per-row top-2."""
    w = weight.float()
    block = torch.empty(chunk, w.shape[0], dtype=torch.float32, device=w.device)
    if w.is_cuda:
        torch.cuda.synchronize()
    started = time.perf_counter()
    for s in range(0, w.shape[0], chunk):
        rows = min(chunk, w.shape[0] - s)
        torch.matmul(w[s:s + rows], w.T, out=block[:rows])
        torch.topk(block[:rows], 2, dim=1)
    if w.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - started


class PeakMemory:
    """Peak memory beyond the level at entry: resident set on CPU, allocator peak on CUDA."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.peak = 0

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _sample(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self._rss())
            time.sleep(0.002)

    def __enter__(self):
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
        else:
            self.base = self.peak = self._rss()
            self._stop = threading.Event()
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc):
        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated()
        else:
            self._stop.set()
            self._thread.join()
            self.peak = max(self.peak, self._rss())
        self.extra = self.peak - self.base


def lp_baseline(weight: np.ndarray, ids, time_limit: float) -> list[float]:
    """Seconds per token of the plain exact LP over all rows (HiGHS): is w_k in the hull of the others?

    Variables alpha_i >= 0 over the other rows with sum alpha_i w_i = w_k and
    sum alpha_i = 1; feasible iff k is unargmaxable (no bias, unbounded domain).
    """
    import scipy.optimize
    import scipy.sparse

    w = weight.astype(np.float64)
    seconds = []
    finished = lp_baseline.finished = []
    for k in ids:
        others = np.delete(np.arange(w.shape[0]), k)
        a_eq = np.vstack([w[others].T, np.ones((1, others.size))])
        b_eq = np.concatenate([w[k], [1.0]])
        started = time.perf_counter()
        result = scipy.optimize.linprog(np.zeros(others.size), A_eq=a_eq, b_eq=b_eq, bounds=(0, None),
                                        method="highs", options={"time_limit": time_limit})
        seconds.append(time.perf_counter() - started)
        finished.append(result.status in (0, 2))  # solved: feasible (inside) or infeasible (a vertex)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="gpt2", help="gpt2, llama3, gemma2 or N,D")
    parser.add_argument("--width", type=int, help="the shape's vocabulary at this hidden width (llama3 at 1024: about "
                        "18 minutes on 2 CPU cores)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lp-tokens", type=int, default=2, help="tokens to time the per-token LP on (0: skip)")
    parser.add_argument("--lp-time-limit", type=float, default=1800.0)
    parser.add_argument("--verify", action="store_true", help="also re-check every certificate with auditor.verify")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    n, d = SHAPES[args.shape] if args.shape in SHAPES else map(int, args.shape.split(","))
    d = args.width or d

    started = time.perf_counter()
    weight, planted, groups = make_head(n, d, args.seed, args.dtype)
    build_s = time.perf_counter() - started
    head = torch.from_numpy(weight)
    if args.dtype == "bfloat16":  # exact: the values are bfloat16 ones already; ``weight`` stays for the oracles
        head = head.to(torch.bfloat16)
    head_bytes = head.numel() * head.element_size()
    figures = {"shape": [n, d], "dtype": args.dtype, "device": args.device, "threads": torch.get_num_threads(),
               "head_bytes": head_bytes, "planted": len(planted), "build_s": round(build_s, 2)}

    device_head = head.to(args.device)
    floor_pass(device_head[:2048])  # warm-up
    figures["floor_s"] = round(floor_pass(device_head), 3)
    del device_head
    auditor.audit(head[:2000], device=args.device, progress=False)  # warm-up (threads, CUDA context)

    with PeakMemory(args.device) as memory:
        started = time.perf_counter()
        report = auditor.audit(head, device=args.device, progress=not args.json)
        audit_s = time.perf_counter() - started
    figures["audit_s"] = round(audit_s, 3)
    figures["stages_s"] = {k: round(v, 3) for k, v in report.timings.items() if k != "total"}
    figures["ratio_to_floor"] = round(audit_s / figures["floor_s"], 2)
    figures["peak_extra_bytes"] = memory.extra
    figures["peak_extra_over_head"] = round(memory.extra / head_bytes, 2)
    figures["counts"] = {k: v for k, v in report.counts.items() if v}
    wrong = {k: report.tokens[k].verdict for k, want in planted.items() if report.tokens[k].verdict != want}
    wrong.update({k: f"tied, the group {report.tokens[k].group_verdict}" for k, want in groups.items()
                  if k not in wrong and report.tokens[k].group_verdict != want})
    unplanted = [k for k in report.ids("unargmaxable") + report.ids("tied") + report.ids("inconclusive")
                 if k not in planted]
    figures["planted_exact"] = not wrong and not unplanted and report.counts.get("inconclusive", 0) == 0
    figures["planted_wrong"] = {str(k): v for k, v in list(wrong.items())[:10]}
    figures["unplanted_not_argmaxable"] = unplanted[:10]
    if args.verify:
        started = time.perf_counter()
        result = auditor.verify(report, head)
        figures["verify_s"] = round(time.perf_counter() - started, 2)
        figures["verified"] = bool(result.ok and result.tokens == n)  # every token's certificate holds
        figures["verify_failed"] = result.failed[:10]

    if args.lp_tokens:
        rng = np.random.default_rng(1)
        sample = rng.choice(n, size=args.lp_tokens, replace=False)
        per_token = lp_baseline(weight, sample, args.lp_time_limit)
        figures["lp_per_token_s"] = [round(s, 2) for s in per_token]
        figures["lp_vocabulary_s"] = round(float(np.mean(per_token)) * n, 1)
        figures["speedup_over_lp"] = round(figures["lp_vocabulary_s"] / audit_s, 1)
        figures["lp_all_finished"] = all(lp_baseline.finished)  # False: hit the time limit, a lower bound

    print(f"head       {n} x {d} {args.dtype}, {head_bytes / 2**20:.0f} MiB, {len(planted)} planted rows "
          f"(built in {build_s:.1f} s)")
    print(f"device     {args.device}, {figures['threads']} threads")
    print(f"floor      {figures['floor_s']:.2f} s  (one float32 W W^T pass, per-row top-2)")
    print(f"audit      {audit_s:.2f} s  = {figures['ratio_to_floor']:.2f} x floor")
    print("stages     " + ", ".join(f"{k} {v:.2f}" for k, v in figures["stages_s"].items()))
    print(f"memory     peak {memory.extra / 2**20:.0f} MiB beyond the head = {figures['peak_extra_over_head']:.2f} "
          f"x its size")
    print(f"verdicts   {figures['counts']}")
    print(f"planted    exact: {figures['planted_exact']}"
          + (f"  wrong {figures['planted_wrong']}" if wrong else "")
          + (f"  unplanted findings {unplanted[:10]}" if unplanted else ""))
    if args.verify:
        print(f"verify     {figures['verify_s']:.2f} s, every certificate re-checked: {figures['verified']}")
    if args.lp_tokens:
        bound = "" if figures["lp_all_finished"] else "at least "
        print(f"LP         {bound}{', '.join(f'{s:.1f}' for s in figures['lp_per_token_s'])} s per token (HiGHS, all rows)"
              f" -> {figures['lp_vocabulary_s']:.0f} s for the vocabulary = {figures['speedup_over_lp']:.0f} x the audit")
    if args.json:
        print(json.dumps(figures))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
