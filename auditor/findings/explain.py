"""Findings in plain words: what each one means for generation, what its certificate shows, what people do next.

Each explanation says first, in plain words, whether and why the model can
produce the token, then what the certificate shows about its row (the
geometry). The certificates prove the verdicts; this module only says what
they amount to, in the terms of the usual causes (the finding's ``kind``):

- copy       the row is identical to another (``tied``): greedy decoding, which
             takes the first maximal logit, emits only the lowest id of the
             group, and only when the group can win;
- mean       the row is within noise of the mean of all rows, where
             ``resize_token_embeddings(mean_resizing=True)`` puts new tokens: its
             distance from the mean is at most ``MEAN_RADIUS`` times the
             root-mean-square distance of the rows from it;
- shorter    the row is a multiple lambda < 1 of another row, to within
             ``PARALLEL_TOL`` of its length;
- hull       otherwise, a convex combination of other rows reaches it: the
             rows with the largest weights are named;
- domain     (bounded domains) a combination of rows beats it everywhere in
             the domain, by at least the certificate's dual value; (nonneg domains) a
             combination of rows at least as large in every coordinate, up to the residual;
- reserved   a padding or reserved token (by its string: ``[PAD]``, ``<pad>``,
             ``[unused7]``, ``<|reserved_special_token_5|>``, ...) that is
             never produced, whichever of the causes above keeps it out;
- untrained  a token added to the vocabulary (past the tokenizer model's own,
             or a baseline's) whose row is within MEAN_RADIUS of the base
             rows' mean: still where mean initialisation put it;
- added      an added token whose row is farther from that mean (trained, or
             initialised otherwise: the audit cannot tell which) and still
             cannot win;
- padding    a row past the tokenizer's length in a padded vocabulary;
- undecided  inconclusive, with the bounds found;
- ceiling    argmaxable, but its probability never exceeds --ceiling P.

Every kind has one next step (``NEXT_STEPS``): what it means for generation and
what people usually do about it: train these rows, re-initialise them, or
accept them. docs/method.md states the tests and their thresholds.
"""

from __future__ import annotations

import re

import torch

from auditor.findings.finding import Finding
from auditor.question.head import Head
from auditor.util.arrays import row_blocks
from auditor.util.input import as_tensor
from auditor.verdicts.report import AuditReport

MEAN_RADIUS = 0.01  # rows this close to the mean, relative to the rows' spread, are "at the mean"
PARALLEL_TOL = 1e-6  # ||w_k - lambda w_j|| <= this * ||w_k||: "a shorter copy of row j"
_NAMED = 3  # rows named in a hull explanation
_PARALLEL_SEARCH = 64  # findings searched for a parallel row over the whole head (one product with it each)
_BLOCK = 4096
# token strings of padding and reserved tokens: [PAD], <pad>, <|padding|>, [unused7], <unused7>,
# <|reserved_special_token_5|>, <|PAD_TOKEN|>, madeupword0003
RESERVED_TOKEN = re.compile(r"[<\[]\|?(pad|padding|unused|reserved)[^<>\[\]]*[>\]]|<?madeupword\d+>?", re.IGNORECASE)

