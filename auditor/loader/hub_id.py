"""Hugging Face Hub model ids: telling ``org/name[@revision]`` from a local path, and taking it apart."""

from __future__ import annotations

import re
from pathlib import Path

from auditor.errors import InputError

# The Hub's own rule for a name: word characters, '.' and '-', starting and ending with a word character.
_NAME = r"[A-Za-z0-9_](?:[\w.-]{0,94}[A-Za-z0-9_])?"
_ID = re.compile(rf"(?P<repo>{_NAME}/{_NAME})(?:@(?P<revision>\S+))?")
_COMMIT = re.compile(r"[0-9a-f]{40}")
# A missing "dir/head.safetensors" is a mistyped path, not a repository: report it as one.
_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".npy", ".npz", ".gguf", ".onnx", ".json",
                 ".git")


def is_hub_id(text) -> bool:
    """Whether ``text`` names a model on the Hub: ``org/name`` or ``org/name@revision`` that is not an
    existing file or folder (a local path always wins)."""
    text = str(text)
    match = _ID.fullmatch(text)
    if match is None or Path(text).exists():
        return False
    repo = match["repo"]
    return "--" not in repo and ".." not in repo and not repo.lower().endswith(_FILE_SUFFIXES)


def parse_hub_id(text) -> tuple[str, str | None]:
    """``"org/name@v1.0"`` -> ("org/name", "v1.0"); the revision (branch, tag or commit) is None when not given."""
    match = _ID.fullmatch(str(text))
    if match is None:
        raise InputError(f"{text}: not a Hub model id (org/name or org/name@revision)")
    return match["repo"], match["revision"]


def hub_id(repo_id: str, revision: str | None) -> str:
    """``("org/name", "v1.0")`` -> ``"org/name@v1.0"``; just the repository when no revision is given."""
    return repo_id + (f"@{revision}" if revision else "")


def is_commit(revision) -> bool:
    """Whether ``revision`` is a full commit hash, which names the same files for ever (a branch or tag
    may move)."""
    return isinstance(revision, str) and _COMMIT.fullmatch(revision) is not None
