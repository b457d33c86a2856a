"""TensorFlow Lite models: the head read back from flatbuffers written by the schema's own generated builder
(the ``tflite`` package), as stored, dequantised as TFLite computes it; damaged files refused in one line."""

from __future__ import annotations

import os
import tracemalloc
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from auditor.errors import InputError
from auditor.loader import tflite_model
from auditor.loader.tflite_model import TfliteStore

tflite = pytest.importorskip("tflite")  # the schema's generated builder writes the models
flatbuffers = pytest.importorskip("flatbuffers")

# TensorType and BuiltinOperator codes, as the schema numbers them
FLOAT32, FLOAT16, INT32, UINT8, INT8, INT4 = 0, 1, 2, 3, 9, 17
CONV_2D, DEQUANTIZE, FULLY_CONNECTED, LOGISTIC, MUL, RESHAPE, SOFTMAX = 3, 6, 9, 14, 18, 22, 25
RELU = 1

VOCABULARY, HIDDEN = 6, 4


@dataclass
class T:
    """A tensor of the model to write: constant when it has data."""

    name: str
    shape: tuple[int, ...]
    type: int = FLOAT32
    data: np.ndarray | None = None
    scale: list[float] | None = None
    zero_point: list[int] | None = None
    dimension: int = 0
    sparse: bool = False

    def scale_array(self) -> np.ndarray:
        """The scales as the model stores them (float32), widened to float64."""
        return np.array(self.scale, np.float32).astype(np.float64)


@dataclass
class Op:
    code: int
    inputs: list[int]
    outputs: list[int]
    activation: int | None = None  # a FULLY_CONNECTED's fused activation (its options written when set)
    weights_format: int = 0


