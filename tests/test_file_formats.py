"""Checkpoint files are recognised by their contents, not their names; other frameworks' files,
text and damaged files are refused with one line that says what the file is."""

import json
import os
import pickle
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from auditor.cli.audit import main
from auditor.loader import load_head
from auditor.loader.formats import identify

ROWS = np.array([[1, 0, 0], [0, 1, 0], [0, 0, 1], [0.2, 0.2, 0.2], [-1, -1, -1]], dtype=np.float32)
REPOSITORY = Path(__file__).resolve().parent.parent
TORCH_ADVICE = ("weights_only=False", "will likely succeed")


def as_array(tensor) -> np.ndarray:
    return tensor.numpy() if isinstance(tensor, torch.Tensor) else np.asarray(tensor)


def write_safetensors(path):
    save_file({"lm_head.weight": ROWS}, str(path))


def write_torch_zip(path):
    torch.save({"lm_head.weight": torch.from_numpy(ROWS)}, path)


def write_legacy_torch(path):
    torch.save({"lm_head.weight": torch.from_numpy(ROWS)}, path, _use_new_zipfile_serialization=False)


def write_npy(path):
    with open(path, "wb") as stream:  # np.save would append .npy to a name without it
        np.save(stream, ROWS)


def write_npz(path):
    with open(path, "wb") as stream:
        np.savez(stream, **{"lm_head.weight": ROWS})


def write_gguf(path):
    gguf = pytest.importorskip("gguf")
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("output.weight", ROWS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_onnx(path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph([helper.make_node("Gemm", ["x", "lm_head.weight"], ["logits"], transB=1)], "head",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 5])],
                              initializer=[numpy_helper.from_array(ROWS, "lm_head.weight")])
    onnx.save_model(helper.make_model(graph), str(path))


WRITERS = {  # format -> (writer, its usual name, a misleading name)
    "safetensors": (write_safetensors, "head.safetensors", "head.bin"),
    "torch-zip": (write_torch_zip, "head.pt", "head.safetensors"),
    "pickle": (write_legacy_torch, "head.bin", "head.npy"),
    "npy": (write_npy, "head.npy", "head.pt"),
    "npz": (write_npz, "head.npz", "head.bin"),
    "gguf": (write_gguf, "head.gguf", "head.safetensors"),
    "onnx": (write_onnx, "head.onnx", "head.bin"),
}


def audit_error(capsys, *args) -> str:
    """The one line the command prints on a refused input (exit 2)."""
    code = main([*map(str, args), "--quiet"])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, captured.err
    assert len(lines) == 1 and lines[0].startswith("audit: error:"), captured.err
    assert not any(advice in lines[0] for advice in TORCH_ADVICE)
    return lines[0]


def cli_error(*args) -> str:
    """The same, from ``python -m auditor`` itself: nothing else may reach stderr, warnings included."""
    done = subprocess.run([sys.executable, "-m", "auditor", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPOSITORY)})
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2, done.stderr
    assert len(lines) == 1 and lines[0].startswith("audit: error:"), done.stderr
    assert not any(advice in lines[0] for advice in TORCH_ADVICE)
    return lines[0]


@pytest.mark.parametrize("kind", sorted(WRITERS))
def test_a_misnamed_checkpoint_loads_by_its_contents(tmp_path, kind):
    write, usual, misleading = WRITERS[kind]
    write(tmp_path / usual)
    (tmp_path / "misnamed").mkdir()
    write(tmp_path / "misnamed" / misleading)
    assert identify(tmp_path / "misnamed" / misleading) == kind
    expected = load_head(tmp_path / usual)
    got = load_head(tmp_path / "misnamed" / misleading)
    assert got.weight_name == expected.weight_name
    np.testing.assert_array_equal(as_array(got.weight), as_array(expected.weight))
    np.testing.assert_array_equal(as_array(got.weight), ROWS)


