"""The search's start for every token: the minimiser of a Gaussian model of its rivals.

Only a start: nothing it gives is trusted. The model and why it starts the search close to the
optimum: docs/method.md, "Probability ceilings", the start.
"""

from __future__ import annotations

import torch

from auditor.question.domain import Domain


class GaussianModel:
    """The rivals seen as a Gaussian cloud (weights softmax(b), mean m, covariance S of the rows):
    F_k(z) is about (m - w_k).z + z.S z / 2 + const, minimised over a ball by (S + lambda)^-1 (w_k - m)."""

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
        """The model's minimiser over the domain for tokens ``k`` (B x d; a box's is clipped by the caller)."""
        if not self.usable:
            return self.weight[k].clone()
        pull = (self.weight[k] - self.mean) @ self.axes  # w_k - m in the covariance's axes
        # over the ball through the domain's farthest points (a box's corners; the caller clips)
        radius = domain.reach(self.weight.shape[1])
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
        """A first step length for the search from the model's start: 1 / (4 lambda_max(S)), a step on the
        scale of the model's Hessian, where the safe default 1 / max ||w_i||^2 is far shorter on real heads.
        None where the model is unusable or flat."""
        if not self.usable:
            return None
        top = float(self.curvature.max())
        return 1.0 / (4 * top) if top > 1e-280 else None
