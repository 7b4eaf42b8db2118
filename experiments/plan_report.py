"""Charts and the self-contained HTML report of a capacity plan."""

from __future__ import annotations

import html
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import plotly.io as pio
from plotly.subplots import make_subplots

from experiments.plan import CAP_SLACK
from experiments.report import PALETTE


def curves_chart(curves: pd.DataFrame) -> go.Figure:
    """GPUs needed and cost per month vs traffic, one line per strategy."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("GPUs needed to meet the SLO", "cost per month (USD)"))
    ok = curves[curves.feasible.astype(bool)]
    for i, (name, g) in enumerate(ok.groupby(["strategy", "gpu"], sort=False)):
        label = f"{name[0]} ({name[1]})"
        g = g.sort_values("rate_rps")
        c = PALETTE[i % len(PALETTE)]
        fig.add_trace(go.Scatter(x=g.rate_rps, y=g.gpus, name=label, legendgroup=label, line={"color": c}), 1, 1)
        fig.add_trace(go.Scatter(x=g.rate_rps, y=g.total_usd_per_month, name=label, legendgroup=label,
                                 showlegend=False, line={"color": c}), 1, 2)
    fig.update_xaxes(title_text="traffic (requests/s)", type="log")
    fig.update_yaxes(type="log")
    fig.update_layout(template="plotly_white", height=460, title="Capacity curves")
    return fig


def decision_map_chart(win: pd.DataFrame) -> go.Figure:
    """Heatmap over utilisation x acceptance: which strategy wins, with its margin."""
    names = sorted(set(win.winner))
    code = {n: i for i, n in enumerate(names)}
    us = sorted(win.utilisation.unique())
    accs = sorted(win.acceptance.unique())
    z = np.full((len(accs), len(us)), np.nan)
    text = [["" for _ in us] for _ in accs]
    for _, r in win.iterrows():
        i, j = accs.index(r.acceptance), us.index(r.utilisation)
        z[i, j] = code[r.winner]
        m = "" if not np.isfinite(r.margin) else f"<br>+{100 * r.margin:.0f}%"
        text[i][j] = f"{r.winner}{m}"
    colours = [PALETTE[i % len(PALETTE)] for i in range(len(names))]
    scale = []
    for i, c in enumerate(colours):
        lo, hi = i / len(colours), (i + 1) / len(colours)
        scale += [[lo, c], [hi, c]]
    fig = go.Figure(go.Heatmap(z=z, x=[f"{u:.2f}" for u in us], y=[f"{a:.2f}" for a in accs], text=text,
                               texttemplate="%{text}", colorscale=scale, zmin=-0.5, zmax=len(names) - 0.5,
                               showscale=False, hovertemplate="utilisation %{x}, acceptance %{y}<br>%{text}<extra></extra>"))
    fig.update_layout(template="plotly_white", height=480,
                      title="Decision map: fastest strategy (mean TPOT) meeting the SLO and quality floor; margin over the runner-up",
                      xaxis_title="rack utilisation (offered / baseline capacity)", yaxis_title="per-token acceptance rate")
    return fig


def shift_chart(shift: pd.DataFrame) -> go.Figure:
    """Speedup on benchmark-like traffic (tail share 0) vs production-like (growing tail)."""
    fig = go.Figure()
    for i, (s, g) in enumerate(shift.groupby("strategy", sort=False)):
        fig.add_trace(go.Bar(x=[f"{100 * t:.0f}% tail" for t in g.tail_share], y=g.speedup, name=s,
                             marker_color=PALETTE[i % len(PALETTE)]))
    fig.add_hline(y=1.0, line_dash="dash")
    fig.update_layout(template="plotly_white", height=440, barmode="group",
                      title="Acceptance shift: how much of the benchmark speedup survives production traffic",
                      xaxis_title="traffic mix (0% tail = benchmark-like)", yaxis_title="TPOT speedup over the first strategy")
    return fig


def retraining_chart(rt: pd.DataFrame) -> go.Figure:
    """Monthly total cost vs teacher update cadence, and the tail quality lost while stale."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("total cost per month (USD)", "tail quality (stale student included)"))
    for i, (name, g) in enumerate(rt.groupby(["strategy", "gpu"], sort=False)):
        c = PALETTE[i % len(PALETTE)]
        label = f"{name[0]} ({name[1]})"
        fig.add_trace(go.Scatter(x=g.cadence, y=g.total_usd_per_month, name=label, legendgroup=label,
                                 line={"color": c}), 1, 1)
        fig.add_trace(go.Scatter(x=g.cadence, y=g.quality_tail, name=label, legendgroup=label, showlegend=False,
                                 line={"color": c}), 1, 2)
    fig.update_xaxes(title_text="teacher update cadence")
    fig.update_layout(template="plotly_white", height=440, title="The retraining obligation")
    return fig


