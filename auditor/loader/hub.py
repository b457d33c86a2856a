"""Models on the Hugging Face Hub: ``org/name[@revision]`` to files in the local cache, fetching only what
the head needs.

huggingface_hub (the auditor[hub] extra) owns the cache (HF_HOME, HF_HUB_CACHE), the endpoint (HF_ENDPOINT),
logins and offline mode (HF_HUB_OFFLINE=1). A file already cached is never fetched again; offline, or when
the Hub cannot be reached, only the cache is read. What is fetched: config.json, the tokenizer files, the
shard index, and only the shards that hold the head's tensors (and the final norm's, for the norm domain):
their headers are read remotely with HTTP range requests to find out which. A model in a single file is
fetched whole, as there is no smaller part of it to read.
"""

from __future__ import annotations

import os
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from auditor.errors import InputError
from auditor.loader.naming import (BIAS_NAMES, EMBEDDING_EXACT, EMBEDDING_SUFFIX, HEAD_EXACT, HEAD_SUFFIX,
                                   NORM_PREFIXES, HeadNames, _matches, choose_head)
from auditor.loader.stores import SafetensorsStore, TensorInfo, TorchStore, parse_index

# The Hub's own rule for a name: word characters, '.' and '-', starting and ending with a word character.
_NAME = r"[A-Za-z0-9_](?:[\w.-]{0,94}[A-Za-z0-9_])?"
_ID = re.compile(rf"(?P<repo>{_NAME}/{_NAME})(?:@(?P<revision>\S+))?")
_COMMIT = re.compile(r"[0-9a-f]{40}")
# A part of a sharded checkpoint ("model-00001-of-00003.safetensors"), never a model in a single file.
_SHARD_NAME = re.compile(r"-\d{5}-of-\d{5}\.")
# A missing "dir/head.safetensors" is a mistyped path, not a repository: report it as one.
_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".npy", ".npz", ".gguf", ".json", ".git")

# The weight files a model folder is read from, in the loader's order of preference (safetensors first).
SHARD_INDEXES = {"model.safetensors.index.json": SafetensorsStore, "pytorch_model.bin.index.json": TorchStore}
WEIGHT_FILES = ("model.safetensors.index.json", "model.safetensors", "pytorch_model.bin.index.json",
                "pytorch_model.bin")
# Both are fetched when present: which one gives the strings depends on whether tokenizers is installed.
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt")

_OFFLINE = "HF_HUB_OFFLINE=1 forbids fetching it (unset HF_HUB_OFFLINE to fetch)"


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


@dataclass
class HubModel:
    """The files of one commit of a Hub model in the local cache, as far as the head needs them."""

    repo_id: str
    commit: str
    checkpoint: Path  # the weights file, or the shard index, in the cache's snapshot folder
    store: object | None = None  # a store over the fetched shards only (sharded models); None: open checkpoint
    note: str | None = None

    @property
    def label(self) -> str:
        """Where the head came from, as reports record it: an id that audits this very commit again."""
        return f"{self.repo_id}@{self.commit}"


class _NotCached(InputError):
    """Some file the head needs is not in the local cache, and it may not or cannot be fetched."""


def load_head(text: str, weight: str | None, bias: str | None, progress: bool, need_norm: bool):
    """The Head of the Hub model ``text`` (see loader.load_head), its ``path`` the id pinned to the commit read."""
    from auditor.loader import load_head as load_local

    repo_id, revision = parse_hub_id(text)
    model = resolve(repo_id, revision, weight=weight, bias=bias, need_norm=need_norm, progress=progress)
    head = load_local(model.checkpoint, weight, bias, progress, store=model.store)
    head.path = Path(model.label)
    if model.note:
        head.notes.append(model.note)
    return head


