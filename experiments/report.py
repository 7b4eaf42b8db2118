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

from experiments.analysis import HEADLINE, SPEEDUP_METRICS, crossovers, load_axis
from experiments.pairs import pair_lines, pair_speedups
from sim.attribution import CAUSE_NAMES, CAUSES

PALETTE = ("#1f77b4", "#d62728", "#ff7f0e", "#9467bd", "#2ca02c", "#17becf", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22")
# one colour per strategy in every chart (sweep report, plan report, compare): the built-in
# strategies by name, any other name by a hash of it (the same name, the same colour, everywhere)
STRATEGY_COLOURS = {"baseline": "#1f77b4", "draft-1b": "#d62728", "draft-1b-adaptive": "#ff7f0e", "eagle": "#9467bd",
                    "distilled-8b": "#2ca02c", "distilled-8b+draft-1b": "#17becf", "fp8": "#8c564b",
                    "fp8+draft-1b": "#e377c2", "ngram": "#bcbd22"}
OTHER_COLOURS = ("#7f7f7f", "#637939", "#8c6d31", "#843c39", "#7b4173", "#e6550d", "#17375e", "#ff9896", "#c49c94",
                 "#000000")  # none of them close to a built-in strategy's
NONE_COLOUR = "#d9d9d9"  # "no strategy passes": grey, never a strategy's colour


def colour_of(name: str) -> str:
    """The fixed colour of a strategy (or sweep variant) by its name."""
    import zlib

    if name in STRATEGY_COLOURS:
        return STRATEGY_COLOURS[name]
    if name == "none":
        return NONE_COLOUR
    return OTHER_COLOURS[zlib.crc32(name.encode()) % len(OTHER_COLOURS)]


def _colour(names: list[str]) -> dict[str, str]:
    return {n: colour_of(n) for n in names}


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


def speedup_chart(sp: pd.DataFrame, metrics: tuple[str, ...] = (HEADLINE, "e2e_s_p50")) -> go.Figure:
    """Headline: speedup vs utilisation per variant, 95% CI bands, the 1.0 line, crossovers marked.
    One panel per metric: the per-token pace (TPOT) and the end-to-end latency, which also counts
    queueing and so shows when a speculating rack runs out of capacity."""
    names = list(dict.fromkeys(sp.variant))
    col = _colour(names)
    xa = load_axis(sp)
    fig = make_subplots(rows=1, cols=len(metrics), subplot_titles=[SPEEDUP_METRICS.get(m, m) for m in metrics])
    for j, metric in enumerate(metrics, start=1):
        d = sp[sp.metric == metric]
        for v in names:
            g = d[d.variant == v].sort_values(xa)
            if g.empty:
                continue
            x = g[xa].tolist()
            fig.add_trace(go.Scatter(x=x + x[::-1], y=g.ci_high.tolist() + g.ci_low.tolist()[::-1], fill="toself",
                                     mode="lines", fillcolor=_rgba(col[v], 0.15), line={"width": 0}, hoverinfo="skip",
                                     showlegend=False, legendgroup=v), 1, j)
            fig.add_trace(go.Scatter(x=x, y=g["mean"], mode="lines+markers", name=v, legendgroup=v, showlegend=j == 1,
                                     line={"color": col[v]},
                                     hovertemplate=f"{v}<br>{xa} %{{x:.2f}}<br>speedup %{{y:.3f}}<extra></extra>"),
                          1, j)
        for v, u in crossovers(sp, metric).items():
            if np.isfinite(u):
                fig.add_trace(go.Scatter(x=[u], y=[1.0], mode="markers+text", text=[f"{u:.2f}"], textposition="bottom center",
                                         marker={"symbol": "x", "size": 13, "color": col.get(v, "#000")},
                                         name=f"{v} crosses 1.0 at {u:.2f}", legendgroup=v, showlegend=False,
                                         hovertemplate=f"{v} crosses 1.0 at {xa} {u:.2f}<extra></extra>"), 1, j)
        fig.add_hline(y=1.0, line_dash="dash", line_color="black", row=1, col=j)
    _x_axes(fig, xa, values=sp[xa])
    ys = pd.concat([sp.ci_low, sp.ci_high, sp["mean"], pd.Series([1.0])])
    fig.update_yaxes(title_text="speedup over baseline (x)", **log_axis(ys))
    fig.update_layout(title="Speedup over baseline (mean and 95% CI over seeds; x marks where it crosses 1.0)",
                      template="plotly_white", height=540)
    return fig


def _panels(df: pd.DataFrame, columns: tuple[str, ...], titles: tuple[str, ...], scale: tuple[float, ...]) -> go.Figure:
    """One panel per column: the mean over seeds vs the load axis, a line per variant."""
    fig = make_subplots(rows=1, cols=len(columns), subplot_titles=titles)
    names = list(dict.fromkeys(df.variant))
    col = _colour(names)
    x = load_axis(df)
    agg = df.groupby(["variant", x], sort=False)[list(columns)].mean().reset_index()
    for v in names:
        g = agg[agg.variant == v].sort_values(x)
        for j, (c, k) in enumerate(zip(columns, scale, strict=True), start=1):
            fig.add_trace(go.Scatter(x=g[x], y=g[c] * k, name=v, legendgroup=v, showlegend=j == 1,
                                     line={"color": col[v]}), 1, j)
    _x_axes(fig, x, AXIS_TITLES.get(x, x), values=df[x])
    return fig


def throughput_chart(df: pd.DataFrame) -> go.Figure:
    """Throughput vs closed-loop clients (a concurrency sweep's own closed-loop curve): requests/s
    and output tokens/s over the measured window, mean over seeds."""
    fig = _panels(df, ("throughput_rps", "throughput_tok_s"), ("requests/s", "output tokens/s"), (1.0, 1.0))
    fig.update_yaxes(rangemode="tozero")
    fig.update_layout(template="plotly_white", height=440, title="Throughput vs concurrency (closed loop)")
    return fig


def latency_chart(df: pd.DataFrame, slo: dict[str, float] | None = None) -> go.Figure:
    """p99 TTFT, p99 TPOT and p99 ITL (gap between streamed chunks) vs utilisation, with the SLO's
    p99 targets drawn where it sets them: drafting can worsen the first, speculation lowers TPOT
    but makes the chunks burstier, so ITL can rise while TPOT falls."""
    slo = slo or {}
    fig = _panels(df, ("ttft_s_p99", "tpot_s_p99", "itl_s_p99"),
                  ("p99 time to first token", "p99 time per output token (TPOT)", "p99 inter-token latency (ITL)"),
                  (1.0, 1e3, 1e3))
    for j, (metric, k) in enumerate((("ttft", 1.0), ("tpot", 1e3), ("itl", 1e3)), start=1):
        target = slo.get(f"{metric}_p99_s")
        if target is not None:
            fig.add_hline(y=target * k, line_dash="dot", line_color="red", annotation_text="SLO", row=1, col=j)
    fig.update_yaxes(title_text="seconds", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="milliseconds", rangemode="tozero", row=1, col=2)
    fig.update_yaxes(title_text="milliseconds", rangemode="tozero", row=1, col=3)
    fig.update_layout(template="plotly_white", height=460, title="Latency vs load (mean over seeds)")
    return fig


def collapse_cause(c: dict[str, Any]) -> str:
    """Why a deployment's closed-loop throughput falls at full load, in a sentence."""
    kv, slots = int(c.get("kv_sequences") or 0), int(c.get("batch_slots") or 0)
    if kv and slots and kv < slots:
        return (f"its paged KV holds about {kv} sequences of the mean length, fewer than its {slots} batch slots, so "
                "at full load sequences are preempted and recomputed over and over.")
    return "the speculation machinery's overhead grows with the running sequences, so a step grows faster than the batch."


def capacity_chart(capacities: dict[str, dict[str, Any]]) -> go.Figure:
    """Throughput vs requests in the system (closed-loop curves), per variant: where speculation
    stops paying the curve bends over (the peak) and falls towards the full batch (the collapse)."""
    names = list(capacities)
    col = _colour(names)
    fig = go.Figure()
    for v in names:
        c = capacities[v]
        curve = c.get("curve") or []
        if not curve:
            continue
        x = [r[0] for r in curve]
        y = [r[1] for r in curve]
        fig.add_trace(go.Scatter(x=x, y=y, mode="lines+markers", name=v, line={"color": col[v]},
                                 hovertemplate=f"{v}<br>%{{x:.0f}} requests in system<br>%{{y:.2f}} req/s<extra></extra>"))
        if c.get("collapse"):
            fig.add_trace(go.Scatter(x=[c["peak_concurrency"]], y=[c["peak_rps"]], mode="markers+text",
                                     text=[f"peak {c['peak_rps']:.1f}; full batch {c['full_batch_rps']:.1f}"],
                                     textposition="top center", marker={"symbol": "star", "size": 13, "color": col[v]},
                                     showlegend=False, hoverinfo="skip"))
    fig.update_layout(template="plotly_white", height=460, xaxis_title="requests in the system (closed-loop clients)",
                      yaxis_title="throughput (requests/s)",
                      title="Throughput vs load: the peak, and the collapse where the batch fills")
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


def cost_chart(df: pd.DataFrame) -> go.Figure:
    """Cost per million output tokens vs utilisation, including amortised retraining: on this
    rack at this load (left), and with the rack sized to each variant's own capacity (right)."""
    x = load_axis(df)
    sized = x == "utilisation"  # a concurrency sweep has no capacity to size a rack by
    d = add_sized_cost(df) if sized else df
    names = list(dict.fromkeys(d.variant))
    col = _colour(names)
    panels = (("this rack at this load (same traffic for all)", "usd_per_mtok"),
              ("rack sized to the variant (u of its own capacity)", "usd_per_mtok_sized"))[: 2 if sized else 1]
    fig = make_subplots(rows=1, cols=len(panels), subplot_titles=[t for t, _ in panels])
    agg = d.groupby(["variant", x], sort=False)[[c for _, c in panels] + ["usd_per_mtok_retraining"]].mean().reset_index()
    for v in names:
        g = agg[agg.variant == v].sort_values(x)
        for c, (_, ycol) in enumerate(panels, start=1):
            fig.add_trace(go.Scatter(x=g[x], y=g[ycol], name=v, legendgroup=v, showlegend=c == 1,
                                     line={"color": col[v]}, customdata=g.usd_per_mtok_retraining,
                                     hovertemplate=f"{v}<br>{x} %{{x:.2f}}<br>$%{{y:.2f}}/Mtok "
                                                   f"(retraining $%{{customdata:.3f}})<extra></extra>"), 1, c)
    fig.update_yaxes(title_text="USD per million output tokens", rangemode="tozero")
    _x_axes(fig, x, AXIS_TITLES.get(x, x), values=d[x])
    fig.update_layout(template="plotly_white", height=460,
                      title="Cost per million output tokens (serving + amortised retraining)")
    return fig


def quality_cost_chart(df: pd.DataFrame, floor: float | None = None) -> go.Figure:
    """Quality (in-distribution and tail) against cost per token at each variant's own capacity:
    the price each option charges; the tail-quality floor drawn when one is set."""
    d = add_sized_cost(df)
    g = d.groupby("variant", sort=False)[["usd_per_mtok_at_capacity", "quality_in_distribution", "quality_tail"]].mean().reset_index()
    fig = go.Figure()
    if floor is not None:
        fig.add_hline(y=floor, line_dash="dot", line_color="#b00", annotation_text=f"tail-quality floor {floor:g}",
                      annotation_position="bottom right")
    for _, r in g.iterrows():
        c = colour_of(str(r.variant))
        fig.add_trace(go.Scatter(x=[r.usd_per_mtok_at_capacity] * 2, y=[r.quality_tail, r.quality_in_distribution],
                                 mode="lines+markers", name=r.variant, line={"color": c},
                                 marker={"symbol": ["triangle-down", "circle"], "size": 11},
                                 hovertemplate=f"{r.variant}<br>$%{{x:.2f}}/Mtok<br>quality %{{y:.3f}}<extra></extra>"))
    fig.update_layout(template="plotly_white", height=480,
                      title="Quality vs cost (circle: in-distribution, triangle: tail; relative to the BF16 teacher)",
                      xaxis_title="USD per million output tokens at the variant's own capacity",
                      yaxis_title="quality (share of rubric passes vs teacher)")
    return fig


def utilisation_chart(df: pd.DataFrame) -> go.Figure:
    """Measured GPU busy fraction and model FLOPs utilisation vs offered utilisation."""
    fig = _panels(df, ("gpu_busy_fraction", "mfu"), ("GPU busy fraction (engine stepping)", "model FLOPs utilisation"),
                  (1.0, 1.0))
    fig.update_layout(template="plotly_white", height=440, title="What 'spare compute' really was")
    return fig


def summary_text(df: pd.DataFrame, sp: pd.DataFrame, capacities: dict[str, dict[str, float]] | None = None) -> list[str]:
    """A few sentences, with numbers, of what the run found (along the sweep's load axis)."""
    lines = []
    x = load_axis(df)
    closed = x == "concurrency"

    def at(u: float) -> str:  # "utilisation 0.30" or "concurrency 16"
        return f"concurrency {u:g}" if closed else f"utilisation {u:.2f}"

    def short(u: float) -> str:  # "u=0.30" or "N=16"
        return f"N={u:g}" if closed else f"u={u:.2f}"

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
            lines.append(f"{v}: ITL (TPOT) speedup {g.loc[lo, 'mean']:.2f}x at {at(lo)} "
                         f"and {g.loc[hi, 'mean']:.2f}x at {hi_s}{ttft_s}{why_text(df, v, x, hi)}.")
    e2e = crossovers(sp, "e2e_s_p50")
    for v, u in crossovers(sp).items():
        if v in spec_variants:
            pace = f"per-token pace (TPOT) speedup falls below 1.0 at {at(u)}" if np.isfinite(u) else \
                "per-token pace (TPOT) speedup stays above 1.0 over the sweep"
            ue = e2e.get(v, float("nan"))
            whole = f"median end-to-end latency is worse than baseline from {at(ue)}" if np.isfinite(ue) else \
                "median end-to-end latency stays better than baseline"
            lines.append(f"{v}: {pace}; {whole}.")
    if closed:  # no capacity measured: the closed-loop curve's own top, and cost there
        top = df.groupby(["variant", x], sort=False)[["throughput_rps", "throughput_tok_s", "usd_per_mtok"]].mean()
        best_n = {v: top.loc[v].throughput_tok_s.idxmax() for v in dict.fromkeys(df.variant)}
        lines.append("Highest throughput over the sweep (closed loop, measured window): " + ", ".join(
            f"{v} {top.loc[(v, n)].throughput_rps:.2f} req/s, {top.loc[(v, n)].throughput_tok_s:.0f} tok/s at N={n:g} "
            f"(${top.loc[(v, n)].usd_per_mtok:.2f}/Mtok)" for v, n in best_n.items()) + ".")
    g = add_sized_cost(df).groupby("variant", sort=False)[["usd_per_mtok_at_capacity", "quality_tail", "quality_in_distribution"]].mean() \
        if not closed else pd.DataFrame()
    if len(g):
        best = g.usd_per_mtok_at_capacity.idxmin()
        lines.append(f"Cheapest per token at its own capacity: {best} at ${g.loc[best, 'usd_per_mtok_at_capacity']:.2f} per million "
                     f"output tokens (tail quality {g.loc[best, 'quality_tail']:.3f}, in-distribution "
                     f"{g.loc[best, 'quality_in_distribution']:.3f} of the teacher); "
                     + ", ".join(f"{v} ${r.usd_per_mtok_at_capacity:.2f}" for v, r in g.iterrows()) + ".")
    if capacities:
        ref = next(iter(capacities.values())).get("reference_capacity_rps", float("nan"))
        own = ", ".join(f"{k} {c['capacity_rps']:.2f}" for k, c in capacities.items())
        lines.append(f"Capacity (peak sustainable req/s, measured by closed-loop simulation): reference deployment "
                     f"{ref:.2f}; each variant's own: {own}. Utilisation is offered load over the reference capacity, "
                     "so every variant sees the same traffic.")
        for k, c in capacities.items():
            if c.get("collapse"):
                lines.append(f"Collapse: {k} peaks at {c['peak_rps']:.2f} req/s with {c['peak_concurrency']} requests in "
                             f"the system, and falls to {c['full_batch_rps']:.2f} req/s "
                             f"({1 - c['full_batch_rps'] / c['peak_rps']:.0%} less) at full load: {collapse_cause(c)} "
                             "Offered load between the two is metastable (a burst tips it into a regime that serves "
                             f"less than is offered, and it stays there), so its capacity is the full-load figure, "
                             f"{c['capacity_rps']:.2f} req/s.")
    checks = sorted({c[len("slo_"):-len("_met")] for c in df.columns
                     if c.startswith("slo_") and c.endswith("_met") and c != "slo_met"})
    if checks and "slo_met" in df:
        missed = []
        for v, g in df.groupby("variant", sort=False):
            bad = g[~g.slo_met.astype(bool)]
            if len(bad):
                u = float(bad[x].min())
                first = bad[bad[x] == u]
                why = [c for c in checks if not first[f"slo_{c}_met"].astype(bool).all()]
                if "verdict" in first and (first.verdict != "stable").any():
                    why.append("stability")
                missed.append(f"{v} from {short(u)} ({', '.join(why)})")
        lines.append(f"SLO ({', '.join(checks)}; each checked on its own metric, plus stability): "
                     + ("met at every point." if not missed else "missed by " + "; ".join(missed) + "."))
    if "verdict" in df:
        over = df[df.verdict == "overloaded"]
        if len(over):
            pts = over.groupby("variant")[x].min()
            lines.append("Overloaded (requests in system or TTFT growing over the run) from: "
                         + ", ".join(f"{v} at {short(u)}" for v, u in pts.items()) + ".")
        if "settled" in df and not df.settled.astype(bool).all():
            loose = df[~df.settled.astype(bool) & (df.verdict != "overloaded")]
            if len(loose):
                pts = loose.groupby("variant", sort=False)[x].min()
                lines.append(
                    f"{len(loose)} run(s) too short for their load to settle: they started empty and the start-up "
                    "may bias over 5% of their window (relaxation time = mean time in system / (1 - offered / the "
                    "variant's own capacity); docs/METRICS.md, 'Planner run length'), so their latencies are "
                    "understated (at 0.85 on default-mix, 200 s runs understate the baseline's mean TPOT by ~7% "
                    "and overstate the 1B draft's speedup by ~3% against 2300 s runs). Lengthen "
                    "workload.duration_s and warmup_s to judge them; from: "
                    + ", ".join(f"{v} at {short(u)}" for v, u in pts.items()) + ".")
        few = df[df.verdict == "insufficient"]
        if len(few):
            lines.append(f"{len(few)} run(s) too short or with too few requests to judge stability (verdict "
                         "'insufficient'; see verdict_reason).")
    return lines


def why_text(df: pd.DataFrame, variant: str, x: str, u: float) -> str:
    """'; from the lightest load to there its speedup over its own reference moves -19%, mostly
    verification compute (in ln points x 100: verification compute -15, drafter compute -4, ...)'
    from the attribution columns the sweep merges in (`experiments.analysis.attributions`); ''
    without them."""
    cols = [f"why_{c}" for c in CAUSES]
    if not set(cols) <= set(df.columns) or "main_cause" not in df:
        return ""
    r = df[(df.variant == variant) & (df[x] == u)]
    if r.empty or not str(r.main_cause.iloc[0]):
        return ""
    why = {c: float(r[f"why_{c}"].iloc[0]) for c in CAUSES}
    total = sum(why.values())
    if not np.isfinite(total):
        return ""
    if abs(total) < 0.02:
        return f"; its speedup over its own reference barely moves from the lightest load ({np.expm1(total):+.0%})"
    parts = sorted(((why[c], c) for c in CAUSES if abs(why[c]) >= 0.005), key=lambda t: -abs(t[0]))
    return (f"; from the lightest load to there its speedup over its own reference moves {np.expm1(total):+.0%}, "
            f"mostly {r.main_cause.iloc[0]} (in ln points x 100: "
            + ", ".join(f"{CAUSE_NAMES[c]} {100 * w:+.0f}" for w, c in parts) + ")")


def attribution_chart(df: pd.DataFrame) -> go.Figure:
    """Why each speculative variant's speedup moved from the lightest load: per load point, each
    cause's part of the change of ln(speedup) (`why_<cause>`; stacked, summing to the change)."""
    x = load_axis(df)
    rows = df.groupby(["variant", x], sort=False)[[f"why_{c}" for c in CAUSES]].first().dropna(how="all")
    variants = list(dict.fromkeys(rows.index.get_level_values(0)))
    fig = make_subplots(rows=1, cols=max(len(variants), 1), subplot_titles=variants, shared_yaxes=True)
    colours = dict(zip(CAUSES, PALETTE, strict=False))
    for i, v in enumerate(variants, start=1):
        g = rows.loc[v]
        for c in CAUSES:
            fig.add_trace(go.Bar(x=[f"{u:g}" for u in g.index], y=100 * g[f"why_{c}"], name=CAUSE_NAMES[c],
                                 marker_color=colours[c], legendgroup=c, showlegend=i == 1), row=1, col=i)
    fig.update_layout(barmode="relative", title="Why the speculative speedup moves with load: each cause's part "
                      "of the change from the lightest load (ln points x 100, about %)", height=380)
    fig.update_yaxes(title_text="change of ln(speedup) x 100", row=1, col=1)
    return fig


def _other_profiles(df: pd.DataFrame, base: str) -> str:
    """' (variants also on X, Y)' when some variant runs another engine profile."""
    if "engine_profile" not in df:
        return ""
    other = sorted(set(df.engine_profile.dropna()) - {base})
    return f" (variants also on {', '.join(html.escape(str(o)) for o in other)})" if other else ""


def report_figures(df: pd.DataFrame, sp: pd.DataFrame, *, spec: Any = None,
                   capacities: dict[str, dict[str, Any]] | None = None) -> list[tuple[str, go.Figure]]:
    """The report's figures by section name, in order (also exported by `sweep --png/--svg`)."""
    slo = spec.base.slo.targets() if spec else {}
    closed = load_axis(df) == "concurrency"
    figs = [
        ("headline", speedup_chart(sp)),
        ("latency", latency_chart(df, slo)),
        *((("throughput", throughput_chart(df)),) if closed else ()),
        ("cost", cost_chart(df)),
        *(() if closed else (("quality", quality_cost_chart(df, getattr(spec, "quality_floor_tail", None))),)),
        ("utilisation", utilisation_chart(df)),
    ]
    if capacities and any(c.get("curve") for c in capacities.values()):
        figs.append(("capacity", capacity_chart(capacities)))
    if "why_verify" in df and df.why_verify.notna().any():
        figs.append(("why", attribution_chart(df)))
    if getattr(spec, "pairs", ()):  # each drafted model against its own undrafted target
        fig = speedup_chart(pair_speedups(df, spec.pairs, load_axis(df)), (HEADLINE,))
        fig.update_layout(title="Speculation within each model: TPOT speedup over its own reference (pairs)")
        figs.append(("pairs", fig))
    return figs


def write_report(df: pd.DataFrame, sp: pd.DataFrame, out: str | Path, *, spec: Any = None,
                 capacities: dict[str, dict[str, float]] | None = None) -> Path:
    """Write report.html: one self-contained file (plotly.js embedded once)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figs = report_figures(df, sp, spec=spec, capacities=capacities)
    parts = []
    for i, (name, fig) in enumerate(figs):
        parts.append(f'<section id="{name}">' + pio.to_html(fig, include_plotlyjs=(i == 0), full_html=False,
                                                            div_id=f"chart-{name}") + "</section>")
    title = f"specrack sweep: {spec.name}" if spec else "specrack sweep"
    summary = "".join(f"<li>{html.escape(s)}</li>" for s in summary_text(df, sp, capacities))
    if getattr(spec, "pairs", ()):
        summary += "<li>Speculation within each model (pairs): <ul>" + "".join(
            f"<li>{html.escape(s)}</li>" for s in pair_lines(df, spec.pairs, load_axis(df))) + "</ul></li>"
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
    doc = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<style>body{{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;color:#222}} li{{margin:.3em 0}}</style>
</head><body>
<h1>{html.escape(title)}</h1>
{setup}
<h2>What this run found</h2><ul id="summary">{summary}</ul>
<p>Speedup = baseline / variant for latencies (variant / baseline for throughput), paired by seed at each {html.escape(load_axis(df))} point;
95% Student-t intervals over seeds. Tables: results.parquet / results.csv (one row per variant x {html.escape(load_axis(df))} x seed) and speedups.csv.</p>
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
