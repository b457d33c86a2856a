"""Token strings by id, from tokenizer.json (the auditor[tokens] extra) or vocab.txt."""

from __future__ import annotations

from pathlib import Path


def read_token_strings(folder: Path, notes: list[str]) -> tuple[list[str] | None, str | None]:
    """Return (strings by id, the file they came from); (None, None) when no tokenizer is found."""
    tokenizer_json = folder / "tokenizer.json"
    vocab_txt = folder / "vocab.txt"
    if tokenizer_json.is_file():
        try:
            from tokenizers import Tokenizer
        except ImportError:
            # what to say depends on whether vocab.txt still gives the strings
            if vocab_txt.is_file():
                notes.append("token strings come from vocab.txt: the tokenizers package is not installed, so "
                             "tokenizer.json is not read; pip install 'auditor[tokens]' to read it (it also "
                             "knows the added tokens)")
            else:
                notes.append("tokenizer.json found but the tokenizers package is not installed: "
                             "pip install 'auditor[tokens]' to show token strings")
        else:
            try:
                tokenizer = Tokenizer.from_file(str(tokenizer_json))
            except Exception as error:  # the library raises its own exception types
                notes.append(f"tokenizer.json could not be read ({error}); token strings come from elsewhere")
            else:
                size = tokenizer.get_vocab_size(with_added_tokens=True)
                return [tokenizer.id_to_token(i) for i in range(size)], str(tokenizer_json)
    if vocab_txt.is_file():
        lines = vocab_txt.read_text(encoding="utf-8", errors="replace").split("\n")
        if lines and lines[-1] == "":
            lines.pop()
        return lines, str(vocab_txt)
    return None, None