def resolve(repo_id: str, revision: str | None = None, *, weight: str | None = None, bias: str | None = None,
            need_norm: bool = False, progress: bool = False) -> HubModel:
    """The files of ``repo_id`` at ``revision`` (default: main) that the head needs, fetched into the cache
    unless they are there. ``weight`` / ``bias`` are the names given to the loader (None: detected);
    ``need_norm`` also fetches the final norm. Raises InputError (one line) when huggingface_hub is missing,
    the repository, revision or a file is not found, the model is gated, or it is not cached and cannot be
    fetched (HF_HUB_OFFLINE=1, no network)."""
    hub = _import_hub(repo_id, revision)
    label = repo_id + (f"@{revision}" if revision else "")
    with _progress_bars(shown=progress), _hub_errors(hub, label, repo_id, revision):
        if hub.constants.HF_HUB_OFFLINE:
            return _gather(_CachedFiles(hub, repo_id, revision, _OFFLINE), label, weight, bias, need_norm)
        if revision and _COMMIT.fullmatch(revision):  # a commit never changes: what is cached is current
            try:
                return _gather_cached(hub, repo_id, revision, label, weight, bias, need_norm)
            except _NotCached:  # not all of it, or not so that it can be read: fetch it
                pass
        try:
            source = _HubFiles(hub, repo_id, revision)
        except _network_errors() as error:
            reason = f"the Hub at {hub.constants.ENDPOINT} cannot be reached ({_first_line(error)})"
            model = _gather(_CachedFiles(hub, repo_id, revision, reason), label, weight, bias, need_norm)
            model.note = f"{reason}: the cached snapshot of {label} (commit {model.commit}) was audited"
            return model
        return _gather(source, label, weight, bias, need_norm)


def list_tensors(text: str) -> list[TensorInfo]:
    """Every tensor of a Hub model, from its safetensors headers: read remotely (range requests), or from
    the cache when offline; no weights are fetched. Raises InputError for a model without safetensors."""
    repo_id, revision = parse_hub_id(text)
    hub = _import_hub(repo_id, revision)
    with _hub_errors(hub, text, repo_id, revision):
        offline = hub.constants.HF_HUB_OFFLINE
        source = (_CachedFiles(hub, repo_id, revision, _OFFLINE) if offline
                  else _HubFiles(hub, repo_id, revision))
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
    """_gather from the cache alone, when fetching is possible: any problem found there (a file missing, a
    head not found among the cached shards, ...) is _NotCached, so that the caller fetches instead; the
    files on the Hub then give the answer, or the error, that the complete model gives."""
    try:
        return _gather(_CachedFiles(hub, repo_id, revision, ""), label, weight, bias, need_norm)
    except _NotCached:
        raise
    except InputError as error:
        raise _NotCached(str(error)) from error


def _gather(source, label: str, weight, bias, need_norm: bool) -> HubModel:
    """Fetch (or find in the cache) config.json, the tokenizer files and the weights the head needs."""
    weights = _weights_file(source, label)
    config = source.get("config.json") if "config.json" in source.files else None
    if not weights.lower().endswith(".gguf"):  # a GGUF file carries its own tokens
        for name in TOKENIZER_FILES:
            if name in source.files:
                source.get(name)
    if weights not in SHARD_INDEXES:
        checkpoint = source.get(weights)
        return HubModel(source.repo_id, source.commit, checkpoint)
    index = source.get(weights)
    weight_map = parse_index(index)
    candidates = _candidates(weight_map, weight, bias, need_norm)
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


def _weights_file(source, label: str) -> str:
    for name in WEIGHT_FILES:
        if name in source.files:
            return name
    singles = [f for f in source.files if "/" not in f and f.lower().endswith((".safetensors", ".gguf"))]
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
    raise source.absent(f"a checkpoint (looked for {looked}, or a single .safetensors or .gguf file)")


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
    passable = [name for name in unknown if weight is None and _is_embedding(name)]
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


def _candidates(weight_map: dict[str, str], weight, bias, need_norm: bool) -> list[str]:
    """The tensors that the loader's choice of head may read (loader/naming.py): the names given, or those
    of known heads and input embeddings; known biases; final norms when they are needed."""
    if weight is not None:
        given = {part[:-2] if part not in weight_map and part.endswith(".T") else part for part in weight.split("@")}
    names = []
    for name in weight_map:
        if weight is not None:
            chosen = name in given
        else:
            chosen = _matches(name, HEAD_EXACT, HEAD_SUFFIX) or _is_embedding(name)
        if bias not in (None, "none"):
            chosen = chosen or name == bias
        elif bias is None:
            chosen = chosen or any(name == b or (b != "bias" and name.endswith("." + b)) for b in BIAS_NAMES)
        if need_norm:
            chosen = chosen or any(name in (f"{p}.weight", f"{p}.bias") for p in NORM_PREFIXES)
        if chosen:
            names.append(name)
    return names