# kind -> what it means for generation; what people usually do about it (one line each)
NEXT_STEPS = {
    "mean": "the model can never produce these tokens: their rows are still where mean initialisation put them; "
            "usually they are trained (fine-tuning on text that uses the tokens) or re-initialised, for example "
            "from the rows of related tokens",
    "copy": "greedy decoding emits at most the lowest id of a group of identical rows, and none of them when the "
            "group cannot win; usually the copies that should be produced are re-initialised and trained, and "
            "copies kept as aliases are accepted (--allow)",
    "shorter copy": "the model can never produce these tokens: the longer row scores higher wherever they could "
                    "lead; usually the rows are trained or re-initialised",
    "padding": "the tokenizer never produces these ids (rows that pad the vocabulary, e.g. pad_to_multiple_of): "
               "nothing to do; they fail the run only with --fail-on padding",
    "untrained": "the model can never produce these tokens: they were added to the vocabulary and their rows are "
                 "still where mean initialisation put them; usually they are trained on data whose targets use "
                 "them (the audit cannot see the data: check that it does), and audited again",
    "added": "the model can never produce these tokens: they were added to the vocabulary and their rows are no "
             "longer where mean initialisation puts new rows (training moved them, or they were initialised "
             "otherwise), yet they cannot win; usually they are trained longer, after a check that the data uses "
             "the tokens as targets, and audited again",
    "hull": "the model can never produce these tokens, whatever the context: other tokens always score at least "
            "as high; usually these are rare or unused tokens, accepted (--allow) when they are not meant to be "
            "generated, else their rows are trained or re-initialised",
    "domain": "the model can never produce these tokens from hidden states in the domain audited; usually the rows "
              "are trained or re-initialised, or accepted (--allow) when they are not meant to be generated",
    "reserved": "padding and reserved tokens are never produced, which is usually what is intended; usually they "
                "are accepted: list them in an --allow file",
    "undecided": "not yet known whether the model can produce these tokens; usually they are audited again with a "
                 "larger budget (auditor.audit(..., tokens=[...], lp_rounds=100)) before anything is changed",
    "ceiling": "these tokens can be produced, but never with the probability --ceiling asks for; usually their rows "
               "are trained further, or the tokens accepted (--allow) when a low probability is expected",
}
# a tied token's next step, by what greedy decoding does with it (findings.greedy_decoding)
_TIE_STEPS = {
    "emits": "nothing to do for this row: greedy decoding emits it; re-initialise its copies if they should be "
             "produced too",
    "never": "re-initialise this row and train it if the token should be produced; accept it (--allow) if it is "
             "an alias",
    "unknown": "audit it again with a larger budget (lp_rounds); its copies are never produced whatever the answer",
}


def explain(head: Head, report: AuditReport, findings: list[Finding], first_added: int | None = None) -> list[str]:
    """Set ``explanation``, ``kind`` and ``next_step`` on every finding; return the summary lines, one per kind
    (next_steps(findings) gives what to do about each, in the same order). Ids from ``first_added`` on were
    added to the vocabulary (past a baseline's, or the tokenizer model's own): an unargmaxable one is a row still
    at the mean (untrained) or one away from it that cannot win (added), never a rare token."""
    if not findings:
        return []
    weight = as_tensor(head.weight, "the weight")
    unargmaxable = [f for f in findings if f.verdict == "unargmaxable"]
    # copies of one row at the mean (resized rows set to the exact mean) are mean-initialised rows too
    unwinnable = [f.id for f in findings if f.verdict == "tied" and f.group_verdict == "unargmaxable"]
    distance = _distance_from_mean(weight, [f.id for f in unargmaxable] + unwinnable)
    rest = [f for f in unargmaxable if distance[f.id] > MEAN_RADIUS]
    # The longer copy carries most of a shorter copy's certificate, so its heaviest rows are tried first;
    # a search over the whole head (one product with it per finding) is kept for a few of the others.
    parallel = _parallel_among(weight, {f.id: [c.id for c in f.competitors] for f in rest})
    parallel.update(_most_parallel(weight, [f.id for f in rest if f.id not in parallel][:_PARALLEL_SEARCH]))
    if head.bias is not None:  # the longer copy outscores k only where its bias is at least k's
        bias = as_tensor(head.bias, "the bias").to(torch.float64)
        parallel = {k: (j, ratio) for k, (j, ratio) in parallel.items() if bias[k] <= bias[j]}
    added = [f.id for f in unargmaxable if first_added is not None and f.id >= first_added]
    from_base = _distance_from_mean(weight, added, base=first_added) if added else {}
    for finding in findings:
        if finding.id in from_base:
            padding = head.tokens is not None and finding.id >= len(head.tokens) and _padded(head.shape[0], len(head.tokens))
            plain, geometry = _explain_added(finding, from_base[finding.id], padding)
            finding.next_step = NEXT_STEPS[finding.kind]
            finding.explanation = f"{plain}; {geometry}"
            continue
        plain, geometry = _explain_one(head, report, finding, distance.get(finding.id), parallel.get(finding.id))
        finding.next_step = _TIE_STEPS[finding.greedy] if finding.kind == "copy" else NEXT_STEPS[finding.kind]
        if finding.greedy == "never" and _reserved(finding.token):
            finding.kind, finding.next_step = "reserved", NEXT_STEPS["reserved"]
            plain = "a padding or reserved token, never produced, as intended"
        finding.explanation = f"{plain}; {geometry}" if geometry else plain
    return _summaries(findings, report)


