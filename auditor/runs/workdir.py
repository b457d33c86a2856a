"""``--work-dir DIR``: the decided blocks of an audit kept as files, so that a stopped audit resumes.

    DIR/audit-work.json                          which audit the folder belongs to (head and settings)
    DIR/block-000000000-000016384.json           one decided block: its part of the report and its certificates

A block file is written to a temporary beside it and renamed into place, so a
reader (a rerun, another rank) sees a whole block or none: a ``kill -9``
loses only the blocks being decided. A folder is bound to one audit: the
sha256 of the head's bytes (weight, bias, second factor, final norm) and every
setting that can change a block's part of the report. Another head or other
settings are refused with one line, rather than merging parts of two audits.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from auditor._version import SOUND_SINCE, __version__, version_tuple
from auditor.errors import InputError
from auditor.findings.baseline import vocabulary_fingerprint
from auditor.formats.json_format import head_section
from auditor.util.io import write_atomically

MANIFEST = "audit-work.json"
MANIFEST_KIND = "auditor-work-dir"
BLOCK_KIND = "auditor-work-block"
_CHUNK_BYTES = 64 << 20  # hash a head in slices of rows: a large head is memory-mapped, never read whole


def _byte_slices(array):
    """The bytes of an array (numpy, memory-mapped or a torch tensor, any float dtype) in slices of rows."""
    import torch

    itemsize = array.element_size() if isinstance(array, torch.Tensor) else array.itemsize
    row_bytes = max(1, itemsize * int(np.prod(array.shape[1:], dtype=np.int64)))
    step = max(1, _CHUNK_BYTES // row_bytes)
    for start in range(0, array.shape[0], step):
        part = array[start:start + step]
        if isinstance(part, torch.Tensor):
            yield part.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        else:
            yield np.ascontiguousarray(part).tobytes()


def head_fingerprint(head) -> str:
    """sha256 over the head's arrays as stored (dtype, shape and bytes): weight, bias, factor, final norm."""
    digest = hashlib.sha256()
    norm = head.final_norm
    arrays = [("weight", head.weight), ("bias", head.bias), ("factor", head.factor),
              ("norm weight", norm.weight if norm else None), ("norm bias", norm.bias if norm else None)]
    for name, array in arrays:
        if array is None:
            digest.update(f"{name}: none\n".encode())
            continue
        digest.update(f"{name}: {array.dtype} {tuple(array.shape)}\n".encode())
        for chunk in _byte_slices(array):
            digest.update(chunk)
    return digest.hexdigest()


def file_fingerprint(path: Path | None) -> str | None:
    """sha256 of a file's bytes (the allow-list, the baseline), or None when no file was given."""
    if path is None:
        return None
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError as error:
        raise InputError(f"{path}: cannot read it ({error.strerror or error})") from None


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Binding:
    """What a work folder is bound to: the head's fingerprint and the settings (a JSON-able dict)."""

    head_sha256: str
    settings: dict

    @property
    def key(self) -> str:
        return _digest({"head": self.head_sha256, "settings": self.settings})