def _is_embedding(name: str) -> bool:
    return _matches(name, EMBEDDING_EXACT, EMBEDDING_SUFFIX) and not _matches(name, HEAD_EXACT, HEAD_SUFFIX)


def _tie_word_embeddings(config: Path | None):
    from auditor.loader import _read_config  # the loader's reading, text_config of multimodal models included

    return _read_config(config.parent).get("tie_word_embeddings") if config is not None else None


class _HubFiles:
    """A revision's files on the Hub, fetched into the cache one by one as asked for."""

    where = "in the repository"
    complete = True  # the repository's own list of files

    def __init__(self, hub, repo_id: str, revision: str | None):
        self._hub, self.repo_id = hub, repo_id
        self._api = hub.HfApi()
        info = self._api.model_info(repo_id, revision=revision)
        self.files = [sibling.rfilename for sibling in info.siblings or ()]
        # The list of files is that of the commit info.sha: every later request is pinned to it, so that a
        # branch moving meanwhile mixes no other commit's files in. (Without a sha, as a mirror may answer,
        # the first fetch names the revision and the others are pinned to the commit it resolved to.)
        self._revision = revision or "main"
        sha = getattr(info, "sha", None)
        self.commit = sha if isinstance(sha, str) and _COMMIT.fullmatch(sha) else None
        self._ref_written = False

    def get(self, filename: str) -> Path:
        path = Path(self._hub.hf_hub_download(self.repo_id, filename, revision=self.commit or self._revision))
        snapshot = path.parents[len(Path(filename).parts) - 1]  # snapshots/<commit>/<filename>
        if self.commit is None:
            self.commit = snapshot.name
        if not self._ref_written:
            self._ref_written = True
            _write_ref(snapshot.parent.parent, self._revision, self.commit)
        return path

    def headers(self, shard: str) -> dict[str, TensorInfo]:
        cached = self._hub.try_to_load_from_cache(self.repo_id, shard, revision=self.commit) if self.commit else None
        if isinstance(cached, str):  # a shard fetched before: its header is here
            return SafetensorsStore.from_file(Path(cached)).tensors()
        metadata = self._api.parse_safetensors_file_metadata(self.repo_id, shard,
                                                             revision=self.commit or self._revision)
        return {name: TensorInfo(name, tuple(info.shape), info.dtype) for name, info in metadata.tensors.items()}

    def absent(self, what: str) -> InputError:
        return InputError(f"{self.repo_id}: {what} is not {self.where}")


def _write_ref(repo_folder: Path, revision: str, commit: str):
    """Record in the cache that the branch or tag ``revision`` points at ``commit`` (refs/<revision>), as a
    fetch by revision records it, so that an offline run finds the snapshot by the same name."""
    if revision == commit:
        return
    ref = repo_folder / "refs" / revision
    try:
        if ref.is_file() and ref.read_text().strip() == commit:
            return
        ref.parent.mkdir(parents=True, exist_ok=True)
        partial = ref.with_name(f"{ref.name}.{os.getpid()}.tmp")
        partial.write_text(commit)
        os.replace(partial, ref)  # readers never see half a ref
    except OSError:  # a read-only cache: the snapshot is there, only its name for offline runs is not
        pass


