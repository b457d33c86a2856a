"""A Hub model, ``org/name[@revision]``, resolved to the files in the local cache that its head needs.

``resolve`` returns them (a HubModel: the checkpoint, a store over the fetched shards, the commit read);
the loader reads the head from them as from a local folder. ``list_tensors`` reads the tensors' names
and shapes from the safetensors headers alone.

huggingface_hub (the auditor[hub] extra) owns the cache (HF_HOME, HF_HUB_CACHE), the endpoint (HF_ENDPOINT),
logins and offline mode (HF_HUB_OFFLINE=1). A file already cached is never fetched again; offline, or when
the Hub cannot be reached, only the cache is read. What is fetched: config.json, the tokenizer files, the
shard index, and only the shards that hold the head's tensors (and the final norm's, for the norm domain):
their headers are read remotely with HTTP range requests to find out which. A model in a single file is
fetched whole, as there is no smaller part of it to read. A PEFT adapter (a repository with
adapter_config.json and no model checkpoint) is fetched whole: its configuration, its weights and its
tokenizer files; the loader applies it over its base model (loader/peft_adapter.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from auditor.errors import InputError
from auditor.loader.config import read_config
from auditor.loader.formats import ADAPTER_CONFIG, ADAPTER_WEIGHTS, INFERENCE_FILES, WEIGHT_FILES
from auditor.loader.hub_errors import first_line, import_hub, network_errors, one_line_errors, progress_bars
from auditor.loader.hub_files import CachedFiles, HubFiles, NotCached
from auditor.loader.hub_id import hub_id, is_commit, parse_hub_id
from auditor.loader.naming import HeadNames, candidate_names, choose_head, is_input_embedding
from auditor.loader.stores import SafetensorsStore, TensorInfo, TorchStore, parse_index

# A part of a sharded checkpoint ("model-00001-of-00003.safetensors"), never a model in a single file.
_SHARD_NAME = re.compile(r"-\d{5}-of-\d{5}\.")

# The shard indexes of a sharded checkpoint, and the store that reads each one's shards.
SHARD_INDEXES = {"model.safetensors.index.json": SafetensorsStore, "pytorch_model.bin.index.json": TorchStore}
# Both are fetched when present: which one gives the strings depends on whether tokenizers is installed.
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt")
# the files that name an inference format's rows (formats.INFERENCE_FILES: faster-whisper's repositories hold a
# CTranslate2 model.bin)
INFERENCE_NAMES = ("vocabulary.json", "vocabulary.txt", "target_vocabulary.json", "target_vocabulary.txt",
                   "shared_vocabulary.json", "shared_vocabulary.txt", "phones.txt", "graph/phones.txt")

_OFFLINE = "HF_HUB_OFFLINE=1 forbids fetching it (unset HF_HUB_OFFLINE to fetch)"


@dataclass
class HubModel:
    """The files of one commit of a Hub model in the local cache, as far as the head needs them."""

    repo_id: str
    commit: str
    checkpoint: Path  # the weights file, or the shard index, in the cache's snapshot folder (an adapter: the folder)
    store: object | None = None  # a store over the fetched shards only (sharded models); None: open checkpoint
    note: str | None = None
    adapter: bool = False  # a PEFT adapter's files, not a model's

    @property
    def label(self) -> str:
        """Where the head came from, as reports record it: an id that audits this very commit again."""
        return f"{self.repo_id}@{self.commit}"


def resolve(repo_id: str, revision: str | None = None, *, weight: str | None = None, bias: str | None = None,
            need_norm: bool = False, progress: bool = False) -> HubModel:
    """The files of ``repo_id`` at ``revision`` (default: main) that the head needs, fetched into the cache
    unless they are there. ``weight`` / ``bias`` are the names given to the loader (None: detected);
    ``need_norm`` also fetches the final norm. Raises InputError (one line) when huggingface_hub is missing,
    the repository, revision or a file is not found, the model is gated, or it is not cached and cannot be
    fetched (HF_HUB_OFFLINE=1, no network)."""
    hub = import_hub(repo_id, revision)
    label = hub_id(repo_id, revision)
    with progress_bars(shown=progress), one_line_errors(hub, label, repo_id, revision):
        if hub.constants.HF_HUB_OFFLINE:
            return gather(CachedFiles(hub, repo_id, revision, _OFFLINE), label, weight, bias, need_norm)
        if is_commit(revision):  # a commit never changes: what is cached is current
            try:
                return _gather_cached(hub, repo_id, revision, label, weight, bias, need_norm)
            except NotCached:  # not all of it, or not so that it can be read: fetch it
                pass
        try:
            source = HubFiles(hub, repo_id, revision)
        except network_errors() as error:
            reason = f"the Hub at {hub.constants.ENDPOINT} cannot be reached ({first_line(error)})"
            model = gather(CachedFiles(hub, repo_id, revision, reason), label, weight, bias, need_norm)
            model.note = f"{reason}: the cached snapshot of {label} (commit {model.commit}) was audited"
            return model
        return gather(source, label, weight, bias, need_norm)


def list_tensors(text: str) -> list[TensorInfo]:
    """Every tensor of a Hub model, from its safetensors headers: read remotely (range requests), or from
    the cache when offline; no weights are fetched. Raises InputError for a model without safetensors."""
    repo_id, revision = parse_hub_id(text)
    hub = import_hub(repo_id, revision)
    with one_line_errors(hub, text, repo_id, revision):
        offline = hub.constants.HF_HUB_OFFLINE
        source = (CachedFiles(hub, repo_id, revision, _OFFLINE) if offline
                  else HubFiles(hub, repo_id, revision))
        if "model.safetensors.index.json" in source.files:
            shards = sorted(set(parse_index(source.get("model.safetensors.index.json")).values()))
        elif "model.safetensors" in source.files:
            shards = ["model.safetensors"]
        else:
            raise InputError(f"{text}: --list-tensors reads the headers of safetensors files, and there are none "
                             f"{source.where}; fetch the model (hf download {repo_id}) and list its folder")
        infos = {}
        for shard in shards:
            header = source.headers(shard)
            if header is None:
                raise source.absent(f"the shard {shard}")
            infos.update(header)
    return sorted(infos.values(), key=lambda info: info.name)


def _gather_cached(hub, repo_id: str, revision: str, label: str, weight, bias, need_norm: bool) -> HubModel:
    """gather from the cache alone, when fetching is possible: any problem found there (a file missing, a
    head not found among the cached shards, ...) is NotCached, so that the caller fetches instead; the
    files on the Hub then give the answer, or the error, that the complete model gives."""
    try:
        return gather(CachedFiles(hub, repo_id, revision, ""), label, weight, bias, need_norm)
    except NotCached:
        raise
    except InputError as error:
        raise NotCached(str(error)) from error


def gather(source, label: str, weight, bias, need_norm: bool) -> HubModel:
    """Fetch (or find in the cache) config.json, the tokenizer files and the weights the head needs; for a
    PEFT adapter, its configuration, weights and tokenizer files."""
    if ADAPTER_CONFIG in source.files and not any(name in source.files for name in WEIGHT_FILES):
        return _adapter_files(source)
    weights = _weights_file(source, label)
    config = source.get("config.json") if "config.json" in source.files else None
    if not weights.lower().endswith(".gguf"):  # a GGUF file carries its own tokens
        for name in TOKENIZER_FILES + (INFERENCE_NAMES if weights in INFERENCE_FILES else ()):
            if name in source.files:
                source.get(name)
    if weights not in SHARD_INDEXES:
        checkpoint = source.get(weights)
        return HubModel(source.repo_id, source.commit, checkpoint)
    index = source.get(weights)
    weight_map = parse_index(index)
    candidates = candidate_names(weight_map, weight, bias, need_norm)
    if SHARD_INDEXES[weights] is SafetensorsStore:
        tie = _tie_word_embeddings(config)
        names = _choose_from_headers(source, weight_map, candidates, weight, bias, tie, label)
        needed = [name for name, _ in names.factors] if names.factors else [names.weight]
        needed += [n for n in (names.bias, *((names.norm_weight, names.norm_bias) if need_norm else ())) if n]
        shards = {weight_map[name] for name in needed}
    else:  # a pickle's shapes cannot be read remotely: fetch every shard holding a tensor that could be chosen
        shards = {weight_map[name] for name in candidates} or set(weight_map.values())
    fetched = {shard: source.get(shard) for shard in sorted(shards)}
    store = SHARD_INDEXES[weights]({name: fetched[shard] for name, shard in weight_map.items() if shard in fetched})
    return HubModel(source.repo_id, source.commit, index, store)


def _adapter_files(source) -> HubModel:
    """A PEFT adapter's files, in the cache's snapshot folder, which the loader then reads as an adapter folder."""
    config = source.get(ADAPTER_CONFIG)
    weights = next((name for name in ADAPTER_WEIGHTS if name in source.files), None)
    if weights is None:
        raise source.absent(f"the adapter's weights ({' or '.join(ADAPTER_WEIGHTS)})")
    source.get(weights)
    for name in TOKENIZER_FILES + ("tokenizer_config.json", "added_tokens.json", "special_tokens_map.json"):
        if name in source.files:
            source.get(name)
    return HubModel(source.repo_id, source.commit, config.parent, adapter=True)


def _weights_file(source, label: str) -> str:
    for name in WEIGHT_FILES:
        if name in source.files:
            return name
    singles = [f for f in source.files if "/" not in f and f.lower().endswith((".safetensors", ".gguf"))]
    if not singles:  # an inference format only where there is no checkpoint it may have been converted from
        inference = [name for name in INFERENCE_FILES if name in source.files
                     and (name != "model.bin" or _is_ctranslate2_repository(source.files))]
        singles = inference[:1] or [f for f in source.files if "/" not in f and f.lower().endswith(".tflite")]
    if not source.complete:
        # A cache holds what was fetched, not the repository's list: a shard there (an interrupted download,
        # say) is one part of a sharded checkpoint whose index is not cached, never a model in a single file.
        shards = sorted(f for f in singles if _SHARD_NAME.search(f))
        if shards:
            what = (f"the shard index of {shards[0]} (looked for {WEIGHT_FILES[0]})"
                    if shards[0].lower().endswith(".safetensors") else f"the rest of the split file {shards[0]}")
            raise source.absent(what)
    if len(singles) == 1:
        return singles[0]
    looked = ", ".join(WEIGHT_FILES)
    if len(singles) > 1:
        raise InputError(f"{label}: no checkpoint {source.where} (looked for {looked}), and {len(singles)} "
                         f"candidate files ({', '.join(sorted(singles)[:4])}, ...): fetch the one to audit "
                         f"(hf download {source.repo_id} FILE) and audit that file")
    raise source.absent(f"a checkpoint (looked for {looked}, a single .safetensors or .gguf file, a CTranslate2 "
                        f"model.bin, a Kaldi final.mdl or a single .tflite file)")


def _is_ctranslate2_repository(files) -> bool:
    """Whether a model.bin is CTranslate2's, from the repository's listing, before fetching it whole: its
    converters write config.json and a vocabulary file beside it (other frameworks' model.bin, fastText's or
    OpenVINO's, come without them)."""
    return "config.json" in files and any(name.endswith(("vocabulary.json", "vocabulary.txt"))
                                          for name in files if "/" not in name)


def _choose_from_headers(source, weight_map, candidates, weight, bias, tie, label) -> HeadNames:
    """The head's tensors, chosen as the loader chooses them, from the headers of the shards that hold a
    tensor that could be chosen (every shard when no name is known). Offline, a shard that is not cached
    must be one the choice passes over: an input embedding's, when an untied output head is chosen."""
    shards = sorted({weight_map[name] for name in candidates} or set(weight_map.values()))
    infos, unread = {}, set()
    for shard in shards:
        header = source.headers(shard)
        if header is None:
            unread.add(shard)
        else:
            infos.update({name: info for name, info in header.items() if weight_map.get(name) == shard})

    def missing(shard: str) -> InputError:
        return source.absent(f"the shard {shard}, which holds a tensor the audit may need,")

    if unread and not candidates:
        raise missing(min(unread))
    unknown = sorted(name for name in candidates if weight_map[name] in unread)
    passable = [name for name in unknown if weight is None and is_input_embedding(name)]
    if len(passable) < len(unknown):
        raise missing(weight_map[next(name for name in unknown if name not in passable)])
    try:
        names = choose_head(infos, weight, bias, tie, label)
    except InputError:
        if passable:  # the unread embedding may be the head that was not found
            raise missing(weight_map[passable[0]]) from None
        raise
    if passable and (names.tied or tie is True):
        raise missing(weight_map[passable[0]])
    return names


def _tie_word_embeddings(config: Path | None):
    return read_config(config.parent).get("tie_word_embeddings") if config is not None else None
