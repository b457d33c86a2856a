"""PEFT adapters: the output head an adapter folder gives, built from its files over its base model's head.

An adapter folder (adapter_config.json and adapter_model.safetensors or adapter_model.bin, as peft's
save_pretrained writes them) holds only what training changed. The head is built here from those files
alone (read by peft_files.py; peft and transformers are never imported), as peft's own model computes it:

- a full copy of the head (``modules_to_save=["lm_head"]``, or the embeddings peft saves with a resized
  vocabulary): that copy is the head;
- LoRA on the head (lora_A and lora_B on lm_head): merged as merge_and_unload does, W + (B @ A) * scaling, with
  scaling = lora_alpha / r (lora_alpha / sqrt(r) with use_rslora; alpha_pattern and rank_pattern honoured);
- trainable tokens (TrainableTokensConfig, or LoRA's trainable_token_indices): the saved rows (whole rows, not
  differences, whatever their name says) replace the head's rows at those ids, when they are the head's own or
  the input embedding's and the base's head is tied to it.

Anything else (LoRA on attention, prompt tuning, trainable tokens on an untied model's input embedding, ...)
leaves the head as the base's: it is audited as it is, and the notes say so. Where peft's merged model and
its unmerged forward pass give different heads (LoRA on a tied input embedding, trainable tokens on a tied
head and embedding that disagree), or a method not read here changes the head (DoRA, IA3, ...), the adapter
is refused in one line that says to merge it and audit the merged model.

The base model is ``--base`` (a folder, a checkpoint file or a Hub id, read as the audit's own PATH is), or
else the adapter's ``base_model_name_or_path``: a local folder, or a Hub model found in the local cache (never
fetched: a base model may be large, and the adapter did not ask for it).
"""

from __future__ import annotations

import math
import re
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch

from auditor.errors import InputError
from auditor.loader import hub
from auditor.loader.formats import ADAPTER_CONFIG
from auditor.loader.hub_errors import import_hub, one_line_errors
from auditor.loader.hub_files import CachedFiles
from auditor.loader.hub_id import hub_id, is_hub_id, parse_hub_id
from auditor.loader.naming import candidate_names, is_input_embedding
from auditor.loader.peft_files import LORA_LINEAR, AdapterFiles, AdapterModule, adapter_folder
from auditor.question.head import Head


_CACHE_ONLY = "an adapter's base model is read from the cache, never fetched"

# The loader's load_head, passed in (the loader package imports this module) to read the base model as the
# audit's own PATH is read: load_head(source, store=None, **settings).
ReadHead = Callable[..., Head]


def load_adapter_head(folder: Path, base: str | Path | None, load_head: ReadHead,
                      vocabulary: tuple[Path, int] | None = None, **settings) -> Head:
    """The head of the adapter in ``folder`` applied over its base model's head, read with ``load_head`` and
    ``settings`` (the loader's weight, bias, progress and need_norm): ``base`` (--base), or else the adapter's
    base_model_name_or_path. Token strings come from ``vocabulary``
    (a --vocab file and its offset), else the adapter folder's tokenizer, else the base's. Returns a Head whose
    ``path`` is the adapter folder and whose notes say what was applied over which base. Raises InputError
    for an unreadable adapter, a base model that cannot be found (saying what to pass), or an adapter whose
    change to the head is not read here."""
    adapter = _Adapter.read(folder)
    head = adapter.apply(_base_head(adapter, base, load_head, settings))
    adapter.name_tokens(head, vocabulary)
    head.adapter_base = str(base) if base is not None else None
    return head