@dataclass
class Model:
    tensors: list[T]
    ops: list[Op]
    inputs: list[int]
    outputs: list[int]
    codes: str = "both"  # which OperatorCode fields hold the code: "both", "deprecated" (old files) or "builtin"
    external: bool = False  # buffers outside the flatbuffer, at Buffer.offset/size (models over 2 GB)
    extra: list[str] = field(default_factory=list)

    def bytes(self) -> bytes:
        if not self.external:
            return self._build(None)
        constants = [t.data for t in self.tensors if t.data is not None]
        # the offsets are uint64 fields: their values do not change the flatbuffer's size, so a first build tells
        # where the data will start (with nonzero offsets: the builder leaves fields at their default out)
        start = len(self._build([2] * len(constants)))
        start += -start % 16
        offsets, at = [], start
        for data in constants:
            offsets.append(at)
            at += data.nbytes
        built = self._build(offsets)
        assert len(built) + -len(built) % 16 == start
        return built + b"\0" * (start - len(built)) + b"".join(data.tobytes() for data in constants)

    def _build(self, offsets: list[int] | None) -> bytes:
        b = flatbuffers.Builder(1024)
        constants = [t for t in self.tensors if t.data is not None]
        # the data first: the builder writes back to front, so the first constant's bytes end the file
        data = [None if offsets is not None else b.CreateNumpyVector(np.frombuffer(t.data.tobytes(), np.uint8))
                for t in constants]
        buffers = []
        tflite.BufferStart(b)
        buffers.append(tflite.BufferEnd(b))  # buffer 0: the empty one computed tensors point at
        for i, t in enumerate(constants):
            tflite.BufferStart(b)
            if offsets is None:
                tflite.BufferAddData(b, data[i])
            else:
                tflite.BufferAddOffset(b, offsets[i])
                tflite.BufferAddSize(b, t.data.nbytes)
            buffers.append(tflite.BufferEnd(b))
        tensors = []
        for t in self.tensors:
            name, shape = b.CreateString(t.name), b.CreateNumpyVector(np.array(t.shape, np.int32))
            quantization = sparsity = None
            if t.scale is not None:
                scale = b.CreateNumpyVector(np.array(t.scale, np.float32))
                zero = b.CreateNumpyVector(np.array(t.zero_point or [0] * len(t.scale), np.int64))
                tflite.QuantizationParametersStart(b)
                tflite.QuantizationParametersAddScale(b, scale)
                tflite.QuantizationParametersAddZeroPoint(b, zero)
                tflite.QuantizationParametersAddQuantizedDimension(b, t.dimension)
                quantization = tflite.QuantizationParametersEnd(b)
            if t.sparse:
                tflite.SparsityParametersStart(b)
                sparsity = tflite.SparsityParametersEnd(b)
            tflite.TensorStart(b)
            tflite.TensorAddShape(b, shape)
            tflite.TensorAddType(b, t.type)
            tflite.TensorAddBuffer(b, 1 + constants.index(t) if t.data is not None else 0)
            tflite.TensorAddName(b, name)
            if quantization is not None:
                tflite.TensorAddQuantization(b, quantization)
            if sparsity is not None:
                tflite.TensorAddSparsity(b, sparsity)
            tensors.append(tflite.TensorEnd(b))
        codes = list(dict.fromkeys(op.code for op in self.ops))
        operators = []
        for op in self.ops:
            inputs = b.CreateNumpyVector(np.array(op.inputs, np.int32))
            outputs = b.CreateNumpyVector(np.array(op.outputs, np.int32))
            options = None
            if op.activation is not None:
                tflite.FullyConnectedOptionsStart(b)
                tflite.FullyConnectedOptionsAddFusedActivationFunction(b, op.activation)
                tflite.FullyConnectedOptionsAddWeightsFormat(b, op.weights_format)
                options = tflite.FullyConnectedOptionsEnd(b)
            tflite.OperatorStart(b)
            tflite.OperatorAddOpcodeIndex(b, codes.index(op.code))
            tflite.OperatorAddInputs(b, inputs)
            tflite.OperatorAddOutputs(b, outputs)
            if options is not None:
                tflite.OperatorAddBuiltinOptionsType(b, tflite.BuiltinOptions.FullyConnectedOptions)
                tflite.OperatorAddBuiltinOptions(b, options)
            operators.append(tflite.OperatorEnd(b))
        operator_codes = []
        for code in codes:
            tflite.OperatorCodeStart(b)
            if self.codes in ("both", "deprecated"):
                tflite.OperatorCodeAddDeprecatedBuiltinCode(b, min(code, 127))
            if self.codes in ("both", "builtin"):
                tflite.OperatorCodeAddBuiltinCode(b, code)
            tflite.OperatorCodeAddVersion(b, 1)
            operator_codes.append(tflite.OperatorCodeEnd(b))

        def tables(items):
            b.StartVector(4, len(items), 4)
            for item in reversed(items):
                b.PrependUOffsetTRelative(item)
            return b.EndVector()

        graph_tensors, graph_operators = tables(tensors), tables(operators)
        graph_inputs = b.CreateNumpyVector(np.array(self.inputs, np.int32))
        graph_outputs = b.CreateNumpyVector(np.array(self.outputs, np.int32))
        tflite.SubGraphStart(b)
        tflite.SubGraphAddTensors(b, graph_tensors)
        tflite.SubGraphAddInputs(b, graph_inputs)
        tflite.SubGraphAddOutputs(b, graph_outputs)
        tflite.SubGraphAddOperators(b, graph_operators)
        subgraph = tflite.SubGraphEnd(b)
        model_codes, subgraphs, model_buffers = tables(operator_codes), tables([subgraph]), tables(buffers)
        description = b.CreateString("written by test_tflite")
        tflite.ModelStart(b)
        tflite.ModelAddVersion(b, 3)
        tflite.ModelAddOperatorCodes(b, model_codes)
        tflite.ModelAddSubgraphs(b, subgraphs)
        tflite.ModelAddDescription(b, description)
        tflite.ModelAddBuffers(b, model_buffers)
        b.Finish(tflite.ModelEnd(b), file_identifier=b"TFL3")
        return bytes(b.Output())


def _rng(seed=0):
    return np.random.default_rng(seed)


def _float_head(dtype=np.float32, seed=0):
    rng = _rng(seed)
    return (rng.standard_normal((VOCABULARY, HIDDEN)).astype(dtype),
            rng.standard_normal(VOCABULARY).astype(dtype))


def _classifier(weight: T, bias: T | None, before: list[T] | None = None, unpack: list[Op] | None = None,
                weight_at: int | None = None, bias_at: int | None = None, **model) -> Model:
    """input -> FULLY_CONNECTED -> SOFTMAX, the weight and bias as given (tensors 3.. hold ``before``, unpacked by
    ``unpack`` into the tensors at ``weight_at`` and ``bias_at``)."""
    tensors = [T("input", (1, HIDDEN)), T("logits", (1, VOCABULARY)), T("probabilities", (1, VOCABULARY)),
               weight, *([bias] if bias is not None else []), *(before or [])]
    w = 3 if weight_at is None else weight_at
    b = (4 if bias is not None else -1) if bias_at is None else bias_at
    ops = [*(unpack or []), Op(FULLY_CONNECTED, [0, w, b], [1], activation=0), Op(SOFTMAX, [1], [2])]
    return Model(tensors, ops, [0], [2], **model)


