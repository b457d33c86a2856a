"""What a model folder's config.json says, as one flat dict of the language model's settings."""

from __future__ import annotations

import json
from pathlib import Path


def read_config(folder: Path) -> dict:
    """The settings in ``folder``/config.json; {} when there is none or it is not a JSON object.

    A multimodal config keeps the language model's settings in ``text_config``: those are returned, with
    the top level's ``tie_word_embeddings`` over them where it has one.
    """
    config = folder / "config.json"
    if not config.is_file():
        return {}
    try:
        data = json.loads(config.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict):
        return {}
    text = data.get("text_config")
    return {**text, **{k: v for k, v in data.items() if k == "tie_word_embeddings"}} if isinstance(text, dict) else data