class WorkDir:
    """A work folder: ``bind`` it to an audit (rank 0) or ``prepare`` it with the key rank 0 found (the other
    ranks), then ``load``/``save`` blocks by range."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.key: str | None = None  # the binding's key, which every block file carries

    def bind(self, binding: Binding) -> None:
        """Create the folder (and its manifest), or check that it belongs to this audit.

        Raises InputError, in one line, for a folder of another head or other settings, a file in
        place of the folder, or a non-empty folder that is not a work folder.
        """
        self.key = binding.key
        manifest = self.path / MANIFEST
        if self.path.exists() and not self.path.is_dir():
            raise InputError(f"--work-dir {self.path}: is a file, not a folder")
        if not manifest.exists():
            if self.path.is_dir() and any(not p.name.startswith(".") for p in self.path.iterdir()):
                raise InputError(f"--work-dir {self.path}: not empty and not a work folder of audit; "
                                 "give a new or empty folder")
            try:
                self.path.mkdir(parents=True, exist_ok=True)
            except OSError as error:
                raise InputError(f"--work-dir {self.path}: cannot create it ({error.strerror or error})") from None
            document = {"kind": MANIFEST_KIND, "head_sha256": binding.head_sha256,
                        "settings": binding.settings}
            write_atomically({manifest: json.dumps(document, indent=2, sort_keys=True) + "\n"})
            return
        try:
            document = json.loads(manifest.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise InputError(f"--work-dir {self.path}: its {MANIFEST} cannot be read ({error})") from None
        if not isinstance(document, dict) or document.get("kind") != MANIFEST_KIND:
            raise InputError(f"--work-dir {self.path}: its {MANIFEST} is not a work folder's manifest")
        if document.get("head_sha256") != binding.head_sha256:
            raise InputError(f"--work-dir {self.path}: holds blocks of another head (its weights differ); "
                             "give a new folder or empty this one")
        settings = document.get("settings") or {}
        if (version_tuple(settings.get("version")) < SOUND_SINCE
                and all(name == "version" for name, _, _ in _differences(settings, binding.settings))):
            # blocks of a version whose bfloat16 screen could certify false witnesses: none is reused (each
            # block file carries the binding's key, which the version is part of), every one is decided again
            document["settings"] = binding.settings
            write_atomically({manifest: json.dumps(document, indent=2, sort_keys=True) + "\n"})
            return
        for name, before, now in _differences(settings, binding.settings):
            raise InputError(f"--work-dir {self.path}: holds blocks of an audit with other settings "
                             f"({name} was {json.dumps(before)}, now {json.dumps(now)}); "
                             "give a new folder or empty this one")

    def prepare(self, key: str) -> None:
        """A rank other than 0 takes rank 0's key and makes sure the folder is there (on a node that does not
        share it)."""
        self.key = key
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise InputError(f"--work-dir {self.path}: cannot create it ({error.strerror or error})") from None

    def block_path(self, first: int, stop: int) -> Path:
        return self.path / f"block-{first:09d}-{stop:09d}.json"

    def load(self, first: int, stop: int, ids) -> dict | None:
        """The stored part of block first..stop-1, or None when it is not there or was decided for
        other ids or another audit (it is then decided again and replaced)."""
        path = self.block_path(first, stop)
        try:
            document = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None  # absent, or unreadable: deciding it again is always safe
        if (not isinstance(document, dict) or document.get("kind") != BLOCK_KIND
                or document.get("key") != self.key or document.get("ids") != _ids_digest(ids)):
            return None
        return document.get("part")

    def save(self, first: int, stop: int, ids, part: dict) -> None:
        """Write a decided block atomically (temporary file, then os.replace)."""
        document = {"kind": BLOCK_KIND, "key": self.key, "ids": _ids_digest(ids), "part": part}
        write_atomically({self.block_path(first, stop): json.dumps(document, allow_nan=False) + "\n"})

    def remove_stale_temporaries(self) -> None:
        """Temporaries of writes cut short by a kill: nothing reads them, so they only take space.
        Called by the root before any rank starts writing."""
        for temporary in self.path.glob(".block-*.tmp"):
            temporary.unlink(missing_ok=True)


def _differences(before: dict, now: dict, prefix: str = ""):
    """(dotted name, before, now) of every setting that differs, nested dicts entered (``head.final_norm.eps``)."""
    for name in sorted(set(before) | set(now)):
        old, new = before.get(name), now.get(name)
        if isinstance(old, dict) and isinstance(new, dict):
            yield from _differences(old, new, f"{prefix}{name}.")
        elif old != new:
            yield f"{prefix}{name}", old, new


def _ids_digest(ids) -> dict:
    ids = np.asarray(ids, dtype=np.int64)
    return {"count": int(ids.size), "sha256": hashlib.sha256(ids.tobytes()).hexdigest()}


def binding_for(head, *, domain, final_norm, ceiling: float | None, fail_on, allow: Path | None,
                baseline: Path | None, block_size: int, device: str) -> Binding:
    """The binding of a work folder to this audit: the head's bytes, and every setting that can change a
    block's part of the report (the verdicts, the findings' marks, the token strings shown). ``device``
    is the kind of device ("cpu", "cuda"): the blocks share the centre and tolerances the engine computes
    on the whole head, which one device may round differently from another."""
    settings = {
        "version": __version__,
        "path": str(head.path) if head.path else None,
        "weight": head.weight_name,
        "bias": head.bias_name,
        "domain": str(domain),
        "final_norm": None if final_norm is None else {"kind": final_norm.kind, "eps": final_norm.eps,
                                                       "unit_offset": final_norm.unit_offset},
        "ceiling": ceiling,
        "fail_on": sorted(fail_on),
        "allow": file_fingerprint(allow),
        "baseline": file_fingerprint(baseline),
        "block_size": block_size,
        "device": device,
        "token_strings": vocabulary_fingerprint(head),
        # every block's report carries the head section, and blocks are merged only when they agree: a
        # changed source format, token source, norm epsilon or tie must not resume
        "head": head_section(head),
    }
    return Binding(head_fingerprint(head), settings)
