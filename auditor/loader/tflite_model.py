"""TensorFlow Lite / LiteRT models (.tflite): the classifier head read from the flatbuffer, no runtime needed.

This module owns the .tflite format: a bounds-checked reader of its flatbuffer (the file memory-mapped by
stores.map_file, every offset checked against the file's size and every constant's shape checked when the
tensor table is read, so a truncated or damaged file is refused in one line); the head found from the first
subgraph's operators: a FULLY_CONNECTED with a constant weight whose output reaches one of the subgraph's
outputs through reshapes and (de)quantisation and at most one SOFTMAX, LOGISTIC, ARG_MAX or LOG_SOFTMAX,
one through a scoring op first, then the last in operator order (where none does, the last FULLY_CONNECTED,
with a note); its weight and bias dequantised as TensorFlow Lite computes them (an integer bias in float64);
and the label files a model with metadata carries in the zip archive appended to it, read only within a size
limit. The layout follows the schema of tensorflow/lite/schema/schema.fbs.
"""

from __future__ import annotations

import math
import re
import struct
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from auditor.errors import InputError
from auditor.loader.stores import TensorInfo, map_file
from auditor.question.head import Head

IDENTIFIER = b"TFL3"  # bytes 4..8 of every TensorFlow Lite flatbuffer

# BuiltinOperator codes this module reads; the names of the others are only shown in messages
FULLY_CONNECTED, DEQUANTIZE, DENSIFY = 9, 6, 124
_SCORING = {25: "SOFTMAX", 14: "LOGISTIC", 56: "ARG_MAX", 50: "LOG_SOFTMAX"}
# ops a head's output may pass through on its way to the scores without changing which class is largest
# (before and after its one scoring op, if any)
_LOGIT_STEPS = {22: "RESHAPE", 43: "SQUEEZE", 70: "EXPAND_DIMS", 114: "QUANTIZE", 6: "DEQUANTIZE"}
_OPERATOR_NAMES = {0: "ADD", 1: "AVERAGE_POOL_2D", 2: "CONCATENATION", 3: "CONV_2D", 4: "DEPTHWISE_CONV_2D",
                   9: "FULLY_CONNECTED", 17: "MAX_POOL_2D", 18: "MUL", 19: "RELU", 21: "RELU6", 28: "TANH", 32: "CUSTOM",
                   34: "PAD", 36: "GATHER", 39: "TRANSPOSE", 40: "MEAN", 41: "SUB", 42: "DIV", 45: "STRIDED_SLICE",
                   53: "CAST", 74: "SUM", 77: "SHAPE", 83: "PACK", 117: "HARD_SWISH", 124: "DENSIFY",
                   126: "BATCH_MATMUL", 150: "GELU", 197: "STABLEHLO_DOT_GENERAL", **_SCORING, **_LOGIT_STEPS}
_FULLY_CONNECTED_OPTIONS = 8  # the BuiltinOptions union's tag of FullyConnectedOptions
_ACTIVATIONS = {1: "RELU", 2: "RELU_N1_TO_1", 3: "RELU6", 4: "TANH", 5: "SIGN_BIT"}

# TensorType -> (name, numpy dtype stored little-endian, or None where numpy has no such type)
_TYPES = {0: ("float32", "<f4"), 1: ("float16", "<f2"), 2: ("int32", "<i4"), 3: ("uint8", "u1"), 4: ("int64", "<i8"),
          5: ("string", None), 6: ("bool", "?"), 7: ("int16", "<i2"), 8: ("complex64", "<c8"), 9: ("int8", "i1"),
          10: ("float64", "<f8"), 11: ("complex128", "<c16"), 12: ("uint64", "<u8"), 13: ("resource", None),
          14: ("variant", None), 15: ("uint32", "<u4"), 16: ("uint16", "<u2"), 17: ("int4", None),
          18: ("bfloat16", None)}
_QUANTISED_WEIGHTS = {"int8", "uint8"}
_FLOAT_WEIGHTS = {"float32", "float16"}
_INTEGER_ACTIVATIONS = {"int8", "uint8", "int16"}

# The most a label file inside the model's zip may declare, and all of them together: a label or vocabulary file
# holds a line per class, a few MB at most, while deflate packs a GiB of newlines into a MB. zipfile stops
# decompressing an entry at its declared size, so checking that size bounds what reading it can cost.
_LABEL_FILE_LIMIT = 64 << 20
_LINE = re.compile("[^\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029]+")  # a run str.splitlines() keeps in one line


