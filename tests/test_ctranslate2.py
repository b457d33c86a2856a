"""CTranslate2 models: heads written by ctranslate2's own converter specs, read back exactly (int8 and int16 through
their scales as CTranslate2's CPU kernel dequantises them, float16 and bfloat16 as stored), checked against the
logits CTranslate2's runtime computes; damaged files refused in one line."""

import json
import struct

import numpy as np
import pytest
import torch

ctranslate2 = pytest.importorskip("ctranslate2")
from ctranslate2.specs import transformer_spec  # noqa: E402

from auditor.cli.audit import main  # noqa: E402
from auditor.errors import InputError  # noqa: E402
from auditor.loader import list_tensors, load_head  # noqa: E402
from auditor.loader.ctranslate2_model import CTranslate2Store  # noqa: E402

V, D, F = 12, 8, 16  # vocabulary, hidden, feed-forward width


def decoder_spec(rng, projection="tied", bias=False, rms_norm=False):
    """A one-layer decoder whose layer adds nothing to its input (zero output projections) and whose learned
    position encodings are zero: its hidden state at every position is the token's embedding, so the logits the
    runtime computes are W LN(E[token]) (+ b). Returns (spec, the float32 embedding, projection, bias, gamma, beta)
    as written, before the writer quantises them."""
    spec = transformer_spec.TransformerDecoderModelSpec.from_config(1, 2, pre_norm=True, rms_norm=rms_norm)
    decoder = spec.decoder
    embedding = rng.standard_normal((V, D)).astype(np.float32)
    weight = embedding if projection == "tied" else rng.standard_normal((V, D)).astype(np.float32)
    decoder.embeddings.weight, decoder.scale_embeddings = embedding.copy(), False
    decoder.projection.weight = weight.copy()
    decoder.position_encodings.encodings = np.zeros((16, D), np.float32)
    gamma = (1 + 0.1 * rng.standard_normal(D)).astype(np.float32)
    beta = None if rms_norm else (0.1 * rng.standard_normal(D)).astype(np.float32)
    decoder.layer_norm.gamma = gamma
    if beta is not None:
        decoder.layer_norm.beta = beta
    b = rng.standard_normal(V).astype(np.float32) if bias else None
    if b is not None:
        decoder.projection.bias = b.copy()
    layer = decoder.layer[0]
    for norm in (layer.self_attention.layer_norm, layer.ffn.layer_norm):
        norm.gamma = np.ones(D, np.float32)
        if not rms_norm:
            norm.beta = np.zeros(D, np.float32)
    layer.self_attention.linear[0].weight = rng.standard_normal((3 * D, D)).astype(np.float32)
    layer.self_attention.linear[1].weight = np.zeros((D, D), np.float32)
    layer.ffn.linear_0.weight = rng.standard_normal((F, D)).astype(np.float32)
    layer.ffn.linear_1.weight = np.zeros((D, F), np.float32)
    spec.register_vocabulary([f"tok{i}" for i in range(V)])
    return spec, embedding, weight, b, gamma, beta


def save(spec, folder, quantization=None):
    """As ctranslate2's converters save a model: validate, alias and quantise, write the folder."""
    folder.mkdir(exist_ok=True)
    spec.validate()
    spec.optimize(quantization=quantization)
    spec.save(str(folder))
    return folder


def stored(spec, name):
    """A variable of the saved spec as the writer holds it (after quantisation): a numpy array."""
    value = spec.variables()[name]
    return value.numpy() if hasattr(value, "numpy") else np.asarray(value)


def runtime_logits(folder, tokens):
    """The logits CTranslate2's runtime computes in float32 at each position of ``tokens``."""
    generator = ctranslate2.Generator(str(folder), device="cpu", compute_type="float32")
    return np.array(generator.forward_batch([[f"tok{t}" for t in tokens]]), dtype=np.float64)[0]


