"""ONNX models: the head found from the graph (MatMul, Gemm, a transposed or Constant weight, quantised
weights dequantised as ONNX computes them, external data from inside the model's folder only), checked
against onnx's own reference evaluator and numpy; bad models refused in one line."""

import json
import sys

import numpy as np
import pytest

from oracles import qhull_argmaxable

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

from auditor.cli.audit import main  # noqa: E402
from auditor.loader import list_tensors, load_head  # noqa: E402

N, D = 7, 4  # vocabulary x hidden


@pytest.fixture
def head_rows():
    rng = np.random.default_rng(3)
    return rng.standard_normal((N, D)).astype(np.float32), rng.standard_normal(N).astype(np.float32)


def save(path, nodes, initializers=(), output="probs", metadata=None, opset=17, width=D, **model_fields):
    """A model of ``nodes`` with input x [1, width] and float output ``output``."""
    graph = helper.make_graph(list(nodes), "head", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, width])],
                              [helper.make_tensor_value_info(output, TensorProto.FLOAT, None)],
                              initializer=[numpy_helper.from_array(np.asarray(a), name) for name, a in initializers])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], **model_fields)
    if metadata:
        helper.set_model_props(model, metadata)
    onnx.save_model(model, str(path))
    return path


def graph_logits(path, x, output="logits"):
    """What onnx's reference evaluator computes for the value ``output`` at the hidden state x."""
    model = onnx.load(str(path))
    model.graph.output.append(helper.make_tensor_value_info(output, TensorProto.FLOAT, None))
    return ReferenceEvaluator(model).run([output], {"x": x[None, :].astype(np.float32)})[0].reshape(-1)


def assert_head_computes_the_graphs_logits(path, head, output="logits"):
    """The loaded head gives the graph's own logits, W x + b, at random hidden states."""
    rng = np.random.default_rng(0)
    for _ in range(3):
        x = rng.standard_normal(head.shape[1]).astype(np.float32)
        ours = np.asarray(head.weight, np.float64) @ x + (0 if head.bias is None else np.asarray(head.bias, np.float64))
        np.testing.assert_allclose(ours, graph_logits(path, x, output), rtol=1e-5, atol=1e-5)


def audit_error(capsys, *args) -> str:
    code = main([*map(str, args), "--quiet"])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, captured.err
    assert len(lines) == 1 and lines[0].startswith("audit: error:"), captured.err
    return lines[0]


def test_matmul_add_softmax_is_read_as_vocabulary_x_hidden(tmp_path, head_rows):
    weight, bias = head_rows
    path = save(tmp_path / "model.onnx", [helper.make_node("MatMul", ["x", "W"], ["mm"]),
                                          helper.make_node("Add", ["mm", "b"], ["logits"]),
                                          helper.make_node("Softmax", ["logits"], ["probs"], axis=-1)],
                [("W", weight.T.copy()), ("b", bias)])
    head = load_head(path)
    assert head.shape == (N, D) and head.source_format == "onnx"
    assert (head.weight_name, head.bias_name) == ("W", "b")
    np.testing.assert_array_equal(head.weight, weight)
    np.testing.assert_array_equal(head.bias, bias)
    assert "MatMul" in head.notes[0] and "Softmax" in head.notes[0]
    assert_head_computes_the_graphs_logits(path, head)


@pytest.mark.parametrize("trans_b", [0, 1])
def test_gemm_honours_trans_b_and_takes_c_as_the_bias(tmp_path, head_rows, trans_b):
    weight, bias = head_rows
    stored = weight if trans_b else weight.T.copy()
    path = save(tmp_path / "model.onnx", [helper.make_node("Gemm", ["x", "W", "C"], ["logits"], transB=trans_b),
                                          helper.make_node("LogSoftmax", ["logits"], ["probs"])],
                [("W", stored), ("C", bias)])
    head = load_head(path)
    np.testing.assert_array_equal(head.weight, weight)
    np.testing.assert_array_equal(head.bias, bias)
    assert head.bias_name == "C"
    assert_head_computes_the_graphs_logits(path, head)


