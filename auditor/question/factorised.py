"""Factorised heads W = U V: audited exactly as the head U in the inner dimension.

With U (n x r) and V (r x d) the logits are U (V z) + b. When V has full row
rank (rank r <= d), z -> V z maps R^d onto R^r, so a token wins somewhere in
R^d iff it wins somewhere in R^r for the head U with the same bias: every
verdict of W is the verdict of U, with no product formed. A convex certificate
over U (sum alpha_i u_i = u_k) is one over W too (multiply by V); a witness y
in R^r stands for every z with V z = y. In a bounded domain the ball or box
maps to an ellipsoid or a zonotope, not to a ball or box, so there the inner
head is not equivalent and the product must be audited as it is.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from auditor.errors import InputError
from auditor.util.input import as_tensor, first_bad_rows

NOTE = "decided on U in R^r; V has full row rank, so verdicts of U V are those of U; witnesses are points of R^r"


@dataclass(frozen=True)
class Factorisation:
    """What the report says about a factorised head: the inner dimension r, the hidden size d, V's
    extreme singular values (float64), on which its full row rank was decided."""

    inner_dimension: int
    hidden_size: int
    smallest_singular_value: float
    largest_singular_value: float

    def to_dict(self) -> dict:
        return {"inner_dimension": self.inner_dimension, "hidden_size": self.hidden_size,
                "smallest_singular_value": self.smallest_singular_value,
                "largest_singular_value": self.largest_singular_value, "note": NOTE}


def is_factor_pair(weight) -> bool:
    """Whether ``weight`` is given as the pair (U, V) rather than as one matrix."""
    return isinstance(weight, tuple)


def split_factors(pair, domain) -> tuple[torch.Tensor, Factorisation]:
    """Check (U, V) and return (U as a tensor, the Factorisation to report).

    Raises InputError when the pair is not two matrices of shapes n x r and r x d with
    r <= d, when V has NaN or Inf entries or is rank deficient (decided by a float64
    SVD: smallest singular value > max(r, d) * eps * largest), or when the domain is
    bounded. U itself is checked later, like any head.
    """
    if len(pair) != 2:
        raise InputError(f"a factorised head is a pair (U, V) with W = U @ V, got a tuple of {len(pair)}")
    u, v = as_tensor(pair[0], "the factor U"), as_tensor(pair[1], "the factor V")
    if u.ndim != 2 or v.ndim != 2:
        raise InputError(f"the factors of W = U @ V must be matrices, got shapes {tuple(u.shape)} and {tuple(v.shape)}")
    (n, r), (r_v, d) = u.shape, v.shape
    if r != r_v:
        raise InputError(f"the factors do not multiply: U is {n} x {r} but V is {r_v} x {d} "
                         "(V must have as many rows as U has columns)")
    if r == 0 or d == 0:
        raise InputError(f"the factor V is empty ({r} x {d}); there is nothing to audit")
    if r > d:
        raise InputError(f"V is {r} x {d}: its inner dimension r = {r} exceeds the hidden size d = {d}, so it cannot "
                         "have full row rank; pass the product U @ V itself")
    if domain.bounded or domain.orthant:
        raise InputError(f"a factorised head can be audited as its inner head U only in the unbounded domain, not "
                         f"{domain} (V maps any other domain to another shape: a ball to an ellipsoid, the orthant "
                         "to a cone); pass the product U @ V itself")
    v64 = v.detach().to(device="cpu", dtype=torch.float64)
    finite = torch.isfinite(v64).all(dim=1)
    if not bool(finite.all()):
        raise InputError(f"the factor V has NaN or Inf entries in rows {first_bad_rows(finite)}")
    singular = np.linalg.svd(v64.numpy(), compute_uv=False)
    largest, smallest = float(singular[0]), float(singular[-1])
    if not smallest > max(r, d) * np.finfo(np.float64).eps * largest:
        raise InputError(f"the factor V ({r} x {d}) does not have full row rank (singular values from {largest:.3g} "
                         f"down to {smallest:.3g}), so U alone does not decide W = U @ V; pass the product itself")
    return u, Factorisation(r, d, smallest, largest)
