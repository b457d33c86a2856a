"""The certificates file (``audit --certificates FILE``): its verdicts, writing it, and reading it back checked.

    certs = auditor.load_certificates("certificates.json")
    auditor.verify(certs, weight, bias).ok

``TokenVerdict`` is one token's verdict with its certificate. The file is
``AuditReport.to_dict()`` as JSON, with where the head came from
(``certificates_document``); blocks of one audit make one file
(``merge_certificates``). Its fields: ``schema_version``, ``kind``
("auditor-certificates"), ``tool``, ``head``, ``domain``, ``tolerances``,
``centre`` and one entry per decided token. Most witnesses are written as a
formula over the token's own row, ``{"row": k, "minus_centre": t, "scale": s}``
meaning ``z = s * (w_k - t * centre)``; those stay formulas here
(``Certificates.witness_formulas``) until ``resolve(weight)`` evaluates them
against the weight being checked, bit for bit as the audit did. Nothing here
uses the engine: a certificate is only believed after ``auditor.verify``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from auditor.errors import InputError
from auditor.question.domain import Domain, parse_domain
from auditor.util.arrays import as_float64
from auditor.util.input import LARGEST_RESIDUAL_TOL as _LARGEST_RESIDUAL_TOL

VERDICTS = ("argmaxable", "unargmaxable", "tied", "inconclusive", "undecided")
SCHEMA_VERSION = 1
CERTIFICATES_KIND = "auditor-certificates"  # what the file's document is; load_certificates refuses other kinds

_DECIDED = tuple(v for v in VERDICTS if v != "undecided")


@dataclass(frozen=True)
class TokenVerdict:
    """One token's verdict with its certificate.

    argmaxable: ``witness`` (float64 z in the domain) and ``margin``, a proven lower
    bound of the exact min_{i != k} (l_k(z) - l_i(z)) over the rivals outside k's
    tie group; for an unbounded head without bias the margin is quoted on the unit
    ball, i.e. for z / ||z||. In the ``norm`` domain z is the exact normalisation of ``pre_norm``.
    unargmaxable: ``convex_indices`` and ``convex_weights`` (largest first; they
    sum to 1 and never include k) and ``residual``: an upper bound on
    ||sum alpha_i w_i - w_k|| in the unbounded domain, on the dual value
    s_D(w_k - sum alpha_i w_i) + b_k - sum alpha_i b_i in a bounded one;
    ``bias_gap`` bounds b_k - sum alpha_i b_i.
    tied: ``tied_with`` lists the tokens with the identical row, and
    ``group_verdict`` says whether the group as a whole could win; the
    certificate fields then hold the group's certificate.
    inconclusive: ``bounds`` = (best witness margin found, best dual bound found).
    In the ``norm`` domain ``witness`` is the norm's output z and ``pre_norm`` a
    hidden state x whose normalisation is z. With ``probability_ceiling=True``:
    ``max_probability`` (reached at ``probability_point``, in the norm domain the
    norm's output) and ``probability_bounds`` = (that value, an upper bound no
    point of the domain exceeds), at most 1e-4 apart. Fields that do not apply are None.
    """

    id: int
    verdict: str
    margin: float | None = None
    witness: np.ndarray | None = None
    runner_up: int | None = None
    convex_indices: np.ndarray | None = None
    convex_weights: np.ndarray | None = None
    residual: float | None = None
    bias_gap: float | None = None
    tied_with: list[int] | None = None
    group_verdict: str | None = None
    bounds: tuple[float, float] | None = None
    stage: str | None = None
    pre_norm: np.ndarray | None = None
    max_probability: float | None = None
    probability_bounds: tuple[float, float] | None = None
    probability_point: np.ndarray | None = None


@dataclass(frozen=True)
class WitnessFormula:
    """The witness ``z = scale * (w_row - minus_centre * centre)`` of one token."""

    row: int
    minus_centre: float
    scale: float

    def point(self, row: np.ndarray, centre: np.ndarray) -> np.ndarray:
        """z from the float64 row and centre, in the audit's order of operations (so the same bits)."""
        direction = row - self.minus_centre * centre if self.minus_centre else row
        return direction * self.scale if self.scale != 1.0 else direction