def test_a_transposed_weight_and_shape_ops_before_argmax(tmp_path, head_rows):
    weight, bias = head_rows
    path = save(tmp_path / "model.onnx", [helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
                                          helper.make_node("MatMul", ["x", "Wt"], ["mm"]),
                                          helper.make_node("Add", ["b", "mm"], ["logits"]),
                                          helper.make_node("Reshape", ["logits", "shape"], ["flat"]),
                                          helper.make_node("ArgMax", ["flat"], ["probs"], axis=-1)],
                [("W", weight), ("b", bias), ("shape", np.array([-1], np.int64))])
    head = load_head(path)
    np.testing.assert_array_equal(head.weight, weight)
    np.testing.assert_array_equal(head.bias, bias)
    assert_head_computes_the_graphs_logits(path, head)


def pointwise_conv(tmp_path, kernel, bias, group=1):
    """x [1, D] -> [1, D, 1, ...] -> Conv(kernel, bias) -> channels last -> ArgMax, as CTC recognisers end."""
    spatial = kernel.ndim - 2
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["image"]),
             helper.make_node("Conv", ["image", "K"] + (["B"] if bias is not None else []), ["conv"], group=group,
                              kernel_shape=list(kernel.shape[2:])),
             helper.make_node("Transpose", ["conv"], ["logits"], perm=[0, *range(2, 2 + spatial), 1]),
             helper.make_node("ArgMax", ["logits"], ["probs"], axis=-1)]
    constants = [("K", kernel), ("shape", np.array([1, D] + [kernel.shape[2]] * spatial, np.int64))]
    return save(tmp_path / "model.onnx", nodes, constants + ([("B", bias)] if bias is not None else []))


@pytest.mark.parametrize("spatial", [1, 2])
def test_a_pointwise_conv_before_argmax_is_the_head(tmp_path, head_rows, capsys, spatial):
    # PaddleOCR-style recognisers end in a 1 x 1 convolution over the sequence: W x + b at every position
    weight, bias = head_rows
    path = pointwise_conv(tmp_path, weight.reshape(N, D, *[1] * spatial), bias)
    head = load_head(path)
    np.testing.assert_array_equal(head.weight, weight)
    np.testing.assert_array_equal(head.bias, bias)
    assert "Conv" in head.notes[0] and "ArgMax" in head.notes[0] and f"read as {N} x {D}" in head.notes[0]
    assert_head_computes_the_graphs_logits(path, head)
    assert main([str(path), "--list-tensors"]) == 0
    assert capsys.readouterr().out.split()[0] == "K"  # the kernel is listed with the matrices


@pytest.mark.parametrize("kernel, group", [(3, 1), (1, 2)])
def test_a_conv_that_mixes_positions_or_splits_channels_is_no_head(tmp_path, capsys, kernel, group):
    rng = np.random.default_rng(0)
    weights = rng.standard_normal((6, D // group, kernel)).astype(np.float32)
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["image"]),
             helper.make_node("Conv", ["image", "K"], ["conv"], group=group, kernel_shape=[kernel]),
             helper.make_node("ArgMax", ["conv"], ["probs"], axis=1)]
    path = save(tmp_path / "model.onnx", nodes, [("K", weights), ("shape", np.array([1, D, 5], np.int64))])
    assert "no classifier head found" in audit_error(capsys, path)


def test_a_conv_bias_added_after_it_is_taken_only_with_the_classes_on_the_channel_axis(tmp_path, head_rows, capsys):
    # Conv output is batch x classes x positions: a bias M x 1 adds one value per class; a bias of M values
    # alone broadcasts along the positions, so it is no bias of the classes and the head is refused
    weight, bias = head_rows
    for shape, read in (((N, 1), True), ((1, N, 1), True), ((N,), False)):
        nodes = [helper.make_node("Reshape", ["x", "shape"], ["image"]),
                 helper.make_node("Conv", ["image", "K"], ["conv"], kernel_shape=[1]),
                 helper.make_node("Add", ["conv", "B"], ["biased"]),
                 helper.make_node("Transpose", ["biased"], ["logits"], perm=[0, 2, 1]),
                 helper.make_node("ArgMax", ["logits"], ["probs"], axis=-1)]
        path = save(tmp_path / f"model{len(shape)}{read}.onnx", nodes,
                    [("K", weight.reshape(N, D, 1)), ("shape", np.array([1, D, 1], np.int64)),
                     ("B", bias.reshape(shape))])
        if read:
            head = load_head(path)
            np.testing.assert_array_equal(head.bias, bias)
            assert_head_computes_the_graphs_logits(path, head)
        else:
            assert "no classifier head found" in audit_error(capsys, path)


