"""Charts and the self-contained HTML report of a capacity plan.

Every chart colours a strategy by its name (experiments.report.colour_of: the same colour in the
sweep report, the plan report and compare) and tells GPU types apart by line dash; log axes carry
labelled 1-2-5 ticks only."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from experiments.images import write_images
from experiments.plan_headroom import HEADROOM_TOL, HEADROOM_TOP
from experiments.plan_miss import rejection_line
from experiments.report import colour_of, log_axis

DASHES = ("solid", "dash", "dot", "dashdot", "longdash")


def _dash(gpus: list[str], gpu: str) -> str:
    return DASHES[gpus.index(gpu) % len(DASHES)] if gpu in gpus else "solid"


def curves_chart(curves: pd.DataFrame) -> go.Figure:
    """GPUs needed and cost per month vs traffic, one line per strategy (dash: GPU type)."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("GPUs needed to meet the SLO", "total cost at the SLO"))
    ok = curves[curves.feasible.astype(bool)]
    gpus = list(dict.fromkeys(curves.gpu))
    for name, g in ok.groupby(["strategy", "gpu"], sort=False):
        label = f"{name[0]} ({name[1]})"
        g = g.sort_values("rate_rps")
        line = {"color": colour_of(str(name[0])), "dash": _dash(gpus, str(name[1]))}
        fig.add_trace(go.Scatter(x=g.rate_rps, y=g.gpus, name=label, legendgroup=label, line=line,
                                 hovertemplate=f"{label}<br>%{{x:.2f}} req/s: %{{y}} GPUs<extra></extra>"), 1, 1)
        fig.add_trace(go.Scatter(x=g.rate_rps, y=g.total_usd_per_month, name=label, legendgroup=label,
                                 showlegend=False, line=line,
                                 hovertemplate=f"{label}<br>%{{x:.2f}} req/s: $%{{y:,.0f}}/month<extra></extra>"), 1, 2)
    fig.update_xaxes(title_text="traffic (requests/s)", **log_axis(ok.rate_rps))
    fig.update_yaxes(title_text="GPUs", **log_axis(ok.gpus), row=1, col=1)
    fig.update_yaxes(title_text="$/month", **log_axis(ok.total_usd_per_month), row=1, col=2)
    fig.update_layout(template="plotly_white", height=460, title="Capacity curves: the cheapest rack meeting the SLO "
                      "as traffic grows (each point found by simulation)")
    return fig


def _k(v: float) -> str:
    return f"${v / 1e3:,.0f}k" if v >= 1e4 else f"${v:,.0f}"


def decision_map_chart(win: pd.DataFrame) -> go.Figure:
    """Heatmap over traffic x acceptance: the cheapest strategy whose rack meets the SLO and the
    quality floor, its rack, monthly cost and margin over the runner-up; grey 'none' where no
    strategy passes; the plan's own operating point marked."""
    names = sorted(set(win.winner) - {"none"}) + (["none"] if (win.winner == "none").any() else [])
    code = {n: i for i, n in enumerate(names)}
    us = sorted(win.utilisation.unique())
    accs = sorted(win.acceptance.unique())
    z = np.full((len(accs), len(us)), np.nan)
    text = [["" for _ in us] for _ in accs]
    for _, r in win.iterrows():
        i, j = accs.index(r.acceptance), us.index(r.utilisation)
        z[i, j] = code[r.winner]
        if r.winner == "none":
            text[i][j] = "none<br>(nothing passes)"
            continue
        m = "" if not np.isfinite(r.margin) else f"<br>+{100 * r.margin:.0f}% vs {r.runner_up}"
        text[i][j] = f"<b>{r.winner}</b><br>{r.rack}, {_k(r.total_usd_per_month)}/mo{m}"
    scale = []
    for i, n in enumerate(names):
        lo, hi = i / len(names), (i + 1) / len(names)
        scale += [[lo, colour_of(n)], [hi, colour_of(n)]]
    rates = {float(r.utilisation): float(r.rate_rps) for _, r in win.iterrows()}
    fig = go.Figure(go.Heatmap(z=z, x=us, y=accs, text=text, texttemplate="%{text}", textfont={"size": 11},
                               colorscale=scale, zmin=-0.5, zmax=len(names) - 0.5, showscale=False, xgap=2, ygap=2,
                               hovertemplate="utilisation %{x:.2f}, acceptance %{y:.2f}<br>%{text}<extra></extra>"))
    for n in names:  # a legend of the colours
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=n if n != "none" else "none passes",
                                 marker={"size": 12, "symbol": "square", "color": colour_of(n)}))
    rack = str(win.base_rack.iloc[0]) if "base_rack" in win else "the base rack"
    cap = float(win.base_capacity_rps.iloc[0]) if "base_capacity_rps" in win else float("nan")
    if "plan_utilisation" in win:
        pu, pa = float(win.plan_utilisation.iloc[0]), float(win.plan_acceptance.iloc[0])
        fig.add_trace(go.Scatter(x=[pu], y=[pa], mode="markers+text", text=["this plan"], textposition="top center",
                                 marker={"symbol": "star", "size": 16, "color": "black", "line": {"color": "white", "width": 1}},
                                 name=f"this plan: {float(win.plan_rate_rps.iloc[0]):.2f} req/s, acceptance {pa:.2f}"))
    fig.update_xaxes(tickvals=us, ticktext=[f"{u:.2f}<br>({rates.get(float(u), u):.1f} req/s)" for u in us],
                     title_text=f"traffic: utilisation of the base rack ({rack}, speculation off; 1.0 = {cap:.1f} req/s)")
    fig.update_yaxes(tickvals=accs, ticktext=[f"{a:.2f}" for a in accs], title_text="per-token acceptance rate")
    fig.update_layout(template="plotly_white", height=520, legend={"title": "cheapest passing"},
                      title="Decision map: the cheapest strategy meeting the SLO and the quality floor (cost at the SLO, "
                            "its rack and its margin over the runner-up)")
    return fig