def _explain_one(head: Head, report: AuditReport, finding: Finding, distance: float | None,
                 parallel: tuple[int, float] | None) -> tuple[str, str]:
    """Set the finding's kind; return (what it means for generation in plain words, what the certificate shows)."""
    if finding.verdict == "tied":
        plain, geometry = _explain_tie(head, finding)
        if distance is not None and distance <= MEAN_RADIUS:
            finding.kind = "mean"
            plain = "never produced, nor are its copies: not trained away from where the vocabulary's resizing put them"
            geometry += f"; at the mean of all rows (mean-initialised): {distance:.1e} of the rows' typical distance"
        return plain, geometry
    if finding.verdict == "inconclusive":
        finding.kind = "undecided"
        bounds = "" if finding.bounds is None else (f": its best margin lies between {finding.bounds[0]:.2g} "
                                                    f"and {finding.bounds[1]:.2g}")
        return "not known whether it can be produced", "not decided within the budget" + bounds
    if finding.verdict == "low-ceiling":
        finding.kind = "ceiling"
        return (f"can be the top prediction, but its probability never exceeds {finding.probability_bounds[1]:.4g} "
                f"{_where(report.domain)}"), ""
    if distance <= MEAN_RADIUS:
        finding.kind = "mean"
        return ("never produced: not trained away from where the vocabulary's resizing put it",
                f"at the mean of all rows (mean-initialised): {distance:.1e} of the rows' typical distance from it")
    if parallel is not None:
        j, ratio = parallel
        finding.kind = "shorter copy"
        return (f"never produced: {_name(head, j)} scores higher wherever it could lead",
                f"a shorter copy of row {_name(head, j)}{_shorter_by(ratio)}")
    if report.domain.orthant:  # sum alpha_i w_i >= w_k entrywise: no hull needed, a dominating mix
        finding.kind = "domain"
        mix = _mix(head, finding)
        return (f"never produced {_where(report.domain)}",
                f"out of reach: a mix of {mix} weighs every coordinate at least as much, so it scores at least as "
                f"high wherever the hidden state is non-negative")
    if report.domain.bounded and finding.residual is not None and finding.residual < 0:
        finding.kind = "domain"
        return (f"never produced {_where(report.domain)}",
                f"out of reach: a mix of {_mix(head, finding)} beats it everywhere there, by at least "
                f"{-finding.residual:.2g}")
    finding.kind = "hull"
    rivals = (_name(head, finding.competitors[0].id) if finding.support == 1 and finding.competitors
              else f"one of {finding.support} other tokens")
    return (f"never produced: whatever the context, {rivals} scores at least as high",
            f"inside the hull of {_mix(head, finding)}")


_PAD_MULTIPLES = (8, 16, 32, 64, 128)  # pad_to_multiple_of values in use (LlamaFactory 64, nanoGPT 64, ...)


def _padded(n: int, strings: int) -> bool:
    """Whether the rows past the tokenizer's ``strings`` tokens look like padding: the head has the smallest
    multiple of 8, 16, ..., 128 rows at or above the tokenizer's length. Rows past the tokenizer added any other
    way (a resized head saved without its tokenizer) are judged like any other row."""
    return strings < n and any(n % m == 0 and n - m < strings for m in _PAD_MULTIPLES)


