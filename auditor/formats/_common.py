"""Small pieces the human-readable formats share. They read the JSON document (json_format.document), not
a GateResult, so that ``audit-merge``, which has only the shards' documents, renders with the same code."""

from __future__ import annotations

FINDING_ORDER = ("unargmaxable", "tied", "inconclusive", "low-ceiling")
VERDICT_COUNTS = ("argmaxable", "unargmaxable", "tied", "inconclusive", "undecided")
SHOWN_PER_VERDICT = 20  # beyond this a verdict's findings are counted, not listed; JSON always lists them all


def head_lines(doc: dict) -> list[tuple[str, str]]:
    """(label, value) pairs describing the audited head, in reading order."""
    head, timing = doc["head"], doc.get("timing", {})
    n, d = head["shape"]
    names = head["weight"] + (f" + {head['bias']}" if head["bias"] else "")
    ceiling = doc.get("ceiling")
    load, total = timing.get("load_s", 0.0), timing.get("total_s", 0.0)
    lines = [
        ("model", head["path"] or "(array)"),
        ("head", f"{names} [{head['format']}]"),
        ("shape", f"{n} x {d} {head['dtype']}"),
        ("bias", "yes" if head["bias"] else "no"),
        ("tied", "yes, the input embedding is the head" if head["tied"] else "no"),
        ("domain", doc["domain"] + (f", probability ceiling {ceiling:g}" if ceiling else "")),
        ("time", f"{load + total:.2f} s (load {load:.2f} s, audit {total:.2f} s)"),
    ]
    factorised = head.get("factorised")
    if factorised:
        r, hidden = factorised["inner_dimension"], factorised["hidden_size"]
        lines.insert(3, ("factors", f"W = U V with V {r} x {hidden} of full row rank: decided exactly on U in R^{r} "
                                    f"(witnesses are points of R^{r})"))
    threads = (doc.get("run") or {}).get("threads")
    if threads:
        lines.append(("threads", f"{threads} CPU thread{'s' if threads != 1 else ''}"
                                 + (" (the first shard's)" if doc.get("merged_from") else "")))
    shard = doc.get("shard")
    if shard:
        lines.append(("shard", f"{shard['index']}/{shard['count']}: ids {shard['first']}..{shard['stop'] - 1}"))
    if doc.get("merged_from"):
        lines.append(("shards", f"{doc['merged_from']} merged; the times are their sum"))
    return lines


def verdict_counts(doc: dict) -> dict[str, int]:
    """Tokens per verdict, the verdicts no token has left out."""
    summary = doc["summary"]
    return {name: summary[name] for name in VERDICT_COUNTS if summary.get(name)}


def has_token_strings(doc: dict) -> bool:
    return doc["head"].get("token_strings") is not None


def token_label(token: str | None) -> str:
    return "(no string)" if token is None else repr(token)


def is_failing(finding: dict, doc: dict) -> bool:
    """Whether the gate counts this finding as failing; documents carry the gate's decision."""
    if "failing" in finding:
        return finding["failing"]
    classes = finding.get("classes") or [finding["verdict"]]  # documents from before the classes were recorded
    return (any(name in doc["fail_on"] for name in classes) and not finding["allowed"]
            and finding.get("baseline") != "unchanged")


def grouped_findings(doc: dict, shown: int = SHOWN_PER_VERDICT) -> list[tuple[str, list[dict], list[dict]]]:
    """(verdict, the findings shown (at most ``shown``), the findings left out) per verdict that has findings.

    Within a verdict, failing findings come first so an allowed or unchanged one never hides
    one that fails the run; each part is in id order. Padding rows past the tokenizer's length that do
    not fail the run are never listed one by one (a padded vocabulary has dozens, and they would bury the
    findings that matter): they are left out, and the left-out line counts them."""
    groups = []
    for verdict in FINDING_ORDER:
        alike = sorted((f for f in doc["findings"] if f["verdict"] == verdict),
                       key=lambda f: (not is_failing(f, doc), f["id"]))
        quiet = [f for f in alike if quiet_padding(f, doc)]
        listed = [f for f in alike if not quiet_padding(f, doc)]
        if alike:
            groups.append((verdict, listed[:shown], listed[shown:] + quiet))
    return groups


def quiet_padding(finding: dict, doc: dict) -> bool:
    """A padding row past the tokenizer's length that does not fail the run: counted, not listed."""
    return finding.get("kind") == "padding" and not is_failing(finding, doc)


def left_out_line(verdict: str, left_out: list[dict], doc: dict) -> str:
    """The line that stands for the findings of a verdict that were not listed."""
    failing = sum(is_failing(f, doc) for f in left_out)
    padding = sum(quiet_padding(f, doc) for f in left_out)
    noun = "finding" if len(left_out) == 1 else "findings"
    also = f"{failing} of them failing; " if failing else ""
    if padding:
        rows = "row" if padding == 1 else "rows"
        also += f"{padding} padding {rows} past the tokenizer's length, listed with --fail-on padding; "
    more = "" if padding == len(left_out) else "more "
    return f"… and {len(left_out)} {more}{verdict} {noun} ({also}all of them are in --format json)"


