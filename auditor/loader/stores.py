"""Tensor stores: the names, shapes and dtypes in a checkpoint, and reading one tensor by name.

Each store reads lazily: listing costs a header read, and ``get`` reads one
tensor (memory-mapped where the format allows). Pickled PyTorch files go
through ``torch.load(weights_only=True)``, which refuses anything but tensors
and plain containers, so a malicious file is rejected rather than executed.
"""

from __future__ import annotations

import json
import mmap
import os
import re
import warnings
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch

from auditor.errors import InputError
from auditor.loader.nested import WRAPPERS, StateDict, find_state_dict, holders, locate, state_dict_at


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]
    dtype: str


class SafetensorsStore:
    """One .safetensors file or the shards named by a model.safetensors.index.json."""

    format = "safetensors"

    def __init__(self, files: dict[str, Path]):
        self._file_of = files  # tensor name -> shard
        self._info: dict[str, TensorInfo] = {}
        for path in sorted(set(files.values())):
            for name, info in _safetensors_header(path).items():
                if name in files and files[name] == path:
                    self._info[name] = info

    @classmethod
    def from_file(cls, path: Path) -> SafetensorsStore:
        return cls({name: path for name in _safetensors_header(path)})

    @classmethod
    def from_index(cls, index: Path) -> SafetensorsStore:
        weight_map = read_index(index)
        return cls({name: index.parent / shard for name, shard in weight_map.items()})

    def tensors(self) -> dict[str, TensorInfo]:
        return self._info

    def get(self, name: str):
        from safetensors import SafetensorError, safe_open

        path = self._file_of[name]
        try:
            with safe_open(str(path), framework="pt") as f:
                return f.get_tensor(name)
        except (SafetensorError, OSError) as error:
            raise InputError(f"{path}: cannot read tensor {name!r} ({_first_line(error)})") from None


def map_file(path: Path, what: str) -> mmap.mmap | bytes:
    """The file at ``path`` mapped read-only (b"" when it is empty, which mmap cannot map): the readers of the
    inference formats take only the bytes they need from it. ``what`` names the format in the error: InputError,
    one line, when the file cannot be opened."""
    try:
        with open(path, "rb") as stream:
            if os.fstat(stream.fileno()).st_size == 0:
                return b""
            return mmap.mmap(stream.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, ValueError) as error:
        raise InputError(f"{path}: cannot read the {what} ({getattr(error, 'strerror', None) or error})") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


def _safetensors_header(path: Path) -> dict[str, TensorInfo]:
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            infos = {}
            for name in f.keys():
                part = f.get_slice(name)
                infos[name] = TensorInfo(name, tuple(part.get_shape()), part.get_dtype())
            return infos
    except (SafetensorError, OSError) as error:
        raise InputError(f"{path}: not a readable safetensors file ({_first_line(error)})") from None


