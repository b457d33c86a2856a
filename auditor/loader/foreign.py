"""Other frameworks' model files, told apart by their first bytes, each with what to do instead.

The auditor reads none of these. Naming the format (rather than saying "unreadable",
or handing the bytes to torch.load, whose refusal advises an unsafe retry) tells
people at once that the file is fine but the wrong kind, and where the head they
want lives. Each recogniser looks at the first bytes only and is specific enough
not to claim a checkpoint the auditor does read.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Foreign:
    """A known format the auditor does not read."""

    what: str  # "a TensorFlow SavedModel"
    advice: str  # what to audit instead, one clause


_FROM_SOURCE = "audit the PyTorch or safetensors checkpoint it was converted from"
_KERAS = ("audit the PyTorch or safetensors checkpoint of the same model, or save the output layer's kernel, "
          "transposed to vocabulary x hidden, with numpy.save and audit the .npy")
_HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
# llama.cpp and whisper.cpp before GGUF: a little-endian uint32 magic.
_GGML_MAGICS = {b"lmgg": "ggml", b"fmgg": "ggmf", b"tjgg": "ggjt", b"algg": "ggla"}


def recognise(head: bytes, size: int) -> Foreign | None:
    """What ``head`` (a file's first bytes; the file has ``size`` bytes) says the file is, when it is a
    known format of another framework; None otherwise."""
    for recogniser in _RECOGNISERS:
        found = recogniser(head, size)
        if found is not None:
            return found
    return None


def torchscript() -> Foreign:
    """A torch.jit.save archive: torch.load refuses it with weights_only, and it is no state dict."""
    return Foreign("a TorchScript archive (torch.jit.save)",
                   "where you trust the file, load it with torch.jit.load, save its state_dict() with "
                   "safetensors, and audit that")


def keras_archive() -> Foreign:
    return Foreign("a Keras 3 archive (.keras)", _KERAS)


def _hdf5(head: bytes, size: int) -> Foreign | None:
    # The superblock sits at 0, or after a user block of 512, 1024, ... bytes; the first two are looked at.
    if head.startswith(_HDF5_MAGIC) or head[512:520] == _HDF5_MAGIC:
        return Foreign("an HDF5 file (TensorFlow/Keras .h5 weights)",
                       "convert it with transformers (from_pretrained(folder, from_tf=True), then save_pretrained), "
                       "or save the output layer's kernel, transposed to vocabulary x hidden, with numpy.save "
                       "and audit the .npy")
    return None


def _ggml(head: bytes, size: int) -> Foreign | None:
    magic = _GGML_MAGICS.get(head[:4])
    if magic is None:
        return None
    return Foreign(f"a {magic} file from llama.cpp or whisper.cpp before GGUF",
                   "convert it to GGUF with llama.cpp's conversion script and audit the .gguf, or " + _FROM_SOURCE)


def varint(data: bytes, at: int) -> tuple[int, int] | None:
    """A protobuf varint at ``at``: (value, the offset after it); None if it runs off the end."""
    value = shift = 0
    while at < len(data) and shift < 64:
        byte = data[at]
        value |= (byte & 0x7F) << shift
        at, shift = at + 1, shift + 7
        if not byte & 0x80:
            return value, at
    return None


def _saved_model(head: bytes, size: int) -> Foreign | None:
    # saved_model.pb: field 1 schema version 1, then field 2, a MetaGraphDef that fills the file
    # and begins with its meta_info_def (field 1).
    if not head.startswith(b"\x08\x01\x12"):
        return None
    length = varint(head, 3)
    if length is None or length[1] + length[0] > size or head[length[1]:length[1] + 1] != b"\x0a":
        return None
    return Foreign("a TensorFlow SavedModel", _KERAS)


def _flax_msgpack(head: bytes, size: int) -> Foreign | None:
    # flax.serialization.to_bytes: a msgpack map of named modules, each a map of parameters
    # (or a parameter, stored as msgpack extension type 1).
    if 0x81 <= head[0] <= 0x8F:
        at = 1
    elif head[0] in (0xDE, 0xDF):
        at = 3 if head[0] == 0xDE else 5
    else:
        return None
    if at >= len(head):
        return None
    if 0xA1 <= head[at] <= 0xBF:
        length, at = head[at] - 0xA0, at + 1
    elif head[at] == 0xD9 and at + 1 < len(head):
        length, at = head[at + 1], at + 2
    else:
        return None
    key, value = head[at:at + length], head[at + length:at + length + 1]
    if len(key) < length or not key.isascii() or not key.decode().isprintable() or not value:
        return None
    is_map = 0x80 <= value[0] <= 0x8F or value[0] in (0xDE, 0xDF)
    is_array = 0xC7 <= value[0] <= 0xC9 or 0xD4 <= value[0] <= 0xD8
    if not (is_map or is_array):
        return None
    return Foreign("a Flax msgpack checkpoint",
                   "convert it with transformers (from_pretrained(folder, from_flax=True), then save_pretrained) "
                   "and audit the .safetensors")


_RECOGNISERS: tuple[Callable[[bytes, int], Foreign | None], ...] = (
    _hdf5, _ggml, _saved_model, _flax_msgpack)
