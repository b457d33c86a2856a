"""What a checkpoint file is, from its first bytes; its name is only a hint for the message (and the last
resort for an ONNX model, whose protobuf fields may come in any order).

Names lie: a safetensors file saved as model.bin, a CTranslate2 model.bin, a Git
LFS pointer named model.safetensors. Handing such a file to the reader its name
suggests gives a baffling error (or, for torch.load, advice to unpickle it
unsafely), so the loader asks ``identify`` first. It reads SNIFF_BYTES and,
for a zip archive, the member names; nothing else.
"""

from __future__ import annotations

import json
import os
import re
import zipfile
from pathlib import Path

from auditor.errors import InputError
from auditor.loader.foreign import Foreign, keras_archive, recognise, torchscript, varint

SNIFF_BYTES = 1024
# the checkpoint of a model folder (local or on the Hub), in the order they are looked for
WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
                "pytorch_model.bin")
# An inference format's model file, which a folder (local or on the Hub) is read from where it holds no checkpoint:
# CTranslate2's model.bin, a Kaldi recipe's final.mdl, Vosk's am/final.mdl. Taken by its contents: OpenVINO also
# writes a model.bin.
INFERENCE_FILES = ("model.bin", "final.mdl", "am/final.mdl")
# a PEFT adapter's folder (local or on the Hub), as peft's save_pretrained writes it: its configuration, and its
# weights in the order they are looked for
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
# The formats the stores read: safetensors, a torch.save zip, a pickle (a legacy torch.save, read with
# weights_only), numpy's .npy and .npz, GGUF, an ONNX model, a shard index (JSON with a weight_map), and the
# inference formats: a CTranslate2 model.bin, a TensorFlow Lite flatbuffer, a Kaldi nnet3 model.
DESCRIPTIONS = {"safetensors": "a safetensors file", "torch-zip": "a PyTorch checkpoint (zip)",
                "pickle": "a pickle (a legacy PyTorch checkpoint, or any other)", "npy": "an .npy array",
                "npz": "an .npz archive", "gguf": "a GGUF file", "onnx": "an ONNX model", "index": "a shard index",
                "ctranslate2": "a CTranslate2 model", "tflite": "a TensorFlow Lite model",
                "kaldi": "a Kaldi nnet3 model"}
READABLE = tuple(DESCRIPTIONS)

_MAX_SAFETENSORS_HEADER = 100_000_000  # the limit the safetensors library itself enforces
_MAX_INDEX_BYTES = 64 << 20
_ZIP_MAGICS = (b"PK\x03\x04", b"PK\x05\x06")  # a local file header; an empty archive's end record
_PICKLE_PROTOCOLS = (b"\x80\x02", b"\x80\x03", b"\x80\x04", b"\x80\x05")  # torch.save's legacy format uses 2
_EXPECTED = ("expected safetensors, a torch .bin/.pt, .npy/.npz, .gguf, .onnx, .tflite, a CTranslate2 model.bin "
             "or a Kaldi nnet3 model")
_NAMED_LIKE = {".safetensors": "a safetensors file", ".gguf": "a GGUF file", ".npy": "an .npy file",
               ".npz": "an .npz archive", ".pt": "a PyTorch checkpoint", ".pth": "a PyTorch checkpoint",
               ".ckpt": "a PyTorch checkpoint"}
# CTranslate2 spec names are Python class names, all ending in "Spec" (WhisperSpec, TransformerDecoderSpec, ...).
_SPEC_NAME = re.compile(rb"[A-Z][A-Za-z0-9_]{0,120}Spec")
# a binary Kaldi file: "\0B", then a final.mdl's transition model or a raw network's first token
_KALDI_STARTS = (b"\x00B<TransitionModel> ", b"\x00B<Nnet3> ")
_KALDI_TEXT_STARTS = ("<TransitionModel>", "<Nnet3>")
_ONNX_WIRE_TYPES = {2: 2, 3: 2, 4: 2, 5: 0, 6: 2, 7: 2, 8: 2, 14: 2, 20: 2, 25: 2}  # ModelProto field -> wire type