class _Adapter(AdapterFiles):
    """An adapter read from its folder, as it changes its base model's head."""

    def refuse(self, what: str) -> InputError:
        return InputError(f"{self.folder}: {what}; merge the adapter with peft (merge_and_unload), save the merged "
                          f"model (save_pretrained) and audit that")

    # --- the head ---------------------------------------------------------------------------------------------

    def apply(self, base: Head) -> Head:
        """The head peft's model has with this adapter over ``base``: see the module's docstring."""
        if base.factor is not None:
            raise InputError(f"{self.folder}: a PEFT adapter's head is one matrix; --weight A@B does not apply to it")
        heads = [m for m in self.modules.values() if _role(m.name, base) == "head"]
        embeddings = [m for m in self.modules.values() if _role(m.name, base) == "embedding"]
        if len(heads) > 1:
            raise InputError(f"{self.folder}: the adapter changes more than one output head "
                             f"({', '.join(m.name for m in heads)}); audit the merged model")
        head_module = heads[0] if heads else None
        tied_embedding = embeddings[0] if base.tied and len(embeddings) == 1 else None
        if base.tied and len(embeddings) > 1:
            raise InputError(f"{self.folder}: the adapter changes more than one input embedding "
                             f"({', '.join(m.name for m in embeddings)}) of a tied head; audit the merged model")
        weight, bias = torch.as_tensor(base.weight), base.bias
        weight_name, bias_name, tied = base.weight_name, base.bias_name, base.tied
        done: list[str] = []
        if tied_embedding is not None:
            self._check_tied_embedding(tied_embedding, head_module)
        if head_module is not None:
            unknown = sorted(set(head_module.parts) - {"weight", "bias", *LORA_LINEAR, "delta"})
            if unknown:
                method = "DoRA" if any(p.startswith("lora_magnitude_vector") for p in unknown) else ", ".join(unknown)
                raise self.refuse(f"the adapter changes the head {head_module.name} by {method}, which the auditor "
                                  f"does not apply")
            if "weight" in head_module.parts:  # modules_to_save, or a resized vocabulary's saved head
                weight = self._full_copy(head_module, weight)
                weight_name, tied = f"{head_module.name}.weight", self._ties(weight, embeddings) if base.tied else False
                if "bias" in head_module.parts:
                    bias, bias_name = self.tensor(head_module, "bias").reshape(-1), f"{head_module.name}.bias"
                elif bias is not None and len(bias) != weight.shape[0]:
                    raise InputError(f"{self.folder}: the adapter's {head_module.name} has {weight.shape[0]} rows "
                                     f"and no bias, but the base head's bias has {len(bias)}")
                done += [note for note in [self._copy_note(head_module, weight, base)] if note]
            if "lora_A" in head_module.parts or "lora_B" in head_module.parts:
                weight, note = self._merge_lora(head_module, weight)
                tied = False  # peft's head is W + B A; the embedding keeps W
                done.append(note)
        trained = head_module if head_module is not None and "delta" in head_module.parts else None
        if trained is None and tied_embedding is not None and "delta" in tied_embedding.parts:
            trained = tied_embedding
        if trained is not None:
            weight, note = self._replace_rows(trained, weight, trained is tied_embedding)
            done.append(note)
        norm = self._final_norm(base)
        if norm is not base.final_norm:
            done.append(f"the final norm is the adapter's own copy of {', '.join(norm.names)}")
        if not done:
            return replace(base, path=self.folder, notes=[*base.notes, self._unchanged_note(base, embeddings)])
        summary = "; ".join(done)
        note = (f"PEFT adapter ({self.method}) applied over the base model {base.path}: {summary}"
                + self._other_changes(head_module, trained))
        return replace(base, weight=weight, bias=bias, weight_name=weight_name, bias_name=bias_name, tied=tied,
                       final_norm=norm, path=self.folder, source_format="peft adapter", notes=[*base.notes, note])

    def _full_copy(self, module: AdapterModule, base_weight: torch.Tensor) -> torch.Tensor:
        weight = self.tensor(module, "weight")
        if weight.ndim != 2 or weight.shape[1] != base_weight.shape[1]:
            raise InputError(f"{self.folder}: the adapter's {module.name} has shape {list(weight.shape)}, but the base "
                             f"model's head is {base_weight.shape[0]} x {base_weight.shape[1]}: is --base the model "
                             f"it was trained on?")
        return weight

    def _copy_note(self, module: AdapterModule, weight: torch.Tensor, base: Head) -> str:
        """What the note says of a saved copy of the head; "" for the base layer peft saves beside a LoRA on the
        head when it is the base's own."""
        same = weight.shape == base.shape and torch.equal(weight, torch.as_tensor(base.weight))
        if ".base_layer." in module.parts["weight"]:
            return "" if same else f"the head is {module.name}'s base layer as saved with the adapter"
        what = f"the head is the adapter's own copy of {module.name} ({weight.shape[0]} rows)"
        return what + (", the same as the base model's" if same else "")

    def _ties(self, weight: torch.Tensor, embeddings: list[AdapterModule]) -> bool:
        """Whether the adapter's head copy is also its input embedding copy (peft's ensure_weight_tying)."""
        copies = [self.tensor(m, "weight") for m in embeddings if "weight" in m.parts]
        return any(copy.shape == weight.shape and torch.equal(copy, weight) for copy in copies)

    def _check_tied_embedding(self, embedding: AdapterModule, head_module: AdapterModule | None) -> None:
        """Refuse what changes a tied head one way in peft's forward pass and another when merged."""
        if {"lora_embedding_A", "lora_embedding_B"} & set(embedding.parts):
            raise self.refuse(f"the adapter puts LoRA on the input embedding {embedding.name}, which the base's head "
                              f"is tied to: peft's forward pass leaves the head as it is, and merge_and_unload "
                              f"changes it")
        unknown = sorted(set(embedding.parts) - {"weight", "delta"})
        if unknown:
            raise self.refuse(f"the adapter changes the input embedding {embedding.name}, which the base's head is "
                              f"tied to, by {', '.join(unknown)}, which the auditor does not apply")
        if head_module is not None and "delta" in embedding.parts and "delta" in head_module.parts:
            same = (self._token_ids(embedding) == self._token_ids(head_module)
                    and torch.equal(self.tensor(embedding, "delta"), self.tensor(head_module, "delta")))
            if not same:
                raise self.refuse(f"the adapter trains different tokens of the tied {head_module.name} and "
                                  f"{embedding.name}: peft's forward pass and merge_and_unload give different heads")

    def _merge_lora(self, module: AdapterModule, weight: torch.Tensor) -> tuple[torch.Tensor, str]:
        """W + (B @ A) * scaling, in the order and the dtypes of peft's merge (half-precision factors are
        multiplied in float32 on the CPU, then rounded back)."""
        if not {"lora_A", "lora_B"} <= set(module.parts) or "lora_B.bias" in module.parts:
            what = "a LoRA bias (lora_bias)" if "lora_B.bias" in module.parts else "half of a LoRA pair"
            raise self.refuse(f"the adapter's LoRA on the head {module.name} has {what}, which the auditor does not "
                              f"merge")
        down, up = self.tensor(module, "lora_A"), self.tensor(module, "lora_B")
        r = _pattern_value(self.config.get("rank_pattern"), module.name, self.config.get("r"))
        alpha = _pattern_value(self.config.get("alpha_pattern"), module.name, self.config.get("lora_alpha"))
        if not isinstance(r, int) or r < 1 or not isinstance(alpha, (int, float)):
            raise InputError(f"{self.folder / ADAPTER_CONFIG}: no usable r and lora_alpha for the LoRA on "
                             f"{module.name} (r={r!r}, lora_alpha={alpha!r})")
        if down.shape != (r, weight.shape[1]) or up.shape != (weight.shape[0], r):
            raise InputError(f"{self.folder}: the LoRA on {module.name} is {list(up.shape)} @ {list(down.shape)}, "
                             f"which does not fit r={r} and a {weight.shape[0]} x {weight.shape[1]} head: is --base "
                             f"the model it was trained on?")
        rslora = bool(self.config.get("use_rslora"))
        scaling = alpha / math.sqrt(r) if rslora else alpha / r
        half = up.dtype in (torch.float16, torch.bfloat16)
        delta = ((up.float() @ down.float()) * scaling).to(up.dtype) if half else (up @ down) * scaling
        merged = weight.clone()
        merged += delta
        rule = f"lora_alpha / sqrt(r) = {alpha:g} / sqrt({r})" if rslora else f"lora_alpha / r = {alpha:g} / {r}"
        return merged, f"its LoRA on {module.name} is merged into the head (scaling {rule} = {scaling:g})"

    def _replace_rows(self, module: AdapterModule, weight: torch.Tensor, through_tie: bool) -> tuple[torch.Tensor, str]:
        ids = self._token_ids(module)
        rows = self.tensor(module, "delta")
        n, d = weight.shape
        if rows.ndim != 2 or rows.shape != (len(ids), d):
            raise InputError(f"{self.folder}: the trainable tokens of {module.name} are {list(rows.shape)}, but "
                             f"{ADAPTER_CONFIG} lists {len(ids)} ids of a head {d} wide")
        outside = [k for k in ids if not 0 <= k < n]
        if outside:
            raise InputError(f"{self.folder}: the adapter trains token {outside[-1]}, but the base model's head has "
                             f"{n} rows (ids 0..{n - 1}): was the vocabulary resized for training? Pass --base a "
                             f"copy of the base model resized as for training")
        # peft's merge: W.index_copy(0, ids, rows) in W's dtype
        replaced = weight.index_copy(0, torch.tensor(ids, dtype=torch.long), rows.to(weight.dtype))
        where = (f"trained on the input embedding {module.name}, which the base's head is tied to" if through_tie
                 else f"trained on {module.name}")
        rows_are = f"row {ids[0]} is" if len(set(ids)) == 1 else f"rows {_ids_text(ids)} are"
        return replaced, f"{rows_are} the adapter's trainable tokens ({where})"

    def _final_norm(self, base: Head):
        """The base's final norm, or the adapter's copy of it (modules_to_save)."""
        norm = base.final_norm
        if norm is None:
            return None
        copies = {}
        for name in norm.names:
            module, part = name.rpartition(".")[::2]
            found = self.modules.get(module)
            if found is not None and part in found.parts and set(found.parts) <= {"weight", "bias"}:
                copies[part] = self.tensor(found, part)
        if not copies:
            return norm
        return replace(norm, weight=copies.get("weight", norm.weight), bias=copies.get("bias", norm.bias))

    # --- notes ------------------------------------------------------------------------------------------------

    def _other_changes(self, *applied: AdapterModule | None) -> str:
        others = [m for m in self.modules.values() if m not in applied]
        return f" (its other parts are not the head's: {_modules_text(others)})" if others else ""

    def _unchanged_note(self, base: Head, embeddings: list[AdapterModule]) -> str:
        holds = _modules_text(list(self.modules.values())) or "no tensors"
        note = (f"PEFT adapter ({self.method}) over the base model {base.path}: it does not change the output head "
                f"(it holds {holds}), so the base model's head is audited as it is")
        trained = [m for m in embeddings if "delta" in m.parts]
        if trained and not base.tied:
            note += (f"; its trainable tokens are rows of the input embedding {trained[0].name} only, which this "
                     f"untied head does not share: to train the head's rows too, list the head in "
                     f"trainable_token_indices as well (a dict by module name)")
        elif any("weight" in m.parts for m in embeddings) and base.tied:
            note += "; its own copy of the input embedding is not the head: peft's model keeps the base's tied head"
        return note