class _CachedFiles:
    """A revision's files already in the local cache; nothing is fetched."""

    where = "in the local cache"
    complete = False  # what was fetched, which may be part of the repository's files

    def __init__(self, hub, repo_id: str, revision: str | None, reason: str):
        self.repo_id, self._reason = repo_id, reason
        self._cache = hub.constants.HF_HUB_CACHE
        self._label = repo_id + (f"@{revision}" if revision else "")
        self.folder = _cached_snapshot(hub, repo_id, revision)
        if self.folder is None:
            raise self.absent("the model")
        self.commit = self.folder.name
        self.files = sorted(p.relative_to(self.folder).as_posix() for p in self.folder.rglob("*") if p.is_file())

    def get(self, filename: str) -> Path:
        path = self.folder / filename
        if not path.is_file():
            raise self.absent(filename)
        return path

    def headers(self, shard: str) -> dict[str, TensorInfo] | None:
        path = self.folder / shard
        return SafetensorsStore.from_file(path).tensors() if path.is_file() else None

    def absent(self, what: str) -> InputError:
        because = f", and {self._reason}" if self._reason else ""
        return _NotCached(f"{self._label}: {what} is not in the local cache ({self._cache}){because}")


def _cached_snapshot(hub, repo_id: str, revision: str | None) -> Path | None:
    """The cache's snapshot folder of a revision: refs/<branch or tag> holds its commit (the cache's layout)."""
    from huggingface_hub.file_download import repo_folder_name

    repo = Path(hub.constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo_id, repo_type="model")
    commit = revision or "main"
    ref = repo / "refs" / commit
    if ref.is_file():
        commit = ref.read_text().strip()
    folder = repo / "snapshots" / commit
    return folder if commit and folder.is_dir() else None


def _import_hub(repo_id: str, revision: str | None):
    try:
        import huggingface_hub
        import huggingface_hub.constants
    except ImportError:
        label = repo_id + (f"@{revision}" if revision else "")
        raise InputError(f"{label}: no such file or folder; as a Hugging Face Hub model id it needs "
                         "huggingface_hub: pip install 'auditor[hub]'") from None
    return huggingface_hub


@contextmanager
def _progress_bars(shown: bool):
    """huggingface_hub's download bars, silenced unless asked for (a terminal, no --quiet), then restored."""
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    if shown or are_progress_bars_disabled():
        yield
        return
    disable_progress_bars()
    try:
        yield
    finally:
        enable_progress_bars()


@contextmanager
def _hub_errors(hub, label: str, repo_id: str, revision: str | None):
    """huggingface_hub's exceptions as one line each, saying what to do."""
    errors = hub.utils
    try:
        yield
    except InputError:
        raise
    except errors.GatedRepoError as error:  # before RepositoryNotFoundError, which it is a kind of
        raise InputError(f"{label}: a gated model: accept its conditions on its Hub page, then log in "
                         "(hf auth login, or HF_TOKEN)") from error
    except errors.RepositoryNotFoundError as error:
        raise InputError(f"{label}: no such file or folder, nor a model on the Hugging Face Hub at "
                         f"{hub.constants.ENDPOINT} (a private one needs a login: hf auth login, or HF_TOKEN)"
                         ) from error
    except errors.RevisionNotFoundError as error:
        raise InputError(f"{label}: the Hub model {repo_id} has no branch, tag or commit {revision!r}") from error
    except errors.LocalEntryNotFoundError as error:  # before EntryNotFoundError: recent versions derive it from it
        raise InputError(f"{label}: a file is neither in the local cache nor could it be fetched from "
                         f"{hub.constants.ENDPOINT} ({_first_line(error)})") from error
    except errors.EntryNotFoundError as error:
        raise InputError(f"{label}: a file is missing on the Hub ({_first_line(error)})") from error
    except errors.HfHubHTTPError as error:
        status = getattr(getattr(error, "response", None), "status_code", "an error")
        raise InputError(f"{label}: the Hub answered HTTP {status} ({_first_line(error)})") from error
    except _network_errors() as error:
        raise InputError(f"{label}: cannot reach the Hub at {hub.constants.ENDPOINT} "
                         f"({type(error).__name__}: {_first_line(error)})") from error


def _network_errors() -> tuple[type[BaseException], ...]:
    """Connection failures as the HTTP client that huggingface_hub uses raises them (it varies by version)."""
    found: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module, name in (("httpx2", "TransportError"), ("httpx", "TransportError"), ("requests", "ConnectionError"),
                         ("requests", "Timeout")):
        error = getattr(sys.modules.get(module), name, None)
        if isinstance(error, type) and issubclass(error, BaseException):
            found.append(error)
    return tuple(found)


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__