def identify(path: Path) -> str:
    """The format of the file at ``path``, one of READABLE, decided by its contents.

    Raises InputError, one line naming the file, when it is empty, truncated, text,
    unknown, or a known format of another framework (saying what to audit instead).
    """
    head, size = _first_bytes(path)
    kind = _kind(path, head, size)
    if isinstance(kind, Foreign):
        raise InputError(f"{path}: {kind.what}, which the auditor does not read: {kind.advice}")
    return kind


def foreign_format(path: Path) -> Foreign | None:
    """The other framework's format of the file at ``path``, if it is one; None for anything else
    (a checkpoint, text, an unreadable file). For telling people what a folder holds instead."""
    try:
        head, size = _first_bytes(path)
        if size == 0 or _readable_magic(path, head, size) or _as_text(head) is not None or _is_onnx(head, size):
            return None
        kind = _zip_kind(path) if head[:4] in _ZIP_MAGICS else recognise(head, size)
    except InputError:
        return None
    return kind if isinstance(kind, Foreign) else None


def _first_bytes(path: Path) -> tuple[bytes, int]:
    try:
        with open(path, "rb") as stream:
            return stream.read(SNIFF_BYTES), os.fstat(stream.fileno()).st_size
    except OSError as error:
        raise InputError(f"{path}: cannot be read ({error.strerror or error})") from None


def _kind(path: Path, head: bytes, size: int) -> str | Foreign:
    if size == 0:
        raise InputError(f"{path}: an empty file, not a checkpoint")
    readable = _readable_magic(path, head, size)
    if readable is not None:
        return readable
    if head[:4] in _ZIP_MAGICS:
        return _zip_kind(path)
    text = _as_text(head)  # before the foreign formats: text never starts with their binary magics
    if text is not None:
        return _text_kind(path, text, size)
    if _is_onnx(head, size):
        return "onnx"
    foreign = recognise(head, size)
    if foreign is not None:
        return foreign
    if path.suffix.lower() == ".onnx":  # a ModelProto may list its fields in any order: onnx itself decides
        return "onnx"
    hint = _NAMED_LIKE.get(path.suffix.lower())
    named = f"; its name says {hint}, but it does not begin like one (damaged, or a partial download?)" if hint else ""
    raise InputError(f"{path}: not a recognised checkpoint format ({_EXPECTED}){named}")


def _readable_magic(path: Path, head: bytes, size: int) -> str | None:
    """A format recognised by a fixed prefix; zip archives need their member names, so not here."""
    if _is_safetensors(path, head, size):
        return "safetensors"
    if head.startswith(b"GGUF"):
        return "gguf"
    if head.startswith(b"\x93NUMPY"):
        return "npy"
    if head[:2] in _PICKLE_PROTOCOLS:
        return "pickle"
    if head[4:8] == b"TFL3":  # a FlatBuffer: a uint32 root offset, then the file identifier
        return "tflite"
    if head.startswith(_KALDI_STARTS):
        return "kaldi"
    if _is_ctranslate2(head):
        return "ctranslate2"
    return None


def _is_ctranslate2(head: bytes) -> bool:
    """model.bin: a uint32 binary version (6 today; version 1 had no spec name), then the spec name, written as a
    uint16 length that counts a trailing NUL. A one-byte length is taken too (the reader then says the file is
    damaged): the spec name ending in "Spec" right after the version is what makes the file unmistakable."""
    version = int.from_bytes(head[:4], "little")
    if not 2 <= version <= 64:
        return False
    for start in (6, 5):  # after a two-byte length, or a one-byte one
        name = _SPEC_NAME.match(head, start)
        length = int.from_bytes(head[4:start], "little")
        if name and length in (len(name.group()), len(name.group()) + 1):
            return True
    return False


