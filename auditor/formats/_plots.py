"""The HTML report's figures, drawn with matplotlib from the JSON document and its plot data, as inline SVG.

Every figure is a ``matplotlib.figure.Figure`` made directly (never pyplot, whose
global state would leak windows and memory in a long-running process). The
per-row numbers come from auditor/formats/plot_data.py: nothing here reads the head.
"""

from __future__ import annotations

import html
import io
import re
from dataclasses import dataclass

import numpy as np

from auditor.findings.explain import id_ranges
from auditor.formats.plot_data import PlotData

VERDICT_COLOURS = {"argmaxable": "#4c78a8", "unargmaxable": "#d62728", "tied": "#ff7f0e",
                   "inconclusive": "#9467bd", "low-ceiling": "#8c564b"}
_MARKERS = {"unargmaxable": "X", "tied": "D", "inconclusive": "s", "low-ceiling": "v"}
_BACKGROUND = "#4c78a8"
_MAX_POINTS = 20000  # argmaxable rows drawn in the projection; flagged rows are always drawn
_MAX_LABELS = 20  # annotate flagged rows by id only when there are this few


@dataclass
class Plot:
    """One figure of the report: its title, how to read it, and the inline SVG."""

    name: str  # unique within the page: the figure's ids are prefixed with it
    title: str
    caption: str
    svg: str


def _figure(height: float = 4.0):
    from matplotlib.figure import Figure

    return Figure(figsize=(7.2, height), layout="constrained")


def to_svg(figure, name: str, title: str) -> str:
    """The figure as an <svg> element to inline in HTML: no XML prolog, no metadata, ids made unique per figure."""
    import matplotlib

    buffer = io.BytesIO()
    # a fixed hash salt keeps the output byte-identical between runs; rasterised layers stay crisp at 150 dpi
    with matplotlib.rc_context({"svg.hashsalt": name, "svg.fonttype": "path"}):
        figure.savefig(buffer, format="svg", dpi=150, metadata={"Date": None})
    svg = buffer.getvalue().decode("utf-8")
    svg = svg[svg.index("<svg"):]
    svg = re.sub(r"<metadata>.*?</metadata>\s*", "", svg, flags=re.S)
    # several figures share one HTML document, where every id must be unique
    svg = re.sub(r'\bid="([^"]+)"', rf'id="{name}-\1"', svg)
    svg = re.sub(r'(url\(#|href="#)', rf"\1{name}-", svg)
    svg = re.sub(r'<svg ([^>]*?)width="[^"]*" height="[^"]*"', r'<svg \1', svg, count=1)  # CSS sizes it
    return svg.replace("<svg ", f'<svg role="img" aria-label="{html.escape(title)}" ', 1)


