"""`specrack calibrate`: measured benchmark files -> fitted engine-profile software factors ->
an efficiency file a scenario reads (`deployment.efficiency_file`), with the side-by-side
comparison (table, CSV, chart) of measured and simulated figures before and after the fit.

`calibrate(benchmarks, sc)` reads the files (experiments.benchfiles), simulates each benchmark
on the scenario's deployment (experiments.calibrate.simulate_point: the same lengths, rate or
concurrency), and fits the chosen software factors by least squares on log(simulated /
measured) over `CAL_METRICS`: the median, p90 and p99 of TTFT, TPOT and ITL and the request and
output throughput, wherever a file has them. `write_outputs` writes efficiency.json (the whole
fitted Efficiency, via models.calibration.save_efficiency), comparison.csv and calibration.html.
"""

from __future__ import annotations

import dataclasses
import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from experiments.benchfiles import THROUGHPUTS, guess_model, model_ids, read_benchmarks
from experiments.calibrate import Fit, LoadPoint, compare, fit_software, with_factors
from models.calibration import save_efficiency
from models.catalog import MODELS
from models.cost import Efficiency
from models.engines import SOFTWARE_FIELDS, get_profile
from models.errors import ConfigError
from sim.deployment import build_runtime
from sim.scenario import Scenario, apply_overrides, load_scenario, parse_set, scenario_from_dict

PCTS = ("median", "p90", "p99")
LATENCY_NAMES = {"ttft": "TTFT", "tpot": "TPOT", "itl": "ITL"}
# the figures `specrack calibrate` fits (vLLM result names), wherever a benchmark file has them
CAL_METRICS = (*(f"{p}_{m}_ms" for m in LATENCY_NAMES for p in PCTS), "request_throughput", "output_throughput")
DEFAULT_FIELDS = ("step_overhead_s", "seq_overhead_s", "frontend_s")  # frontend_s: TTFT off by a constant
# least squares over simulated figures, which move in small jumps as events reorder: a Jacobian
# from 20% steps follows the trend, and factors closer than 0.1% are not told apart
DIFF_STEP = 0.2
TOL = 1e-3


def label(metric: str) -> str:
    """'p90_tpot_ms' -> 'TPOT p90 (ms)'; throughputs with their units."""
    if metric == "request_throughput":
        return "request throughput (req/s)"
    if metric == "output_throughput":
        return "output throughput (tok/s)"
    p, m, _ = metric.split("_")
    return f"{LATENCY_NAMES.get(m, m.upper())} {'p50' if p == 'median' else p} (ms)"


def load_label(p: LoadPoint) -> str:
    """A short name of a point's load: '4 req/s', 'inf', 'inf, 32 clients'."""
    s = "inf" if math.isinf(p.request_rate) else f"{p.request_rate:g} req/s"
    return s + (f", {p.max_concurrency} clients" if p.max_concurrency else "")


def _load_order(p: LoadPoint) -> tuple[float, float]:
    return (p.request_rate, float(p.max_concurrency or math.inf))


@dataclass(frozen=True)
class Calibration:
    """The outcome of `calibrate`: the fit, the figures before it, and the fitted profile."""

    scenario: Scenario  # the base scenario (before the fit)
    points: tuple[LoadPoint, ...]
    fields: tuple[str, ...]
    start: dict[str, float]  # the software factors the fit started from (the profile's)
    seeds: tuple[int, ...]
    metrics: tuple[str, ...]
    fit: Fit  # the least-squares fit (its rows and MAPE: the fitted figures only)
    before: tuple[dict[str, Any], ...]  # compare() rows of every measured figure at the start
    after: tuple[dict[str, Any], ...]  # ... and with the fitted factors
    efficiency: Efficiency  # the whole fitted efficiency profile (what efficiency.json holds)

    def _mape(self, rows: Sequence[dict[str, Any]]) -> float:
        fitted = {p.name: set(fitted_figures(p, self.metrics)) for p in self.points}
        errs = [abs(r["error_pct"]) for r in rows if r["metric"] in fitted[r["point"]]]
        return float(np.mean(errs)) if errs else float("nan")

    @property
    def mape_before_pct(self) -> float:
        """Mean |error| (%) over the fitted figures with the profile's factors."""
        return self._mape(self.before)

    @property
    def mape_pct(self) -> float:
        """Mean |error| (%) over the fitted figures with the fitted factors."""
        return self._mape(self.after)

    @property
    def engine(self) -> str:
        return self.scenario.deployment.engine

    def table(self) -> pd.DataFrame:
        """One row per (load point, figure): measured, simulated before and after the fit, errors."""
        info = {p.name: p for p in self.points}
        before = {(r["point"], r["metric"]): r for r in self.before}
        rows = []
        for r in self.after:
            b = before.get((r["point"], r["metric"]), {})
            p = info[r["point"]]
            rows.append(dict(point=r["point"], load=load_label(p), request_rate=p.request_rate,
                             max_concurrency=p.max_concurrency, num_prompts=p.num_prompts, metric=r["metric"],
                             figure=label(r["metric"]), fitted=r["metric"] in fitted_figures(p, self.metrics),
                             measured=r["measured"],
                             simulated_before=b.get("simulated", float("nan")),
                             error_before_pct=b.get("error_pct", float("nan")),
                             simulated=r["simulated"], error_pct=r["error_pct"]))
        return pd.DataFrame(rows)


