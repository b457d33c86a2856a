"""Kaldi nnet3 models (kaldi_model.py): small final.mdl and final.raw files written here byte by byte as Kaldi's
binary Write functions lay them out (base/io-funcs, matrix/kaldi-matrix, hmm/transition-model,
nnet3/nnet-nnet, nnet3/nnet-simple-component, nnet3/am-nnet-simple), independently of the reader; the head read
back exactly, the pdf-ids named from the tuples and a phones.txt, and bad files refused in one line."""

import math
import struct

import numpy as np
import pytest

from auditor.errors import InputError
from auditor.loader.kaldi_model import KaldiStore

N, D = 9, 5  # pdf-ids x the output layer's input


# --- Kaldi's binary basic I/O ---------------------------------------------------------------------------------

def tok(text):  # WriteToken: the token and one space
    return text.encode() + b" "


def i32(value):  # WriteBasicType<int32>: the size byte, then the value
    return b"\x04" + struct.pack("<i", value)


def f32(value):
    return b"\x04" + struct.pack("<f", value)


def f64(value):
    return b"\x08" + struct.pack("<d", value)


def boolean(value):  # WriteBasicType<bool>: one character
    return b"T" if value else b"F"


def ints(values, pairs=False):  # WriteIntegerVector / WriteIntegerPairVector
    values = np.asarray(values, "<i4").reshape(-1)
    return b"\x04" + struct.pack("<i", len(values) // (2 if pairs else 1)) + values.tobytes()


def matrix(m):  # Matrix::Write: FM or DM, rows, cols, the values row by row
    m = np.asarray(m)
    double = m.dtype == np.float64
    values = m.astype("<f8" if double else "<f4").tobytes()
    return tok("DM" if double else "FM") + i32(m.shape[0]) + i32(m.shape[1]) + values


def vector(v):  # Vector::Write: FV or DV, the dimension, the values
    v = np.asarray(v)
    double = v.dtype == np.float64
    return tok("DV" if double else "FV") + i32(len(v)) + v.astype("<f8" if double else "<f4").tobytes()


def compressed_cm2(rows, cols):  # CompressedMatrix::Write, kTwoByte: the header less its format, then uint16s
    return tok("CM2") + struct.pack("<ffii", -1.0, 2.0, rows, cols) + np.arange(rows * cols, dtype="<u2").tobytes()


# --- components, as their Write functions lay them out -----------------------------------------------------------

def natural_gradient_affine(w, b):
    return (tok("<NaturalGradientAffineComponent>") + tok("<MaxChange>") + f32(1.5) + tok("<LearningRate>")
            + f32(0.002) + tok("<LinearParams>") + matrix(w) + tok("<BiasParams>") + vector(b) + tok("<RankIn>")
            + i32(20) + tok("<RankOut>") + i32(80) + tok("<UpdatePeriod>") + i32(4) + tok("<NumSamplesHistory>")
            + f32(2000.0) + tok("<Alpha>") + f32(4.0) + tok("</NaturalGradientAffineComponent>"))


def fixed_affine(w, b):
    return (tok("<FixedAffineComponent>") + tok("<LinearParams>") + matrix(w) + tok("<BiasParams>") + vector(b)
            + tok("</FixedAffineComponent>"))


def linear(w, params=None):
    return (tok("<LinearComponent>") + tok("<LearningRateFactor>") + f32(0.5) + tok("<LearningRate>") + f32(0.001)
            + tok("<Params>") + (matrix(w) if params is None else params) + tok("<OrthonormalConstraint>")
            + f32(-1.0) + tok("<UseNaturalGradient>") + boolean(True) + tok("<RankInOut>") + i32(20) + i32(80)
            + tok("<Alpha>") + f32(4.0) + tok("<NumSamplesHistory>") + f32(2000.0) + tok("<UpdatePeriod>") + i32(4)
            + tok("</LinearComponent>"))


def tdnn(w, b, offsets):
    return (tok("<TdnnComponent>") + tok("<MaxChange>") + f32(0.75) + tok("<L2Regularize>") + f32(0.01)
            + tok("<LearningRate>") + f32(0.001) + tok("<TimeOffsets>") + ints(offsets) + tok("<LinearParams>")
            + matrix(w) + tok("<BiasParams>") + vector(b) + tok("<OrthonormalConstraint>") + f32(0.0)
            + tok("<UseNaturalGradient>") + boolean(True) + tok("<NumSamplesHistory>") + f32(2000.0)
            + tok("<AlphaInOut>") + f32(4.0) + f32(4.0) + tok("<RankInOut>") + i32(20) + i32(80)
            + tok("</TdnnComponent>"))


def nonlinear(kind, dim):  # NonlinearComponent::Write: the stats, count_ a double
    stats = vector(np.linspace(0, 1, dim).astype(np.float32))
    return (tok(f"<{kind}>") + tok("<Dim>") + i32(dim) + tok("<ValueAvg>") + stats + tok("<DerivAvg>") + stats
            + tok("<Count>") + f64(12.0) + tok("<OderivRms>") + stats + tok("<OderivCount>") + f64(12.0)
            + tok("<NumDimsSelfRepaired>") + f64(0.0) + tok("<NumDimsProcessed>") + f64(24.0)
            + tok("<SelfRepairScale>") + f32(1e-5) + tok(f"</{kind}>"))


def batchnorm(dim):
    return (tok("<BatchNormComponent>") + tok("<Dim>") + i32(dim) + tok("<BlockDim>") + i32(dim) + tok("<Epsilon>")
            + f32(0.001) + tok("<TargetRms>") + f32(1.0) + tok("<TestMode>") + boolean(False) + tok("<Count>")
            + f64(100.0) + tok("<StatsMean>") + vector(np.zeros(dim, np.float32)) + tok("<StatsVar>")
            + vector(np.ones(dim, np.float32)) + tok("</BatchNormComponent>"))


def dropout(dim):  # a token with no value: <Continuous>
    return (tok("<GeneralDropoutComponent>") + tok("<Dim>") + i32(dim) + tok("<BlockDim>") + i32(dim)
            + tok("<TimePeriod>") + i32(0) + tok("<DropoutProportion>") + f32(0.0) + tok("<Continuous>")
            + tok("</GeneralDropoutComponent>"))


def permute(column_map):  # an integer vector, whose values may hold a '<' byte (60)
    return tok("<PermuteComponent>") + tok("<ColumnMap>") + ints(column_map) + tok("</PermuteComponent>")


def nnet3(config_lines, components):
    body = b"".join(tok("<ComponentName>") + tok(name) + written for name, written in components)
    return (tok("<Nnet3>") + b"\n" + "".join(line + "\n" for line in config_lines).encode() + b"\n"
            + tok("<NumComponents>") + i32(len(components)) + body + tok("</Nnet3>"))


# --- a TransitionModel: a chain topology (one emitting state: forward pdf class 0, self-loop pdf class 1) ---------

PHONES = {1: "sil", 2: "a_B", 3: "a_E", 4: "k_I"}
# (phone, hmm state, forward pdf, self-loop pdf)
TUPLES = [(1, 0, 0, 1), (2, 0, 2, 3), (3, 0, 2, 4), (4, 0, 5, 6), (2, 0, 7, 8)]


def transition_model(tuples=TUPLES, phones=tuple(PHONES)):
    phone2idx = [-1] + [0] * max(phones)  # every phone uses entry 0
    entry = (i32(2) + i32(0) + i32(1) + i32(2) + i32(0) + f32(0.5) + i32(1) + f32(0.5)  # state 0: loop or leave
             + i32(-1) + i32(-1) + i32(0))  # state 1: final, no pdf
    topology = tok("<Topology>") + ints(phones) + ints(phone2idx) + i32(-1) + i32(1) + entry + tok("</Topology>")
    rows = b"".join(i32(v) for t in tuples for v in t)
    log_probs = vector(np.log(np.full(2 * len(tuples) + 1, 0.5, np.float32)))
    return (tok("<TransitionModel>") + topology + tok("<Tuples>") + i32(len(tuples)) + rows + tok("</Tuples>")
            + tok("<LogProbs>") + log_probs + tok("</LogProbs>") + tok("</TransitionModel>"))


def am_tail(priors):
    return tok("<LeftContext>") + i32(3) + tok("<RightContext>") + i32(3) + tok("<Priors>") + vector(priors)


CONFIG = ["input-node name=input dim=4",
          "component-node name=tdnn1.affine component=tdnn1.affine input=Append(Offset(input, -1), input)",
          "component-node name=tdnn1.relu component=tdnn1.relu input=tdnn1.affine",
          "component-node name=tdnn1.batchnorm component=tdnn1.batchnorm input=tdnn1.relu",
          "component-node name=tdnn1.dropout component=tdnn1.dropout input=tdnn1.batchnorm",
          "component-node name=tdnnf2.linear component=tdnnf2.linear input=tdnn1.dropout",
          "component-node name=tdnnf2.affine component=tdnnf2.affine input=tdnnf2.linear",
          "component-node name=permute component=permute input=tdnnf2.affine",
          "component-node name=output.affine component=output.affine input=permute",
          "output-node name=output input=output.affine objective=linear",
          "component-node name=output-xent.affine component=output-xent.affine input=permute",
          "component-node name=output-xent.log-softmax component=output-xent.log-softmax input=output-xent.affine",
          "output-node name=output-xent input=output-xent.log-softmax objective=linear"]


@pytest.fixture
def arrays():
    rng = np.random.default_rng(7)
    return {"tdnn1": (rng.standard_normal((6, 8)).astype(np.float32), rng.standard_normal(6).astype(np.float32)),
            "linear": rng.standard_normal((3, 6)).astype(np.float32),
            "tdnnf2": (rng.standard_normal((D, 9)).astype(np.float32), rng.standard_normal(D).astype(np.float32)),
            "output": (rng.standard_normal((N, D)).astype(np.float32), rng.standard_normal(N).astype(np.float32)),
            "xent": (rng.standard_normal((N, D)).astype(np.float32), rng.standard_normal(N).astype(np.float32))}


def components(a, output=None):
    return [("tdnn1.affine", fixed_affine(*a["tdnn1"])), ("tdnn1.relu", nonlinear("RectifiedLinearComponent", 6)),
            ("tdnn1.batchnorm", batchnorm(6)), ("tdnn1.dropout", dropout(6)), ("tdnnf2.linear", linear(a["linear"])),
            ("tdnnf2.affine", tdnn(*a["tdnnf2"], offsets=[-1, 0, 1])),
            ("permute", permute([60, 1, 2, 3, 0])),
            ("output.affine", output or natural_gradient_affine(*a["output"])),
            ("output-xent.affine", natural_gradient_affine(*a["xent"])),
            ("output-xent.log-softmax", nonlinear("LogSoftmaxComponent", N))]


def write_mdl(path, a, priors=(), output=None, config=CONFIG, parts=None):
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (b"\0B" + transition_model() + nnet3(config, parts or components(a, output))
            + am_tail(np.asarray(priors, np.float32)))
    path.write_bytes(data)
    return path


def write_phones(path):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("<eps> 0\n" + "".join(f"{name} {i}\n" for i, name in PHONES.items()) + "#0 5\n")


def raises_one_line(path, *calls):
    with pytest.raises(InputError) as error:
        store = KaldiStore(path)
        for call in calls:
            call(store)
    message = str(error.value)
    assert message.startswith(f"{path}: ") and "\n" not in message, message
    return message


# --- the head --------------------------------------------------------------------------------------------------

def test_the_head_is_output_affine_read_exactly(tmp_path, arrays):
    path = write_mdl(tmp_path / "final.mdl", arrays)
    store = KaldiStore(path)
    head = store.read_head(path, None, None)
    weight, bias = arrays["output"]
    assert head.weight.dtype == np.float32 and head.shape == (N, D)
    np.testing.assert_array_equal(head.weight, weight)
    np.testing.assert_array_equal(head.bias, bias)
    assert (head.weight_name, head.bias_name, head.source_format) == ("output.affine.LinearParams",
                                                                       "output.affine.BiasParams", "kaldi")
    assert head.notes[0] == ("the head is the Kaldi nnet3 component output.affine (NaturalGradientAffineComponent, "
                             f"{N} x {D}, bias {N}) feeding the output node 'output'")
    assert "no priors" in head.notes[1]


def test_a_float64_head_stays_float64(tmp_path, arrays):
    rng = np.random.default_rng(1)
    weight, bias = rng.standard_normal((N, D)), rng.standard_normal(N)  # float64: written as DM and DV
    path = write_mdl(tmp_path / "final.mdl", arrays, output=natural_gradient_affine(weight, bias))
    head = KaldiStore(path).read_head(path, None, None)
    assert head.weight.dtype == np.float64 and head.bias.dtype == np.float64
    np.testing.assert_array_equal(head.weight, weight)
    np.testing.assert_array_equal(head.bias, bias)


def test_tensors_are_listed_under_the_names_heads_report(tmp_path, arrays):
    """NAME.LinearParams (a LinearComponent's NAME.Params) and NAME.BiasParams: the names a head read from them
    reports, which --weight and --bias take back."""
    path = write_mdl(tmp_path / "final.mdl", arrays)
    store = KaldiStore(path)
    infos = {name: (info.shape, info.dtype) for name, info in store.tensors().items()}
    assert infos == {"tdnn1.affine.LinearParams": ((6, 8), "float32"), "tdnn1.affine.BiasParams": ((6,), "float32"),
                     "tdnnf2.linear.Params": ((3, 6), "float32"), "tdnnf2.affine.LinearParams": ((D, 9), "float32"),
                     "tdnnf2.affine.BiasParams": ((D,), "float32"), "output.affine.LinearParams": ((N, D), "float32"),
                     "output.affine.BiasParams": ((N,), "float32"),
                     "output-xent.affine.LinearParams": ((N, D), "float32"),
                     "output-xent.affine.BiasParams": ((N,), "float32")}
    for weight in (None, "tdnnf2.linear", "output-xent.affine"):
        head = store.read_head(path, weight, None)
        assert head.weight_name in infos and head.bias_name in (*infos, None)
        again = store.read_head(path, head.weight_name, head.bias_name or "none")
        np.testing.assert_array_equal(again.weight, head.weight)
        assert (again.weight_name, again.bias_name) == (head.weight_name, head.bias_name)
        if head.bias is not None:
            np.testing.assert_array_equal(again.bias, head.bias)


@pytest.mark.parametrize("name, expected", [("output-xent.affine", "xent"), ("tdnnf2.affine", "tdnnf2"),
                                            ("tdnn1.affine.LinearParams", "tdnn1"),
                                            ("output-xent.affine.LinearParams", "xent")])
def test_weight_chooses_another_component(tmp_path, arrays, name, expected):
    path = write_mdl(tmp_path / "final.mdl", arrays)
    head = KaldiStore(path).read_head(path, name, None)
    np.testing.assert_array_equal(head.weight, arrays[expected][0])
    np.testing.assert_array_equal(head.bias, arrays[expected][1])


@pytest.mark.parametrize("name", ["output.affine.Params", "output.affine.weight", "tdnnf2.linear.LinearParams",
                                  "output.affine.BiasParams"])
def test_weight_takes_only_the_matrixs_own_name(tmp_path, arrays, name):
    path = write_mdl(tmp_path / "final.mdl", arrays)
    assert f"no component {name!r}" in raises_one_line(path, lambda s: s.read_head(path, name, None))


def test_a_linear_component_has_no_bias_and_feeds_the_next_layer(tmp_path, arrays):
    path = write_mdl(tmp_path / "final.mdl", arrays)
    head = KaldiStore(path).read_head(path, "tdnnf2.linear", None)
    np.testing.assert_array_equal(head.weight, arrays["linear"])
    assert head.bias is None and head.bias_name is None and head.weight_name == "tdnnf2.linear.Params"
    assert head.notes[0].endswith("(LinearComponent, 3 x 6) feeding tdnnf2.affine (TdnnComponent)")


def test_bias_none_and_another_bias(tmp_path, arrays):
    path = write_mdl(tmp_path / "final.mdl", arrays)
    store = KaldiStore(path)
    head = store.read_head(path, None, "none")
    assert head.bias is None and head.bias_name is None
    for name in ("output-xent.affine.BiasParams", "output-xent.affine"):
        head = store.read_head(path, None, name)
        np.testing.assert_array_equal(head.bias, arrays["xent"][1])
        assert head.bias_name == "output-xent.affine.BiasParams"
    for name in ("tdnn1.affine.BiasParams", "output-xent.affine.bias", "output.affine.LinearParams",
                 "output.affine.BiasParams - log(Priors)", "-log(Priors)"):
        message = raises_one_line(path, lambda s, name=name: s.read_head(path, None, name))
        assert "with 9 outputs" in message or "the model has none" in message, message


LOG_SOFTMAX_CONFIG = ["input-node name=input dim=4",
                      "component-node name=final-affine component=final-affine input=input",
                      "component-node name=final-log-softmax component=final-log-softmax input=final-affine",
                      "output-node name=output input=final-log-softmax objective=linear"]


def test_the_default_head_feeds_the_output_node_and_the_priors_shift_its_bias(tmp_path, arrays):
    """An xent model (no output.affine here): the component feeding the output node through a log-softmax; its
    priors are subtracted in log by Kaldi's decodables, so the bias audited is b - log prior."""
    weight, bias = arrays["output"]
    parts = [("final-affine", natural_gradient_affine(weight, bias)),
             ("final-log-softmax", nonlinear("LogSoftmaxComponent", N))]
    priors = np.arange(1, N + 1, dtype=np.float32) / np.float32(N * (N + 1) / 2)
    path = write_mdl(tmp_path / "final.mdl", arrays, priors=priors, config=LOG_SOFTMAX_CONFIG, parts=parts)
    store = KaldiStore(path)
    head = store.read_head(path, None, None)
    np.testing.assert_array_equal(head.weight, weight)
    # b - log p in double precision (the priors as stored, float32): a float32 rounding is ~1e-7 off
    expected = [float(b) - math.log(float(p)) for b, p in zip(bias, priors)]
    assert head.bias.dtype == np.float64
    np.testing.assert_allclose(head.bias, expected, rtol=0, atol=1e-13)
    assert head.bias_name == "final-affine.BiasParams - log(Priors)"
    assert "feeding final-log-softmax (LogSoftmaxComponent) then the output node 'output'" in head.notes[0]
    assert "whose log Kaldi's decodables subtract" in head.notes[1] and "in float64" in head.notes[1]
    for name in (head.bias_name, "final-affine", "final-affine.BiasParams"):  # the report's name taken back
        again = store.read_head(path, head.weight_name, name)
        np.testing.assert_array_equal(again.bias, head.bias)
        assert again.bias_name == head.bias_name
    none = store.read_head(path, None, "none")
    assert none.bias is None and none.bias_name is None and "neither the bias nor the priors" in none.notes[1]


def test_priors_matching_a_head_that_is_not_the_output_are_refused(tmp_path, arrays):
    """output-xent.affine has as many rows as there are priors, but decoding reads the output node, which is
    output.affine's: its audit with its bias, without the priors, is refused unless --bias none says so."""
    priors = np.full(N, 1 / N, np.float32)
    path = write_mdl(tmp_path / "final.mdl", arrays, priors=priors)
    message = raises_one_line(path, lambda s: s.read_head(path, "output-xent.affine", None))
    assert "its values are not output-xent.affine's" in message
    assert "pass --weight output-xent.affine --bias none" in message
    head = KaldiStore(path).read_head(path, "output-xent.affine", "none")
    assert head.bias is None and "neither the bias nor the priors" in head.notes[1]
    other = KaldiStore(path).read_head(path, "tdnnf2.affine", None)  # D rows: the priors are not for it
    np.testing.assert_array_equal(other.bias, arrays["tdnnf2"][1])
    assert "not applied" in other.notes[1]


def xent_model(path, a, output_input, priors=None, kind="LogSoftmaxComponent"):
    """xconfig's output-layer with an output delay: output.affine, a log-softmax, and the output node reading
    the log-softmax through ``output_input`` (a descriptor); priors 1/N each unless given."""
    priors = np.full(N, 1 / N, np.float32) if priors is None else priors
    config = CONFIG[:8] + ["component-node name=output.affine component=output.affine input=permute",
                           "component-node name=output.log-softmax component=output.log-softmax input=output.affine",
                           f"output-node name=output input={output_input} objective=linear"]
    parts = components(a)[:8] + [("output.log-softmax", nonlinear(kind, N))]
    return write_mdl(path, a, priors=priors, config=config, parts=parts)


@pytest.mark.parametrize("descriptor", ["Offset(output.log-softmax, 5)", "Offset(output.log-softmax, -3, 1)",
                                        "Round(Offset(output.log-softmax, 2), 3)",
                                        "ReplaceIndex(Offset( output.log-softmax , 1 ), t, 0)"])
def test_priors_are_subtracted_through_an_output_delay(tmp_path, arrays, descriptor):
    """Offset, Round and ReplaceIndex copy rows of one node as they are (moved in time): the output node's
    values are still the head's, so decoding subtracts the log priors from them."""
    priors = np.linspace(1, 2, N).astype(np.float32) / np.float32(np.linspace(1, 2, N).sum())
    path = xent_model(tmp_path / "final.mdl", arrays, descriptor, priors)
    head = KaldiStore(path).read_head(path, None, None)
    assert head.bias_name == "output.affine.BiasParams - log(Priors)"
    expected = [float(b) - math.log(float(p)) for b, p in zip(arrays["output"][1], priors)]
    np.testing.assert_allclose(head.bias, expected, rtol=0, atol=1e-13)
    assert head.notes[0].endswith("feeding output.log-softmax (LogSoftmaxComponent) then the output node "
                                  f"'output' (input={descriptor})")


def test_the_default_head_is_found_through_an_output_delay(tmp_path, arrays):
    weight, bias = arrays["output"]
    parts = [("final-affine", natural_gradient_affine(weight, bias)),
             ("final-log-softmax", nonlinear("LogSoftmaxComponent", N))]
    config = LOG_SOFTMAX_CONFIG[:-1] + ["output-node name=output input=Offset(final-log-softmax, 5)"]
    path = write_mdl(tmp_path / "final.mdl", arrays, priors=np.full(N, 1 / N, np.float32), config=config,
                     parts=parts)
    head = KaldiStore(path).read_head(path, None, None)
    assert head.weight_name == "final-affine.LinearParams" and head.bias_name.endswith(" - log(Priors)")


@pytest.mark.parametrize("descriptor", ["Scale(2.0, output.log-softmax)", "IfDefined(output.log-softmax)",
                                        "Sum(output.log-softmax, output.log-softmax)",
                                        "Failover(output.log-softmax, output.affine)",
                                        "Offset(output.log-softmax, 1.5)",
                                        "Switch(output.log-softmax, output.log-softmax)",
                                        "Offset(output.log-softmax, 1))("])
def test_priors_are_refused_where_the_output_is_not_the_heads_rows(tmp_path, arrays, descriptor):
    path = xent_model(tmp_path / "final.mdl", arrays, descriptor)
    message = raises_one_line(path, lambda s: s.read_head(path, None, None))
    assert "its values are not output.affine's" in message and "--weight output.affine --bias none" in message
    head = KaldiStore(path).read_head(path, None, "none")
    assert head.bias is None and "neither the bias nor the priors" in head.notes[1]


def test_priors_after_a_softmax_are_refused(tmp_path, arrays):
    """Kaldi would subtract log priors from probabilities: not W x + b - log p, not a linear head."""
    path = xent_model(tmp_path / "final.mdl", arrays, "output.log-softmax", kind="SoftmaxComponent")
    message = raises_one_line(path, lambda s: s.read_head(path, None, None))
    assert "a SoftmaxComponent comes before it" in message and "--bias none" in message
    assert KaldiStore(path).read_head(path, "output.affine", "none").bias is None
    no_priors = xent_model(tmp_path / "chain.mdl", arrays, "output.log-softmax", priors=(), kind="SoftmaxComponent")
    np.testing.assert_array_equal(KaldiStore(no_priors).read_head(no_priors, None, None).bias, arrays["output"][1])


def test_a_prior_that_is_not_positive_is_refused(tmp_path, arrays):
    priors = np.r_[0, np.full(N - 1, 1 / (N - 1))].astype(np.float32)
    path = xent_model(tmp_path / "final.mdl", arrays, "output.log-softmax", priors)
    assert "prior 0 is 0.0, whose log is not finite" in raises_one_line(path, lambda s: s.read_head(path, None, None))


# --- token strings ---------------------------------------------------------------------------------------------

EXPECTED_STRINGS = ["pdf 0: sil/0", "pdf 1: sil/0:loop", "pdf 2: a_B/0 a_E/0", "pdf 3: a_B/0:loop",
                    "pdf 4: a_E/0:loop", "pdf 5: k_I/0", "pdf 6: k_I/0:loop", "pdf 7: a_B/0", "pdf 8: a_B/0:loop"]


def test_token_strings_from_the_tuples_and_phones_txt_beside_the_model(tmp_path, arrays):
    path = write_mdl(tmp_path / "final.mdl", arrays)
    write_phones(tmp_path / "phones.txt")
    strings, source, notes = KaldiStore(path).token_strings(N + 2)
    assert strings == EXPECTED_STRINGS + [None, None]
    assert "Tuples (5" in source and str(tmp_path / "phones.txt") in source
    assert notes == [f"the TransitionModel's Tuples use {N} pdf-ids, the head has {N + 2} rows"]


def test_token_strings_in_vosks_layout_and_by_phone_id(tmp_path, arrays):
    path = write_mdl(tmp_path / "model" / "am" / "final.mdl", arrays)
    strings, _, notes = KaldiStore(path).token_strings(N)
    assert strings[2] == "pdf 2: 2/0 3/0" and "no phones.txt" in notes[0]
    write_phones(tmp_path / "model" / "graph" / "phones.txt")
    strings, source, notes = KaldiStore(path).token_strings(N)
    assert strings == EXPECTED_STRINGS and notes == [] and "graph" in source


def test_a_phones_txt_of_another_phone_set_is_passed_over(tmp_path, arrays):
    """Phone 4 named "#0": a disambiguation symbol, so the file lists fewer phones than the model has."""
    path = write_mdl(tmp_path / "am" / "final.mdl", arrays)
    (tmp_path / "am" / "phones.txt").write_text("<eps> 0\nsil 1\na_B 2\na_E 3\n#0 4\n#1 5\n")
    strings, source, notes = KaldiStore(path).token_strings(N)
    assert strings[5] == "pdf 5: 4/0" and strings[2] == "pdf 2: 2/0 3/0" and source.endswith("phones by id")
    assert notes == [(f"{tmp_path / 'am' / 'phones.txt'} is not this model's phone set: of its 4 phones it names 1 "
                      "as disambiguation symbols or not at all (phone 4: #0): phones named by id")]
    write_phones(tmp_path / "graph" / "phones.txt")  # Vosk's place, looked in next
    strings, source, notes = KaldiStore(path).token_strings(N)
    assert strings == EXPECTED_STRINGS and str(tmp_path / "graph" / "phones.txt") in source and len(notes) == 1


def test_more_than_two_phones_are_counted(tmp_path, arrays):
    tuples = [(p, 0, 0, 1) for p in (4, 3, 2, 1)]
    path = tmp_path / "final.mdl"
    path.write_bytes(b"\0B" + transition_model(tuples) + nnet3(CONFIG, components(arrays)) + am_tail([]))
    write_phones(tmp_path / "phones.txt")
    strings, _, _ = KaldiStore(path).token_strings(3)
    assert strings == ["pdf 0: sil/0 a_B/0 +2 more", "pdf 1: sil/0:loop a_B/0:loop +2 more", None]


def hmm_transition_model(triples):
    """An older TransitionModel: a 3-state HMM topology (no -1 marker: one pdf class per state) and Triples."""
    states = b"".join(i32(s) + i32(2) + i32(s) + f32(0.75) + i32(s + 1) + f32(0.25) for s in range(3))
    entry = i32(4) + states + i32(-1) + i32(0)
    topology = (tok("<Topology>") + ints(list(PHONES)) + ints([-1] + [0] * len(PHONES)) + i32(1) + entry
                + tok("</Topology>"))
    rows = b"".join(i32(v) for t in triples for v in t)
    return (tok("<TransitionModel>") + topology + tok("<Triples>") + i32(len(triples)) + rows + tok("</Triples>")
            + tok("<LogProbs>") + vector(np.zeros(7, np.float32)) + tok("</LogProbs>") + tok("</TransitionModel>"))


def test_token_strings_from_an_hmms_triples(tmp_path, arrays):
    triples = [(1, 0, 0), (1, 1, 1), (1, 2, 2), (2, 0, 3), (2, 1, 4), (2, 2, 5), (3, 0, 3), (3, 1, 4), (3, 2, 6)]
    path = tmp_path / "final.mdl"
    path.write_bytes(b"\0B" + hmm_transition_model(triples) + nnet3(CONFIG, components(arrays)) + am_tail([]))
    write_phones(tmp_path / "phones.txt")
    strings, source, notes = KaldiStore(path).token_strings(7)
    assert strings == ["pdf 0: sil/0", "pdf 1: sil/1", "pdf 2: sil/2", "pdf 3: a_B/0 a_E/0", "pdf 4: a_B/1 a_E/1",
                       "pdf 5: a_B/2", "pdf 6: a_E/2"]
    assert "Triples (9" in source and notes == []


def test_the_loader_reads_a_vosk_model_folder(tmp_path, arrays):
    from auditor.loader import load_head

    path = write_mdl(tmp_path / "model" / "am" / "final.mdl", arrays)
    write_phones(tmp_path / "model" / "graph" / "phones.txt")
    head = load_head(path)
    assert head.source_format == "kaldi" and head.tokens == EXPECTED_STRINGS
    np.testing.assert_array_equal(head.weight, arrays["output"][0])


def test_a_raw_network_has_a_head_but_no_token_strings(tmp_path, arrays):
    path = tmp_path / "final.raw"
    path.write_bytes(b"\0B" + nnet3(CONFIG, components(arrays)))
    store = KaldiStore(path)
    head = store.read_head(path, None, None)
    np.testing.assert_array_equal(head.weight, arrays["output"][0])
    assert len(head.notes) == 1  # no priors to speak of
    strings, source, notes = store.token_strings(N)
    assert strings is None and source is None and "raw nnet3" in notes[0]


# --- refusals --------------------------------------------------------------------------------------------------

def test_every_truncation_is_refused_in_one_line(tmp_path, arrays):
    data = write_mdl(tmp_path / "whole.mdl", arrays, priors=np.full(N, 1 / N, np.float32)).read_bytes()
    header = data.index(b"<NumComponents>") + 30
    cuts = sorted(set(range(0, header, 11)) | set(range(header, len(data), 23)) | set(range(len(data) - 40, len(data))))
    for cut in cuts:
        path = tmp_path / f"cut{cut}.mdl"  # a new file each time: rewriting one is slow on some file systems
        path.write_bytes(data[:cut])
        raises_one_line(path)


def test_corrupt_bytes_never_raise_anything_but_an_input_error(tmp_path, arrays):
    data = bytearray(write_mdl(tmp_path / "whole.mdl", arrays, priors=np.full(N, 1 / N, np.float32)).read_bytes())
    rng = np.random.default_rng(0)
    for at in rng.integers(2, len(data), 150):
        corrupt = bytearray(data)
        corrupt[at] = int(rng.integers(0, 256))
        path = tmp_path / f"at{at}.mdl"
        path.write_bytes(bytes(corrupt))
        try:
            store = KaldiStore(path)
            head = store.read_head(path, None, None)
            store.token_strings(head.shape[0])
        except InputError as error:
            assert "\n" not in str(error)


@pytest.mark.parametrize("content, words", [
    (b"<TransitionModel> <Topology> ...", "nnet3-am-copy --binary=true"),
    (b"<Nnet3> \ninput-node name=input dim=4\n", "nnet3-copy --binary=true"),
    (b"\0Bnot kaldi at all", "<TransitionModel> or <Nnet3> expected"),
    (b"PK\x03\x04zip", "not a binary Kaldi nnet3 model"),
    (b"", "not a binary Kaldi nnet3 model")])
def test_text_mode_and_other_files_are_refused(tmp_path, content, words):
    path = tmp_path / "final.mdl"
    path.write_bytes(content)
    assert words in raises_one_line(path)


def test_a_file_that_cannot_be_opened_is_refused_in_the_shared_words(tmp_path):
    """stores.map_file's message: the reason once, the path not repeated."""
    assert raises_one_line(tmp_path / "missing.mdl") == (f"{tmp_path / 'missing.mdl'}: cannot read the Kaldi model "
                                                         "(No such file or directory)")
    assert raises_one_line(tmp_path) == f"{tmp_path}: cannot read the Kaldi model (Is a directory)"


def test_an_nnet2_model_is_refused(tmp_path):
    path = tmp_path / "final.mdl"
    path.write_bytes(b"\0B" + transition_model() + tok("<Nnet>") + tok("<NumComponents>") + i32(0))
    assert "an nnet2 model" in raises_one_line(path)


def test_missing_and_unsuitable_components_are_refused(tmp_path, arrays):
    path = write_mdl(tmp_path / "final.mdl", arrays)
    message = raises_one_line(path, lambda s: s.read_head(path, "nope", None))
    assert "no component 'nope'" in message and "output.affine (NaturalGradientAffineComponent, 9 x 5)" in message
    assert "has no matrix" in raises_one_line(path, lambda s: s.read_head(path, "tdnn1.relu", None))
    no_head = [line for line in CONFIG if "output" not in line] + ["output-node name=output input=tdnn1.relu"]
    parts = [part for part in components(arrays) if not part[0].startswith("output")]
    path = write_mdl(tmp_path / "other.mdl", arrays, config=no_head, parts=parts)
    assert "choose one with --weight NAME" in raises_one_line(path, lambda s: s.read_head(path, None, None))


def test_a_compressed_matrix_is_skipped_but_not_read_as_a_head(tmp_path, arrays):
    parts = components(arrays)
    parts[4] = ("tdnnf2.linear", linear(None, params=compressed_cm2(3, 6)))
    path = write_mdl(tmp_path / "final.mdl", arrays, parts=parts)
    store = KaldiStore(path)
    np.testing.assert_array_equal(store.read_head(path, None, None).weight, arrays["output"][0])
    assert store.tensors()["tdnnf2.linear.Params"].shape == (3, 6)
    assert "compressed matrix (CM2" in raises_one_line(path, lambda s: s.read_head(path, "tdnnf2.linear", None))
