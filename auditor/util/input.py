"""Checks user input and puts it on one device, without copying the head where it can be avoided.

Every float16, bfloat16 and float32 value is exactly a float64 (and a float32)
value, so the engine's conversions lose nothing and every later certificate is
about the very weights the user gave.
"""

from __future__ import annotations

from collections.abc import Iterable

import warnings

import numpy as np
import torch

from auditor.errors import InputError

LARGEST_RESIDUAL_TOL = 1e-6  # a convex certificate may rest on at most this relative residual

_FLOAT_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64}
_NUMPY_FLOATS = {np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64)}


def resolve_device(device: str | torch.device) -> torch.device:
    """``"auto"`` picks CUDA when it is there; ``"cpu"``/``"cuda"`` force it."""
    if isinstance(device, torch.device):
        chosen = device
    elif device == "auto":
        chosen = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            chosen = torch.device(device)
        except (RuntimeError, TypeError):
            raise InputError(f"unknown device {device!r}: use 'auto', 'cpu' or 'cuda'") from None
    if chosen.type == "cuda" and not torch.cuda.is_available():
        raise InputError("device 'cuda' was asked for but torch sees no CUDA device; use 'auto' or 'cpu'")
    if chosen.type not in ("cpu", "cuda"):
        raise InputError(f"unsupported device {device!r}: use 'auto', 'cpu' or 'cuda'")
    return chosen


def as_tensor(array, what: str) -> torch.Tensor:
    if isinstance(array, torch.Tensor):
        tensor = array.detach()
        if tensor.dtype not in _FLOAT_DTYPES:
            raise InputError(f"{what} has dtype {tensor.dtype}; use float16, bfloat16, float32 or float64")
        return tensor
    if isinstance(array, np.ndarray) or hasattr(array, "__array__"):
        arr = np.asarray(array)
        if arr.dtype.name == "bfloat16":  # ml_dtypes' bfloat16 has the same bits as torch's
            return torch.from_numpy(np.array(arr).view(np.int16)).view(torch.bfloat16)
        if arr.dtype not in _NUMPY_FLOATS:
            raise InputError(f"{what} has dtype {arr.dtype}; use float16, bfloat16, float32 or float64")
        if any(step < 0 for step in arr.strides):
            arr = np.ascontiguousarray(arr)
        with warnings.catch_warnings():
            # memory-mapped arrays are read-only; the engine never writes to the head
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
            return torch.from_numpy(arr)
    raise InputError(f"{what} must be a numpy array or a torch tensor, got {type(array).__name__}")


def first_bad_rows(finite_rows: torch.Tensor, limit: int = 5) -> str:
    bad = torch.nonzero(~finite_rows).flatten()[:limit].tolist()
    more = int((~finite_rows).sum()) - len(bad)
    listed = ", ".join(str(i) for i in bad)
    return listed + (f" and {more} more" if more > 0 else "")


def _finite_rows(block: torch.Tensor) -> torch.Tensor:
    """Whether each row is free of NaN and Inf. A NaN or an infinity makes its row's sum NaN or infinite, so
    finite sums clear their rows in one reduction; only rows whose sum is not finite (a NaN, an Inf, or
    large finite entries whose sum overflowed) are looked at entry by entry."""
    finite = torch.isfinite(block.sum(dim=1))
    if not bool(finite.all()):
        doubtful = torch.nonzero(~finite).flatten()
        finite[doubtful] = torch.isfinite(block[doubtful]).all(dim=1)
    return finite


def prepare_inputs(weight, bias, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None, str]:
    """Validate the head and return (weight in its own dtype, bias as float64) on ``device``.

    Returns the source dtype's name as the third value. Raises InputError for
    wrong shapes, dtypes, empty heads and NaN or Inf entries (naming rows).
    """
    w = as_tensor(weight, "the weight")
    if w.ndim != 2:
        raise InputError(f"the weight must be two-dimensional (vocabulary x hidden), got shape {tuple(w.shape)}")
    n, d = w.shape
    if n == 0 or d == 0:
        raise InputError(f"the weight is empty (shape {n} x {d}); there is nothing to audit")
    source_dtype = str(w.dtype).replace("torch.", "")
    w = w.to(device=device)  # no copy when it is already there; the engine picks its own precision
    finite = torch.cat([_finite_rows(w[s:s + 8192]) for s in range(0, n, 8192)])
    if not bool(finite.all()):
        raise InputError(f"the weight has NaN or Inf entries in rows {first_bad_rows(finite)}")

    b64 = None
    if bias is not None:
        b = as_tensor(bias, "the bias")
        if b.ndim != 1 or b.shape[0] != n:
            raise InputError(f"the bias must be a vector of length {n} (one per row), got shape {tuple(b.shape)}")
        b64 = b.to(device=device, dtype=torch.float64)
        finite_b = torch.isfinite(b64)
        if not bool(finite_b.all()):
            raise InputError(f"the bias has NaN or Inf entries at rows {first_bad_rows(finite_b)}")
    return w, b64, source_dtype


def prepare_vector(vector, length: int, what: str, device: torch.device) -> torch.Tensor:
    """A float vector of the given length as float64 on ``device``; raises InputError otherwise."""
    v = as_tensor(vector, what)
    if v.ndim != 1 or v.shape[0] != length:
        raise InputError(f"{what} must be a vector of length {length}, got shape {tuple(v.shape)}")
    v64 = v.to(device=device, dtype=torch.float64)
    if not bool(torch.isfinite(v64).all()):
        raise InputError(f"{what} has NaN or Inf entries")
    return v64


def prepare_token_ids(tokens: Iterable[int] | None, n: int) -> np.ndarray:
    """The sorted unique token ids to decide; all of them when ``tokens`` is None."""
    if tokens is None:
        return np.arange(n, dtype=np.int64)
    try:
        raw = np.asarray(list(tokens))
    except (TypeError, ValueError):
        raise InputError("tokens must be an iterable of integer token ids") from None
    if raw.size and (raw.dtype == bool or not np.issubdtype(raw.dtype, np.integer)):
        raise InputError(f"tokens must be integer token ids, got values of type {raw.dtype}")
    ids = np.unique(raw.astype(np.int64))
    if ids.size and (ids[0] < 0 or ids[-1] >= n):
        bad = ids[(ids < 0) | (ids >= n)][:5].tolist()
        raise InputError(f"token ids {bad} are outside the vocabulary 0..{n - 1}")
    return ids


def check_options(residual_tol: float, frank_wolfe_iterations: int, lp_rounds: int, newton_iterations: int = 40,
                  min_norm_rounds: int = 40) -> None:
    """Refuse engine settings that would make verdicts meaningless or the run endless."""
    if not (isinstance(residual_tol, (int, float)) and 0 < residual_tol <= LARGEST_RESIDUAL_TOL):
        raise InputError(f"residual_tol must be in (0, {LARGEST_RESIDUAL_TOL:g}], got {residual_tol!r}")
    for name, value in (("frank_wolfe_iterations", frank_wolfe_iterations), ("lp_rounds", lp_rounds),
                        ("newton_iterations", newton_iterations), ("min_norm_rounds", min_norm_rounds)):
        if not (isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 1_000_000):
            raise InputError(f"{name} must be a non-negative integer, got {value!r}")