def parse_index(index: Path) -> dict[str, str]:
    """The weight_map of a shard index (tensor name -> shard file) as written, its shards not looked for
    (the Hub's loader reads an index before it has fetched any shard)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise InputError(f"{index}: not a readable shard index ({_first_line(error)})") from None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise InputError(f"{index}: its weight_map must map tensor names to shard files")
    return weight_map


def read_index(index: Path) -> dict[str, str]:
    """The weight_map of a shard index (tensor name -> shard file), every shard checked present."""
    weight_map = parse_index(index)
    if not weight_map:
        raise InputError(f"{index}: its weight_map is empty")
    missing = sorted({shard for shard in weight_map.values() if not (index.parent / shard).is_file()})
    if missing:
        raise InputError(f"{index}: shard {missing[0]} is missing from {index.parent}")
    return weight_map


class TorchStore:
    """PyTorch state dicts (.bin, .pt, .pth), single or sharded by a pytorch_model.bin.index.json.

    A single file may be a training checkpoint: its state dict is found inside the wrappers (nested.py),
    and ``resolve`` finds a tensor anywhere in it by its dotted path."""

    format = "pytorch"

    def __init__(self, files: dict[str, Path], loaded: dict[Path, dict] | None = None):
        self._file_of = files  # tensor name -> file
        self._loaded = dict(loaded or {})
        self._checkpoint = None  # a single file's whole checkpoint, for dotted paths
        self._source: Path | None = None
        self._state: StateDict | None = None  # the single file's tensors as named now

    @classmethod
    def from_file(cls, path: Path) -> TorchStore:
        checkpoint = _torch_checkpoint(path)
        store = cls({})
        store._checkpoint, store._source = checkpoint, path
        state = find_state_dict(checkpoint)
        if state is not None:
            store._use(state)
        return store

    @classmethod
    def from_index(cls, index: Path) -> TorchStore:
        weight_map = read_index(index)
        return cls({name: index.parent / shard for name, shard in weight_map.items()})

    def _use(self, state: StateDict) -> None:
        self._state = state
        self._file_of = {name: self._source for name in state.tensors}
        self._loaded = {self._source: dict(state.tensors)}

    def _shard(self, path: Path) -> dict:
        if path not in self._loaded:  # memory-mapped: parsing a shard does not read its tensors
            self._loaded[path] = _torch_state_dict(path)
        return self._loaded[path]

    @property
    def origin(self) -> str | None:
        """Where in a training checkpoint the tensors were read, for the head's notes; None for a state dict."""
        return self._state.describe() if self._state is not None else None

    def resolve(self, name: str, where_named: str, switch: bool = True) -> str | None:
        """The name under which the tensor at the dotted path ``name`` of a single file's checkpoint is
        listed, or None when there is none. A tensor outside the state dict in use brings its own dict in
        when ``switch`` (its tensors then named by their dotted paths, so that its siblings are found beside
        it); otherwise it joins the tensors in use under its dotted path."""
        if self._checkpoint is None:
            return None
        if name in self._file_of:
            return name
        state = self._state
        if state is not None and state.prefix and name.removeprefix(state.prefix) in self._file_of:
            return name.removeprefix(state.prefix)  # a Lightning name as the module's own state dict spells it
        found = locate(self._checkpoint, name, where_named)
        if found is None:
            return None
        where, key = found
        if state is not None and where == state.where and not state.named_from_top:
            inner = key[len(state.prefix):] if state.prefix and key.startswith(state.prefix) else key
            if inner in state.tensors:
                return inner
        if switch or state is None:
            self._use(state_dict_at(self._checkpoint, where))
        else:
            self._file_of[name] = self._source
            self._loaded[self._source][name] = state_dict_at(self._checkpoint, where).tensors[name]
        return name

    def tensors(self) -> dict[str, TensorInfo]:
        if self._checkpoint is not None and self._state is None:
            raise InputError(_no_state_dict(self._source, self._checkpoint))
        infos = {}
        for name, path in self._file_of.items():
            tensor = self._shard(path).get(name)
            if tensor is not None:
                infos[name] = TensorInfo(name, tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""))
        return infos

    def get(self, name: str):
        return self._shard(self._file_of[name])[name]

    def sharing_storage(self, name: str, candidate) -> str | None:
        """The name of another tensor of ``name``'s file that is the same tensor (same storage, offset, shape and
        strides) and whose name ``candidate`` accepts, or None: torch.save writes tied parameters once."""
        tensors = self._shard(self._file_of[name])
        tensor = tensors.get(name)
        if not isinstance(tensor, torch.Tensor):
            return None
        key = _view_key(tensor)
        for other, value in tensors.items():
            if other != name and candidate(other) and isinstance(value, torch.Tensor) and _view_key(value) == key:
                return other
        return None


def _view_key(tensor: torch.Tensor) -> tuple:
    return (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()))


def _no_state_dict(path: Path, checkpoint) -> str:
    if not isinstance(checkpoint, dict):
        return f"{path}: expected a state dict of tensors, found a {type(checkpoint).__name__}"
    found = sorted(holders(checkpoint), key=lambda item: -item[1])
    if found:
        dicts = ", ".join(f"{'.'.join(where)} ({count} tensors)" for where, count in found[:4])
        return (f"{path}: no state dict under the keys {', '.join(WRAPPERS)}, but tensors are under {dicts}; "
                f"name the head with --weight and its dotted path, such as --weight {'.'.join(found[0][0])}.NAME")
    keys = ", ".join(map(str, list(checkpoint)[:8]))
    return f"{path}: no tensors in it outside optimizer state (keys: {keys})"


def _torch_checkpoint(path: Path):
    """What torch.load(weights_only=True) gives for ``path``; one-line InputErrors for what it refuses."""
    import pickle

    try:
        return _torch_load(path)
    except pickle.UnpicklingError as error:
        # torch's own text advises retrying with weights_only=False, which would run whatever the
        # pickle says: never pass it on.
        raise InputError(f"{path}: refused to unpickle: it holds objects other than tensors{_refused_global(error)}, "
                         "and the auditor never unpickles arbitrary objects; whoever trusts the file can load it "
                         "and save its tensors as safetensors") from None
    except Exception as error:  # a damaged pickle can fail in any way at all inside torch.load
        raise InputError(f"{path}: not a readable PyTorch checkpoint ({_torch_reason(error)})") from None


def _torch_state_dict(path: Path) -> dict:
    """A shard's tensors by name, from inside its training-checkpoint wrappers if it has any."""
    checkpoint = _torch_checkpoint(path)
    state = find_state_dict(checkpoint)
    if state is None:
        raise InputError(_no_state_dict(path, checkpoint))
    return state.tensors