def our_logits(head, hidden):
    """W LN(hidden) + b from the head as read, in float64."""
    norm = head.final_norm
    x = np.asarray(hidden, np.float64)
    if norm.kind == "layernorm":
        centred = x - x.mean()
        y = centred / np.sqrt((centred ** 2).mean() + norm.eps) * norm.weight + norm.bias
    else:
        y = x / np.sqrt((x ** 2).mean() + norm.eps) * norm.weight
    weight = head.weight.float().numpy() if isinstance(head.weight, torch.Tensor) else head.weight
    logits = np.asarray(weight, np.float64) @ y
    return logits if head.bias is None else logits + head.bias


def dequantised(values, scale):
    """CTranslate2's CPU dequantisation, computed here: the value times the float32 reciprocal of its scale."""
    reciprocal = (np.float32(1) / np.asarray(scale, np.float32)).astype(np.float32)
    return values.astype(np.float32) * reciprocal.reshape(-1, 1)


def test_a_float32_projection_with_a_bias_reads_back_exactly(tmp_path, rng):
    spec, _, weight, bias, gamma, beta = decoder_spec(rng, projection="own", bias=True)
    folder = save(spec, tmp_path / "model")
    head = load_head(folder)
    np.testing.assert_array_equal(head.weight, weight)
    np.testing.assert_array_equal(head.bias, bias)
    assert head.weight.dtype == np.float32 and head.weight_name == "decoder/projection/weight"
    assert head.bias_name == "decoder/projection/bias" and not head.tied
    assert head.final_norm.kind == "layernorm" and head.final_norm.eps == float(np.float32(1e-5))  # a C++ float
    np.testing.assert_array_equal(head.final_norm.weight, gamma)
    np.testing.assert_array_equal(head.final_norm.bias, beta)
    assert head.tokens == [f"tok{i}" for i in range(V)] and head.token_source.endswith("vocabulary.json")
    assert head.source_format == "ctranslate2"


def test_int8_rows_are_dequantised_as_the_runtime_computes_its_logits(tmp_path, rng):
    spec, *_ = decoder_spec(rng)
    folder = save(spec, tmp_path / "model", quantization="int8")
    head = load_head(folder / "model.bin")
    values, scale = stored(spec, "decoder/embeddings/weight"), stored(spec, "decoder/embeddings/weight_scale")
    assert values.dtype == np.int8 and scale.shape == (V,)
    np.testing.assert_array_equal(head.weight, dequantised(values, scale))
    assert head.tied and "alias of decoder/embeddings/weight" in head.notes[0]
    assert any("1 / scale" in note for note in head.notes)
    tokens = [3, 5, 0, 11]
    for position, logits in enumerate(runtime_logits(folder, tokens)):
        # the hidden state is the token's (dequantised) embedding: the head's own row, the head being tied
        np.testing.assert_allclose(our_logits(head, head.weight[tokens[position]]), logits, rtol=1e-5, atol=1e-5)


def test_an_untied_int8_projection_with_a_bias_gives_the_runtimes_logits(tmp_path, rng):
    spec, *_ = decoder_spec(rng, projection="own", bias=True)
    folder = save(spec, tmp_path / "model", quantization="int8_float32")
    head = load_head(folder)
    embedding = dequantised(stored(spec, "decoder/embeddings/weight"), stored(spec, "decoder/embeddings/weight_scale"))
    np.testing.assert_array_equal(head.weight, dequantised(stored(spec, "decoder/projection/weight"),
                                                           stored(spec, "decoder/projection/weight_scale")))
    tokens = [1, 7, 2]
    for position, logits in enumerate(runtime_logits(folder, tokens)):
        np.testing.assert_allclose(our_logits(head, embedding[tokens[position]]), logits, rtol=1e-5, atol=1e-5)


