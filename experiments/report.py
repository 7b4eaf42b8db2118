"""Charts as functions from the tidy tables to plotly figures, and one self-contained HTML report
(plotly.js embedded once, so the file opens offline).

The x-axis is the sweep's load axis: utilisation (open loop), or concurrency (closed-loop clients,
log scale). A concurrency sweep measures no capacity, so the charts that need one (cost with the
rack sized to each variant's capacity, quality against cost at capacity, the capacity curve) give
way to throughput against clients, which is that sweep's own closed-loop curve."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from experiments.analysis import (
    FADE_LEVELS,
    FAMILIES,
    FAMILY_TITLES,
    HEADLINE,
    SPEEDUP_METRICS,
    cheapest,
    cost_column,
    crossovers,
    families,
    load_axis,
    own_references,
)
from experiments.pairs import pair_lines, pair_speedups
from sim.attribution import CAUSE_NAMES, CAUSES

PALETTE = ("#1f77b4", "#d62728", "#ff7f0e", "#9467bd", "#2ca02c", "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")
# one colour per strategy in every chart (sweep report, plan report, compare): the built-in
# strategies by name (all of them told apart), any other name by a hash of it into OTHER_COLOURS
# (the same name, the same colour, everywhere; `panel_colours` moves a clash within one figure)
STRATEGY_COLOURS = {"baseline": "#1f77b4", "draft-1b": "#d62728", "draft-1b-adaptive": "#ff7f0e", "eagle": "#9467bd",
                    "eagle3": "#222222", "eagle3-tree": "#00a08a", "distilled-8b": "#2ca02c",
                    "distilled-8b+draft-1b": "#17becf", "fp8": "#8c564b", "fp8+draft-1b": "#e377c2", "ngram": "#bcbd22",
                    "mtp": "#b8860b", "self-spec": "#4b0082", "self-spec-layer-skip": "#800000", "suffix": "#74c476"}
OTHER_COLOURS = ("#e7298a", "#fdae6b", "#7f7f7f", "#6baed6", "#17375e", "#556b2f", "#a6d854", "#c49c94", "#a55194",
                 "#000080", "#b3b3b3", "#e6550d")  # none of them a built-in strategy's
MIN_DISTANCE = 100.0  # two colours closer than this ("redmean" RGB distance) are too alike to share a figure
NONE_COLOUR = "#d9d9d9"  # "no strategy passes": grey, never a strategy's colour


def colour_of(name: str) -> str:
    """The fixed colour of a strategy (or sweep variant) by its name."""
    import zlib

    if name in STRATEGY_COLOURS:
        return STRATEGY_COLOURS[name]
    if name == "none":
        return NONE_COLOUR
    return OTHER_COLOURS[zlib.crc32(name.encode()) % len(OTHER_COLOURS)]


def colour_distance(a: str, b: str) -> float:
    """How far apart two colours look: the "redmean" weighted RGB distance (0 to about 765)."""
    r1, g1, b1 = (int(a[i:i + 2], 16) for i in (1, 3, 5))
    r2, g2, b2 = (int(b[i:i + 2], 16) for i in (1, 3, 5))
    r = (r1 + r2) / 2
    return float(((2 + r / 256) * (r1 - r2) ** 2 + 4 * (g1 - g2) ** 2 + (2 + (255 - r) / 256) * (b1 - b2) ** 2) ** 0.5)


def panel_colours(names: list[str]) -> dict[str, str]:
    """The colours of the variants one figure shows: each its fixed `colour_of`, except that a name
    whose hashed colour is too like one already in this figure (MIN_DISTANCE) takes the next one
    of OTHER_COLOURS that is not (names in sorted order: the same set of names always gets the
    same colours, and a name alone in a figure always its own)."""
    out = {n: colour_of(n) for n in names if n in STRATEGY_COLOURS or n == "none"}
    used = list(out.values())
    for n in sorted(set(names) - set(out)):
        i = OTHER_COLOURS.index(colour_of(n))
        ring = [OTHER_COLOURS[(i + k) % len(OTHER_COLOURS)] for k in range(len(OTHER_COLOURS))]
        far = [c for c in ring if all(colour_distance(c, u) >= MIN_DISTANCE for u in used)]
        c = far[0] if far else max(ring, key=lambda c: min((colour_distance(c, u) for u in used), default=1e9))
        out[n] = c
        used.append(c)
    return {n: out[n] for n in names}


def _colour(names: list[str]) -> dict[str, str]:
    return panel_colours(names)


MAX_LINES = 6  # lines per panel: the reference and at most five others


def facet_groups(names: list[str], fams: dict[str, str] | None = None,
                 reference: str | None = None) -> list[tuple[str, list[str]]]:
    """The rows of a faceted chart: (title, variants), the reference first in every row, at most
    MAX_LINES variants a row. Variants are taken family by family (`analysis.families`, in
    FAMILIES order); a family too big for a row is split, small ones share a row while they fit."""
    names = list(dict.fromkeys(names))
    ref = reference if reference in names else None
    cap = MAX_LINES - (ref is not None)
    fams = fams or {}
    order = [*FAMILIES, ""]
    by_family: dict[str, list[str]] = {}
    for n in names:
        if n != ref:
            by_family.setdefault(fams.get(n, "") if fams.get(n, "") in FAMILIES else "", []).append(n)
    chunks: list[tuple[str, list[str]]] = []
    for f in sorted(by_family, key=order.index):
        members = by_family[f]
        k = -(-len(members) // cap)
        for i in range(k):
            part = members[i * cap:(i + 1) * cap]
            chunks.append((FAMILY_TITLES.get(f, f) + (f" ({i + 1}/{k})" if k > 1 else "") if f else "", part))
    rows: list[tuple[list[str], list[str]]] = []
    for title, part in chunks:
        if rows and len(rows[-1][1]) + len(part) <= cap:
            rows[-1][0].append(title)
            rows[-1][1].extend(part)
        else:
            rows.append(([title], list(part)))
    out = [(_and([t if k == 0 else t.lower() for k, t in enumerate(t for t in titles if t)]),
            ([ref] if ref else []) + members) for titles, members in rows]
    return out or [("", [ref] if ref else [])]


def _and(items: list[str]) -> str:
    """'a', 'a and b', 'a, b and c'."""
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1] if items else ""


def _groups(df: pd.DataFrame, reference: str | None = None,
            groups: list[tuple[str, list[str]]] | None = None) -> list[tuple[str, list[str]]]:
    """The rows of a results table's faceted charts: `groups` when given, else its variants by
    family (the reference: `reference`, else the first variant, as a sweep file's default)."""
    if groups is not None:
        return groups
    names = [str(v) for v in dict.fromkeys(df.variant)]
    ref = reference if reference is not None else (names[0] if names else None)
    fams = families(df, ref) if ref is not None and "speculative_method" in df else None
    return facet_groups(names, fams, ref)


def _sp_groups(sp: pd.DataFrame) -> list[tuple[str, list[str]]]:
    """The rows of a speedups table's chart with no families given: its reference (the variant
    whose speedup is exactly 1 everywhere, the sweep's reference) in each, at most MAX_LINES a row."""
    names = [str(v) for v in dict.fromkeys(sp.variant)]
    ones = sp.groupby("variant", sort=False)[["mean", "ci_low", "ci_high"]].agg(lambda s: bool((s == 1.0).all()))
    refs = [str(v) for v, r in ones.iterrows() if r.all()]
    return facet_groups(names, None, refs[0] if refs else None)


def _facets(groups: list[tuple[str, list[str]]], titles: tuple[str, ...] | list[str], row_height: int,
            **kw: Any) -> go.Figure:
    """Rows of panels, one row per group (its title beside each panel's), one column per title."""
    n = len(groups)
    fig = make_subplots(rows=n, cols=len(titles), subplot_titles=[t for _ in groups for t in titles],
                        vertical_spacing=min(0.14, 0.36 / n) if n > 1 else 0.1, **kw)
    fig.update_layout(height=max(400, 120 + row_height * n))
    return fig


def _row_legends(fig: go.Figure, groups: list[tuple[str, list[str]]]) -> None:
    """One legend per row of panels, beside it, titled by the row's families, listing its variants;
    the x-axis titles on the bottom row only."""
    ncols = max(1, len([k for k in fig.layout if k.startswith("xaxis")]) // max(len(groups), 1))
    for i, (title, _) in enumerate(groups):
        axis = fig.layout[f"yaxis{'' if i == 0 else i * ncols + 1}"]
        fig.update_layout({_legend(i + 1): {"y": axis.domain[1], "yanchor": "top", "x": 1.02, "xanchor": "left",
                                            "tracegroupgap": 2, "title": {"text": _wrap(title)}}})
        if i + 1 < len(groups):
            fig.update_xaxes(title_text="", row=i + 1)
    if ncols >= 3:  # one x-axis title under the middle panel: three side by side would collide
        for c in range(1, ncols + 1):
            if c != (ncols + 1) // 2:
                fig.update_xaxes(title_text="", row=max(len(groups), 1), col=c)


def _axes_of(fig: go.Figure, row: int, col: int) -> tuple[str, str]:
    """The x and y axis names ("x3", "y3") of a panel of a make_subplots figure."""
    ncols = len(fig._grid_ref[0]) if getattr(fig, "_grid_ref", None) else 1
    k = (row - 1) * ncols + col
    return ("x", "y") if k == 1 else (f"x{k}", f"y{k}")


def _hline(fig: go.Figure, y: float, row: int, col: int, colour: str, dash: str, label: str = "") -> None:
    """A horizontal line across one panel (and its label at the right), as `add_hline` draws it,
    without its per-call validation of the whole figure (slow with many panels)."""
    xa, ya = _axes_of(fig, row, col)
    fig.layout.shapes += ({"type": "line", "xref": f"{xa} domain", "x0": 0, "x1": 1, "yref": ya, "y0": y, "y1": y,
                           "line": {"color": colour, "dash": dash}},)
    if label:
        fig.layout.annotations += ({"xref": f"{xa} domain", "x": 1, "xanchor": "right", "yref": ya, "y": y,
                                    "yanchor": "bottom", "text": label, "showarrow": False},)


def _note(fig: go.Figure, row: int, col: int, **kw: Any) -> None:
    """An annotation in one panel (`add_annotation(row=, col=)` without its validation cost)."""
    xa, ya = _axes_of(fig, row, col)
    fig.layout.annotations += ({"xref": xa, "yref": ya, **kw},)


def _wrap(title: str, width: int = 26) -> str:
    """A legend title in bold, broken into lines of about `width` characters."""
    lines: list[str] = []
    for word in title.split():
        if lines and len(lines[-1]) + 1 + len(word) <= width:
            lines[-1] += " " + word
        else:
            lines.append(word)
    return "<br>".join(f"<b>{html.escape(t)}</b>" for t in lines)


def _legend(row: int) -> str:
    return "legend" if row == 1 else f"legend{row}"


def log_ticks(lo: float, hi: float) -> list[float]:
    """Tick values 1-2-5 per decade covering [lo, hi], for log axes: every tick labelled, no
    unlabelled minor digits."""
    if not (lo > 0 and hi > 0 and np.isfinite(lo) and np.isfinite(hi)):
        return []
    for mantissas in ((1.0, 2.0, 5.0), (1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0),
                      tuple(float(m) for m in np.arange(1.0, 10.0, 0.5))):  # finer for a narrow range
        out = [m * 10.0 ** e for e in range(int(np.floor(np.log10(lo))) - 1, int(np.ceil(np.log10(hi))) + 1)
               for m in mantissas if lo / 1.15 <= m * 10.0 ** e <= hi * 1.15]
        if len(out) >= 3:
            return [float(f"{v:.3g}") for v in out]
    return sorted({float(f"{lo:.3g}"), float(f"{hi:.3g}")})


def log_axis(values: Any) -> dict[str, Any]:
    """Layout of a log axis over these values: labelled 1-2-5 ticks only."""
    v = np.asarray(pd.to_numeric(pd.Series(list(values)), errors="coerce"), dtype=float)
    v = v[np.isfinite(v) & (v > 0)]
    ticks = log_ticks(float(v.min()), float(v.max())) if v.size else []
    return {"type": "log", "tickvals": ticks, "ticktext": [f"{t:g}" for t in ticks], "minor": {"showgrid": False}} \
        if ticks else {"type": "log"}


AXIS_TITLES = {"utilisation": "rack utilisation (offered load / baseline capacity)",
               "concurrency": "concurrency (closed-loop clients)"}


def _x_axes(fig: go.Figure, x: str, title: str | None = None, values: Any = None) -> None:
    log = log_axis(values) if values is not None else {"type": "log"}
    fig.update_xaxes(title_text=title or AXIS_TITLES[x], **(log if x == "concurrency" else {}))


def _rgba(hex_colour: str, alpha: float) -> str:
    h = hex_colour.lstrip("#")
    return f"rgba({int(h[0:2], 16)},{int(h[2:4], 16)},{int(h[4:6], 16)},{alpha})"


def speedup_chart(sp: pd.DataFrame, metrics: tuple[str, ...] = (HEADLINE, "e2e_s_p50"),
                  groups: list[tuple[str, list[str]]] | None = None) -> go.Figure:
    """Headline: speedup vs load per variant, mean and 95% CI (error bars) over seeds, the 1.0 line,
    crossovers marked. One column per metric: the per-token pace (TPOT) and the end-to-end latency,
    which also counts queueing and so shows when a speculating rack runs out of capacity. One row
    per family of variants (`groups`, else at most MAX_LINES a row), the reference in each."""
    groups = groups if groups is not None else _sp_groups(sp)
    col = _colour([v for _, members in groups for v in members])
    xa = load_axis(sp)
    fig = _facets(groups, [SPEEDUP_METRICS.get(m, m) for m in metrics], 340)
    for i, (_, members) in enumerate(groups, start=1):
        for j, metric in enumerate(metrics, start=1):
            d = sp[(sp.metric == metric) & sp.variant.isin(members)]
            for v in members:
                g = d[d.variant == v].sort_values(xa)
                if g.empty:
                    continue
                fig.add_trace(go.Scatter(
                    x=g[xa], y=g["mean"], mode="lines+markers", name=v, legendgroup=v, showlegend=j == 1,
                    legend=_legend(i), line={"color": col[v]}, marker={"size": 6},
                    error_y={"type": "data", "symmetric": False, "array": g.ci_high - g["mean"],
                             "arrayminus": g["mean"] - g.ci_low, "color": _rgba(col[v], 0.5), "thickness": 1.2},
                    customdata=np.stack([g.ci_low, g.ci_high], axis=1),
                    hovertemplate=f"{v}<br>{xa} %{{x:.2f}}<br>speedup %{{y:.3f}} "
                                  "(95% CI %{customdata[0]:.2f}-%{customdata[1]:.2f})<extra></extra>"), i, j)
            k = 0
            for v, u in crossovers(d, metric).items():
                first = d[d.variant == v].sort_values(xa)["mean"]
                if np.isfinite(u) and len(first) and first.iloc[0] >= 1.0:  # a crossing, not a start below 1
                    # an arrow onto the 1.0 line; on a log axis an annotation's position is in decades
                    _note(fig, i, j, x=float(np.log10(u)) if xa == "concurrency" else u, y=0.0,
                          text=f"{v} {u:.2f}" if xa == "utilisation" else f"{v} {u:.0f}",
                          showarrow=True, arrowhead=2, arrowcolor=col[v], ax=0, ay=28 + 16 * k,
                          font={"size": 10, "color": col[v]})
                    k += 1
            _hline(fig, 1.0, i, j, "#888", "dash")
    _x_axes(fig, xa, values=sp[xa])
    ys = pd.concat([sp.ci_low, sp.ci_high, sp["mean"], pd.Series([1.0])])
    fig.update_yaxes(title_text="speedup (x)", **log_axis(ys))
    ref = next((m[0] for _, m in groups if m and (sp[sp.variant == m[0]]["mean"] == 1.0).all()), "the reference")
    fig.update_layout(title=f"Speedup over {ref} (mean and 95% CI over seeds; arrows mark where it crosses 1.0)",
                      template="plotly_white")
    _row_legends(fig, groups)
    return fig


def _panels(df: pd.DataFrame, columns: tuple[str, ...], titles: tuple[str, ...], scale: tuple[float, ...],
            groups: list[tuple[str, list[str]]] | None = None, row_height: int = 300) -> go.Figure:
    """One column per column of the table, one row per family of variants (`_groups`): the mean
    over seeds vs the load axis, a line per variant."""
    groups = _groups(df, groups=groups)
    fig = _facets(groups, titles, row_height)
    col = _colour([v for _, members in groups for v in members])
    x = load_axis(df)
    agg = df.groupby(["variant", x], sort=False)[list(columns)].mean().reset_index()
    for i, (_, members) in enumerate(groups, start=1):
        for v in members:
            g = agg[agg.variant == v].sort_values(x)
            for j, (c, k) in enumerate(zip(columns, scale, strict=True), start=1):
                fig.add_trace(go.Scatter(x=g[x], y=g[c] * k, name=v, legendgroup=v, showlegend=j == 1,
                                         legend=_legend(i), line={"color": col[v]}), i, j)
    _x_axes(fig, x, AXIS_TITLES.get(x, x), values=df[x])
    _row_legends(fig, groups)
    return fig


def throughput_chart(df: pd.DataFrame, groups: list[tuple[str, list[str]]] | None = None) -> go.Figure:
    """Throughput vs closed-loop clients (a concurrency sweep's own closed-loop curve): requests/s
    and output tokens/s over the measured window, mean over seeds."""
    fig = _panels(df, ("throughput_rps", "throughput_tok_s"), ("requests/s", "output tokens/s"), (1.0, 1.0), groups)
    fig.update_yaxes(rangemode="tozero")
    fig.update_layout(template="plotly_white", title="Throughput vs concurrency (closed loop)")
    return fig


def latency_chart(df: pd.DataFrame, slo: dict[str, float] | None = None,
                  groups: list[tuple[str, list[str]]] | None = None) -> go.Figure:
    """p99 TTFT, p99 TPOT and p99 ITL (gap between streamed chunks) vs utilisation, with the SLO's
    p99 targets drawn where it sets them: drafting can worsen the first, speculation lowers TPOT
    but makes the chunks burstier, so ITL can rise while TPOT falls."""
    slo = slo or {}
    groups = _groups(df, groups=groups)
    fig = _panels(df, ("ttft_s_p99", "tpot_s_p99", "itl_s_p99"),
                  ("p99 time to first token", "p99 time per output token (TPOT)", "p99 inter-token latency (ITL)"),
                  (1.0, 1e3, 1e3), groups)
    for i in range(1, len(groups) + 1):
        for j, (metric, k) in enumerate((("ttft", 1.0), ("tpot", 1e3), ("itl", 1e3)), start=1):
            target = slo.get(f"{metric}_p99_s")
            if target is not None:
                _hline(fig, target * k, i, j, "red", "dot", "SLO")
        fig.update_yaxes(title_text="seconds", rangemode="tozero", row=i, col=1)
        fig.update_yaxes(title_text="milliseconds", rangemode="tozero", row=i, col=2)
        fig.update_yaxes(title_text="milliseconds", rangemode="tozero", row=i, col=3)
    fig.update_layout(template="plotly_white", title="Latency vs load (mean over seeds)")
    return fig


def collapse_cause(c: dict[str, Any]) -> str:
    """Why a deployment's closed-loop throughput falls at full load, in a sentence."""
    kv, slots = int(c.get("kv_sequences") or 0), int(c.get("batch_slots") or 0)
    if kv and slots and kv < slots:
        return (f"its paged KV holds about {kv} sequences of the mean length, fewer than its {slots} batch slots, so "
                "at full load sequences are preempted and recomputed over and over.")
    return "the speculation machinery's overhead grows with the running sequences, so a step grows faster than the batch."


def capacity_chart(capacities: dict[str, dict[str, Any]],
                   groups: list[tuple[str, list[str]]] | None = None) -> go.Figure:
    """Throughput vs requests in the system (closed-loop curves), per variant: where speculation
    stops paying the curve bends over (the peak) and falls towards the full batch (the collapse).
    One row per family of variants (`groups`, else at most MAX_LINES a row)."""
    names = [v for v in capacities if capacities[v].get("curve")]
    groups = [(t, [v for v in m if v in names]) for t, m in groups] if groups is not None else \
        facet_groups(names, None, names[0] if names else None)
    groups = [(t, m) for t, m in groups if m]
    col = _colour(names)
    fig = _facets(groups, ["requests/s vs requests in the system"], 300)
    for i, (_, members) in enumerate(groups, start=1):
        for v in members:
            c = capacities[v]
            x = [r[0] for r in c["curve"]]
            y = [r[1] for r in c["curve"]]
            fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", name=v, line={"color": col[v]}, legendgroup=v,
                                     legend=_legend(i),
                                     hovertemplate=f"{v}<br>%{{x:.0f}} requests in system<br>%{{y:.2f}} req/s"
                                                   "<extra></extra>"), i, 1)
            if c.get("collapse"):
                _note(fig, i, 1, x=c["peak_concurrency"], y=c["peak_rps"], showarrow=True, arrowhead=2, ay=-30,
                      text=f"{v}: peak {c['peak_rps']:.1f}; full batch {c['full_batch_rps']:.1f}",
                      font={"size": 10, "color": col[v]}, arrowcolor=col[v])
    fig.update_xaxes(title_text="requests in the system (closed-loop clients)", row=len(groups), col=1)
    fig.update_yaxes(title_text="requests/s")
    fig.update_layout(template="plotly_white", title="Throughput vs load: the peak, and the collapse where the batch fills")
    _row_legends(fig, groups)
    return fig


