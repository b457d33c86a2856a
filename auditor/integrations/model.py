"""``audit_model``: the live output head of a model in memory, audited with findings, explanations and the gate.

The head is found as the command finds it in a checkpoint, but on the module: ``get_output_embeddings()``
(transformers' models, and PEFT's wrappers, which hand the call on), its ``weight`` and ``bias``. Nothing
here imports a training framework; the model only has to answer that call, or be given ``head=``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import torch

from auditor.api import audit
from auditor.errors import InputError
from auditor.findings.finding import DEFAULT_FAIL_ON
from auditor.findings.gate import AllowList, GateResult, run_gate
from auditor.question.head import Head
from auditor.runs.trend import min_margin


def output_head(model, head=None) -> tuple[torch.Tensor, torch.Tensor | None, str, bool]:
    """(weight, bias, name, tied) of the model's output head, detached; ``head`` is the module when the
    model has no ``get_output_embeddings``. Refuses a head sharded across ranks in one line."""
    module = head
    if module is None:
        getter = getattr(model, "get_output_embeddings", None)
        module = getter() if callable(getter) else None
    if module is None or not isinstance(getattr(module, "weight", None), torch.Tensor):
        raise InputError("found no output head on the model: it has no get_output_embeddings() with a weight; "
                         "pass the head module with head=")
    weight = module.weight.detach()
    if weight.dim() != 2 or weight.numel() == 0:
        raise InputError(f"the output head's weight has shape {tuple(weight.shape)} here: it is sharded across "
                         "ranks (FSDP or DeepSpeed ZeRO-3); audit the saved checkpoint instead (audit "
                         "checkpoint-N/), or gather the head first")
    bias = getattr(module, "bias", None)
    bias = bias.detach() if isinstance(bias, torch.Tensor) else None
    inputs = getattr(model, "get_input_embeddings", None)
    embedding = inputs() if callable(inputs) else None
    embedded = getattr(embedding, "weight", None)
    tied = isinstance(embedded, torch.Tensor) and embedded.data_ptr() == weight.data_ptr()
    return weight, bias, _module_path(model, module), tied


def _module_path(model, module) -> str:
    """The head's dotted path in the model ("lm_head", "base_model.model.lm_head.modules_to_save.default"), as
    its state dict names it; its class name where the model does not hold it as a submodule."""
    named = getattr(model, "named_modules", None)
    if callable(named):
        for path, candidate in named():
            if candidate is module and path:
                return path
    return type(module).__name__


def token_strings(tokenizer) -> tuple[list[str | None] | None, int | None]:
    """(strings by id, the size of the tokenizer model's own vocabulary) from a transformers tokenizer (or a
    processor holding one); (None, None) without one."""
    tokenizer = getattr(tokenizer, "tokenizer", tokenizer)
    if tokenizer is None or not hasattr(tokenizer, "convert_ids_to_tokens"):
        return None, None
    size = len(tokenizer)
    return list(tokenizer.convert_ids_to_tokens(list(range(size)))), int(tokenizer.vocab_size)


def watched_ids(tokens, head: Head) -> list[int] | None:
    """The ids ``tokens`` names on ``head``: None (every token), ``"added"`` (the ids past the tokenizer model's
    own vocabulary), or ids and token strings."""
    if tokens is None:
        return None
    n, base_vocab = head.shape[0], head.base_vocab
    if isinstance(tokens, str) and tokens == "added":
        if base_vocab is None:
            raise InputError("tokens='added' needs the tokenizer (its own vocabulary tells the added tokens apart): "
                             "pass tokenizer=, or give the ids")
        if base_vocab >= n:
            raise InputError(f"tokens='added': the tokenizer's own vocabulary has {base_vocab} tokens and the head "
                             f"{n} rows: no token was added")
        return list(range(base_vocab, n))
    ids = []
    for token in ([tokens] if isinstance(tokens, (str, int)) else tokens):
        if isinstance(token, str):
            found = head.ids_of(token)
            if not found:
                raise InputError(f"no token is the string {token!r}" + ("" if head.tokens else ": no tokenizer given"))
            ids += found
        else:
            ids.append(int(token))
    bad = [k for k in ids if not 0 <= k < n]
    if bad:
        raise InputError(f"token ids {bad[:5]} are outside the vocabulary 0..{n - 1}")
    return sorted(set(ids))


def audit_model(model, tokens: str | Iterable[int | str] | None = None, *, tokenizer=None, head=None,
                domain="unbounded", fail_on=DEFAULT_FAIL_ON, allow: AllowList | None = None, progress: bool = False,
                threads: int | None = None) -> GateResult:
    """Audit the live output head of ``model`` (under torch.no_grad, on the device its weights are on).

    ``tokens``: None for every token, ``"added"`` for the ids past the tokenizer model's own vocabulary
    (the tokens added to it, and rows past its length), or ids and token strings. ``tokenizer`` (a
    transformers tokenizer or processor) names the tokens. Returns the GateResult the command builds:
    ``findings`` with their explanations and next steps, ``summaries``, ``failing`` and ``exit_code``,
    and the AuditReport as ``report``. Findings about added tokens are of kind ``untrained`` (still at the mean)
    or ``added`` (away from it)."""
    weight, bias, name, tied = output_head(model, head)
    strings, base_vocab = token_strings(tokenizer)
    described = Head(weight=weight, bias=bias, weight_name=f"{name}.weight", bias_name=None if bias is None else
                     f"{name}.bias", tied=tied, tokens=strings, token_source=None if strings is None else "tokenizer",
                     source_format="model", base_vocab=base_vocab)
    ids = watched_ids(tokens, described)
    device = "cuda" if weight.is_cuda else "cpu"
    with torch.no_grad():
        report = audit(weight, bias, tokens=ids, domain=domain, device=device, progress=progress, threads=threads)
    return run_gate(described, report, fail_on, allow)


class UnproducibleTokensError(RuntimeError):
    """Watched tokens that the model can never produce, raised where a training callback is told to stop."""


def unproducible_message(result: GateResult, where: str, stopped: bool = True) -> str:
    """What a gate says of the watched tokens that cannot be produced, ``where`` it looked: "stopped" when it stops
    the run, a plain statement when it only warns."""
    named = ", ".join(f"{f.id} {json.dumps(f.token, ensure_ascii=False)}" if f.token is not None else str(f.id)
                      for f in result.failing[:20])
    more = f" and {len(result.failing) - 20} more" if len(result.failing) > 20 else ""
    return (f"argmaxability: {'stopped ' if stopped else ''}{where}: the model can never produce "
            f"{len(result.failing)} watched token(s): {named}{more}; "
            f"{result.next_steps[0] if result.next_steps else ''}")


def metrics(result) -> dict[str, float]:
    """The logged values of one audit: counts over the watched tokens (those decided), and the smallest lead
    among them, 0 while one of them cannot win."""
    report = result.report
    return {"argmaxability/unargmaxable": float(report.counts["unargmaxable"]),
            "argmaxability/never_emitted": float(len(report.never_emitted())),
            "argmaxability/min_margin": min_margin(report)}