def _write(tmp_path: Path, model: Model | bytes, name="model.tflite") -> Path:
    path = tmp_path / name
    path.write_bytes(model if isinstance(model, bytes) else model.bytes())
    return path


def _head(path: Path, weight=None, bias=None):
    return TfliteStore(path).read_head(path, weight, bias)


def test_float32_head_and_bias_read_exactly(tmp_path):
    w, b = _float_head()
    path = _write(tmp_path, _classifier(T("dense/kernel", w.shape, data=w), T("dense/bias", b.shape, data=b)))
    head = _head(path)
    assert head.weight.dtype == np.float32 and np.array_equal(head.weight, w)
    assert head.bias.dtype == np.float32 and np.array_equal(head.bias, b)
    assert (head.weight_name, head.bias_name, head.source_format, head.path) == ("dense/kernel", "dense/bias",
                                                                                  "tflite", path)
    assert head.notes[0].startswith("the head is the TensorFlow Lite model's FULLY_CONNECTED (operator #0 of 2) "
                                    "feeding SOFTMAX (operator #1): weight dense/kernel (float32, 6 x 4)")


@pytest.mark.parametrize("codes", ["deprecated", "builtin"])
def test_operator_code_read_from_either_field(tmp_path, codes):
    w, b = _float_head(seed=1)
    path = _write(tmp_path, _classifier(T("w", w.shape, data=w), T("b", b.shape, data=b), codes=codes))
    assert np.array_equal(_head(path).weight, w)


def test_buffers_outside_the_flatbuffer(tmp_path):
    w, b = _float_head(seed=2)
    path = _write(tmp_path, _classifier(T("w", w.shape, data=w), T("b", b.shape, data=b), external=True))
    head = _head(path)
    assert np.array_equal(head.weight, w) and np.array_equal(head.bias, b)


def test_float16_behind_dequantize_kept_as_float16(tmp_path):
    w, b = _float_head(np.float16, seed=3)
    # tensors 3, 4: the DEQUANTIZE outputs the product takes; 5, 6: the float16 constants
    model = _classifier(T("w/dequantized", w.shape), T("b/dequantized", b.shape),
                        before=[T("w", w.shape, FLOAT16, w), T("b", b.shape, FLOAT16, b)],
                        unpack=[Op(DEQUANTIZE, [5], [3]), Op(DEQUANTIZE, [6], [4])])
    path = _write(tmp_path, model)
    head = _head(path)
    assert head.weight.dtype == np.float16 and np.array_equal(head.weight, w)
    assert head.bias.dtype == np.float16 and np.array_equal(head.bias, b)
    assert (head.weight_name, head.bias_name) == ("w", "b")
    assert "behind DEQUANTIZE #0" in head.notes[0] and "operator #2 of 4" in head.notes[0]
    store = TfliteStore(path)
    assert {name: (info.shape, info.dtype) for name, info in store.tensors().items()} == {
        "w": ((VOCABULARY, HIDDEN), "float16"), "b": ((VOCABULARY,), "float16")}
    # --weight may name the constant or the tensor the product takes
    assert _head(path, weight="w/dequantized").weight_name == "w"


def _dequantised(q, scale, zero, axis_shape):
    """(q - zero point) x scale rounded once to float32 from the exact product (held exactly in float64)."""
    exact = (q.astype(np.float64) - np.asarray(zero, np.float64).reshape(axis_shape)) * \
        np.asarray(scale, np.float32).astype(np.float64).reshape(axis_shape)
    return exact.astype(np.float32)


def test_int8_per_channel_weight_dequantised(tmp_path):
    rng = _rng(4)
    q = rng.integers(-127, 128, (VOCABULARY, HIDDEN)).astype(np.int8)
    scale = list(rng.uniform(0.001, 0.1, VOCABULARY).astype(np.float32))
    b = rng.standard_normal(VOCABULARY).astype(np.float32)
    # hybrid: float input, int8 weight consumed directly by the product
    path = _write(tmp_path, _classifier(T("w", q.shape, INT8, q, scale=scale, zero_point=[0] * VOCABULARY),
                                        T("b", b.shape, data=b)))
    head = _head(path)
    assert head.weight.dtype == np.float32
    assert np.array_equal(head.weight, _dequantised(q, scale, 0, (-1, 1)))
    assert not np.array_equal(head.weight, q.astype(np.float32))
    assert np.array_equal(head.bias, b)
    assert "int8 per-channel, 6 x 4, dequantised as (q - zero point) x scale in float32" in head.notes[0]
    assert any("hybrid" in note for note in head.notes)