@dataclass
class Certificates:
    """The verdicts and certificates of a certificates file, shaped like an AuditReport for ``auditor.verify``.

    ``tokens[k]`` is a TokenVerdict for every id 0..n-1 (``"undecided"`` for the
    ids the file does not list). A witness written as a formula is None in
    ``tokens[k].witness`` and kept in ``witness_formulas[k]`` until
    ``resolve(weight)``. In the ``norm`` domain the certificate of a win is
    ``tokens[k].pre_norm`` (the file does not repeat its normalisation).
    ``final_norm`` is the file's ``{"kind", "eps", "unit_offset"}`` or None;
    ``head`` its head description (shape, dtype, bias, path and tensor names).
    """

    source: str
    n_tokens: int
    hidden_size: int
    has_bias: bool
    dtype: str | None
    domain: Domain
    tolerances: dict[str, float]
    centre: np.ndarray
    tokens: list[TokenVerdict]
    witness_formulas: dict[int, WitnessFormula] = field(default_factory=dict)
    final_norm: dict | None = None
    head: dict = field(default_factory=dict)
    tool: dict | None = None

    def ids(self, verdict: str) -> list[int]:
        """Sorted ids of the tokens with this verdict."""
        if verdict not in VERDICTS:
            raise ValueError(f"unknown verdict {verdict!r}; use one of {', '.join(VERDICTS)}")
        return [t.id for t in self.tokens if t.verdict == verdict]

    def resolve(self, weight: np.ndarray) -> Certificates:
        """A copy whose formula witnesses are evaluated on ``weight`` (an n x d numpy array, read as float64).

        Raises InputError when ``weight`` is not n x d.
        """
        rows = as_float64(weight)
        if rows.shape != (self.n_tokens, self.hidden_size):
            raise InputError(f"{self.source}: the certificates are for a {self.n_tokens} x {self.hidden_size} head, "
                             f"the weight given is {' x '.join(map(str, rows.shape))}")
        tokens = list(self.tokens)
        for k, formula in self.witness_formulas.items():
            tokens[k] = dataclasses.replace(tokens[k], witness=formula.point(rows[formula.row], self.centre))
        return dataclasses.replace(self, tokens=tokens, witness_formulas={})


def certificates_document(head, report) -> dict:
    """The certificates file's document: the report's certificates, with where the head came from."""
    document = report.to_dict()
    document["head"].update(path=str(head.path), weight_tensor=head.weight_name, bias_tensor=head.bias_name)
    return document


_CERTIFICATE_SAME = ("schema_version", "kind", "tool", "argmaxable_listed", "final_norm", "head", "domain",
                     "tolerances", "centre")


def merge_certificates(documents: list[dict]) -> dict:
    """One certificates document from those of disjoint blocks of one audit: every token, counts summed.

    The blocks share the head's centre and tolerances (the engine computes them over the whole head),
    which the witness formulas and the convex checks refer to; raises InputError if they do not."""
    first = documents[0]
    for document in documents[1:]:
        for key in _CERTIFICATE_SAME:
            if document.get(key) != first.get(key):
                raise InputError(f"the blocks' certificates differ in {key!r}, so they cannot make one "
                                 "certificates file; empty the work folder and run again")
    merged = dict(first)
    merged["tokens"] = sorted((t for d in documents for t in d["tokens"]), key=lambda t: t["id"])
    counts = {name: sum(d["counts"][name] for d in documents) for name in first["counts"] if name != "undecided"}
    counts["undecided"] = first["head"]["n_tokens"] - sum(counts.values())
    merged["counts"] = {name: counts[name] for name in first["counts"]}
    timings: dict[str, float] = {}
    for document in documents:
        for name, seconds in document["timings"].items():
            timings[name] = round(timings.get(name, 0.0) + seconds, 6)
    merged["timings"] = timings
    return merged