def _torch_load(path: Path):
    """torch.load(weights_only=True) of a file already known to be a torch file, memory-mapped if a zip."""
    with open(path, "rb") as stream, warnings.catch_warnings():
        # torch warns about pickle protocols and the like on stderr: the load's result, or its one-line
        # error, is all people need.
        warnings.simplefilter("ignore")
        # torch.load hands any path ending in .safetensors to the safetensors library, whatever the
        # file holds; such a misnamed torch file is named to torch by its open descriptor instead.
        source: str | BinaryIO = str(path)
        if source.endswith(".safetensors"):
            source = f"/dev/fd/{stream.fileno()}" if os.path.isdir("/dev/fd") else stream
        if not isinstance(source, str):  # an open stream, which torch cannot memory-map
            return torch.load(source, map_location="cpu", weights_only=True)
        try:
            return torch.load(source, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as error:
            if "mmap" not in str(error) and "zip" not in str(error):
                raise
            return torch.load(source, map_location="cpu", weights_only=True)  # legacy, not memory-mappable


def _refused_global(error: BaseException) -> str:
    """The class or function the weights-only unpickler refused, when its message names one."""
    found = re.search(r"GLOBAL (\S+) was not an allowed global", str(error))
    return f" ({found.group(1)})" if found else " (or was not written by torch.save)"


def _torch_reason(error: BaseException) -> str:
    # torch appends its weights_only=False advice to some errors (TorchScript archives, for one).
    reason = _first_line(error)
    if "weights_only" in reason or "trusted source" in reason:
        return "torch.load refused it with weights_only=True"
    if isinstance(error, (RuntimeError, OSError, EOFError, ValueError)):
        return reason
    return f"{type(error).__name__}: {reason}"  # a KeyError's text alone ("101") says nothing


class NumpyStore:
    """.npy (one array, called 'weight') or .npz (arrays by name, read one at a time), never unpickled."""

    format = "numpy"

    def __init__(self, path: Path, archive: bool):
        self._path = path
        self._npz = archive  # from the file's contents: its name may say otherwise
        try:
            if not self._npz:
                array = np.load(path, mmap_mode="r", allow_pickle=False)
                self._info = {"weight": TensorInfo("weight", tuple(array.shape), str(array.dtype))}
                self._array = array
            else:
                self._info = _npz_headers(path)
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
            raise InputError(f"{path}: not a readable numpy file ({_first_line(error)})") from None

    def tensors(self) -> dict[str, TensorInfo]:
        return self._info

    def get(self, name: str):
        if not self._npz:
            return self._array
        try:
            with np.load(self._path, allow_pickle=False) as archive:
                return archive[name]
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as error:
            raise InputError(f"{self._path}: cannot read array {name!r} ({_first_line(error)})") from None


def _npz_headers(path: Path) -> dict[str, TensorInfo]:
    """Names, shapes and dtypes of an .npz archive's arrays, from their headers alone."""
    infos = {}
    with zipfile.ZipFile(path) as archive:
        for member in archive.namelist():
            if not member.endswith(".npy"):
                continue
            with archive.open(member) as stream:
                major, _ = np.lib.format.read_magic(stream)
                read_header = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
                shape, _, dtype = read_header(stream)
            name = member[:-4]
            infos[name] = TensorInfo(name, tuple(shape), str(dtype))
    return infos


class GGUFStore:
    """A .gguf file through the ``gguf`` package (the auditor[gguf] extra); quantised types dequantised."""

    format = "gguf"

    def __init__(self, path: Path):
        try:
            import gguf
        except ImportError:
            raise InputError(f"{path}: reading GGUF needs the gguf package: pip install 'auditor[gguf]'") from None
        self._gguf = gguf
        try:
            self._reader = gguf.GGUFReader(str(path))
        except (OSError, ValueError, IndexError, KeyError) as error:
            raise InputError(f"{path}: not a readable GGUF file ({_first_line(error)})") from None
        self._tensors = {t.name: t for t in self._reader.tensors}

    def tensors(self) -> dict[str, TensorInfo]:
        # GGUF lists dimensions fastest-first; numpy order is the reverse.
        return {name: TensorInfo(name, tuple(int(s) for s in reversed(t.shape)), t.tensor_type.name)
                for name, t in self._tensors.items()}

    def get(self, name: str):
        tensor = self._tensors[name]
        shape = tuple(int(s) for s in reversed(tensor.shape))
        kind = tensor.tensor_type
        plain = {"F32": np.float32, "F16": np.float16, "F64": np.float64}
        if kind.name in plain:
            return np.asarray(tensor.data, dtype=plain[kind.name]).reshape(shape)
        if kind.name == "BF16":
            bits = np.array(tensor.data).view(np.int16).reshape(shape)  # a writable copy for torch
            return torch.from_numpy(bits).view(torch.bfloat16)
        try:
            return self._gguf.quants.dequantize(tensor.data, kind).astype(np.float32).reshape(shape)
        except NotImplementedError:
            raise InputError(f"tensor {name!r} has GGUF type {kind.name}, which the gguf package cannot dequantise") from None

    def metadata(self, key: str):
        field = self._reader.fields.get(key)
        if field is None:
            return None
        if len(field.data) == 1 and field.types and field.types[0] != self._gguf.GGUFValueType.ARRAY:
            value = field.parts[field.data[0]]
            if field.types[0] == self._gguf.GGUFValueType.STRING:
                return bytes(value).decode("utf-8", errors="replace")
            return value.tolist()[0]
        return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