def _explain_added(finding: Finding, distance: float, padding: bool) -> tuple[str, str]:
    where = (f"{distance:.2g} of the base rows' typical distance from their mean"
             + (" (where mean initialisation puts new rows)" if distance <= MEAN_RADIUS else ""))
    if padding:  # past the tokenizer's length: no text names it, so it is reported but fails only when asked
        finding.kind, finding.classes = "padding", ("padding",)
        return "a padding row past the tokenizer's length: no text produces its id", where
    if distance <= MEAN_RADIUS:
        finding.kind = "untrained"
        return "never produced: a token added to the vocabulary whose row is still where mean initialisation put it", \
            where
    # away from the mean: moved by training, or never mean-initialised; the audit cannot tell which, nor whether
    # the data holds the token, so it says what it sees
    finding.kind = "added"
    plain = ("never produced: a token added to the vocabulary whose row is away from where mean initialisation "
             "puts new rows, yet cannot win")
    return plain, where


def _reserved(token: str | None) -> bool:
    return token is not None and RESERVED_TOKEN.fullmatch(token.strip()) is not None


def _distance_from_mean(weight: torch.Tensor, ids: list[int], base: int | None = None) -> dict[int, float]:
    """||w_k - c|| / sqrt(mean_i ||w_i - c||^2) for the given rows, c the mean of all rows (of the first
    ``base`` rows when given: the vocabulary before tokens were added)."""
    if not ids:
        return {}
    head_rows = weight if base is None else weight[:base]
    n = head_rows.shape[0]
    centre = sum(rows.sum(dim=0) for _, _, rows in row_blocks(head_rows, _BLOCK)) / n
    spread = float(sum(((rows - centre) ** 2).sum() for _, _, rows in row_blocks(head_rows, _BLOCK)) / n) ** 0.5
    offsets = torch.linalg.vector_norm(weight[ids].to(torch.float64) - centre, dim=1)
    scale = spread if spread > 0 else 1.0
    return {k: float(v) / scale for k, v in zip(ids, offsets.tolist())}


def _shorter_by(ratio: float) -> str:
    """': 0.5 times its length', or for a copy shorter only by rounding ', by 7.1e-10 of its length' (six
    digits of the ratio would print 1)."""
    if ratio < 1 - 1e-5:
        return f": {ratio:.6g} times its length"
    return f", by {1 - ratio:.2g} of its length"


def _shorter_copy(w_k: torch.Tensor, w_j: torch.Tensor) -> float | None:
    """lambda when w_k = lambda w_j with 0 < lambda < 1 to within PARALLEL_TOL ||w_k||, else None."""
    ratio = float(w_k @ w_j) / max(float(w_j @ w_j), 1e-300)
    close = float(torch.linalg.vector_norm(w_k - ratio * w_j)) <= PARALLEL_TOL * float(torch.linalg.vector_norm(w_k))
    return ratio if 0 < ratio < 1 and close else None


def _parallel_among(weight: torch.Tensor, candidates: dict[int, list[int]]) -> dict[int, tuple[int, float]]:
    """k -> (j, lambda) for the first j among k's candidates of which w_k is a shorter copy."""
    found = {}
    for k, rows in candidates.items():
        w_k = weight[k].to(torch.float64)
        for j in rows:
            ratio = _shorter_copy(w_k, weight[j].to(torch.float64))
            if ratio is not None:
                found[k] = (j, ratio)
                break
    return found


