"""Probability ceilings: the largest softmax probability a token can reach in a bounded domain.

For token k, p_k(z) = 1 / (1 + exp(F_k(z))) with

    F_k(z) = log sum_{i != k} exp(l_i(z) - l_k(z)),

a log-sum-exp of affine functions: convex. So max_{z in D} p_k = 1 / (1 + exp(min_D F_k)),
a convex problem. Every point z of D gives a lower bound p_k(z). Convexity
gives an upper bound at every point too: F_k(z') >= F_k(z) + g.(z' - z) with
g = grad F_k(z), so min_D F_k >= F_k(z) - g.z - s_D(-g), s_D the support
function (the Frank-Wolfe gap). Both are widened by the rounding bounds of the
computed value and gradient.

The softmax over the rivals is dense on real heads (on the normalised MiniLM head
every one of the 30,524 rivals is within 20 of the leading logit at the best
point), so every evaluation costs two products with the whole head and n
exponentials per token. The search therefore runs in a fast steering precision
(bfloat16 products where the hardware has them, float32 otherwise; nothing it
computes is trusted), from the minimiser of a Gaussian model of the rivals, and
each token's best steering point is then certified once in float32 (the upper
bound from Gibbs' inequality, _Float32Certifier), or in float64 where float32
cannot hold the head; a token whose lower bound is already within the gap of 1
needs no gradient. Spectral projected gradient
(Barzilai-Borwein steps with a non-monotone acceptance test), batched over
tokens, drives the steering and then, every iterate certified, the tokens whose
bounds are still further apart than the gap: in float32 where its allowance leaves
room, then in float64; the few still open after that get
an interior-point solve (cvxpy, Clarabel) whose point is evaluated the same way.
Copies of row k count as rivals (each adds exp(0) = 1): a token tied with m - 1
others never passes 1/m.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from auditor.domain import Ball, Box, Domain
from auditor.engine.certify import inside_domain
from auditor.engine.head import robust_row_norms
from auditor.engine.rounding import UNIT_ROUNDOFF_32, gamma, ieee_float32_products, safe_norm

_BLOCK_BUDGET = 1 << 25  # float64 entries per token x vocabulary block


@dataclass
class Ceilings:
    lower: np.ndarray  # p_k at the best point found (a probability the token does reach)
    upper: np.ndarray  # a bound no point of the domain exceeds
    point: np.ndarray  # B x d: the points attaining ``lower``
    # Where the float32 certification also proved that token k's logit is the strict maximum at a point
    # (a witness of argmaxability, as the screen's): margin > 0, a lower bound on l_k - max_i l_i there
    # (-inf elsewhere), the rival closest to winning, and the point when the search went on past it.
    margin: np.ndarray
    runner_up: np.ndarray
    moved: dict[int, np.ndarray] = field(default_factory=dict)

    def witness(self, j: int) -> np.ndarray:
        """The point at which ``margin[j]`` was proved."""
        return self.moved.get(j, self.point[j])


def _project(domain: Domain, z: torch.Tensor) -> torch.Tensor:
    if isinstance(domain, Ball):  # onto a sphere a hair inside, so rounding cannot carry the point out
        norm = torch.linalg.vector_norm(z, dim=1, keepdim=True)
        return z * torch.clamp((1 - 1e-12) * domain.radius / torch.clamp(norm, min=1e-300), max=1.0)
    return z.clamp(-domain.radius, domain.radius)


def _support(domain: Domain, v: torch.Tensor) -> torch.Tensor:
    if isinstance(domain, Ball):
        return domain.radius * torch.linalg.vector_norm(v, dim=1)
    return domain.radius * v.abs().sum(dim=1)


class _Buffers:
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


def _evaluate(weight: torch.Tensor, bias: torch.Tensor | None, k: torch.Tensor, z: torch.Tensor,
              gradient=True, buffers: _Buffers | None = None):
    """F_k(z) and its gradient for a batch of tokens: logits and exponentials in ``weight``'s
    precision, sums, values and gradients in z's.

    ``gradient`` is True (for every row) or a function of the values giving a boolean mask of
    the rows that need it; rows left out get NaN. One pass of exponentials over the
    logits, in place."""
    buffers = buffers or _Buffers()
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
    top = logits.amax(dim=1)  # values only: four times faster than max(dim=1) here
    terms = logits.sub_(top[:, None]).exp_()  # exp(l_i - max): each in (0, 1], the largest 1
    total = terms.sum(dim=1).to(z.dtype)  # in the steering rounded to bfloat16 (2^-9, harmless); a dtype= would copy
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


def _probability(value: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(-value)


_SIGMOID_ROUNDING = 8 * 2.0**-53  # the sigmoid's own relative error, allowed for generously


def _probability_below(value: torch.Tensor) -> torch.Tensor:
    """A probability at most 1 / (1 + exp(value)): near 1 the value's slack is below one unit of p. NaN gives 0."""
    p = torch.sigmoid(-value) * (1 - _SIGMOID_ROUNDING)
    return torch.where(torch.isnan(p), torch.zeros_like(p), p)