def _finished(figure, ax, name: str, title: str, caption: str, *, xlabel: str, ylabel: str, legend: dict) -> Plot:
    """Label the axes, add the legend and the title, and render the figure as the named plot."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(**legend)
    ax.set_title(title)
    return Plot(name, title, caption, to_svg(figure, name, title))


def _label_points(ax, xs, ys, ids, colour, log_x=False, log_y=False):
    """Annotate points by id; points that would print on top of each other share one label."""
    def unit(values, log):
        values = np.log10(values) if log else np.asarray(values, dtype=float)
        span = np.ptp(values) if len(values) > 1 else 0.0
        return (values - values.min()) / span if span > 0 else np.zeros_like(values)

    ux, uy = unit(np.asarray(xs), log_x), unit(np.asarray(ys), log_y)
    clusters: list[list[int]] = []
    for i in np.lexsort((uy, ux)).tolist():
        for cluster in clusters:
            if abs(ux[cluster[0]] - ux[i]) < 0.04 and abs(uy[cluster[0]] - uy[i]) < 0.06:
                cluster.append(i)
                break
        else:
            clusters.append([i])
    # a label near earlier ones moves below or further above its point so that they do not overprint
    offsets = [(6, 6), (6, -16), (6, 20), (6, -30)]
    for number, cluster in enumerate(clusters):
        first = cluster[0]
        crowd = sum(abs(ux[other[0]] - ux[first]) < 0.2 and abs(uy[other[0]] - uy[first]) < 0.2
                    for other in clusters[:number])
        ax.annotate(id_ranges([ids[i] for i in cluster], limit=None), (xs[first], ys[first]), xytext=offsets[crowd % 4],
                    textcoords="offset points", fontsize=8, color=colour, zorder=6,
                    bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none", "alpha": 0.8})


def _finding_positions(doc: dict, margins: np.ndarray):
    """For each finding verdict: (ids, the margin to plot or NaN when it has no positive margin).

    Tied tokens carry their group's margin, inconclusive ones the upper bound of theirs,
    low-ceiling ones (argmaxable) their own; unargmaxable ones have none.
    """
    groups: dict[str, tuple[list[int], list[float]]] = {}
    for f in doc["findings"]:
        value = f["bounds"]["margin_upper"] if f["verdict"] == "inconclusive" and f["bounds"] else margins[f["id"]]
        value = value if value is not None and np.isfinite(value) and value > 0 else np.nan
        ids, values = groups.setdefault(f["verdict"], ([], []))
        ids.append(f["id"])
        values.append(value)
    return {verdict: (ids, np.array(values)) for verdict, (ids, values) in groups.items()}


_FINDING_NOTE = {"unargmaxable": "", "tied": " at the group's margin", "inconclusive": " at the margin's upper bound",
                 "low-ceiling": ""}


def _margin_range(values: np.ndarray) -> tuple[float, float]:
    positive = values[np.isfinite(values) & (values > 0)]
    if not len(positive):
        return 1e-3, 1.0
    return float(positive.min()), float(max(positive.max(), positive.min() * 10))


def margin_histogram(doc: dict, data: PlotData) -> Plot:
    margins = data.margins
    shown = margins[data.argmaxable]
    shown = shown[np.isfinite(shown) & (shown > 0)]
    findings = _finding_positions(doc, margins)
    low, high = _margin_range(np.concatenate([shown] + [v for _, v in findings.values()]))
    edge = low / 8  # findings without a positive margin sit in a band left of every margin
    figure = _figure()
    ax = figure.add_subplot()
    bins = np.geomspace(low, high * 1.001, 60)
    counts, _ = np.histogram(shown, bins)
    # limits set before drawing, never autoscaled: there may be no bar at all
    ax.set_xscale("log")
    ax.set_xlim(edge / 3, high * 1.5)
    # counts on a log axis: the few tokens in the thin tail of small margins are the ones worth seeing
    ax.set_yscale("log")
    ax.set_ylim(0.7, max(float(counts.max(initial=1)) * 1.8, 2.0))
    ax.hist(shown, bins=bins, color=VERDICT_COLOURS["argmaxable"], label=f"argmaxable ({len(shown)} tokens)")
    if any(np.isnan(values).any() for _, values in findings.values()):
        ax.axvspan(edge / 3, edge * 3, color="#eeeeee", zorder=0)
        ax.text(edge, 0.5, "margin ≤ 0 (cannot win)", transform=ax.get_xaxis_transform(), rotation=90,
                ha="center", va="center", fontsize=8, color="#555555")
    for verdict, (ids, values) in findings.items():
        x = np.where(np.isnan(values), edge, values)
        ax.vlines(x, 0, 0.12, transform=ax.get_xaxis_transform(), colors=VERDICT_COLOURS[verdict], linewidth=2,
                  label=f"{verdict} ({len(ids)}){_FINDING_NOTE[verdict]}", zorder=4)
    caption = ("Each bar counts argmaxable tokens by their certified margin over the runner-up; ticks at the bottom "
               "mark findings, and tokens far to the left are the argmaxable ones closest to losing.")
    return _finished(figure, ax, "margins", "How far each token's witness puts it ahead", caption,
                     xlabel=_margin_label(doc) + ", log scale", ylabel="tokens, log scale",
                     legend=dict(loc="best", fontsize=8, framealpha=0.9))


def _margin_label(doc: dict, formula: bool = True) -> str:
    # an unbounded head without bias quotes its margins for z / ||z||, a scale-free number
    unit_ball = doc["domain"] in ("unbounded", "nonneg") and doc["head"]["bias"] is None
    return ("margin min_i (l_k(z) − l_i(z))" if formula else "margin") + (" on the unit ball" if unit_ball else "")


def norm_scatter(doc: dict, data: PlotData) -> Plot:
    margins, argmaxable, norms = data.margins, data.argmaxable, data.geometry.norms
    findings = _finding_positions(doc, margins)
    flagged = np.zeros(len(margins), dtype=bool)
    for ids, _ in findings.values():
        flagged[ids] = True
    background = argmaxable & ~flagged & np.isfinite(margins) & (margins > 0)
    low, high = _margin_range(np.concatenate([margins[background]] + [v for _, v in findings.values()]))
    floor = low / 8  # where rows without a positive margin are drawn
    figure = _figure(4.4)
    ax = figure.add_subplot()
    ax.set_yscale("log")
    ax.scatter(norms[background], margins[background], s=3, alpha=0.35, linewidths=0,
               color=VERDICT_COLOURS["argmaxable"], rasterized=True, label=f"other argmaxable rows ({background.sum()})")
    if any(np.isnan(values).any() for _, values in findings.values()):
        ax.axhspan(floor / 3, floor * 3, color="#eeeeee", zorder=0)
        ax.text(0.99, floor, "margin ≤ 0 (cannot win)", transform=ax.get_yaxis_transform(), ha="right", va="center",
                fontsize=8, color="#555555")
    labels = ([], [], [])
    for verdict, (ids, values) in findings.items():
        y = np.where(np.isnan(values), floor, values)
        ax.scatter(norms[ids], y, s=40, marker=_MARKERS[verdict], color=VERDICT_COLOURS[verdict],
                   edgecolors="black", linewidths=0.5, zorder=5, label=f"{verdict} ({len(ids)})")
        for part, values in zip(labels, (norms[ids], y, ids)):
            part.extend(np.asarray(values).tolist())
    if 0 < len(labels[2]) <= _MAX_LABELS:
        _label_points(ax, *labels, colour="#222222", log_y=True)
    ax.set_ylim(floor / 3, high * 3)
    caption = ("Each dot is a row of the head: short rows with small margins are the ones that barely win, and "
               "the marked findings show whether the rows that cannot win are short (mean-initialised) or copies.")
    return _finished(figure, ax, "norms", "Row norm against margin", caption, xlabel="row norm ‖w_k‖",
                     ylabel=_margin_label(doc, formula=False) + ", log scale",
                     legend=dict(loc="upper left", fontsize=8, frameon=False))


def projection_scatter(doc: dict, data: PlotData) -> Plot:
    found = [f["id"] for f in doc["findings"]]
    flagged = np.zeros(len(data.argmaxable), dtype=bool)
    flagged[found] = True
    background = np.nonzero(~flagged)[0]
    if len(background) > _MAX_POINTS:  # a fixed subsample: the same picture for the same head
        background = np.sort(np.random.default_rng(0).choice(background, _MAX_POINTS, replace=False))
    points = data.geometry.projection
    figure = _figure(5.2)
    ax = figure.add_subplot()
    sampled = f", {len(background)} shown" if len(background) < (~flagged).sum() else ""
    ax.scatter(points[background, 0], points[background, 1], s=3, alpha=0.3, linewidths=0, color=_BACKGROUND,
               rasterized=True, label=f"other rows ({(~flagged).sum()}{sampled})")
    by_verdict: dict[str, list[int]] = {}
    for f in doc["findings"]:
        by_verdict.setdefault(f["verdict"], []).append(f["id"])
    for verdict, ids in by_verdict.items():
        ax.scatter(points[ids, 0], points[ids, 1], s=44, marker=_MARKERS[verdict], color=VERDICT_COLOURS[verdict],
                   edgecolors="black", linewidths=0.5, zorder=5, label=f"{verdict} ({len(ids)})")
    if 0 < len(found) <= _MAX_LABELS:
        _label_points(ax, points[found, 0], points[found, 1], found, colour="#222222")
    caption = ("A 2-D shadow of the rows around their mean: mean-initialised rows sit at the origin, deep inside "
               "the cloud; a row can look inside here and still win in the full space, so the certificates decide.")
    explained = data.geometry.explained
    return _finished(figure, ax, "projection", "The rows seen along their two main directions", caption,
                     xlabel=f"principal direction 1 ({explained[0]:.1%} of the variance)",
                     ylabel=f"principal direction 2 ({explained[1]:.1%})",
                     legend=dict(loc="best", fontsize=8, frameon=True, framealpha=0.85))


def ceiling_histogram(doc: dict, data: PlotData) -> Plot:
    upper, ceiling = data.ceilings, doc["ceiling"]
    has_ceiling = np.isfinite(upper)
    shown = upper[has_ceiling]
    figure = _figure()
    ax = figure.add_subplot()
    low = max(float(shown.min()), 1e-300) if len(shown) else 1e-3
    log = low < 1e-2 * float(shown.max(initial=1.0))  # a log axis only when the ceilings span decades
    bins = np.geomspace(low, 1.0, 50) if log else np.linspace(0.0, 1.0, 50)
    if log:
        ax.set_xscale("log")
    stacks, colours, labels = [], [], []
    for verdict in ("argmaxable", "unargmaxable", "tied", "inconclusive"):
        values = upper[data.verdict == verdict]
        values = values[np.isfinite(values)]
        if len(values):
            below = int((values < ceiling).sum())
            stacks.append(values)
            colours.append(VERDICT_COLOURS[verdict])
            labels.append(f"{verdict} ({len(values)}, {below} below {ceiling:g})")
    ax.hist(stacks, bins=bins, stacked=True, color=colours, label=labels)
    ax.axvline(ceiling, color=VERDICT_COLOURS["low-ceiling"], linestyle="--", linewidth=1.5,
               label=f"--ceiling {ceiling:g}")
    caption = ("Each bar counts tokens by the largest probability any hidden state in the domain can give them; "
               "argmaxable tokens left of the dashed line can never reach the --ceiling probability.")
    return _finished(figure, ax, "ceilings", "Probability ceilings", caption,
                     xlabel="largest reachable softmax probability" + (", log scale" if log else ""), ylabel="tokens",
                     legend=dict(loc="upper left", fontsize=8, frameon=False))


def draw_plots(doc: dict, data: PlotData) -> list[Plot]:
    """The report's figures: margins, norm against margin, the projection and, when computed, the ceilings."""
    plots = [margin_histogram(doc, data), norm_scatter(doc, data), projection_scatter(doc, data)]
    if doc["ceiling"] is not None and np.isfinite(data.ceilings).any():
        plots.append(ceiling_histogram(doc, data))
    return plots