def shift_chart(shift: pd.DataFrame) -> go.Figure:
    """Speedup on benchmark-like traffic (tail share 0) vs production-like (growing tail)."""
    fig = go.Figure()
    for s, g in shift.groupby("strategy", sort=False):
        fig.add_trace(go.Bar(x=[f"{100 * t:.0f}% tail" for t in g.tail_share], y=g.speedup, name=str(s),
                             marker_color=colour_of(str(s))))
    fig.add_hline(y=1.0, line_dash="dash")
    ref = str(shift.strategy.iloc[0]) if len(shift) else "the first strategy"
    fig.update_layout(template="plotly_white", height=440, barmode="group",
                      title="Acceptance shift: how much of the benchmark speedup survives production traffic",
                      xaxis_title="traffic mix (0% tail = benchmark-like)", yaxis_title=f"TPOT speedup over {ref} (x)")
    return fig


def retraining_chart(rt: pd.DataFrame) -> go.Figure:
    """Monthly total cost vs teacher update cadence, and the tail quality lost while stale, with
    the plan's tail-quality floor."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("total cost per month", "tail quality (stale student included)"))
    gpus = list(dict.fromkeys(rt.gpu))
    for name, g in rt.groupby(["strategy", "gpu"], sort=False):
        line = {"color": colour_of(str(name[0])), "dash": _dash(gpus, str(name[1]))}
        label = f"{name[0]} ({name[1]})"
        fig.add_trace(go.Scatter(x=g.cadence, y=g.total_usd_per_month, name=label, legendgroup=label, line=line), 1, 1)
        fig.add_trace(go.Scatter(x=g.cadence, y=g.quality_tail, name=label, legendgroup=label, showlegend=False,
                                 line=line), 1, 2)
    if "quality_floor_tail" in rt and len(rt):
        floor = float(rt.quality_floor_tail.iloc[0])
        fig.add_hline(y=floor, line_dash="dot", line_color="#b00", row=1, col=2,
                      annotation_text=f"floor {floor:g}", annotation_position="bottom right")
    fig.update_xaxes(title_text="teacher update cadence")
    fig.update_yaxes(title_text="$/month", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="tail quality (share of the BF16 teacher's)", row=1, col=2)
    fig.update_layout(template="plotly_white", height=440, title="The retraining obligation")
    return fig


def pareto_chart(configs: pd.DataFrame) -> go.Figure:
    """Every simulated passing configuration's monthly cost vs the capacity of its rack, the
    cost-vs-capacity Pareto frontier joined."""
    fig = go.Figure()
    ok = configs[configs.status == "passes"]
    symbols = ("circle", "diamond", "square", "triangle-up", "x")
    gpus = list(dict.fromkeys(configs.gpu))
    for name, g in ok.groupby(["strategy", "gpu"], sort=False):
        label = [f"TP{int(r.tp)}, MBT {int(r.max_num_batched_tokens)}, seqs {int(r.max_num_seqs)}"
                 + ("" if r.get("k") is None or r.get("k") != r.get("k") else f", k {int(r.k)}")
                 + f": {int(r.replicas)} replicas" for _, r in g.iterrows()]
        fig.add_trace(go.Scatter(x=g.capacity_rps, y=g.total_usd_per_month, mode="markers", name=f"{name[0]} ({name[1]})",
                                 text=label, marker={"color": colour_of(str(name[0])), "size": 9,
                                                     "symbol": symbols[gpus.index(name[1]) % len(symbols)]},
                                 hovertemplate="%{text}<br>capacity %{x:.2f} req/s<br>$%{y:,.0f}/month<extra></extra>"))
    front = ok[ok.pareto.astype(bool)].sort_values("capacity_rps")
    fig.add_trace(go.Scatter(x=front.capacity_rps, y=front.total_usd_per_month, mode="lines", name="Pareto frontier",
                             line={"color": "#222", "dash": "dash", "shape": "hv"}))
    fig.update_layout(template="plotly_white", height=460,
                      title="Configurations: monthly cost vs rack capacity (passing racks; frontier dashed)",
                      xaxis_title="rack capacity (req/s, replicas x capacity per replica)", yaxis_title="total cost ($/month)",
                      yaxis_rangemode="tozero")
    return fig


FACTORS = (("acceptance", "per-token acceptance rate"), ("traffic growth", "traffic (x the plan's)"),
           ("GPU price", "GPU price (x the plan's)"))


def sensitivity_chart(sens: pd.DataFrame) -> go.Figure:
    """Monthly cost at the SLO of the winner and the runner-up as acceptance, traffic and GPU
    price move (a missing point: no rack within max_gpus meets the SLO there)."""
    fig = make_subplots(rows=1, cols=3, subplot_titles=[t for _, t in FACTORS], shared_yaxes=False)
    gpus = list(dict.fromkeys(sens.gpu))
    for j, (factor, title) in enumerate(FACTORS, start=1):
        d = sens[(sens.factor == factor)]
        for name, g in d.groupby(["strategy", "gpu"], sort=False):
            label = f"{name[0]} ({name[1]})"
            g = g.sort_values("value")
            y = g.total_usd_per_month.where(g.feasible.astype(bool))
            fig.add_trace(go.Scatter(x=g.value, y=y, mode="lines+markers", name=label, legendgroup=label,
                                     showlegend=j == 1, line={"color": colour_of(str(name[0])),
                                                              "dash": _dash(gpus, str(name[1]))},
                                     hovertemplate=f"{label}<br>{factor} %{{x:g}}: $%{{y:,.0f}}/month<extra></extra>"),
                          1, j)
        fig.update_xaxes(title_text=title, row=1, col=j)
        if factor == "traffic growth" and len(d):
            fig.update_xaxes(**log_axis(d.value), row=1, col=j)
        if factor != "acceptance":
            fig.add_vline(x=1.0, line_dash="dot", line_color="#888", row=1, col=j)
    fig.update_yaxes(title_text="total cost at the SLO ($/month)", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(rangemode="tozero")
    fig.update_layout(template="plotly_white", height=440,
                      title="Sensitivity of the winner and the runner-up: cost at the SLO (a gap: nothing within max_gpus passes)")
    return fig


def quality_chart(plan: pd.DataFrame, floor: float) -> go.Figure:
    """Each planned option's quality (tail and in-distribution) against its monthly cost, with
    the tail-quality floor."""
    fig = go.Figure()
    ok = plan[plan.feasible.astype(bool)]
    for _, r in ok.iterrows():
        fig.add_trace(go.Scatter(x=[r.total_usd_per_month] * 2, y=[r.quality_tail, r.quality_in_distribution],
                                 mode="lines+markers", name=f"{r.strategy} ({r.gpu})", line={"color": colour_of(str(r.strategy))},
                                 marker={"symbol": ["triangle-down", "circle"], "size": 11},
                                 hovertemplate=f"{r.strategy}<br>$%{{x:,.0f}}/month<br>quality %{{y:.3f}}<extra></extra>"))
    fig.add_hline(y=floor, line_dash="dot", line_color="#b00", annotation_text=f"tail-quality floor {floor:g}",
                  annotation_position="bottom right")
    fig.update_layout(template="plotly_white", height=440,
                      title="Quality vs cost (circle: in-distribution, triangle: tail; relative to the BF16 teacher)",
                      xaxis_title="total cost at the SLO ($/month)", yaxis_title="quality (share of the teacher's)",
                      xaxis_rangemode="tozero")
    return fig


def check_label(key: str) -> str:
    """'ttft_p99_s' -> 'p99 TTFT' (an SLO check by its human name)."""
    parts = key.removesuffix("_s").split("_")
    if len(parts) == 2 and parts[1].startswith("p"):
        return f"{parts[1]} {parts[0].upper()}"
    return key


def _t(v: Any) -> str:
    """A latency with its unit: 1.23 s, or 45.6 ms below a second."""
    try:
        x = float(v)
    except (TypeError, ValueError):
        return ""
    if x != x:
        return ""
    return f"{x:.2f} s" if x >= 1 else f"{x * 1e3:.0f} ms" if x >= 0.01 else f"{x * 1e3:.1f} ms"


def _usd(v: Any, digits: int = 0) -> str:
    try:
        x = float(v)
    except (TypeError, ValueError):
        return ""
    return "" if x != x else f"${x:,.{digits}f}"


def _config(r: Any) -> str:
    k = r.get("k")
    lay = r.get("layout")
    pre = f"{html.escape(lay)} · " if isinstance(lay, str) and lay not in ("", "aggregated") else ""
    return (pre + f"TP{int(r.tp)} · MBT {int(r.max_num_batched_tokens)} · seqs {int(r.max_num_seqs)}"
            + ("" if k is None or k != k else f" · k {int(k)}"))


def binding_text(r: Any) -> str:
    b = r.get("binding_slo")
    if not isinstance(b, str) or not b:
        return "stability" if r.get("verdict") not in (None, "stable") else ""
    v, t = r.get(f"slo_{b}_value"), r.get(f"slo_{b}_target")
    return f"{check_label(b)}: {_t(v)} of {_t(t)} ({float(v) / float(t):.0%})"


def ranked_table_html(plan: pd.DataFrame, floor: float) -> str:
    """The ranked options as a readable table: human headers with units, money without cents
    ($/month) or to the cent ($/Mtok), latencies with their unit, the headroom, the binding check."""
    head = ("#", "strategy", "GPU", "configuration", "rack", "TTFT p50 / p99", "TPOT p50 / p99", "ITL p50 / p99",
            "headroom: max req/s at the SLO", "binding constraint", "cost ($/month)", "$/Mtok at the SLO",
            f"tail quality (floor {floor:g})")
    rows = []
    for i, r in plan.reset_index(drop=True).iterrows():
        if not bool(r.feasible):
            rows.append(f"<tr class='infeasible'><td>{i + 1}</td><td>{html.escape(str(r.strategy))}</td>"
                        f"<td>{html.escape(str(r.gpu))}</td><td colspan='{len(head) - 3}' class='why'>no rack: "
                        f"{html.escape(_text(r.get('miss_detail')) or str(r.get('reason', '')))}"
                        f"{' (options with no passing rack, below)' if _text(r.get('miss_detail')) else ''}</td></tr>")
            continue
        nodes = int(r.get("nodes", 0) or 0)
        rack = (f"{int(r.replicas)} x {int(r.gpus_per_replica)} = {int(r.gpus)} GPUs"
                + (f"<br>{nodes} node{'s' if nodes != 1 else ''}, {int(r.billed_gpus)} GPUs billed" if nodes else "")
                + (" (n+1)" if r.get("redundancy") == "n+1" else ""))
        hr = float(r.get("headroom_rps", float("nan")))
        fail = float(r.get("headroom_fail_rps", float("nan")))
        headroom = "" if hr != hr else (f"{hr:.2f} req/s (+{hr / float(r.rate_rps) - 1:.0%})"
                                        + (" or more" if fail == float("inf") else ""))
        power = float(r.get("power_usd_per_month", 0.0) or 0.0)
        retrain = float(r.get("retraining_usd_per_month", 0.0) or 0.0)
        split = [f"serving {_usd(r.serving_usd_per_month)}"] + ([f"power {_usd(power)}"] if power else []) \
            + ([f"retraining {_usd(retrain)}"] if retrain else [])
        cost = f"<b>{_usd(r.total_usd_per_month)}</b> ({html.escape(str(r.get('cost_mode', 'rent')))})<br><small>{', '.join(split)}</small>"
        q = f"{float(r.quality_tail):.3f} {'✓' if bool(r.passes_quality_floor) else '✗ below floor'}"
        cells = [str(i + 1), html.escape(str(r.strategy)), html.escape(str(r.gpu)), _config(r), rack,
                 f"{_t(r.get('ttft_p50_s'))} / {_t(r.ttft_p99_s)}", f"{_t(r.get('tpot_p50_s'))} / {_t(r.tpot_p99_s)}",
                 f"{_t(r.get('itl_p50_s'))} / {_t(r.itl_p99_s)}", headroom, binding_text(r), cost,
                 _usd(r.usd_per_mtok_at_slo, 2), q]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return ("<div class='wide'><table class='plan ranked'><thead><tr>" + "".join(f"<th>{h}</th>" for h in head)
            + "</tr></thead><tbody>" + "".join(rows) + "</tbody></table></div>")


def configs_table_html(df: pd.DataFrame) -> str:
    """Every configuration searched: its grid point, what happened (simulated, pruned, not
    applicable) and why, its rack and cost."""
    head = ("strategy", "GPU", "configuration", "status", "capacity per replica", "lower bound", "rack",
            "cost ($/month)", "$/Mtok at the SLO", "Pareto", "why")
    rows = []
    for _, r in df.iterrows():
        cfg = _config(r) if r.get("tp") == r.get("tp") and r.get("tp") is not None and r.get("max_num_seqs") == r.get("max_num_seqs") else ""
        cap = r.get("capacity_per_replica_rps")
        lb = r.get("lower_bound_replicas")
        reps = r.get("replicas")
        cells = [html.escape(str(r.strategy)), html.escape(str(r.gpu)), cfg, html.escape(str(r.get("status", ""))),
                 "" if cap is None or cap != cap else f"{float(cap):.2f} req/s",
                 "" if lb is None or lb != lb else f"{int(lb)} replicas, {_usd(r.get('lower_bound_usd_per_month'))}",
                 "" if reps is None or reps != reps else f"{int(reps)} replicas, {int(r.gpus)} GPUs",
                 _usd(r.get("total_usd_per_month")), _usd(r.get("usd_per_mtok_at_slo"), 2),
                 "yes" if bool(r.get("pareto", False)) else "",
                 html.escape(str(r.get("reason", "")) if r.get("reason") == r.get("reason") else "")]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    return ("<div class='wide'><table class='plan'><thead><tr>" + "".join(f"<th>{h}</th>" for h in head)
            + "</tr></thead><tbody>" + "".join(rows) + "</tbody></table></div>")


def _inputs_html(spec: Any) -> str:
    """The effective inputs the plan ran with, as a definition list."""
    items = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in spec.inputs().items())
    warn = "".join(f'<p class="warn">{html.escape(w)}</p>' for w in spec.warnings)
    return f'<dl id="inputs">{items}</dl>{warn}'


def header_html(spec: Any) -> str:
    """What was planned, in one block: model, precision, engine profile, TP, base rack, traffic
    (and trace window), SLO, cost mode."""
    b = spec.base
    dep = b.deployment
    tr = spec.traffic
    window = (f"{tr.window} of {Path(tr.trace or '').name} ({tr.lo_s:.0f}-{tr.hi_s:.0f} s of its clock), growth {tr.growth:g}"
              if tr is not None and tr.kind == "trace" else "none (Poisson/gamma arrivals at a fixed rate)")
    items = {"model": f"{dep.model}", "precision": f"{dep.weights} weights, {dep.kv_cache} KV cache",
             "engine profile": str(dep.engine), "tensor parallel (base)": f"TP{dep.tensor_parallel}",
             "base rack": f"{b.rack.num_gpus}x {b.rack.gpu}",
             "traffic": f"{spec.rate_rps:.2f} req/s", "trace window": window, "SLO": b.slo.describe(),
             "cost mode": spec.cost.mode, "GPUs searched": f"{', '.join(spec.gpus)} (up to {spec.max_gpus} GPUs)"}
    return "<table class='header'>" + "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                                              for k, v in items.items()) + "</table>"


PRUNING = ("Pruning, before any rack is simulated: a configuration of capacity C req/s per replica (measured by "
           "sim.capacity) needs more than rate / C replicas (a rack offered its capacity or more fails without "
           "simulation), more if "
           "min_replicas, max_utilisation or n+1 ask; it is skipped if that exceeds max_gpus, or if that cheapest "
           "possible rack already costs more than the best passing rack found so far (configurations are simulated "
           "cheapest bound first). Pruned configurations are listed with their bound; the frontier is drawn over "
           "the simulated passing ones.")

CAPTIONS = {
    "pareto": "Every configuration the search simulated that passes: what it costs against what its rack carries.",
    "curves": "Each point is the cheapest rack meeting the SLO at that traffic, found by simulation (the plan's "
              "configuration of each strategy).",
    "decision-map": "Each cell re-plans every strategy at that traffic and acceptance (cheapest rack meeting the SLO "
                    "under the plan's rack rules, by simulation) and names the cheapest that also keeps the quality "
                    "floor; grey cells: nothing passes within max_gpus. The star is this plan.",
    "sensitivity": "The winner and the runner-up re-costed: acceptance and traffic by re-finding the rack by "
                   "simulation, GPU price by repricing the planned rack (serving cost is linear in it).",
    "quality": "Quality each option keeps, against its cost; options below the floor are ranked after those above.",
    "shift": "Speedup on benchmark-like traffic (no tail) and on production-like traffic with a growing tail share.",
    "retraining": "Distilled options pay a re-distillation per teacher update and lose tail quality while stale.",
}


def _any_feasible(df: pd.DataFrame | None) -> bool:
    return df is not None and len(df) > 0 and "feasible" in df and bool(df.feasible.astype(bool).any())


def plan_figures(tables: dict[str, pd.DataFrame], floor: float | None = None) -> list[tuple[str, go.Figure]]:
    """The plan report's figures by section name, from the analyses' tables that are present
    (also exported by `plan --png/--svg`)."""
    figs = []
    configs = tables.get("configs")
    if configs is not None and len(configs) and (configs.get("status") == "passes").any():
        figs.append(("pareto", pareto_chart(configs)))
    if "map" in tables and len(tables["map"]):
        figs.append(("decision-map", decision_map_chart(tables["map"])))
    if _any_feasible(tables.get("sensitivity")):
        figs.append(("sensitivity", sensitivity_chart(tables["sensitivity"])))
    if _any_feasible(tables.get("curves")):  # (a curve where no point passes has nothing to draw)
        figs.append(("curves", curves_chart(tables["curves"])))
    plan = tables.get("plan")
    if floor is None and "retraining" in tables and "quality_floor_tail" in tables["retraining"] and len(tables["retraining"]):
        floor = float(tables["retraining"].quality_floor_tail.iloc[0])
    if plan is not None and floor is not None and plan.feasible.astype(bool).any():
        figs.append(("quality", quality_chart(plan, floor)))
    if "shift" in tables and len(tables["shift"]):
        figs.append(("shift", shift_chart(tables["shift"])))
    if "retraining" in tables and len(tables["retraining"]):
        figs.append(("retraining", retraining_chart(tables["retraining"])))
    return figs


MISS_HEAD = ("strategy", "GPU", "configuration", "closest rack", "binding constraint", "value vs target",
             "how far it misses", "cheapest change that would pass", "rejected requests")


def _miss(r: Any) -> str:
    """How far a failing option misses: x times its target (a latency), or its share of capacity."""
    ratio, c = r.get("miss_ratio"), str(r.get("miss_constraint", ""))
    try:
        x = float(ratio)
    except (TypeError, ValueError):
        return ""
    if x != x:
        return ""
    if c in ("capacity", "stability"):
        return f"offered {x:.0%} of the rack's capacity"
    if c == "max_gpus":
        return f"{x:.2g}x max_gpus"
    return f"{x:.3g}x the target" + (f" ({x - 1:+.0%})" if x < 10 else "")


def _value_vs_target(r: Any) -> str:
    c = str(r.get("miss_constraint", ""))
    v, t = r.get("miss_value"), r.get("miss_target")
    if v is None or t is None or v != v or t != t:
        return ""
    if c in ("capacity", "stability"):
        return f"{float(v):.2f} req/s offered vs {float(t):.2f} req/s capacity"
    if c == "max_gpus":
        return f"{int(v)} GPUs vs max_gpus {int(t)}"
    return f"{_t(v)} vs {_t(t)}"


def _text(v: Any) -> str:
    return v if isinstance(v, str) else ""


def no_rack_html(plan: pd.DataFrame) -> str:
    """The options with no passing rack: each one's closest rack (the largest tried, of its
    configuration that came closest), the binding constraint, value vs target, how far it misses,
    the cheapest change that would pass, and its run's rejected requests."""
    rows = []
    for _, r in plan[~plan.feasible.astype(bool)].iterrows():
        has_cfg = r.get("tp") is not None and r.get("tp") == r.get("tp") and r.get("max_num_seqs") == r.get("max_num_seqs")
        gpus, reps = r.get("closest_gpus"), r.get("closest_replicas")
        rack = "" if gpus is None or gpus != gpus else (
            f"{int(reps)} replicas, {int(gpus)} GPUs" if reps is not None and reps == reps else f"{int(gpus)} GPUs")
        c = _text(r.get("miss_constraint"))
        detail = _text(r.get("miss_detail")) or _text(r.get("reason"))
        rej = r.get("rejected_requests")
        rejected = "" if rej is None or rej != rej or not int(rej) else (
            f"{int(rej)} of {int(r.get('sent_requests', 0))} ({float(r.get('rejected_share', 0.0)):.0%}): "
            f"{html.escape(_text(r.get('rejected_reason')))}")
        cells = [html.escape(str(r.strategy)), html.escape(str(r.gpu)), _config(r) if has_cfg else "", rack,
                 f"<b>{html.escape(check_label(c))}</b><br><small>{html.escape(detail)}</small>", _value_vs_target(r),
                 _miss(r), html.escape(_text(r.get("fix"))), rejected]
        rows.append("<tr>" + "".join(f"<td>{x}</td>" for x in cells) + "</tr>")
    return ("<div class='wide'><table class='plan norack'><thead><tr>" + "".join(f"<th>{h}</th>" for h in MISS_HEAD)
            + "</tr></thead><tbody>" + "".join(rows) + "</tbody></table></div>")


