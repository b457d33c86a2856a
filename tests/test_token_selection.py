"""Naming the tokens to decide: ids and ranges, `added` (past the tokenizer model's own vocabulary), `new`
(past a baseline's), token strings (JSON-quoted where they look like ids); and allow-list ranges."""

import json
import re
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from auditor.cli.audit import main, parse_token_ids
from auditor.errors import InputError
from auditor.findings.gate import AllowList
from auditor.question.head import Head
from conftest import run_command


def _head(n=40, tokens=None, base_vocab=None):
    return Head(weight=np.zeros((n, 4), dtype=np.float32), tokens=tokens, base_vocab=base_vocab)


class _Baseline:
    def __init__(self, n_tokens):
        self.n_tokens = n_tokens


def test_ids_ranges_and_open_ranges_give_sorted_ids_without_repeats():
    assert parse_token_ids("5,0-2,2,38-", 40) == [0, 1, 2, 5, 38, 39]


@pytest.mark.parametrize("text,message", [("7-3", "runs backwards"), ("40", "outside the vocabulary"),
                                          ("", "no token ids given"), ('"abc', "not a valid quoted")])
def test_bad_selections_are_refused_in_one_line(text, message):
    with pytest.raises(InputError, match=message):
        parse_token_ids(text, 40, _head(tokens=[f"t{k}" for k in range(40)]))


def test_added_takes_the_ids_past_the_tokenizer_models_own_vocabulary():
    assert parse_token_ids("added", 40, _head(base_vocab=32)) == list(range(32, 40))
    # without tokenizer.json, the rows past the token strings' length
    assert parse_token_ids("added", 40, _head(tokens=["a"] * 36)) == [36, 37, 38, 39]
    assert parse_token_ids("added,0", 40, _head(base_vocab=38)) == [0, 38, 39]
    with pytest.raises(InputError, match="needs the model's tokenizer.json"):
        parse_token_ids("added", 40, _head())
    grown_not = _head(base_vocab=40)  # nothing was added: no id, and a note, not an error
    assert parse_token_ids("added", 40, grown_not) == []
    assert any("no token was added" in note for note in grown_not.notes)


def test_new_takes_the_ids_past_the_baselines_vocabulary():
    assert parse_token_ids("new", 40, _head(), _Baseline(37)) == [37, 38, 39]
    with pytest.raises(InputError, match="needs --baseline"):
        parse_token_ids("new", 40, _head())
    same = _head()
    assert parse_token_ids("new", 40, same, _Baseline(40)) == []
    assert any("no id is new" in note for note in same.notes)


def test_a_gate_on_added_tokens_passes_a_model_that_added_none(tmp_path):
    """The same CI step on every model: one that added no token decides nothing, fails nothing, and says so."""
    folder = _resized_folder(tmp_path)
    done = _audit(folder, "--tokens", "added,new", "--format", "json", "--quiet")  # without a baseline: refused
    assert done.returncode == 2 and "needs --baseline" in done.stderr
    W = np.random.default_rng(1).standard_normal((32, 8)).astype(np.float32)
    save_file({"lm_head.weight": W}, str(folder / "model.safetensors"))  # the tokenizer's own 32 tokens only
    tokenizer = json.loads((folder / "tokenizer.json").read_text())
    tokenizer["added_tokens"] = []
    (folder / "tokenizer.json").write_text(json.dumps(tokenizer))
    done = _audit(folder, "--tokens", "added", "--format", "json", "--quiet")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["summary"]["undecided"] == 32 and report["findings"] == []
    assert any("no token was added" in note for note in report["notes"])


def test_token_strings_name_tokens_and_quotes_tell_strings_from_ids():
    tokens = [f"t{k}" for k in range(36)] + ["<|im_end|>", "7", "a,b", "t3"]
    head = _head(tokens=tokens)
    assert parse_token_ids("<|im_end|>", 40, head) == [36]
    assert parse_token_ids('"7",7', 40, head) == [7, 37]  # the string "7" is token 37; the id 7 is 7
    assert parse_token_ids('"a,b", 1', 40, head) == [1, 38]
    assert parse_token_ids("t3", 40, head) == [3, 39]  # every id with that string
    with pytest.raises(InputError, match="no token is the string"):
        parse_token_ids("<|missing|>", 40, head)
    with pytest.raises(InputError, match="no token strings"):
        parse_token_ids("<|im_end|>", 40, _head())