def type_name(code: int) -> str:
    return _TYPES.get(code, (f"TensorType {code}", None))[0]


@dataclass
class _Quantization:
    scale: np.ndarray  # float32, empty when the tensor is not quantised
    zero_point: np.ndarray  # int64
    dimension: int  # the axis that per-channel scales run along


@dataclass
class _Tensor:
    index: int
    name: str
    shape: tuple[int, ...]
    type: int
    buffer: int
    quantization: _Quantization
    sparse: bool

    @property
    def dtype(self) -> str:
        return type_name(self.type)


@dataclass
class _Operator:
    index: int
    code: int
    custom: str | None
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    options_type: int
    options: int | None  # the position of its builtin options table

    @property
    def name(self) -> str:
        if self.custom is not None:
            return f"CUSTOM {self.custom!r}"
        return _OPERATOR_NAMES.get(self.code, f"builtin operator {self.code}")


@dataclass
class _Candidate:
    """A FULLY_CONNECTED whose weight is a constant, and whether its output reaches the subgraph's outputs."""

    operator: _Operator
    weight: _Tensor  # the constant the weight is read from
    unpacked_by: _Operator | None = None  # the DEQUANTIZE (or DENSIFY) between that constant and the product
    reaches: str | None = None  # how its output reaches the subgraph's outputs (None: it does not)
    score: int = 0  # 2 an output through a scoring op, 1 an output directly, 0 no output (an inner layer)
    names: set[str] = field(default_factory=set)  # what --weight may call it

    def describe(self) -> str:
        to = f" -> {self.reaches}" if self.reaches else ""
        return f"{self.weight.name} {list(self.weight.shape)} (operator #{self.operator.index}{to})"


class _Flatbuffer:
    """Bounds-checked reads of a flatbuffer: every position is checked against the file's size before it is read."""

    def __init__(self, data, size: int, path: Path):
        self.data, self.size, self.path = data, size, path

    def fail(self, what: str, start: int, end: int) -> InputError:
        if start < 0:
            return InputError(f"{self.path}: a damaged TensorFlow Lite model ({what} would start before the file)")
        return InputError(f"{self.path}: a truncated TensorFlow Lite model ({what} ends at byte {end}, "
                          f"the file has {self.size})")

    def check(self, start: int, length: int, what: str) -> None:
        if start < 0 or start + length > self.size:
            raise self.fail(what, start, start + length)

    def scalar(self, fmt: str, at: int, what: str):
        self.check(at, struct.calcsize(fmt), what)
        return struct.unpack_from(fmt, self.data, at)[0]

    def table(self, at: int, what: str) -> _Table:
        vtable = at - self.scalar("<i", at, what)  # a table starts with the signed distance back to its vtable
        vtable_size = self.scalar("<H", vtable, f"{what}'s vtable")
        self.check(vtable, vtable_size, f"{what}'s vtable")
        return _Table(self, at, vtable, vtable_size, what)

    def array(self, start: int, count: int, dtype: str, what: str) -> np.ndarray:
        itemsize = np.dtype(dtype).itemsize
        self.check(start, count * itemsize, what)
        return np.frombuffer(self.data, dtype=dtype, count=count, offset=start)