def test_uint8_per_tensor_weight_with_zero_point(tmp_path):
    rng = _rng(5)
    q = rng.integers(0, 256, (VOCABULARY, HIDDEN)).astype(np.uint8)
    weight = T("w", q.shape, UINT8, q, scale=[0.0173], zero_point=[131])
    model = _classifier(T("w/dequantized", q.shape), None, before=[weight], unpack=[Op(DEQUANTIZE, [4], [3])])
    head = _head(_write(tmp_path, model))
    assert np.array_equal(head.weight, _dequantised(q, [0.0173], 131, (1, 1)))
    assert head.bias is None and head.bias_name is None
    assert any("DEQUANTIZE #0" in note for note in head.notes)


def _fully_quantised(bias_scale: bool) -> tuple[Model, np.ndarray, np.ndarray, np.ndarray]:
    rng = _rng(6)
    input_scale = np.float32(0.05)
    q = rng.integers(-127, 128, (VOCABULARY, HIDDEN)).astype(np.int8)
    scale = rng.uniform(0.001, 0.1, VOCABULARY).astype(np.float32)
    # beyond float32's 24-bit integers, within 29 bits: q x scale (24 bits) is exact in float64
    qb = rng.integers(-2**29, 2**29, VOCABULARY).astype(np.int32)
    products = (input_scale * scale).astype(np.float32)  # as the converter stores the bias's scale
    tensors = [T("input", (1, HIDDEN), INT8, scale=[0.05], zero_point=[-3]),
               T("logits", (1, VOCABULARY), INT8, scale=[0.25], zero_point=[7]),
               T("probabilities", (1, VOCABULARY), INT8, scale=[1 / 256], zero_point=[-128]),
               T("w", q.shape, INT8, q, scale=list(scale)),
               T("b", qb.shape, INT32, qb, scale=list(products) if bias_scale else None)]
    model = Model(tensors, [Op(FULLY_CONNECTED, [0, 3, 4], [1], activation=0), Op(SOFTMAX, [1], [2])], [0], [2])
    expected_bias = (qb.astype(np.float64) * (products if bias_scale else input_scale * scale).astype(np.float64))
    return model, _dequantised(q, scale, 0, (-1, 1)), expected_bias, qb


@pytest.mark.parametrize("bias_scale", [True, False])
def test_fully_quantised_head(tmp_path, bias_scale):
    model, weight, _, qb = _fully_quantised(bias_scale)
    head = _head(_write(tmp_path, model))
    assert np.array_equal(head.weight, weight)
    # the kernel adds q to its int32 accumulator, whose scale is input scale x weight scale (exact in float64),
    # whatever the bias's own scale (the converter's float32 product): q x that, rounded once, kept in float64
    accumulator = np.float64(np.float32(0.05)) * model.tensors[3].scale_array()
    assert head.bias.dtype == np.float64 and np.array_equal(head.bias, qb.astype(np.float64) * accumulator)
    assert not np.allclose(head.bias, qb)
    assert any("dequantised as q x input scale x weight scale in float64" in note for note in head.notes)
    assert any("fully quantised" in note and "requantises them to int8 (scale 0.25, zero point 7)" in note
               for note in head.notes)


def _two_layers() -> tuple[Model, dict[str, np.ndarray]]:
    rng = _rng(7)
    arrays = {"w1": rng.standard_normal((HIDDEN, 3)).astype(np.float32),
              "b1": rng.standard_normal(HIDDEN).astype(np.float32),
              "w2": rng.standard_normal((VOCABULARY, HIDDEN)).astype(np.float32),
              "b2": rng.standard_normal(VOCABULARY).astype(np.float32),
              "other": rng.standard_normal(VOCABULARY).astype(np.float32)}
    tensors = [T("input", (1, 3)), T("hidden", (1, HIDDEN)), T("logits", (1, VOCABULARY)),
               T("flat", (VOCABULARY,)), T("probabilities", (VOCABULARY,)),
               *(T(name, a.shape, data=a) for name, a in arrays.items())]
    ops = [Op(FULLY_CONNECTED, [0, 5, 6], [1], activation=RELU), Op(FULLY_CONNECTED, [1, 7, 8], [2]),
           Op(RESHAPE, [2], [3]), Op(SOFTMAX, [3], [4])]
    return Model(tensors, ops, [0], [4]), arrays


