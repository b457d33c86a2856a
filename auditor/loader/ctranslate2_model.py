"""CTranslate2 models (model.bin, as its converters write it): the output projection, its final norm and vocabulary.

model.bin is a flat list of named variables: a uint32 binary version, the spec's name and revision, then each
variable's name, shape, type and bytes, then aliases (a name standing for another variable: a Whisper
decoder's ``decoder/projection/weight`` is ``decoder/embeddings/weight``). Strings are a uint16 length that
counts a trailing NUL. The file is memory-mapped: its layout is walked without reading any variable's bytes, and
only the head's variables are read.

Quantised weights are dequantised as CTranslate2's CPU kernel does when it runs a model in float32:
int8 rows (and int16 tensors) times ``1 / weight_scale``, that reciprocal and the product each rounded to
float32. float16 and bfloat16 weights are kept as stored.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from auditor.errors import InputError
from auditor.loader.stores import TensorInfo, map_file
from auditor.question.head import Head
from auditor.question.norm import FinalNorm

NEWEST_VERSION = 6  # the binary version CTranslate2 4.x writes; older ones are read as its loader reads them
# the DataType enum of include/ctranslate2/types.h, in order
_TYPES = ("float32", "int8", "int16", "int32", "float16", "bfloat16")
_NUMPY = {"float32": np.float32, "int8": np.int8, "int16": np.int16, "int32": np.int32, "float16": np.float16,
          "bfloat16": np.uint16}  # bfloat16's bits, viewed as torch.bfloat16 once read
_ITEM_TYPES = {1: "int8", 2: "int16", 4: "float32"}  # before binary version 4 a variable gave its item size only
# Where specs keep the vocabulary projection, and the layer norm the runtime applies to its input: decoders
# (Transformer, Whisper, LLMs; src/layers/transformer.cc) and Wav2Vec2's CTC head (src/layers/wav2vec2.cc).
# Wav2Vec2Bert has no norm right before its head.
HEADS = {"decoder/projection/weight": ("decoder/layer_norm", None),
         "encoder/lm_head/weight": ("encoder/layer_norm", "Wav2Vec2Spec")}
# the token strings of a head, in the order CTranslate2's converters name the files
_VOCABULARIES = ("target_vocabulary", "shared_vocabulary", "vocabulary")


@dataclass(frozen=True)
class _Variable:
    name: str
    shape: tuple[int, ...]
    dtype: str
    offset: int  # of its bytes in the file


class CTranslate2Store:
    """A CTranslate2 model.bin: its variables by name (aliases resolved), read lazily from the mapped file."""

    format = "ctranslate2"

    def __init__(self, path: Path):
        self._path = path
        self._bytes = map_file(path, "CTranslate2 model")
        self._at = 0
        self.variables: dict[str, _Variable] = {}
        # every name the runtime knows, aliases included, and the variable it stands for
        self._index: dict[str, str] = {}
        self.config = _read_config(path.parent)
        self._parse()

    # -- the file's layout

    def _fail(self, what: str):
        raise InputError(f"{self._path}: {what}")

    def _skip(self, size: int, what: str) -> int:
        """Moves past ``size`` bytes, checked to lie in the file, without reading them; their offset."""
        start, end = self._at, self._at + size
        if end > len(self._bytes):
            self._fail(f"a truncated CTranslate2 model ({what} needs bytes {start}..{end}, the file has "
                       f"{len(self._bytes)}): download or convert it again")
        self._at = end
        return start

    def _take(self, size: int, what: str) -> bytes:
        start = self._skip(size, what)
        return self._bytes[start:self._at]

    def _uint(self, size: int, what: str) -> int:
        return int.from_bytes(self._take(size, what), "little")

    def _string(self, what: str) -> str:
        length = self._uint(2, what)
        raw = self._take(length, what)
        if length == 0 or raw[-1:] != b"\x00":
            self._fail(f"a damaged CTranslate2 model ({what} at byte {self._at - length} is not a NUL-ended string)")
        try:
            return raw[:-1].decode("utf-8")
        except UnicodeDecodeError:
            self._fail(f"a damaged CTranslate2 model ({what} at byte {self._at - length} is not UTF-8)")

    def _parse(self) -> None:
        # Version 1 files had no spec name, so nothing tells them apart from other bytes: formats.py never
        # hands one here.
        self.version = self._uint(4, "the binary version")
        if not 2 <= self.version <= NEWEST_VERSION:
            self._fail(f"a CTranslate2 model of binary version {self.version}, which this reader does not know "
                       f"(it reads versions 2 to {NEWEST_VERSION})")
        self.spec = self._string("the spec's name")
        self.revision = self._uint(4, "the spec's revision")
        count = self._uint(4, "the number of variables")
        for index in range(count):
            what = f"variable {index + 1} of {count}"
            name = self._string(f"{what}'s name")
            rank = self._uint(1, f"{name}'s rank")
            shape = tuple(self._uint(4, f"{name}'s shape") for _ in range(rank))
            if self.version >= 4:
                type_id = self._uint(1, f"{name}'s type")
                if type_id >= len(_TYPES):
                    self._fail(f"a damaged CTranslate2 model ({name} has type id {type_id}; known are 0 to "
                               f"{len(_TYPES) - 1})")
                dtype, size = _TYPES[type_id], self._uint(4, f"{name}'s size")
            else:
                item = self._uint(1, f"{name}'s item size")
                if item not in _ITEM_TYPES:
                    self._fail(f"a damaged CTranslate2 model ({name} has items of {item} bytes)")
                dtype, size = _ITEM_TYPES[item], self._uint(4, f"{name}'s size") * item
            expected = math.prod(shape) * np.dtype(_NUMPY[dtype]).itemsize  # Python integers: no overflow
            if size != expected:
                self._fail(f"a damaged CTranslate2 model ({name}, {dtype} {list(shape)}, says it has {size} bytes "
                           f"instead of {expected})")
            offset = self._skip(size, name)
            if name not in self.variables:  # the runtime keeps the first of two variables of one name
                self.variables[name] = _Variable(name, shape, dtype, offset)
                self._index[name] = name
        if self.version >= 3:
            for index in range(self._uint(4, "the number of aliases")):
                alias = self._string(f"alias {index + 1}")
                target = self._string(f"the variable alias {alias} stands for")
                # as src/models/model.cc registers them, in order: an alias of a name not yet known is dropped,
                # a name already known keeps its variable, and a weight's alias also aliases its scale and zero
                for suffix in ("", "_scale", "_zero"):
                    if target + suffix in self._index:
                        self._index.setdefault(alias + suffix, self._index[target + suffix])

    # -- what the loader asks

    def resolve(self, name: str) -> str | None:
        """The variable the runtime reads for ``name`` (an alias followed); None when it knows no such name."""
        return self._index.get(name)

    def tensors(self) -> dict[str, TensorInfo]:
        """Every variable and alias with its shape and stored type."""
        listed = {}
        for name, target in self._index.items():
            variable = self.variables[target]
            listed[name] = TensorInfo(name, variable.shape, variable.dtype)
        return listed

    def stored(self, name: str):
        """The variable ``name`` (an alias followed) as stored: a read-only numpy view of the mapped file, or for
        bfloat16 a torch tensor."""
        variable = self.variables[self.resolve(name)]
        array = np.frombuffer(self._bytes, _NUMPY[variable.dtype], math.prod(variable.shape),
                              variable.offset).reshape(variable.shape)
        if variable.dtype == "bfloat16":
            return torch.from_numpy(array.copy()).view(torch.bfloat16)
        return array

    def _scalar(self, name: str) -> float:
        """A variable the runtime reads as one value (a scale, a flag)."""
        value = _float_array(self.stored(name)).reshape(-1)
        if value.size != 1:
            self._fail(f"{name} holds {value.size} values where the runtime reads one")
        return float(value[0])

    def _dequantised(self, name: str, notes: list[str]):
        """The weight ``name`` as CTranslate2 runs it in float32 (int8 and int16 through their scale), else as stored.
        The scales' shapes are the ones the runtime accepts: one per row for int8, one for the tensor for int16."""
        value = self.stored(name)
        dtype = self.variables[self.resolve(name)].dtype
        if dtype not in ("int8", "int16"):
            if dtype == "int32":
                self._fail(f"{name} is int32 (AWQ-packed 4-bit weights), which this reader does not dequantise: "
                           "audit the checkpoint the model was converted from")
            return value
        rows = value.shape[0]
        scale_name = self.resolve(name + "_scale")
        if scale_name is None:
            if dtype != "int16":
                self._fail(f"{name} is int8 but the model has no {name}_scale to dequantise it with")
            scale = np.float32(1000.0)  # ops::Quantize::global_int16_scale, for int16 models saved without one
        else:
            if self.variables[scale_name].dtype != "float32":
                self._fail(f"{scale_name} is {self.variables[scale_name].dtype}; the runtime reads scales as float32")
            scale = self.stored(scale_name)
            wanted = rows if dtype == "int8" else 1
            if scale.size != wanted:
                self._fail(f"{scale_name} has {scale.size} values where the runtime takes "
                           f"{'one per row' if dtype == 'int8' else 'one'} for the {dtype} weight {name}")
        if not np.all(np.isfinite(scale)) or np.any(scale == 0):
            self._fail(f"{scale_name} holds a zero or non-finite scale, so {name} cannot be dequantised")
        reciprocal = (np.float32(1) / np.asarray(scale, np.float32)).astype(np.float32)
        weight = value.astype(np.float32) * reciprocal.reshape(-1, 1)
        per = "per row" if dtype == "int8" else "for the whole tensor"
        notes.append(f"the weight {name} is {dtype} with a scale {per}, dequantised as CTranslate2's CPU kernel does "
                     f"for float32: the value times 1 / scale, each rounded to float32 (its GPU kernel divides; "
                     f"with an {dtype} compute type the logits are also computed from quantised hidden states)")
        return weight

    def read_head(self, path: Path, weight: str | None, bias: str | None) -> Head:
        """The head: the output projection (or the variable ``weight`` names), its bias, the final norm before it."""
        name = weight if weight is not None else next((n for n in HEADS if self.resolve(n) is not None), None)
        if name is None or self.resolve(name) is None or len(self.variables[self.resolve(name)].shape) != 2:
            matrices = sorted(n for n, info in self.tensors().items() if len(info.shape) == 2)
            said = f"no 2-D variable {name!r}" if weight is not None else f"no {' or '.join(HEADS)}"
            shown = ", ".join(matrices[:8]) + (", ..." if len(matrices) > 8 else "")
            self._fail(f"a CTranslate2 model ({self.spec}) with {said}; choose the head with --weight NAME (its 2-D "
                       f"variables: {shown or 'none'})")
        notes: list[str] = []
        matrix = self._dequantised(name, notes)
        bias_vector, bias_name = self._bias(name, bias, matrix.shape[0])
        scope = name.rsplit("/", 2)[0] if name.count("/") >= 2 else ""  # "decoder" of "decoder/projection/weight"
        scale_outputs = self.resolve(f"{scope}/scale_outputs") if name in HEADS else None
        if scale_outputs is not None:
            # the runtime multiplies the projection's input by it; its product with each weight is exact in float64
            factor = self._scalar(scale_outputs)
            matrix = _float_array(matrix).astype(np.float64) * factor
            notes.append(f"{scale_outputs} ({factor:g}) multiplies the hidden state before the projection: the "
                         "weight is read multiplied by it, in float64")
        target = self.resolve(name)
        tied = target != name or "embeddings" in target
        aliased = f" (an alias of {target})" if target != name else ""
        with_bias = f", bias {bias_name}" if bias_name else ""
        notes.insert(0, f"the head is the CTranslate2 model's {name}{aliased}: {self.spec}, "
                        f"{' x '.join(map(str, matrix.shape))} {self.variables[target].dtype}{with_bias}")
        head = Head(weight=matrix, bias=bias_vector, weight_name=name, bias_name=bias_name, tied=tied, path=path,
                    source_format=self.format, notes=notes)
        head.final_norm = self._final_norm(name, notes)
        return head

    def _bias(self, name: str, bias: str | None, rows: int):
        if bias == "none":
            return None, None
        chosen = bias if bias is not None else (name[:-len("weight")] + "bias" if name.endswith("weight") else None)
        found = self.resolve(chosen) if chosen is not None else None
        if found is None:
            if bias is not None:
                self._fail(f"no variable {bias!r} in the CTranslate2 model (--bias)")
            return None, None
        vector = _float_array(self.stored(found)).reshape(-1)
        if vector.size != rows:
            self._fail(f"the bias {chosen} has {vector.size} values for a head of {rows} rows")
        return vector, chosen

    def _final_norm(self, name: str, notes: list[str]) -> FinalNorm | None:
        """The layer norm the runtime applies right before the head ``name``, for the heads HEADS knows: LayerNorm
        with a beta, RMSNorm without; epsilon from config.json's layer_norm_epsilon, else CTranslate2's default,
        as the C++ float the runtime holds it in. None for any other weight, and where a projection (a decoder's
        ``project_out``) lies between the norm and the head."""
        if name not in HEADS:
            return None
        scope, spec = HEADS[name]
        gamma = self.resolve(f"{scope}/gamma")
        if gamma is None or (spec is not None and self.spec != spec):
            return None
        outer = scope.rsplit("/", 1)[0]
        if self.resolve(f"{outer}/project_out/weight") is not None:
            notes.append(f"{outer}/project_out lies between {scope} and the head: the outputs of the final norm are "
                         "not the head's inputs, so the norm domain is not offered")
            return None
        beta = self.resolve(f"{scope}/beta")
        epsilon = self.config.get("layer_norm_epsilon")
        if not isinstance(epsilon, (int, float)) or isinstance(epsilon, bool):
            epsilon = 1e-5 if beta is not None else 1e-6  # src/layers/common.cc's defaults
        flag = self.resolve(f"{scope}/layer_norm_use_residual")  # read by the runtime's RMSNorm only
        unit_offset = beta is None and flag is not None and self._scalar(flag) != 0  # times (1 + gamma)
        return FinalNorm("layernorm" if beta is not None else "rmsnorm", _float_array(self.stored(gamma)),
                         _float_array(self.stored(beta)) if beta is not None else None, float(np.float32(epsilon)),
                         unit_offset=unit_offset, names=tuple(n for n in (gamma, beta) if n))

    def token_strings(self, rows: int) -> tuple[list[str | None] | None, str | None, list[str]]:
        """The token strings of the folder's vocabulary file (target, shared or plain; .json or .txt, one token a
        line), as CTranslate2's converters write them; (None, None, notes) when there is none."""
        folder = self._path.parent
        for stem in _VOCABULARIES:
            for suffix in (".json", ".txt"):
                path = folder / f"{stem}{suffix}"
                if path.is_file():
                    return _read_vocabulary(path, rows)
        return None, None, []


def _float_array(value) -> np.ndarray:
    """A stored value as numpy: bfloat16 (a torch tensor) widened to float32, which is exact."""
    return value if isinstance(value, np.ndarray) else value.float().numpy()


def _read_config(folder: Path) -> dict:
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def _read_vocabulary(path: Path, rows: int) -> tuple[list[str | None] | None, str | None, list[str]]:
    try:
        if path.suffix == ".json":
            tokens = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
                return None, None, [f"{path.name} is not a list of token strings: no token strings"]
        else:
            tokens = path.read_text(encoding="utf-8").split("\n")
            if tokens and tokens[-1] == "":
                tokens.pop()
    except (OSError, ValueError) as error:
        return None, None, [f"{path.name} could not be read ({error}): no token strings"]
    notes = [] if len(tokens) == rows else [f"{path.name} has {len(tokens)} tokens for the head's {rows} rows"]
    return tokens, str(path), notes