def _role(module: str, base: Head) -> str | None:
    """"head" for the base model's output head, "embedding" for an input embedding, else None."""
    name = f"{module}.weight"
    if name == base.weight_name:
        return "embedding" if base.tied else "head"
    if is_input_embedding(name):
        return "embedding"
    return "head" if candidate_names([name], None, "none", False) else None


def _pattern_value(patterns, module: str, default):
    """peft's rank_pattern / alpha_pattern: the value of the first key that matches the end of the module's
    name (as a regular expression, on a dot boundary), else ``default``."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _ids_text(ids: list[int], most: int = 12) -> str:
    """Sorted ids as ranges, ``3, 64..69``; after ``most`` ranges, how many more ids."""
    ordered = sorted(set(ids))
    runs: list[list[int]] = []
    for k in ordered:
        if runs and k == runs[-1][1] + 1:
            runs[-1][1] = k
        else:
            runs.append([k, k])
    text = ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs[:most])
    if len(runs) > most:
        text += f" and {sum(b - a + 1 for a, b in runs[most:])} more"
    return text


def _modules_text(modules: list[AdapterModule]) -> str:
    """``LoRA on q_proj, v_proj; a full copy of model.norm``: what the adapter holds, by kind, with
    repeated layers' modules named once by their last name."""
    by_kind: dict[str, list[str]] = {}
    for module in modules:
        name = module.name.rsplit(".", 1)[-1] if re.search(r"\.\d+\.", module.name) else module.name
        names = by_kind.setdefault(module.describe(), [])
        if name and name not in names:
            names.append(name)

    def listed(kind: str, names: list[str]) -> str:
        return f"{kind} {'of' if kind == 'a full copy' else 'on'} {', '.join(names)}" if names else kind

    return "; ".join(listed(kind, names) for kind, names in by_kind.items())