def pareto_chart(configs: pd.DataFrame) -> go.Figure:
    """Every simulated passing configuration's monthly cost vs the capacity of its rack, the
    cost-vs-capacity Pareto frontier joined."""
    fig = go.Figure()
    ok = configs[configs.status == "passes"]
    for i, (name, g) in enumerate(ok.groupby(["strategy", "gpu"], sort=False)):
        label = [f"TP{int(r.tp)}, MBT {int(r.max_num_batched_tokens)}, seqs {int(r.max_num_seqs)}"
                 + ("" if r.get("k") is None or r.get("k") != r.get("k") else f", k {int(r.k)}")
                 + f": {int(r.replicas)} replicas" for _, r in g.iterrows()]
        fig.add_trace(go.Scatter(x=g.capacity_rps, y=g.total_usd_per_month, mode="markers", name=f"{name[0]} ({name[1]})",
                                 text=label, marker={"color": PALETTE[i % len(PALETTE)], "size": 9},
                                 hovertemplate="%{text}<br>capacity %{x:.2f} req/s<br>$%{y:,.0f}/month<extra></extra>"))
    front = ok[ok.pareto.astype(bool)].sort_values("capacity_rps")
    fig.add_trace(go.Scatter(x=front.capacity_rps, y=front.total_usd_per_month, mode="lines", name="Pareto frontier",
                             line={"color": "#222", "dash": "dash", "shape": "hv"}))
    fig.update_layout(template="plotly_white", height=460,
                      title="Configurations: monthly cost vs rack capacity (passing racks; frontier dashed)",
                      xaxis_title="rack capacity (req/s, replicas x capacity per replica)", yaxis_title="total cost ($/month)")
    return fig


_MONEY = {"serving_usd_per_month": "serving ($/month)", "power_usd_per_month": "power ($/month)",
          "retraining_usd_per_month": "retraining ($/month)", "total_usd_per_month": "total ($/month)",
          "lower_bound_usd_per_month": "cheapest possible ($/month)"}


def _money(df: pd.DataFrame) -> pd.DataFrame:
    """Cost columns as text with units: $/month with thousands separators, $/Mtok to 2 decimals."""
    out = df.copy()
    for c in _MONEY:
        if c in out:
            out[c] = [f"${v:,.0f}" if v == v else "" for v in out[c].astype(float)]
    if "usd_per_mtok_at_slo" in out:
        out["usd_per_mtok_at_slo"] = [f"${v:,.2f}" if v == v else "" for v in out.usd_per_mtok_at_slo.astype(float)]
    return out.rename(columns={**_MONEY, "usd_per_mtok_at_slo": "$/Mtok (output) at the SLO"})


def _table_html(df: pd.DataFrame) -> str:
    """The ranked options: the configuration, each SLO check by name (value, target, met), the
    binding one, the simulated rate and the requests behind the percentiles, the cost split."""
    checks = [c for c in df.columns if c.startswith("slo_") and c.endswith(("_value", "_target", "_met"))]
    cols = [c for c in ("strategy", "gpu", "engine_profile", "tp", "max_num_batched_tokens", "max_num_seqs", "k",
                        "replicas", "gpus", "nodes", "billed_gpus", "utilisation", "verdict", *checks, "binding_slo",
                        "simulated_rate_rps", "judged_requests", "itl_samples", "cost_mode", "serving_usd_per_month",
                        "power_usd_per_month", "retraining_usd_per_month", "total_usd_per_month", "usd_per_mtok_at_slo",
                        "quality_in_distribution", "quality_tail", "passes_quality_floor", "feasible", "reason") if c in df]
    return _money(df[cols]).to_html(index=False, float_format=lambda x: f"{x:,.3f}", na_rep="", border=0, classes="plan")


def _configs_html(df: pd.DataFrame) -> str:
    cols = [c for c in ("strategy", "gpu", "tp", "max_num_batched_tokens", "max_num_seqs", "k", "status",
                        "capacity_per_replica_rps", "lower_bound_replicas", "lower_bound_usd_per_month", "replicas",
                        "billed_gpus", "capacity_rps", "cost_mode", "total_usd_per_month", "usd_per_mtok_at_slo", "pareto",
                        "reason") if c in df]
    return _money(df[cols]).to_html(index=False, float_format=lambda x: f"{x:,.3f}", na_rep="", border=0, classes="plan")


def _inputs_html(spec: Any) -> str:
    """The effective inputs the plan ran with, as a definition list."""
    items = "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in spec.inputs().items())
    warn = "".join(f'<p class="warn">{html.escape(w)}</p>' for w in spec.warnings)
    return f'<dl id="inputs">{items}</dl>{warn}'


