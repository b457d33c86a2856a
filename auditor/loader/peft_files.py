"""A PEFT adapter folder as peft's save_pretrained writes it: its config, its tensors by module, its tokenizer.

adapter_config.json says the method (peft_type) and its settings; adapter_model.safetensors (or
adapter_model.bin, a PyTorch state dict) holds only what training changed, each key naming a module of the
base model inside peft's wrappers. The keys are grouped here by the base model's module they change, so
that peft_adapter.py can tell what the adapter does to the head; the tokens an adapter trains are listed
in its config. The files are read alone: peft and transformers are never imported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from auditor.errors import InputError
from auditor.loader.formats import ADAPTER_CONFIG, ADAPTER_WEIGHTS, WEIGHT_FILES, identify
from auditor.loader.stores import SafetensorsStore, TorchStore
from auditor.loader.tokens import base_vocabulary_size, read_token_strings, read_vocabulary
from auditor.question.head import Head


_PREFIX = "base_model.model."  # peft's PeftModel -> LoraModel (or other tuner) -> the base model
_WRAPPERS = {"base_layer", "token_adapter", "original_module"}  # peft's wrapping modules, not the model's own
LORA_LINEAR = ("lora_A", "lora_B")


def adapter_folder(path: Path) -> Path | None:
    """The PEFT adapter folder that ``path`` is (a folder with adapter_config.json and no model checkpoint of
    its own), or whose adapter_model.safetensors / .bin file it is; None for any other path."""
    path = Path(path)
    if path.is_file() and path.name in ADAPTER_WEIGHTS:
        path = path.parent
    if not path.is_dir() or not (path / ADAPTER_CONFIG).is_file():
        return None
    return None if any((path / name).is_file() for name in WEIGHT_FILES) else path


def not_an_adapter(path, base) -> InputError:
    """The error for --base given with a PATH that is no adapter folder."""
    return InputError(f"--base {base}: {path} is not a PEFT adapter folder (with {ADAPTER_CONFIG}), and only an "
                      f"adapter has a base model; audit the base model by its own path")


@dataclass
class AdapterModule:
    """What the adapter's saved state holds for one module of the base model: its keys by part (``weight``,
    ``bias``, ``lora_A``, ``lora_B``, ``lora_embedding_A``, ``delta`` for trainable tokens, or another method's
    own parameter name)."""

    name: str
    parts: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        if "delta" in self.parts:
            return "trainable tokens"
        if set(self.parts) & {"lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"}:
            return "LoRA"
        if set(self.parts) <= {"weight", "bias"}:
            return "a full copy"
        return ", ".join(sorted(self.parts))


def split_key(key: str) -> tuple[str, str]:
    """An adapter state key -> (the base model's module it belongs to, the part). peft's wrappers are left
    out: ``base_model.model.lm_head.modules_to_save.default.weight`` (older peft), ``...lm_head.weight`` and
    ``...lm_head.base_layer.weight`` are all ("lm_head", "weight"), and
    ``...embed_tokens.token_adapter.trainable_tokens_delta`` is ("model.embed_tokens", "delta")."""
    names = key.removeprefix(_PREFIX).split(".")
    kept, i = [], 0
    while i < len(names):
        if names[i] == "modules_to_save":  # followed by the adapter's name, unless peft removed it
            i += 2 if i + 2 < len(names) else 1
            continue
        if names[i] not in _WRAPPERS:
            kept.append(names[i])
        i += 1
    if not kept:
        return "", key
    if kept[-1] == "trainable_tokens_delta":
        return ".".join(kept[:-1]), "delta"
    if len(kept) >= 2 and kept[-2] in (*LORA_LINEAR, "lora_magnitude_vector"):
        part = kept[-2] if kept[-1] == "weight" else f"{kept[-2]}.{kept[-1]}"
        return ".".join(kept[:-2]), part
    return ".".join(kept[:-1]), kept[-1]


@dataclass
class AdapterFiles:
    """What an adapter folder holds: its config, its saved tensors, and their keys by the base model's module."""

    folder: Path
    config: dict
    store: object  # the adapter file's tensors: a SafetensorsStore or TorchStore
    modules: dict[str, AdapterModule]

    @classmethod
    def read(cls, folder: Path) -> AdapterFiles:
        config_path = folder / ADAPTER_CONFIG
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:
            raise InputError(f"{config_path}: not a readable adapter config ({error})") from None
        if not isinstance(config, dict):
            raise InputError(f"{config_path}: not a readable adapter config (not a JSON object)")
        weights = next((folder / name for name in ADAPTER_WEIGHTS if (folder / name).is_file()), None)
        if weights is None:
            raise InputError(f"{folder}: a PEFT adapter folder ({ADAPTER_CONFIG}) without its weights "
                             f"({' or '.join(ADAPTER_WEIGHTS)})")
        kind = identify(weights)
        if kind == "safetensors":
            store = SafetensorsStore.from_file(weights)
        elif kind in ("torch-zip", "pickle"):
            store = TorchStore.from_file(weights)
        else:
            raise InputError(f"{weights}: adapter weights must be safetensors or a PyTorch state dict")
        modules: dict[str, AdapterModule] = {}
        for key in store.tensors():
            module, part = split_key(key)
            modules.setdefault(module, AdapterModule(module)).parts[part] = key
        return cls(folder, config, store, modules)

    @property
    def method(self) -> str:
        return str(self.config.get("peft_type") or "unknown type")

    def tensor(self, module: AdapterModule, part: str) -> torch.Tensor:
        return torch.as_tensor(self.store.get(module.parts[part]))

    def _token_ids(self, module: AdapterModule) -> list[int]:
        """The ids of the trainable tokens saved for ``module``: token_indices (TrainableTokensConfig), or
        trainable_token_indices, a list (for the input embedding) or a dict by module name."""
        if self.config.get("peft_type") == "TRAINABLE_TOKENS":
            ids = self.config.get("token_indices")
        else:
            ids = self.config.get("trainable_token_indices")
            if isinstance(ids, dict):
                found = [v for k, v in ids.items() if module.name == k or module.name.endswith(f".{k}")]
                ids = found[0] if len(found) == 1 else None
        if not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids):
            raise InputError(f"{self.folder / ADAPTER_CONFIG}: the adapter saves trainable tokens of {module.name}, "
                             f"but lists no token ids for them (token_indices or trainable_token_indices)")
        return ids

    # --- token strings ----------------------------------------------------------------------------------------

    def name_tokens(self, head: Head, vocabulary: tuple[Path, int] | None) -> None:
        """A --vocab file's strings, else the adapter folder's tokenizer's, else the base's (already on
        ``head``); the base's notes about its token strings go when they are replaced."""
        rows = head.shape[0]
        strings = None
        notes: list[str] = []
        if vocabulary is not None:
            strings, note = read_vocabulary(*vocabulary, rows)
            head.token_source = str(vocabulary[0])
            head.vocab_file, head.vocab_offset = vocabulary
            notes.append(note)
        elif (self.folder / "tokenizer.json").is_file() or (self.folder / "vocab.txt").is_file():
            strings, source = read_token_strings(self.folder, notes)
            if strings is not None:
                head.token_source, head.base_vocab = source, base_vocabulary_size(self.folder)
        # every note the loader writes about token strings says "token string"
        kept = [n for n in head.notes if "token string" not in n] if strings is not None else list(head.notes)
        kept = [n for n in kept if not (n.startswith("rows ") and "have no token string" in n)]
        if strings is not None:
            head.tokens = strings
        head.notes = kept + notes
        if head.tokens is not None and len(head.tokens) < rows:
            head.notes.append(f"rows {len(head.tokens)}..{rows - 1} have no token string "
                              f"(the tokenizer has {len(head.tokens)} tokens)")
