"""ONNX models (the auditor[onnx] extra): the classifier head found from the graph's structure.

The head is a MatMul or Gemm (or a quantised MatMulInteger, or a Conv whose kernel covers one position:
the 1 x 1 convolutions that CTC recognisers such as PaddleOCR's end in) whose weight is a constant (an
initializer or a Constant node's output, possibly through Transpose, Cast or DequantizeLinear) and whose output
reaches a Softmax, LogSoftmax, ArgMax or a graph output through shape ops only (Reshape, Squeeze,
Identity, ...) and at most one Add of a constant: the bias. So it is the last such layer, the one that
computes the logits; the graph is read, never run. Its weight comes out as vocabulary x hidden
(X @ W with W hidden x vocabulary is transposed), quantised weights dequantised as the graph computes
them, in float32. The graph's constants, external data included, and the values computed from them are
read by onnx_graph.py; this module finds which product is the head and reads it out.

``onnx`` is imported when a model is opened, never when the auditor is.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from auditor.errors import InputError
from auditor.loader.onnx_graph import FLOAT_CASTS, Chain, OnnxGraph, node_attribute
from auditor.question.head import Head

PADDLE_CHARACTERS = "character"  # PaddleOCR / RapidOCR exports keep their character list under this key

_SCORING = {"Softmax", "LogSoftmax", "ArgMax"}
# ops a head's output passes through on the way to its scores; the reshaping ones may also move the
# vocabulary axis, so a graph output reached through them counts for less than a Softmax (KV caches)
_LOGIT_STEPS = {"Identity", "Cast", "Dropout", "Reshape", "Squeeze", "Unsqueeze", "Flatten", "Transpose"}
_RESHAPING = {"Reshape", "Unsqueeze", "Flatten", "Transpose"}
# integer matrix products: (weight input, its scale input or None when a Mul follows, zero point, bias)
_INTEGER = {"MatMulInteger": (1, None, 3, None), "DynamicQuantizeMatMul": (1, 2, 3, 4),
            "MatMulIntegerToFloat": (1, 3, 5, 6)}


@dataclass
class _Head:
    """A head the graph computes: the matrix product, its weight, and where its output goes."""

    node: object  # the MatMul, Gemm, integer product or pointwise Conv
    weight: Chain
    weight_on_left: bool  # W @ X (the weight is the product's first input): rows are already the vocabulary
    vocabulary: int
    scale: Chain | None = None  # an integer product's weight scale
    zero_point: Chain | None = None
    bias: Chain | None = None
    weight_scale: float = 1.0  # Gemm's alpha
    bias_scale: float = 1.0  # Gemm's beta
    reaches: str | None = None  # "Softmax 'softmax_5.tmp_0'", "the graph output 'logits'"
    score: int = -1  # 2 a scoring op, 1 a graph output, 0 one reached through reshapes
    notes: list[str] = field(default_factory=list)

    def describe(self) -> str:
        to = f" -> {self.reaches}" if self.reaches else ""
        return f"{self.weight.constant} {list(self.weight.stored)} ({self.node.op_type}{to})"


class OnnxStore(OnnxGraph):
    """An ONNX model: its constants by name, its metadata, and the head its graph computes."""

    format = "onnx"

    def _product(self, node) -> _Head | None:
        """The head computed by a MatMul, Gemm, integer product or pointwise Conv whose weight is a constant;
        else None."""
        op = node.op_type
        if op == "Conv":
            return self._pointwise(node)
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
        transposed = node_attribute(node, "transA" if on_left else "transB", 0) if op == "Gemm" else 0
        # rows of the product's weight as used: the vocabulary on the left (W @ X), columns on the right (X @ W)
        rows, columns = reversed(weight.shape) if transposed else weight.shape
        head = _Head(node, weight, on_left, rows if on_left else columns)
        if op == "Gemm":
            head.weight_scale, head.bias_scale = node_attribute(node, "alpha", 1.0), node_attribute(node, "beta", 1.0)
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

    def _pointwise(self, node) -> _Head | None:
        """A Conv whose kernel is one position wide in every spatial axis and whose channels form one group: at
        every position (padding's zeros included) it computes W x + b on the channels x, W = the kernel as
        vocabulary x hidden. Wider kernels and grouped channels mix positions or split the hidden state, and one
        output channel scores positions, not classes (a context block's attention: a Softmax over positions): None."""
        inputs = list(node.input) + [""] * 2
        weight = self._chain(inputs[1])
        if (self._is_constant(inputs[0]) or weight is None or len(weight.shape) < 3 or weight.shape[0] < 2
                or any(size != 1 for size in weight.shape[2:]) or node_attribute(node, "group", 1) != 1):
            return None
        head = _Head(node, weight, True, weight.shape[0])
        if inputs[2]:
            head.bias = self._chain(inputs[2])
            if head.bias is None or head.bias.size != head.vocabulary:
                return None
        self._follow(head, node.output[0])
        return head

    def _integer_scale(self, value: str) -> tuple[Chain, str] | None:
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
                    if op != "Cast" or node_attribute(node, "to", 1) in FLOAT_CASTS:
                        stack.append((node.output[0], bias, reshaped or op in _RESHAPING))
                elif op == "Add" and bias is None and len(node.input) == 2:
                    added = self._chain(node.input[1] if first else node.input[0])
                    if added is not None and added.size == head.vocabulary and self._on_classes(head, added, reshaped):
                        stack.append((node.output[0], added, reshaped))

    @staticmethod
    def _on_classes(head: _Head, added: Chain, reshaped: bool) -> bool:
        """Whether an Add of ``added`` lands one value per class: a Conv's output has its classes on axis 1,
        positions after them, so its bias must have one unit axis per position axis (1 x M x 1 ..., or M x 1 ...; a
        bias of M values alone would broadcast along the last position axis). After a reshape, as for a product's
        output, the classes are taken to be where the bias lines up."""
        if head.node.op_type != "Conv" or reshaped:
            return True
        spatial = len(head.weight.shape) - 2
        shape = list(added.shape)
        while len(shape) > spatial + 1 and shape[0] == 1:
            shape.pop(0)
        return shape == [head.vocabulary] + [1] * spatial

    @staticmethod
    def _reach(head: _Head, where: str, score: int, bias: Chain | None) -> None:
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
                raise InputError(f"{self._path}: no MatMul, Gemm or pointwise Conv of the ONNX graph takes {weight!r} "
                                 f"as its weight (heads found: {found}; --list-tensors lists the constants)")
            heads = named
        else:
            heads = [head for head in heads if head.reaches]
            if not heads:
                raise InputError(f"{self._path}: no classifier head found in the ONNX graph: no MatMul, Gemm or "
                                 "pointwise Conv with a constant weight feeds a Softmax, LogSoftmax, ArgMax or a graph "
                                 "output through shape ops and a bias Add")
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
        if found.node.op_type == "Conv":
            matrix = matrix.reshape(matrix.shape[:2])  # the kernel's positions are all 1 wide
        notes = []
        op, constant = found.node.op_type, found.weight.constant
        if op in _INTEGER:
            matrix = self._dequantised_product(found, matrix, notes)
        elif any(step.op_type == "DequantizeLinear" for step in found.weight.steps):
            notes.append(f"the weight {constant} is {self._stored_dtype(constant)}, dequantised as the graph's "
                         f"DequantizeLinear computes it: (weight - zero point) x scale, {matrix.dtype}")
        if op == "Gemm" and node_attribute(found.node, "transA" if found.weight_on_left else "transB", 0):
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
        with np.errstate(all="ignore"):  # a scale beyond float32 becomes infinite: the weights' check names it
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
        with np.errstate(all="ignore"):
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
