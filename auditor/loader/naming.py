"""Which tensors of a checkpoint are the head, its bias and the final norm.

Explicit names win. Otherwise the known names of output heads are tried; when a
model has none (its head is tied to the input embedding, and the checkpoint
stores the matrix once) the input embedding is the head. More than one
candidate is an error that lists them: guessing the head would audit the
wrong matrix. The bias is the weight's sibling (``fc.bias`` beside ``fc.weight``)
or a known bias name; two different candidates are an error too, and a bias
found this way is named in the head's notes.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, replace

from auditor.errors import InputError
from auditor.loader.stores import TensorInfo

# Output heads: exact names, and names that may carry a prefix ("model.", "language_model.", ...).
HEAD_EXACT = ("weight", "output.weight")
HEAD_SUFFIX = ("lm_head.weight", "embed_out.weight", "cls.predictions.decoder.weight", "lm_head.decoder.weight",
               "generator_lm_head.weight", "pred_layer.proj.weight", "lm_head.linear.weight")
# Input embeddings, used when the head is tied to them.
EMBEDDING_EXACT = ("token_embd.weight", "shared.weight", "model.shared.weight")
EMBEDDING_SUFFIX = ("embed_tokens.weight", "wte.weight", "word_embeddings.weight", "embed_in.weight",
                    "tok_embeddings.weight", "embedding.weight", "embeddings.weight")
# Biases in order of preference; BERT stores cls.predictions.bias and its alias decoder.bias.
BIAS_NAMES = ("bias", "lm_head.bias", "final_logits_bias", "cls.predictions.bias", "cls.predictions.decoder.bias",
              "lm_head.decoder.bias", "embed_out.bias", "output.bias", "generator_lm_head.bias")
# Final normalisation layers (prefixes of .weight / .bias).
NORM_PREFIXES = ("model.norm", "transformer.ln_f", "gpt_neox.final_layer_norm", "model.decoder.final_layer_norm",
                 "output_norm", "model.final_layernorm", "transformer.norm_f", "backbone.norm_f",
                 "model.language_model.norm", "language_model.model.norm", "ln_f", "norm", "final_layer_norm",
                 "decoder.final_layer_norm")


@dataclass
class HeadNames:
    weight: str
    bias: str | None
    tied: bool
    norm_weight: str | None = None
    norm_bias: str | None = None
    # weight "A@B": ((A, transposed), (B, transposed)), the head being the product of the two
    factors: tuple[tuple[str, bool], tuple[str, bool]] | None = None
    bias_note: str | None = None  # where a detected bias came from, for the head's notes


def _matches(name: str, exact: tuple[str, ...], suffix: tuple[str, ...]) -> bool:
    return name in exact or any(name == s or name.endswith("." + s) for s in suffix)


def _is_known_bias(name: str, known: str) -> bool:
    return name == known or (known != "bias" and name.endswith("." + known))


def is_input_embedding(name: str) -> bool:
    """Whether ``name`` is a known input embedding's and not also a known output head's."""
    return _matches(name, EMBEDDING_EXACT, EMBEDDING_SUFFIX) and not _matches(name, HEAD_EXACT, HEAD_SUFFIX)


def candidate_names(names: Collection[str], weight: str | None, bias: str | None, need_norm: bool) -> list[str]:
    """Those of ``names`` that ``choose_head`` may pick, in their order: the names given (``weight``, its
    factors for ``"A@B"``; ``bias``), or those of known heads and input embeddings; known biases; final
    norms when ``need_norm``."""
    if weight is not None:
        given = {part[:-2] if part not in names and part.endswith(".T") else part for part in weight.split("@")}
        siblings = {sibling_bias(weight)} if "@" not in weight else set()
    candidates = []
    for name in names:
        if weight is not None:
            chosen = name in given
        else:
            chosen = _matches(name, HEAD_EXACT, HEAD_SUFFIX) or is_input_embedding(name)
        if bias not in (None, "none"):
            chosen = chosen or name == bias
        elif bias is None:
            chosen = chosen or any(_is_known_bias(name, known) for known in BIAS_NAMES)
            chosen = chosen or (weight is not None and name in siblings)
        if need_norm:
            chosen = chosen or any(name in (f"{p}.weight", f"{p}.bias") for p in NORM_PREFIXES)
        if chosen:
            candidates.append(name)
    return candidates


def _describe(infos: list[TensorInfo]) -> str:
    return ", ".join(f"{i.name} {list(i.shape)}" for i in infos)


def choose_head(tensors: dict[str, TensorInfo], weight: str | None, bias: str | None, tie_word_embeddings: bool | None,
                where: str) -> HeadNames:
    """Pick the head's tensors; raises InputError naming the candidates when unsure."""
    matrices = [info for info in tensors.values() if len(info.shape) == 2]
    factors = None
    if weight is not None and weight not in tensors and "@" in weight:
        factors, (chosen, right) = _factor_names(tensors, weight, matrices, where)
        tied, width = False, right.shape[1]
    elif weight is not None:
        if weight not in tensors:
            raise InputError(f"{where}: no tensor named {weight!r}; 2-D tensors: {_describe(matrices) or 'none'}")
        if len(tensors[weight].shape) != 2:
            raise InputError(f"{where}: tensor {weight!r} has shape {list(tensors[weight].shape)}, not vocabulary x hidden")
        chosen = tensors[weight]
        tied = is_input_embedding(weight)
    else:
        heads = [i for i in matrices if _matches(i.name, HEAD_EXACT, HEAD_SUFFIX)]
        embeddings = [i for i in matrices if _matches(i.name, EMBEDDING_EXACT, EMBEDDING_SUFFIX)]
        if len(heads) > 1:
            raise InputError(f"{where}: more than one output head ({_describe(heads)}); choose one with --weight NAME")
        if not heads and tie_word_embeddings is False:
            raise InputError(f"{where}: config.json says the head is not tied to the input embedding, but no output "
                             "head tensor is here; audit the model folder or its shard index, or name the head "
                             "with --weight NAME")
        shared = [i for i in embeddings if i.name in ("shared.weight", "model.shared.weight")]
        if len(embeddings) > 1 and len(shared) == 1:
            embeddings = shared  # T5 and BART keep the one shared matrix beside per-stack aliases of it
        if heads and tie_word_embeddings is not True:
            chosen, tied = heads[0], False
        elif heads and not embeddings:
            chosen, tied = heads[0], False
        elif len(embeddings) == 1:
            chosen, tied = embeddings[0], True
        elif len(embeddings) > 1:
            raise InputError(f"{where}: the head is tied but there is more than one input embedding "
                             f"({_describe(embeddings)}); choose one with --weight NAME")
        elif len(matrices) == 1:
            chosen, tied = matrices[0], False
        else:
            raise InputError(f"{where}: found no output head or input embedding; choose one with --weight NAME "
                             f"(2-D tensors: {_describe(matrices) or 'none'})")
    rows = chosen.shape[0]
    bias_name, bias_note = _choose_bias(tensors, bias, rows, where, None if factors else chosen.name)
    norm_weight, norm_bias = _choose_norm(tensors, width if factors else chosen.shape[1])
    return HeadNames(weight if factors else chosen.name, bias_name, tied, norm_weight, norm_bias, factors, bias_note)


