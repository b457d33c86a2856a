"""Token strings by id, from tokenizer.json (the auditor[tokens] extra) or vocab.txt, or a file given
with --vocab (a character list: one string per line, from a given id on)."""

from __future__ import annotations

import json
from pathlib import Path

from auditor.errors import InputError


def base_vocabulary_size(folder: Path) -> int | None:
    """The size of the tokenizer model's own vocabulary (``model.vocab`` in tokenizer.json), before the
    added tokens; None without a readable tokenizer.json. Read as JSON: no tokenizers package needed."""
    try:
        document = json.loads((folder / "tokenizer.json").read_text(encoding="utf-8"))
        vocab = document["model"]["vocab"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return len(vocab) if isinstance(vocab, (dict, list)) else None


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


def read_vocabulary(path: Path, offset: int, rows: int) -> tuple[list[str | None], str]:
    """Token strings from a character list or vocabulary file, one string per line (UTF-8, only the line
    break removed): line i names id i + ``offset``. Returns (strings by id, the note saying so).

    Fewer strings than ids leave the last ids unnamed (PaddleOCR appends a space as its last class when
    use_space_char is set: a line holding one space names it); more strings than the head has ids, an
    unreadable file or an empty one is an InputError.
    """
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as error:
        raise InputError(f"--vocab {path}: cannot be read ({error.strerror or error})") from None
    except UnicodeDecodeError as error:
        raise InputError(f"--vocab {path}: not UTF-8 (byte {error.start})") from None
    lines = text.removeprefix("\ufeff").split("\n")
    if lines[-1] == "":
        lines.pop()  # the last line's break
    lines = [line.removesuffix("\r") for line in lines]
    if not lines:
        raise InputError(f"--vocab {path}: no strings in it")
    last = offset + len(lines) - 1
    if last >= rows:
        raise InputError(f"--vocab {path}: {len(lines)} strings from id {offset} would name ids up to {last}, but the "
                         f"head has {rows} rows (ids 0..{rows - 1})")
    note = f"token strings from {path}: line i names id i + {offset} (ids {offset}..{last})"
    unnamed = [f"0..{offset - 1}" if offset > 1 else "0"] if offset else []
    if last < rows - 1:
        unnamed.append(f"{last + 1}..{rows - 1}" if last + 1 < rows - 1 else f"{rows - 1}")
    if unnamed:
        note += f"; ids {' and '.join(unnamed)} have no string"
    if offset == 1 and last == rows - 2:
        note += " (PaddleOCR's last class is the space it appends: a last line of one space names it)"
    return [None] * offset + lines, note