def add_sized_cost(df: pd.DataFrame) -> pd.DataFrame:
    """Cost per Mtok if the rack were sized so the variant runs at utilisation u of its *own*
    capacity: rack USD/s / (u x own capacity tok/s) + amortised retraining. Speculation lowers
    a deployment's own capacity, distillation raises it: this is where it shows in dollars."""
    d = df.copy()
    rack_usd_s = d.num_gpus * d.usd_per_gpu_hour / 3600.0
    retrain = d.usd_per_mtok_retraining.fillna(0.0)
    d["usd_per_mtok_sized"] = rack_usd_s / (d.utilisation * d.capacity_tok_s) * 1e6 + retrain
    d["usd_per_mtok_at_capacity"] = rack_usd_s / d.capacity_tok_s * 1e6 + retrain
    return d


def cost_chart(df: pd.DataFrame, groups: list[tuple[str, list[str]]] | None = None) -> go.Figure:
    """Cost per million output tokens vs utilisation, including amortised retraining: on this
    rack at this load (left), and with the rack sized to each variant's own capacity (right)."""
    x = load_axis(df)
    sized = x == "utilisation"  # a concurrency sweep has no capacity to size a rack by
    d = add_sized_cost(df) if sized else df
    groups = _groups(d, groups=groups)
    col = _colour([v for _, members in groups for v in members])
    panels = (("this rack at this load (same traffic for all)", "usd_per_mtok"),
              ("rack sized to the variant (u of its own capacity)", "usd_per_mtok_sized"))[: 2 if sized else 1]
    fig = _facets(groups, [t for t, _ in panels], 300)
    agg = d.groupby(["variant", x], sort=False)[[c for _, c in panels] + ["usd_per_mtok_retraining"]].mean().reset_index()
    for i, (_, members) in enumerate(groups, start=1):
        for v in members:
            g = agg[agg.variant == v].sort_values(x)
            for c, (_, ycol) in enumerate(panels, start=1):
                fig.add_trace(go.Scatter(x=g[x], y=g[ycol], name=v, legendgroup=v, showlegend=c == 1,
                                         legend=_legend(i), line={"color": col[v]}, customdata=g.usd_per_mtok_retraining,
                                         hovertemplate=f"{v}<br>{x} %{{x:.2f}}<br>$%{{y:.2f}}/Mtok "
                                                       f"(retraining $%{{customdata:.3f}})<extra></extra>"), i, c)
    fig.update_yaxes(title_text="USD per million output tokens", rangemode="tozero")
    _x_axes(fig, x, AXIS_TITLES.get(x, x), values=d[x])
    fig.update_layout(template="plotly_white", title="Cost per million output tokens (serving + amortised retraining)")
    _row_legends(fig, groups)
    return fig