def one_hot_models(rng, folder, quantization):
    """D post-norm decoders with the same projection whose last layer norm has gain 0 and bias e_j: the hidden
    state at every position is exactly e_j, so the runtime's logits are column j of the projection as it uses it
    (one product by 1, the rest by 0: no rounding). Returns (the folders, the float32 projection written)."""
    weight = (rng.standard_normal((V, D)) * np.exp(rng.standard_normal((V, 1)))).astype(np.float32)
    folders = []
    for j in range(D):
        spec = transformer_spec.TransformerDecoderModelSpec.from_config(1, 2, pre_norm=False)
        decoder = spec.decoder
        decoder.embeddings.weight, decoder.scale_embeddings = rng.standard_normal((V, D)).astype(np.float32), False
        decoder.projection.weight = weight.copy()
        decoder.position_encodings.encodings = np.zeros((16, D), np.float32)
        layer = decoder.layer[0]
        layer.self_attention.layer_norm.gamma = np.ones(D, np.float32)
        layer.self_attention.layer_norm.beta = np.zeros(D, np.float32)
        layer.ffn.layer_norm.gamma, layer.ffn.layer_norm.beta = np.zeros(D, np.float32), np.eye(D, dtype=np.float32)[j]
        layer.self_attention.linear[0].weight = rng.standard_normal((3 * D, D)).astype(np.float32)
        layer.self_attention.linear[1].weight = rng.standard_normal((D, D)).astype(np.float32)
        layer.ffn.linear_0.weight = rng.standard_normal((F, D)).astype(np.float32)
        layer.ffn.linear_1.weight = rng.standard_normal((D, F)).astype(np.float32)
        spec.register_vocabulary([f"tok{i}" for i in range(V)])
        folders.append(save(spec, folder / f"e{j}", quantization=quantization))
    return folders, weight


@pytest.mark.parametrize("quantization", ["int8", "int16"])
def test_the_dequantised_weight_is_bit_for_bit_the_one_the_runtime_multiplies_by(tmp_path, rng, quantization):
    folders, _ = one_hot_models(rng, tmp_path, quantization)
    columns = [runtime_logits(folder, [1])[0] for folder in folders]
    runtime_weight = np.array(columns, dtype=np.float32).T
    head = load_head(folders[0])
    assert head.final_norm is None  # a post-norm decoder has no norm of its own before the projection
    np.testing.assert_array_equal(head.weight, runtime_weight)
    # the check can tell the two roundings apart: dividing by the scale gives other float32 values
    store = CTranslate2Store(folders[0] / "model.bin")
    values = store.stored("decoder/projection/weight").astype(np.float32)
    scale = np.asarray(store.stored("decoder/projection/weight_scale"), np.float32).reshape(-1, 1)
    assert np.any((values / scale).astype(np.float32) != runtime_weight)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the writer's int16 scale of the layer's zero matrices
def test_int16_weights_use_their_single_scale(tmp_path, rng):
    spec, *_ = decoder_spec(rng, projection="own")
    folder = save(spec, tmp_path / "model", quantization="int16")
    head = load_head(folder)
    values, scale = stored(spec, "decoder/projection/weight"), stored(spec, "decoder/projection/weight_scale")
    assert values.dtype == np.int16 and np.size(scale) == 1
    np.testing.assert_array_equal(head.weight, dequantised(values, np.full(V, scale, np.float32)))


def test_float16_and_bfloat16_weights_are_kept_as_stored(tmp_path, rng):
    spec, _, weight, *_ = decoder_spec(rng, projection="own")
    head = load_head(save(spec, tmp_path / "half", quantization="float16"))
    assert head.weight.dtype == np.float16
    np.testing.assert_array_equal(head.weight, weight.astype(np.float16))
    spec, _, weight, *_ = decoder_spec(rng, projection="own")
    head = load_head(save(spec, tmp_path / "brain", quantization="bfloat16"))
    assert head.weight.dtype == torch.bfloat16
    assert torch.equal(head.weight, torch.from_numpy(weight).to(torch.bfloat16))


def test_an_rms_norm_and_the_configs_epsilon(tmp_path, rng):
    spec, _, _, _, gamma, _ = decoder_spec(rng, rms_norm=True)
    folder = save(spec, tmp_path / "model")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "layer_norm_epsilon": 1e-3}))
    head = load_head(folder)
    assert head.final_norm.kind == "rmsnorm" and head.final_norm.bias is None and head.final_norm.eps == float(np.float32(1e-3))
    np.testing.assert_array_equal(head.final_norm.weight, gamma)
    tokens = [4, 9]
    for position, logits in enumerate(runtime_logits(folder, tokens)):
        np.testing.assert_allclose(our_logits(head, head.weight[tokens[position]]), logits, rtol=1e-5, atol=1e-5)