class _Table:
    """One flatbuffer table: its fields by their index in the schema (the vtable's slots)."""

    def __init__(self, buffer: _Flatbuffer, at: int, vtable: int, vtable_size: int, what: str):
        self.buffer, self.at, self.vtable, self.vtable_size, self.what = buffer, at, vtable, vtable_size, what

    def position(self, index: int) -> int | None:
        slot = 4 + 2 * index
        if slot + 2 > self.vtable_size:  # a field added to the schema after this file was written
            return None
        offset = self.buffer.scalar("<H", self.vtable + slot, f"{self.what}'s vtable")
        return None if offset == 0 else self.at + offset

    def scalar(self, index: int, fmt: str, default, name: str):
        at = self.position(index)
        return default if at is None else self.buffer.scalar(fmt, at, f"{self.what}'s {name}")

    def target(self, index: int, name: str) -> int | None:
        at = self.position(index)
        if at is None:
            return None
        return at + self.buffer.scalar("<I", at, f"{self.what}'s {name}")

    def table(self, index: int, name: str) -> _Table | None:
        at = self.target(index, name)
        return None if at is None else self.buffer.table(at, f"{self.what}'s {name}")

    def vector(self, index: int, name: str) -> tuple[int, int] | None:
        """(where the elements start, how many there are) of a vector field."""
        at = self.target(index, name)
        if at is None:
            return None
        return at + 4, self.buffer.scalar("<I", at, f"{self.what}'s {name}")

    def numbers(self, index: int, dtype: str, name: str) -> np.ndarray:
        found = self.vector(index, name)
        if found is None:
            return np.zeros(0, dtype=dtype)
        return self.buffer.array(*found, dtype, f"{self.what}'s {name}")

    def tables(self, index: int, name: str) -> list[_Table]:
        found = self.vector(index, name)
        if found is None:
            return []
        start, count = found
        offsets = self.buffer.array(start, count, "<u4", f"{self.what}'s {name}")
        return [self.buffer.table(start + 4 * i + int(offset), f"{name[:-1]} {i}") for i, offset in enumerate(offsets)]

    def string(self, index: int, name: str) -> str | None:
        found = self.vector(index, name)
        if found is None:
            return None
        start, length = found
        self.buffer.check(start, length + 1, f"{self.what}'s {name}")  # the string and its terminating zero
        return bytes(self.buffer.data[start:start + length]).decode("utf-8", errors="replace")