def _unique_names(points: list[LoadPoint]) -> list[LoadPoint]:
    seen: dict[str, int] = {}
    out = []
    for p in points:
        k = seen.get(p.name, 0)
        seen[p.name] = k + 1
        out.append(p if k == 0 else dataclasses.replace(p, name=f"{p.name}~{k + 1}"))
    return out


def fitted_figures(p: LoadPoint, metrics: Sequence[str] = CAL_METRICS) -> tuple[str, ...]:
    """The figures of a load point the fit uses: its measured `metrics`, less the throughputs of
    an open-loop point at a finite request rate (there the throughput is the offered rate, as
    realised by the benchmark's random send times, which a simulation cannot replay: it says
    nothing about the engine). At request_rate = inf, with or without a concurrency cap, the
    engine sets the throughput and it is fitted."""
    skip = set(THROUGHPUTS) if math.isfinite(p.request_rate) and not p.max_concurrency else set()
    return tuple(m for m in metrics if m in p.measured and m not in skip)


def calibrate(benchmarks: Sequence[str | Path | LoadPoint], sc: Scenario, *,
              fields: Sequence[str] = DEFAULT_FIELDS, seeds: Sequence[int] = (1,),
              metrics: Sequence[str] = CAL_METRICS, start: dict[str, float] | None = None,
              max_nfev: int = 40, load: dict[str, Any] | None = None) -> Calibration:
    """Fit the software factors `fields` of the scenario's engine profile to measured benchmarks
    (file paths, read by experiments.benchfiles with the CSV `load` arguments, or LoadPoints),
    over each point's `fitted_figures`; every measured figure of `metrics` is compared."""
    bad = [f for f in fields if f not in SOFTWARE_FIELDS]
    if bad or not fields:
        raise ConfigError(f"--fit {','.join(fields)}: the fitted factors are the software ones "
                          f"({', '.join(SOFTWARE_FIELDS)}); name one or more")
    points: list[LoadPoint] = []
    for b in benchmarks:
        points.extend([b] if isinstance(b, LoadPoint) else read_benchmarks(b, **(load or {})))
    if not points:
        raise ConfigError("no benchmark to calibrate against: name one or more benchmark files")
    points = _unique_names(points)
    fit_points = [dataclasses.replace(p, measured={m: p.measured[m] for m in fitted_figures(p, metrics)})
                  for p in points]
    if not any(p.measured for p in fit_points):
        raise ConfigError(f"the benchmark files hold none of the fitted figures ({', '.join(metrics)})")
    prof = get_profile(sc.deployment.engine).software
    base = build_runtime(sc).cost.eff
    first = {f: float((start or {}).get(f, getattr(base, f, prof.get(f, 0.0)))) for f in fields}
    before = compare(with_factors(sc, first), points, seeds, metrics)
    fit = fit_software(sc, fit_points, fields, seeds, metrics, start=first, max_nfev=max_nfev, diff_step=DIFF_STEP,
                       tol=TOL)
    after = compare(with_factors(sc, fit.factors), points, seeds, metrics)
    eff = build_runtime(with_factors(sc, fit.factors)).cost.eff
    names = ", ".join(sorted({Path(p.source).name if p.source else p.name for p in points}))
    fitted = ", ".join(f"{k}={v:.4g}" for k, v in fit.factors.items())
    eff = dataclasses.replace(eff, source=(f"specrack calibrate: {sc.deployment.engine} profile, {fitted} fitted to "
                                           f"{len(points)} benchmark run(s) ({names}) of {sc.deployment.model} TP"
                                           f"{sc.deployment.tensor_parallel} on {sc.rack.gpu}; MAPE {fit.mape_pct:.1f}%"))
    return Calibration(sc, tuple(points), tuple(fields), first, tuple(seeds), metrics=tuple(metrics), fit=fit,
                       before=tuple(before), after=tuple(after), efficiency=eff)