def load_certificates(path) -> Certificates:
    """Read a certificates file written by ``audit --certificates FILE``; returns Certificates.

    Raises InputError, with one line naming the path, when the file is missing,
    is not JSON, is another kind of document (such as a ``--format json``
    report), has another schema_version, or is malformed.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise InputError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise InputError(f"{path}: is a folder, not a certificates file") from None
    except (OSError, UnicodeDecodeError) as error:
        raise InputError(f"{path}: cannot read it ({getattr(error, 'strerror', None) or error})") from None
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise InputError(f"{path}: not JSON ({error}); write a certificates file with "
                         "audit --certificates FILE") from None
    return parse_certificates(document, source=str(path))


def parse_certificates(document: dict, source: str = "the certificates document") -> Certificates:
    """Certificates from the parsed JSON of a certificates file (``json.load`` output or ``report.to_dict()``).

    Raises InputError naming ``source`` when the document is not a certificates
    file of this schema_version or is malformed.
    """
    return _Parser(source).certificates(document)


class _Parser:
    """Checks every field it reads: a malformed file must be an error here, never a crash in verify."""

    def __init__(self, source: str):
        self.source = source
        self.argmaxable_listed = True

    def fail(self, message: str):
        raise InputError(f"{self.source}: {message}")

    def certificates(self, document) -> Certificates:
        if not isinstance(document, dict):
            self.fail("not a certificates file (the JSON is not an object); write one with audit --certificates FILE")
        if "findings" in document and "tokens" not in document:
            self.fail("this is an audit report, not a certificates file; write one with audit --certificates FILE")
        kind = document.get("kind", CERTIFICATES_KIND)  # files of the first release carry no kind
        if kind != CERTIFICATES_KIND:
            self.fail(f"a document of kind {kind!r}, not {CERTIFICATES_KIND!r}; "
                      "write one with audit --certificates FILE")
        for key in ("schema_version", "head", "domain", "tolerances", "centre", "tokens"):
            if key not in document:
                self.fail(f"not a certificates file: no {key!r} field; write one with audit --certificates FILE")
        if document["schema_version"] != SCHEMA_VERSION:
            self.fail(f"schema_version {document['schema_version']!r}, but this auditor reads schema_version "
                      f"{SCHEMA_VERSION}; re-check it with the auditor version that wrote it")

        self.argmaxable_listed = document.get("argmaxable_listed", True) is not False
        head = self.mapping(document["head"], "head")
        n = self.count(head.get("n_tokens"), "head.n_tokens")
        d = self.count(head.get("hidden_size"), "head.hidden_size")
        has_bias = head.get("bias")
        if not isinstance(has_bias, bool):
            self.fail(f"head.bias must be true or false, got {has_bias!r}")
        if not isinstance(document["domain"], str):
            self.fail(f"domain must be a string such as 'unbounded', got {document['domain']!r}")
        try:
            domain = parse_domain(document["domain"])
        except InputError as error:
            self.fail(str(error))
        tolerances = self.mapping(document["tolerances"], "tolerances")
        tolerance = tolerances.get("residual_tol")
        # The file states the tolerance its certificates rest on; the check must not take a looser one
        # than any audit can use, or an edited file could pass anything.
        if not (self.is_number(tolerance) and math.isfinite(tolerance) and 0 < tolerance <= _LARGEST_RESIDUAL_TOL):
            self.fail(f"tolerances.residual_tol must be a number in (0, {_LARGEST_RESIDUAL_TOL:g}], "
                      f"got {tolerance!r}")
        final_norm = document.get("final_norm")
        if final_norm is not None:
            final_norm = self.mapping(final_norm, "final_norm")
        centre = self.vector(document["centre"], d, "centre")

        tokens: list[TokenVerdict | None] = [None] * n
        formulas: dict[int, WitnessFormula] = {}
        if not isinstance(document["tokens"], list):
            self.fail("tokens must be a list")
        for entry in document["tokens"]:
            token, formula = self.token(entry, n, d)
            if tokens[token.id] is not None:
                self.fail(f"token {token.id} is listed twice")
            tokens[token.id] = token
            if formula is not None:
                formulas[token.id] = formula
        self.check_counts(document.get("counts"), tokens)
        for k in range(n):
            if tokens[k] is None:  # the audit did not decide it (audit --tokens, --shard)
                tokens[k] = TokenVerdict(id=k, verdict="undecided")
        return Certificates(source=self.source, n_tokens=n, hidden_size=d, has_bias=has_bias,
                            dtype=head.get("dtype"), domain=domain, tolerances=dict(tolerances), centre=centre,
                            tokens=tokens, witness_formulas=formulas, final_norm=final_norm, head=dict(head),
                            tool=document.get("tool"))

    def check_counts(self, counts, tokens: list) -> None:
        """An entry dropped from the file would read as undecided and escape the check: refuse that."""
        if not isinstance(counts, dict):
            return
        listed = {v: 0 for v in _DECIDED}
        for token in tokens:
            if token is not None:
                listed[token.verdict] += 1
        for verdict in _DECIDED:
            if verdict == "argmaxable" and not self.argmaxable_listed:
                continue  # written with to_dict(include_argmaxable=False): those tokens are left out
            stated = counts.get(verdict, 0)
            if stated != listed[verdict]:
                self.fail(f"its counts say {stated} {verdict} tokens but it lists {listed[verdict]}; a certificates "
                          "file lists every decided token (write it with audit --certificates FILE)")

    def token(self, entry, n: int, d: int) -> tuple[TokenVerdict, WitnessFormula | None]:
        entry = self.mapping(entry, "a token entry")
        k = entry.get("id")
        if not self.is_int(k) or not 0 <= k < n:
            self.fail(f"token id {k!r} is not an id of the {n}-token head")
        where = f"token {k}"
        verdict = entry.get("verdict")
        if verdict not in _DECIDED:
            self.fail(f"{where}: verdict {verdict!r} is not one of {', '.join(_DECIDED)}")
        fields: dict = {"id": k, "verdict": verdict, "stage": entry.get("stage")}
        if "margin" in entry:
            fields["margin"] = self.number_or_none(entry["margin"], f"{where}: margin", math.nan)
        runner_up = entry.get("runner_up")
        if runner_up is not None:
            fields["runner_up"] = self.token_id(runner_up, n, f"{where}: runner_up")
        formula = None
        witness = entry.get("witness")
        if isinstance(witness, dict):
            row = self.token_id(witness.get("row"), n, f"{where}: witness row")
            t, s = witness.get("minus_centre"), witness.get("scale")
            if not (self.is_number(t) and self.is_number(s)):
                self.fail(f"{where}: a witness formula needs numbers minus_centre and scale")
            formula = WitnessFormula(row, float(t), float(s))
        elif witness is not None:
            fields["witness"] = self.vector(witness, d, f"{where}: witness")
        if entry.get("pre_norm") is not None:
            fields["pre_norm"] = self.vector(entry["pre_norm"], d, f"{where}: pre_norm")
        if entry.get("convex") is not None:
            convex = self.mapping(entry["convex"], f"{where}: convex")
            indices, weights = convex.get("indices"), convex.get("weights")
            if not isinstance(indices, list) or not isinstance(weights, list) or len(indices) != len(weights):
                self.fail(f"{where}: convex needs lists indices and weights of one length")
            fields["convex_indices"] = np.array([self.token_id(i, n, f"{where}: convex index") for i in indices],
                                                dtype=np.int64)
            fields["convex_weights"] = self.vector(weights, len(weights), f"{where}: convex weights")
            fields["residual"] = self.number_or_none(convex.get("residual"), f"{where}: residual", math.inf)
            fields["bias_gap"] = self.number_or_none(convex.get("bias_gap"), f"{where}: bias_gap", math.inf)
        if verdict == "tied" and not entry.get("tied_with"):
            self.fail(f"{where}: a tied token needs tied_with (its copies) and group_verdict")
        if entry.get("tied_with") is not None:
            if not isinstance(entry["tied_with"], list):
                self.fail(f"{where}: tied_with must be a list of ids")
            fields["tied_with"] = [self.token_id(j, n, f"{where}: tied_with") for j in entry["tied_with"]]
            group = entry.get("group_verdict")
            if group not in _DECIDED:
                self.fail(f"{where}: group_verdict {group!r} is not one of {', '.join(_DECIDED)}")
            fields["group_verdict"] = group
        if entry.get("bounds") is not None:
            bounds = self.mapping(entry["bounds"], f"{where}: bounds")
            fields["bounds"] = (self.number_or_none(bounds.get("margin_lower"), f"{where}: margin_lower", -math.inf),
                                self.number_or_none(bounds.get("margin_upper"), f"{where}: margin_upper", math.inf))
        if entry.get("max_probability") is not None:
            ceiling = self.mapping(entry["max_probability"], f"{where}: max_probability")
            lower = self.number_or_none(ceiling.get("lower"), f"{where}: max_probability.lower", math.nan)
            upper = self.number_or_none(ceiling.get("upper"), f"{where}: max_probability.upper", math.nan)
            fields.update(max_probability=lower, probability_bounds=(lower, upper),
                          probability_point=self.vector(ceiling.get("point"), d, f"{where}: max_probability.point"))
        return TokenVerdict(**fields), formula

    # -- field readers ---------------------------------------------------------------------------

    @staticmethod
    def is_int(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool)

    @staticmethod
    def is_number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    def mapping(self, value, what: str) -> dict:
        if not isinstance(value, dict):
            self.fail(f"{what} must be an object")
        return value

    def count(self, value, what: str) -> int:
        if not self.is_int(value) or value < 1:
            self.fail(f"{what} must be a positive integer, got {value!r}")
        return value

    def token_id(self, value, n: int, what: str) -> int:
        if not self.is_int(value) or not 0 <= value < n:
            self.fail(f"{what} {value!r} is not an id of the {n}-token head")
        return value

    def number_or_none(self, value, what: str, none: float) -> float:
        """JSON has no infinity: the writer stores an infinite or undefined number as null (``none`` here)."""
        if value is None:
            return none
        if not self.is_number(value):
            self.fail(f"{what} must be a number or null, got {value!r}")
        return float(value)

    def vector(self, value, length: int, what: str) -> np.ndarray:
        if not isinstance(value, list) or not all(self.is_number(v) for v in value):
            self.fail(f"{what} must be a list of numbers")
        if len(value) != length:
            self.fail(f"{what} has {len(value)} entries, expected {length}")
        return np.array(value, dtype=np.float64)  # Python floats are float64: the values written, exactly