def _probability_above(value: torch.Tensor) -> torch.Tensor:
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


def probability_ceilings(weight: torch.Tensor, bias: torch.Tensor | None, ids: np.ndarray, domain: Domain,
                         start: torch.Tensor | None = None, gap: float = 1e-4, iterations: int = 2000, progress=None,
                         row_error: float = 0.0, bias_error: float = 0.0,
                         steering: torch.dtype | None = None) -> Ceilings:
    """Bound max_{z in D} softmax_k(W z + b) for tokens ``ids`` to within ``gap``, starting from points ``start``
    (default: the minimiser of a Gaussian model of the rivals, ``_GaussianModel``).

    ``row_error`` / ``bias_error`` bound how far the rows and biases may be from
    exact ones (the norm domain's reduced head); they widen the bounds like rounding does.
    ``steering``: the search's precision (default: ``steering_dtype`` of the device).
    """
    if not isinstance(domain, (Ball, Box)):
        raise ValueError("probability ceilings need a bounded domain")
    count = len(ids)
    if weight.shape[0] == 1:  # no rival: the only token has probability 1 everywhere
        point = weight[torch.as_tensor(ids, device=weight.device)] if start is None else start
        return Ceilings(np.ones(count), np.ones(count), _project(domain, point.to(torch.float64)).cpu().numpy(),
                        np.full(count, -np.inf), np.full(count, -1, dtype=np.int64))
    weight = weight.to(torch.float64)
    bias = bias.to(torch.float64) if bias is not None else None
    lower = np.zeros(count)
    upper = np.ones(count)
    point = np.zeros((count, weight.shape[1]))
    margin = np.full(count, -np.inf)
    runner_up = np.full(count, -1, dtype=np.int64)
    moved: dict[int, np.ndarray] = {}
    beyond = np.zeros(count, dtype=bool)  # float32's allowance alone too wide for the gap
    first: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # F_k and its gradient where float32 certified
    batch = max(1, min(512, _BLOCK_BUDGET // max(weight.shape[0], 1)))
    scale = _Scale(weight, bias, row_error, bias_error, domain)
    # a point or logits past float32's range: the steering too in float64
    fast = _Steering(weight, bias, steering or (steering_dtype(weight.device) if _fits_float32(scale) else torch.float64))
    model = _GaussianModel(weight, bias) if start is None else None
    first_step = model.first_step() if model is not None else None
    exact = _Buffers()  # the float64 evaluations' scratch
    # float32 certification where rows, points and logits stay far from its range's ends (its
    # products are kept IEEE ones by ``ieee_float32_products`` around every use)
    single = _Float32Certifier(weight, bias, scale) if _fits_float32(scale) else None
    # the steering in larger batches than the certification: its searches leave fewer tokens active at
    # each step, and products of a few hundred rows run well below the full batch's rate
    steering_batch = batch * max(1, min(2, _BLOCK_BUDGET // max(weight.shape[0] * batch, 1)))
    for s in range(0, count, steering_batch):
        block = slice(s, min(s + steering_batch, count))
        k = torch.as_tensor(ids[block], device=weight.device)
        z = model.start(k, domain) if model is not None else start[block].to(torch.float64)
        z = _project(domain, z)
        z = _spg(_steering_run(fast.evaluate, domain, gap * _STEERING_GAP), k, z.to(fast.compute), domain,
                 gap * _STEERING_GAP, _STEERING_ITERATIONS, scale.max_norm, first_step)[2]
        steered = _project(domain, z.to(torch.float64))
        for t in range(block.start, block.stop, batch):
            part = slice(t, min(t + batch, block.stop))
            k = torch.as_tensor(ids[part], device=weight.device)
            z = steered[part.start - block.start:part.stop - block.start]
            if single is not None:
                found = single.certify(k, z, domain, gap, exact)
                lower[part], upper[part] = found.lower.cpu().numpy(), found.upper.cpu().numpy()
                point[part] = z.cpu().numpy()
                margin[part], runner_up[part] = found.margin.cpu().numpy(), found.runner_up.cpu().numpy()
                beyond[part] = (found.floor > _FLOAT32_REACH * gap).cpu().numpy()
                for j in np.nonzero((upper[part] - lower[part] > gap) & ~beyond[part])[0].tolist():
                    first[part.start + j] = (found.value[j], found.gradient[j])  # the float32 search starts here
            else:
                lower[part], upper[part], point[part] = _certify(weight, bias, k, z, domain, gap, scale, exact)
            if progress is not None:
                progress.update(part.stop - part.start)

    def go_on(left: np.ndarray, run, limit: int, known: bool = False) -> None:
        """On from the tokens' best points with every iterate certified, in full batches; ``known``: from
        the float32 certification's value and gradient there rather than a first evaluation."""
        for s in range(0, left.size, batch):
            part = left[s:s + batch]
            k = torch.as_tensor(ids[part], device=weight.device)
            z = torch.as_tensor(point[part], device=weight.device)
            start = None
            if known:
                value = torch.stack([first[j][0] for j in part.tolist()])
                start = (value, torch.stack([first[j][1] for j in part.tolist()]), torch.as_tensor(lower[part]),
                         torch.as_tensor(upper[part]), torch.zeros_like(value, dtype=torch.bool))
            lo, up, zz = (t.cpu().numpy() for t in _spg(run, k, z, domain, gap, limit, scale.max_norm, first_step,
                                                          start))
            better = lo > lower[part]
            lower[part] = np.maximum(lo, lower[part])
            upper[part] = np.minimum(up, upper[part])
            for j in part[better & (margin[part] > 0)].tolist():  # the witness stays where it was proved
                moved.setdefault(j, point[j].copy())
            point[part[better]] = zz[better]

    # where the steering's point is not close enough: on in float32 where its allowance leaves room
    # (the steering's bfloat16 estimates cannot resolve the last 1e-4 of p in mid-range), then in
    # float64 for what is still open
    if single is not None:
        go_on(np.nonzero((upper - lower > gap) & ~beyond)[0],
              lambda kk, zz: single.evaluate(kk, zz, domain, gap, exact), _FLOAT32_ITERATIONS, known=True)
        first.clear()
    go_on(np.nonzero(upper - lower > gap)[0], _float64_run(weight, bias, domain, gap, scale, exact), iterations)
    wide = np.nonzero(upper - lower > gap)[0][:_EXACT_LIMIT]
    for j in wide.tolist():  # the few that first-order steps leave open: an interior-point solve
        z = _cvxpy_point(weight, bias, int(ids[j]), domain)
        if z is not None:
            k = torch.as_tensor(ids[j:j + 1], device=weight.device)
            lo, up, zz = _solve_batch(weight, bias, k, _project(domain, z[None, :]), domain, gap, 50, scale)
            if lo[0] > lower[j]:  # the point stays with the bound reached at it
                if margin[j] > 0:  # the witness stays where it was proved
                    moved.setdefault(j, point[j].copy())
                lower[j], point[j] = lo[0], zz[0]
            upper[j] = min(up[0], upper[j])
    return Ceilings(lower, upper, point, margin, runner_up, moved)


_EXACT_LIMIT = 64
_FLOAT32_ITERATIONS = 20
_STEERING_ITERATIONS = 12
_STEERING_GAP = 0.5  # of the gap: the steering's estimates are not certified, so it aims closer


class _GaussianModel:
    """A start for every token: the rivals seen as a Gaussian cloud.

    With weights pi_i proportional to exp(b_i), mean m and covariance S of the rows,
    log sum_i exp(w_i.z + b_i) is about const + m.z + z.S z / 2 (exact for a Gaussian
    cloud), so F_k(z) is about (m - w_k).z + z.S z / 2 + const, whose minimiser over a
    ball is (S + lambda)^-1 (w_k - m), lambda >= 0 the smallest that puts it in the ball.
    On the MiniLM head in the norm domain this start has median p_k 0.9996, where the
    token's own row scaled onto the sphere has 1e-4; the steering then needs a third fewer
    evaluations. Only a start: nothing it gives is trusted."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        pi = torch.softmax(bias, dim=0) if bias is not None else torch.full_like(weight[:, 0], 1.0 / weight.shape[0])
        self.weight = weight
        self.mean = pi @ weight
        covariance = torch.zeros(weight.shape[1], weight.shape[1], dtype=weight.dtype, device=weight.device)
        for s in range(0, weight.shape[0], 4096):  # in blocks: no centred copy of the whole head
            centred = weight[s:s + 4096] - self.mean
            covariance += (centred * pi[s:s + 4096, None]).T @ centred
        self.usable = bool(torch.isfinite(covariance).all()) and bool(torch.isfinite(self.mean).all())
        if not self.usable:  # rows past float64's range squared: the token's own row is the start
            return
        self.curvature, self.axes = torch.linalg.eigh(covariance)
        self.curvature.clamp_(min=0.0)

    def start(self, k: torch.Tensor, domain: Domain) -> torch.Tensor:
        if not self.usable:
            return self.weight[k].clone()
        pull = (self.weight[k] - self.mean) @ self.axes  # w_k - m in the covariance's axes
        # a box is started from the ball through its corners, then clipped
        radius = domain.radius if isinstance(domain, Ball) else domain.reach(self.weight.shape[1])
        size = torch.linalg.vector_norm(pull, dim=1)
        inside = torch.zeros_like(size)
        outside = size / radius  # lambda here gives ||(S + lambda)^-1 pull|| <= ||pull|| / lambda = radius
        for _ in range(36):  # bisection on ||(S + lambda)^-1 pull|| = radius, to 2^-36 of the bracket: a start
            middle = (inside + outside) / 2
            beyond = torch.linalg.vector_norm(pull / (self.curvature + middle[:, None]), dim=1) > radius
            inside = torch.where(beyond, middle, inside)
            outside = torch.where(beyond, outside, middle)
        return torch.nan_to_num(pull / (self.curvature + outside[:, None]), nan=0.0) @ self.axes.T

    def first_step(self) -> float | None:
        """A first step length for the search from the model's start: 1 / (4 lambda_max(S)), the model's
        Hessian. On the MiniLM head this takes the steering from 3.4 to 2.5 evaluations per token
        (1 / max ||w_i||^2, the safe default, is a tenth of it there)."""
        if not self.usable:
            return None
        top = float(self.curvature.max())
        return 1.0 / (4 * top) if top > 1e-280 else None


class _Steering:
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
        self.buffers = _Buffers()

    def evaluate(self, k, z, gradient=True):
        if not self.biased:
            return _evaluate(self.weight, None, k, z, gradient=gradient, buffers=self.buffers)
        value, g = _evaluate(self.weight, None, k, torch.cat([z, torch.ones_like(z[:, :1])], dim=1),
                             gradient=gradient, buffers=self.buffers)
        return value, g[:, :-1]


class _Scale:
    """Rounding bounds of a computed F_k(z) and of its gradient, in float64.

    Every logit is within f (||w_i|| ||z|| + |b_i|) of exact (plus the rows' and biases'
    own error when they are derived); the sum of n exponentials, its logarithm and the
    products with the softmax weights add relative errors of about n units of roundoff."""

    def __init__(self, weight, bias, row_error, bias_error, domain):
        n, d = weight.shape
        self.factor = 2.0 * gamma(d + 4)
        self.norms = robust_row_norms(weight)  # an underflowed norm would shrink the bound
        self.max_norm = float(self.norms.max())
        self.max_bias = float(bias.abs().max()) if bias is not None else 0.0
        self.row_error = row_error
        self.bias_error = bias_error
        self.summation = gamma(n + 8)  # exponentials (a few units each), their sum and its logarithm
        self.reach = domain.reach(d)

    def logit_error(self, k: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """A bound on |computed l_i - l_k - exact l_i - l_k| for every i."""
        size = safe_norm(z, dim=1)
        spread = (self.norms[k] + self.max_norm) * size + 2 * self.max_bias
        return self.factor * spread + 2 * (self.row_error * size + self.bias_error) + 1e-300

    def value_error(self, k: torch.Tensor, z: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        return self.logit_error(k, z) + self.summation * (1 + value.abs())

    def gradient_error(self, k: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """A bound on ||computed gradient - exact gradient||: the softmax weights are within a factor
        exp(2 e) of exact for logits within e, and each w_i - w_k within 2 row_error."""
        shift = torch.expm1(2 * self.logit_error(k, z))
        return (shift + self.summation) * 2 * self.max_norm + 2 * self.row_error


def _certified_bounds(scale: _Scale, domain, k, z, value, gradient, dual_value):
    """p_k at z, rounded down, and the upper bound from the linearisation at the point
    where ``dual_value`` = F - g.z - s_D(-g) was computed (``z``, ``value``, ``gradient`` there)."""
    lower = _probability_below(value + scale.value_error(k, z, value))
    size = safe_norm(z, dim=1)
    # F(z') >= F(z) + g.(z' - z) - ||g - g~|| ||z' - z||, ||z' - z|| <= reach + ||z||; the products
    # g~.z and s_D(-g~) are float64 sums of d terms
    products = gamma(gradient.shape[1] + 2) * safe_norm(gradient, dim=1) * (size + scale.reach * math.sqrt(gradient.shape[1]))
    slack = scale.value_error(k, z, value) + scale.gradient_error(k, z) * (scale.reach + size) + products
    return lower, _probability_above(dual_value - slack)


def _dual(domain, value, gradient, z):
    return value - (gradient * z).sum(dim=1) - _support(domain, -gradient)


def _certify(weight, bias, k, z, domain, gap, scale: _Scale, buffers: _Buffers | None = None):
    """One float64 evaluation at z: the certified bounds, with the gradient only where the lower
    bound is not already within ``gap`` of 1."""
    lower, upper = _float64_run(weight, bias, domain, gap, scale, buffers)(k, z)[2:4]
    upper = torch.where(torch.isnan(upper), torch.ones_like(upper), upper)  # no gradient: 1 is within the gap
    return lower.cpu().numpy(), upper.cpu().numpy(), z.cpu().numpy()


def _fits_float32(scale: "_Scale") -> bool:
    """Rows, points and logits well inside float32's normal range (2^-126 .. 2^128)."""
    return (2.0**-60 < scale.max_norm < 2.0**60 and 2.0**-60 < scale.reach < 2.0**60
            and scale.max_norm * scale.reach + scale.max_bias < 2.0**60)


class _Float32Certifier:
    """Certified bounds at a point from float32 products: half of float64's cost here or less, and enough
    wherever p_k is near 0 or 1, which is most tokens (the bounds move p by p (1 - p) times their
    error in F_k). Tokens it leaves wider than the gap go on from its value and gradient (the
    search's float32 evaluation), or in float64 where its own allowance takes most of the gap.

    Each computed logit (the product of [z, 1] with [w_i, b_i], all rounded to float32) is within
    e_i = gamma_{d+8} (||w_i|| ||z|| + |b_i|) of exact: the inputs' rounding, d products, the bias.
    The lower bound is p_k(z) with F_k raised by e_k + sum_i q~_i e_i (Jensen: log sum exp(x_i) <=
    log sum exp(x~_i) + sum_i q~_i |x_i - x~_i|, q~ the softmax of the computed logits), plus
    u |x~_i - top| for the shift by the largest rival's logit: first with the largest row norm and
    bias for the rivals, then, where that leaves p_k short of the gap to 1, with the softmax mean of
    the row norms that the upper bound's products give. Where the computed lead of k over every
    rival exceeds e_k + max_i e_i, k is the strict argmax at z: a witness. The upper bound is Gibbs'
    inequality, log sum_i exp(x_i) >= sum_i q_i x_i + H(q) for every distribution q over the
    rivals, taken at the softmax q of the computed logits and minimised over the domain:

        min_D F_k >= H(q) + sum_i q_i (b_i - b_k) - s_D(-(sum_i q_i w_i - w_k)).

    It holds for whatever q is used, however far the computed logits are from exact: the
    rounding that matters is only that of evaluating the right side for that q. With y_i the
    stored shifted logits and e_i = fl(exp y_i) = exp(y_i) (1 + d_i), q_i = e_i / E gives
    H(q) = log E - sum_i q_i log e_i >= log E - sum_i q_i y_i - max |log(1 + d_i)|, and the
    products sum_i e_i [w_i, b_i, ||w_i||] are float32 sums of _CHUNK terms at a time (each within
    gamma_{_CHUNK+4} of sum_i e_i |.|), added up in float64. Sums of exponentials are float32 sums
    of _CHUNK terms too (all terms of one sign: relative error gamma), added up in float64:
    float32 tensors summed into float64 directly cost thirty times more here."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, scale: "_Scale"):
        n, d = weight.shape
        self.n, self.d = n, d
        self.padded = -(-n // _CHUNK) * _CHUNK  # rival blocks of _CHUNK; the padding rows' exponentials are 0
        device = weight.device
        self.weight = weight  # float64: w_k for the gradient
        self.bias = bias
        # the rows, the biases and the rows' norms: the logits are [z, 1, 0] against them (the product
        # adds the bias: one pass over the logits less), and sum_i e_i [w_i, b_i, ||w_i||] goes into
        # the Gibbs bound; the padding rows' bias -1e30 puts their exponentials at 0
        self.stacked = torch.zeros(self.padded, d + 2, dtype=torch.float32, device=device)
        self.stacked[:n, :d] = weight
        self.stacked[:n, d] = bias if bias is not None else 0.0
        self.stacked[n:, d] = -1e30
        self.stacked[:n, d + 1] = scale.norms * (1 + 2.0**-20)  # rounded up: they bound a rounding error
        self.scale = scale
        self.logit_factor = gamma(d + 8, UNIT_ROUNDOFF_32)  # one logit: inputs, d products, the bias
        self.shift_factor = 3 * UNIT_ROUNDOFF_32  # y_i = fl(l_i - top): u |l_i - top| <= 2 u (max |l|)
        self.sum_factor = gamma(_CHUNK + 4, UNIT_ROUNDOFF_32)  # a float32 sum of _CHUNK terms, and its products
        self.exp_error = -math.log1p(-_EXP_ROUNDING_32)
        self.underflow = n * 2.0**-126  # exponentials below float32's normal range, all together
        self.subnormal = 2 * math.sqrt(d) * 2.0**-126

    def _blocked_sum(self, x: torch.Tensor) -> torch.Tensor:
        return x.view(x.shape[0], -1, _CHUNK).sum(dim=2).to(torch.float64).sum(dim=1)

    def certify(self, k, z, domain, gap, buffers: "_Buffers") -> "_Certified":
        """The certified bounds at z (the upper bound only where the lower bound is not already within
        ``gap`` of 1, elsewhere 1), with what the search needs to go on from z."""
        with ieee_float32_products():
            return self._bounds(k, z, domain, gap, buffers)

    def evaluate(self, k, z, domain, gap, buffers: "_Buffers"):
        """For the search: F_k at z from the computed logits, its gradient (NaN where the lower bound is
        within ``gap`` of 1), the certified bounds, and whether float32's own allowance keeps them wider
        than ``_FLOAT32_REACH`` of the gap."""
        found = self.certify(k, z, domain, gap, buffers)
        return found.value, found.gradient, found.lower, found.upper, found.floor > _FLOAT32_REACH * gap

    def _bounds(self, k, z, domain, gap, buffers: "_Buffers"):
        rows = torch.arange(len(k), device=z.device)
        shape = (len(k), self.padded)
        logits = buffers.get("logits32", shape, torch.float32, z.device)
        augmented = torch.zeros(len(k), self.d + 2, dtype=torch.float32, device=z.device)
        augmented[:, :self.d] = z
        augmented[:, self.d] = 1.0
        torch.matmul(augmented, self.stacked.T, out=logits)
        own = logits[rows, k].to(torch.float64)
        logits[rows, k] = -torch.inf
        top, runner_up = logits.max(dim=1)
        scale = self.scale
        size = safe_norm(z, dim=1)
        # token k wins at z where its computed lead over the top rival is more than both logits' errors
        # (a float64 difference of float32 numbers: exact but for a far-apart pair's last bit)
        lead = (own - top.to(torch.float64)) * (1 - 2.0**-50)
        margin = lead - self._logit_error(k, size, scale.max_norm, scale.max_bias) - self._common_error(size, shift=False)
        margin = torch.where((margin > 0) & inside_domain(domain, z), margin, torch.full_like(margin, -torch.inf))
        y = logits.sub_(top[:, None])  # y_i <= 0, the largest 0
        e = torch.exp(y, out=buffers.get("terms32", shape, torch.float32, z.device))  # 0 at k
        y[rows, k] = 0.0  # so that e_k y_k = 0
        total = self._blocked_sum(e)  # E >= 1: the largest rival has y = 0
        log_total = torch.log(total)
        value = top.to(torch.float64) - own + log_total  # F_k at z from the computed logits
        # F_k(z) <= value + errors: the logits; exp's rounding (sum e^y <= E / (1 - d), plus what
        # underflowed to 0 or a subnormal: under 2^-126 each); E's sums
        rest = (self.exp_error + self.underflow + 2 * self.sum_factor + scale.summation * (1 + value.abs())
                + self._common_error(size))
        lower = _probability_below(value + self._logit_error(k, size, scale.max_norm, scale.max_bias) + rest)
        upper = torch.ones_like(lower)
        gradient = torch.full_like(z, torch.nan)
        floor = torch.zeros_like(lower)  # the part of upper - lower that is rounding allowance
        need = torch.nonzero(~(lower >= 1 - gap)).flatten()  # the rest: 1 is within the gap of lower
        if len(need):
            if len(need) < len(k):  # into held buffers: fresh tensors this size cost their page faults
                part = (len(need), self.padded)
                y = torch.index_select(y, 0, need, out=buffers.get("y32", part, torch.float32, z.device, len(k)))
                e = torch.index_select(e, 0, need, out=buffers.get("e32", part, torch.float32, z.device, len(k)))
            upper[need], norm_mass, gradient[need], bound = self._gibbs_bound(k[need], y, e, total[need], domain)
            # the rivals' errors weighted by the softmax (Jensen, in the class's text) rather than the largest
            sharper = _probability_below(value[need] + self._logit_error(k[need], size[need], norm_mass, scale.max_bias)
                                         + rest[need])
            lower[need] = torch.maximum(lower[need], sharper)
            floor[need] = (_probability(value[need]) - lower[need]) + (upper[need] - _probability(bound))
        return _Certified(value, gradient, lower, upper, margin, runner_up, floor)

    def _logit_error(self, k, size, rival_norm, rival_bias):
        """Allowance for the logits' rounding in F_k: |e_k| + sum_i q_i |e_i| with the rivals' row norms and
        biases bounded by ``rival_norm`` and ``rival_bias`` (their largest, or their softmax means)."""
        scale = self.scale
        own_bias = self.bias[k].abs() if self.bias is not None else 0.0
        return self.logit_factor * ((scale.norms[k] + rival_norm) * size + own_bias + rival_bias)

    def _common_error(self, size, shift: bool = True):
        """The terms of the logits' allowance that every token pays alike: the shift by the top logit
        (where the logits were shifted), the rows' and biases' own error, and what is below float32's
        normal range (entries of the rows or the point are off by up to 2^-126 each there, not by a
        relative u, and so is every product that underflows)."""
        scale = self.scale
        return (self.shift_factor * (scale.max_norm * size + scale.max_bias) * shift
                + 2 * (scale.row_error * size + scale.bias_error)
                + self.subnormal * (scale.max_norm + size + self.d + 8))

    def _gibbs_bound(self, k, y, e, total, domain):
        """An upper bound on max_D p_k from Gibbs' inequality at q = e / E (see the class's text)."""
        d = self.d
        # sum_i e_i y_i: every term <= 0, so a float32 block sum is within gamma of it, the products within u
        entropy_part = self._blocked_sum(torch.mul(e, y, out=y)).neg_()  # -sum e_i y_i >= 0
        mixed = torch.zeros(len(k), d + 2, dtype=torch.float64, device=e.device)
        for s in range(0, self.padded, _CHUNK):
            mixed += (e[:, s:s + _CHUNK] @ self.stacked[s:s + _CHUNK]).to(torch.float64)
        scale = self.scale
        v = mixed[:, :d] / total[:, None] - self.weight[k]  # sum_i q_i w_i - w_k
        bias_mean = mixed[:, d] / total - (self.bias[k] if self.bias is not None else 0.0)
        norm_mass = mixed[:, d + 1] * (1 + 3 * self.sum_factor) / total  # >= sum_i (e_i / E) ||w_i||
        # >= sum_i q~_i ||w_i||, q~ the exact softmax of the stored y: e_i within exp's rounding of
        # exp(y_i) or, where it underflowed, within 2^-126; E >= 1 (the top rival's e is 1)
        softmax_norm = ((mixed[:, d + 1] * (1 + 3 * self.sum_factor) + self.underflow * scale.max_norm)
                        / (total * (1 - 2 * self.sum_factor) - self.underflow) * (1 + 3 * _EXP_ROUNDING_32))
        softmax_norm = torch.clamp(softmax_norm, max=scale.max_norm)
        # E = sum_i e_i is within gamma of ``total``, so dividing by ``total`` moves each mean by
        # gamma of its size more; -sum_i e_i y_i within gamma (the products within u)
        entropy = (torch.log(total) - 2 * self.sum_factor + entropy_part * (1 - 3 * self.sum_factor) / total
                   - self.exp_error)
        support = _support(domain, -v)
        bound = entropy + bias_mean - support
        # ||v - exact v|| <= 3 gamma (sum_i q_i ||w_i||) + 2 row_error (the products, the rows' float32
        # rounding, the division by ``total``), paid over the domain's reach; the bias mean within
        # 3 gamma max |b| + 2 bias_error; float64's own roundings in the sums, the division, the
        # logarithm and s_D well inside the last term, with what underflowed
        slack = (scale.reach * (3 * self.sum_factor * norm_mass + 2 * scale.row_error)
                 + 3 * self.sum_factor * scale.max_bias + 2 * scale.bias_error
                 + self.underflow * (2 + scale.reach * (scale.max_norm + math.sqrt(self.d)) + scale.max_bias)
                 + self.subnormal * (scale.reach + 1)
                 + 1e-12 * (1 + bound.abs() + support + entropy.abs()))
        upper = _probability_above(bound - slack)
        return torch.where(torch.isnan(upper), torch.ones_like(upper), upper), softmax_norm, v, bound


@dataclass
class _Certified:
    """What one float32 certification at a batch of points gives."""

    value: torch.Tensor  # F_k from the computed logits (no allowance)
    gradient: torch.Tensor  # sum_i q_i w_i - w_k, NaN where the lower bound is within the gap of 1
    lower: torch.Tensor
    upper: torch.Tensor
    margin: torch.Tensor  # the certified lead of token k over every rival, -inf where it does not win
    runner_up: torch.Tensor
    floor: torch.Tensor  # how much of upper - lower is rounding allowance rather than distance to the optimum


_CHUNK = 256  # rivals per float32 sum: gamma_260 ~ 1.5e-5
_FLOAT32_REACH = 0.7  # tokens whose float32 allowance alone takes more of the gap go on in float64
_EXP_ROUNDING_32 = 8 * UNIT_ROUNDOFF_32  # float32 exp's relative error (1-2 units in practice), generously


def _cvxpy_point(weight, bias, k: int, domain) -> torch.Tensor | None:
    import cvxpy as cp

    W = weight.cpu().numpy()
    b = bias.cpu().numpy() if bias is not None else np.zeros(W.shape[0])
    rivals = np.arange(W.shape[0]) != k
    z = cp.Variable(W.shape[1])
    limit = cp.norm(z, 2) <= domain.radius if isinstance(domain, Ball) else cp.abs(z) <= domain.radius
    problem = cp.Problem(cp.Minimize(cp.log_sum_exp((W[rivals] - W[k]) @ z + (b[rivals] - b[k]))), [limit])
    try:
        problem.solve(solver=cp.CLARABEL)
    except (cp.error.SolverError, ValueError, ArithmeticError):
        return None
    if z.value is None:
        return None
    return torch.as_tensor(np.asarray(z.value, dtype=np.float64), device=weight.device)


def _steering_run(evaluate, domain, gap):
    """The steering's evaluations for _spg: plain estimates, nothing certified."""
    def run(k, z):
        value, gradient = evaluate(k, z, lambda v: ~(_probability(v) >= 1 - gap))
        upper = torch.clamp(_probability(_dual(domain, value, gradient, z)), max=1.0)
        return value, gradient, _probability(value), upper, torch.zeros_like(upper, dtype=torch.bool)
    return run


def _float64_run(weight, bias, domain, gap, scale: _Scale, buffers: _Buffers | None = None):
    """Float64 evaluations for _spg, with certified bounds at every point."""
    def run(k, z):
        value, gradient = _evaluate(weight, bias, k, z, buffers=buffers,
                                    gradient=lambda v: ~(_probability_below(v + scale.value_error(k, z, v)) >= 1 - gap))
        lower, upper = _certified_bounds(scale, domain, k, z, value, gradient, _dual(domain, value, gradient, z))
        return value, gradient, lower, upper, torch.zeros_like(upper, dtype=torch.bool)
    return run


def _solve_batch(weight, bias, k, z, domain, gap, iterations, scale: _Scale, buffers: _Buffers | None = None):
    """Float64 spectral projected gradient with certified bounds at every point it evaluates."""
    lower, upper, best_z = _spg(_float64_run(weight, bias, domain, gap, scale, buffers), k, z, domain, gap, iterations,
                                scale.max_norm)
    return lower.cpu().numpy(), upper.cpu().numpy(), best_z.cpu().numpy()


def _spg(evaluate, k, z, domain, gap, iterations, max_norm, first_step: float | None = None, start=None):
    """Spectral projected gradient (Barzilai-Borwein steps, non-monotone acceptance) on F_k, batched.

    ``evaluate(k, z)`` gives F_k, its gradient, lower and upper bounds on max p_k (certified or
    estimates, as the caller's precision allows) and a mask of the tokens whose search should end
    however wide their bounds (float32's allowance). Returns the best bounds seen and the point
    of the lower one. A point whose lower bound is already within ``gap`` of 1 ends its token's
    search, so its gradient is not needed (NaN). ``start``: what ``evaluate(k, z)`` would give, when
    it is known already."""
    value, gradient, best_lower, best_upper, stuck = start if start is not None else evaluate(k, z)
    best_upper = torch.where(torch.isfinite(best_upper), best_upper, torch.ones_like(best_upper))
    best_z = z.clone()
    step = torch.full_like(value, min(first_step or 1.0 / max(max_norm, 1e-150) ** 2, torch.finfo(z.dtype).max ** 0.5))
    recent = value[:, None].repeat(1, _MEMORY)  # the last values, for the non-monotone test
    for _ in range(iterations):
        active = (best_upper - best_lower > gap) & ~stuck
        if not bool(active.any()):
            break
        idx = torch.nonzero(active).flatten()
        zi = _project(domain, z[idx] - step[idx, None] * gradient[idx])
        vi, gi, li, ui, si = evaluate(k[idx], zi)
        # sufficient decrease against the worst recent value, 1e-4 of the first-order decrease: no
        # step length in it, so that the test does not change when the head or the domain is rescaled
        accept = vi <= recent[idx].max(dim=1).values - 1e-4 * (gradient[idx] * (z[idx] - zi)).sum(dim=1).abs()
        accept &= torch.isfinite(vi)
        dz, dg = zi - z[idx], gi - gradient[idx]
        curvature = (dz * dg).sum(dim=1)
        bb = (dz * dz).sum(dim=1) / torch.clamp(curvature, min=1e-300)
        spectral = torch.where((curvature > 0) & torch.isfinite(bb), bb, step[idx] * 4)
        step[idx] = torch.where(accept, spectral, step[idx] * 0.25)  # refused: the same point, a shorter step
        moved = idx[accept]
        z[moved], gradient[moved] = zi[accept], gi[accept]
        recent[moved] = torch.cat([recent[moved, 1:], vi[accept, None]], dim=1)
        stuck[idx] |= si
        better = li > best_lower[idx]
        best_lower[idx[better]] = li[better]
        best_z[idx[better]] = zi[better]
        best_upper[idx] = torch.minimum(best_upper[idx], torch.where(torch.isfinite(ui), ui, best_upper[idx]))
    return best_lower, best_upper, best_z


_MEMORY = 10