def scenario_with_file(sc: Scenario, path: str | Path) -> Scenario:
    """The scenario with its efficiency taken from the file alone (no per-factor overrides)."""
    data = sc.model_dump(mode="json", exclude_none=True)
    data["deployment"].pop("efficiency", None)
    data["deployment"]["efficiency_file"] = str(Path(path).resolve())
    return scenario_from_dict(data)


def reproduction_error_pct(cal: Calibration, path: str | Path) -> float:
    """The largest |difference| (%) between the fitted figures and those simulated by a
    scenario that reads the efficiency file at `path` (0 when the file reproduces the fit)."""
    rows = compare(scenario_with_file(cal.scenario, path), cal.points, cal.seeds, cal.metrics)
    fitted = {(r["point"], r["metric"]): r["simulated"] for r in cal.after}
    return max((abs(r["simulated"] / fitted[(r["point"], r["metric"])] - 1.0) * 100.0 for r in rows), default=0.0)


# ----------------------------------------------------------------------------- text


def format_report(cal: Calibration) -> str:
    """The side-by-side table per load point, the fitted factors and MAPE before and after."""
    t = cal.table()
    lines = []
    for point, g in t.groupby("point", sort=False):
        lines.append(f"{point}: {g.num_prompts.iloc[0]} requests, {g.load.iloc[0]}")
        lines.append(f"  {'figure':<28}{'measured':>11}{'before':>11}{'error':>9}{'fitted':>11}{'error':>9}")
        for r in g.itertuples(index=False):
            lines.append(f"  {r.figure:<28}{r.measured:>11.4g}{r.simulated_before:>11.4g}{r.error_before_pct:>+8.1f}%"
                         f"{r.simulated:>11.4g}{r.error_pct:>+8.1f}%{'' if r.fitted else '  (not fitted)'}")
    lines.append(f"MAPE over the {int(t.fitted.sum())} fitted figures: {cal.mape_before_pct:.1f}% with the {cal.engine} "
                 f"profile's factors, {cal.mape_pct:.1f}% fitted (throughputs at a finite request rate are the offered "
                 "rate, not fitted)")
    lines.append(f"fitted {cal.engine} software factors (seeds {', '.join(map(str, cal.seeds))}):")
    for k, v in cal.fit.factors.items():
        lines.append(f"  {k} = {v:.4g}   (start {cal.start[k]:.4g})")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- chart and files

_COLORS = {"median": "#1f77b4", "p90": "#ff7f0e", "p99": "#d62728"}


