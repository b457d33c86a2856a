"""Training checkpoints: the state dict inside the wrappers people save it in, and dotted paths into them.

``torch.save`` of a training run rarely writes a bare state dict. It writes
``{"model_state_dict": ..., "optimizer_state_dict": ..., "epoch": ...}``, or
Lightning's ``{"state_dict": {"model.fc.weight": ...}, "optimizer_states": [...]}``,
or DeepSpeed's ``{"module": ...}``. The state dict is found under the known
wrapper keys; any tensor of the checkpoint can also be named by the dotted path
of keys that leads to it (``model_state_dict.fc.weight``). Optimizer state is
never walked: its moments have the head's shape, and auditing them would be
auditing the wrong matrix.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import torch

from auditor.errors import InputError

# Looked for in this order, and again inside what they hold ({"model": {"module": {...}}}).
WRAPPERS = ("model_state_dict", "state_dict", "model", "module")
# Keys only a Lightning checkpoint has beside its state_dict, whose names carry the module's attribute.
_LIGHTNING_KEYS = ("pytorch-lightning_version", "optimizer_states", "lr_schedulers", "loops")
_LIGHTNING_PREFIX = "model."
# Optimizer, scheduler and gradient-scaler state, by the names trainers give it.
_OPTIMIZER_KEY = re.compile(r"optim|sched|scaler", re.IGNORECASE)
_MAX_DEPTH = 8  # wrappers nest a few levels at most; a deeper tree is not a checkpoint's


@dataclass(frozen=True)
class StateDict:
    """The tensors of one dict of a checkpoint, by the names the loader chooses the head from."""

    where: tuple[str, ...]  # the keys leading to it from the top; () for a bare state dict
    tensors: dict[str, torch.Tensor]
    prefix: str = ""  # taken off every key (Lightning's "model.")
    named_from_top: bool = False  # names carry the dotted path of ``where`` (a dict named by --weight)

    def describe(self) -> str | None:
        """Where the tensors came from, for the head's notes; None for a bare state dict."""
        if not self.where:
            return None
        place = "checkpoint" + "".join(f"[{key!r}]" for key in self.where)
        stripped = f", with the prefix {self.prefix!r} taken off its names (a PyTorch Lightning checkpoint)" \
            if self.prefix else ""
        return f"the head was read from {place}{stripped}; optimizer state, if any, was not read"


def is_optimizer_state(key, value) -> bool:
    """Whether ``key: value`` of a checkpoint is optimizer (or scheduler) state, which is never read."""
    named = isinstance(key, str) and _OPTIMIZER_KEY.search(key) is not None
    return named or (isinstance(value, Mapping) and "param_groups" in value)


def _tensors_of(node: Mapping) -> dict[str, torch.Tensor]:
    return {key: value for key, value in node.items() if isinstance(key, str) and isinstance(value, torch.Tensor)}


def find_state_dict(checkpoint) -> StateDict | None:
    """The state dict of a loaded checkpoint: under the first wrapper key that leads to tensors, else the
    top level's own tensors; None when neither holds any."""
    if not isinstance(checkpoint, Mapping):
        return None
    found = _unwrap(checkpoint, ())
    if found is None:
        return None
    where, tensors = found
    prefix = ""
    lightning = where == ("state_dict",) and any(key in checkpoint for key in _LIGHTNING_KEYS)
    if lightning and all(name.startswith(_LIGHTNING_PREFIX) for name in tensors):
        prefix = _LIGHTNING_PREFIX
        tensors = {name[len(prefix):]: tensor for name, tensor in tensors.items()}
    return StateDict(where, tensors, prefix)


def _unwrap(node: Mapping, where: tuple[str, ...]) -> tuple[tuple[str, ...], dict[str, torch.Tensor]] | None:
    if len(where) < _MAX_DEPTH:
        for key in WRAPPERS:
            inner = node.get(key)
            if isinstance(inner, Mapping) and not is_optimizer_state(key, inner):
                found = _unwrap(inner, (*where, key))
                if found is not None:
                    return found
    tensors = _tensors_of(node)
    return (where, tensors) if tensors else None


def holders(checkpoint) -> Iterator[tuple[tuple[str, ...], int]]:
    """Every dict of the checkpoint that holds tensors, outside optimizer state: (its keys, how many)."""
    def walk(node: Mapping, where: tuple[str, ...]):
        count = len(_tensors_of(node))
        if count:
            yield where, count
        if len(where) < _MAX_DEPTH:
            for key, value in node.items():
                if isinstance(key, str) and isinstance(value, Mapping) and not is_optimizer_state(key, value):
                    yield from walk(value, (*where, key))

    if isinstance(checkpoint, Mapping):
        yield from walk(checkpoint, ())


def locate(checkpoint, dotted: str, where_named: str) -> tuple[tuple[str, ...], str] | None:
    """The dict holding the tensor at the dotted path ``dotted`` (its keys from the top) and the tensor's
    key in it; None when no path of keys spells ``dotted``. Keys may hold dots themselves ("fc.weight"),
    so every split is tried. Raises InputError when the path leads into optimizer state, or when two
    tensors have the same dotted path."""
    found, optimizer = [], []

    def walk(node: Mapping, rest: str, where: tuple[str, ...]):
        for key, value in node.items():
            if not isinstance(key, str):
                continue
            if rest == key and isinstance(value, torch.Tensor):
                found.append((where, key))
            elif rest.startswith(key + ".") and isinstance(value, Mapping) and len(where) < _MAX_DEPTH:
                if is_optimizer_state(key, value):
                    optimizer.append(".".join((*where, key)))
                else:
                    walk(value, rest[len(key) + 1:], (*where, key))

    if isinstance(checkpoint, Mapping):
        walk(checkpoint, dotted, ())
    if len(found) > 1:
        spelled = " and ".join("checkpoint" + "".join(f"[{k!r}]" for k in (*w, key)) for w, key in found[:2])
        raise InputError(f"{where_named}: {dotted!r} names two tensors ({spelled}); the auditor cannot tell "
                         "which is meant: save the head's tensors on their own")
    if not found and optimizer:
        raise InputError(f"{where_named}: {dotted!r} is inside {optimizer[0]!r}, optimizer state, which the "
                         "auditor never reads: name a tensor of the model")
    return found[0] if found else None


def state_dict_at(checkpoint, where: tuple[str, ...]) -> StateDict:
    """The tensors of the dict at ``where``, named by their dotted paths from the top of the checkpoint."""
    node = checkpoint
    for key in where:
        node = node[key]
    dotted = ".".join(where)
    return StateDict(where, {f"{dotted}.{key}" if dotted else key: tensor
                             for key, tensor in _tensors_of(node).items()}, named_from_top=True)
