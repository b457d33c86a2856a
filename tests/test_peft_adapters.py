"""PEFT adapter folders: the head an adapter gives over its base model's is the head peft's own model computes
(its forward pass and merge_and_unload, bit for bit), its verdicts are the plain LP's, the report says which
adapter was applied over which base, and what cannot be audited is refused in one line that says what to do.

The tests marked slow build tiny Llama models from configs and train nothing: they save adapters made by peft
with their trainable parameters moved at random. The others write adapter folders by hand, as peft lays them
out, so that the rules are checked without peft or transformers."""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from tokenizers import Tokenizer, models

import auditor
from auditor.cli.audit import main as audit
from auditor.errors import InputError
from auditor.loader import load_head
from auditor.loader.peft_files import split_key
from test_low_rank_heads import compared_with_plain_lp

VOCAB, ADDED, HIDDEN = 64, 6, 16  # 64 words, then 6 added tokens whose rows are mean-initialised
TRAINED = [64, 65, 66]  # the added tokens the adapters train
LORA = {"r": 4, "lora_alpha": 8}


def _tokenizer(folder: Path, added: list[str]) -> None:
    tokenizer = Tokenizer(models.WordLevel({f"w{k}": k for k in range(VOCAB)}, unk_token="w0"))
    tokenizer.add_special_tokens(added)
    tokenizer.save(str(folder / "tokenizer.json"))


def _run(capsys, *args) -> tuple[int, dict | None, str]:
    code = audit([*map(str, args), "--format", "json", "--quiet"])
    out, err = capsys.readouterr()
    return code, (json.loads(out) if out else None), err


