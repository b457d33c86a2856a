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