def quality_cost_chart(df: pd.DataFrame, floor: float | None = None,
                       groups: list[tuple[str, list[str]]] | None = None) -> go.Figure:
    """Quality (in-distribution and tail) against cost per token at each variant's own capacity:
    the price each option charges; the tail-quality floor drawn when one is set. One row per
    family of variants, the cost axes shared."""
    d = add_sized_cost(df)
    groups = _groups(d, groups=groups)
    col = _colour([v for _, members in groups for v in members])
    g = d.groupby("variant", sort=False)[["usd_per_mtok_at_capacity", "quality_in_distribution", "quality_tail"]].mean()
    fig = _facets(groups, ["quality vs cost at own capacity"], 260, shared_xaxes=True)
    for i, (_, members) in enumerate(groups, start=1):
        if floor is not None:
            _hline(fig, floor, i, 1, "#b00", "dot", f"tail-quality floor {floor:g}")
        for v in members:
            r = g.loc[v]
            fig.add_trace(go.Scatter(x=[r.usd_per_mtok_at_capacity] * 2, y=[r.quality_tail, r.quality_in_distribution],
                                     mode="lines+markers", name=v, line={"color": col[v]}, legend=_legend(i),
                                     marker={"symbol": ["triangle-down", "circle"], "size": 11},
                                     hovertemplate=f"{v}<br>$%{{x:.2f}}/Mtok<br>quality %{{y:.3f}}<extra></extra>"),
                          i, 1)
        fig.update_yaxes(title_text="quality vs teacher", row=i, col=1)
    q = g[["quality_in_distribution", "quality_tail"]].to_numpy(float)
    q = q[np.isfinite(q)]
    if q.size:  # one quality range in every row, a little beyond the values (and the floor)
        lo, hi = min(float(q.min()), floor if floor is not None else 1.0), max(float(q.max()), floor or 0.0)
        fig.update_yaxes(range=[lo - 0.03, hi + 0.03])
    fig.update_xaxes(title_text="USD per million output tokens at the variant's own capacity", row=len(groups), col=1)
    fig.update_layout(template="plotly_white",
                      title="Quality vs cost (circle: in-distribution, triangle: tail; relative to the BF16 teacher)")
    _row_legends(fig, groups)
    return fig