def _one_error_line(code: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("audit: error:") and "Traceback" not in err, err
    return lines[0]


def _numpy(tensor) -> np.ndarray:
    return tensor.detach().cpu().numpy() if isinstance(tensor, torch.Tensor) else np.asarray(tensor)


# --- adapters made by peft -----------------------------------------------------------------------------------

def _base_model(folder: Path, tied: bool) -> Path:
    """A 1-layer Llama of 70 tokens and hidden size 16 whose 6 added rows sit at the mean of the others (so they
    cannot win), saved with its tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB + ADDED, hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for matrix in {id(m): m for m in (model.get_input_embeddings().weight,
                                          model.get_output_embeddings().weight)}.values():
            matrix[VOCAB:] = matrix[:VOCAB].mean(dim=0) + 1e-4 * torch.randn(ADDED, HIDDEN)
    model.save_pretrained(folder)
    _tokenizer(folder, [f"<reserved_{k}>" for k in range(ADDED)])
    return folder


def _adapter(base: Path, config, folder: Path, resize: int | None = None) -> Path:
    """peft's adapter of ``config`` over the base, its trainable parameters moved at random, saved by peft."""
    from peft import get_peft_model
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(base))  # base_model_name_or_path: the base's folder
    if resize is not None:
        model.resize_token_embeddings(resize)
    model = get_peft_model(model, config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.requires_grad:
                parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(str(folder))
    return folder


def _peft_heads(base: Path, adapter: Path, resize: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(the head of peft's model with the adapter loaded, as its forward pass computes it; the head of
    merge_and_unload's model)."""
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(base))
    if resize is not None:
        model.resize_token_embeddings(resize)
    model = PeftModel.from_pretrained(model, str(adapter))
    with torch.no_grad():  # logits of the unit vectors: the rows, exactly (each is one product by 1)
        forward = model.get_output_embeddings()(torch.eye(HIDDEN)).T.numpy().copy()
    merged = model.merge_and_unload().get_output_embeddings().weight.detach().numpy().copy()
    return forward, merged


def _configs():
    from peft import LoraConfig, TrainableTokensConfig

    def lora(modules=("q_proj",), **options):
        return LoraConfig(target_modules=list(modules), **LORA, **options)

    # name: (tied base, adapter config, vocabulary resized to, rows the adapter changes: all, some, or none)
    cases = [
        ("modules_to_save", False, lora(modules_to_save=["lm_head"]), None, "all"),
        ("modules_to_save-tied", True, lora(modules_to_save=["lm_head"]), None, "all"),
        ("trainable_token_indices-tied", True, lora(trainable_token_indices=TRAINED), None, TRAINED),
        ("trainable_token_indices-head", False,
         lora(trainable_token_indices={"lm_head": TRAINED, "embed_tokens": [1, 2]}), None, TRAINED),
        ("TrainableTokensConfig-tied", True, TrainableTokensConfig(token_indices=TRAINED), None, TRAINED),
        ("TrainableTokensConfig-head", False, TrainableTokensConfig(target_modules=["lm_head"], token_indices=TRAINED),
         None, TRAINED),
        ("lora-head", False, lora(("q_proj", "lm_head")), None, "all"),
        ("rslora-head-tied", True, lora(("q_proj", "lm_head"), use_rslora=True, alpha_pattern={"lm_head": 3}),
         None, "all"),
        ("resized-vocabulary", False, lora(), VOCAB + ADDED + 2, "all"),
        ("lora-attention-only", False, lora(("q_proj", "v_proj")), None, "none"),
        ("trainable-tokens-untied-embedding", False, lora(trainable_token_indices=TRAINED), None, "none"),
        ("modules_to_save-embedding-tied", True, lora(modules_to_save=["embed_tokens"]), None, "none"),
    ]
    return {name: rest for name, *rest in cases}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    pytest.importorskip("peft")
    folder = tmp_path_factory.mktemp("bases")
    return {tied: _base_model(folder / ("tied" if tied else "untied"), tied) for tied in (False, True)}


CASES = ["modules_to_save", "modules_to_save-tied", "trainable_token_indices-tied", "trainable_token_indices-head",
         "TrainableTokensConfig-tied", "TrainableTokensConfig-head", "lora-head", "rslora-head-tied",
         "resized-vocabulary", "lora-attention-only", "trainable-tokens-untied-embedding",
         "modules_to_save-embedding-tied"]


@pytest.mark.slow
@pytest.mark.parametrize("name", CASES)
def test_the_audited_head_is_the_head_of_peft_s_own_model(name, bases, tmp_path):
    tied, config, resize, changed = _configs()[name]
    base = bases[tied]
    adapter = _adapter(base, config, tmp_path / name, resize)
    forward, merged = _peft_heads(base, adapter, resize)
    assert np.array_equal(forward, merged)  # peft agrees with itself on these layouts
    head = load_head(adapter)  # the base from the adapter's base_model_name_or_path, a local folder
    weight = _numpy(head.weight)
    assert weight.dtype == np.float32 and np.array_equal(weight, merged)
    base_weight = _numpy(load_head(base).weight)
    if changed == "none":
        assert np.array_equal(weight, base_weight)
        assert any("does not change the output head" in note and str(base) in note for note in head.notes)
    else:
        assert any(note.startswith(f"PEFT adapter ({config.peft_type.value}) applied over the base model {base}")
                   for note in head.notes), head.notes
        if changed != "all":
            differ = np.flatnonzero((weight != base_weight).any(axis=1)).tolist()
            assert differ == changed
    assert head.path == adapter


@pytest.mark.slow
def test_trained_tokens_win_where_the_base_s_mean_rows_could_not_and_the_plain_lp_agrees(bases, tmp_path):
    """The base's 6 mean-initialised rows cannot win; an adapter that trains 3 of them (trainable tokens on the
    tied embedding) makes those 3 argmaxable, and every verdict over the adapter's head is the plain LP's."""
    from peft import LoraConfig

    base = bases[True]
    before = auditor.audit(_numpy(load_head(base).weight), progress=False)
    assert before.ids("unargmaxable") == list(range(VOCAB, VOCAB + ADDED))
    adapter = _adapter(base, LoraConfig(target_modules=["q_proj"], trainable_token_indices=TRAINED, **LORA),
                       tmp_path / "adapter")
    weight = _numpy(load_head(adapter).weight)
    report = auditor.audit(weight, progress=False)
    assert report.counts["inconclusive"] == 0
    assert report.ids("unargmaxable") == [67, 68, 69]
    assert compared_with_plain_lp(report, weight, None) >= 68
    assert auditor.verify(report, weight).ok


@pytest.mark.slow
def test_the_command_audits_an_adapter_over_base_with_the_adapter_s_token_strings(bases, tmp_path, capsys):
    from peft import TrainableTokensConfig

    base = bases[True]
    adapter = _adapter(base, TrainableTokensConfig(token_indices=TRAINED), tmp_path / "adapter")
    code, report, err = _run(capsys, adapter, "--base", base)
    assert code == 1, err
    assert report["head"]["path"] == str(adapter) and report["head"]["format"] == "peft adapter"
    assert report["head"]["tied"] is True  # the rows are the tied embedding's: the head is still the embedding
    assert any(f"applied over the base model {base}: rows 64..66 are the adapter's trainable tokens" in note
               for note in report["notes"]), report["notes"]
    assert {f["id"]: f["token"] for f in report["findings"]} == {67: "<reserved_3>", 68: "<reserved_4>",
                                                                 69: "<reserved_5>"}
    _tokenizer(adapter, ["<tool>", "</tool>", "<think>", "<r3>", "<r4>", "<r5>"])  # the adapter's own tokenizer
    code, report, err = _run(capsys, adapter, "--base", base, "--tokens", "added")
    assert code == 1, err
    assert {f["id"]: f["token"] for f in report["findings"]} == {67: "<r3>", 68: "<r4>", 69: "<r5>"}
    assert report["summary"]["undecided"] == VOCAB
    assert report["head"]["token_strings"] == str(adapter / "tokenizer.json")


# --- adapters written by hand, as peft lays them out -----------------------------------------------------------

def _plain_base(folder: Path, tied: bool = False, rows: int = 40, width: int = 6) -> tuple[Path, np.ndarray]:
    """A base model folder: config.json and model.safetensors with an embedding, a layer and (untied) a head."""
    rng = np.random.default_rng(3)
    folder.mkdir(parents=True)
    tensors = {"model.embed_tokens.weight": rng.standard_normal((rows, width)).astype(np.float32),
               "model.layers.0.self_attn.q_proj.weight": rng.standard_normal((width, width)).astype(np.float32)}
    if not tied:
        tensors["lm_head.weight"] = rng.standard_normal((rows, width)).astype(np.float32)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "tie_word_embeddings": tied}))
    return folder, tensors["model.embed_tokens.weight" if tied else "lm_head.weight"]


