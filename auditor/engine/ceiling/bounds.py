"""Certified bounds on a token's ceiling at a point: the rounding allowances, float64 and float32 certification.

At any point z of D, p_k(z) is a lower bound on max_D p_k and the linearisation (or, in float32,
Gibbs' inequality) gives an upper bound; both are widened here by stated bounds on the rounding
of the values, gradients and products they come from. The derivations: docs/method.md,
"Probability ceilings", certified bounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from auditor.engine.arithmetic.rounding import SMALLEST_NORMAL_32, UNIT_ROUNDOFF_32, gamma, ieee_float32_products, safe_norm
from auditor.engine.arithmetic.row_statistics import robust_row_norms
from auditor.engine.ceiling.objective import (Buffers, dual, evaluate, probability, probability_above,
                                              probability_below)

FLOAT32_REACH = 0.7  # tokens whose float32 allowance alone takes more of the gap go on in float64
_CHUNK = 256  # rivals per float32 sum: gamma_260 ~ 1.5e-5
_EXP_ROUNDING_32 = 8 * UNIT_ROUNDOFF_32  # float32 exp's relative error (1-2 units in practice), generously


class Scale:
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
        """A bound on |computed F_k(z) - exact F_k(z)|."""
        return self.logit_error(k, z) + self.summation * (1 + value.abs())

    def gradient_error(self, k: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """A bound on ||computed gradient - exact gradient||: the softmax weights are within a factor
        exp(2 e) of exact for logits within e, and each w_i - w_k within 2 row_error."""
        shift = torch.expm1(2 * self.logit_error(k, z))
        return (shift + self.summation) * 2 * self.max_norm + 2 * self.row_error


def certified_bounds(scale: Scale, domain, k, z, value, gradient, dual_value):
    """p_k at z, rounded down, and the upper bound from the linearisation at the point
    where ``dual_value`` = F - g.z - s_D(-g) was computed (``z``, ``value``, ``gradient`` there)."""
    lower = probability_below(value + scale.value_error(k, z, value))
    size = safe_norm(z, dim=1)
    # F(z') >= F(z) + g.(z' - z) - ||g - g~|| ||z' - z||, ||z' - z|| <= reach + ||z||; the products
    # g~.z and s_D(-g~) are float64 sums of d terms
    products = gamma(gradient.shape[1] + 2) * safe_norm(gradient, dim=1) * (size + scale.reach * math.sqrt(gradient.shape[1]))
    slack = scale.value_error(k, z, value) + scale.gradient_error(k, z) * (scale.reach + size) + products
    return lower, probability_above(dual_value - slack)


def float64_run(weight, bias, domain, gap, scale: Scale, buffers: Buffers | None = None):
    """Float64 evaluations for the search, with certified bounds at every point: ``run(k, z)`` gives F_k,
    its gradient (NaN where the lower bound is within ``gap`` of 1), the bounds, and no token stopped."""
    def run(k, z):
        value, gradient = evaluate(weight, bias, k, z, buffers=buffers,
                                   gradient=lambda v: ~(probability_below(v + scale.value_error(k, z, v)) >= 1 - gap))
        lower, upper = certified_bounds(scale, domain, k, z, value, gradient, dual(domain, value, gradient, z))
        return value, gradient, lower, upper, torch.zeros_like(upper, dtype=torch.bool)
    return run


def certify_float64(weight, bias, k, z, domain, gap, scale: Scale, buffers: Buffers | None = None):
    """One float64 evaluation at z: the certified bounds, with the gradient only where the lower
    bound is not already within ``gap`` of 1, and the points (numpy)."""
    lower, upper = float64_run(weight, bias, domain, gap, scale, buffers)(k, z)[2:4]
    upper = torch.where(torch.isnan(upper), torch.ones_like(upper), upper)  # no gradient: 1 is within the gap
    return lower.cpu().numpy(), upper.cpu().numpy(), z.cpu().numpy()


@dataclass
class Certified:
    """What one float32 certification at a batch of points gives."""

    value: torch.Tensor  # F_k from the computed logits (no allowance)
    gradient: torch.Tensor  # sum_i q_i w_i - w_k, NaN where the lower bound is within the gap of 1
    lower: torch.Tensor
    upper: torch.Tensor
    margin: torch.Tensor  # the certified lead of token k over every rival, -inf where it does not win
    runner_up: torch.Tensor
    floor: torch.Tensor  # how much of upper - lower is rounding allowance rather than distance to the optimum


class Float32Certifier:
    """Certified bounds at a point from float32 products: cheaper than float64's, and enough wherever
    p_k is near 0 or 1, which is most tokens (the bounds move p by p (1 - p) times their error in F_k).
    Tokens it leaves wider than the gap go on from its value and gradient (the search's float32
    evaluation), or in float64 where its own allowance takes most of the gap.

    The lower bound is p_k(z) with F_k raised by the logits' errors weighted by the computed softmax
    (times expm1(E)/E, E the largest: exp's chord); where token k's computed lead exceeds its own and the largest rival's error, z is a
    witness that k is the strict argmax; the upper bound is Gibbs' inequality at the computed softmax.
    The derivations and every allowance: docs/method.md, "Probability ceilings", float32."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, scale: Scale):
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
        self.underflow = n * SMALLEST_NORMAL_32  # exponentials below float32's normal range, all together
        self.subnormal = 2 * math.sqrt(d) * SMALLEST_NORMAL_32

    def _blocked_sum(self, x: torch.Tensor) -> torch.Tensor:
        # float32 sums of _CHUNK terms added up in float64: summing float32 straight into float64 is much slower
        return x.view(x.shape[0], -1, _CHUNK).sum(dim=2).to(torch.float64).sum(dim=1)

    def certify(self, k, z, domain, gap, buffers: Buffers) -> Certified:
        """The certified bounds at z (the upper bound only where the lower bound is not already within
        ``gap`` of 1, elsewhere 1), with what the search needs to go on from z."""
        with ieee_float32_products():
            return self._bounds(k, z, domain, gap, buffers)

    def evaluate(self, k, z, domain, gap, buffers: Buffers):
        """For the search: F_k at z from the computed logits, its gradient (NaN where the lower bound is
        within ``gap`` of 1), the certified bounds, and whether float32's own allowance keeps them wider
        than ``FLOAT32_REACH`` of the gap."""
        found = self.certify(k, z, domain, gap, buffers)
        return found.value, found.gradient, found.lower, found.upper, found.floor > FLOAT32_REACH * gap

    def _bounds(self, k, z, domain, gap, buffers: Buffers):
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
        inside = domain.contains_rows(z, safe_norm)
        margin = torch.where((margin > 0) & inside, margin, torch.full_like(margin, -torch.inf))
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
        lower = probability_below(value + self._logit_error(k, size, scale.max_norm, scale.max_bias) + rest)
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
            # the rivals' errors weighted by the softmax rather than the largest (docs/method.md): with
            # |x_i - x~_i| <= e_k + e_i, log sum q~_i exp(e_i) <= (sum q~_i e_i) expm1(E) / E, E = max e_i,
            # since exp lies below its chord on [0, E]
            own_bias = self.bias[k[need]].abs() if self.bias is not None else 0.0
            own_part = self.logit_factor * (scale.norms[k[need]] * size[need] + own_bias)
            widest = self.logit_factor * (scale.max_norm * size[need] + scale.max_bias)  # E
            mean_part = self.logit_factor * (norm_mass * size[need] + scale.max_bias)  # >= sum q~_i e_i
            chord = torch.clamp(torch.where(widest > 0, torch.expm1(widest) / widest.clamp(min=2.0**-1000),
                                            torch.ones_like(widest)), min=1.0) * (1 + 2.0**-48)  # and its rounding
            sharper = probability_below(value[need] + (own_part + mean_part * chord) * (1 + 2.0**-48) + rest[need])
            lower[need] = torch.maximum(lower[need], sharper)
            floor[need] = (probability(value[need]) - lower[need]) + (upper[need] - probability(bound))
        return Certified(value, gradient, lower, upper, margin, runner_up, floor)

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
        """An upper bound on max_D p_k from Gibbs' inequality at q = e / E (docs/method.md)."""
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
        support_value = domain.support_rows(-v)
        bound = entropy + bias_mean - support_value
        # ||v - exact v|| <= 3 gamma (sum_i q_i ||w_i||) + 2 row_error (the products, the rows' float32
        # rounding, the division by ``total``), paid over the domain's reach; the bias mean within
        # 3 gamma max |b| + 2 bias_error; float64's own roundings in the sums, the division, the
        # logarithm and s_D well inside the last term, with what underflowed
        slack = (scale.reach * (3 * self.sum_factor * norm_mass + 2 * scale.row_error)
                 + 3 * self.sum_factor * scale.max_bias + 2 * scale.bias_error
                 + self.underflow * (2 + scale.reach * (scale.max_norm + math.sqrt(self.d)) + scale.max_bias)
                 + self.subnormal * (scale.reach + 1)
                 + 1e-12 * (1 + bound.abs() + support_value + entropy.abs()))
        upper = probability_above(bound - slack)
        return torch.where(torch.isnan(upper), torch.ones_like(upper), upper), softmax_norm, v, bound