def chart(cal: Calibration) -> go.Figure:
    """Measured (markers) vs simulated after the fit (dashed) and before it (dotted, faint), per
    load point ordered by offered load: TTFT, TPOT, ITL percentiles and the throughputs."""
    t = cal.table()
    order = [load_label(p) + f" [{p.name}]" for p in sorted(cal.points, key=_load_order)]
    t["x"] = t.load + " [" + t.point + "]"
    panels = [("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"), ("itl", "ITL (ms)"),
              ("output_throughput", "output throughput (tok/s)"), ("request_throughput", "request throughput (req/s)")]
    fig = make_subplots(rows=3, cols=2, subplot_titles=[p[1] for p in panels], vertical_spacing=0.12)
    for i, (key, _) in enumerate(panels):
        row, col = i // 2 + 1, i % 2 + 1
        series = [(p, f"{p}_{key}_ms") for p in PCTS] if key in LATENCY_NAMES else [("median", key)]
        for pct, metric in series:
            g = t[t.metric == metric].set_index("x").reindex([x for x in order if x in set(t.x)])
            g = g[g.measured.notna()]
            if g.empty:
                continue
            c = _COLORS[pct]
            name = "p50" if pct == "median" else pct
            show = (key in LATENCY_NAMES and i == 0) or (key == "output_throughput" and pct == "median")
            lg = name if key in LATENCY_NAMES else "throughput"
            fig.add_trace(go.Scatter(x=g.index, y=g.measured, mode="markers", marker={"color": c, "size": 9},
                                     name=f"{lg} measured", legendgroup=lg, showlegend=bool(show)), row, col)
            fig.add_trace(go.Scatter(x=g.index, y=g.simulated, mode="lines+markers", line={"color": c, "dash": "dash"},
                                     name=f"{lg} simulated (fitted)", legendgroup=lg, showlegend=bool(show)), row, col)
            fig.add_trace(go.Scatter(x=g.index, y=g.simulated_before, mode="lines", opacity=0.4,
                                     line={"color": c, "dash": "dot"}, name=f"{lg} simulated (profile)",
                                     legendgroup=lg, showlegend=bool(show)), row, col)
    fig.update_xaxes(type="category", categoryorder="array", categoryarray=order)
    fig.update_layout(template="plotly_white", height=1000,
                      title=(f"Measured vs simulated, {cal.scenario.deployment.model} TP{cal.scenario.deployment.tensor_parallel} "
                             f"on {cal.scenario.rack.gpu}, {cal.engine}: MAPE {cal.mape_before_pct:.1f}% -> "
                             f"{cal.mape_pct:.1f}%"))
    return fig


def write_outputs(cal: Calibration, out_dir: str | Path) -> dict[str, Path]:
    """efficiency.json, comparison.csv and calibration.html (self-contained) in `out_dir`."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a folder; name a folder (it is created if missing)")
    out.mkdir(parents=True, exist_ok=True)
    eff = save_efficiency(cal.efficiency, out / "efficiency.json")
    csv = out / "comparison.csv"
    cal.table().to_csv(csv, index=False)
    page = out / "calibration.html"
    factors = "".join(f"<li><code>{html.escape(k)}</code> = {v:.4g} (start {cal.start[k]:.4g})</li>"
                      for k, v in cal.fit.factors.items())
    body = cal.table().drop(columns=["metric", "request_rate", "max_concurrency"]).to_html(
        index=False, float_format=lambda x: f"{x:.4g}", border=0)
    page.write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>specrack calibrate</title>"
        "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse}"
        "td,th{padding:2px 8px;text-align:right}</style></head><body>"
        f"<h1>Calibration: {html.escape(cal.engine)} profile</h1>"
        f"<p>{html.escape(cal.efficiency.source)}</p><ul>{factors}</ul>"
        f"<p>MAPE over the {int(cal.table().fitted.sum())} fitted figures: {cal.mape_before_pct:.1f}% with the "
        f"profile's factors, {cal.mape_pct:.1f}% fitted (throughputs at a finite request rate are not fitted). Use it: <code>deployment.efficiency_file = \"{html.escape(str(eff))}\"</code> "
        f"with <code>deployment.engine = \"{html.escape(cal.engine)}\"</code>.</p>"
        + chart(cal).to_html(full_html=False, include_plotlyjs=True)
        + "<h2>Side by side</h2>" + body + "</body></html>")
    return {"efficiency": eff, "comparison": csv, "chart": page}


# ----------------------------------------------------------------------------- command line


def calibration_scenario(scenario: str | Path | None = None, *, model: str | None = None, gpu: str | None = None,
                         tp: int | None = None, engine: str | None = None, overrides: dict[str, Any] | None = None,
                         model_ids: Sequence[str] = ()) -> Scenario:
    """The one-replica deployment the benchmarks ran on: a scenario file's deployment and/or the
    flags (which win), dotted `overrides` on top; the model, when neither names it, guessed from
    the benchmark files' `model_id`. A benchmark drives one server, so the rack is one replica."""
    if scenario is not None:
        data = load_scenario(scenario).model_dump(mode="json", exclude_none=True)
    else:
        if gpu is None:
            raise ConfigError("give --gpu (a benchmark file does not record the GPU it ran on), or --scenario FILE")
        data = {"deployment": {"tensor_parallel": 1}, "workload": {"rate_rps": 1.0, "duration_s": 60.0, "warmup_s": 0.0}}
        if model is None:
            guesses = {mid: guess_model(mid) for mid in model_ids}
            found = sorted({g for g in guesses.values() if g})
            if len(found) > 1:
                raise ConfigError(f"the benchmark files name different models ({', '.join(found)}); calibrate one "
                                  "deployment at a time, or give --model")
            if not found:
                if not model_ids:
                    raise ConfigError("cannot tell the model: the benchmark files name none (no model_id); give --model")
                raise ConfigError(f"cannot tell the model: model_id {', '.join(repr(m) for m in model_ids)} is not in "
                                  f"the catalogue ({', '.join(MODELS)}); give --model")
            model = found[0]
    dep = data.setdefault("deployment", {})
    rack = data.setdefault("rack", {})
    for key, value in (("model", model), ("tensor_parallel", tp), ("engine", engine)):
        if value is not None:
            dep[key] = value
    if gpu is not None:
        rack["gpu"] = gpu
    data = apply_overrides(data, overrides or {})
    tp_set = data.get("deployment", {}).get("tensor_parallel", 1)
    if isinstance(tp_set, int) and not isinstance(tp_set, bool) and tp_set >= 1:
        data.setdefault("rack", {})["num_gpus"] = tp_set
    return scenario_from_dict(data)


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{flag} '{text}': expected whole numbers separated by commas, e.g. 1,2") from None
    if not out:
        raise ConfigError(f"{flag} '{text}': name at least one")
    return out