def _hand_adapter(folder: Path, tensors: dict, base: Path | str | None, **config) -> Path:
    folder.mkdir(parents=True)
    save_file({f"base_model.model.{name}": value for name, value in tensors.items()},
              str(folder / "adapter_model.safetensors"))
    document = {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"],
                "base_model_name_or_path": None if base is None else str(base), **config}
    (folder / "adapter_config.json").write_text(json.dumps(document))
    return folder


def _lora_pair(rng, rows: int, width: int, r: int = 2) -> dict:
    return {"lora_A.weight": rng.standard_normal((r, width)).astype(np.float32),
            "lora_B.weight": rng.standard_normal((rows, r)).astype(np.float32)}


def test_adapter_keys_name_the_base_model_s_modules_whatever_peft_wrapped_them_in():
    assert split_key("base_model.model.lm_head.weight") == ("lm_head", "weight")
    assert split_key("base_model.model.lm_head.modules_to_save.default.weight") == ("lm_head", "weight")
    assert split_key("base_model.model.lm_head.base_layer.weight") == ("lm_head", "weight")
    assert split_key("base_model.model.lm_head.lora_A.weight") == ("lm_head", "lora_A")
    assert split_key("base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta") == (
        "model.embed_tokens", "delta")
    assert split_key("base_model.model.model.embed_tokens.lora_embedding_B") == ("model.embed_tokens",
                                                                                 "lora_embedding_B")
    assert split_key("base_model.model.lm_head.lora_magnitude_vector") == ("lm_head", "lora_magnitude_vector")