def _most_parallel(weight: torch.Tensor, ids: list[int]) -> dict[int, tuple[int, float]]:
    """k -> (j, lambda) where w_k = lambda w_j with lambda < 1, to within PARALLEL_TOL; searched over the head."""
    found: dict[int, tuple[int, float]] = {}
    for start in range(0, len(ids), 256):
        part = ids[start:start + 256]
        rows = weight[part].to(torch.float64)
        norms = torch.linalg.vector_norm(rows, dim=1)
        best = torch.full((len(part),), -2.0, dtype=torch.float64)
        best_j = torch.zeros(len(part), dtype=torch.int64)
        for s, _, block in row_blocks(weight, _BLOCK):
            cosine = (rows @ block.T) / (norms[:, None] * torch.linalg.vector_norm(block, dim=1)[None, :]).clamp(min=1e-300)
            local = torch.as_tensor(part) - s
            own = (local >= 0) & (local < block.shape[0])
            cosine[torch.nonzero(own).flatten(), local[own]] = -2.0  # not its own rival
            value, where = cosine.max(dim=1)
            better = value > best
            best[better], best_j[better] = value[better], where[better] + s
        for j, k in enumerate(part):
            ratio = _shorter_copy(rows[j], weight[int(best_j[j])].to(torch.float64))
            if ratio is not None:
                found[k] = (int(best_j[j]), ratio)
    return found


def _where(domain) -> str:
    kind, _, radius = str(domain).partition(":")  # a domain object or its name
    if kind == "nonneg":
        return "for non-negative hidden states" + (f" of norm at most {radius}" if radius else "")
    return "on the final norm's outputs" if str(domain) == "norm" else f"in {domain}"


def _name(head: Head, j: int) -> str:
    token = head.token(j)
    return f"{j}" if token is None else f"{j} {token!r}"


def _mix(head: Head, finding: Finding) -> str:
    """"N rows, mainly a, b and c": the rows with the largest weights (the weights are in the competitors)."""
    named = [_name(head, c.id) for c in finding.competitors[:_NAMED]]
    listed = ", ".join(named[:-1]) + " and " + named[-1] if len(named) > 1 else "".join(named)
    return f"{finding.support} rows, mainly {listed}" if named else f"{finding.support} rows"


def _listed(head: Head, ids: list[int]) -> str:
    shown = ", ".join(_name(head, j) for j in ids[:_NAMED])
    return shown + (f" and {len(ids) - _NAMED} more" if len(ids) > _NAMED else "")


def _explain_tie(head: Head, finding: Finding) -> tuple[str, str]:
    """(plain words, geometry) for a tied token: what greedy decoding does with it (it returns the first maximal
    logit, so only the lowest id of the group, and only when the group can win), then the rows it shares."""
    others = sorted(finding.tied_with or [])
    lowest = finding.group_lowest
    finding.kind = "copy"
    copies = f"cop{'ies' if len(others) > 1 else 'y'} {_listed(head, others)}"
    if finding.id != lowest:
        geometry = f"copy of row {_name(head, lowest)}: they always tie"
    else:
        geometry = f"copied as row{'s' if len(others) > 1 else ''} {_listed(head, others)}: they always tie"
    if finding.group_verdict == "unargmaxable":
        plain = "never produced, nor are its copies: the shared row never wins"
        geometry += ", and the shared row is inside the hull of the others"
    elif finding.id != lowest:
        plain = (f"greedy decoding never produces it: it always ties with {_name(head, lowest)}, "
                 "and argmax returns the lower id")
    elif finding.greedy == "emits":
        plain = f"greedy decoding produces it, and never its {copies}: argmax returns the lowest id of a tie"
    else:
        plain = f"not known whether greedy decoding can produce it; never its {copies}, which tie with it"
    return plain, geometry


def id_ranges(ids: list[int], limit: int | None = 8, separator: str = ", ", dash: str = "–") -> str:
    """``[3, 4, 5, 9]`` -> ``"3–5, 9"``; past ``limit`` ranges (None: no limit), a count of the rest."""
    ids = sorted(ids)
    ranges: list[tuple[int, int]] = []
    for k in ids:
        if ranges and k == ranges[-1][1] + 1:
            ranges[-1] = (ranges[-1][0], k)
        else:
            ranges.append((k, k))
    shown = ranges if limit is None else ranges[:limit]
    parts = [f"{a}" if a == b else f"{a}{dash}{b}" for a, b in shown]
    rest = sum(b - a + 1 for a, b in ranges[len(shown):])
    return separator.join(parts) + (f" and {rest} more" if rest else "")