def utilisation_chart(df: pd.DataFrame, groups: list[tuple[str, list[str]]] | None = None) -> go.Figure:
    """Measured GPU busy fraction and model FLOPs utilisation vs offered utilisation."""
    fig = _panels(df, ("gpu_busy_fraction", "mfu"), ("GPU busy fraction (engine stepping)", "model FLOPs utilisation"),
                  (1.0, 1.0), groups)
    fig.update_layout(template="plotly_white", title="What 'spare compute' really was")
    return fig


MAX_FINDINGS = 6  # bullets under "What this run found"; the rest go to its collapsible details
QUALITY_TOLERANCE = 0.02  # tail quality within this of the reference's counts as "no quality lost"


def _axis_fmt(x: str) -> tuple[Any, Any, Any]:
    """at(u): "utilisation 0.30" / "concurrency 16"; short(u): "u=0.30" / "N=16"; approx(u): "u≈0.78"."""
    closed = x == "concurrency"

    def at(u: float) -> str:
        return f"concurrency {u:g}" if closed else f"utilisation {u:.2f}"

    def short(u: float) -> str:
        return f"N={u:g}" if closed else f"u={u:.2f}"

    def approx(u: float) -> str:
        return f"N≈{u:.0f}" if closed else f"u≈{u:.2f}"

    return at, short, approx


def _x(v: float) -> str:
    """A speedup: 2 significant decimals below 10x, 3 figures above."""
    return f"{v:.2f}x" if abs(v) < 10 else f"{v:.3g}x"


def _span(values: list[float]) -> str:
    """'2.13x' or '0.61-2.13x'."""
    lo, hi = min(values), max(values)
    return _x(lo) if f"{lo:.2f}" == f"{hi:.2f}" else f"{_x(lo)[:-1]}-{_x(hi)}"