def verdict_html(spec: Any, plan: pd.DataFrame) -> str:
    floor = plan["passes_quality_floor"].fillna(False).astype(bool) if "passes_quality_floor" in plan else True
    best = plan[plan.feasible.astype(bool) & floor]
    if not plan.feasible.astype(bool).any():
        return (f"No rack passes: none of the {len(plan)} options meets the SLO within max_gpus = {spec.max_gpus}. "
                "The table below gives each option's closest rack, what binds there, how far it misses and the "
                "cheapest change that would pass.")
    if not len(best):
        return "No option meets the SLO and the quality floor within max_gpus."
    r = best.iloc[0]
    hr = float(r.get("headroom_rps", float("nan")))
    room = "" if hr != hr else f" It carries up to {hr:.2f} req/s at the SLO ({hr / spec.rate_rps - 1:+.0%} over the plan's traffic)."
    second = ""
    if len(best) > 1:
        s2 = best.iloc[1]
        same = abs(s2.total_usd_per_month / r.total_usd_per_month - 1) < 5e-3
        second = (f" Runner-up: {html.escape(str(s2.strategy))} on {int(s2.gpus)}x {html.escape(str(s2.gpu))}, "
                  f"{_usd(s2.total_usd_per_month)}/month ("
                  + ("the same cost: choose on headroom, latency and quality" if same
                     else f"{s2.total_usd_per_month / r.total_usd_per_month - 1:+.0%}") + ").")
    return (f"Recommended: <b>{html.escape(str(r.strategy))}</b> on <b>{int(r.gpus)}x {html.escape(str(r.gpu))}</b> "
            f"({int(r.replicas)} replica{'s' if int(r.replicas) != 1 else ''}, {_config(r)}), <b>{_usd(r.total_usd_per_month)}/month</b> "
            f"({html.escape(str(r.cost_mode))}), {_usd(r.usd_per_mtok_at_slo, 2)} per million output tokens; "
            f"binding: {binding_text(r)}.{room}{second}")