@pytest.mark.parametrize("layout", ["lm_head.weight", "lm_head.modules_to_save.default.weight", "bin"])
def test_a_saved_copy_of_the_head_is_the_head_in_every_layout_peft_wrote(tmp_path, layout):
    base, _ = _plain_base(tmp_path / "base")
    copy = np.random.default_rng(5).standard_normal((40, 6)).astype(np.float32)
    key = "lm_head.weight" if layout == "bin" else layout
    adapter = _hand_adapter(tmp_path / "adapter", {key: copy}, base, modules_to_save=["lm_head"])
    if layout == "bin":
        (adapter / "adapter_model.safetensors").unlink()
        torch.save({f"base_model.model.{key}": torch.from_numpy(copy)}, adapter / "adapter_model.bin")
    head = load_head(adapter)
    assert np.array_equal(_numpy(head.weight), copy)
    assert any("the head is the adapter's own copy of lm_head (40 rows)" in note for note in head.notes)


def test_lora_on_the_head_is_merged_with_rslora_scaling(tmp_path):
    base, W = _plain_base(tmp_path / "base")
    pair = _lora_pair(np.random.default_rng(6), 40, 6, r=4)
    adapter = _hand_adapter(tmp_path / "adapter", {f"lm_head.{k}": v for k, v in pair.items()}, base,
                            r=4, lora_alpha=8, use_rslora=True, target_modules=["lm_head"])
    head = load_head(adapter)
    expected = W.astype(np.float64) + pair["lora_B.weight"] @ pair["lora_A.weight"] * (8 / np.sqrt(4))
    assert np.allclose(_numpy(head.weight), expected, rtol=1e-5, atol=1e-5)
    assert head.tied is False
    assert any("scaling lora_alpha / sqrt(r) = 8 / sqrt(4) = 4" in note for note in head.notes), head.notes


def test_an_adapter_that_leaves_the_head_alone_audits_the_base_s_head_and_says_so(tmp_path, capsys):
    base, W = _plain_base(tmp_path / "base")
    pair = _lora_pair(np.random.default_rng(7), 6, 6)
    adapter = _hand_adapter(tmp_path / "adapter", {f"model.layers.0.self_attn.q_proj.{k}": v for k, v in pair.items()},
                            base)
    head = load_head(adapter)
    assert np.array_equal(_numpy(head.weight), W)
    code, report, err = _run(capsys, adapter)
    assert code in (0, 1), err
    assert report["head"]["path"] == str(adapter)
    assert any(f"PEFT adapter (LORA) over the base model {base}: it does not change the output head (it holds "
               f"LoRA on q_proj), so the base model's head is audited as it is" in note for note in report["notes"])


def test_trainable_tokens_of_an_untied_embedding_leave_the_head_alone_and_the_note_says_how_to_train_it(tmp_path):
    base, W = _plain_base(tmp_path / "base")
    rows = np.ones((2, 6), dtype=np.float32)
    adapter = _hand_adapter(tmp_path / "adapter", {"model.embed_tokens.token_adapter.trainable_tokens_delta": rows},
                            base, trainable_token_indices=[38, 39])
    head = load_head(adapter)
    assert np.array_equal(_numpy(head.weight), W)
    assert any("list the head in trainable_token_indices as well" in note for note in head.notes)


