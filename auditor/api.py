"""``auditor.audit``: the one entry point for weight arrays."""

from __future__ import annotations

import time
from collections.abc import Iterable

import numpy as np
import torch

from auditor._input import check_options, prepare_inputs, prepare_token_ids, resolve_device
from auditor.domain import Domain, parse_domain
from auditor.engine import EngineOptions, decide
from auditor.report import AuditReport


def _row_reader(weight):
    """k -> float64 copy of row k of the caller's array (exact for every float dtype)."""
    if isinstance(weight, torch.Tensor):
        return lambda k: weight[k].detach().to(torch.float64).cpu().numpy()
    array = np.asarray(weight)
    if array.dtype.name == "bfloat16":
        return lambda k: array[k].astype(np.float32).astype(np.float64)
    return lambda k: array[k].astype(np.float64)


def audit(weight, bias=None, *, domain: str | Domain = "unbounded", device: str = "auto",
          tokens: Iterable[int] | None = None, progress: bool = True,
          residual_tol: float = 1e-10, frank_wolfe_iterations: int = 100, lp_rounds: int = 30) -> AuditReport:
    """Decide which tokens of a head can be the strict argmax of its logits ``W z + b``.

    ``weight`` is an n x d numpy array or torch tensor (float16, bfloat16, float32
    or float64) and ``bias`` a length-n vector or None. ``domain`` is
    ``"unbounded"``, ``"ball:R"``, ``"box:R"`` or a domain object. ``tokens``
    restricts the audit to some ids; the others are reported ``undecided``.
    ``residual_tol`` is the relative residual an unargmaxable certificate may
    rest on (times the largest row norm).

    Returns an AuditReport. Raises auditor.InputError for bad input (NaN or Inf
    weights, wrong shapes or dtypes, an empty head, an unknown domain or device)
    before deciding anything.
    """
    started = time.perf_counter()
    check_options(residual_tol, frank_wolfe_iterations, lp_rounds)
    parsed_domain = parse_domain(domain)
    chosen = resolve_device(device)
    w64, b64, dtype = prepare_inputs(weight, bias, chosen)
    ids = prepare_token_ids(tokens, w64.shape[0])
    options = EngineOptions(frank_wolfe_iterations=frank_wolfe_iterations, lp_rounds=lp_rounds,
                            residual_tol=residual_tol)
    decisions = decide(w64, b64, ids, parsed_domain, options, progress)
    timings = dict(decisions.timings)
    timings["total"] = time.perf_counter() - started
    return AuditReport(decisions, _row_reader(weight), n_tokens=w64.shape[0], hidden_size=w64.shape[1],
                       dtype=dtype, has_bias=b64 is not None, domain=parsed_domain, device=str(chosen),
                       timings=timings)