STYLE = """body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}
div.wide{overflow-x:auto;max-width:100%} table.plan{border-collapse:collapse;font-size:13px}
table.plan td,table.plan th{padding:4px 6px;border-bottom:1px solid #ddd;text-align:right;vertical-align:top}
table.plan th{background:#f4f4f4;text-align:center} table.plan td:nth-child(-n+4){text-align:left}
table.ranked td:nth-child(4){white-space:nowrap} table.norack td{text-align:left} tr.infeasible td{color:#888} td.why{text-align:left!important}
table.header{border-collapse:collapse;margin:1em 0} table.header th{text-align:left;padding:2px 12px 2px 0}
dl#inputs dt{font-weight:bold;float:left;clear:left;width:11em} dl#inputs dd{margin-left:12em}
p.warn{color:#b00;font-weight:bold} p#verdict{font-size:1.1em;background:#f3f8ff;padding:.6em;border-left:4px solid #1f77b4}
p.caption{color:#555;font-size:.9em;margin:.2em 0 1.5em}"""


RANKED_CAPTION = """<h2>Ranked options</h2>
<p class="caption">Cheapest first among those meeting the SLO and the quality floor. Latencies are the worst seed's
percentiles at the plan's traffic; headroom is the highest traffic the same rack still serves within the SLO (found by
simulation, within {tol:.0f}%, for the {top} best options); the binding constraint is the SLO check nearest its target. Every
figure is in plan.csv.</p>"""