def _factor_names(tensors: dict[str, TensorInfo], weight: str, matrices: list[TensorInfo], where: str):
    """``"A@B"`` (either name may end in ``.T``: transposed, as nn.Linear stores (out, in)) ->
    (((A, transposed), (B, transposed)), (A's info, B's info) as used)."""
    names = weight.split("@")
    if len(names) != 2 or not all(names):
        raise InputError(f"{where}: --weight {weight!r}: name one tensor, or two as A@B for the head W = A @ B")
    factors, infos = [], []
    for name in names:
        transposed = name not in tensors and name.endswith(".T")
        stored = name[:-2] if transposed else name
        if stored not in tensors:
            raise InputError(f"{where}: no tensor named {name!r} (in --weight {weight}); 2-D tensors: "
                             f"{_describe(matrices) or 'none'}")
        info = tensors[stored]
        if len(info.shape) != 2:
            raise InputError(f"{where}: tensor {stored!r} has shape {list(info.shape)}, not a matrix")
        factors.append((stored, transposed))
        infos.append(replace(info, shape=tuple(reversed(info.shape))) if transposed else info)
    left, right = infos
    if left.shape[1] != right.shape[0]:
        raise InputError(f"{where}: --weight {weight}: the factors do not multiply ({left.shape[0]} x "
                         f"{left.shape[1]} @ {right.shape[0]} x {right.shape[1]}); add or drop a .T")
    return tuple(factors), (left, right)