def _is_onnx(head: bytes, size: int) -> bool:
    """A ModelProto as exporters write it: field 1 ir_version (3 and up since 2017) first, then its other
    fields in field order: producer name and version, domain, model version, doc string, the graph, opsets."""
    if head[:1] != b"\x08":
        return False
    first = varint(head, 1)
    if first is None or not 3 <= first[0] <= 30:
        return False
    at, fields = first[1], 0
    while at < len(head):
        tag = varint(head, at)
        if tag is None:
            break
        number, wire = tag[0] >> 3, tag[0] & 7
        if _ONNX_WIRE_TYPES.get(number) != wire:
            return False
        value = varint(head, tag[1])
        if value is None:
            break
        fields += 1
        if wire == 0:
            at = value[1]
            continue
        end = value[1] + value[0]
        if end > size:
            return False
        if number in (2, 3, 4, 6) and end <= len(head):  # producer, its version, domain, doc string: UTF-8
            try:
                head[value[1]:end].decode("utf-8")
            except UnicodeDecodeError:
                return False
        if number >= 7:  # the graph: everything after it is the model itself
            break
        at = end
    return fields > 0


def _is_safetensors(path: Path, head: bytes, size: int) -> bool:
    # An 8-byte little-endian header length N, then N bytes of JSON: an object, so "{".
    if head[8:9] != b"{":
        return False
    length = int.from_bytes(head[:8], "little")
    if not 2 <= length <= _MAX_SAFETENSORS_HEADER:
        return False
    if 8 + length > size:
        raise InputError(f"{path}: a truncated safetensors file (its header alone needs {8 + length} bytes, "
                         f"the file has {size}): download or copy it again")
    return True


def _zip_kind(path: Path) -> str | Foreign:
    # torch.save writes <dir>/data.pkl beside <dir>/data/<storage>; np.savez writes <name>.npy members.
    try:
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError, ValueError, EOFError) as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise InputError(f"{path}: a damaged or truncated zip archive ({reason})") from None
    if not names:
        raise InputError(f"{path}: an empty zip archive, not a checkpoint")
    top_level = [name.split("/", 1)[1] for name in names if name.count("/") >= 1]
    if "constants.pkl" in top_level:  # torch.jit.save also writes data.pkl, so ask first
        return torchscript()
    if "data.pkl" in top_level:
        return "torch-zip"
    if all(name.endswith(".npy") for name in names):
        return "npz"
    if "config.json" in names and "model.weights.h5" in names:
        return keras_archive()
    raise InputError(f"{path}: a zip archive, but neither a PyTorch checkpoint nor an .npz "
                     f"(its first member is {names[0]!r})")


def _as_text(head: bytes) -> str | None:
    """``head`` as text when it is printable UTF-8 (a multi-byte character cut at the end allowed)."""
    if b"\x00" in head:
        return None
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as error:
        if error.start < len(head) - 3 or error.reason != "unexpected end of data":
            return None
        text = head[:error.start].decode("utf-8")
    text = text.removeprefix("\ufeff")
    return text if all(ch.isprintable() or ch in "\t\n\r\f\v" for ch in text) else None


def _text_kind(path: Path, text: str, size: int) -> str:
    if text.startswith("version https://git-lfs"):
        raise InputError(f"{path}: not a checkpoint but a Git LFS pointer to one: fetch the file itself "
                         "(git lfs pull)")
    if text.lstrip().startswith("{"):
        if _is_index(path, size):
            return "index"
        raise InputError(f"{path}: not a checkpoint (a JSON text file, not a shard index with a weight_map)")
    if text.startswith(_KALDI_TEXT_STARTS):
        raise InputError(f"{path}: a Kaldi model in text mode, which the auditor does not read: write it in binary "
                         "with nnet3-am-copy --binary=true (nnet3-copy for a raw network) and audit that")
    first = text.strip().splitlines()[0][:30] if text.strip() else ""
    begins = f" that begins {first!r}" if first else ""
    raise InputError(f"{path}: not a checkpoint (a text file{begins})")


def _is_index(path: Path, size: int) -> bool:
    if size > _MAX_INDEX_BYTES:
        return False
    try:
        document = json.loads(path.read_text(encoding="utf-8-sig"))
    except (OSError, ValueError):
        return False
    return isinstance(document, dict) and "weight_map" in document