PRUNING = ("Pruning, before any rack is simulated: a configuration of capacity C req/s per replica (measured by "
           f"sim.capacity) needs at least ceil(rate / (C x {1 + CAP_SLACK:g})) replicas ({CAP_SLACK:.0%} slack for the "
           "capacity's noise), more if "
           "min_replicas, max_utilisation or n+1 ask; it is skipped if that exceeds max_gpus, or if that cheapest "
           "possible rack already costs more than the best passing rack found so far (configurations are simulated "
           "cheapest bound first). Pruned configurations are listed with their bound; the frontier is drawn over "
           "the simulated passing ones.")


def plan_figures(tables: dict[str, pd.DataFrame]) -> list[tuple[str, go.Figure]]:
    """The plan report's figures by section name, from the analyses' tables that are present
    (also exported by `plan --png/--svg`)."""
    figs = []
    configs = tables.get("configs")
    if configs is not None and len(configs) and (configs.get("status") == "passes").any():
        figs.append(("pareto", pareto_chart(configs)))
    if "curves" in tables:
        figs.append(("curves", curves_chart(tables["curves"])))
    if "map" in tables:
        figs.append(("decision-map", decision_map_chart(tables["map"])))
    if "shift" in tables:
        figs.append(("shift", shift_chart(tables["shift"])))
    if "retraining" in tables and len(tables["retraining"]):
        figs.append(("retraining", retraining_chart(tables["retraining"])))
    return figs


def write_plan_report(spec: Any, tables: dict[str, pd.DataFrame], out: str | Path) -> Path:
    out = Path(out)
    figs = plan_figures(tables)
    configs = tables.get("configs")
    parts = [f'<section id="{n}">' + pio.to_html(f, include_plotlyjs=(i == 0), full_html=False, div_id=f"chart-{n}")
             + "</section>" for i, (n, f) in enumerate(figs)]
    plan = tables["plan"]
    best = plan[plan.feasible.astype(bool) & plan.get("passes_quality_floor", True).astype(bool)]
    verdict = (f"Cheapest option meeting the SLO and the tail-quality floor ({spec.quality_floor_tail:.2f}): "
               f"<b>{html.escape(str(best.iloc[0].strategy))}</b> on {int(best.iloc[0].gpus)}x {html.escape(str(best.iloc[0].gpu))}, "
               f"TP{int(best.iloc[0].tp)}, max_num_batched_tokens {int(best.iloc[0].max_num_batched_tokens)}, "
               f"max_num_seqs {int(best.iloc[0].max_num_seqs)}, ${best.iloc[0].total_usd_per_month:,.0f}/month "
               f"({html.escape(str(best.iloc[0].cost_mode))}), ${best.iloc[0].usd_per_mtok_at_slo:,.2f} per million output tokens.") if len(best) else "No option meets the SLO and the quality floor."
    dep = spec.base.deployment
    configs_part = ""
    if configs is not None and len(configs):
        configs_part = (f"<h2>Configurations searched</h2><p>{html.escape(spec.search.describe())}. {PRUNING}</p>"
                        + _configs_html(configs))
    doc = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>specrack plan: {html.escape(spec.name)}</title>
<style>body{{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;color:#222}}
table.plan{{border-collapse:collapse}} dl#inputs dt{{font-weight:bold;float:left;clear:left;width:11em}}
dl#inputs dd{{margin-left:12em}} p.warn{{color:#b00;font-weight:bold}} table.plan td,table.plan th{{padding:4px 8px;border-bottom:1px solid #ddd;text-align:right}}</style>
</head><body>
<h1>specrack plan: {html.escape(spec.name)}</h1>
<p>Model {html.escape(dep.model)} ({html.escape(dep.weights)} weights, {html.escape(dep.kv_cache)} KV cache) on the
{html.escape(dep.engine)} engine profile; base rack {spec.base.rack.num_gpus}x {html.escape(spec.base.rack.gpu)} at TP{dep.tensor_parallel};
traffic {html.escape(spec.traffic.describe() if spec.traffic else f"{spec.rate_rps:.2f} req/s")}; SLO {html.escape(spec.base.slo.describe())};
racks searched with the simulator up to {spec.max_gpus} GPUs; seeds {list(spec.seeds)}; {spec.base.workload.duration_s:.0f} s per run;
costs in {html.escape(spec.cost.mode)} mode.</p>
<h2>Inputs</h2>{_inputs_html(spec)}
<p id="verdict">{verdict}</p>
<h2>Ranked options</h2>{_table_html(plan)}
{configs_part}
{''.join(parts)}
</body></html>"""
    path = out / "report.html"
    path.write_text(doc)
    return path