# --- the base model ---------------------------------------------------------------------------------------------

def _base_head(adapter: _Adapter, base: str | Path | None, load_head: ReadHead, settings: dict) -> Head:
    """The base model's head: ``--base`` as given, or the adapter's base_model_name_or_path."""
    if base is not None:
        source, named = base, f"--base {base}"
    else:
        source = adapter.config.get("base_model_name_or_path")
        named = f"its base model {source!r} (base_model_name_or_path in {ADAPTER_CONFIG})"
        if not isinstance(source, str) or not source.strip():
            raise InputError(f"{adapter.folder}: a PEFT adapter whose {ADAPTER_CONFIG} names no base model "
                             f"(base_model_name_or_path is empty): pass --base PATH, the model it was trained on "
                             f"(a folder, a checkpoint file or a Hub id)")
    if adapter_folder(Path(source)) is not None:
        raise InputError(f"{adapter.folder}: {named} is itself a PEFT adapter: pass --base the model the adapters "
                         f"were trained on, with the first adapter merged into it")
    cached = base is None and not Path(source).exists()
    if cached and not is_hub_id(source):
        raise InputError(f"{adapter.folder}: a PEFT adapter, and {named} is neither a folder here nor a Hub id: pass "
                         f"--base PATH, the model it was trained on (a folder, a checkpoint file or a Hub id)")
    try:
        if cached:
            return _cached_hub_head(source, adapter.config.get("revision"), load_head, settings)
        return load_head(source, **settings)
    except InputError as error:
        raise InputError(f"{adapter.folder}: a PEFT adapter, and {named} cannot be read: {error}") from None