def test_a_one_channel_conv_scoring_positions_leaves_the_matmul_head_alone(tmp_path, head_rows):
    # a context block's attention (1 x 1 Conv to one channel, Softmax over positions) is not a head
    weight, bias = head_rows
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["image"]),
             helper.make_node("Conv", ["image", "C"], ["scores"], kernel_shape=[1]),
             helper.make_node("Softmax", ["scores"], ["attention"], axis=2),
             helper.make_node("MatMul", ["x", "W"], ["mm"]),
             helper.make_node("Add", ["mm", "b"], ["logits"]),
             helper.make_node("Softmax", ["logits"], ["probs"], axis=-1)]
    path = save(tmp_path / "model.onnx", nodes, [("C", np.ones((1, D, 1), np.float32)),
                                                 ("shape", np.array([1, D, 1], np.int64)),
                                                 ("W", weight.T.copy()), ("b", bias)])
    head = load_head(path)
    assert head.weight_name == "W"
    np.testing.assert_array_equal(head.weight, weight)


def test_a_constant_node_weight_is_read(tmp_path, head_rows):
    weight, _ = head_rows
    constant = helper.make_node("Constant", [], ["W"], value=numpy_helper.from_array(weight.T.copy(), "W"))
    path = save(tmp_path / "model.onnx", [constant, helper.make_node("MatMul", ["x", "W"], ["logits"]),
                                          helper.make_node("Softmax", ["logits"], ["probs"])])
    head = load_head(path)
    np.testing.assert_array_equal(head.weight, weight)
    assert head.bias is None and "a Constant" in head.notes[0]
    assert "W" in {info.name for info in list_tensors(path)}
    assert_head_computes_the_graphs_logits(path, head)


@pytest.mark.parametrize("per_axis, dtype", [(True, np.int8), (False, np.uint8)])
def test_a_dequantize_linear_weight_is_dequantised_as_onnx_does(tmp_path, per_axis, dtype):
    rng = np.random.default_rng(1)
    info = np.iinfo(dtype)
    quantised = rng.integers(info.min, info.max + 1, size=(D, N)).astype(dtype)
    scale = (rng.random(N) * 0.1 + 0.01).astype(np.float32) if per_axis else np.float32(0.037)
    zero = rng.integers(-3, 4, size=N).astype(dtype) if per_axis and dtype == np.int8 else np.array(128, dtype)
    if not per_axis:
        zero = np.array(128, dtype)
    path = save(tmp_path / "model.onnx", [helper.make_node("DequantizeLinear", ["Wq", "s", "z"], ["W"], axis=1),
                                          helper.make_node("MatMul", ["x", "W"], ["logits"]),
                                          helper.make_node("Softmax", ["logits"], ["probs"])],
                [("Wq", quantised), ("s", np.asarray(scale)), ("z", zero)], opset=19)
    head = load_head(path)
    # numpy's own dequantisation, in float32
    expected = ((quantised.astype(np.int32) - zero.astype(np.int32)).astype(np.float32) * scale).T
    assert head.weight.dtype == np.float32
    np.testing.assert_array_equal(head.weight, expected)
    # and onnx's reference evaluator, bit for bit
    np.testing.assert_array_equal(head.weight, graph_logits(path, np.zeros(D), "W").reshape(D, N).T)
    assert any("dequantised" in note for note in head.notes)


