"""torchrun: one audit split over the ranks of a process group, one report.

    torchrun --nproc-per-node 4 -m auditor model/ --format json --output report.json
    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 8 --master-addr HOST --master-port 29500 -m auditor model/ ...

Every rank loads the head and decides the blocks of token ids it claims
(auditor/runs/blocks.py); rank 0 gathers the parts, merges them and writes the one
report. The ranks meet three times, in this order, whatever happens on any of
them, so that no rank waits for a meeting another has skipped:

1. ready    after loading, before deciding: rank 0's plan reaches every rank; a
            rank that failed (say, the checkpoint is missing on its node) stops
            all of them here, before any work is done.
2. collect  each rank's decided parts, or its error, go to rank 0.
3. finish   rank 0's exit code goes to every rank.

A rank that fails between 1 and 2 also sets a flag in the rendezvous store, so
the others stop after their current block rather than finish their share.
Only rank 0 prints (``audit: error: rank R: ...``), and every rank exits with
the same code. Every wait is bounded by ``--dist-timeout``, the process
group's timeout: it must exceed the time one block takes, since a rank that is
done waits at the next meeting for the others' last blocks.

The object exchanges run over gloo. With CUDA each rank uses ``cuda:LOCAL_RANK``
and the default group is NCCL, so the exchanges get a gloo group of their own
(NCCL's object collectives would need tensors on the GPU).
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from dataclasses import dataclass
from datetime import timedelta

from auditor.errors import EXIT_ERROR, AuditorError

DEFAULT_TIMEOUT_S = 1800.0

_OK, _ERROR, _EXIT, _STOPPED = "ok", "error", "exit", "stopped"


@dataclass(frozen=True)
class Launch:
    """Where this process stands in a torchrun launch, as the environment says."""

    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_environment(cls) -> Launch | None:
        """The launch torchrun describes (WORLD_SIZE > 1, RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), or None
        for a plain run."""
        environment = os.environ
        try:
            world = int(environment.get("WORLD_SIZE", "1"))
            rank = int(environment["RANK"])
            local = int(environment.get("LOCAL_RANK", "0"))
        except (KeyError, ValueError):
            return None
        if world <= 1 or not environment.get("MASTER_ADDR") or not environment.get("MASTER_PORT"):
            return None
        return cls(rank, world, local)


class RanksFailed(AuditorError):
    """A rank failed and rank 0 knows it; the message names the rank (``rank 1: ...``)."""


class Agreed(Exception):
    """Every rank knows the outcome of meeting 1 and ends with it: ``code``, and ``message`` for rank 0 to print."""

    def __init__(self, code: int, message: str | None):
        super().__init__(message)
        self.code, self.message = code, message


class Halted(Exception):
    """Another rank failed: this one stopped after its current block."""


class LostRanks(Exception):
    """A meeting itself failed (a rank died, or did not come within --dist-timeout): no further meeting can
    be held, so each rank says so for itself and exits 2."""


@contextlib.contextmanager
def _meeting():
    try:
        yield
    except Exception as error:
        raise LostRanks(str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__) \
            from error


class Ranks:
    """This process's rank in the audit, and the three meetings of the ranks (see the module's docstring)."""

    def __init__(self, launch: Launch, store, group):
        self.rank, self.world_size = launch.rank, launch.world_size
        self._store = store  # the rendezvous store, under a prefix of our own: block claims and the failure flag
        self._group = group  # gloo: the object exchanges
        self.met = 0  # how many meetings this rank has been to

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @classmethod
    def join(cls, launch: Launch, device: str, timeout: timedelta) -> Ranks:
        """Rendezvous with the other ranks (torchrun's env:// variables) and start the process group."""
        import torch
        import torch.distributed as dist

        cuda = device != "cpu" and torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(launch.local_rank)  # "cuda" and "auto" then mean this rank's GPU
        store, _, _ = next(dist.rendezvous("env://", rank=launch.rank, world_size=launch.world_size,
                                           timeout=timeout))
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=launch.rank,
                                world_size=launch.world_size, timeout=timeout)
        group = dist.new_group(backend="gloo", timeout=timeout) if cuda else dist.group.WORLD
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # keys of a restarted run start afresh
        return cls(launch, dist.PrefixStore(f"auditor/{attempt}/", store), group)

    def leave(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    # -- the three meetings ----------------------------------------------------------------------

    def ready(self, plan=None, identity: str | None = None):
        """Meeting 1, on the way to deciding: returns rank 0's ``plan``; raises Agreed on every rank when
        any rank failed before it, or when a rank's ``identity`` (a digest of the head it loaded and of its
        settings) is not rank 0's: ranks on nodes that hold different files must not merge their halves."""
        payloads = self.meet_ready((_OK, (plan, identity)))
        for rank, (_, theirs) in enumerate(payloads):
            if theirs != payloads[0][1]:
                raise Agreed(EXIT_ERROR, f"rank {rank}: it loaded another head (or the same from another path), or read other settings, than "
                                         "rank 0 (every node must hold the same checkpoint and files)")
        return payloads[0][0]

    def collect(self, parts):
        """Meeting 2, the work done: rank 0 gets every rank's ``parts`` as a list (others get None). Rank 0
        raises RanksFailed when a rank failed."""
        statuses = self.meet_collect((_OK, parts))
        if statuses is None:
            return None
        code, message = _outcome(statuses)
        if message is not None:
            raise RanksFailed(message)
        return [payload for _, payload in statuses]

    def finish(self, code: int) -> int:
        """Meeting 3: every rank returns rank 0's exit code."""
        import torch.distributed as dist

        self.met = 3
        box = [code if self.is_root else None]
        with _meeting():
            dist.broadcast_object_list(box, src=0, group=self._group)
        return int(box[0])

    def meet_ready(self, status):
        import torch.distributed as dist

        self.met = 1
        statuses = [None] * self.world_size
        with _meeting():
            dist.all_gather_object(statuses, status, group=self._group)
        if all(kind == _OK for kind, _ in statuses):
            return [payload for _, payload in statuses]
        raise Agreed(*_outcome(statuses))

    def meet_collect(self, status):
        import torch.distributed as dist

        self.met = 2
        statuses = [None] * self.world_size if self.is_root else None
        with _meeting():
            dist.gather_object(status, statuses, dst=0, group=self._group)
        return statuses

    # -- between meetings: sharing the blocks, and stopping early --------------------------------

    def claim(self) -> int:
        """The next unclaimed index of the plan's blocks (0, 1, 2, ... over all ranks): a rank that is done
        takes the next block, so the ranks finish within one block of each other."""
        return int(self._store.add("next-block", 1)) - 1

    def raise_flag(self) -> None:
        self._store.set("failed", "1")

    def halted(self) -> bool:
        """Whether another rank has failed (then this one should stop)."""
        return self._store.check(["failed"])


def _outcome(statuses: list) -> tuple[int, str | None]:
    """The exit code and rank 0's error line (None when there is no error) from every rank's status; errors
    win over stops."""
    if all(kind == _OK for kind, _ in statuses):
        return 0, None
    errors = [(rank, detail) for rank, (kind, detail) in enumerate(statuses) if kind == _ERROR]
    if errors:
        if len(errors) == len(statuses) and len({detail for _, detail in errors}) == 1:
            return EXIT_ERROR, errors[0][1]  # the same on every rank (a bad path): said once, with no rank
        rank, detail = errors[0]
        return EXIT_ERROR, f"rank {rank}: {detail}"
    codes = {detail for kind, detail in statuses if kind == _EXIT}
    if all(kind == _EXIT for kind, _ in statuses) and len(codes) == 1:
        return codes.pop(), None  # every rank ended before the audit alike (such as --list-tensors)
    stopped = [rank for rank, (kind, _) in enumerate(statuses) if kind != _OK]
    return EXIT_ERROR, f"rank {stopped[0]}: ended before the audit while others went on"


def run_on_ranks(prog: str, run, args) -> int:
    """``run(args)`` on this rank of a torchrun launch, ending alike on every rank (see the docstring)."""
    launch = Launch.from_environment()
    try:
        ranks = Ranks.join(launch, args.device, timedelta(seconds=args.dist_timeout))
    except Exception as error:  # no process group, so nothing to agree on: each rank says why
        if args.debug:
            traceback.print_exc()
        print(f"{prog}: error: rank {launch.rank}: cannot join the other ranks ({error})", file=sys.stderr)
        return EXIT_ERROR
    args.ranks = ranks
    try:
        return _conclude(prog, run, args, ranks)
    finally:
        ranks.leave()


def _conclude(prog: str, run, args, ranks: Ranks) -> int:
    failure = None
    status = None
    try:
        code = run(args)
        status = (_EXIT, code)
    except LostRanks as error:
        return _lost(prog, ranks, error)
    except Agreed as outcome:  # every rank knows: nothing more to meet for
        if ranks.is_root and outcome.message:
            print(f"{prog}: error: {outcome.message}", file=sys.stderr)
        return outcome.code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_ERROR
    except Halted:
        code, status = EXIT_ERROR, (_STOPPED, None)
    except Exception as error:
        if args.debug:
            traceback.print_exc()
        failure = str(error) if isinstance(error, AuditorError) else f"{type(error).__name__}: {error}"
        code, status = EXIT_ERROR, (_ERROR, failure)
        if not isinstance(error, RanksFailed):
            try:
                ranks.raise_flag()  # the others stop after their current block
            except Exception:  # the store is gone with rank 0: the meeting below says so
                pass
    try:
        if ranks.met == 0:  # this rank ended before meeting 1: tell the others there
            ranks.meet_ready(status)
        if ranks.met == 1:  # it failed while deciding: send the error in place of its parts
            statuses = ranks.meet_collect(status)
            if statuses is not None:
                code, failure = _outcome(statuses)
        if ranks.is_root and failure is not None:
            print(f"{prog}: error: {failure}", file=sys.stderr)
        return ranks.finish(EXIT_ERROR if failure is not None else code)
    except Agreed as outcome:
        if ranks.is_root and outcome.message:
            print(f"{prog}: error: {outcome.message}", file=sys.stderr)
        return outcome.code
    except LostRanks as error:
        return _lost(prog, ranks, error)


def _lost(prog: str, ranks: Ranks, error: LostRanks) -> int:
    print(f"{prog}: error: rank {ranks.rank}: lost the other ranks ({error}); see --dist-timeout", file=sys.stderr)
    return EXIT_ERROR