def test_weight_and_bias_options_choose_other_variables(tmp_path, rng):
    spec, _, weight, *_ = decoder_spec(rng, projection="own", bias=True)
    folder = save(spec, tmp_path / "model")
    head = load_head(folder, weight="decoder/layer_0/ffn/linear_0/weight", bias="none")
    assert head.shape == (F, D) and head.bias is None
    head = load_head(folder, bias="none")
    np.testing.assert_array_equal(head.weight, weight)
    assert head.bias is None
    names = {info.name for info in list_tensors(folder, matrices=True)}
    assert {"decoder/projection/weight", "decoder/embeddings/weight"} <= names


def test_the_command_audits_a_folder_with_its_vocabulary(tmp_path, rng, capsys):
    spec, *_ = decoder_spec(rng)
    rows = spec.decoder.embeddings.weight
    rows[[1, 2]] = np.round(rows[[1, 2]] * 4) / 4
    rows[6] = (rows[1] + rows[2]) / 2  # exactly the midpoint, in float32: inside the hull
    spec.decoder.projection.weight = rows.copy()
    folder = save(spec, tmp_path / "model")
    code = main([str(folder), "--quiet", "--format", "json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1
    failing = {finding["id"]: finding for finding in report["findings"] if finding["failing"]}
    assert set(failing) == {6} and failing[6]["token"] == "tok6" and failing[6]["verdict"] == "unargmaxable"


def write(path, version=6, spec_name="TransformerDecoderSpec", variables=(), aliases=(), tail=b""):
    """model.bin from bytes, as the format is laid out: the version, the spec and revision, each variable
    (name, rank, dims, type id, byte count, bytes), the aliases."""
    def string(text):
        raw = text.encode()
        return struct.pack("<H", len(raw) + 1) + raw + b"\x00"

    body = struct.pack("<I", version) + string(spec_name) + struct.pack("<II", 1, len(variables))
    for name, type_id, array in variables:
        data = np.ascontiguousarray(array).tobytes()
        body += string(name) + struct.pack("<B", array.ndim) + b"".join(struct.pack("<I", s) for s in array.shape)
        body += struct.pack("<BI", type_id, len(data)) + data
    body += struct.pack("<I", len(aliases)) + b"".join(string(a) + string(b) for a, b in aliases)
    path.write_bytes(body + tail)
    return path


def test_a_file_cut_anywhere_is_refused_in_one_line(tmp_path, rng):
    weight = rng.standard_normal((V, D)).astype(np.float32)
    whole = write(tmp_path / "whole.bin", variables=[("decoder/embeddings/weight", 0, weight)],
                  aliases=[("decoder/projection/weight", "decoder/embeddings/weight")]).read_bytes()
    np.testing.assert_array_equal(load_head(tmp_path / "whole.bin").weight, weight)
    for cut in sorted({30, 33, 40, 60, 61, len(whole) - 40, len(whole) - 30, len(whole) - 2, len(whole) - 1}):
        path = tmp_path / f"cut{cut}.bin"
        path.write_bytes(whole[:cut])
        with pytest.raises(InputError, match="truncated CTranslate2 model") as error:
            load_head(path)
        assert "\n" not in str(error.value)


@pytest.mark.parametrize("variables, message", [
    ([("decoder/projection/weight", 1, np.ones((V, D), np.int8))], "has no decoder/projection/weight_scale"),
    ([("decoder/projection/weight", 3, np.ones((V, D), np.int32))], "AWQ"),
    ([("decoder/projection/weight", 9, np.ones((V, D), np.int8))], "type id 9"),
    ([("decoder/projection/weight", 1, np.ones((V, D), np.int8)),
      ("decoder/projection/weight_scale", 0, np.zeros(V, np.float32))], "zero or non-finite scale"),
])
def test_weights_that_cannot_be_dequantised_are_refused(tmp_path, capsys, variables, message):
    path = write(tmp_path / "model.bin", variables=variables)
    assert main([str(path), "--quiet"]) == 2
    line = capsys.readouterr().err.strip()
    assert message in line and "\n" not in line


def test_a_newer_binary_version_is_named(tmp_path, capsys):
    path = write(tmp_path / "model.bin", version=7)
    assert main([str(path), "--quiet"]) == 2
    assert "binary version 7" in capsys.readouterr().err


def test_a_payload_of_the_wrong_size_is_refused(tmp_path, capsys):
    data = np.ones((V, D), np.float32).tobytes()
    raw = (struct.pack("<I", 6) + struct.pack("<H", 9) + b"TestSpec\x00" + struct.pack("<II", 1, 1)
           + struct.pack("<H", 2) + b"w\x00" + struct.pack("<BII", 2, V, D) + struct.pack("<BI", 0, len(data) - 4)
           + data)
    (tmp_path / "model.bin").write_bytes(raw)
    assert main([str(tmp_path / "model.bin"), "--quiet"]) == 2
    assert "says it has" in capsys.readouterr().err


def one_line_error(capsys, path, *options) -> str:
    assert main([str(path), "--quiet", *options]) == 2
    line = capsys.readouterr().err.strip()
    assert "\n" not in line and line.startswith("audit: error:"), line
    return line


def test_crafted_files_are_refused_in_one_line(tmp_path, capsys):
    rows = np.ones((V, D), np.int8)
    cases = {
        "a bfloat16 scale": ([("decoder/projection/weight", 1, rows),
                              ("decoder/projection/weight_scale", 5, np.ones(V, np.uint16))], [], "reads scales"),
        "one scale for int8 rows": ([("decoder/projection/weight", 1, rows),
                                     ("decoder/projection/weight_scale", 0, np.ones(1, np.float32))], [],
                                    "one per row"),
        "a scale per row for int16": ([("decoder/projection/weight", 2, rows.astype(np.int16)),
                                       ("decoder/projection/weight_scale", 0, np.ones(V, np.float32))], [],
                                      "takes one for the int16"),
        "an empty output scale": ([("decoder/projection/weight", 0, rows.astype(np.float32)),
                                   ("decoder/scale_outputs", 0, np.ones(0, np.float32))], [], "holds 0 values"),
        "aliases in a loop": ([("decoder/embeddings/weight", 1, rows)],
                              [("decoder/projection/weight", "x"), ("x", "decoder/projection/weight")],
                              "no decoder/projection/weight"),
    }
    for name, (variables, aliases, message) in cases.items():
        path = write(tmp_path / f"{name}.bin", variables=variables, aliases=aliases)
        assert message in one_line_error(capsys, path), name


def test_a_shape_whose_product_overflows_is_refused(tmp_path, capsys):
    raw = (struct.pack("<I", 6) + struct.pack("<H", 9) + b"TestSpec\x00" + struct.pack("<II", 1, 1)
           + struct.pack("<H", 2) + b"w\x00" + struct.pack("<B", 4) + struct.pack("<IIII", *[65536] * 4)
           + struct.pack("<BI", 0, 0))
    (tmp_path / "model.bin").write_bytes(raw)
    assert "says it has 0 bytes" in one_line_error(capsys, tmp_path / "model.bin")


def test_aliases_and_duplicates_resolve_as_the_runtime_registers_them(tmp_path, rng):
    first, second = (rng.standard_normal((V, D)).astype(np.float32) for _ in range(2))
    scale = np.full(V, 2, np.float32)
    path = write(tmp_path / "model.bin",
                 variables=[("decoder/embeddings/weight", 0, first), ("decoder/embeddings/weight", 0, second),
                            ("decoder/other/weight", 1, np.ones((V, D), np.int8)),
                            ("decoder/other/weight_scale", 0, scale)],
                 aliases=[("decoder/projection/weight", "decoder/later"), ("decoder/later", "decoder/other/weight"),
                          ("decoder/projection/weight", "decoder/embeddings/weight"),
                          ("decoder/tied/weight", "decoder/other/weight")])
    # the first of two variables of one name; an alias of a name not yet registered is dropped, so the
    # projection's second alias is the one that holds
    np.testing.assert_array_equal(load_head(path).weight, first)
    # an alias of a quantised weight brings its scale along
    np.testing.assert_array_equal(load_head(path, weight="decoder/tied/weight").weight, np.full((V, D), 0.5, np.float32))


def test_only_the_heads_own_norm_is_taken(tmp_path, rng):
    spec, *_ = decoder_spec(rng, projection="own")
    folder = save(spec, tmp_path / "model")
    inner = load_head(folder, weight="decoder/layer_0/self_attention/linear_1/weight")
    assert inner.final_norm is None  # its layer's norm runs before linear_0, not before it
    gamma, beta = (rng.standard_normal(D).astype(np.float32) for _ in range(2))
    path = write(tmp_path / "project_out.bin", variables=[
        ("decoder/layer_norm/beta", 0, beta), ("decoder/layer_norm/gamma", 0, gamma),
        ("decoder/project_out/weight", 0, rng.standard_normal((D, D)).astype(np.float32)),
        ("decoder/projection/weight", 0, rng.standard_normal((V, D)).astype(np.float32))])
    head = load_head(path)
    assert head.final_norm is None and any("project_out lies between" in note for note in head.notes)


def test_a_ctc_head_of_a_wav2vec2_model_is_found_with_its_norm(tmp_path, rng):
    weight, gamma, beta = (rng.standard_normal(shape).astype(np.float32) for shape in ((V, D), D, D))
    path = write(tmp_path / "model.bin", spec_name="Wav2Vec2Spec", variables=[
        ("encoder/layer_norm/beta", 0, beta), ("encoder/layer_norm/gamma", 0, gamma),
        ("encoder/lm_head/weight", 0, weight)])
    head = load_head(path)
    np.testing.assert_array_equal(head.weight, weight)
    np.testing.assert_array_equal(head.final_norm.weight, gamma)
    assert head.final_norm.names == ("encoder/layer_norm/gamma", "encoder/layer_norm/beta")


def test_another_frameworks_model_bin_does_not_hide_a_readable_model(tmp_path, rng):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    weight = rng.standard_normal((V, D)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["logits"]),
                               helper.make_node("Softmax", ["logits"], ["probs"])], "head",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, D])],
                              [helper.make_tensor_value_info("probs", TensorProto.FLOAT, None)],
                              initializer=[numpy_helper.from_array(weight.T.copy(), "W")])
    onnx.save_model(helper.make_model(graph), str(tmp_path / "model.onnx"))
    (tmp_path / "model.bin").write_bytes(bytes(range(256)) * 4)  # OpenVINO's weights, beside its model.xml
    np.testing.assert_array_equal(load_head(tmp_path).weight, weight)