def test_weight_option_chooses_the_fully_connected(tmp_path):
    model, arrays = _two_layers()
    path = _write(tmp_path, model)
    head = _head(path)  # the last, through RESHAPE to SOFTMAX
    assert np.array_equal(head.weight, arrays["w2"]) and np.array_equal(head.bias, arrays["b2"])
    assert "feeding SOFTMAX (operator #3) through RESHAPE" in head.notes[0]
    first = _head(path, weight="w1")
    assert np.array_equal(first.weight, arrays["w1"]) and np.array_equal(first.bias, arrays["b1"])
    assert any("fused RELU" in note for note in first.notes)
    with pytest.raises(InputError, match=r"takes 'nope' as its weight \(FULLY_CONNECTED weights: w1 \[4, 3\].*w2"):
        _head(path, weight="nope")


def test_bias_option(tmp_path):
    model, arrays = _two_layers()
    path = _write(tmp_path, model)
    assert _head(path, bias="none").bias is None
    other = _head(path, bias="other")
    assert other.bias_name == "other" and np.array_equal(other.bias, arrays["other"])
    with pytest.raises(InputError, match="--bias 'b1' is not a constant of 6 values"):
        _head(path, bias="b1")


def test_a_head_feeding_the_output_is_preferred_to_a_later_one_feeding_nothing(tmp_path):
    model, _ = _two_layers()
    model.tensors.append(T("side", (1, 2)))
    model.tensors.append(T("side/w", (2, 3), data=np.ones((2, 3), np.float32)))
    model.ops.append(Op(FULLY_CONNECTED, [0, len(model.tensors) - 1, -1], [len(model.tensors) - 2]))
    assert _head(_write(tmp_path, model)).weight_name == "w2"


def test_the_last_of_two_heads_of_the_same_standing(tmp_path):
    rng = _rng(13)
    first, second = (rng.standard_normal((VOCABULARY, HIDDEN)).astype(np.float32) for _ in range(2))
    tensors = [T("input", (1, HIDDEN)), T("first/logits", (1, VOCABULARY)), T("second/logits", (1, VOCABULARY)),
               T("first", first.shape, data=first), T("second", second.shape, data=second)]
    ops = [Op(FULLY_CONNECTED, [0, 3, -1], [1]), Op(FULLY_CONNECTED, [0, 4, -1], [2])]
    head = _head(_write(tmp_path, Model(tensors, ops, [0], [1, 2])))
    assert head.weight_name == "second" and np.array_equal(head.weight, second) and head.bias is None
    assert "feeding the subgraph output 'second/logits'" in head.notes[0]


def test_a_squeeze_excite_gate_is_not_the_head(tmp_path):
    """Dense(activation='sigmoid') -> LOGISTIC -> MUL into the features: the gate feeds a LOGISTIC, but its output
    reaches the subgraph's output only through the MUL, so the head is the product whose logits are the output."""
    rng = _rng(14)
    gate, head_w = rng.standard_normal((HIDDEN, HIDDEN)), rng.standard_normal((VOCABULARY, HIDDEN))
    tensors = [T("input", (1, HIDDEN)), T("se/w", gate.shape, data=gate.astype(np.float32)), T("se/out", (1, HIDDEN)),
               T("se/gate", (1, HIDDEN)), T("gated", (1, HIDDEN)), T("head/w", head_w.shape, data=head_w.astype(np.float32)),
               T("logits", (1, VOCABULARY))]
    ops = [Op(FULLY_CONNECTED, [0, 1, -1], [2]), Op(LOGISTIC, [2], [3]), Op(MUL, [0, 3], [4]),
           Op(FULLY_CONNECTED, [4, 5, -1], [6])]
    head = _head(_write(tmp_path, Model(tensors, ops, [0], [6])))
    assert head.weight_name == "head/w" and head.shape == (VOCABULARY, HIDDEN)
    assert "(operator #3 of 4) feeding the subgraph output 'logits'" in head.notes[0]


