"""Where a Hub model's files are read from: the Hub, fetching into the local cache, or the local cache alone.

Both sources answer the same questions: which files the revision has (``files``), the commit they belong
to (``commit``), one file's path in the cache (``get``), a safetensors shard's tensors from its header
(``headers``), and the one-line error for a file that is not there (``absent``). huggingface_hub owns the
cache; its layout (models--org--name/refs/<revision>, snapshots/<commit>/<file>) is read here.
"""

from __future__ import annotations

import os
from pathlib import Path

from auditor.errors import InputError
from auditor.loader.hub_id import hub_id, is_commit
from auditor.loader.stores import SafetensorsStore, TensorInfo


class NotCached(InputError):
    """Some file the head needs is not in the local cache, and it may not or cannot be fetched."""


class HubFiles:
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
        self.commit = sha if is_commit(sha) else None
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


class CachedFiles:
    """A revision's files already in the local cache; nothing is fetched. ``reason`` says why not (it ends
    the message of a file that is not cached; "" for none)."""

    where = "in the local cache"
    complete = False  # what was fetched, which may be part of the repository's files

    def __init__(self, hub, repo_id: str, revision: str | None, reason: str):
        self.repo_id, self._reason = repo_id, reason
        self._cache = hub.constants.HF_HUB_CACHE
        self._label = hub_id(repo_id, revision)
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
        return NotCached(f"{self._label}: {what} is not in the local cache ({self._cache}){because}")


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