def _why(df: pd.DataFrame, variant: str, x: str, u: float) -> tuple[float, str, dict[str, float]] | None:
    """The attribution the sweep merged into the rows (`why_<cause>`, `main_cause`) of a variant at
    load u: the change of ln(speedup over its own reference) from the lightest load, its main
    cause and each cause's part; None without them."""
    cols = [f"why_{c}" for c in CAUSES]
    if not set(cols) <= set(df.columns) or "main_cause" not in df:
        return None
    r = df[(df.variant == variant) & (df[x] == u)]
    if r.empty or not isinstance(r.main_cause.iloc[0], str) or not r.main_cause.iloc[0]:
        return None
    why = {c: float(r[f"why_{c}"].iloc[0]) for c in CAUSES}
    total = sum(why.values())
    return (total, str(r.main_cause.iloc[0]), why) if np.isfinite(total) else None


def _runs(best: pd.DataFrame, x: str) -> list[tuple[str, float, float, float, float]]:
    """Consecutive load points with the same cheapest variant: (variant, u0, u1, usd0, usd1)."""
    out: list[tuple[str, float, float, float, float]] = []
    for r in best.itertuples(index=False):
        u, v, usd = float(getattr(r, x)), str(r.variant), float(r.usd)
        if out and out[-1][0] == v:
            out[-1] = (v, out[-1][1], u, out[-1][3], usd)
        else:
            out.append((v, u, u, usd, usd))
    return out


def _cheapest_text(d: pd.DataFrame, candidates: list[str], x: str, column: str) -> str:
    """'baseline at u=0.30 ($5.55), eagle3 at u=0.60-0.85 ($2.78 → $1.96)': the cheapest of the
    candidates at each load, consecutive loads with the same one together."""
    best = cheapest(d, candidates, x, column)
    if best.empty:
        return ""
    _, short, _ = _axis_fmt(x)
    us = sorted(d[x].unique())
    runs = _runs(best, x)
    parts = []
    for v, u0, u1, c0, c1 in runs:
        where = "every load" if len(runs) == 1 and u0 == us[0] and u1 == us[-1] else \
            short(u0) if u0 == u1 else f"{short(u0)}-{u1:g}" if x == "concurrency" else f"{short(u0)}-{u1:.2f}"
        parts.append(f"{v} at {where} (${c0:.2f}" + (f" → ${c1:.2f})" if u0 != u1 else ")"))
    return ", ".join(parts)


def _pct(v: float) -> str:
    """A change in percent with a true minus sign: '−19%', '+4%'."""
    return f"{v:+.0%}".replace("-", "−")


def answer(df: pd.DataFrame, sp: pd.DataFrame, reference: str,
           pairs: tuple[tuple[str, str], ...] | list[tuple[str, str]] = ()) -> list[tuple[str, str, str]]:
    """The top of the report: (id, title, text), first the project's question with its short
    answer, then one paragraph per family of strategies (`analysis.families`): where each one's
    TPOT speedup over the reference falls below 1.5x and below 1.0x (interpolated along the load
    axis), why (the cost attribution where present, the variant's own capacity), and the cheapest
    option per million output tokens at each load (the family and the reference)."""
    x = load_axis(df)
    closed = x == "concurrency"
    _, short, approx = _axis_fmt(x)
    us = sorted(df[x].unique())
    if not us or "variant" not in sp:
        return []
    lo, hi = us[0], us[-1]
    head = sp[sp.metric == HEADLINE].pivot_table(index="variant", columns=x, values="mean", sort=False)
    fams = families(df, reference) if "speculative_method" in df else {str(v): "other" for v in df.variant}
    fade = {level: crossovers(sp, HEADLINE, level) for level in FADE_LEVELS}
    d = add_sized_cost(df) if not closed and "capacity_tok_s" in df else df
    column = cost_column(d)
    cost_how = "on this rack at this load" if column == "usd_per_mtok" else "rack sized to each option's own capacity"
    quality = df.groupby("variant", sort=False).quality_tail.mean() if "quality_tail" in df else pd.Series(dtype=float)
    ref_q = float(quality.get(reference, np.nan))
    first = df.groupby("variant", sort=False).first()
    ratio = (first.capacity_rps / first.reference_capacity_rps) if not closed and {
        "capacity_rps", "reference_capacity_rps"} <= set(first.columns) else pd.Series(dtype=float)
    own = own_references(df, reference, pairs)

    def s(v: str, u: float) -> float:
        return float(head.loc[v, u]) if v in head.index and u in head.columns else float("nan")

    def clause(v: str) -> str:
        notes = []
        if s(v, lo) < 1.0:
            notes.append(f"below 1.0x already at {short(lo)}")
        else:
            for level in FADE_LEVELS:
                u = fade[level].get(v, float("nan"))
                if np.isfinite(u):
                    notes.append(f"below {level:.1f}x " + (f"already at {short(lo)}" if s(v, lo) < level
                                                            else f"from {approx(u)}"))
        r = own.get(v, reference)
        if r != reference and r in head.index:
            notes.append(f"{r} alone {_x(s(r, lo))} → {_x(s(r, hi))}")
        return f"{v} {_x(s(v, lo))} → {_x(s(v, hi))}" + (f" ({', '.join(notes)})" if notes else "")

    def why(members: list[str], fam: str) -> str:
        causes: dict[str, list[str]] = {}
        for v in members:
            w = _why(df, v, x, hi)
            if w is None:
                continue
            key = "barely" if abs(w[0]) < 0.02 else f"mostly through {w[1]}"
            causes.setdefault(key, []).append(f"{v} {_pct(float(np.expm1(w[0])))}")
        out = []
        if causes:
            out.append(f"from {short(lo)} to {short(hi)} the speedup over each one's own reference changes "
                       + "; ".join(f"{k} ({', '.join(vs)})" for k, vs in causes.items()))
        for v in members:
            k = float(ratio.get(v, np.nan))
            if not np.isfinite(k):
                continue
            if fam in ("speculative", "composition") and k < 1.0 and k <= hi:
                out.append(f"{v}'s own capacity is {k:.2f}x the {reference}'s, so from u={k:.2f} it is offered "
                           "more than it can serve")
            elif fam != "speculative":
                out.append(f"{v}'s own capacity is {k:.2f}x the {reference}'s (at {short(hi)} it runs at "
                           f"{hi / k:.2f} of it)")
        return "Why: " + "; ".join(out) + "." if out else ""

    paras: list[tuple[str, str, str]] = []
    summary = []
    for fam in FAMILIES:
        members = [v for v, f in fams.items() if f == fam and v in head.index]
        if not members:
            continue
        members.sort(key=lambda v: -s(v, hi))
        text = f"TPOT speedup {short(lo)} → {short(hi)}: " + "; ".join(clause(v) for v in members) + "."
        if not any(np.isfinite(fade[1.5].get(v, float("nan"))) for v in members):
            text += " None falls below 1.5x over the sweep." if len(members) > 1 else \
                " It stays above 1.5x over the sweep."
        w = why(members, fam)
        text += f" {w}" if w else ""
        lost = [f"{v} {quality[v]:.2f}" for v in members
                if v in quality and np.isfinite(ref_q) and quality[v] < ref_q - 0.005]
        if lost:
            text += f" Tail quality (share of the teacher's): {', '.join(lost)}, {reference} {ref_q:.2f}."
        cheap = _cheapest_text(d, [*members, reference], x, column)
        if cheap:
            text += f" Cheapest per million output tokens of these and {reference}: {cheap}."
        paras.append((f"family-{fam}", FAMILY_TITLES[fam], text))
        below = [f"{v} " + (f"already at {short(lo)}" if s(v, lo) < 1.0 else f"from {approx(fade[1.0][v])}")
                 for v in members if np.isfinite(fade[1.0].get(v, float("nan")))]
        summary.append(f"{FAMILY_TITLES[fam].lower()} {_span([s(v, lo) for v in members])} → "
                       f"{_span([s(v, hi) for v in members])}" + (f" (below 1.0x: {', '.join(below)})" if below else ""))
    present = [FAMILY_TITLES[f].lower() for f in ("distilled", "quantized") if f in fams.values()]
    question = ("Where does each strategy's speedup fade, and by how much"
                + (f", compared with the {_and(present)} options?" if present else "?"))
    lead = question
    if summary:
        lead += (f" TPOT speedup over {reference} from {short(lo)} to {short(hi)}: " + ", ".join(summary)
                 + " (≈: interpolated between the sweep's points).")
    everyone = [str(v) for v in dict.fromkeys(df.variant)]
    best = _cheapest_text(d, everyone, x, column)
    if best:
        ref = d[d.variant == reference].groupby(x)[column].mean().sort_index()
        lead += (f" Cheapest per million output tokens ({cost_how}; {reference} ${ref.iloc[0]:.2f} → "
                 f"${ref.iloc[-1]:.2f}): {best}" if len(ref) > 1 else
                 f" Cheapest per million output tokens ({cost_how}): {best}")
        top = set(cheapest(d, everyone, x, column).variant)
        keep = [v for v in everyone if v in quality and np.isfinite(ref_q) and quality[v] >= ref_q - QUALITY_TOLERANCE]
        if np.isfinite(ref_q) and top - set(keep) and keep:
            worst = min(float(quality[v]) for v in top)
            lead += (f", at tail quality {worst:.2f} of the teacher's; within {QUALITY_TOLERANCE:g} of the "
                     f"{reference}'s tail quality: {_cheapest_text(d, keep, x, column)}")
        lead += "."
    paras.insert(0, ("lead", "", lead))
    if pairs:
        paras.append(("family-pairs", "Speculation within each model (pairs)", " ".join(pair_lines(df, pairs, x))))
    return paras