def main_calibrate(a: Any) -> int:
    """`specrack calibrate BENCH...` (experiments.cli)."""
    import sys

    out = Path(a.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a folder; name a folder (it is created if missing)")
    fields = tuple(f.strip() for f in a.fit.split(",") if f.strip())
    seeds = _ints(a.seeds, "--seeds") if a.seeds else ((1,) if a.quick else (1, 2))
    load: dict[str, Any] = {}
    if a.request_rate is not None:
        try:
            load["request_rate"] = float(a.request_rate)
        except ValueError:
            raise ConfigError(f"--request-rate '{a.request_rate}': expected requests/s or inf") from None
    if a.max_concurrency is not None:
        load["max_concurrency"] = a.max_concurrency
    if a.burstiness is not None:
        load["burstiness"] = a.burstiness
    points = [pt for b in a.bench for pt in read_benchmarks(b, **load)]  # file errors first
    sc = calibration_scenario(a.scenario, model=a.model, gpu=a.gpu, tp=a.tp, engine=a.engine,
                              overrides=parse_set(a.set or []), model_ids=model_ids(a.bench))
    dep = sc.deployment
    print(f"calibrate {dep.engine} on {dep.model} TP{dep.tensor_parallel} ({dep.weights} weights, {dep.kv_cache} KV) "
          f"on {sc.rack.gpu}: fit {', '.join(fields)} over {len(a.bench)} file(s), seeds {', '.join(map(str, seeds))}"
          f"{' (--quick)' if a.quick else ''}", file=sys.stderr)
    cal = calibrate(points, sc, fields=fields, seeds=seeds, max_nfev=15 if a.quick else 40)
    files = write_outputs(cal, out)
    drift = reproduction_error_pct(cal, files["efficiency"])
    print(format_report(cal))
    print(f"wrote {files['efficiency']} (reproduces the fitted figures: largest difference {drift:.2g}%), "
          f"{files['comparison']}, {files['chart']}")
    print(f"use it: deployment.efficiency_file = \"{files['efficiency']}\" with deployment.engine = \"{dep.engine}\" "
          f"(or --set deployment.efficiency_file={files['efficiency']})")
    return 0


__all__ = ["CAL_METRICS", "DEFAULT_FIELDS", "Calibration", "calibrate", "calibration_scenario", "chart", "fitted_figures", "format_report",
           "main_calibrate", "reproduction_error_pct", "scenario_with_file", "write_outputs"]