@pytest.mark.parametrize("kind", ["safetensors", "torch-zip"])
def test_a_shard_index_is_recognised_by_its_weight_map_and_its_shards_by_their_contents(tmp_path, kind):
    write = WRITERS[kind][0]
    write(tmp_path / "part-1.data")
    (tmp_path / "shards.json").write_text(json.dumps({"metadata": {}, "weight_map": {"lm_head.weight": "part-1.data"}}))
    assert identify(tmp_path / "shards.json") == "index"
    np.testing.assert_array_equal(as_array(load_head(tmp_path / "shards.json").weight), ROWS)


def test_a_folder_file_with_the_wrong_format_for_its_name_still_loads(tmp_path):
    write_safetensors(tmp_path / "pytorch_model.bin")  # safetensors under the torch name
    np.testing.assert_array_equal(as_array(load_head(tmp_path).weight), ROWS)


@pytest.mark.slow
def test_a_ctranslate2_model_is_named_and_torch_is_never_asked(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(b"\x06\x00\x00\x00\x0cWhisperSpec")  # a one-byte length: recognised, then refused as damaged
    line = cli_error(path)
    assert "CTranslate2 model" in line and "unpickle" not in line


def test_a_ctranslate2_model_cut_after_its_header_is_called_truncated(tmp_path, capsys):
    # as CTranslate2 writes it: uint32 version, uint16 length counting the NUL, the name, NUL, revision, count
    name = b"TransformerDecoderSpec"
    path = tmp_path / "model.bin"
    path.write_bytes(struct.pack("<IH", 6, len(name) + 1) + name + b"\x00" + struct.pack("<II", 8, 1))
    assert "a truncated CTranslate2 model" in audit_error(capsys, path)


def test_a_ctranslate2_folder_without_a_projection_says_so(tmp_path, capsys):
    name = b"WhisperSpec"
    (tmp_path / "model.bin").write_bytes(struct.pack("<IH", 6, len(name) + 1) + name + b"\x00" + bytes(64))
    (tmp_path / "config.json").write_text(json.dumps({"suppress_ids": []}))
    (tmp_path / "vocabulary.json").write_text(json.dumps(["a", "b"]))
    line = audit_error(capsys, tmp_path)
    assert "model.bin: a CTranslate2 model (WhisperSpec) with no decoder/projection/weight" in line


def test_a_text_file_named_like_a_torch_checkpoint_is_not_a_checkpoint(tmp_path):
    path = tmp_path / "t.pt"
    path.write_text("hello\n")
    line = cli_error(path)
    assert "not a checkpoint" in line and "KeyError" not in line


@pytest.mark.slow
def test_a_pickle_of_a_function_is_refused_without_torchs_advice(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(pickle.dumps({"lm_head.weight": os.system}))
    line = cli_error(path)  # torch also warns about the pickle protocol: that must not reach stderr
    assert "objects other than tensors" in line and "never unpickles" in line and "safetensors" in line


class Recipe:  # a custom object in a checkpoint, which the weights-only unpickler must refuse
    def __init__(self):
        self.steps = 3


@pytest.mark.slow
def test_a_torch_checkpoint_holding_an_object_is_refused_without_torchs_advice(tmp_path):
    path = tmp_path / "ckpt.pt"
    torch.save({"lm_head.weight": torch.from_numpy(ROWS), "recipe": Recipe()}, path)
    line = cli_error(path)
    assert "objects other than tensors" in line and "Recipe" in line


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.jit is deprecated, but its files are still about
def test_a_torchscript_archive_is_named_without_torchs_advice(tmp_path, capsys):
    path = tmp_path / "model.pt"
    torch.jit.save(torch.jit.script(torch.nn.Linear(3, 5)), str(path))
    assert "TorchScript" in audit_error(capsys, path)


def test_an_hdf5_file_is_named(tmp_path, capsys):
    path = tmp_path / "tf_model.bin"
    path.write_bytes(b"\x89HDF\r\n\x1a\n" + bytes(200))
    assert "HDF5" in audit_error(capsys, path)


def onnx_bytes() -> bytes:
    """The start of an ONNX ModelProto: ir_version 8, producer, version, a graph, an opset."""
    def field(number, payload):
        return bytes([number << 3 | 2, len(payload)]) + payload
    graph = field(1, field(4, b"MatMul")) + field(2, b"main_graph")
    return b"\x08\x08" + field(2, b"pytorch") + field(3, b"2.1.0") + field(7, graph) + field(8, b"\x12\x00\x10\x11")


def test_an_onnx_model_is_read_by_its_contents_whatever_its_name(tmp_path, capsys):
    pytest.importorskip("onnx")
    path = tmp_path / "model.bin"
    path.write_bytes(onnx_bytes())
    assert identify(path) == "onnx"
    line = audit_error(capsys, path)  # read as ONNX: its one MatMul has no weight
    assert "no classifier head found in the ONNX graph" in line


def test_a_savedmodel_folder_is_named(tmp_path, capsys):
    meta_graph = b"\x0a\x04\x0a\x02v1" + b"\x12\x10" + bytes(16)
    (tmp_path / "saved_model.pb").write_bytes(b"\x08\x01\x12" + bytes([len(meta_graph)]) + meta_graph)
    (tmp_path / "variables").mkdir()
    assert "saved_model.pb is a TensorFlow SavedModel" in audit_error(capsys, tmp_path)


@pytest.mark.parametrize("head, named", [
    (b"tjgg\x01\x00\x00\x00" + bytes(32), "ggjt"),
    (b"\x81\xa5model\x81\xa7lm_head\xc7\x10\x01" + bytes(16), "Flax msgpack"),
])
def test_other_frameworks_files_are_named(tmp_path, capsys, head, named):
    path = tmp_path / "model.bin"
    path.write_bytes(head)
    assert named in audit_error(capsys, path)


def test_an_empty_file_is_refused(tmp_path, capsys):
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert "empty file" in audit_error(capsys, tmp_path / "model.safetensors")


def test_a_safetensors_file_cut_inside_its_header_is_called_truncated(tmp_path, capsys):
    path = tmp_path / "head.bin"
    write_safetensors(path)
    path.write_bytes(path.read_bytes()[:40])
    assert "truncated safetensors" in audit_error(capsys, path)


def test_a_git_lfs_pointer_says_to_fetch_the_file(tmp_path, capsys):
    path = tmp_path / "model.safetensors"
    path.write_text("version https://git-lfs.github.com/spec/v1\noid sha256:0123abcd\nsize 1234\n")
    assert "git lfs pull" in audit_error(capsys, path)


def test_a_json_file_without_a_weight_map_is_not_a_checkpoint(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "gpt2"}))
    assert "not a checkpoint" in audit_error(capsys, path)