NO_RACK_CAPTION = ("No rack within max_gpus meets the SLO (every target, on a stable run) for these options. The closest "
                   "rack is the largest one tried (of the configuration that came closest); it is no answer, so no cost "
                   "or latency is given. More GPUs are estimated from the capacity per replica where throughput or "
                   "stability binds (a lower bound); a looser target is the value the closest rack achieves; another GPU "
                   "is an option of this plan that passes. Every figure is in plan.csv (the miss_* and fix* columns).")


def write_plan_report(spec: Any, tables: dict[str, pd.DataFrame], out: str | Path) -> Path:
    out = Path(out)
    figs = plan_figures(tables, spec.quality_floor_tail)
    configs = tables.get("configs")
    parts = [f'<section id="{n}">' + pio.to_html(f, include_plotlyjs=(i == 0), full_html=False, div_id=f"chart-{n}")
             + f'<p class="caption">{html.escape(CAPTIONS.get(n, ""))}</p></section>' for i, (n, f) in enumerate(figs)]
    plan = tables["plan"]
    ranked_part = RANKED_CAPTION.format(tol=100 * HEADROOM_TOL, top=HEADROOM_TOP) + ranked_table_html(plan, spec.quality_floor_tail)
    failing = int((~plan.feasible.astype(bool)).sum())
    no_rack = ""
    if failing == len(plan):  # nothing passes: the answer is how close each option came
        ranked_part = ""
        no_rack = f'<section id="no-rack"><h2>No rack passes</h2><p class="caption">{NO_RACK_CAPTION}</p>{no_rack_html(plan)}</section>'
    elif failing:
        no_rack = (f'<section id="no-rack"><h2>Options with no passing rack ({failing} of {len(plan)})</h2>'
                   f'<p class="caption">{NO_RACK_CAPTION}</p>{no_rack_html(plan)}</section>')
    line = rejection_line(plan)
    rejected = f'<p class="warn" id="rejected">{html.escape(line)}</p>' if line else ""
    configs_part = ""
    if configs is not None and len(configs):
        configs_part = (f"<details><summary><b>Configurations searched ({len(configs)})</b></summary><p>"
                        f"{html.escape(spec.search.describe())}. {PRUNING}</p>{configs_table_html(configs)}</details>")
    doc = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>specrack plan: {html.escape(spec.name)}</title>
<style>{STYLE}</style>
</head><body>
<h1>specrack plan: {html.escape(spec.name)}</h1>
{header_html(spec)}
<p id="verdict">{verdict_html(spec, plan)}</p>
{rejected}
{ranked_part}
{no_rack}
{configs_part}
<h2>Analyses</h2>
{''.join(parts)}
<h2>Inputs</h2>{_inputs_html(spec)}
</body></html>"""
    path = out / "report.html"
    path.write_text(doc)
    return path


def plan_images(out: Path, formats: list[str]) -> list[Path]:
    """The plan report's figures, from the analyses' tables `specrack plan` wrote into OUT (none
    built when no format is asked for)."""
    if not formats:
        return []
    tables = {k: pd.read_csv(out / f"{k}.csv") for k in ("plan", "configs", "curves", "map", "shift", "retraining",
                                                          "sensitivity")
              if (out / f"{k}.csv").is_file() and (out / f"{k}.csv").stat().st_size > 1}
    return write_images(plan_figures(tables), out, formats, "report")