def _domain_words(domain: str) -> str:
    kind, _, radius = domain.partition(":")
    if kind in ("ball", "box"):
        return f"the {kind} of radius {radius}"
    if kind == "norm":
        return "the final norm's outputs"
    if kind == "nonneg":
        return "the non-negative hidden states" + (f" of norm at most {radius}" if radius else "")
    return domain


def dual_bound_legend(doc: dict) -> str | None:
    """What a dual bound means, for reports whose listed findings show one."""
    if doc["domain"] in ("unbounded", "nonneg"):  # their certificates state a residual, not a dual bound
        return None
    # an unexplained finding says it in its own cell; an explained one has room only for the number
    shown = (f for _, listed, _ in grouped_findings(doc) for f in listed)
    if not any(f["verdict"] == "unargmaxable" and f.get("explanation") for f in shown):
        return None
    return (f"dual bound: the certificate's upper bound on the token's margin (its logit minus the largest "
            f"other logit) anywhere in {_domain_words(doc['domain'])}; at most 0: it never wins; a tiny positive "
            f"bound (within the residual tolerance): it leads by no more than that")


def _number(value: float | None, missing: str) -> str:
    return missing if value is None else f"{value:.1e}"


def _certificate_fact(finding: dict, doc: dict, explained: bool) -> str:
    """The number a finding rests on, worded for its verdict and domain."""
    verdict = finding["verdict"]
    if verdict == "unargmaxable":
        residual = _number(finding["residual"], "not stated")
        # "unbounded hull" (norm domain): inside the hull of the rows as given, a distance, not a dual bound
        if doc["domain"] in ("unbounded", "nonneg") or finding.get("stage") == "unbounded hull":
            return f"residual {residual}"
        # in a bounded domain the certificate's number is s_D(w_k - sum a_i w_i) + b_k - sum a_i b_i,
        # an upper bound on the token's margin over the domain, not a distance between rows; it may be
        # positive within the residual tolerance when the hull certificate is what was accepted
        if explained or finding["residual"] is None:
            return f"dual bound {residual}"
        where = _domain_words(doc["domain"])
        if finding["residual"] <= 0:
            return f"dual bound {residual} (no point of {where} lets it win)"
        return f"dual bound {residual} (nowhere in {where} does it lead by more)"
    if verdict == "tied":
        return f"group {finding['group_verdict']}"
    if verdict == "low-ceiling":
        return f"max probability {finding['max_probability']['lower']:.4f}"
    bounds = finding["bounds"] or {}
    return (f"margin in [{_number(bounds.get('margin_lower'), '-inf')}, "
            f"{_number(bounds.get('margin_upper'), 'inf')}]")


def evidence(finding: dict, doc: dict) -> str:
    """What a finding rests on: its explanation in plain words when there is one, with the number."""
    explanation = finding.get("explanation") or ""
    fact = _certificate_fact(finding, doc, explained=bool(explanation))
    return f"{explanation} ({fact})" if explanation else fact


def competitors(finding: dict, with_tokens: bool) -> str:
    """The largest convex weights (id, token string, weight), or the tie group."""
    if finding["verdict"] == "tied":
        return "same row as " + ", ".join(str(i) for i in finding["tied_with"] or [])
    if not finding["competitors"]:
        return ""
    shown = ", ".join(f"{c['id']}{' ' + token_label(c['token']) if with_tokens else ''} {c['weight']:.2g}"
                      f"{' (cannot win)' if c.get('can_win') is False else ''}"
                      for c in finding["competitors"][:3])
    more = finding["support"] - min(3, len(finding["competitors"]))
    return shown + (f" (+{more} more)" if more > 0 else "")


def fixed_line(doc: dict) -> str | None:
    """With a baseline: the findings it had that this audit no longer has."""
    baseline = doc.get("baseline")
    if not baseline:
        return None
    fixed = baseline.get("fixed") or []
    if not fixed:
        return f"fixed since the baseline: none (baseline {baseline.get('path')})"
    listed = ", ".join(f"{f['id']}{'' if f.get('token') is None else ' ' + token_label(f['token'])} {f['verdict']}"
                       for f in fixed[:SHOWN_PER_VERDICT])
    more = len(fixed) - SHOWN_PER_VERDICT
    noun = "finding" if len(fixed) == 1 else "findings"
    return (f"fixed since the baseline: {len(fixed)} {noun}: {listed}" + (f", … and {more} more" if more > 0 else "")
            + f" (baseline {baseline.get('path')})")


def failing_line(doc: dict) -> str:
    """The closing count: how many findings fail the run, and why the others do not."""
    failing = doc["summary"]["failing"]
    line = f"{failing} failing finding{'s' if failing != 1 else ''}"
    passing = len(doc["findings"]) - failing
    if passing > 0:
        line += (f" ({passing} pass: allowed, unchanged since the baseline, or not in --fail-on)"
                 if doc.get("baseline") else f" ({passing} allowed or not in --fail-on)")
    return line