def _grouped(pts: dict[str, tuple[float, str]], short: Any) -> str:
    """'from u=0.85: a, b (stability); from u=0.60: c (ttft_p99_s)': variants grouped by load and reason."""
    groups: dict[tuple[float, str], list[str]] = {}
    for v, key in pts.items():
        groups.setdefault(key, []).append(v)
    return "; ".join(f"from {short(u)}: {', '.join(vs)}" + (f" ({why})" if why else "")
                     for (u, why), vs in sorted(groups.items(), key=lambda kv: kv[0]))


def summary_text(df: pd.DataFrame, sp: pd.DataFrame, capacities: dict[str, dict[str, Any]] | None = None,
                 reference: str | None = None) -> tuple[list[str], list[str]]:
    """What the run found, with numbers (along the sweep's load axis): at most MAX_FINDINGS
    findings, and the details (per strategy, the full cost list, each collapse) for the
    collapsible section under them."""
    found: list[str] = []
    details: list[str] = []
    x = load_axis(df)
    closed = x == "concurrency"
    at, short, _ = _axis_fmt(x)
    names = [str(v) for v in dict.fromkeys(df.variant)]
    reference = reference if reference in names else (names[0] if names else "baseline")

    us = sorted(df[x].unique())
    lo, hi = us[0], us[-1]
    head = sp[sp.metric == HEADLINE]
    spec_variants = sorted(set(df[df.get("speculative_method", "none") != "none"].variant)) if "speculative_method" in df else []
    for v in spec_variants:
        g = head[head.variant == v].set_index(x)
        if lo in g.index and hi in g.index:
            ttft = sp[(sp.metric == "ttft_s_p99") & (sp.variant == v) & (sp[x] == lo)]["mean"]
            ttft_s = f"; its p99 TTFT speedup there is {float(ttft.iloc[0]):.2f}x" if len(ttft) else ""
            hi_s = f"{hi:g}" if closed else f"{hi:.2f}"
            details.append(f"{v}: ITL (TPOT) speedup {g.loc[lo, 'mean']:.2f}x at {at(lo)} "
                           f"and {g.loc[hi, 'mean']:.2f}x at {hi_s}{ttft_s}{why_text(df, v, x, hi)}.")
    e2e = crossovers(sp, "e2e_s_p50")
    for v, u in crossovers(sp).items():
        if v in spec_variants:
            pace = f"per-token pace (TPOT) speedup falls below 1.0 at {at(u)}" if np.isfinite(u) else \
                "per-token pace (TPOT) speedup stays above 1.0 over the sweep"
            ue = e2e.get(v, float("nan"))
            whole = f"median end-to-end latency is worse than baseline from {at(ue)}" if np.isfinite(ue) else \
                "median end-to-end latency stays better than baseline"
            details.append(f"{v}: {pace}; {whole}.")
    worse = {v: u for v, u in e2e.items() if v != reference and np.isfinite(u)}
    better = [v for v in e2e if v != reference and v not in worse]
    if e2e:
        found.append(f"Median end-to-end latency against {reference}: "
                     + "; ".join([*([", ".join(f"{v} worse from {at(u)}" for v, u in worse.items())] if worse else []),
                                  *([("every other option" if worse else "every option") + " stays better over the "
                                     "sweep"] if better else [])]) + ".")
    if closed:  # no capacity measured: the closed-loop curve's own top, and cost there
        top = df.groupby(["variant", x], sort=False)[["throughput_rps", "throughput_tok_s", "usd_per_mtok"]].mean()
        best_n = {v: top.loc[v].throughput_tok_s.idxmax() for v in dict.fromkeys(df.variant)}
        found.append("Highest throughput over the sweep (closed loop, measured window): " + ", ".join(
            f"{v} {top.loc[(v, n)].throughput_rps:.2f} req/s, {top.loc[(v, n)].throughput_tok_s:.0f} tok/s at N={n:g} "
            f"(${top.loc[(v, n)].usd_per_mtok:.2f}/Mtok)" for v, n in best_n.items()) + ".")
    g = add_sized_cost(df).groupby("variant", sort=False)[["usd_per_mtok_at_capacity", "quality_tail", "quality_in_distribution"]].mean() \
        if not closed else pd.DataFrame()
    if len(g):
        best = g.usd_per_mtok_at_capacity.idxmin()
        found.append(f"Cheapest per token at its own capacity: {best} at ${g.loc[best, 'usd_per_mtok_at_capacity']:.2f} "
                     f"per million output tokens (tail quality {g.loc[best, 'quality_tail']:.3f}, in-distribution "
                     f"{g.loc[best, 'quality_in_distribution']:.3f} of the teacher)"
                     + (f"; {reference} ${g.loc[reference, 'usd_per_mtok_at_capacity']:.2f}" if reference in g.index
                        and reference != best else "") + " (every option's in the details).")
        details.append("Cost per million output tokens at each option's own capacity: "
                       + ", ".join(f"{v} ${r.usd_per_mtok_at_capacity:.2f}" for v, r in g.iterrows()) + ".")
    if capacities:
        ref = next(iter(capacities.values())).get("reference_capacity_rps", float("nan"))
        own = ", ".join(f"{k} {c['capacity_rps']:.2f}" for k, c in capacities.items())
        collapsing = [k for k, c in capacities.items() if c.get("collapse")]
        found.append(f"Capacity (peak sustainable req/s, measured by closed-loop simulation): reference deployment "
                     f"{ref:.2f}; each variant's own: {own}. Utilisation is offered load over the reference capacity, "
                     "so every variant sees the same traffic."
                     + (f" Throughput collapses at full load for {', '.join(collapsing)} (details below)."
                        if collapsing else ""))
        for k, c in capacities.items():
            if c.get("collapse"):
                details.append(f"Collapse: {k} peaks at {c['peak_rps']:.2f} req/s with {c['peak_concurrency']} requests "
                               f"in the system, and falls to {c['full_batch_rps']:.2f} req/s "
                               f"({1 - c['full_batch_rps'] / c['peak_rps']:.0%} less) at full load: {collapse_cause(c)} "
                               "Offered load between the two is metastable (a burst tips it into a regime that serves "
                               f"less than is offered, and it stays there), so its capacity is the full-load figure, "
                               f"{c['capacity_rps']:.2f} req/s.")
    checks = sorted({c[len("slo_"):-len("_met")] for c in df.columns
                     if c.startswith("slo_") and c.endswith("_met") and c != "slo_met"})
    if checks and "slo_met" in df:
        missed: dict[str, tuple[float, str]] = {}
        for v, grp in df.groupby("variant", sort=False):
            bad = grp[~grp.slo_met.astype(bool)]
            if len(bad):
                u = float(bad[x].min())
                first = bad[bad[x] == u]
                why = [c for c in checks if not first[f"slo_{c}_met"].astype(bool).all()]
                if "verdict" in first and (first.verdict == "overloaded").any():
                    why.append("stability")
                elif "verdict" in first and (first.verdict == "insufficient").any():
                    why.append("not judged: run too short")
                missed[str(v)] = (u, ", ".join(why))
        found.append(f"SLO ({', '.join(checks)}; each checked on its own metric, plus stability): "
                     + ("met at every point." if not missed else "missed " + _grouped(missed, short) + "."))
    if "verdict" in df:
        verdicts = []
        over = df[df.verdict == "overloaded"]
        if len(over):
            pts = over.groupby("variant", sort=False)[x].min()
            verdicts.append("Overloaded (requests in system or TTFT growing over the run) "
                            + _grouped({str(v): (float(u), "") for v, u in pts.items()}, short) + ".")
        few = df[df.verdict == "insufficient"]
        if len(few):
            verdicts.append(f"{len(few)} run(s) too short or with too few requests to judge stability (verdict "
                            "'insufficient'; see verdict_reason).")
        if verdicts:
            found.append(" ".join(verdicts))
        if "settled" in df and not df.settled.astype(bool).all():
            loose = df[~df.settled.astype(bool) & (df.verdict != "overloaded")]
            if len(loose):
                pts = loose.groupby("variant", sort=False)[x].min()
                found.append(
                    f"{len(loose)} run(s) too short for their load to settle: they started empty, so their latencies "
                    "are understated (relaxation time = mean time in system / (1 - offered / the variant's own "
                    "capacity); docs/METRICS.md, 'Planner run length'); lengthen workload.duration_s and warmup_s to "
                    "judge them; " + _grouped({str(v): (float(u), "") for v, u in pts.items()}, short) + ".")
                details.append("Runs too short to settle understate latency: at 0.85 on default-mix, 200 s runs "
                               "understate the baseline's mean TPOT by ~7% and overstate the 1B draft's speedup by "
                               "~3% against 2300 s runs.")
    return found[:MAX_FINDINGS], found[MAX_FINDINGS:] + details