def test_a_base_model_in_the_hugging_face_cache_is_read_from_it_and_never_fetched(tmp_path, monkeypatch):
    pytest.importorskip("huggingface_hub")
    import huggingface_hub.constants

    cache = tmp_path / "cache"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # reading the cache is not offline mode
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # a fetch would fail loudly
    rows = np.random.default_rng(8).standard_normal((30, 4)).astype(np.float32)
    adapter = _hand_adapter(tmp_path / "adapter", {"model.embed_tokens.trainable_tokens_delta": np.zeros((1, 4),
                            dtype=np.float32)}, "org/base", peft_type="TRAINABLE_TOKENS", token_indices=[7])
    with pytest.raises(InputError, match=r"org/base: the model is not in the local cache .*never fetched: pass "
                                         r"--base org/base to fetch it, or --base PATH"):
        load_head(adapter)
    commit = "3f1c0d9e8b7a6f5e4d3c2b1a0f9e8d7c6b5a4f3e"
    snapshot = cache / "models--org--base" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (cache / "models--org--base" / "refs").mkdir()
    (cache / "models--org--base" / "refs" / "main").write_text(commit)
    save_file({"model.embed_tokens.weight": rows}, str(snapshot / "model.safetensors"))
    (snapshot / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    head = load_head(adapter)
    expected = rows.copy()
    expected[7] = 0
    assert np.array_equal(_numpy(head.weight), expected)
    assert any(f"over the base model org/base@{commit}: row 7 is the adapter's trainable tokens" in note
               for note in head.notes), head.notes


def _cache_snapshot(cache: Path, repo: str, commit: str, folder: Path) -> Path:
    """``folder``'s files as the cached snapshot of ``repo`` at ``commit`` (main pointing at it)."""
    snapshot = cache / ("models--" + repo.replace("/", "--")) / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text(commit)
    for file in folder.iterdir():
        (snapshot / file.name).write_bytes(file.read_bytes())
    return snapshot


def test_an_adapter_given_as_a_hub_id_audits_as_its_folder_and_with_base(tmp_path, monkeypatch, capsys):
    """An adapter repository on the Hub (adapter_config.json, adapter_model.safetensors, no model checkpoint),
    here found in the cache: the same head, verdicts and findings as its local folder, over the base it names
    or over --base; a model's id with --base is still refused."""
    pytest.importorskip("huggingface_hub")
    import huggingface_hub.constants

    cache = tmp_path / "cache"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    base, rows = _plain_base(tmp_path / "base")
    copy = rows.copy()
    copy[-3:] = rows[:-3].mean(axis=0)  # three rows the adapter set to the mean: unargmaxable
    adapter = _hand_adapter(tmp_path / "adapter", {"lm_head.weight": copy}, base)
    commit = "0123456789abcdef0123456789abcdef01234567"
    _cache_snapshot(cache, "org/adapter", commit, adapter)
    head = load_head("org/adapter")
    assert head.path == Path(f"org/adapter@{commit}") and np.array_equal(_numpy(head.weight), copy)
    assert any(f"applied over the base model {base}: the head is the adapter's own copy of lm_head (40 rows)"
               in note for note in head.notes), head.notes
    code, local, _ = _run(capsys, str(adapter))
    hub_code, report, err = _run(capsys, "org/adapter")
    assert (hub_code, err) == (code, "") and code == 1
    assert report["findings"] == local["findings"] and report["summary"] == local["summary"]
    assert {f["id"] for f in report["findings"]} >= {37, 38, 39}
    other, _ = _plain_base(tmp_path / "other")
    head = load_head("org/adapter", base=other)  # --base over the adapter's own base_model_name_or_path
    assert np.array_equal(_numpy(head.weight), copy)
    _cache_snapshot(cache, "org/model", commit, base)
    with pytest.raises(InputError, match="is not a PEFT adapter folder"):
        load_head("org/model", base=other)


def _missing_base_line(capsys, adapter) -> str:
    return _one_error_line(*_run(capsys, adapter)[::2])


def test_a_missing_base_model_says_to_pass_base(tmp_path, capsys):
    delta = {"lm_head.trainable_tokens_delta": np.zeros((1, 6), dtype=np.float32)}
    config = {"peft_type": "TRAINABLE_TOKENS", "token_indices": [3]}
    nameless = _hand_adapter(tmp_path / "nameless", delta, None, **config)
    assert "names no base model (base_model_name_or_path is empty): pass --base PATH" in _missing_base_line(
        capsys, nameless)
    elsewhere = _hand_adapter(tmp_path / "elsewhere", delta, "/nowhere/llama-base", **config)
    line = _missing_base_line(capsys, elsewhere)
    assert "'/nowhere/llama-base' (base_model_name_or_path in adapter_config.json) is neither a folder here nor a " \
           "Hub id: pass --base PATH" in line
    code, _, err = _run(capsys, elsewhere, "--base", tmp_path / "not-there")
    assert f"--base {tmp_path / 'not-there'} cannot be read: {tmp_path / 'not-there'}: no such file or folder" in \
        _one_error_line(code, err)
    base, _ = _plain_base(tmp_path / "base")
    code, report, err = _run(capsys, elsewhere, "--base", base)  # --base wins over the adapter's own
    assert code in (0, 1), err


def test_base_is_refused_for_what_is_not_an_adapter_and_an_adapter_is_refused_as_a_base(tmp_path, capsys):
    base, _ = _plain_base(tmp_path / "base")
    line = _one_error_line(*_run(capsys, base, "--base", base)[::2])
    assert f"--base {base}: {base} is not a PEFT adapter folder (with adapter_config.json)" in line
    first = _hand_adapter(tmp_path / "first", {"lm_head.weight": np.zeros((40, 6), np.float32)}, base)
    second = _hand_adapter(tmp_path / "second", {"lm_head.weight": np.zeros((40, 6), np.float32)}, first)
    assert "is itself a PEFT adapter" in _missing_base_line(capsys, second)


@pytest.mark.parametrize("tensors, config, tied, message", [
    ({"model.embed_tokens.lora_embedding_A": np.ones((2, 40), np.float32),
      "model.embed_tokens.lora_embedding_B": np.ones((6, 2), np.float32)}, {}, True,
     "LoRA on the input embedding model.embed_tokens, which the base's head is tied to: peft's forward pass leaves "
     "the head as it is, and merge_and_unload changes it; merge the adapter with peft (merge_and_unload), save the "
     "merged model (save_pretrained) and audit that"),
    ({"lm_head.lora_A.weight": np.ones((2, 6), np.float32), "lm_head.lora_B.weight": np.ones((40, 2), np.float32),
      "lm_head.lora_magnitude_vector": np.ones(40, np.float32)}, {"use_dora": True}, False,
     "changes the head lm_head by DoRA, which the auditor does not apply; merge the adapter with peft"),
    ({"model.embed_tokens.token_adapter.trainable_tokens_delta": np.ones((2, 6), np.float32),
      "lm_head.token_adapter.trainable_tokens_delta": np.ones((1, 6), np.float32)},
     {"trainable_token_indices": {"embed_tokens": [1, 2], "lm_head": [5]}}, True,
     "trains different tokens of the tied lm_head and model.embed_tokens"),
    ({"model.embed_tokens.token_adapter.trainable_tokens_delta": np.ones((2, 6), np.float32)},
     {"trainable_token_indices": [40, 41]}, True,
     "trains token 41, but the base model's head has 40 rows (ids 0..39): was the vocabulary resized"),
    ({"model.embed_tokens.token_adapter.trainable_tokens_delta": np.ones((3, 6), np.float32)},
     {"trainable_token_indices": [4, 5]}, True,
     "the trainable tokens of model.embed_tokens are [3, 6], but adapter_config.json lists 2 ids"),
    ({"lm_head.weight": np.ones((40, 5), np.float32)}, {"modules_to_save": ["lm_head"]}, False,
     "the adapter's lm_head has shape [40, 5], but the base model's head is 40 x 6: is --base the model"),
])
def test_what_cannot_be_audited_as_peft_runs_it_is_refused_in_one_line(tmp_path, capsys, tensors, config, tied,
                                                                       message):
    base, _ = _plain_base(tmp_path / "base", tied=tied)
    adapter = _hand_adapter(tmp_path / "adapter", tensors, base, **config)
    assert message in _missing_base_line(capsys, adapter)


def test_an_adapter_config_without_weights_is_one_clear_line(tmp_path, capsys):
    folder = tmp_path / "adapter"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA"}))
    assert ("a PEFT adapter folder (adapter_config.json) without its weights (adapter_model.safetensors or "
            "adapter_model.bin)") in _missing_base_line(capsys, folder)


def test_the_weights_file_of_an_adapter_audits_as_its_folder(tmp_path):
    base, _ = _plain_base(tmp_path / "base")
    copy = np.full((40, 6), 2.0, dtype=np.float32)
    adapter = _hand_adapter(tmp_path / "adapter", {"lm_head.weight": copy}, base)
    head = load_head(adapter / "adapter_model.safetensors")
    assert head.path == adapter and np.array_equal(_numpy(head.weight), copy)


def test_a_trainer_output_folder_of_adapters_audits_its_latest_adapter(tmp_path):
    base, _ = _plain_base(tmp_path / "base")
    for step in (5, 50):
        _hand_adapter(tmp_path / "out" / f"checkpoint-{step}", {"lm_head.weight": np.full((40, 6), float(step),
                                                                                          np.float32)}, base)
    head = load_head(tmp_path / "out")
    assert head.path == tmp_path / "out" / "checkpoint-50" and float(_numpy(head.weight)[0, 0]) == 50.0
    assert any("its latest checkpoint, checkpoint-50, is audited" in note for note in head.notes)


def test_the_vocab_file_names_the_adapter_s_rows(tmp_path):
    base, _ = _plain_base(tmp_path / "base")
    adapter = _hand_adapter(tmp_path / "adapter", {"lm_head.weight": np.ones((42, 6), np.float32)}, base,
                            modules_to_save=["lm_head"])  # a head resized to 42 rows
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("".join(f"t{k}\n" for k in range(41)), encoding="utf-8")
    head = load_head(adapter, vocab=vocab)
    assert head.shape == (42, 6) and head.tokens[40] == "t40"
    assert any("ids 41 have no string" in note for note in head.notes), head.notes


def test_the_html_page_reproduces_with_base_and_audit_verify_takes_it(tmp_path, capsys):
    """An adapter audited over --base: the page's commands carry --base, and audit-verify re-checks the
    certificates over the same base (without it, the adapter's own base cannot be found)."""
    from auditor.cli.verify import main as verify

    base, head = _plain_base(tmp_path / "base", rows=40, width=4)
    rows = np.vstack([head[:3].mean(axis=0), head[5]]).astype(np.float32)  # a mean row and a copy of row 5
    delta = {"lm_head.trainable_tokens_delta": rows}
    adapter = _hand_adapter(tmp_path / "adapter", delta, "/nowhere/base", peft_type="TRAINABLE_TOKENS",
                            token_indices=[38, 39])
    page, certificates = tmp_path / "page.html", tmp_path / "certificates.json"
    code = audit([str(adapter), "--base", str(base), "--format", "html", "--output", str(page),
                  "--certificates", str(certificates), "--quiet"])
    assert code == 1, capsys.readouterr().err  # row 39 ties row 5
    text = page.read_text(encoding="utf-8")
    assert f"audit {adapter} --weight lm_head.weight --bias none --base {base}" in text
    assert f"audit-verify {certificates} {adapter} --weight lm_head.weight --bias none --base {base}" in text
    assert verify([str(certificates), str(adapter), "--base", str(base), "--quiet"]) == 0
    capsys.readouterr()
    assert verify([str(certificates), str(adapter), "--quiet"]) == 2
    assert "pass --base PATH" in capsys.readouterr().err