class TfliteStore:
    """A TensorFlow Lite model: its constants by name, and the head its first subgraph computes."""

    format = "tflite"

    def __init__(self, path: Path):
        self._path = path = Path(path)
        data = map_file(path, "TensorFlow Lite model")
        size = len(data)
        if size < 8:
            raise InputError(f"{path}: a truncated TensorFlow Lite model ({size} bytes, less than a flatbuffer's header)")
        if bytes(data[4:8]) != IDENTIFIER:
            raise InputError(f"{path}: not a TensorFlow Lite model (bytes 4..8 are {bytes(data[4:8])!r}, "
                             f"not {IDENTIFIER!r})")
        self._file = _Flatbuffer(data, size, path)
        model = self._file.table(self._file.scalar("<I", 0, "the root offset"), "the model")
        codes = [(max(code.scalar(0, "<b", 0, "deprecated_builtin_code"), code.scalar(3, "<i", 0, "builtin_code")),
                  code.string(1, "custom_code")) for code in model.tables(1, "operator_codes")]
        self._buffers = [self._buffer_extent(i, table) for i, table in enumerate(model.tables(4, "buffers"))]
        subgraphs = model.tables(2, "subgraphs")
        if not subgraphs:
            raise InputError(f"{path}: the TensorFlow Lite model has no subgraph")
        self._subgraphs = len(subgraphs)
        graph = subgraphs[0]
        self._tensors = [self._tensor(i, table) for i, table in enumerate(graph.tables(0, "tensors"))]
        self._inputs = self._indices(graph.numbers(1, "<i4", "inputs"), "the subgraph's inputs")
        self._outputs = self._indices(graph.numbers(2, "<i4", "outputs"), "the subgraph's outputs")
        self._operators = [self._operator(i, table, codes) for i, table in enumerate(graph.tables(3, "operators"))]
        self._producer = {out: op for op in self._operators for out in op.outputs if out >= 0}
        self._consumers: dict[int, list[_Operator]] = {}
        for op in self._operators:
            for tensor in dict.fromkeys(i for i in op.inputs if i >= 0):
                self._consumers.setdefault(tensor, []).append(op)

    # -- the structure ---------------------------------------------------------------------------------------

    def _buffer_extent(self, index: int, table: _Table) -> tuple[int, int] | None:
        """Where buffer ``index``'s bytes lie in the file (start, length); None when it holds none (a computed
        tensor's). Models over 2 GB keep them outside the flatbuffer, at Buffer.offset (from the file's start;
        the schema counts it only when above 1) for Buffer.size bytes."""
        what = f"buffer {index}"
        found = table.vector(0, "data")
        if found is not None and found[1] > 0:
            self._file.check(*found, what)
            return found
        offset, size = table.scalar(1, "<Q", 0, "offset"), table.scalar(2, "<Q", 0, "size")
        if offset > 1 and size > 0:
            self._file.check(offset, size, what)
            return offset, size
        return None

    def _tensor(self, index: int, table: _Table) -> _Tensor:
        name = table.string(3, "name") or f"tensor {index}"
        table.what = f"tensor {name!r}"
        shape = tuple(int(s) for s in table.numbers(0, "<i4", "shape"))
        buffer = table.scalar(2, "<I", 0, "buffer")
        if buffer >= len(self._buffers) and buffer != 0:  # a model may omit even the empty buffer 0
            raise InputError(f"{self._path}: a damaged TensorFlow Lite model (tensor {name!r} names buffer {buffer}, "
                             f"the model has {len(self._buffers)})")
        sparse = table.position(6) is not None
        if buffer < len(self._buffers) and self._buffers[buffer] is not None:
            self._check_shape(name, shape, sparse)
        quantization = _Quantization(np.zeros(0, np.float32), np.zeros(0, np.int64), 0)
        parameters = table.table(4, "quantization")
        if parameters is not None:
            quantization = _Quantization(parameters.numbers(2, "<f4", "scale").astype(np.float32),
                                         parameters.numbers(3, "<i8", "zero_point").astype(np.int64),
                                         parameters.scalar(6, "<i", 0, "quantized_dimension"))
        return _Tensor(index, name, shape, table.scalar(1, "<b", 0, "type"), buffer, quantization, sparse)

    def _check_shape(self, name: str, shape: tuple[int, ...], sparse: bool) -> None:
        """A constant's shape, which says how its bytes are read: no dimension negative (numpy would take -1 as
        "whatever is left", and two negatives multiply to a positive count that may match the buffer), and no
        more values than the file could hold, two a byte at the densest (int4), counted in Python ints, which
        cannot overflow. A sparse constant's shape is its dense one, so only its signs are checked. Computed
        tensors' shapes are never read (and an activation may well hold more values than the model has bytes)."""
        count = math.prod(shape)
        if any(s < 0 for s in shape) or (not sparse and count > 2 * self._file.size):
            raise InputError(f"{self._path}: a damaged TensorFlow Lite model (tensor {name!r} has shape "
                             f"{list(shape)})")

    def _indices(self, values: np.ndarray, what: str) -> tuple[int, ...]:
        """Tensor indices as listed by an operator or the subgraph, each checked (-1: an optional input left out)."""
        found = tuple(int(v) for v in values)
        wrong = [v for v in found if v < -1 or v >= len(self._tensors)]
        if wrong:
            raise InputError(f"{self._path}: a damaged TensorFlow Lite model ({what} name tensor {wrong[0]}, "
                             f"the subgraph has {len(self._tensors)})")
        return found

    def _operator(self, index: int, table: _Table, codes: list[tuple[int, str | None]]) -> _Operator:
        table.what = f"operator {index}"
        opcode = table.scalar(0, "<I", 0, "opcode_index")
        if opcode >= len(codes):
            raise InputError(f"{self._path}: a damaged TensorFlow Lite model (operator {index} has operator code "
                             f"{opcode}, the model lists {len(codes)})")
        code, custom = codes[opcode]
        options = table.target(4, "builtin_options")
        if options is not None:
            self._file.table(options, f"operator {index}'s builtin_options")  # checked now, read when it is the head
        return _Operator(index, code, custom if code == 32 else None,
                         self._indices(table.numbers(1, "<i4", "inputs"), f"operator {index}'s inputs"),
                         self._indices(table.numbers(2, "<i4", "outputs"), f"operator {index}'s outputs"),
                         table.scalar(3, "<B", 0, "builtin_options_type"), options)

    def _is_constant(self, index: int) -> bool:
        """Whether tensor ``index`` has data of its own (buffer 0, the empty one, is every computed tensor's)."""
        if index < 0:
            return False
        buffer = self._tensors[index].buffer
        return buffer < len(self._buffers) and self._buffers[buffer] is not None

    def _values(self, tensor: _Tensor) -> np.ndarray:
        """A constant tensor's stored values, a read-only view of the mapped file, in its shape."""
        dtype = _TYPES.get(tensor.type, (None, None))[1]
        if dtype is None:
            raise InputError(f"{self._path}: tensor {tensor.name!r} is {tensor.dtype}, which the auditor does not read")
        start, length = self._buffers[tensor.buffer]
        count = math.prod(tensor.shape)  # checked non-negative, and bounded by the file's size, with the table
        if count * np.dtype(dtype).itemsize != length:
            raise InputError(f"{self._path}: tensor {tensor.name!r} holds {length} bytes, its shape "
                             f"{list(tensor.shape)} of {tensor.dtype} needs {count * np.dtype(dtype).itemsize}")
        return self._file.array(start, count, dtype, f"tensor {tensor.name!r}").reshape(tensor.shape)

    def tensors(self) -> dict[str, TensorInfo]:
        """The constant tensors (those with data in a buffer) of the first subgraph, by name."""
        found = {}
        for tensor in self._tensors:
            if self._is_constant(tensor.index):
                found.setdefault(tensor.name, TensorInfo(tensor.name, tensor.shape, tensor.dtype))
        return found

    # -- the head --------------------------------------------------------------------------------------------

    def _constant_behind(self, index: int) -> tuple[_Tensor, _Operator | None] | None:
        """The constant a tensor is, or is unpacked from by a DEQUANTIZE (float16 or int8 weights) or DENSIFY
        (sparse ones); None when it is computed."""
        if index < 0:
            return None
        if self._is_constant(index):
            return self._tensors[index], None
        op = self._producer.get(index)
        if op is not None and op.code in (DEQUANTIZE, DENSIFY) and op.inputs and self._is_constant(op.inputs[0]):
            return self._tensors[op.inputs[0]], op
        return None

    def _candidate(self, op: _Operator) -> _Candidate | None:
        if op.code != FULLY_CONNECTED or len(op.inputs) < 2 or not op.outputs or op.outputs[0] < 0 or op.inputs[0] < 0:
            return None
        behind = self._constant_behind(op.inputs[1])
        if behind is None or self._is_constant(op.inputs[0]):
            return None
        weight, unpacked_by = behind
        found = _Candidate(op, weight, unpacked_by, names={weight.name, self._tensors[op.inputs[1]].name})
        self._follow(found)
        return found

    def _follow(self, head: _Candidate) -> None:
        """Whether the product's output reaches one of the subgraph's outputs as the model's scores: through steps
        that keep the logits (_LOGIT_STEPS), at most one scoring op (_SCORING), then such steps again. Anything
        else on the way (a MUL, an ADD, another product) makes it an inner layer: a squeeze-and-excite gate, a
        Dense(activation='sigmoid') whose LOGISTIC is multiplied into the features, reaches no output."""
        head.score = 0
        stack, seen = [(head.operator.outputs[0], "", None)], set()
        while stack:
            tensor, path, scored = stack.pop()  # scored: the scoring op passed, as the note names it
            if (tensor, scored is None) in seen:
                continue
            seen.add((tensor, scored is None))
            if tensor in self._outputs:
                if scored is None:
                    self._reach(head, f"the subgraph output {self._tensors[tensor].name!r}{path}", 1)
                else:
                    self._reach(head, scored, 2)
            for op in self._consumers.get(tensor, []):
                if op.inputs[0] != tensor or op.custom is not None or not op.outputs or op.outputs[0] < 0:
                    continue
                if op.code in _SCORING and scored is None:
                    stack.append((op.outputs[0], path, f"{_SCORING[op.code]} (operator #{op.index}){path}"))
                elif op.code in _LOGIT_STEPS:
                    step = _LOGIT_STEPS[op.code]
                    stack.append((op.outputs[0], f"{path}, through {step}" if path else f" through {step}", scored))

    @staticmethod
    def _reach(head: _Candidate, where: str, score: int) -> None:
        if score > head.score:
            head.reaches, head.score = where, score

    def _find_head(self, weight: str | None) -> _Candidate:
        heads = [found for found in map(self._candidate, self._operators) if found is not None]
        if weight is not None:
            named = [found for found in heads if weight in found.names]
            if not named:
                listed = "; ".join(found.describe() for found in heads) or "none"
                raise InputError(f"{self._path}: no FULLY_CONNECTED of the TensorFlow Lite model takes {weight!r} as "
                                 f"its weight (FULLY_CONNECTED weights: {listed})")
            return named[-1]
        if not heads:
            ops = ", ".join(dict.fromkeys(op.name for op in self._operators)) or "none"
            raise InputError(f"{self._path}: no classifier head found in the TensorFlow Lite model: no FULLY_CONNECTED "
                             f"operator with a constant weight in its first subgraph (its operators: {ops})")
        # through a scoring op first, then straight to an output; the last of those (operators are listed in
        # execution order); where none reaches an output, the last of all, nearest the output (read_head notes it)
        best = max(found.score for found in heads)
        return [found for found in heads if found.score == best][-1]

    def read_head(self, path: Path, weight: str | None, bias: str | None) -> Head:
        """The head as vocabulary x hidden (FULLY_CONNECTED keeps its weight as outputs x inputs), with its bias
        (``bias``: a constant's name, or "none")."""
        found = self._find_head(weight)
        op, constant = found.operator, found.weight
        notes: list[str] = []
        if weight is None and found.score == 0:
            notes.append("no FULLY_CONNECTED's output reaches the subgraph's outputs (directly, or through one "
                         "SOFTMAX, LOGISTIC, ARG_MAX or LOG_SOFTMAX, with only reshapes and (de)quantisation on the "
                         "way): the head read is the last one, nearest the output; --weight names another")
        activation = self._activation(op)
        if constant.sparse:
            raise InputError(f"{self._path}: the weight {constant.name!r} of FULLY_CONNECTED #{op.index} is sparse "
                             "(Tensor.sparsity): sparse weights are not supported")
        if len(constant.shape) != 2:
            raise InputError(f"{self._path}: the weight {constant.name!r} of FULLY_CONNECTED #{op.index} is "
                             f"{len(constant.shape)}-D {list(constant.shape)}, not outputs x inputs")
        activations = self._tensors[op.inputs[0]].dtype
        quantised_input = activations in _INTEGER_ACTIVATIONS
        matrix, stored, how = self._weight(constant, found, quantised_input, notes)
        vocabulary, hidden = matrix.shape
        if activation:
            notes.append(f"the FULLY_CONNECTED applies a fused {activation} to its output: the scores are "
                         f"{activation}(W z + b), monotone in the logits but with ties where it clips")
        bias_vector, bias_name = self._bias(found, bias, vocabulary, notes)
        head = Head(weight=matrix, bias=bias_vector, weight_name=constant.name, bias_name=bias_name, path=path,
                    source_format=self.format)
        where = f"operator #{op.index} of {len(self._operators)}"
        reaches = f" feeding {found.reaches}" if found.reaches else ""
        with_bias = f", bias {bias_name}" if bias_name else ", no bias"
        head.notes.append(f"the head is the TensorFlow Lite model's FULLY_CONNECTED ({where}){reaches}: weight "
                          f"{constant.name} ({stored}, {vocabulary} x {hidden}{how}){with_bias}")
        if self._subgraphs > 1:
            notes.append(f"the model has {self._subgraphs} subgraphs: the head was looked for in the first")
        head.notes += notes
        return head

    def _activation(self, op: _Operator) -> str | None:
        """The activation the FULLY_CONNECTED fuses onto its output (None: none); weights stored shuffled for a
        kernel are refused."""
        if op.options is None or op.options_type != _FULLY_CONNECTED_OPTIONS:
            return None
        options = self._file.table(op.options, f"operator {op.index}'s options")
        if options.scalar(1, "<b", 0, "weights_format") != 0:
            raise InputError(f"{self._path}: FULLY_CONNECTED #{op.index} keeps its weight in a shuffled layout "
                             "(weights_format SHUFFLED4x16INT8), which the auditor does not read")
        return _ACTIVATIONS.get(options.scalar(0, "<b", 0, "fused_activation_function"))

    def _weight(self, constant: _Tensor, found: _Candidate, quantised_input: bool,
                notes: list[str]) -> tuple[np.ndarray, str, str]:
        """The weight as the model uses it, how it is stored ("int8 per-channel ...") and how it was read."""
        op, stored = found.operator, constant.dtype
        if stored in _FLOAT_WEIGHTS:
            matrix = self._values(constant)
            if found.unpacked_by is not None:  # float16 -> float32 is exact, so the float16 values are the weight
                return matrix, stored, (f", behind DEQUANTIZE #{found.unpacked_by.index}: kept as {stored}, which it "
                                        "turns into float32 exactly")
            return matrix, stored, ""
        if stored not in _QUANTISED_WEIGHTS:
            raise InputError(f"{self._path}: the weight {constant.name!r} of FULLY_CONNECTED #{op.index} is {stored}: "
                             "the auditor reads float32, float16, int8 and uint8 weights")
        matrix, per = self._dequantised(constant)
        how = ", dequantised as (q - zero point) x scale in float32"
        if found.unpacked_by is not None:
            notes.append(f"the weight is dequantised by DEQUANTIZE #{found.unpacked_by.index} before the product: "
                         "read as it computes it")
        elif quantised_input:
            output = self._tensors[op.outputs[0]]
            q = output.quantization
            requantised = (f" to {output.dtype} (scale {float(q.scale[0]):g}, zero point {int(q.zero_point[0])})"
                           if q.scale.size and q.zero_point.size else f" to {output.dtype}")
            notes.append(f"the head is fully quantised ({self._tensors[op.inputs[0]].dtype} input, {constant.dtype} "
                         f"weight): the model computes the logits in integers and requantises them{requantised}, so "
                         "its scores are the dequantised head's logits rounded to that grid")
        else:
            notes.append(f"the FULLY_CONNECTED is hybrid ({constant.dtype} weight, float input): the runtime quantises "
                         "the input on the fly, so its logits are W z + b of the dequantised weight up to that rounding")
        return matrix, f"{stored} {per}", how

    def _dequantised(self, tensor: _Tensor) -> tuple[np.ndarray, str]:
        """(q - zero point) x scale, per tensor or per channel along the quantised dimension, in float32: TFLite's
        reference kernels round the exact product (at most 24 + 9 bits, held exactly in double) once to float32,
        and so does a float32 product of (q - zero point), exact in float32, and the float32 scale."""
        q = tensor.quantization
        values = self._values(tensor)
        if q.scale.size == 0:
            raise InputError(f"{self._path}: the {tensor.dtype} tensor {tensor.name!r} has no quantization scale")
        dimension = q.dimension if q.scale.size > 1 else 0
        channels = tensor.shape[dimension] if 0 <= dimension < len(tensor.shape) else -1
        if q.scale.size not in (1, channels) or q.zero_point.size not in (0, 1, q.scale.size):
            raise InputError(f"{self._path}: tensor {tensor.name!r} has {q.scale.size} scales and "
                             f"{q.zero_point.size} zero points for its shape {list(tensor.shape)}")
        broadcast = [1] * values.ndim
        if q.scale.size > 1:
            broadcast[dimension] = -1
        zero = q.zero_point.reshape(broadcast) if q.zero_point.size else 0
        integers = values.astype(np.int32) - np.asarray(zero, dtype=np.int32)
        with np.errstate(all="ignore"):  # a scale beyond float32 becomes infinite: the weights' check names it
            result = integers.astype(np.float32) * q.scale.reshape(broadcast)
        per = ("per-channel" + (f" along axis {dimension}" if dimension else "")) if q.scale.size > 1 else "per-tensor"
        return result, per

    def _bias(self, found: _Candidate, bias: str | None, vocabulary: int,
              notes: list[str]) -> tuple[np.ndarray | None, str | None]:
        op = found.operator
        if bias == "none":
            return None, None
        if bias is not None:
            named = [t for t in self._tensors if t.name == bias]
            behind = self._constant_behind(named[-1].index) if named else None
            if behind is None or math.prod(behind[0].shape) != vocabulary:
                raise InputError(f"{self._path}: --bias {bias!r} is not a constant of {vocabulary} values in the "
                                 "TensorFlow Lite model")
            return self._bias_values(behind[0], found, notes), behind[0].name
        index = op.inputs[2] if len(op.inputs) > 2 else -1
        if index < 0:
            return None, None
        behind = self._constant_behind(index)
        if behind is None:
            notes.append(f"the FULLY_CONNECTED's bias {self._tensors[index].name} is computed, not a constant: "
                         "the head is read without it")
            return None, None
        if math.prod(behind[0].shape) != vocabulary:
            raise InputError(f"{self._path}: the bias {behind[0].name!r} of FULLY_CONNECTED #{op.index} has "
                             f"{math.prod(behind[0].shape)} values for {vocabulary} outputs")
        return self._bias_values(behind[0], found, notes), behind[0].name

    def _bias_values(self, tensor: _Tensor, found: _Candidate, notes: list[str]) -> np.ndarray:
        """A bias as the logits get it: float as stored; an integer bias (int32, int64 with int16 activations) of a
        quantised product, in float64, as q x input scale x weight scale: the kernel adds q to the product's
        integer accumulator, whose scale that is (the multiplier it requantises with is computed from those two
        scales in double; the bias's own scale, which the converter sets to their float32 product, is only
        checked against it, loosely). The bias's own scale is used only where the product is not an integer
        one (its input has no single scale, or its weight is unpacked before it)."""
        if tensor.dtype in _FLOAT_WEIGHTS:
            return self._values(tensor).reshape(-1)
        if tensor.dtype not in ("int32", "int64"):
            raise InputError(f"{self._path}: the bias {tensor.name!r} is {tensor.dtype}: the auditor reads float32, "
                             "float16, int32 and int64 biases")
        values = self._values(tensor).reshape(-1)
        inputs = self._tensors[found.operator.inputs[0]].quantization.scale
        weights = found.weight.quantization.scale
        if found.unpacked_by is None and inputs.size == 1 and weights.size in (1, values.size):
            # float32 x float32 is exact in float64 (48 bits)
            scale, which = np.float64(inputs[0]) * weights.astype(np.float64), "input scale x weight scale"
        else:
            scale, which = tensor.quantization.scale.astype(np.float64), "its own scale"
            if scale.size == 0:
                raise InputError(f"{self._path}: the {tensor.dtype} bias {tensor.name!r} has no quantization scale")
        if scale.size not in (1, values.size):
            raise InputError(f"{self._path}: the bias {tensor.name!r} has {scale.size} scales for {values.size} values")
        # q x scale rounded once in float64 for an int32 q (twice for an int64 one past 2^53): relative error 2^-53,
        # where float32 would round q itself past 2^24
        notes.append(f"the bias {tensor.name} is {tensor.dtype}, dequantised as q x {which} in float64")
        return values.astype(np.float64) * scale

    # -- labels ----------------------------------------------------------------------------------------------

    def token_strings(self, rows: int) -> tuple[list[str | None] | None, str | None, list[str]]:
        """Labels the model carries: a model with TFLite metadata is also a zip archive of its associated files
        (appended after the flatbuffer). The first .txt file with one non-empty line per row, those with "label"
        in their name tried first; (None, None, []) when there is none. Entries are read only while their
        declared sizes are plausible (_LABEL_FILE_LIMIT), and their lines counted without splitting them all."""
        try:
            with zipfile.ZipFile(self._path) as archive:
                entries = [info for info in archive.infolist()
                           if not info.is_dir() and info.filename.lower().endswith(".txt")]
                entries.sort(key=lambda info: "label" not in info.filename.lower())  # stable: the archive's order
                budget = _LABEL_FILE_LIMIT
                for info in entries:
                    if (info.file_size > budget or info.compress_size > self._file.size
                            or info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED)):
                        continue  # a bomb, sizes no label file has, or a method that inflates without a limit
                    # a stream stops at the declared size, inflating in bounded chunks; archive.read(info) would
                    # inflate the whole entry first, however large it really is
                    with archive.open(info) as stream:
                        raw = stream.read(info.file_size)
                    budget -= len(raw)
                    lines = _lines(raw.decode("utf-8", errors="replace"), rows)
                    if lines is not None:
                        note = (f"token strings from {info.filename}, the label file the TensorFlow Lite model "
                                f"carries ({rows} lines)")
                        return lines, f"{info.filename} inside the model", [note]
        # not an archive, or a damaged one: the model simply carries no labels we can read
        except (zipfile.BadZipFile, zlib.error, OSError, EOFError, ValueError, KeyError, RuntimeError,
                NotImplementedError):
            pass
        return None, None, []


def _lines(text: str, rows: int) -> list[str | None] | None:
    """The non-empty lines of ``text`` (as str.splitlines() splits it) when there are exactly ``rows`` of them, else
    None: found one at a time, so a file of a billion lines is given up after ``rows`` + 1."""
    lines: list[str | None] = []
    for match in _LINE.finditer(text):
        line = match.group()
        if line.strip():
            if len(lines) == rows:
                return None
            lines.append(line)
    return lines if len(lines) == rows else None
