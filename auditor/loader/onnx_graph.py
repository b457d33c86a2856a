"""An ONNX model's graph, read and never run: its constants, and the values the graph computes from them.

A head's weight, bias and scales are constants the graph may pass through a few ops before a product uses
them (Transpose, Cast, Reshape, DequantizeLinear, ...): a chain from one constant. A chain's value comes
out as the graph computes it: DequantizeLinear's (value - zero point) x scale, rounded once in the scale's
type (float32 mostly), per tensor, per axis or per block. Constants kept as external data are read from
files inside the model's folder only, so a model cannot make the auditor read a file elsewhere. Which
product is the head is for onnx_head.py.

``onnx`` is imported when a model is opened, never when the auditor is.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from auditor.errors import InputError
from auditor.loader.stores import TensorInfo

MISSING = "reading ONNX needs the onnx package: pip install 'auditor[onnx]'"

# ops a weight, bias or scale is computed by from its constant
_CONSTANT_STEPS = {"Identity", "Cast", "Transpose", "DequantizeLinear", "Reshape", "Squeeze", "Unsqueeze",
                   "Flatten"}
FLOAT_CASTS = {1, 10, 11, 16}  # FLOAT, FLOAT16, DOUBLE, BFLOAT16


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
class Chain:
    """A value computed from one constant by the ops ``steps`` (in the order they apply)."""

    constant: str
    steps: list
    names: tuple[str, ...]  # every value along it, the constant's included
    shape: tuple[int, ...]
    stored: tuple[int, ...]  # the constant's own shape

    @property
    def size(self) -> int:
        return math.prod(self.shape)


class OnnxGraph:
    """An ONNX model's graph: its constants by name, its metadata, and the values computed from its constants."""

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

    def _chain(self, value: str) -> Chain | None:
        """How ``value`` is computed from one constant, when it is (through _CONSTANT_STEPS); else None."""
        steps, names = [], [value]
        while not self._is_constant(value):
            node = self._producer.get(value)
            if node is None or node.op_type not in _CONSTANT_STEPS or not node.input or len(steps) > 32:
                return None
            if node.op_type in ("DequantizeLinear", "Reshape"):
                if not all(self._chain(name) is not None for name in node.input[1:] if name):
                    return None
            if node.op_type == "Cast" and node_attribute(node, "to", 1) not in FLOAT_CASTS:
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
        return Chain(value, steps, tuple(names), shape, stored)

    def _step_shape(self, node, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        op = node.op_type
        if op == "Transpose":
            perm = node_attribute(node, "perm", list(reversed(range(len(shape)))))
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

    def _evaluate(self, chain: Chain) -> np.ndarray:
        """The value of ``chain`` as the graph computes it (DequantizeLinear in float32, like ONNX).

        Overflow to infinity is left to the loader's check of non-finite weights (one line naming the
        tensor), so numpy's warnings are silenced here; a step the numbers do not fit (a permutation or a
        shape of the wrong size) is refused naming the file, the constant and the node."""
        value = self.get(chain.constant)
        for step in chain.steps:
            op = step.op_type
            where = f"{self._path}: {op} {step.name!r} on the constant {chain.constant!r}"
            try:
                with np.errstate(all="ignore"):
                    if op == "Transpose":
                        value = np.transpose(value, node_attribute(step, "perm", None))
                    elif op == "Cast":
                        value = value.astype(self._onnx.helper.tensor_dtype_to_np_dtype(node_attribute(step, "to", 1)))
                    elif op == "DequantizeLinear":
                        scale = self._evaluate(self._chain(step.input[1]))
                        zero = (self._evaluate(self._chain(step.input[2])) if len(step.input) > 2 and step.input[2]
                                else None)
                        value = dequantize(value, scale, zero, node_attribute(step, "axis", 1),
                                           node_attribute(step, "block_size", 0), where)
                    elif op in ("Reshape", "Squeeze", "Unsqueeze", "Flatten"):
                        value = value.reshape(self._step_shape(step, value.shape))
            except InputError:
                raise  # already names what it refuses (InputError is a ValueError)
            except (ValueError, TypeError) as error:
                raise InputError(f"{where}: {_first_line(error)}") from None
        return value


def node_attribute(node, name: str, default):
    """A node's attribute by name (ints and floats as lists), ``default`` when it has none."""
    for attribute in node.attribute:
        if attribute.name == name:
            from onnx import helper  # the store that holds the node imported it

            value = helper.get_attribute_value(attribute)
            return list(value) if isinstance(value, (list, tuple)) else value
    return default


def dequantize(value: np.ndarray, scale: np.ndarray, zero: np.ndarray | None, axis: int = 1,
               block_size: int = 0, where: str = "DequantizeLinear") -> np.ndarray:
    """ONNX's DequantizeLinear: (value - zero) x scale, per tensor (a scalar scale), per axis (a vector along
    ``axis``) or per block along ``axis``; the difference is exact in int32, the product rounds once, in the
    scale's type (float32 mostly). What the operator's specification forbids is refused, ``where`` naming the
    node: an axis outside [-r, r - 1] (per axis or per block), a negative block size, a scale or zero point of another shape than the
    quantisation asks for, or a zero point unlike the scale."""
    if value.dtype.kind not in "iu" and value.dtype.name not in ("int4", "uint4"):
        raise InputError(f"{where}: DequantizeLinear of {value.dtype} values is not supported (int8, uint8, int4, "
                         "... are)")
    rank = max(value.ndim, 1)
    if block_size < 0:
        raise InputError(f"{where}: block_size {block_size} is negative")
    if zero is not None and zero.shape != scale.shape and not (zero.size == 1 and scale.size == 1):
        raise InputError(f"{where}: the zero point's shape {list(zero.shape)} is not the scale's {list(scale.shape)}")
    if scale.size != 1 or scale.ndim > 1:  # per axis or per block: the axis counts (per tensor it is ignored)
        if not -rank <= axis <= rank - 1:
            raise InputError(f"{where}: axis {axis} is outside [{-rank}, {rank - 1}], which the operator allows for "
                             f"a tensor of rank {rank}")
        if value.ndim == 0:
            raise InputError(f"{where}: a scale of shape {list(scale.shape)} for a single value")
        axis = axis % rank
        if block_size:
            wanted = list(value.shape)
            wanted[axis] = -(-value.shape[axis] // block_size)
            if list(scale.shape) != wanted:
                raise InputError(f"{where}: a blocked scale of shape {list(scale.shape)}, where blocks of "
                                 f"{block_size} along axis {axis} of {list(value.shape)} need {wanted}")
        elif scale.ndim != 1 or scale.size != value.shape[axis]:
            raise InputError(f"{where}: a scale of shape {list(scale.shape)}, neither one value nor one per entry of "
                             f"axis {axis} ({value.shape[axis]}) of the {list(value.shape)} values")

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

