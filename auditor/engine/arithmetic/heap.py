"""Handing the heap's free pages back to the operating system between the audit's stages.

glibc serves blocks below its mmap threshold from its heap, and that threshold
rises (up to 32 MiB) each time a larger mapped block is freed; the stages' blocks
of rows (tens of MiB) then come from the heap, and once freed they stay in the
resident set until the heap is trimmed: about 100 MiB at 128256 x 4096, there
under the later stages' own arrays. ``malloc_trim(0)`` returns every free page.
Elsewhere (another C library, another system) this does nothing.
"""

from __future__ import annotations

import ctypes
import functools
import sys


@functools.cache
def _malloc_trim():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc's; musl and others have none
    except (OSError, AttributeError):
        return None


def release_free_pages() -> None:
    """malloc_trim(0) where the C library has it; a few milliseconds."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
