"""Where the token strings come from, and what the report says when the better source is unreadable."""

import json
import sys

from auditor.loader.tokens import read_token_strings


def _folder(tmp_path, vocab=True):
    (tmp_path / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordLevel"}}))
    if vocab:
        (tmp_path / "vocab.txt").write_text("[PAD]\nhello\nworld\n")
    return tmp_path


def test_without_tokenizers_vocab_txt_gives_the_strings_and_the_note_says_so(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # as if auditor[tokens] were not installed
    notes = []
    strings, source = read_token_strings(_folder(tmp_path), notes)
    assert strings == ["[PAD]", "hello", "world"] and source.endswith("vocab.txt")
    assert len(notes) == 1 and "come from vocab.txt" in notes[0] and "auditor[tokens]" in notes[0]
    assert "to show token strings" not in notes[0]


def test_without_tokenizers_or_vocab_txt_the_note_says_how_to_show_strings(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    notes = []
    assert read_token_strings(_folder(tmp_path, vocab=False), notes) == (None, None)
    assert len(notes) == 1 and "pip install 'auditor[tokens]' to show token strings" in notes[0]


# -- --vocab FILE --vocab-offset N: a character list names the tokens ----------------------------

def _head_with_a_mean_row(tmp_path, n=6):
    """An n x 3 head whose last row is the mean of the others, on a sphere: the one finding."""
    import numpy as np
    from safetensors.numpy import save_file

    rows = np.random.default_rng(7).standard_normal((n - 1, 3))
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)  # every row a vertex of their hull
    weight = np.vstack([rows, rows.mean(axis=0)]).astype(np.float32)
    save_file({"lm_head.weight": weight}, str(tmp_path / "head.safetensors"))
    return tmp_path / "head.safetensors"


def _audit_json(capsys, *args):
    from auditor.cli.audit import main

    code = main([*map(str, args), "--format", "json", "--quiet", "--fail-on", "none"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return json.loads(captured.out)


def _audit_error(capsys, *args) -> str:
    from auditor.cli.audit import main

    code = main([*map(str, args), "--quiet"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("audit: error:"), lines
    return lines[0]


def test_vocab_with_an_offset_names_the_findings(tmp_path, capsys):
    path = _head_with_a_mean_row(tmp_path)
    # ids 1..5: the blank at 0 unnamed, spaces kept, a Windows line break removed
    (tmp_path / "keys.txt").write_bytes(" 一 \r\n二\n三\n四\n五\n".encode("utf-8"))
    report = _audit_json(capsys, path, "--vocab", tmp_path / "keys.txt", "--vocab-offset", 1)
    assert [(f["id"], f["token"]) for f in report["findings"]] == [(5, "五")]
    named = {0: None, 1: " 一 ", 2: "二", 3: "三", 4: "四"}
    competitors = report["findings"][0]["competitors"]
    assert competitors and all(c["token"] == named[c["id"]] for c in competitors)
    assert report["head"]["token_strings"].endswith("keys.txt")
    assert any("line i names id i + 1" in note for note in report["notes"])


def test_vocab_with_fewer_strings_than_ids_leaves_the_rest_unnamed(tmp_path, capsys):
    path = _head_with_a_mean_row(tmp_path)
    (tmp_path / "keys.txt").write_text("一\n二\n三\n四\n", encoding="utf-8")
    report = _audit_json(capsys, path, "--vocab", tmp_path / "keys.txt", "--vocab-offset", 1)
    assert report["findings"][0]["token"] is None
    note = next(note for note in report["notes"] if "keys.txt" in note)
    assert "ids 0 and 5 have no string" in note and "space" in note  # PaddleOCR's appended space, explained


def test_vocab_with_more_strings_than_ids_is_refused(tmp_path, capsys):
    path = _head_with_a_mean_row(tmp_path)
    (tmp_path / "keys.txt").write_text("\n".join("abcdef") + "\n", encoding="utf-8")
    line = _audit_error(capsys, path, "--vocab", tmp_path / "keys.txt", "--vocab-offset", 1)
    assert "6 strings from id 1 would name ids up to 6" in line and "6 rows" in line


def test_vocab_that_is_not_utf8_is_refused(tmp_path, capsys):
    path = _head_with_a_mean_row(tmp_path)
    (tmp_path / "keys.txt").write_bytes(b"\xb0\xa1\xff\n")  # GBK, not UTF-8
    assert "not UTF-8" in _audit_error(capsys, path, "--vocab", tmp_path / "keys.txt")


def test_vocab_offset_without_vocab_is_refused(tmp_path, capsys):
    path = _head_with_a_mean_row(tmp_path)
    assert "--vocab-offset needs --vocab" in _audit_error(capsys, path, "--vocab-offset", 1)


def test_text_report_keeps_its_columns_with_wide_characters(tmp_path, capsys):
    import unicodedata

    from auditor.cli.audit import main

    path = _head_with_a_mean_row(tmp_path)
    (tmp_path / "keys.txt").write_text("一\n二\n三\n四\n五五五\n", encoding="utf-8")
    assert main([str(path), "--vocab", str(tmp_path / "keys.txt"), "--vocab-offset", "1", "--quiet"]) == 1
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.lstrip().startswith("id  token"))
    row = next(line for line in lines if "unargmaxable" in line and "'五五五'" in line)

    def columns(text: str) -> int:  # terminal columns: CJK characters take two
        return sum(2 if unicodedata.east_asian_width(ch) in "WF" else 1 for ch in text)

    assert columns(row[:row.index("unargmaxable")]) == columns(header[:header.index("verdict")])
