"""The objective F_k over the domain: its value and gradient at a batch of points, the probability it gives.

F_k(z) = log sum_{i != k} exp(l_i(z) - l_k(z)) and p_k(z) = 1 / (1 + exp(F_k(z))); the linearisation
at z bounds min_D F_k from below by F_k(z) - g.z - s_D(-g), g the gradient (``dual``, with the
domain's support function). Nothing here allows for rounding: bounds.py does.
"""

from __future__ import annotations

import torch

from auditor.engine.arithmetic.rounding import UNIT_ROUNDOFF
from auditor.question.domain import Domain


def dual(domain: Domain, value: torch.Tensor, gradient: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """F - g.z - s_D(-g): the linearisation's lower bound on min_D F_k, from F_k and its gradient at z."""
    return value - (gradient * z).sum(dim=1) - domain.support_rows(-gradient)


class Buffers:
    """Scratch tensors reused from one evaluation to the next: a fresh B x n tensor each time costs
    as much in page faults as an elementwise pass over it."""

    def __init__(self):
        self.held: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, int], dtype: torch.dtype, device, rows: int = 0) -> torch.Tensor:
        """A shape[0] x shape[1] view of the held tensor ``name``; a new one holds at least ``rows`` rows, so
        that a buffer for a varying subset of a batch is not allocated again each time the subset grows."""
        size = shape[0] * shape[1]
        held = self.held.get(name)
        if held is None or held.dtype != dtype or held.device != torch.device(device) or held.numel() < size:
            held = self.held[name] = torch.empty(max(shape[0], rows) * shape[1], dtype=dtype, device=device)
        return held[:size].view(shape)


def evaluate(weight: torch.Tensor, bias: torch.Tensor | None, k: torch.Tensor, z: torch.Tensor,
             gradient=True, buffers: Buffers | None = None):
    """F_k(z) and its gradient for a batch of tokens: logits and exponentials in ``weight``'s
    precision, sums, values and gradients in z's.

    ``gradient`` is True (for every row) or a function of the values giving a boolean mask of
    the rows that need it; rows left out get NaN. One pass of exponentials over the
    logits, in place."""
    buffers = buffers or Buffers()
    rows = torch.arange(len(k), device=z.device)
    shape = (len(k), weight.shape[0])
    # in the steering the logits and their exponentials stay in the products' precision (a
    # bfloat16 product is no more exact than that anyway), the sums go to z's
    logits = buffers.get("logits", shape, weight.dtype, z.device)
    torch.matmul(z.to(weight.dtype), weight.T, out=logits)
    if bias is not None:
        logits += bias[None, :].to(weight.dtype)
    own = logits[rows, k].to(z.dtype)
    logits[rows, k] = -torch.inf
    top = logits.amax(dim=1)  # values only: max(dim=1) would also find the indices, which nothing here needs
    terms = logits.sub_(top[:, None]).exp_()  # exp(l_i - max): each in (0, 1], the largest 1
    total = terms.sum(dim=1).to(z.dtype)  # steering only: bfloat16 rounding (2^-8) is harmless here; a dtype= would copy
    value = torch.log(total) + (top.to(z.dtype) - own)
    if gradient is True:
        need, chosen = rows, terms
    else:
        need = torch.nonzero(gradient(value)).flatten()
        chosen = terms if len(need) == len(k) else torch.index_select(
            terms, 0, need, out=buffers.get("chosen", (len(need), shape[1]), weight.dtype, z.device, len(k)))
    g = torch.full_like(z, torch.nan)
    if len(need):
        mix = (chosen @ weight).to(z.dtype) / total[need, None]
        g[need] = mix - weight[k[need]].to(z.dtype)
    return value, g


def probability(value: torch.Tensor) -> torch.Tensor:
    """p_k = 1 / (1 + exp(F_k)), as computed (no allowance)."""
    return torch.sigmoid(-value)


_SIGMOID_ROUNDING = 8 * UNIT_ROUNDOFF  # the sigmoid's own relative error, allowed for generously


def probability_below(value: torch.Tensor) -> torch.Tensor:
    """A probability at most 1 / (1 + exp(value)): near 1 the value's slack is below one unit of p. NaN gives 0."""
    p = torch.sigmoid(-value) * (1 - _SIGMOID_ROUNDING)
    return torch.where(torch.isnan(p), torch.zeros_like(p), p)


def probability_above(value: torch.Tensor) -> torch.Tensor:
    """A probability at least 1 / (1 + exp(value)), at most 1 (NaN stays NaN: no bound)."""
    return torch.clamp(torch.sigmoid(-value) * (1 + _SIGMOID_ROUNDING), max=1.0)


def steering_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 where matrix products in it are fast (CUDA with bfloat16, CPUs with AVX512-BF16 or AMX),
    else float32: the search's own precision, whose answers are all evaluated again in float64."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "cpu":
        probes = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
        try:
            if any(probe is not None and probe() for probe in probes):
                return torch.bfloat16
        except RuntimeError:
            pass
    return torch.float32


class Steering:
    """The head in the steering precision; values and bounds without any rounding allowance."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype):
        self.compute = torch.float32 if dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.float64
        self.biased = bias is not None
        if self.biased:
            # the bias as one more column, against a 1 appended to z: the product adds it (one pass over
            # the logits less); shifted by its largest value (which changes no softmax), so that a large
            # common offset does not cost the narrow precision its resolution
            weight = torch.cat([weight, (bias - bias.max())[:, None]], dim=1)
        self.weight = weight.to(dtype)
        self.buffers = Buffers()

    def evaluate(self, k, z, gradient=True):
        """F_k(z) and its gradient in the steering precision (see ``evaluate``)."""
        if not self.biased:
            return evaluate(self.weight, None, k, z, gradient=gradient, buffers=self.buffers)
        value, g = evaluate(self.weight, None, k, torch.cat([z, torch.ones_like(z[:, :1])], dim=1),
                            gradient=gradient, buffers=self.buffers)
        return value, g[:, :-1]
