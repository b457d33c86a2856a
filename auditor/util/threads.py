"""How many CPU threads torch may use during an audit, and putting that number back afterwards.

Two audits that each take every core of a shared machine slow each other down
far more than twice (docs/performance.md gives the figures). ``threads=`` /
``--threads N`` caps one audit; without it the ``OMP_NUM_THREADS`` convention
applies, else torch's own default.

numpy's and scipy's own BLAS libraries run on one thread during an audit. The
heavy passes are torch's; numpy and scipy get the small dense problems (pools,
bases, eliminations), which gain little from a second thread, and an OpenBLAS
thread that waits for work spins on a core torch's threads need
(bench/blas_threads.py measures what that costs; docs/performance.md, "numpy's
BLAS threads").
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
from threadpoolctl import ThreadpoolController

from auditor.errors import InputError

_controller: ThreadpoolController | None = None


def resolve_threads(threads: int | None) -> int:
    """The thread count to use: ``threads``, else OMP_NUM_THREADS when set, else torch's current one.

    Raises InputError for anything but a positive integer (in either place).
    """
    if threads is not None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise InputError(f"threads must be a positive integer, got {threads!r}")
        return threads
    setting = os.environ.get("OMP_NUM_THREADS")
    if setting is None or not setting.strip():
        return torch.get_num_threads()
    try:
        count = int(setting.strip())
    except ValueError:
        count = 0
    if count < 1:
        raise InputError(f"OMP_NUM_THREADS={setting!r} is not a positive integer; set it to one (or unset it), "
                         "or pass the thread count explicitly")
    return count


@contextlib.contextmanager
def torch_threads(count: int):
    """torch.set_num_threads(count) inside the block; the previous value is restored on the way out."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        with _own_blas().limit(limits=1):
            yield count
    finally:
        torch.set_num_threads(previous)


def _own_blas() -> ThreadpoolController:
    """The BLAS libraries loaded in this process other than torch's (numpy's and scipy's OpenBLAS), found
    once: torch's, where it loads one, follows torch.set_num_threads."""
    global _controller
    if _controller is None:
        own = os.path.dirname(torch.__file__)
        found = ThreadpoolController().select(user_api="blas")
        _controller = found.select(filepath=[c.filepath for c in found.lib_controllers
                                             if not os.path.realpath(c.filepath).startswith(os.path.realpath(own))])
    return _controller


def applying_threads(audit):
    """Run ``audit`` with its keyword ``threads`` resolved and applied (see resolve_threads).

    A decorator, so that the audit's own body stays as it is; the audit reads the
    count in effect with torch.get_num_threads() when it builds its report.
    """
    @functools.wraps(audit)
    def wrapper(*args, **kwargs):
        count = resolve_threads(kwargs.get("threads"))
        with torch_threads(count):
            return audit(*args, **kwargs)
    return wrapper