def test_allow_lists_take_id_ranges(tmp_path):
    path = tmp_path / "allow.txt"
    path.write_text('2002-2047  # padding rows\n"100-200"\n7\n', encoding="utf-8")
    allow = AllowList.read(path)
    assert allow.allows(2002, None) and allow.allows(2047, None) and not allow.allows(2048, None)
    assert allow.allows(5, "100-200") and not allow.allows(150, None)  # the quoted line is a token string
    assert allow.allows(7, None)
    path.write_text("9-3\n", encoding="utf-8")
    with pytest.raises(InputError, match="runs backwards"):
        AllowList.read(path)


def test_allow_lists_take_ranges_open_at_the_end(tmp_path):
    path = tmp_path / "allow.txt"
    path.write_text("300-   # every reserved row from 300 on\n", encoding="utf-8")
    allow = AllowList.read(path)
    assert allow.allows(300, None) and allow.allows(10 ** 6, None) and not allow.allows(299, None)
    assert allow.strings == set()  # not a token string "300-"
    assert allow.unused([], 200) == ["allow-list entry 300- is not a range of token ids of this head (0..199)"]
    assert allow.unused([], 400) == ["allow-list entry 300- matches no finding"]


def _resized_folder(tmp_path: Path) -> Path:
    """A head of 40 rows in 8 dimensions whose tokenizer's own vocabulary has 32 tokens and 3 added ones
    (ids 32-34); rows 35-39 pad the head past the tokenizer's length. The added rows and the padding
    rows sit at the mean of the first 32: unargmaxable."""
    rng = np.random.default_rng(0)
    W = rng.standard_normal((40, 8)).astype(np.float32)
    W[32:] = W[:32].mean(axis=0)
    W[33:] += 1e-3 * rng.standard_normal((7, 8)).astype(np.float32)
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"lm_head.weight": W}, str(folder / "model.safetensors"))
    vocab = {f"w{k}": k for k in range(32)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>", "<tool>"])
    tokenizer.save(str(folder / "tokenizer.json"))
    assert json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]["w31"] == 31
    return folder


def _audit(*args):
    return run_command(main, *args)  # in this process (every path here is absolute)


def test_the_command_decides_the_added_tokens_by_name_and_by_kind(tmp_path):
    folder = _resized_folder(tmp_path)
    done = _audit(folder, "--tokens", "added", "--format", "json", "--quiet")
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    decided = {f["id"] for f in report["findings"]}
    assert decided == set(range(32, 40))
    assert report["summary"]["n_tokens"] == 40
    done = _audit(folder, "--tokens", "<|im_end|>,<tool>", "--format", "json", "--quiet")
    assert {f["id"] for f in json.loads(done.stdout)["findings"]} == {33, 34}
    allow = tmp_path / "allow.txt"
    allow.write_text("32-39\n", encoding="utf-8")
    assert _audit(folder, "--tokens", "added", "--allow", allow, "--quiet").returncode == 0


def test_added_tokens_that_cannot_win_are_called_untrained_never_rare(tmp_path):
    """Rows 32-39 were added (past the tokenizer model's 32 tokens): unargmaxable there means not trained
    yet, with the distance from the base rows' mean, and the advice to train them, not to allow them."""
    folder = _resized_folder(tmp_path)
    report = json.loads(_audit(folder, "--format", "json", "--quiet").stdout)
    added = [f for f in report["findings"] if 32 <= f["id"] < 35]
    assert {f["id"] for f in added} == {32, 33, 34}
    padding = [f for f in report["findings"] if f["id"] >= 35]  # past the tokenizer's 35 tokens: no string
    assert {f["id"] for f in padding} == set(range(35, 40))
    assert all(f["kind"] == "padding" and f["classes"] == ["padding"] and not f["failing"] for f in padding)
    assert any(line.startswith("5 rows padding the vocabulary past the tokenizer's length: 35") for line in
               report["summaries"])
    for finding in added:
        assert finding["kind"] == "untrained", finding
        assert "of the base rows' typical distance from their mean" in finding["explanation"]
        assert "trained on data whose targets use them" in finding["next_step"]
        assert "rare or unused" not in finding["next_step"]
    assert "(where mean initialisation puts new rows)" in next(f for f in added if f["id"] == 32)["explanation"]
    assert any(line.startswith("3 rows added to the vocabulary and still at the mean of the rows: 32")
               for line in report["summaries"])
    # the padding rows fail only when asked for
    assert {f["id"] for f in json.loads(_audit(folder, "--format", "json", "--quiet", "--fail-on", "padding").stdout)[
        "findings"] if f["failing"]} == set(range(35, 40))