@pytest.mark.parametrize("after, chosen", [(RESHAPE, "first"), (SOFTMAX, "second"), (MUL, "second")])
def test_a_scoring_op_counts_on_the_way_to_an_output(tmp_path, after, chosen):
    """first -> SOFTMAX -> ``after`` -> output, second -> output: through one scoring op and then reshapes the first
    outranks the later one; a second scoring op or anything else on the way and it is no head."""
    rng = _rng(15)
    first, second = (rng.standard_normal((VOCABULARY, HIDDEN)).astype(np.float32) for _ in range(2))
    tensors = [T("input", (1, HIDDEN)), T("first", first.shape, data=first), T("first/logits", (1, VOCABULARY)),
               T("first/probabilities", (1, VOCABULARY)), T("first/out", (1, VOCABULARY)),
               T("second", second.shape, data=second), T("second/logits", (1, VOCABULARY))]
    ops = [Op(FULLY_CONNECTED, [0, 1, -1], [2]), Op(SOFTMAX, [2], [3]), Op(after, [3, 3], [4]),
           Op(FULLY_CONNECTED, [0, 5, -1], [6])]
    head = _head(_write(tmp_path, Model(tensors, ops, [0], [4, 6])))
    assert head.weight_name == chosen
    if chosen == "first":
        assert "feeding SOFTMAX (operator #1): weight first" in head.notes[0]


def test_no_head_reaching_an_output_falls_back_to_the_last(tmp_path):
    rng = _rng(16)
    first, second = (rng.standard_normal((VOCABULARY, HIDDEN)).astype(np.float32) for _ in range(2))
    tensors = [T("input", (1, HIDDEN)), T("first", first.shape, data=first), T("first/logits", (1, VOCABULARY)),
               T("second", second.shape, data=second), T("second/logits", (1, VOCABULARY)), T("out", (1, VOCABULARY))]
    ops = [Op(FULLY_CONNECTED, [0, 1, -1], [2]), Op(FULLY_CONNECTED, [0, 3, -1], [4]), Op(MUL, [2, 4], [5])]
    path = _write(tmp_path, Model(tensors, ops, [0], [5]))
    head = _head(path)
    assert head.weight_name == "second" and "(operator #1 of 3): weight second" in head.notes[0]
    assert any(note.startswith("no FULLY_CONNECTED's output reaches the subgraph's outputs") and "the last one" in note
               for note in head.notes)
    assert not any("reaches the subgraph's outputs" in note for note in _head(path, weight="first").notes)


@pytest.mark.parametrize("which, shape", [
    ("weight", (-VOCABULARY, -HIDDEN)),
    ("bias", (-1, -VOCABULARY)),
    ("bias", (70, 88801, 11239, 1056175639)),  # 6 values once the product wraps around int64
])
def test_impossible_constant_shapes_refused(tmp_path, which, shape):
    w, b = _float_head(seed=17)
    weight, bias = T("w", w.shape, data=w), T("b", b.shape, data=b)
    (weight if which == "weight" else bias).shape = shape
    path = _write(tmp_path, _classifier(weight, bias))
    name = "w" if which == "weight" else "b"
    with pytest.raises(InputError, match=rf"^{path}: a damaged TensorFlow Lite model \(tensor '{name}' has shape "
                                         rf"{list(shape)}\)$".replace("[", r"\[").replace("]", r"\]")):
        _every_read(path)


def test_unreadable_files(tmp_path):
    with pytest.raises(InputError, match=r"cannot read the TensorFlow Lite model \(No such file or directory\)$"):
        TfliteStore(tmp_path / "missing.tflite")
    with pytest.raises(InputError, match=r"cannot read the TensorFlow Lite model \(Is a directory\)$"):
        TfliteStore(tmp_path)
    with pytest.raises(InputError, match=r"truncated TensorFlow Lite model \(0 bytes, less than a flatbuffer's header"):
        TfliteStore(_write(tmp_path, b""))


def test_labels_from_the_zip_appended_to_the_model(tmp_path):
    w, b = _float_head(seed=8)
    path = _write(tmp_path, _classifier(T("w", w.shape, data=w), T("b", b.shape, data=b)))
    assert TfliteStore(path).token_strings(VOCABULARY) == (None, None, [])
    labels = [f"class {k}" for k in range(VOCABULARY)]
    with zipfile.ZipFile(path, "a") as archive:  # as TFLite Support's metadata writer packs associated files
        archive.writestr("vocab.txt", "\n".join(f"other {k}" for k in range(VOCABULARY)) + "\n")
        archive.writestr("labels.txt", "\n".join(labels) + "\n\n")
        archive.writestr("short.txt", "a\nb\n")
    store = TfliteStore(path)
    assert np.array_equal(store.read_head(path, None, None).weight, w)
    strings, source, notes = store.token_strings(VOCABULARY)
    assert strings == labels and source == "labels.txt inside the model" and "labels.txt" in notes[0]
    assert store.token_strings(VOCABULARY + 1) == (None, None, [])
    assert store.token_strings(2)[0] == ["a", "b"]


