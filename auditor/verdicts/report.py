"""What an audit returns: a verdict and its certificate for every token."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from auditor._version import __version__
from auditor.engine import STAGES, TIED, UNARGMAXABLE, UNDECIDED, VERDICT_NAMES, Decisions
from auditor.verdicts.certificates import CERTIFICATES_KIND, SCHEMA_VERSION, VERDICTS, TokenVerdict


def _finite_or_none(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return float(value)


class _TokenList(Sequence):
    """``report.tokens[k]``: builds each TokenVerdict on demand, witnesses included."""

    def __init__(self, report: AuditReport):
        self._report = report

    def __len__(self) -> int:
        return self._report.n_tokens

    def __getitem__(self, k):
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(self)))]
        k = int(k)
        if k < 0:
            k += len(self)
        if not 0 <= k < len(self):
            raise IndexError(f"token id {k} is outside the vocabulary 0..{len(self) - 1}")
        return self._report._token(k)


class AuditReport:
    """The result of ``auditor.audit``: ``tokens[k]``, ``ids(verdict)``, ``counts``, ``to_dict()``."""

    def __init__(self, decisions: Decisions, weight_rows, *, n_tokens: int, hidden_size: int, dtype: str,
                 has_bias: bool, domain, device: str, timings: dict[str, float], norm_map=None,
                 threads: int | None = None, factorised=None):
        self._d = decisions
        self._norm_map = norm_map  # norm domain: the engine saw the reduced head; see auditor/question/norm.py
        # k -> float64 row, read from the caller's array without a copy of it
        self._row = norm_map.row if norm_map is not None else weight_rows
        self.n_tokens = n_tokens
        self.hidden_size = hidden_size
        self.dtype = dtype
        self.has_bias = has_bias
        self.domain = domain
        self.device = device
        self.threads = threads  # the CPU threads torch used
        # W = U V given as (U, V): the auditor.question.factorised.Factorisation on which U stood for W, else None
        self.factorised = factorised
        self.timings = timings
        self.tolerances = dict(decisions.tolerances)
        self.tokens = _TokenList(self)
        rep = decisions.representative
        members: dict[int, list[int]] = {}
        for k in np.nonzero(np.bincount(rep, minlength=n_tokens)[rep] > 1)[0].tolist():
            members.setdefault(int(rep[k]), []).append(k)
        self._groups = members

    # -- queries ---------------------------------------------------------------------------------

    def ids(self, verdict: str, *, groups: bool = False) -> list[int]:
        """Sorted ids of the tokens with this verdict.

        With ``groups=True``, also the tied tokens whose group as a whole has this verdict:
        ``ids("unargmaxable", groups=True)`` is every token that no hidden state makes the top prediction,
        copies of an unargmaxable row included (``ids("unargmaxable")`` leaves out tied tokens, as before).
        """
        if verdict not in VERDICTS:
            raise ValueError(f"unknown verdict {verdict!r}; use one of {', '.join(VERDICTS)}")
        code = VERDICT_NAMES.index(verdict)
        chosen = self._d.verdict == code
        if groups:
            for k, group in self._d.group_verdict.items():
                if group == code and self._d.verdict[k] == TIED:
                    chosen[k] = True
        return np.nonzero(chosen)[0].tolist()

    def never_emitted(self) -> list[int]:
        """Sorted ids of the tokens greedy decoding can never produce (it returns the first maximal logit, as
        ``torch.argmax`` does): the unargmaxable tokens, every member of an unargmaxable tied group, and every
        tied token but the lowest id of its group. Inconclusive and undecided tokens are not among them."""
        d = self._d
        never = d.verdict == UNARGMAXABLE
        for k, group in d.group_verdict.items():
            if d.verdict[k] == TIED and (group == UNARGMAXABLE or k != min(self._groups[int(d.representative[k])])):
                never[k] = True
        return np.nonzero(never)[0].tolist()

    @property
    def counts(self) -> dict[str, int]:
        """Number of tokens per verdict (every verdict present, zero included)."""
        tally = np.bincount(self._d.verdict, minlength=len(VERDICT_NAMES))
        return {name: int(tally[VERDICT_NAMES.index(name)]) for name in VERDICTS}

    def margins(self) -> np.ndarray:
        """Every token's witness margin (float64, NaN where there is none), without building TokenVerdicts."""
        return np.array(self._d.margin, dtype=np.float64)

    def ceilings(self) -> tuple[np.ndarray, np.ndarray]:
        """Every token's probability ceiling as (reached, upper bound) arrays; NaN where not computed."""
        lower, upper = np.full(self.n_tokens, np.nan), np.full(self.n_tokens, np.nan)
        for k, (reached, bound, _) in self._d.ceiling.items():
            lower[k], upper[k] = reached, bound
        return lower, upper

    def witness(self, k: int) -> np.ndarray | None:
        """The witness z (in the norm domain: the norm's output), or None."""
        y = self._engine_witness(k)
        if y is None or self._norm_map is None:
            return y
        return self._norm_map.outputs(y)[1]

    def pre_norm(self, k: int) -> np.ndarray | None:
        """Norm domain: a hidden state whose normalisation is the witness; None elsewhere."""
        y = self._engine_witness(k)
        if y is None or self._norm_map is None:
            return None
        return self._norm_map.outputs(y)[0]

    def _engine_witness(self, k: int) -> np.ndarray | None:
        d = self._d
        if k in d.explicit_witness:
            return d.explicit_witness[k]
        scale = d.witness_scale[k]
        if not np.isfinite(scale):
            return None
        direction = self._row(int(d.representative[k]))  # a group's witness is its representative's
        if d.witness_shift[k]:
            direction = direction - d.witness_shift[k] * d.centre
        return direction * scale if scale != 1.0 else direction

    def _token(self, k: int) -> TokenVerdict:
        d = self._d
        code = int(d.verdict[k])
        fields: dict = {"id": k, "verdict": VERDICT_NAMES[code]}
        if code == UNDECIDED:
            return TokenVerdict(**fields)
        fields["stage"] = STAGES[int(d.stage[k])] or None
        if code == TIED:
            fields["tied_with"] = [j for j in self._groups[int(d.representative[k])] if j != k]
            fields["group_verdict"] = VERDICT_NAMES[d.group_verdict[k]]
        if k in d.convex:
            indices, weights, residual, gap = d.convex[k]
            fields.update(convex_indices=indices, convex_weights=weights, residual=residual, bias_gap=gap)
        witness = self._engine_witness(k)
        if witness is not None:
            if self._norm_map is not None:
                fields["pre_norm"], witness = self._norm_map.outputs(witness)
            fields.update(witness=witness, margin=float(d.margin[k]))
            if d.runner_up[k] >= 0:
                fields["runner_up"] = int(d.runner_up[k])
        if k in d.bounds:
            fields["bounds"] = d.bounds[k]
        if k in d.ceiling:
            lower, upper, point = d.ceiling[k]
            if self._norm_map is not None:
                point = self._norm_map.outputs(point)[1]
            fields.update(max_probability=lower, probability_bounds=(lower, upper), probability_point=point)
        return TokenVerdict(**fields)

    # -- serialisation ---------------------------------------------------------------------------

    def to_dict(self, *, include_argmaxable: bool = True) -> dict:
        """A JSON-serialisable dict with every certificate.

        A witness that is a multiple of a shifted row is written as
        ``{"row": k, "minus_centre": t, "scale": s}`` meaning
        ``z = s * (w_k - t * centre)`` with the top-level ``centre``; any other
        witness is written out as a list. Infinite or undefined numbers are null.
        """
        d = self._d
        tokens = []
        for k in range(self.n_tokens):
            code = int(d.verdict[k])
            if code == UNDECIDED or (code == VERDICT_NAMES.index("argmaxable") and not include_argmaxable):
                continue
            token = self.tokens[k]
            entry = {"id": k, "verdict": token.verdict, "stage": token.stage}
            if token.witness is not None:
                entry["margin"] = _finite_or_none(token.margin)
                entry["runner_up"] = token.runner_up
                if self._norm_map is not None:
                    entry["pre_norm"] = [float(v) for v in token.pre_norm]  # the witness is its normalisation
                elif k in d.explicit_witness:
                    entry["witness"] = [float(v) for v in token.witness]
                else:
                    entry["witness"] = {"row": int(d.representative[k]), "minus_centre": float(d.witness_shift[k]),
                                        "scale": float(d.witness_scale[k])}
            if token.convex_indices is not None:
                entry["convex"] = {"indices": [int(i) for i in token.convex_indices],
                                   "weights": [float(w) for w in token.convex_weights],
                                   "residual": _finite_or_none(token.residual),
                                   "bias_gap": _finite_or_none(token.bias_gap)}
            if token.tied_with is not None:
                entry["tied_with"] = token.tied_with
                entry["group_verdict"] = token.group_verdict
            if token.bounds is not None:
                entry["bounds"] = {"margin_lower": _finite_or_none(token.bounds[0]),
                                   "margin_upper": _finite_or_none(token.bounds[1])}
            if token.max_probability is not None:
                entry["max_probability"] = {"lower": token.probability_bounds[0], "upper": token.probability_bounds[1],
                                            "point": [float(v) for v in token.probability_point]}
            tokens.append(entry)
        norm = self._norm_map.norm if self._norm_map is not None else None
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": CERTIFICATES_KIND,
            "tool": {"name": "auditor", "version": __version__},
            "argmaxable_listed": include_argmaxable,  # False: argmaxable tokens (and their witnesses) left out
            "final_norm": None if norm is None else {"kind": norm.kind, "eps": norm.eps, "unit_offset": norm.unit_offset},
            "head": {"n_tokens": self.n_tokens, "hidden_size": self.hidden_size, "dtype": self.dtype,
                     "bias": self.has_bias,
                     "factorised": None if self.factorised is None else self.factorised.to_dict()},
            "domain": str(self.domain),
            "device": self.device,
            "threads": self.threads,
            "counts": self.counts,
            "tolerances": self.tolerances,
            "timings": {name: round(seconds, 6) for name, seconds in self.timings.items()},
            "centre": [float(v) for v in d.centre],
            "tokens": tokens,
        }

    def __repr__(self) -> str:
        counts = ", ".join(f"{name} {count}" for name, count in self.counts.items() if count)
        inner = f" (U of W = U V, hidden size {self.factorised.hidden_size})" if self.factorised else ""
        return f"<AuditReport {self.n_tokens} x {self.hidden_size} {self.dtype}{inner}, {self.domain}: {counts}>"