def test_unknown_bytes_are_refused_with_what_was_expected(tmp_path, capsys):
    path = tmp_path / "head.safetensors"
    path.write_bytes(bytes(range(256)) * 4)
    line = audit_error(capsys, path)
    assert "not a recognised checkpoint format" in line and ".gguf" in line and "its name says" in line


def test_a_zip_of_something_else_is_refused(tmp_path, capsys):
    import zipfile

    path = tmp_path / "model.pt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("readme.txt", "hello")
    assert "neither a PyTorch checkpoint nor an .npz" in audit_error(capsys, path)


def test_a_damaged_pickle_is_one_line_naming_the_failure(tmp_path, capsys):
    path = tmp_path / "head.pt"
    path.write_bytes(b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19" + b"junk" * 8)  # torch's legacy magic
    assert "not a readable PyTorch checkpoint" in audit_error(capsys, path)


@pytest.mark.parametrize("tied", [True, False])
def test_a_torch_file_whose_head_is_the_embedding_itself_is_tied(tmp_path, tied):
    """torch.save writes a tied parameter once: lm_head.weight and transformer.wte.weight are then one tensor
    (same storage, offset, shape and strides), and the head is reported tied; a clone is not."""
    wte = torch.randn(64, 8)
    state = {"transformer.wte.weight": wte, "transformer.h.0.mlp.weight": torch.randn(8, 8),
             "lm_head.weight": wte if tied else wte.clone()}
    path = tmp_path / "model.pt"
    torch.save(state, path)
    head = load_head(path)
    assert head.weight_name == "lm_head.weight"
    assert head.tied is tied
    assert any("shares its storage with the input embedding transformer.wte.weight" in note
               for note in head.notes) is tied
