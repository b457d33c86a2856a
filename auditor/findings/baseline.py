"""``--baseline REPORT.json``: which findings are new since an earlier report of the same vocabulary.

A finding is *unchanged* when the baseline has the same token id with the same
verdict, and *new* otherwise (a tie that became unargmaxable is new); the
baseline's findings whose token is no longer a finding at all are *fixed*.
Only new findings fail the gate.

The baseline must describe the same vocabulary: the same number of rows, or
fewer when this head extends it (``resize_token_embeddings`` appends rows), in
which case the token strings of the baseline's ids must be the very same
(the JSON report records a hash of them). Another vocabulary or another domain
is an error, since comparing ids across them would mean nothing, and so is
another ``--ceiling`` (low-ceiling findings depend on it).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from auditor.errors import InputError
from auditor.util.io import read_json_report


def vocabulary_fingerprint(head, size: int | None = None) -> str | None:
    """sha256 of the token strings of ids 0..size-1 (JSON-encoded), or None when the head has none."""
    if head.tokens is None:
        return None
    size = head.shape[0] if size is None else size
    strings = [head.token(k) for k in range(size)]
    if all(s is None for s in strings):
        return None
    return hashlib.sha256(json.dumps(strings, ensure_ascii=False).encode("utf-8")).hexdigest()


@dataclass
class Baseline:
    path: Path
    document: dict

    @classmethod
    def read(cls, path: Path) -> Baseline:
        """Read a JSON report written by ``audit --format json`` (or ``audit-merge``)."""
        document = read_json_report(path, f"--baseline {path}")
        if not isinstance(document, dict) or not {"summary", "findings", "head", "domain"} <= document.keys():
            certificates = isinstance(document, dict) and (document.get("kind") == "auditor-certificates"
                                                           or "tokens" in document)
            hint = " (it is a certificates file)" if certificates else ""
            raise InputError(f"--baseline {path}: not a JSON report of audit{hint}; write one with "
                             "audit --format json --output FILE")
        if document.get("shard"):
            raise InputError(f"--baseline {path}: a report of one shard covers part of the vocabulary; "
                             "merge the shards with audit-merge first")
        return cls(Path(path), document)

    @property
    def n_tokens(self) -> int:
        return int(self.document["summary"]["n_tokens"])

    def check(self, head, domain, ceiling: float | None = None) -> None:
        """Refuse a baseline of another vocabulary, domain or --ceiling (before any work is done)."""
        if self.document["domain"] != str(domain):
            raise InputError(f"--baseline {self.path}: its domain is {self.document['domain']}, this audit's is "
                             f"{domain}; compare reports of the same domain")
        if self.document.get("ceiling") != ceiling:  # else low-ceiling findings would all read new, or fixed
            theirs, ours = self.document.get("ceiling"), ceiling
            raise InputError(f"--baseline {self.path}: it was written with "
                             f"{'no --ceiling' if theirs is None else f'--ceiling {theirs:g}'}, this audit has "
                             f"{'none' if ours is None else f'--ceiling {ours:g}'}; compare reports of the same "
                             "--ceiling")
        n, old = head.shape[0], self.n_tokens
        recorded = self.document["head"].get("vocabulary_sha256")
        ours = vocabulary_fingerprint(head, min(n, old))
        if recorded is None or ours is None:
            # nothing to compare the vocabularies by: the ids are taken to name the same tokens, and the report
            # says so (a resized checkpoint saved without its tokenizer: a .pt, a Lightning or Trainer checkpoint)
            if n < old:
                raise InputError(f"--baseline {self.path}: a vocabulary of {old} tokens, this head has {n}; "
                                 "compare reports of the same vocabulary or of one it grew from")
            missing = ("neither the baseline nor this head has token strings" if recorded is None and ours is None
                       else "the baseline has no token strings" if recorded is None
                       else "this head has no token strings")
            head.notes.append(f"--baseline {self.path}: {missing}, so findings are compared by id (ids 0.."
                              f"{old - 1} taken to be the same tokens)")
            return
        if n == old:
            if ours != recorded:
                raise InputError(f"--baseline {self.path}: same size but other token strings; "
                                 "it is a report of another vocabulary")
            return
        if not (n > old and ours == recorded):
            raise InputError(f"--baseline {self.path}: a vocabulary of {old} tokens, this head has {n}"
                             + (" and its first token strings differ" if n > old else "")
                             + "; compare reports of the same vocabulary (a resized one must keep the "
                               "baseline's token strings)")

    def mark(self, findings, head, report) -> dict:
        """Mark each finding new or unchanged; return the summary the report shows."""
        before = {(f["id"], f["verdict"]) for f in self.document["findings"]}
        for finding in findings:
            finding.baseline = "unchanged" if (finding.id, finding.verdict) in before else "new"
        # fixed: no longer a finding at all (a changed verdict is a new finding, not a fix)
        still = {f.id for f in findings} | set(report.ids("undecided"))
        fixed = [{"id": f["id"], "token": f.get("token"), "verdict": f["verdict"]}
                 for f in self.document["findings"] if f["id"] not in still]
        new = sum(f.baseline == "new" for f in findings)
        return {"path": str(self.path), "n_tokens": self.n_tokens, "new": new, "unchanged": len(findings) - new,
                "fixed": fixed}