def test_a_blockwise_dequantised_weight_matches_onnx(tmp_path):
    rng = np.random.default_rng(8)
    quantised = rng.integers(-8, 8, size=(D, N)).astype(np.int8)
    scale = (rng.random((D, 4)) * 0.1 + 0.01).astype(np.float32)  # blocks of 2 columns: 7 -> 4 blocks
    zero = rng.integers(-2, 3, size=(D, 4)).astype(np.int8)
    path = save(tmp_path / "model.onnx", [helper.make_node("DequantizeLinear", ["Wq", "s", "z"], ["W"], axis=1,
                                                           block_size=2),
                                          helper.make_node("MatMul", ["x", "W"], ["logits"]),
                                          helper.make_node("Softmax", ["logits"], ["probs"])],
                [("Wq", quantised), ("s", scale), ("z", zero)], opset=21)
    head = load_head(path)
    np.testing.assert_array_equal(head.weight, graph_logits(path, np.zeros(D), "W").reshape(D, N).T)


def test_a_weight_on_the_left_of_matmul_is_already_vocabulary_x_hidden(tmp_path, head_rows):
    weight, bias = head_rows
    path = save(tmp_path / "model.onnx", [helper.make_node("Transpose", ["x"], ["xt"]),
                                          helper.make_node("MatMul", ["W", "xt"], ["logits"]),
                                          helper.make_node("Softmax", ["logits"], ["probs"], axis=0)],
                [("W", weight)])
    head = load_head(path)
    np.testing.assert_array_equal(head.weight, weight)
    assert_head_computes_the_graphs_logits(path, head)


def test_matmul_integer_of_a_dynamically_quantised_graph_is_dequantised(tmp_path):
    rng = np.random.default_rng(2)
    quantised = rng.integers(0, 256, size=(D, N)).astype(np.uint8)
    zero, scale = np.array(131, np.uint8), np.float32(0.02)
    bias = rng.standard_normal(N).astype(np.float32)
    nodes = [helper.make_node("DynamicQuantizeLinear", ["x"], ["xq", "xs", "xz"]),
             helper.make_node("MatMulInteger", ["xq", "Wq", "xz", "Wz"], ["mmi"]),
             helper.make_node("Mul", ["xs", "Ws"], ["scales"]),
             helper.make_node("Cast", ["mmi"], ["mmf"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["mmf", "scales"], ["mm"]),
             helper.make_node("Add", ["mm", "b"], ["logits"]),
             helper.make_node("Softmax", ["logits"], ["probs"])]
    path = save(tmp_path / "model.onnx", nodes, [("Wq", quantised), ("Wz", zero), ("Ws", np.asarray(scale)),
                                                 ("b", bias)])
    head = load_head(path)
    expected = ((quantised.astype(np.int32) - 131).astype(np.float32) * scale).T
    np.testing.assert_array_equal(head.weight, expected)
    np.testing.assert_array_equal(head.bias, bias)
    assert head.weight_name == "Wq" and any("MatMulInteger" in note and "dequantised" in note for note in head.notes)
    # the graph's logits (its input quantised to 8 bits first) are the dequantised head's at the
    # dequantised input
    x = np.array([0.5, -1.0, 0.25, 2.0], np.float32)
    xq, xs, xz = ReferenceEvaluator(onnx.load(str(path))).run(["xq", "xs", "xz"], {"x": x[None, :]})
    hidden = (xq.reshape(-1).astype(np.float32) - np.float32(xz)) * xs
    np.testing.assert_allclose(head.weight @ hidden + bias, graph_logits(path, x), rtol=1e-5, atol=1e-5)


def external_model(tmp_path, weight):
    folder = tmp_path / "model"
    folder.mkdir()
    path = save(folder / "model.onnx", [helper.make_node("MatMul", ["x", "W"], ["logits"]),
                                        helper.make_node("Softmax", ["logits"], ["probs"])], [("W", weight.T.copy())])
    model = onnx.load(str(path))
    onnx.save_model(model, str(path), save_as_external_data=True, location="weights.bin", size_threshold=0)
    return path


def test_external_data_inside_the_folder_is_read(tmp_path, head_rows):
    weight, _ = head_rows
    path = external_model(tmp_path, weight)
    assert (path.parent / "weights.bin").is_file()
    np.testing.assert_array_equal(load_head(path).weight, weight)


def test_external_data_linked_from_inside_the_folder_is_read(tmp_path, head_rows):
    """A Hub cache keeps every file of a snapshot as a link into its blobs/."""
    weight, _ = head_rows
    path = external_model(tmp_path, weight)
    blob = tmp_path / "blob"
    (path.parent / "weights.bin").rename(blob)
    (path.parent / "weights.bin").symlink_to(blob)
    np.testing.assert_array_equal(load_head(path).weight, weight)


@pytest.mark.parametrize("location", ["../outside.bin", "sub/../../outside.bin", "/tmp/outside.bin"])
def test_external_data_outside_the_folder_is_refused(tmp_path, head_rows, capsys, location):
    weight, _ = head_rows
    path = external_model(tmp_path, weight)
    (tmp_path / "outside.bin").write_bytes((path.parent / "weights.bin").read_bytes())
    model = onnx.load(str(path), load_external_data=False)
    for entry in model.graph.initializer[0].external_data:
        if entry.key == "location":
            entry.value = location
    path.write_bytes(model.SerializeToString())
    line = audit_error(capsys, path)
    assert "outside the model's folder" in line and "'W'" in line


def two_heads(tmp_path, head_rows):
    weight, bias = head_rows
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["l1"]), helper.make_node("Softmax", ["l1"], ["probs"]),
             helper.make_node("MatMul", ["x", "W2"], ["l2"]), helper.make_node("Add", ["l2", "b2"], ["l3"]),
             helper.make_node("Softmax", ["l3"], ["probs2"])]
    path = save(tmp_path / "model.onnx", nodes, [("W1", weight.T.copy()), ("W2", weight[:5].T.copy()),
                                                 ("b2", bias[:5])])
    model = onnx.load(str(path))
    model.graph.output.append(helper.make_tensor_value_info("probs2", TensorProto.FLOAT, None))
    onnx.save_model(model, str(path))
    return path


