"""A vocabulary head as loaded from a checkpoint: the matrices and where each came from."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from auditor.question.norm import FinalNorm


@dataclass
class Head:
    """What the auditor needs from a checkpoint, read without loading the rest of the model.

    ``weight`` (n x d) and ``bias`` are numpy arrays or torch tensors exactly as
    stored (dequantised for GGUF); ``tokens`` are the token strings by id where a
    tokenizer was found (None beyond the tokenizer's size). A head named as a
    product W = U @ V keeps its factors: ``weight`` is U and ``factor`` V.
    """

    weight: Any
    bias: Any = None
    weight_name: str = "weight"
    bias_name: str | None = None
    tied: bool = False
    final_norm: FinalNorm | None = None
    tokens: list[str | None] | None = None
    token_source: str | None = None
    path: Path | None = None
    source_format: str = "array"
    notes: list[str] = field(default_factory=list)
    factor: Any = None
    vocab_file: Path | None = None  # the --vocab file the token strings came from, and its offset
    vocab_offset: int = 0
    base_vocab: int | None = None  # the tokenizer model's own vocabulary size (tokenizer.json): later ids were added
    adapter_base: str | None = None  # the --base a PEFT adapter was applied over (None: its own base_model_name_or_path)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(int(s) for s in self.weight.shape)

    @property
    def dtype(self) -> str:
        return str(self.weight.dtype).replace("torch.", "")

    @property
    def audited(self):
        """What auditor.audit takes: the weight, or the pair (U, V) of a factorised head."""
        return self.weight if self.factor is None else (self.weight, self.factor)

    def token(self, k: int) -> str | None:
        if self.tokens is None or k >= len(self.tokens):
            return None
        return self.tokens[k]

    def ids_of(self, string: str) -> list[int]:
        """Every id whose token string is exactly ``string``, in order; [] when none is, or the head has no
        token strings (``tokens`` is None: the caller says which, in its own words)."""
        return [k for k, token in enumerate(self.tokens or ()) if token == string]
