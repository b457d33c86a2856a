"""One self-contained HTML page: the summary, a findings table to filter and sort, and plots.

Nothing is loaded from the network: CSS, script and figures (matplotlib SVG) are inline,
and a Content-Security-Policy forbids any fetch. Every string from the checkpoint is
escaped; the script reads its data from the DOM, so no token string ever lands in it.
"""

from __future__ import annotations

import html
import shlex
from pathlib import Path

from auditor._version import __version__
from auditor.errors import InputError
from auditor.findings.explain import id_ranges
from auditor.findings.gate import DEFAULT_FAIL_ON, GateResult
from auditor.formats._common import (FINDING_ORDER, competitors, evidence, has_token_strings, head_lines,
                                     grouped_findings, is_failing, left_out_line, token_label, verdict_counts)
from auditor.formats._plots import draw_plots
from auditor.formats.json_format import document
from auditor.formats.plot_data import plot_data

_ROWS_PER_VERDICT = 2000  # table rows per verdict; the JSON report lists every finding

PLOTS_MISSING = "--format html draws its plots with matplotlib: pip install 'auditor[plots]'"


def require_matplotlib() -> None:
    """Raise InputError unless matplotlib can be imported; the CLI calls it before loading anything."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise InputError(PLOTS_MISSING) from None


def _e(text) -> str:
    """Escaped text, quotes included (it also goes into attributes); lone surrogates become \\udxxx."""
    escaped = html.escape(str(text), quote=True)
    return escaped.encode("utf-8", "backslashreplace").decode("utf-8")


# -- the summary (read from the JSON document, like the text and markdown formats) ---------------

_BANNER_TOKENS = 8  # failing tokens the banner names; the table lists them all


def _status(doc: dict) -> tuple[str, str]:
    """(verdict word, what the exit code means for this run)."""
    failing = doc["summary"]["failing"]
    quiet = len(doc["findings"]) - failing
    if failing:
        verdicts = ", ".join(doc["fail_on"])
        are = "are" if failing != 1 else "is"
        nor = " nor unchanged since the baseline" if doc.get("baseline") else ""
        named = [f"{f['id']} {token_label(f['token'])}" for f in doc["findings"] if is_failing(f, doc)]
        shown = ", ".join(named[:_BANNER_TOKENS]) + (f" and {len(named) - _BANNER_TOKENS} more"
                                                     if len(named) > _BANNER_TOKENS else "")
        return "fails", (f"Exit code 1: {failing} finding{'s' if failing != 1 else ''} {are} of a class listed "
                         f"in --fail-on ({verdicts}) and {are} not allowed{nor}: {shown}.")
    why = "allowed, unchanged since the baseline or not in --fail-on" if doc.get("baseline") else \
        "allowed or not in --fail-on"
    extra = f" ({quiet} finding{'s are' if quiet != 1 else ' is'} {why})" if quiet else ""
    return "passes", f"Exit code 0: no failing finding{extra}."


def _facts(doc: dict) -> str:
    rows = head_lines(doc) + [("tokens", doc["head"].get("token_strings") or "no token strings found")]
    cells = "".join(f"<tr><th scope=\"row\">{_e(label)}</th><td>{_e(value)}</td></tr>" for label, value in rows)
    return f'<table class="facts">{cells}</table>'


def _counts(doc: dict) -> str:
    counts = verdict_counts(doc)
    low = sum(f["verdict"] == "low-ceiling" for f in doc["findings"])
    if low:
        counts["low-ceiling"] = low
    tiles = "".join(f'<li class="v-{_e(name)}"><span class="count">{count}</span> {_e(name)}</li>'
                    for name, count in counts.items())
    return f'<ul class="counts" aria-label="verdict counts">{tiles}</ul>'


def _list(title: str, lines: list[str], css: str) -> str:
    if not lines:
        return ""
    items = "".join(f"<li>{_e(line)}</li>" for line in lines)
    return f'<h3>{_e(title)}</h3><ul class="{css}">{items}</ul>'


def _baseline(doc: dict) -> str:
    baseline = doc.get("baseline")
    if not baseline:
        return ""
    fixed = baseline.get("fixed") or []
    text = f"<h3>Baseline</h3><p>Compared with <code>{_e(baseline.get('path'))}</code>: "
    if not fixed:
        return text + "no earlier finding is fixed.</p>"
    items = "".join(f"<li>{_e(item['id'])} <code>{_e(token_label(item.get('token')))}</code> "
                    f"was {_e(item['verdict'])}</li>" for item in fixed)
    return text + f"{len(fixed)} earlier finding{'s are' if len(fixed) != 1 else ' is'} fixed:</p>" \
                  f'<ul class="fixed">{items}</ul>'


def _summaries(doc: dict) -> str:
    """The summary lines, each with its next step: what it means for generation and what people usually do."""
    lines, steps = doc.get("summaries", []), doc.get("next_steps") or []
    if not lines:
        return ""
    items = "".join(f"<li>{_e(line)}" + (f'<p class="next">Next: {_e(steps[index])}</p>' if index < len(steps)
                                         else "") + "</li>" for index, line in enumerate(lines))
    return f'<h3>What the findings are</h3><ul class="summaries">{items}</ul>'


def _summary(doc: dict) -> str:
    notes = list(doc.get("notes", [])) + list(doc.get("warnings", []))
    return ('<section id="summary"><h2>Summary</h2>' + _facts(doc) + _counts(doc)
            + _summaries(doc) + _list("Notes", notes, "notes") + _baseline(doc) + "</section>")


# the words of the report that are not everyday ones, in plain words first
GLOSSARY = (
    ("margin", "a token's logit minus the largest other logit, at one hidden state: positive where the token is "
               "the top prediction. An argmaxable token's certificate is a hidden state (its witness) with a "
               "positive margin."),
    ("residual", "how far a mix of other rows, with weights that sum to 1, is from the token's own row. A residual "
                 "at rounding level (1e-14, say) means the row is inside their hull: whatever the hidden state, one "
                 "of those tokens scores at least as high, so the token is never the top prediction."),
    ("dual bound", "in a bounded domain (a ball, a box, the final norm's outputs): the certificate's upper bound on "
                   "the token's margin anywhere in the domain. At most 0: the token never wins there."),
    ("group verdict", "for tied tokens, whose rows are identical: whether the group as a whole can be the top "
                      "prediction. Greedy decoding returns the first maximal logit, so when the group leads it emits "
                      "the lowest id and never the others; when the group is unargmaxable, no member is ever "
                      "emitted."),
    ("never-emitted", "the --fail-on class of every token greedy decoding can never produce: unargmaxable tokens, "
                      "every member of an unargmaxable group, and every tied token but the lowest id of its group."),
)


def _glossary() -> str:
    terms = "".join(f"<dt>{_e(term)}</dt><dd>{_e(meaning)}</dd>" for term, meaning in GLOSSARY)
    return f'<section id="glossary"><h2>Glossary</h2><dl>{terms}</dl></section>'


# -- the findings table -------------------------------------------------------------------------

def _columns(doc: dict) -> list[tuple[str, str]]:
    """(header, sort kind) of each column; the token column only when the head has token strings."""
    columns = [("id", "number")]
    if has_token_strings(doc):
        columns.append(("token", "text"))
    columns += [("verdict", "text"), ("explanation", "text"), ("evidence", "text"),
                ("main competitors (weight)", "text"), ("allowed", "text")]
    if doc.get("baseline"):
        columns.append(("baseline", "text"))
    return columns


def _row(doc: dict, finding: dict) -> str:
    with_tokens = has_token_strings(doc)
    label, explanation = token_label(finding["token"]), finding.get("explanation") or ""
    # the filter box matches id, token and explanation; lower-cased here so the script stays trivial
    token = "" if finding["token"] is None else f'{label} {finding["token"]}'
    search = " ".join([str(finding["id"]), token, explanation]).lower()
    fact = evidence({**finding, "explanation": ""}, doc)  # the explanation has its own column
    cells = [f'<td class="num">{finding["id"]}</td>']
    if with_tokens:
        cells.append(f"<td><code>{_e(label)}</code></td>" if finding["token"] is not None
                     else '<td><span class="none">no string</span></td>')
    cells += [f'<td><span class="badge v-{_e(finding["verdict"])}">{_e(finding["verdict"])}</span></td>',
              f"<td>{_e(explanation)}</td>", f'<td class="evidence">{_e(fact)}</td>',
              f"<td>{_e(competitors(finding, with_tokens))}</td>", f"<td>{'yes' if finding['allowed'] else ''}</td>"]
    if doc.get("baseline"):
        cells.append(f"<td>{_e(finding.get('baseline') or '')}</td>")
    failing = " failing" if is_failing(finding, doc) else ""
    return (f'<tr class="finding{failing}" data-id="{finding["id"]}" data-verdict="{_e(finding["verdict"])}" '
            f'data-search="{_e(search)}">{"".join(cells)}</tr>')


def _findings(doc: dict) -> str:
    findings = doc["findings"]
    title = f'<section id="findings"><h2>Findings ({len(findings)})</h2>'
    if not findings:
        return title + "<p>No token is unargmaxable, tied, inconclusive or below the probability ceiling.</p></section>"
    options = "".join(f'<option value="{v}">{v}</option>' for v in FINDING_ORDER)
    controls = ('<div class="controls" role="search">'
                '<label>Filter <input type="search" id="q" placeholder="id, token or explanation"></label> '
                f'<label>Verdict <select id="verdict"><option value="">all</option>{options}</select></label> '
                '<span id="shown" aria-live="polite"></span></div>')
    header = "".join(f'<th scope="col" data-sort="{kind}"><button type="button">{_e(name)}</button></th>'
                     for name, kind in _columns(doc))
    listed, left_out = _listed(doc)
    rows = "".join(_row(doc, f) for f in listed)
    more = "".join(f'<p class="more">{_e(left_out_line(verdict, rest, doc))}</p>' for verdict, rest in left_out)
    return (title + controls + '<div class="scroll"><table id="findings-table">'
            f"<thead><tr>{header}</tr></thead><tbody>{rows}</tbody></table></div>{more}</section>")


def _listed(doc: dict) -> tuple[list[dict], list[tuple[str, list[dict]]]]:
    """The findings in the table (by id) and, per verdict, those left out: a page stays light in a
    browser even when a ceiling flags most of a large vocabulary. Failing findings are listed first."""
    groups = grouped_findings(doc, _ROWS_PER_VERDICT)
    listed = sorted((f for _, shown, _ in groups for f in shown), key=lambda f: f["id"])
    return listed, [(verdict, rest) for verdict, _, rest in groups if rest]


# -- plots and footer ---------------------------------------------------------------------------

def _plots(plots) -> str:
    figures = "".join(f'<figure class="plot" id="plot-{plot.name}">{plot.svg}'
                      f"<figcaption>{_e(plot.caption)}</figcaption></figure>" for plot in plots)
    return f'<section id="plots"><h2>Plots</h2>{figures}</section>'


def reproduce_command(result: GateResult, output: Path | None = None, certificates: Path | None = None) -> str:
    """The commands that make this report again and re-check its certificates, one per line.

    The ``audit`` command writes the page to ``output`` (stdout when None), as the run did, and the certificates
    to ``certificates`` (``certificates.json`` when the run kept none: the report is the same either way); the
    ``audit-verify`` command re-checks that file against the same head. The allow-list's path is not recorded.
    """
    head, report = result.head, result.report
    path = str(head.path) if head.path else "PATH"
    tensors = ["--weight", head.weight_name, "--bias", head.bias_name or "none"]
    domain = str(report.domain)
    unit_offset = domain == "norm" and head.final_norm is not None and head.final_norm.unit_offset
    base = ["--base", head.adapter_base] if head.adapter_base is not None else []
    words = ["audit", path, *tensors, *base]
    if head.vocab_file is not None:
        words += ["--vocab", str(head.vocab_file)] + (["--vocab-offset", str(head.vocab_offset)]
                                                      if head.vocab_offset else [])
    if domain != "unbounded":
        words += ["--domain", domain]
    if unit_offset:
        words.append("--norm-unit-offset")
    if result.ceiling is not None:
        words += ["--ceiling", f"{result.ceiling:g}"]
    if result.shard:
        words += ["--shard", f"{result.shard['index']}/{result.shard['count']}"]
    if report.counts["undecided"]:
        decided = sorted(set(range(report.n_tokens)) - set(report.ids("undecided")))
        if not result.shard or len(decided) != result.shard["stop"] - result.shard["first"]:
            words += ["--tokens", id_ranges(decided, limit=None, separator=",", dash="-")]
    if result.fail_on != DEFAULT_FAIL_ON:
        words += ["--fail-on", ",".join(sorted(result.fail_on)) or "none"]
    if any(f.allowed for f in result.findings):
        words += ["--allow", "ALLOW-LIST"]
    if result.baseline is not None:
        words += ["--baseline", str(result.baseline.get("path"))]
    kept = str(certificates) if certificates is not None else "certificates.json"
    words += ["--certificates", kept, "--format", "html"]
    if output is not None:
        words += ["--output", str(output)]
    check = ["audit-verify", kept, path, *tensors, *base] + (["--norm-unit-offset"] if unit_offset else [])
    return shlex.join(words) + "\n" + shlex.join(check)


def _footer(command: str) -> str:
    """``command``: shell commands, one per line (reproduce_command's)."""
    lines = "<br>".join(f'<code class="command">{_e(line)}</code>' for line in command.splitlines())
    return ("<footer><p>auditor " + _e(__version__) + ". Every verdict carries a certificate, which "
            "<code>audit-verify</code> re-checks in plain float64 arithmetic, with no code of the engine that "
            "decided it.</p>"
            f"<p>Reproduce this report and re-check every certificate:<br>{lines}</p></footer>")


# -- the page -----------------------------------------------------------------------------------

_CSP = "default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'; img-src data:"

_STYLE = """
:root { --fail: #b3261e; --pass: #1e7b34; --line: #d0d4d9; --muted: #5b6470; }
* { box-sizing: border-box; }
body { margin: 0; font: 15px/1.45 system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
       color: #1d232a; background: #f6f7f9; }
main { max-width: 1180px; margin: 0 auto; padding: 0 20px 24px; }
header { padding: 18px 20px; color: white; background: var(--pass); }
header.fails { background: var(--fail); }
header h1 { margin: 0 auto; max-width: 1140px; font-size: 24px; }
header p { margin: 4px auto 0; max-width: 1140px; }
section { background: white; border: 1px solid var(--line); border-radius: 6px; padding: 6px 18px 14px;
          margin-top: 16px; }
h2 { font-size: 19px; margin: 10px 0 8px; }
h3 { font-size: 15px; margin: 14px 0 4px; }
code { font: 13px/1.3 ui-monospace, "DejaVu Sans Mono", Menlo, Consolas, monospace; background: #f0f2f4;
       padding: 0 3px; border-radius: 3px; white-space: pre-wrap; overflow-wrap: anywhere; }
table { border-collapse: collapse; }
.facts th { text-align: left; color: var(--muted); font-weight: normal; padding: 1px 18px 1px 0; }
.facts td { padding: 1px 0; overflow-wrap: anywhere; }
.counts { list-style: none; padding: 0; margin: 12px 0 4px; display: flex; flex-wrap: wrap; gap: 8px; }
.counts li { border: 1px solid var(--line); border-left: 5px solid #999; border-radius: 4px; padding: 3px 10px; }
.counts .count { font-weight: 600; font-size: 17px; margin-right: 4px; }
.v-argmaxable { border-left-color: #4c78a8 !important; } .v-unargmaxable { border-left-color: #d62728 !important; }
.v-tied { border-left-color: #ff7f0e !important; } .v-inconclusive { border-left-color: #9467bd !important; }
.v-low-ceiling { border-left-color: #8c564b !important; } .v-undecided { border-left-color: #bbbbbb !important; }
.notes li, .summaries li { margin: 2px 0; }
.summaries .next { margin: 0 0 4px; color: var(--muted); }
#glossary dt { font-weight: 600; margin-top: 6px; } #glossary dd { margin: 0 0 0 18px; }
.controls { display: flex; flex-wrap: wrap; gap: 14px; align-items: center; margin: 6px 0 10px; }
.controls input { width: 18em; padding: 3px 6px; } .controls select { padding: 2px 4px; }
#shown, .more { color: var(--muted); }
.scroll { overflow-x: auto; }
#findings-table { width: 100%; font-size: 14px; }
#findings-table th { position: sticky; top: 0; background: #eef1f4; text-align: left; border-bottom: 2px solid var(--line); }
#findings-table th button { all: unset; cursor: pointer; display: block; padding: 5px 8px; font-weight: 600; }
#findings-table th[aria-sort="ascending"] button::after { content: " \\25B2"; font-size: 10px; }
#findings-table th[aria-sort="descending"] button::after { content: " \\25BC"; font-size: 10px; }
#findings-table td { padding: 4px 8px; border-bottom: 1px solid #eceef1; vertical-align: top; }
#findings-table td.num { text-align: right; font-variant-numeric: tabular-nums; }
#findings-table td.evidence { min-width: 10em; }
.none { color: var(--muted); font-style: italic; white-space: nowrap; }
#findings-table tr.failing td:first-child { box-shadow: inset 3px 0 0 var(--fail); }
.badge { border-left: 5px solid #999; padding: 0 6px; background: #f3f4f6; border-radius: 3px; white-space: nowrap; }
.plot { margin: 10px 0 18px; }
.plot svg { display: block; width: 100%; max-width: 860px; height: auto; }
.plot figcaption { color: var(--muted); max-width: 860px; font-size: 14px; }
footer { color: var(--muted); font-size: 13px; margin-top: 16px; }
"""

# Records script errors in the DOM, so a headless browser's --dump-dom shows them.
_ERROR_HOOK = ('window.onerror = function (message, source, line) { var b = document.body; '
               'b.dataset.scriptErrors = (b.dataset.scriptErrors ? b.dataset.scriptErrors + " | " : "") '
               '+ message + " (line " + line + ")"; };')

_SCRIPT = """
(function () {
  "use strict";
  var table = document.getElementById("findings-table");
  if (table) {
    var query = document.getElementById("q"), verdict = document.getElementById("verdict");
    var shown = document.getElementById("shown"), body = table.tBodies[0];
    var rows = function () { return Array.prototype.slice.call(body.rows); };
    var apply = function () {
      var q = query.value.trim().toLowerCase(), v = verdict.value, count = 0;
      rows().forEach(function (row) {
        var visible = (!v || row.dataset.verdict === v) && (!q || row.dataset.search.indexOf(q) >= 0);
        row.hidden = !visible;
        count += visible ? 1 : 0;
      });
      shown.textContent = count + " of " + body.rows.length + " shown";
    };
    var fromFragment = function () {  // report.html#verdict=tied&q=40 opens filtered
      var params = new URLSearchParams(location.hash.slice(1));
      query.value = params.get("q") || "";
      verdict.value = params.get("verdict") || "";
      apply();
    };
    var toFragment = function () {
      var params = new URLSearchParams();
      if (query.value) { params.set("q", query.value); }
      if (verdict.value) { params.set("verdict", verdict.value); }
      try { history.replaceState(null, "", "#" + params.toString()); } catch (e) { /* file: URLs may refuse */ }
    };
    var sortBy = function (th) {
      var index = th.cellIndex, numeric = th.dataset.sort === "number";
      var ascending = th.getAttribute("aria-sort") !== "ascending";
      Array.prototype.forEach.call(th.parentNode.cells, function (cell) { cell.removeAttribute("aria-sort"); });
      th.setAttribute("aria-sort", ascending ? "ascending" : "descending");
      rows().sort(function (a, b) {
        var x = a.cells[index].textContent, y = b.cells[index].textContent;
        var order = numeric ? parseFloat(x) - parseFloat(y) : x.localeCompare(y);
        return ascending ? order : -order;
      }).forEach(function (row) { body.appendChild(row); });
    };
    query.addEventListener("input", function () { apply(); toFragment(); });
    verdict.addEventListener("change", function () { apply(); toFragment(); });
    window.addEventListener("hashchange", fromFragment);
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (th) {
      th.addEventListener("click", function () { sortBy(th); });
    });
    fromFragment();
  }
  document.body.dataset.ready = "1";
})();
"""


def render(result: GateResult, output: Path | None = None, certificates: Path | None = None) -> str:
    """The whole report as one HTML5 document, whose footer names the files the run writes (``output``: the page,
    stdout when None; ``certificates``). Raises InputError when matplotlib is missing."""
    require_matplotlib()
    doc = document(result)
    return render_page(doc, draw_plots(doc, plot_data(result)), reproduce_command(result, output, certificates))


def render_page(doc: dict, plots: list, command: str) -> str:
    """The page for a JSON document (json_format.document), its plots (_plots.Plot) and the command that made it."""
    word, meaning = _status(doc)
    name = Path(doc["head"]["path"]).name if doc["head"]["path"] else "head"
    return "\n".join([
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>Argmaxability audit of {_e(name)}: {word}</title>",
        f"<style>{_STYLE}</style></head>",
        f"<body><script>{_ERROR_HOOK}</script>",
        f'<header class="{word}"><h1>Argmaxability audit: {word}</h1><p>{_e(meaning)}</p></header>',
        "<main>", _summary(doc), _findings(doc), _glossary(), _plots(plots), _footer(command), "</main>",
        f"<script>{_SCRIPT}</script>",
        "</body></html>",
        "",
    ])