def test_two_heads_are_ambiguous_and_weight_picks_one(tmp_path, head_rows, capsys):
    path = two_heads(tmp_path, head_rows)
    line = audit_error(capsys, path)
    assert "more than one classifier head" in line and "W1 [4, 7]" in line and "W2 [4, 5]" in line
    assert "--weight" in line
    head = load_head(path, weight="W2")
    assert head.shape == (5, D) and head.bias_name == "b2"
    np.testing.assert_array_equal(head.weight, head_rows[0][:5])
    assert "no MatMul, Gemm or pointwise Conv" in audit_error(capsys, path, "--weight", "nothing")


def test_list_tensors_lists_the_2d_constants(tmp_path, head_rows, capsys):
    path = two_heads(tmp_path, head_rows)
    assert main([str(path), "--list-tensors"]) == 0
    listed = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert listed == ["W1", "W2"]


def test_no_head_in_the_graph_is_one_line(tmp_path, capsys):
    path = save(tmp_path / "model.onnx", [helper.make_node("Relu", ["x"], ["probs"])])
    assert "no classifier head found" in audit_error(capsys, path)


def test_garbage_named_onnx_is_one_line(tmp_path, capsys):
    path = tmp_path / "model.onnx"
    path.write_bytes(b"\xff" * 64)
    assert "not a readable ONNX model" in audit_error(capsys, path)


def test_without_the_onnx_package_the_line_names_the_extra(tmp_path, head_rows, capsys, monkeypatch):
    weight, _ = head_rows
    path = save(tmp_path / "model.onnx", [helper.make_node("MatMul", ["x", "W"], ["logits"]),
                                          helper.make_node("Softmax", ["logits"], ["probs"])], [("W", weight.T.copy())])
    monkeypatch.setitem(sys.modules, "onnx", None)  # as if auditor[onnx] were not installed
    assert "pip install 'auditor[onnx]'" in audit_error(capsys, path)