def _labelled(tmp_path: Path, files: dict[str, str]) -> Path:
    w, b = _float_head(seed=18)
    path = _write(tmp_path, _classifier(T("w", w.shape, data=w), T("b", b.shape, data=b)))
    with zipfile.ZipFile(path, "a", compression=zipfile.ZIP_DEFLATED) as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return path


def test_a_label_file_bomb_is_not_read(tmp_path):
    """The right labels, then 64 MiB of newlines (64 kB deflated): the entry declares more than a label file may,
    so it is skipped unread, where reading it took seconds and gigabytes per hundred MiB."""
    labels = [f"class {k}" for k in range(VOCABULARY)]
    path = _labelled(tmp_path, {"labels.txt": "\n".join(labels) + "\n" * (64 << 20)})
    assert path.stat().st_size < 1 << 20
    assert TfliteStore(path).token_strings(VOCABULARY) == (None, None, [])


def test_a_label_file_that_understates_its_size_is_read_no_further(tmp_path):
    """64 MiB of newlines after the labels, the central directory claiming 100 bytes: reading stops there, where
    inflating the whole entry first allocated all of it (a gigabyte per 500 MiB)."""
    labels = "\n".join(f"class {k}" for k in range(VOCABULARY)) + "\n"
    path = _labelled(tmp_path, {"labels.txt": labels + "\n" * (64 << 20)})
    data = bytearray(path.read_bytes())
    entry = data.index(b"PK\x01\x02")  # the central directory's entry: the uncompressed size at 24
    data[entry + 24:entry + 28] = (100).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    tracemalloc.start()
    try:
        assert TfliteStore(path).token_strings(VOCABULARY) == (None, None, [])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20  # allocations, counted exactly: a few buffers, not the entry's 64 MiB


def test_label_files_read_within_their_budget(tmp_path, monkeypatch):
    labels = "\n".join(f"class {k}" for k in range(VOCABULARY)) + "\n"
    path = _labelled(tmp_path, {"labels_a.txt": labels + "one too many\n", "labels_b.txt": labels,
                                "classes.txt": labels})
    store = TfliteStore(path)
    assert store.token_strings(VOCABULARY)[1] == "labels_b.txt inside the model"
    # labels_a.txt alone beyond the limit: skipped unread, labels_b.txt read
    monkeypatch.setattr(tflite_model, "_LABEL_FILE_LIMIT", len(labels) + 5)
    assert store.token_strings(VOCABULARY)[1] == "labels_b.txt inside the model"
    # each within it, but labels_a.txt, read (it does not fit), leaves too little for the others
    monkeypatch.setattr(tflite_model, "_LABEL_FILE_LIMIT", len(labels) + 20)
    assert store.token_strings(VOCABULARY) == (None, None, [])
    monkeypatch.undo()
    # a compressed size beyond the file's: labels_b.txt is not read, classes.txt is
    data = bytearray(path.read_bytes())
    entry = data.index(b"PK\x01\x02")  # the central directory's entries: the name at 46, compressed size at 20
    while data[entry + 46:entry + 58] != b"labels_b.txt":
        entry = data.index(b"PK\x01\x02", entry + 4)
    data[entry + 20:entry + 24] = (0x7FFFFFFF).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    assert TfliteStore(path).token_strings(VOCABULARY)[1] == "classes.txt inside the model"


def test_damaged_archive_gives_no_labels(tmp_path):
    w, b = _float_head(seed=9)
    data = _classifier(T("w", w.shape, data=w), T("b", b.shape, data=b)).bytes()
    path = _write(tmp_path, data)
    with zipfile.ZipFile(path, "a") as archive:
        archive.writestr("labels.txt", "\n".join(map(str, range(VOCABULARY))))
    damaged = bytearray(path.read_bytes())
    damaged[len(data) + 40:len(data) + 60] = b"\xff" * 20  # inside the stored file and its local header
    path.write_bytes(bytes(damaged))
    assert TfliteStore(path).token_strings(VOCABULARY) == (None, None, [])


def _every_read(path: Path):
    store = TfliteStore(path)
    store.tensors()
    store.read_head(path, None, None)


