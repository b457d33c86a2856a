"""Findings in plain words: what each certificate shows, and one line per group of findings alike.

The certificates prove the verdicts; this module only says what they amount
to, in the terms of the usual causes:

- copy       the row is identical to another (``tied``);
- mean       the row is within noise of the mean of all rows, where
             ``resize_token_embeddings(mean_resizing=True)`` puts new tokens: its
             distance from the mean is at most ``MEAN_RADIUS`` times the
             root-mean-square distance of the rows from it;
- shorter    the row is a multiple lambda < 1 of another row, to within
             ``PARALLEL_TOL`` of its length;
- hull       otherwise, a convex combination of other rows reaches it: the
             rows with the largest weights are named;
- domain     (bounded domains) a combination of rows beats it everywhere in
             the domain, by at least the certificate's dual value;
- undecided  inconclusive, with the bounds found;
- ceiling    argmaxable, but its probability never reaches --ceiling P.

docs/method.md states the tests and their thresholds.
"""

from __future__ import annotations

import torch

from auditor._arrays import row_blocks
from auditor._input import as_tensor
from auditor.findings import Finding
from auditor.head import Head
from auditor.report import AuditReport

MEAN_RADIUS = 0.01  # rows this close to the mean, relative to the rows' spread, are "at the mean"
PARALLEL_TOL = 1e-6  # ||w_k - lambda w_j|| <= this * ||w_k||: "a shorter copy of row j"
_NAMED = 3  # rows named in a hull explanation
_PARALLEL_SEARCH = 64  # findings searched for a parallel row over the whole head (one product with it each)
_BLOCK = 4096


def explain(head: Head, report: AuditReport, findings: list[Finding]) -> list[str]:
    """Set ``explanation`` and ``kind`` on every finding; return the summary lines, one per kind."""
    if not findings:
        return []
    weight = as_tensor(head.weight, "the weight")
    unargmaxable = [f for f in findings if f.verdict == "unargmaxable"]
    distance = _distance_from_mean(weight, [f.id for f in unargmaxable])
    rest = [f for f in unargmaxable if distance[f.id] > MEAN_RADIUS]
    # The longer copy carries most of a shorter copy's certificate, so its heaviest rows are tried first;
    # a search over the whole head (one product with it per finding) is kept for a few of the others.
    parallel = _parallel_among(weight, {f.id: [c.id for c in f.competitors] for f in rest})
    parallel.update(_most_parallel(weight, [f.id for f in rest if f.id not in parallel][:_PARALLEL_SEARCH]))
    bounded = report.domain.bounded
    for finding in findings:
        k = finding.id
        if finding.verdict == "tied":
            _explain_tie(head, finding)
        elif finding.verdict == "inconclusive":
            finding.kind = "undecided"
            finding.explanation = "not decided within the budget"
            if finding.bounds is not None:
                finding.explanation += (f": its best margin lies between {finding.bounds[0]:.2g} and "
                                        f"{finding.bounds[1]:.2g}")
        elif finding.verdict == "low-ceiling":
            reached, ceiling = finding.probability_bounds
            finding.kind = "ceiling"
            finding.explanation = (f"can be the top prediction, but its probability never exceeds {ceiling:.4g} "
                                   f"{_where(report.domain)}")
        elif distance[k] <= MEAN_RADIUS:
            finding.kind = "mean"
            finding.explanation = (f"at the mean of all rows (mean-initialised): {distance[k]:.1e} of the rows' "
                                   "typical distance from it")
        elif k in parallel:
            j, ratio = parallel[k]
            finding.kind = "shorter copy"
            finding.explanation = f"a shorter copy of row {_name(head, j)}: {ratio:.6g} times its length"
        elif bounded and finding.residual is not None and finding.residual < 0:
            finding.kind = "domain"
            finding.explanation = (f"out of reach {_where(report.domain)}: a mix of {_mix(head, finding)} beats it "
                                   f"everywhere there, by at least {-finding.residual:.2g}")
        else:
            finding.kind = "hull"
            finding.explanation = f"inside the hull of {_mix(head, finding)}"
    return _summaries(findings, report)