def sibling_bias(weight: str) -> str | None:
    """The bias of the layer whose weight is ``weight``: ``<prefix>.bias`` beside ``<prefix>.weight``."""
    if weight == "weight":
        return "bias"
    return weight[:-len("weight")] + "bias" if weight.endswith(".weight") else None


def _is_alias(name: str, chosen: list[str]) -> bool:
    # BERT and RoBERTa tie <head>.decoder.bias to <head>.bias: one parameter stored under two names
    return name.endswith(".decoder.bias") and name[:-len(".decoder.bias")] + ".bias" in chosen


def _choose_bias(tensors: dict[str, TensorInfo], bias: str | None, rows: int, where: str,
                 weight: str | None) -> tuple[str | None, str | None]:
    """(the bias's name or None, a note saying where a detected bias came from). The sibling of the
    weight (``fc.bias`` beside ``fc.weight``) and the known bias names are the candidates; two that are
    not one parameter under two names are ambiguous, and an InputError."""
    def length(info: TensorInfo) -> int | None:
        # final_logits_bias is stored as 1 x vocabulary
        if len(info.shape) == 1:
            return info.shape[0]
        if len(info.shape) == 2 and info.shape[0] == 1:
            return info.shape[1]
        return None

    if bias == "none":
        return None, None
    if bias is not None:
        if bias not in tensors:
            raise InputError(f"{where}: no tensor named {bias!r} for the bias")
        if length(tensors[bias]) != rows:
            raise InputError(f"{where}: bias {bias!r} has shape {list(tensors[bias].shape)}, "
                             f"but the head has {rows} rows")
        return bias, None
    sibling = sibling_bias(weight) if weight is not None else None
    chosen = [sibling] if sibling in tensors and length(tensors[sibling]) == rows else []
    for known in BIAS_NAMES:
        for name, info in tensors.items():
            if _is_known_bias(name, known) and length(info) == rows and name not in chosen:
                chosen.append(name)
    chosen = [name for name in chosen if not _is_alias(name, chosen)]
    if not chosen:
        return None, None
    if len(chosen) > 1:
        candidates = _describe([tensors[name] for name in chosen])
        raise InputError(f"{where}: more than one tensor could be the head's bias ({candidates}); name it with "
                         "--bias NAME, or pass --bias none")
    found = "beside the weight, in the same layer" if chosen[0] == sibling else "by its name"
    return chosen[0], f"the bias is {chosen[0]}, found {found} (--bias none audits without it)"


def _choose_norm(tensors: dict[str, TensorInfo], width: int) -> tuple[str | None, str | None]:
    for prefix in NORM_PREFIXES:
        weight = f"{prefix}.weight"
        info = tensors.get(weight)
        if info is not None and tuple(info.shape) == (width,):
            bias = f"{prefix}.bias"
            has_bias = bias in tensors and tuple(tensors[bias].shape) == (width,)
            return weight, (bias if has_bias else None)
    return None, None
