"""ONNX models (the auditor[onnx] extra): the classifier head found from the graph's structure.

The head is a MatMul or Gemm (or a quantised MatMulInteger) whose weight is a constant (an initializer
or a Constant node's output, possibly through Transpose, Cast or DequantizeLinear) and whose output
reaches a Softmax, LogSoftmax, ArgMax or a graph output through shape ops only (Reshape, Squeeze,
Identity, ...) and at most one Add of a constant: the bias. So it is the last such layer, the one that
computes the logits; the graph is read, never run. Its weight comes out as vocabulary x hidden
(X @ W with W hidden x vocabulary is transposed), quantised weights dequantised as the graph computes
them, in float32. Weights kept as external data are read from files inside the model's folder only.

``onnx`` is imported when a model is opened, never when the auditor is.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from auditor.errors import InputError
from auditor.head import Head
from auditor.loader.stores import TensorInfo

MISSING = "reading ONNX needs the onnx package: pip install 'auditor[onnx]'"
PADDLE_CHARACTERS = "character"  # PaddleOCR / RapidOCR exports keep their character list under this key

_SCORING = {"Softmax", "LogSoftmax", "ArgMax"}
# ops a head's output passes through on the way to its scores; the reshaping ones may also move the
# vocabulary axis, so a graph output reached through them counts for less than a Softmax (KV caches)
_LOGIT_STEPS = {"Identity", "Cast", "Dropout", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Transpose"}
_RESHAPING = {"Reshape", "Unsqueeze", "Flatten", "Transpose"}
# ops a weight, bias or scale is computed by from its constant
_CONSTANT_STEPS = {"Identity", "Cast", "Transpose", "DequantizeLinear", "Reshape", "Squeeze", "Unsqueeze",
                   "Flatten"}
# integer matrix products: (weight input, its scale input or None when a Mul follows, zero point, bias)
_INTEGER = {"MatMulInteger": (1, None, 3, None), "DynamicQuantizeMatMul": (1, 2, 3, 4),
            "MatMulIntegerToFloat": (1, 3, 5, 6)}
_FLOAT_CASTS = {1, 10, 11, 16}  # FLOAT, FLOAT16, DOUBLE, BFLOAT16


def _import_onnx(path: Path):
    try:
        import onnx
        from onnx import numpy_helper
    except ImportError:
        raise InputError(f"{path}: {MISSING}") from None
    return onnx, numpy_helper


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else type(error).__name__


@dataclass
class _Chain:
    """A value computed from one constant by the ops ``steps`` (in the order they apply)."""

    constant: str
    steps: list
    names: tuple[str, ...]  # every value along it, the constant's included
    shape: tuple[int, ...]
    stored: tuple[int, ...]  # the constant's own shape

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass
class _Head:
    """A head the graph computes: the matrix product, its weight, and where its output goes."""

    node: object  # the MatMul, Gemm or integer product
    weight: _Chain
    weight_on_left: bool  # W @ X (the weight is the product's first input): rows are already the vocabulary
    vocabulary: int
    scale: _Chain | None = None  # an integer product's weight scale
    zero_point: _Chain | None = None
    bias: _Chain | None = None
    weight_scale: float = 1.0  # Gemm's alpha
    bias_scale: float = 1.0  # Gemm's beta
    reaches: str | None = None  # "Softmax 'softmax_5.tmp_0'", "the graph output 'logits'"
    score: int = -1  # 2 a scoring op, 1 a graph output, 0 one reached through reshapes
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        to = f" -> {self.reaches}" if self.reaches else ""
        return f"{self.weight.constant} {list(self.weight.stored)} ({self.node.op_type}{to})"


class OnnxStore:
    """An ONNX model: its constants by name, its metadata, and the head its graph computes."""

    format = "onnx"

    def __init__(self, path: Path):
        onnx, self._numpy_helper = _import_onnx(path)
        self._onnx = onnx
        self._path = path
        self._folder = Path(os.path.abspath(path.parent))  # as named: a Hub cache's files are links into blobs/
        try:
            model = onnx.load_model(str(path), load_external_data=False)
        except Exception as error:  # protobuf's DecodeError, or anything a damaged file makes onnx raise
            raise InputError(f"{path}: not a readable ONNX model ({_first_line(error)})") from None
        if not model.HasField("graph") or not model.graph.node:
            raise InputError(f"{path}: an ONNX model without a graph to find the head in")
        graph = model.graph
        self.metadata_props = {prop.key: prop.value for prop in model.metadata_props}
        self._initializers = {t.name: t for t in graph.initializer}
        self._constant_nodes = {node.output[0]: node for node in graph.node
                                if node.op_type == "Constant" and node.output}
        self._producer = {out: node for node in graph.node for out in node.output if out}
        self._consumers: dict[str, list] = {}
        for node in graph.node:
            for name in node.input:
                if name:
                    self._consumers.setdefault(name, []).append(node)
        self._outputs = {value.name for value in graph.output}
        self._nodes = list(graph.node)

    # -- constants -------------------------------------------------------------------------------

    def _is_constant(self, name: str) -> bool:
        return name in self._initializers or name in self._constant_nodes

    def _tensor_proto(self, name: str):
        """The TensorProto of a constant; None for a Constant node of a plain float or int list."""
        if name in self._initializers:
            return self._initializers[name]
        for attribute in self._constant_nodes[name].attribute:
            if attribute.name == "value":
                return attribute.t
        return None

    def _stored_shape(self, name: str) -> tuple[int, ...]:
        proto = self._tensor_proto(name)
        if proto is not None:
            return tuple(int(d) for d in proto.dims)
        attribute = self._constant_nodes[name].attribute[0]
        return (len(attribute.floats or attribute.ints),) if attribute.name.endswith("s") else ()

    def _stored_dtype(self, name: str) -> str:
        proto = self._tensor_proto(name)
        if proto is None:
            return "float32" if "float" in self._constant_nodes[name].attribute[0].name else "int64"
        return str(np.dtype(self._onnx.helper.tensor_dtype_to_np_dtype(proto.data_type)))

    def tensors(self) -> dict[str, TensorInfo]:
        """Every constant (initializers and Constant outputs) with its stored shape and dtype."""
        names = list(self._initializers) + [n for n in self._constant_nodes if n not in self._initializers]
        return {name: TensorInfo(name, self._stored_shape(name), self._stored_dtype(name)) for name in names}

    def get(self, name: str) -> np.ndarray:
        """A constant's value as stored; external data is read from inside the model's folder only."""
        proto = self._tensor_proto(name)
        if proto is None:
            attribute = self._constant_nodes[name].attribute[0]
            if attribute.name not in ("value_float", "value_floats", "value_int", "value_ints"):
                raise InputError(f"{self._path}: the Constant {name!r} is a {attribute.name}, which is not read")
            return np.asarray(self._onnx.helper.get_attribute_value(attribute),
                              dtype=np.float32 if "float" in attribute.name else np.int64)
        if proto.data_location == self._onnx.TensorProto.EXTERNAL:
            proto = self._with_external_data(proto)
        try:
            return self._numpy_helper.to_array(proto)
        except Exception as error:
            raise InputError(f"{self._path}: cannot read tensor {name!r} ({_first_line(error)})") from None

    def _with_external_data(self, proto):
        """A copy of ``proto`` holding the bytes its external_data names, read from a file in the model's folder."""
        info = {entry.key: entry.value for entry in proto.external_data}
        location = info.get("location", "")
        # the path as written must stay in the folder (no absolute path, no way up); links inside it are
        # the folder owner's own (a Hub cache links every file into its blobs/)
        relative = Path(os.path.normpath(location or "."))
        if relative.is_absolute() or relative.drive or not relative.parts or relative.parts[0] == "..":
            raise InputError(f"{self._path}: tensor {proto.name!r} keeps its data in {location!r}, outside the "
                             f"model's folder {self._folder}: refused (move the data file beside the model)")
        target = self._folder / relative
        packed = proto.data_type in (self._onnx.TensorProto.INT4, self._onnx.TensorProto.UINT4)
        itemsize = np.dtype(self._onnx.helper.tensor_dtype_to_np_dtype(proto.data_type)).itemsize
        expected = (math.prod(proto.dims) + 1) // 2 if packed else math.prod(proto.dims) * itemsize
        try:
            offset, length = int(info.get("offset", 0)), int(info.get("length", expected))
        except ValueError:
            offset = length = -1
        if offset < 0 or length < 0:
            raise InputError(f"{self._path}: tensor {proto.name!r} has an unreadable external data offset or "
                             "length")
        try:
            with open(target, "rb") as stream:
                stream.seek(offset)
                data = stream.read(length)
        except OSError as error:
            raise InputError(f"{self._path}: tensor {proto.name!r}: its external data {location!r} cannot be read "
                             f"({error.strerror or error})") from None
        if len(data) != length or length != expected:
            raise InputError(f"{self._path}: tensor {proto.name!r} needs {expected} bytes of external data, but "
                             f"{location!r} gives {len(data)} at offset {offset}")
        copy = self._onnx.TensorProto()
        copy.CopyFrom(proto)
        del copy.external_data[:]
        copy.data_location = self._onnx.TensorProto.DEFAULT
        copy.raw_data = data
        return copy

    # -- values computed from constants -------------------------------------------------------------

    def _chain(self, value: str) -> _Chain | None:
        """How ``value`` is computed from one constant, when it is (through _CONSTANT_STEPS); else None."""
        steps, names = [], [value]
        while not self._is_constant(value):
            node = self._producer.get(value)
            if node is None or node.op_type not in _CONSTANT_STEPS or not node.input or len(steps) > 32:
                return None
            if node.op_type in ("DequantizeLinear", "Reshape"):
                if not all(self._chain(name) is not None for name in node.input[1:] if name):
                    return None
            if node.op_type == "Cast" and _attribute(node, "to", 1) not in _FLOAT_CASTS:
                return None
            steps.append(node)
            value = node.input[0]
            names.append(value)
        steps.reverse()
        shape = stored = self._stored_shape(value)
        for step in steps:
            shape = self._step_shape(step, shape)
            if shape is None:
                return None
        return _Chain(value, steps, tuple(names), shape, stored)

    def _step_shape(self, node, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        op = node.op_type
        if op == "Transpose":
            perm = _attribute(node, "perm", list(reversed(range(len(shape)))))
            return tuple(shape[i] for i in perm) if sorted(perm) == list(range(len(shape))) else None
        if op == "Reshape":
            wanted = [int(v) for v in self._evaluate(self._chain(node.input[1])).reshape(-1)]
            wanted = [shape[i] if v == 0 and i < len(shape) else v for i, v in enumerate(wanted)]
            if wanted.count(-1) == 1:
                known = math.prod(v for v in wanted if v != -1)
                wanted[wanted.index(-1)] = math.prod(shape) // known if known else 0
            return tuple(wanted) if math.prod(wanted) == math.prod(shape) and min(wanted, default=0) >= 0 else None
        if op in ("Squeeze", "Unsqueeze", "Flatten"):
            return (math.prod(shape),) if math.prod(shape) == max(shape, default=1) else None  # vectors only
        return shape  # Identity, Cast, DequantizeLinear

    def _evaluate(self, chain: _Chain) -> np.ndarray:
        """The value of ``chain`` as the graph computes it (DequantizeLinear in float32, like ONNX)."""
        value = self.get(chain.constant)
        for step in chain.steps:
            op = step.op_type
            if op == "Transpose":
                value = np.transpose(value, _attribute(step, "perm", None))
            elif op == "Cast":
                value = value.astype(self._onnx.helper.tensor_dtype_to_np_dtype(_attribute(step, "to", 1)))
            elif op == "DequantizeLinear":
                scale = self._evaluate(self._chain(step.input[1]))
                zero = self._evaluate(self._chain(step.input[2])) if len(step.input) > 2 and step.input[2] else None
                value = dequantize(value, scale, zero, _attribute(step, "axis", 1), _attribute(step, "block_size", 0))
            elif op in ("Reshape", "Squeeze", "Unsqueeze", "Flatten"):
                value = value.reshape(self._step_shape(step, value.shape))
        return value

    # -- the head -----------------------------------------------------------------------------------

    def _product(self, node) -> _Head | None:
        """The head computed by a MatMul, Gemm or integer product whose weight is a constant; else None."""
        op = node.op_type
        if op not in ("MatMul", "Gemm") and op not in _INTEGER:
            return None
        inputs = list(node.input) + [""] * 7
        if op in _INTEGER:
            weight, on_left = self._chain(inputs[_INTEGER[op][0]]), False
            if self._is_constant(inputs[0]):
                return None
        else:
            left, right = self._chain(inputs[0]), self._chain(inputs[1])
            if (left is None) == (right is None):  # both computed (attention) or both constant (folded away)
                return None
            weight, on_left = (left, True) if left is not None else (right, False)
        if weight is None or len(weight.shape) != 2:
            return None
        transposed = _attribute(node, "transA" if on_left else "transB", 0) if op == "Gemm" else 0
        # rows of the product's weight as used: the vocabulary on the left (W @ X), columns on the right (X @ W)
        rows, columns = reversed(weight.shape) if transposed else weight.shape
        head = _Head(node, weight, on_left, rows if on_left else columns)
        if op == "Gemm":
            head.weight_scale, head.bias_scale = _attribute(node, "alpha", 1.0), _attribute(node, "beta", 1.0)
            if inputs[2]:
                head.bias = self._chain(inputs[2])
                if head.bias is None or head.bias.size not in (1, head.vocabulary):
                    return None
        output = node.output[0]
        if op in _INTEGER:
            _, scale_at, zero_at, bias_at = _INTEGER[op]
            head.zero_point = self._chain(inputs[zero_at]) if inputs[zero_at] else None
            if scale_at is None:  # MatMulInteger: Cast to float, then Mul by the scales
                scaled = self._integer_scale(output)
                if scaled is None:
                    return None
                head.scale, output = scaled
            else:
                head.scale = self._chain(inputs[scale_at])
                if inputs[bias_at]:
                    head.bias = self._chain(inputs[bias_at])
            if head.scale is None or (inputs[zero_at] and head.zero_point is None):
                return None
        self._follow(head, output)
        return head

    def _integer_scale(self, value: str) -> tuple[_Chain, str] | None:
        """After MatMulInteger: Cast(to float) then Mul by the weight's scale, alone or times the input's
        dynamic scale (onnxruntime's quantize_dynamic). (the weight scale, the scaled product)."""
        casts = [n for n in self._consumers.get(value, []) if n.op_type == "Cast"]
        for cast in casts:
            for mul in self._consumers.get(cast.output[0], []):
                if mul.op_type != "Mul":
                    continue
                other = mul.input[1] if mul.input[0] == cast.output[0] else mul.input[0]
                scale = self._chain(other)
                if scale is None and other in self._producer and self._producer[other].op_type == "Mul":
                    factors = [self._chain(name) for name in self._producer[other].input]
                    constant = [f for f in factors if f is not None]
                    scale = constant[0] if len(constant) == 1 else None  # the other factor: the input's scale
                if scale is not None:
                    return scale, mul.output[0]
        return None

    def _follow(self, head: _Head, start: str) -> None:
        """Where the product's output goes: the best place it reaches (a scoring op, a graph output) through
        shape ops, and the bias Added on the way."""
        stack, seen = [(start, head.bias, False)], set()
        while stack:
            value, bias, reshaped = stack.pop()
            if (value, bias is None) in seen:
                continue
            seen.add((value, bias is None))
            if value in self._outputs:
                self._reach(head, f"the graph output {value!r}", 0 if reshaped else 1, bias)
            for node in self._consumers.get(value, []):
                op, first = node.op_type, node.input[0] == value
                if op in _SCORING and first:
                    self._reach(head, f"{op} {node.output[0]!r}", 2, bias)
                elif op in _LOGIT_STEPS and first:
                    if op != "Cast" or _attribute(node, "to", 1) in _FLOAT_CASTS:
                        stack.append((node.output[0], bias, reshaped or op in _RESHAPING))
                elif op == "Add" and bias is None and len(node.input) == 2:
                    added = self._chain(node.input[1] if first else node.input[0])
                    if added is not None and added.size == head.vocabulary:
                        stack.append((node.output[0], added, reshaped))

    @staticmethod
    def _reach(head: _Head, where: str, score: int, bias: _Chain | None) -> None:
        if score > head.score:
            head.reaches, head.score, head.bias = where, score, bias

    def _heads(self) -> list[_Head]:
        return [head for head in map(self._product, self._nodes) if head is not None]

    def find_head(self, weight: str | None) -> _Head:
        """The head: the one whose output reaches a Softmax, LogSoftmax or ArgMax, else a graph output
        (directly before through reshapes), or the product whose weight is ``weight``. InputError when
        there is none, or more than one of the same standing and no ``weight`` to choose."""
        heads = self._heads()
        if weight is not None:
            named = [head for head in heads if weight in head.weight.names]
            if not named:
                found = "; ".join(head.describe() for head in heads if head.reaches) or "none"
                raise InputError(f"{self._path}: no MatMul or Gemm of the ONNX graph takes {weight!r} as its weight "
                                 f"(heads found: {found}; --list-tensors lists the constants)")
            heads = named
        else:
            heads = [head for head in heads if head.reaches]
            if not heads:
                raise InputError(f"{self._path}: no classifier head found in the ONNX graph: no MatMul or Gemm with a "
                                 "constant weight feeds a Softmax, LogSoftmax, ArgMax or a graph output through shape "
                                 "ops and a bias Add")
        best = max(head.score for head in heads)
        heads = [head for head in heads if head.score == best]
        if len(heads) > 1:
            candidates = "; ".join(head.describe() for head in heads)
            raise InputError(f"{self._path}: more than one classifier head in the ONNX graph ({candidates}); "
                             "choose one with --weight NAME")
        return heads[0]

    def read_head(self, path: Path, weight: str | None, bias: str | None) -> Head:
        """The head as vocabulary x hidden, with its bias (``bias``: a constant's name, or "none")."""
        found = self.find_head(weight)
        matrix = self._evaluate(found.weight)
        notes = []
        op, constant = found.node.op_type, found.weight.constant
        if op in _INTEGER:
            matrix = self._dequantised_product(found, matrix, notes)
        elif any(step.op_type == "DequantizeLinear" for step in found.weight.steps):
            notes.append(f"the weight {constant} is {self._stored_dtype(constant)}, dequantised as the graph's "
                         f"DequantizeLinear computes it: (weight - zero point) x scale, {matrix.dtype}")
        if op == "Gemm" and _attribute(found.node, "transA" if found.weight_on_left else "transB", 0):
            matrix = matrix.T
        if not found.weight_on_left:
            matrix = matrix.T  # X @ W: W is hidden x vocabulary
        if found.weight_scale != 1.0:
            matrix = (matrix * np.float32(found.weight_scale)).astype(matrix.dtype)
            notes.append(f"Gemm's alpha {found.weight_scale:g} multiplies the weight (in {matrix.dtype})")
        matrix = np.ascontiguousarray(matrix)
        bias_vector, bias_name = self._bias(found, bias)
        if found.bias is not None and bias_name == found.bias.constant and found.bias_scale != 1.0:
            notes.append(f"Gemm's beta {found.bias_scale:g} multiplies the bias")
        head = Head(weight=matrix, bias=bias_vector, weight_name=constant, bias_name=bias_name,
                    tied=self._is_embedding(constant), path=path, source_format=self.format)
        kind = "a Constant" if constant in self._constant_nodes else "an initializer"
        stored = " x ".join(map(str, found.weight.stored))
        if found.weight.stored != matrix.shape:
            stored += f", read as {matrix.shape[0]} x {matrix.shape[1]}"
        reaches = f" feeding {found.reaches}" if found.reaches else ""
        with_bias = f", bias {bias_name}" if bias_name else ""
        head.notes.append(f"the head is the ONNX graph's {op} {found.node.name or found.node.output[0]!r}{reaches}: "
                          f"weight {constant} ({kind}, {stored})"
                          f"{with_bias}")
        head.notes += notes
        return head

    def _dequantised_product(self, found: _Head, matrix: np.ndarray, notes: list[str]) -> np.ndarray:
        """An integer product's weight as float32: (weight - zero point) x scale, per column of X @ W."""
        scale = self._evaluate(found.scale).astype(np.float32)
        zero = self._evaluate(found.zero_point) if found.zero_point is not None else None
        stored = self._stored_dtype(found.weight.constant)
        if scale.size not in (1, found.vocabulary) or (zero is not None and zero.size not in (1, found.vocabulary)):
            raise InputError(f"{self._path}: the scale or zero point of {found.node.op_type} {found.node.name!r} is "
                             "neither one value nor one per output column")
        integers = matrix.astype(np.int32) - (zero.reshape(-1).astype(np.int32) if zero is not None else 0)
        per = "per column" if scale.size > 1 else "per tensor"
        notes.append(f"the weight {found.weight.constant} is {stored}, dequantised as {found.node.op_type} and its "
                     f"scale compute it: (weight - zero point) x scale ({per}), float32")
        return integers.astype(np.float32) * scale.reshape(-1)

    def _bias(self, found: _Head, bias: str | None) -> tuple[np.ndarray | None, str | None]:
        if bias == "none":
            return None, None
        if bias is not None and (found.bias is None or bias != found.bias.constant):
            chain = self._chain(bias)
            if chain is None or chain.size != found.vocabulary:
                raise InputError(f"{self._path}: --bias {bias!r} is not a constant of {found.vocabulary} values "
                                 "in the ONNX graph")
            return self._evaluate(chain).reshape(-1), bias
        if found.bias is None:
            return None, None
        vector = self._evaluate(found.bias).reshape(-1)
        if found.bias_scale != 1.0:  # Gemm's beta
            vector = (vector * np.float32(found.bias_scale)).astype(vector.dtype)
        if vector.size == 1:
            vector = np.repeat(vector, found.vocabulary)
        return vector, found.bias.constant

    def _is_embedding(self, constant: str) -> bool:
        """Whether the head's weight is also gathered from as an input embedding (a tied head)."""
        return any(node.op_type == "Gather" and node.input[0] == constant
                   for node in self._consumers.get(constant, []))

    def metadata(self, key: str) -> str | None:
        return self.metadata_props.get(key)


def _attribute(node, name: str, default):
    """A node's attribute by name (ints and floats as lists), ``default`` when it has none."""
    for attribute in node.attribute:
        if attribute.name == name:
            from onnx import helper  # the store that holds the node imported it

            value = helper.get_attribute_value(attribute)
            return list(value) if isinstance(value, (list, tuple)) else value
    return default


def dequantize(value: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, axis: int = 1,
               block_size: int = 0) -> np.ndarray:
    """ONNX's DequantizeLinear: (value - zero) x scale, per tensor (a scalar scale), per axis (a vector along
    ``axis``) or per block along ``axis``; the difference is exact in int32, the product rounds once, in the
    scale's type (float32 mostly)."""
    if value.dtype.kind not in "iu" and value.dtype.name not in ("int4", "uint4"):
        raise InputError(f"DequantizeLinear of {value.dtype} values is not supported (int8, uint8, int4, ... are)")
    axis = axis % max(value.ndim, 1)

    def spread(factor: np.ndarray) -> np.ndarray:
        if factor.ndim == 0 or factor.size == 1:
            return factor.reshape(())
        if block_size:
            return np.repeat(factor, block_size, axis=axis)[tuple(slice(0, s) for s in value.shape)]
        shape = [1] * value.ndim
        shape[axis] = factor.size
        return factor.reshape(shape)

    difference = value.astype(np.int32) - (spread(zero).astype(np.int32) if zero is not None else 0)
    if scale.dtype == np.float32:
        return difference.astype(np.float32) * spread(scale)
    # float16 or bfloat16 scales: the product of an 8-bit difference and the scale is exact in float32,
    # then rounded once to the scale's type, as ONNX computes it in that type
    return (difference.astype(np.float32) * spread(scale).astype(np.float32)).astype(scale.dtype)


def paddle_characters(text: str, rows: int) -> tuple[list[str | None] | None, str]:
    """Token strings from a PaddleOCR character list (the model's metadata ``character``): id 0 is CTC's
    blank, ids 1.. the list's lines, and the last id the space PaddleOCR appends when use_space_char is
    set. Returns (strings by id, or None when the list does not fit ``rows``; the note saying so)."""
    lines = text.splitlines()  # as RapidOCR reads it
    where = f"the model's metadata {PADDLE_CHARACTERS!r} (PaddleOCR's character list, {len(lines)} lines)"
    if len(lines) + 2 == rows:
        return [None, *lines, " "], (f"token strings from {where}: id 0 is CTC's blank, ids 1..{len(lines)} the "
                                     f"lines, id {rows - 1} the space PaddleOCR appends (use_space_char)")
    if len(lines) + 1 == rows:
        return [None, *lines], f"token strings from {where}: id 0 is CTC's blank, ids 1..{len(lines)} the lines"
    return None, (f"{where} does not fit the head's {rows} rows (a blank, the lines and a space would be "
                  f"{len(lines) + 2}): no token strings; pass --vocab FILE --vocab-offset N")