def _distance_from_mean(weight: torch.Tensor, ids: list[int]) -> dict[int, float]:
    """||w_k - c|| / sqrt(mean_i ||w_i - c||^2) for the given rows, c the mean of all rows."""
    if not ids:
        return {}
    n = weight.shape[0]
    centre = sum(rows.sum(dim=0) for _, _, rows in row_blocks(weight, _BLOCK)) / n
    spread = float(sum(((rows - centre) ** 2).sum() for _, _, rows in row_blocks(weight, _BLOCK)) / n) ** 0.5
    offsets = torch.linalg.vector_norm(weight[ids].to(torch.float64) - centre, dim=1)
    scale = spread if spread > 0 else 1.0
    return {k: float(v) / scale for k, v in zip(ids, offsets.tolist())}


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
    return "on the final norm's outputs" if str(domain) == "norm" else f"in {domain}"


def _name(head: Head, j: int) -> str:
    token = head.token(j)
    return f"{j}" if token is None else f"{j} {token!r}"


def _mix(head: Head, finding: Finding) -> str:
    """"N rows, mainly a, b and c": the rows with the largest weights (the weights are in the competitors)."""
    named = [_name(head, c.id) for c in finding.competitors[:_NAMED]]
    listed = ", ".join(named[:-1]) + " and " + named[-1] if len(named) > 1 else "".join(named)
    return f"{finding.support} rows, mainly {listed}" if named else f"{finding.support} rows"


def _explain_tie(head: Head, finding: Finding) -> None:
    """Name the row it copies (the lowest id of its group) or, for that row, its copies."""
    others = sorted(finding.tied_with or [])
    earlier = [j for j in others if j < finding.id]
    finding.kind = "copy"
    if earlier:
        finding.explanation = f"copy of row {_name(head, earlier[0])}: they always tie"
    else:
        listed = ", ".join(_name(head, j) for j in others[:_NAMED]) + (f" and {len(others) - _NAMED} more"
                                                                       if len(others) > _NAMED else "")
        finding.explanation = f"copied as row{'s' if len(others) > 1 else ''} {listed}: they always tie"
    if finding.group_verdict == "unargmaxable":
        finding.explanation += ", and the shared row is inside the hull of the others"


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
    return summary_lines([{"id": f.id, "kind": f.kind, "tied_with": f.tied_with,
                           "max_probability": None if f.probability_bounds is None
                           else {"upper": f.probability_bounds[1]}} for f in findings], str(report.domain))


def summary_lines(findings: list[dict], domain: str) -> list[str]:
    """One line per kind of finding, from the JSON report's findings (so that audit-merge can
    summarise the merged findings as one audit would)."""
    by_kind: dict[str, list[dict]] = {}
    for finding in findings:
        by_kind.setdefault(finding.get("kind"), []).append(finding)
    lines = []
    for kind, group in by_kind.items():
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
            lines.append(f"{rows} in {len(groups)} group{'s' if len(groups) != 1 else ''} of identical rows "
                         f"({shown}{more}): copies tie, so none of them is ever the strict top prediction")
        elif kind == "shorter copy":
            lines.append(f"{rows} {'are shorter copies' if count != 1 else 'is a shorter copy'} of other rows: "
                         f"{id_ranges(ids)}")
        elif kind == "hull":
            lines.append(f"{rows} inside the hull of other rows: {id_ranges(ids)}")
        elif kind == "domain":
            lines.append(f"{rows} out of reach {_where(domain)}: {id_ranges(ids)}")
        elif kind == "undecided":
            lines.append(f"{count} token{'s' if count != 1 else ''} not decided within the budget: {id_ranges(ids)}")
        elif kind == "ceiling":
            lowest = min(group, key=lambda f: f["max_probability"]["upper"])
            lines.append(f"{count} token{'s' if count != 1 else ''} never reach the probability ceiling: "
                         f"{id_ranges(ids)}; the lowest, {lowest['id']}, never exceeds "
                         f"{lowest['max_probability']['upper']:.4g}")
    return lines