def _summaries(findings: list[Finding], report: AuditReport) -> list[str]:
    return summary_lines([{"id": f.id, "kind": f.kind, "tied_with": f.tied_with, "group_verdict": f.group_verdict,
                           "max_probability": None if f.probability_bounds is None
                           else {"upper": f.probability_bounds[1]}} for f in findings], str(report.domain))


def _by_kind(findings: list[dict]) -> dict[str, list[dict]]:
    """The findings of each kind that has a next step, kinds in the order they first appear."""
    by_kind: dict[str, list[dict]] = {}
    for finding in findings:
        if finding.get("kind") in NEXT_STEPS:
            by_kind.setdefault(finding["kind"], []).append(finding)
    return by_kind


def next_steps(findings: list[dict]) -> list[str]:
    """What each summary line's findings mean for generation and what people usually do about them, one line per
    line of summary_lines(findings, ...), in its order."""
    return [NEXT_STEPS[kind] for kind in _by_kind(findings)]


def summary_lines(findings: list[dict], domain: str) -> list[str]:
    """One line per kind of finding, from the JSON report's findings (so that audit-merge can
    summarise the merged findings as one audit would)."""
    lines = []
    for kind, group in _by_kind(findings).items():
        ids = [f["id"] for f in group]
        count = len(group)
        rows = f"{count} row{'s' if count != 1 else ''}"
        if kind == "mean":
            lines.append(f"{rows} at the mean of all rows: {id_ranges(ids)}, typical of a vocabulary resized "
                         "with mean initialisation")
        elif kind == "copy":
            groups = {tuple(sorted([f["id"], *(f.get("tied_with") or [])])) for f in group}
            shown = "; ".join(" = ".join(map(str, g)) for g in sorted(groups)[:4])
            more = f" and {len(groups) - 4} more groups" if len(groups) > 4 else ""
            # greedy decoding returns the first maximal logit: a group's lowest id, and only if the group can win
            never = sum(f["id"] > min(f.get("tied_with") or [f["id"]]) or f.get("group_verdict") == "unargmaxable"
                        for f in group)
            lines.append(f"{rows} in {len(groups)} group{'s' if len(groups) != 1 else ''} of identical rows "
                         f"({shown}{more}): greedy decoding emits only the lowest id of a group that can win"
                         + (f", so {never} of them {'is' if never == 1 else 'are'} never produced" if never else ""))
        elif kind == "shorter copy":
            lines.append(f"{rows} {'are shorter copies' if count != 1 else 'is a shorter copy'} of other rows: "
                         f"{id_ranges(ids)}")
        elif kind == "padding":
            lines.append(f"{rows} padding the vocabulary past the tokenizer's length: {id_ranges(ids)}")
        elif kind == "untrained":
            lines.append(f"{rows} added to the vocabulary and still at the mean of the rows: {id_ranges(ids)}")
        elif kind == "added":
            lines.append(f"{rows} added to the vocabulary, away from the mean of the rows, that cannot win: "
                         f"{id_ranges(ids)}")
        elif kind == "hull":
            lines.append(f"{rows} inside the hull of other rows: {id_ranges(ids)}")
        elif kind == "domain":
            lines.append(f"{rows} out of reach {_where(domain)}: {id_ranges(ids)}")
        elif kind == "reserved":
            lines.append(f"{count} padding or reserved token{'s' if count != 1 else ''}, never produced: "
                         f"{id_ranges(ids)}")
        elif kind == "undecided":
            lines.append(f"{count} token{'s' if count != 1 else ''} not decided within the budget: {id_ranges(ids)}")
        elif kind == "ceiling":
            lowest = min(group, key=lambda f: f["max_probability"]["upper"])
            lines.append(f"{count} token{'s' if count != 1 else ''} never reach the probability ceiling: "
                         f"{id_ranges(ids)}; the lowest, {lowest['id']}, never exceeds "
                         f"{lowest['max_probability']['upper']:.4g}")
    return lines