def _cached_hub_head(text: str, revision: str | None, load_head: ReadHead, settings: dict) -> Head:
    """The head of a Hub model found in the local cache (hub.py's cache reader; nothing is fetched)."""
    repo_id, given = parse_hub_id(text)
    revision = given or (revision if isinstance(revision, str) and revision else None)
    label = hub_id(repo_id, revision)
    advice = f"{_CACHE_ONLY}: pass --base {label} to fetch it, or --base PATH for a local copy"
    try:
        huggingface_hub = import_hub(repo_id, revision)
    except InputError:
        raise InputError(f"{label} is not a local folder, and reading it from the Hugging Face cache needs "
                         f"huggingface_hub (pip install 'auditor[hub]'); or pass --base PATH") from None
    import huggingface_hub.utils  # noqa: F401  (one_line_errors reads its exception types)

    with one_line_errors(huggingface_hub, label, repo_id, revision):
        model = hub.gather(CachedFiles(huggingface_hub, repo_id, revision, advice), label, settings.get("weight"),
                            settings.get("bias"), settings.get("need_norm", False))
    if model.adapter:
        raise InputError(f"{label} is itself a PEFT adapter: pass --base the model the adapters were trained on, "
                         f"with the first adapter merged into it")
    head = load_head(model.checkpoint, store=model.store, **settings)
    head.path = Path(model.label)
    return head