def test_a_baseline_without_token_strings_compares_by_id_with_a_note(tmp_path):
    """A resized checkpoint saved without its tokenizer (a .pt, a Trainer checkpoint): neither report has token
    strings, so the comparison is by id, the report says so, `--tokens new` takes the added ids, and the
    added rows, which sit at the mean, are new findings of kind untrained."""
    rng = np.random.default_rng(4)
    base = rng.standard_normal((60, 6)).astype(np.float32)
    resized = np.vstack([base, np.repeat(base.mean(axis=0, keepdims=True), 3, axis=0)
                         + 1e-4 * rng.standard_normal((3, 6)).astype(np.float32)])
    save_file({"lm_head.weight": base}, str(tmp_path / "base.safetensors"))
    save_file({"lm_head.weight": resized}, str(tmp_path / "resized.safetensors"))
    baseline = tmp_path / "base.json"
    assert _audit(tmp_path / "base.safetensors", "--format", "json", "--output", baseline, "--quiet").returncode in (0, 1)
    done = _audit(tmp_path / "resized.safetensors", "--baseline", baseline, "--tokens", "new", "--format", "json",
                  "--quiet")
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    assert any("neither the baseline nor this head has token strings, so findings are compared by id" in note
               for note in report["notes"])
    new = [f for f in report["findings"] if f["baseline"] == "new"]
    assert {f["id"] for f in new} == {60, 61, 62}
    assert all(f["kind"] == "untrained" for f in new)


def test_a_trainer_output_folder_audits_its_latest_checkpoint_and_says_so(tmp_path):
    """checkpoint-10/ and checkpoint-200/ under an output folder with no checkpoint of its own: the latest step
    (200, not the last name in alphabetical order) is audited, and the notes say which."""
    rng = np.random.default_rng(9)
    for step, scale in ((10, 1.0), (200, 2.0)):
        folder = tmp_path / "out" / f"checkpoint-{step}"
        folder.mkdir(parents=True)
        save_file({"lm_head.weight": (scale * rng.standard_normal((30, 4))).astype(np.float32)},
                  str(folder / "model.safetensors"))
    done = _audit(tmp_path / "out", "--format", "json", "--quiet")
    assert done.returncode in (0, 1), done.stderr
    report = json.loads(done.stdout)
    assert any("its latest checkpoint, checkpoint-200, is audited (2 checkpoint folders" in note
               for note in report["notes"])
    assert report["head"]["path"].endswith("checkpoint-200")


def test_padding_rows_are_one_line_unless_the_gate_fails_on_them(tmp_path):
    """Rows 35-39 pad the head past the tokenizer's length: the text report counts them in one line under the
    findings that matter, and lists them one by one only with --fail-on padding."""
    folder = _resized_folder(tmp_path)
    lines = _audit(folder, "--quiet").stdout.splitlines()
    listed = {int(line.split()[0]) for line in lines if re.match(r"\s+[0-9]+\s", line)}
    assert listed == {32, 33, 34}
    assert any("5 padding rows past the tokenizer's length, listed with --fail-on padding" in line for line in lines)
    lines = _audit(folder, "--quiet", "--fail-on", "unargmaxable,padding").stdout.splitlines()
    assert {int(line.split()[0]) for line in lines if re.match(r"\s+[0-9]+\s", line)} == set(range(32, 40))