def test_a_folder_whose_model_file_is_refused_says_why(tmp_path, capsys):
    (tmp_path / "final.mdl").write_text("<TransitionModel> <Topology> ...\n")  # Kaldi's text mode
    assert "nnet3-am-copy --binary=true" in one_line_error(capsys, tmp_path)


def test_the_output_scale_and_the_rms_norms_offset_are_the_runtimes(tmp_path, rng):
    weight, gamma, beta = (rng.standard_normal(shape).astype(np.float32) for shape in ((V, D), D, D))
    scale = np.float32(1 / 3)
    path = write(tmp_path / "scaled.bin", variables=[
        ("decoder/layer_norm/gamma", 0, gamma), ("decoder/layer_norm/layer_norm_use_residual", 1, np.ones((), np.int8)),
        ("decoder/projection/weight", 0, weight), ("decoder/scale_outputs", 0, np.array(scale))])
    head = load_head(path)
    # the product of two float32 numbers, exact in float64
    np.testing.assert_array_equal(head.weight, weight.astype(np.float64) * np.float64(scale))
    assert head.weight.dtype == np.float64
    assert head.final_norm.kind == "rmsnorm" and head.final_norm.unit_offset  # RMSNorm times (1 + gamma)
    path = write(tmp_path / "layernorm.bin", variables=[
        ("decoder/layer_norm/beta", 0, beta), ("decoder/layer_norm/gamma", 0, gamma),
        ("decoder/layer_norm/layer_norm_use_residual", 1, np.ones((), np.int8)),
        ("decoder/projection/weight", 0, weight)])
    norm = load_head(path).final_norm
    assert norm.kind == "layernorm" and not norm.unit_offset  # the runtime's LayerNorm never reads the flag