def why_text(df: pd.DataFrame, variant: str, x: str, u: float) -> str:
    """'; from the lightest load to there its speedup over its own reference moves -19%, mostly
    verification compute (in ln points x 100: verification compute -15, drafter compute -4, ...)'
    from the attribution columns the sweep merges in (`experiments.analysis.attributions`); ''
    without them."""
    w = _why(df, variant, x, u)
    if w is None:
        return ""
    total, main, why = w
    if abs(total) < 0.02:
        return f"; its speedup over its own reference barely moves from the lightest load ({np.expm1(total):+.0%})"
    parts = sorted(((why[c], c) for c in CAUSES if abs(why[c]) >= 0.005), key=lambda t: -abs(t[0]))
    return (f"; from the lightest load to there its speedup over its own reference moves {np.expm1(total):+.0%}, "
            f"mostly {main} (in ln points x 100: "
            + ", ".join(f"{CAUSE_NAMES[c]} {100 * w:+.0f}" for w, c in parts) + ")")


def attribution_chart(df: pd.DataFrame, per_row: int = 4) -> go.Figure:
    """Why each speculative variant's speedup moved from the lightest load: per load point, each
    cause's part of the change of ln(speedup) (`why_<cause>`; stacked, summing to the change).
    One panel per variant, `per_row` panels a row."""
    x = load_axis(df)
    rows = df.groupby(["variant", x], sort=False)[[f"why_{c}" for c in CAUSES]].first().dropna(how="all")
    variants = list(dict.fromkeys(rows.index.get_level_values(0)))
    ncols = max(1, min(per_row, len(variants)))
    nrows = max(1, -(-len(variants) // ncols))
    fig = make_subplots(rows=nrows, cols=ncols, subplot_titles=variants, shared_yaxes=True,
                        vertical_spacing=min(0.15, 0.4 / nrows))
    colours = dict(zip(CAUSES, PALETTE, strict=False))
    for i, v in enumerate(variants):
        g = rows.loc[v]
        for c in CAUSES:
            fig.add_trace(go.Bar(x=[f"{u:g}" for u in g.index], y=100 * g[f"why_{c}"], name=CAUSE_NAMES[c],
                                 marker_color=colours[c], legendgroup=c, showlegend=i == 0),
                          row=i // ncols + 1, col=i % ncols + 1)
    fig.update_layout(barmode="relative", title="Why the speculative speedup moves with load: each cause's part "
                      "of the change from the lightest load (ln points x 100, about %)", height=120 + 280 * nrows,
                      template="plotly_white")
    for r in range(1, nrows + 1):
        fig.update_yaxes(title_text="change of ln(speedup) x 100", row=r, col=1)
    return fig


def _other_profiles(df: pd.DataFrame, base: str) -> str:
    """' (variants also on X, Y)' when some variant runs another engine profile."""
    if "engine_profile" not in df:
        return ""
    other = sorted(set(df.engine_profile.dropna()) - {base})
    return f" (variants also on {', '.join(html.escape(str(o)) for o in other)})" if other else ""


def report_figures(df: pd.DataFrame, sp: pd.DataFrame, *, spec: Any = None,
                   capacities: dict[str, dict[str, Any]] | None = None) -> list[tuple[str, go.Figure]]:
    """The report's figures by section name, in order (also exported by `sweep --png/--svg`): one
    row of panels per family of strategies, the reference in each (`facet_groups`)."""
    slo = spec.base.slo.targets() if spec else {}
    closed = load_axis(df) == "concurrency"
    groups = _groups(df, getattr(spec, "reference", None))
    figs = [
        ("headline", speedup_chart(sp, groups=groups)),
        ("latency", latency_chart(df, slo, groups)),
        *((("throughput", throughput_chart(df, groups)),) if closed else ()),
        ("cost", cost_chart(df, groups)),
        *(() if closed else (("quality", quality_cost_chart(df, getattr(spec, "quality_floor_tail", None), groups)),)),
        ("utilisation", utilisation_chart(df, groups)),
    ]
    if capacities and any(c.get("curve") for c in capacities.values()):
        figs.append(("capacity", capacity_chart(capacities, groups)))
    if "why_verify" in df and df.why_verify.notna().any():
        figs.append(("why", attribution_chart(df)))
    if getattr(spec, "pairs", ()):  # each drafted model against its own undrafted target
        fig = speedup_chart(pair_speedups(df, spec.pairs, load_axis(df)), (HEADLINE,))
        fig.update_layout(title="Speculation within each model: TPOT speedup over its own reference (pairs)")
        figs.append(("pairs", fig))
    return figs


STYLE = ("body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;color:#222;line-height:1.45}"
         "li{margin:.3em 0} #answer p{margin:.6em 0} #answer .lead{font-size:1.08em}"
         "details{margin:.8em 0} summary{cursor:pointer;color:#1f4e79}")


def write_report(df: pd.DataFrame, sp: pd.DataFrame, out: str | Path, *, spec: Any = None,
                 capacities: dict[str, dict[str, Any]] | None = None) -> Path:
    """Write report.html: one self-contained file (plotly.js embedded once). It opens with the
    answer (`answer`: the project's question, then a paragraph per family of strategies), then
    at most MAX_FINDINGS findings with the rest in a collapsible details section, then the charts."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figs = report_figures(df, sp, spec=spec, capacities=capacities)
    parts = []
    for i, (name, fig) in enumerate(figs):
        parts.append(f'<section id="{name}">' + pio.to_html(fig, include_plotlyjs=(i == 0), full_html=False,
                                                            div_id=f"chart-{name}") + "</section>")
    title = f"specrack sweep: {spec.name}" if spec else "specrack sweep"
    names = [str(v) for v in dict.fromkeys(df.variant)]
    reference = getattr(spec, "reference", None) or (names[0] if names else "baseline")
    top = "".join(f'<p id="{pid}" class="{"lead" if pid == "lead" else "family"}">'
                  + (f"<b>{html.escape(t)}.</b> " if t else "") + html.escape(text) + "</p>"
                  for pid, t, text in answer(df, sp, reference, getattr(spec, "pairs", ())))
    found, details = summary_text(df, sp, capacities, reference)
    summary = "".join(f"<li>{html.escape(s)}</li>" for s in found)
    more = (f'<details id="details"><summary>Details: {len(details)} more findings (per strategy, every '
            'option\'s cost, collapses)</summary><ul>' + "".join(f"<li>{html.escape(s)}</li>" for s in details)
            + "</ul></details>") if details else ""
    setup = ""
    if spec is not None:
        b = spec.base
        load = (f"concurrency {list(spec.concurrency)} (closed-loop clients)" if getattr(spec, "concurrency", ()) else
                f"utilisation {min(spec.utilisation):.2f}-{max(spec.utilisation):.2f}")
        setup = (f"<p>Base: {html.escape(b.deployment.model)} ({b.deployment.weights}) on {b.rack.num_gpus}x {b.rack.gpu}, "
                 f"TP{b.deployment.tensor_parallel}, engine profile {html.escape(b.deployment.engine)}"
                 f"{_other_profiles(df, b.deployment.engine)}; {len(spec.variants)} variants; {load}; "
                 f"seeds {list(spec.seeds)}; {b.workload.duration_s:.0f} s per run "
                 f"({b.workload.warmup_s:.0f} s warm-up excluded).</p>")
    axis = html.escape(load_axis(df))
    doc = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>{STYLE}</style>
</head><body>
<h1>{html.escape(title)}</h1>
<div id="answer">{top}</div>
{setup}
<h2>What this run found</h2><ul id="summary">{summary}</ul>
{more}
<p>Speedup = {html.escape(reference)} / variant for latencies (variant / {html.escape(reference)} for throughput), paired by
seed at each {axis} point; 95% Student-t intervals over seeds. Each chart has a row of panels per family of strategies,
{html.escape(reference)} in each, and a strategy has the same colour in every chart and report. Tables: results.parquet /
results.csv (one row per variant x {axis} x seed), speedups.csv and attribution.csv.</p>
{''.join(parts)}
</body></html>"""
    path = out / "report.html"
    path.write_text(doc)
    return path


TIMESERIES_PANELS = (
    ("offered_rps", "offered req/s", 1.0), ("replicas_running", "replicas running", 1.0),
    ("ttft_s_p99", "TTFT p99 (ms)", 1e3), ("tpot_s_mean", "TPOT mean (ms)", 1e3),
    ("load_utilisation", "load (share of live capacity)", 1.0), ("speculating_share", "decode work speculating", 1.0),
)


def timeseries_chart(iv: pd.DataFrame, by: str | None = None,
                     panels: tuple[tuple[str, str, float], ...] = TIMESERIES_PANELS) -> go.Figure:
    """The intervals table over the day (x: hours from the start), one panel per column, one line
    per value of `by` (a strategy, a rack) when given."""
    cols = [p for p in panels if p[0] in iv.columns]
    fig = make_subplots(rows=len(cols), cols=1, shared_xaxes=True, subplot_titles=[t for _, t, _ in cols],
                        vertical_spacing=0.04)
    groups = list(iv.groupby(by, sort=False)) if by else [("", iv)]
    colours = _colour([str(k) for k, _ in groups])
    for name, g in groups:
        g = g.groupby("start_s", as_index=False).mean(numeric_only=True)  # mean over seeds
        x = (g.start_s + g.end_s) / 2 / 3600.0
        for i, (col, _, scale) in enumerate(cols, start=1):
            fig.add_trace(go.Scatter(x=x, y=g[col] * scale, mode="lines+markers", name=str(name) or col,
                                     legendgroup=str(name), showlegend=i == 1 and bool(by),
                                     line={"color": colours[str(name)]} if by else None), row=i, col=1)
    fig.update_xaxes(title_text="hours from the start of the day", row=len(cols), col=1)
    fig.update_layout(height=220 * len(cols), margin={"t": 40, "l": 60, "r": 20, "b": 40})
    return fig
