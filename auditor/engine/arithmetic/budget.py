"""How much working memory a stage's batch may take on the head's device.

On the CPU the audit keeps to fixed budgets, sized to the one-head memory target (docs/performance.md). On a
GPU the batches size themselves to the memory the device reports free (``torch.cuda.mem_get_info``): a quarter
of it, so that a large GPU takes whole stages in a few batches and a small one still fits, never below the
CPU's budget.
"""

from __future__ import annotations

import torch

_FREE_SHARE = 4  # a batch takes at most this fraction (1 / _FREE_SHARE) of the device's free memory


def working_bytes(device: torch.device | str, default: int) -> int:
    """The bytes a batch may take on ``device``: ``default`` on the CPU; on CUDA a quarter of the free memory,
    at least ``default``."""
    device = torch.device(device)
    if device.type != "cuda":
        return default
    free, _ = torch.cuda.mem_get_info(device)
    return max(default, free // _FREE_SHARE)


def batch_count(device: torch.device | str, default_bytes: int, item_bytes: int, most: int) -> int:
    """Items of ``item_bytes`` each that one batch takes: as many as ``working_bytes`` holds, between 1 and
    ``most``."""
    return max(1, min(most, working_bytes(device, default_bytes) // max(item_bytes, 1)))