def test_a_folder_holding_one_onnx_model_loads_it(tmp_path, head_rows):
    weight, _ = head_rows
    save(tmp_path / "model.onnx", [helper.make_node("MatMul", ["x", "W"], ["logits"]),
                                   helper.make_node("Softmax", ["logits"], ["probs"])], [("W", weight.T.copy())])
    np.testing.assert_array_equal(load_head(tmp_path).weight, weight)


def test_an_interior_row_is_exactly_the_finding(tmp_path, capsys):
    """Rows on a sphere are vertices of their hull; one at their mean is inside it (Qhull agrees)."""
    rng = np.random.default_rng(4)
    rows = rng.standard_normal((8, 3))
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    weight = np.vstack([rows, rows.mean(axis=0)]).astype(np.float32)
    bias = np.zeros(9, np.float32)
    path = save(tmp_path / "model.onnx", [helper.make_node("Gemm", ["x", "W", "C"], ["logits"], transB=1),
                                          helper.make_node("Softmax", ["logits"], ["probs"])],
                [("W", weight), ("C", bias)], width=3)
    assert qhull_argmaxable(weight.astype(np.float64), bias.astype(np.float64)) == set(range(8))
    assert main([str(path), "--format", "json", "--quiet"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["head"]["format"] == "onnx"
    assert [(f["id"], f["verdict"]) for f in report["findings"]] == [(8, "unargmaxable")]


def test_audit_verify_rechecks_an_onnx_models_certificates(tmp_path, head_rows, capsys):
    from auditor.cli.verify import main as verify

    weight, bias = head_rows
    path = save(tmp_path / "model.onnx", [helper.make_node("Gemm", ["x", "W", "C"], ["logits"], transB=1),
                                          helper.make_node("Softmax", ["logits"], ["probs"])],
                [("W", weight), ("C", bias)])
    certificates = tmp_path / "certificates.json"
    assert main([str(path), "--certificates", str(certificates), "--quiet", "--fail-on", "none"]) == 0
    assert verify([str(certificates), str(path)]) == 0, capsys.readouterr()
    assert "all hold" in capsys.readouterr().out


def test_paddleocr_character_metadata_names_the_tokens(tmp_path, capsys):
    """id 0 CTC's blank, ids 1..L the list, the last id the space PaddleOCR appends."""
    rng = np.random.default_rng(6)
    weight = rng.standard_normal((6, 3)).astype(np.float32)
    weight[4] = weight[:4].mean(axis=0)  # the fourth character is never read
    path = save(tmp_path / "rec.onnx", [helper.make_node("MatMul", ["x", "W"], ["logits"]),
                                        helper.make_node("Softmax", ["logits"], ["probs"])], [("W", weight.T.copy())],
                width=3, metadata={"character": "字\n符\n表\n格"})
    head = load_head(path)
    assert head.tokens == [None, "字", "符", "表", "格", " "]
    assert any("blank" in note and "space" in note for note in head.notes)
    assert main([str(path), "--format", "json", "--quiet", "--fail-on", "none"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["head"]["token_strings"] == "metadata 'character'"
    assert {f["id"]: f["token"] for f in report["findings"]} == {4: "格"}


def test_a_vocab_file_wins_over_the_character_metadata(tmp_path):
    weight = np.eye(3, dtype=np.float32)
    path = save(tmp_path / "rec.onnx", [helper.make_node("MatMul", ["x", "W"], ["logits"]),
                                        helper.make_node("Softmax", ["logits"], ["probs"])], [("W", weight)],
                width=3, metadata={"character": "a"})
    (tmp_path / "chars.txt").write_text("x\ny\n", encoding="utf-8")
    head = load_head(path, vocab=tmp_path / "chars.txt", vocab_offset=1)
    assert head.tokens == [None, "x", "y"] and head.token_source.endswith("chars.txt")
    assert not any("metadata" in note for note in head.notes)


def test_a_character_list_that_does_not_fit_is_a_note_not_an_error(tmp_path):
    weight = np.eye(3, dtype=np.float32)
    path = save(tmp_path / "rec.onnx", [helper.make_node("MatMul", ["x", "W"], ["logits"]),
                                        helper.make_node("Softmax", ["logits"], ["probs"])], [("W", weight)],
                width=3, metadata={"character": "a\nb\nc\nd\ne"})
    head = load_head(path)
    assert head.tokens is None and any("does not fit" in note for note in head.notes)


def _dequantised_model(tmp_path, scale, zero, **attributes):
    rng = np.random.default_rng(9)
    quantised = rng.integers(-8, 8, size=(D, N)).astype(np.int8)
    return save(tmp_path / "model.onnx", [helper.make_node("DequantizeLinear", ["Wq", "s", "z"], ["W"], name="dq",
                                                           **attributes),
                                          helper.make_node("MatMul", ["x", "W"], ["logits"]),
                                          helper.make_node("Softmax", ["logits"], ["probs"])],
                [("Wq", quantised), ("s", scale), ("z", zero)], opset=21)


@pytest.mark.parametrize("axis", [2, -3, 5])
def test_a_dequantize_axis_outside_what_the_operator_allows_is_refused_naming_the_node(tmp_path, capsys, axis):
    path = _dequantised_model(tmp_path, np.full(N, 0.05, np.float32), np.zeros(N, np.int8), axis=axis)
    message = audit_error(capsys, path)
    assert "'dq'" in message and f"axis {axis}" in message and "model.onnx" in message


@pytest.mark.parametrize("scale,zero,words", [
    (np.full(N + 1, 0.05, np.float32), np.zeros(N + 1, np.int8), "scale of shape [8]"),
    (np.full(N, 0.05, np.float32), np.zeros(N - 2, np.int8), "zero point's shape [5]"),
    (np.full((D, 3), 0.05, np.float32), np.zeros((D, 3), np.int8), "blocked scale of shape [4, 3]"),
])
def test_dequantize_scales_and_zero_points_of_the_wrong_size_are_refused_naming_the_file_and_node(
        tmp_path, capsys, scale, zero, words):
    attributes = {"axis": 1, "block_size": 2} if scale.ndim == 2 else {"axis": 1}
    path = _dequantised_model(tmp_path, scale, zero, **attributes)
    message = audit_error(capsys, path)
    assert "model.onnx" in message and "'dq'" in message and "'Wq'" in message and words in message


def test_a_scale_that_overflows_float32_gives_one_line_and_no_numpy_warning(tmp_path):
    """In a process of its own: pytest would catch numpy's RuntimeWarning before it reached stderr."""
    import subprocess

    path = _dequantised_model(tmp_path, np.full(N, 3e38, np.float32), np.zeros(N, np.int8), axis=1)
    script = f"import sys; from auditor.cli.audit import main; sys.exit(main([{str(path)!r}, '--quiet']))"
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("audit: error:") and "model.onnx" in lines[0], run.stderr


def test_a_per_tensor_dequantized_bias_of_rank_one_ignores_the_default_axis(tmp_path, head_rows):
    """DequantizeLinear's axis (default 1) counts only per axis or per block: an int32 bias with a scalar scale,
    as a QDQ model carries it, is read (its rank, 1, has no axis 1)."""
    weight, _ = head_rows
    quantised_bias = np.arange(-3, N - 3, dtype=np.int32)
    path = save(tmp_path / "model.onnx", [helper.make_node("DequantizeLinear", ["bq", "bs"], ["b"]),
                                          helper.make_node("MatMul", ["x", "W"], ["mm"]),
                                          helper.make_node("Add", ["mm", "b"], ["logits"]),
                                          helper.make_node("Softmax", ["logits"], ["probs"])],
                [("W", weight.T.copy()), ("bq", quantised_bias), ("bs", np.array(0.5, np.float32))], opset=21)
    head = load_head(path)
    np.testing.assert_array_equal(head.bias, quantised_bias.astype(np.float32) * np.float32(0.5))
    assert_head_computes_the_graphs_logits(path, head)