@pytest.mark.parametrize("kind", ["inline", "external", "float16"])
def test_every_truncation_refused_in_one_line(tmp_path, kind):
    w, b = _float_head(seed=10)
    if kind == "float16":
        model = _classifier(T("w/dequantized", w.shape), T("b", b.shape, data=b),
                            before=[T("w", w.shape, FLOAT16, w.astype(np.float16))], unpack=[Op(DEQUANTIZE, [5], [3])])
    else:
        model = _classifier(T("w", w.shape, data=w), T("b", b.shape, data=b), external=kind == "external")
    data = model.bytes()
    # no padding after the constants' data: every byte of the file is something the reader checks
    constants = [t.data.tobytes() for t in model.tensors if t.data is not None]
    assert data.endswith(b"".join(constants) if model.external else constants[0])
    path = tmp_path / "cut.tflite"
    path.write_bytes(data)
    _every_read(path)
    for cut in range(len(data) - 1, -1, -1):  # every cut, the file shortened in place (faster than rewriting it)
        os.truncate(path, cut)
        with pytest.raises(InputError) as error:
            _every_read(path)
        message = str(error.value)
        assert message.startswith(f"{path}: ") and "\n" not in message
        assert ("truncated" in message or "damaged" in message) if cut >= 8 else "truncated" in message


def test_truncated_message_names_the_buffer(tmp_path):
    w, b = _float_head(seed=11)
    data = _classifier(T("w", w.shape, data=w), T("b", b.shape, data=b)).bytes()
    path = _write(tmp_path, data[:-1])
    with pytest.raises(InputError, match=rf"truncated TensorFlow Lite model \(buffer 1 ends at byte {len(data)}, "
                                         rf"the file has {len(data) - 1}\)"):
        TfliteStore(path)


def test_corrupted_bytes_never_raise_anything_but_input_error(tmp_path):
    model, _ = _two_layers()
    data = model.bytes()
    rng = _rng(12)
    path = _write(tmp_path, data, "corrupt.tflite")
    refused = 0
    with open(path, "r+b") as file:
        for _ in range(300):
            places = rng.integers(8, len(data), 3)
            for at in places:  # a few bytes changed in place, put back after (faster than rewriting the file)
                file.seek(at)
                file.write(bytes([rng.integers(0, 256)]))
            file.flush()
            try:
                _every_read(path)
                TfliteStore(path).token_strings(VOCABULARY)
            except InputError as error:
                assert "\n" not in str(error)
                refused += 1
            for at in places:
                file.seek(at)
                file.write(data[at:at + 1])
    assert refused > 0


def test_wrong_identifier(tmp_path):
    w, b = _float_head()
    data = bytearray(_classifier(T("w", w.shape, data=w), T("b", b.shape, data=b)).bytes())
    data[4:8] = b"TFL2"
    with pytest.raises(InputError, match=r"not a TensorFlow Lite model \(bytes 4..8 are b'TFL2', not b'TFL3'\)"):
        TfliteStore(_write(tmp_path, bytes(data)))


def test_model_without_fully_connected(tmp_path):
    kernel = np.ones((2, 1, 1, HIDDEN), np.float32)
    model = Model([T("input", (1, 1, 1, HIDDEN)), T("kernel", kernel.shape, data=kernel), T("out", (1, 1, 1, 2)),
                   T("probabilities", (1, 1, 1, 2))],
                  [Op(CONV_2D, [0, 1, -1], [2]), Op(SOFTMAX, [2], [3])], [0], [3])
    path = _write(tmp_path, model)
    assert set(TfliteStore(path).tensors()) == {"kernel"}
    with pytest.raises(InputError, match=r"no FULLY_CONNECTED operator with a constant weight .*CONV_2D, SOFTMAX"):
        _head(path)


@pytest.mark.parametrize("change, message", [
    ({"sparse": True}, "is sparse"),
    ({"type": INT4, "data": np.zeros(VOCABULARY * HIDDEN // 2, np.uint8)}, "is int4: the auditor reads"),
    ({"shape": (VOCABULARY, HIDDEN, 1)}, r"is 3-D \[6, 4, 1\], not outputs x inputs"),
])
def test_weights_refused(tmp_path, change, message):
    w, b = _float_head()
    weight = T("w", w.shape, data=w)
    for key, value in change.items():
        setattr(weight, key, value)
    with pytest.raises(InputError, match=message):
        _head(_write(tmp_path, _classifier(weight, T("b", b.shape, data=b))))


def test_shuffled_weights_refused(tmp_path):
    w, b = _float_head()
    model = _classifier(T("w", w.shape, data=w), T("b", b.shape, data=b))
    model.ops[0].weights_format = 1
    with pytest.raises(InputError, match="shuffled layout"):
        _head(_write(tmp_path, model))
