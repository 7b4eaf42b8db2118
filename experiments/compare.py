"""`specrack compare RUN_A RUN_B ...`: two or more sweep or plan output folders side by side.

A sweep folder holds results.parquet (or results.csv) and usually speedups.csv; a plan folder
holds plan.csv. The runs' key figures are aligned on their common keys (sweeps: variant x load
point, averaged over seeds; plans: strategy x GPU) with one column per figure and run, and the
inputs that differ between the runs (engine profile, GPU price, model, ...) are named from the
rows' own columns and, where a folder has one, its summary.json scenario."""

from __future__ import annotations

import html
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from experiments.images import image_formats, write_images
from experiments.report import colour_of
from models.errors import ConfigError

# the figures aligned per kind: (column, label, unit scale)
SWEEP_FIGURES = (("tpot_s_mean", "TPOT mean (ms)", 1e3), ("ttft_s_p99", "TTFT p99 (ms)", 1e3),
                 ("throughput_tok_s", "throughput (tok/s)", 1.0))
SPEEDUP_FIGURE = ("speedup_tpot_s_mean", "ITL (TPOT) speedup", 1.0)
PLAN_FIGURES = (("gpus", "GPUs", 1.0), ("total_usd_per_month", "$/month", 1.0), ("binding_slo", "binding SLO", 1.0))
# inputs that may differ between runs, as the rows name them
INPUT_COLUMNS = ("engine_profile", "usd_per_gpu_hour", "model", "weights", "kv_cache", "tensor_parallel", "gpu",
                 "num_gpus", "distilled_from", "speculative_method", "speculative_policy", "num_speculative_tokens",
                 "rate_rps")


@dataclass
class Run:
    """One output folder, read: its kind ("sweep" or "plan"), label and tables."""

    path: Path
    label: str
    kind: str
    table: pd.DataFrame
    speedups: pd.DataFrame | None = None
    scenario: dict[str, Any] = field(default_factory=dict)


def _read(path: Path, name: str) -> pd.DataFrame:
    f = path / name
    try:
        return pd.read_parquet(f) if name.endswith(".parquet") else pd.read_csv(f)
    except pd.errors.EmptyDataError:
        raise ConfigError(f"{f}: empty file; rerun the sweep or plan that wrote it") from None
    except (ValueError, OSError) as err:  # a corrupt or foreign file (pyarrow's errors are ValueErrors)
        text = (str(err).splitlines() or [""])[0]
        raise ConfigError(f"{f}: cannot be read ({type(err).__name__}: {text[:120]})") from None


def _require(df: pd.DataFrame, cols: tuple[str, ...], where: Path) -> None:
    missing = [c for c in cols if c not in df]
    if missing:
        raise ConfigError(f"{where}: not a specrack output table, it lacks the column(s) {', '.join(missing)}")
    if df.empty:
        raise ConfigError(f"{where}: has no rows; nothing to compare")


def load_run(path: str | Path, label: str | None = None) -> Run:
    """Read one sweep or plan output folder; a one-line ConfigError for anything else."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{p}: no such folder (give sweep or plan output folders)")
    if not p.is_dir():
        raise ConfigError(f"{p}: is a file, not an output folder (give the folder holding results.parquet or plan.csv)")
    label = label or p.name or str(p)
    scenario = _scenario_of(p)
    if (p / "results.parquet").is_file() or (p / "results.csv").is_file():
        name = "results.parquet" if (p / "results.parquet").is_file() else "results.csv"
        df = _read(p, name)
        _require(df, ("variant", "seed", *(c for c, _, _ in SWEEP_FIGURES)), p / name)
        if "error" in df:
            df = df[df.error.isna() | (df.error.astype(str) == "")]  # failed points are left out
        sp = _read(p, "speedups.csv") if (p / "speedups.csv").is_file() else None
        if sp is not None and not {"variant", "metric", "mean"} <= set(sp.columns):
            raise ConfigError(f"{p / 'speedups.csv'}: not a specrack speedups table (needs variant, metric, mean)")
        return Run(p, label, "sweep", df, sp, scenario)
    if (p / "plan.csv").is_file():
        df = _read(p, "plan.csv")
        _require(df, ("strategy", "gpu", "feasible"), p / "plan.csv")
        return Run(p, label, "plan", df, None, scenario)
    raise ConfigError(f"{p}: neither a sweep output (results.parquet or results.csv) nor a plan output (plan.csv)")


def _scenario_of(p: Path) -> dict[str, Any]:
    """The flattened scenario of a folder's summary.json, if it has a readable one."""
    f = p / "summary.json"
    try:
        sc = json.loads(f.read_text()).get("scenario") if f.is_file() else None
    except (OSError, ValueError, AttributeError):
        return {}
    return _dotted(sc) if isinstance(sc, dict) else {}


def _dotted(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_dotted(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = json.dumps(v) if isinstance(v, list) else v
    return out


def load_runs(paths: list[str]) -> list[Run]:
    if len(paths) < 2:
        raise ConfigError(f"compare needs two or more output folders, got {len(paths)}")
    labels = [Path(p).name or str(p) for p in paths]
    if len(set(labels)) < len(labels):  # same folder names in different places: label by the path given
        labels = [str(p) for p in paths]
    runs = [load_run(p, lab) for p, lab in zip(paths, labels, strict=True)]
    kinds = {r.kind for r in runs}
    if len(kinds) > 1:
        what = ", ".join(f"{r.path} ({r.kind})" for r in runs)
        raise ConfigError(f"cannot compare sweeps with plans: {what}; give folders of one kind")
    return runs


def _axis(df: pd.DataFrame) -> str:
    return "concurrency" if "concurrency" in df and df.concurrency.notna().any() else "utilisation"


def _sweep_long(run: Run) -> pd.DataFrame:
    df = run.table
    x = _axis(df)
    g = df.assign(**{x: df[x].astype(float).round(6)}).groupby(["variant", x], sort=False)
    figs = g[[c for c, _, _ in SWEEP_FIGURES]].mean()
    if run.speedups is not None and x in run.speedups:
        sp = run.speedups[run.speedups.metric == "tpot_s_mean"]
        sp = sp.assign(**{x: sp[x].astype(float).round(6)}).set_index(["variant", x])["mean"]
        figs[SPEEDUP_FIGURE[0]] = sp.reindex(figs.index)
    figs = figs.reset_index().rename(columns={x: "load"})
    figs.insert(1, "axis", x)
    return figs.assign(run=run.label)


def _plan_long(run: Run) -> pd.DataFrame:
    df = run.table
    cols = [c for c, _, _ in PLAN_FIGURES if c in df]
    out = df[["strategy", "gpu", "feasible", *cols]].copy()
    return out.assign(run=run.label)


def compare_table(runs: list[Run]) -> pd.DataFrame:
    """The aligned table: one row per key (sweeps: variant, axis, load; plans: strategy, gpu),
    one column per figure and run, named `<figure> [<run>]`."""
    if runs[0].kind == "sweep":
        keys, long = ["variant", "axis", "load"], pd.concat([_sweep_long(r) for r in runs], ignore_index=True)
        figs = [c for c, _, _ in (*SWEEP_FIGURES, SPEEDUP_FIGURE) if c in long]
    else:
        keys, long = ["strategy", "gpu"], pd.concat([_plan_long(r) for r in runs], ignore_index=True)
        figs = ["feasible", *(c for c, _, _ in PLAN_FIGURES if c in long)]
    order = list(dict.fromkeys(map(tuple, long[keys].itertuples(index=False))))  # first run's order first
    wide = pd.DataFrame(order, columns=keys)
    for fig in figs:
        for r in runs:
            part = long[long.run == r.label].set_index(keys)[fig]
            part = part[~part.index.duplicated()]
            wide[f"{fig} [{r.label}]"] = part.reindex(pd.MultiIndex.from_tuples(order, names=keys)).to_numpy()
    return wide


def _values(run: Run, col: str) -> str | None:
    if col in run.scenario:
        vals = [run.scenario[col]]
    elif col in run.table:
        vals = sorted({_norm(v) for v in run.table[col].tolist() if not _missing(v)}, key=str)
    else:
        return None
    return ", ".join(map(str, vals)) if vals else None


def _missing(v: Any) -> bool:
    return v is None or (isinstance(v, float) and math.isnan(v))


def _norm(v: Any) -> Any:
    if isinstance(v, float) and v.is_integer():
        return int(v)
    return round(v, 6) if isinstance(v, float) else v


def differences(runs: list[Run]) -> list[str]:
    """What differs between the runs' inputs: `name: A=value; B=value` per differing input."""
    cols = list(INPUT_COLUMNS)
    for r in runs:
        cols.extend(k for k in r.scenario if k not in cols)
    keys = ("variant",) if runs[0].kind == "sweep" else ("strategy", "gpu")
    out = []
    for col in cols:
        vals = [_values(r, col) for r in runs]
        if all(v is None for v in vals) or len(set(vals)) == 1:
            continue
        out.append(f"{col}: " + "; ".join(f"{r.label}={v if v is not None else '-'}" for r, v in zip(runs, vals, strict=True)))
    if runs[0].kind == "sweep":
        loads = [", ".join(f"{_norm(float(u)):g}" for u in sorted(r.table[_axis(r.table)].dropna().unique())) for r in runs]
        if len(set(loads)) > 1:
            out.append(f"{_axis(runs[0].table)} points: " + "; ".join(f"{r.label}=[{v}]" for r, v in zip(runs, loads, strict=True)))
    sets = [sorted(set(map(tuple, r.table[list(keys)].astype(str).itertuples(index=False)))) for r in runs]
    if any(s != sets[0] for s in sets):
        what = "variants" if runs[0].kind == "sweep" else "strategy x GPU options"
        out.append(f"{what}: " + "; ".join(f"{r.label}={len(s)}" for r, s in zip(runs, sets, strict=True)) + " (unmatched rows are blank)")
    return out


def differs_line(runs: list[Run]) -> str:
    diffs = differences(runs)
    return "inputs differ: " + " | ".join(diffs) if diffs else "inputs differ: nothing in the recorded inputs (same engine profile, prices, models)"


def figures(runs: list[Run], table: pd.DataFrame) -> list[tuple[str, Any]]:
    """Plotly figures of the aligned figures: per metric, one line (sweeps) or bar group (plans) per run."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    dashes = ("solid", "dash", "dot", "dashdot", "longdash")
    patterns = ("", "/", "x", ".", "+")
    out = []
    if runs[0].kind == "sweep":
        figs = [f for f in (*SWEEP_FIGURES, SPEEDUP_FIGURE) if any(f"{f[0]} [{r.label}]" in table for r in runs)]
        fig = make_subplots(rows=1, cols=len(figs), subplot_titles=[lab for _, lab, _ in figs])
        variants = list(dict.fromkeys(table.variant))
        for j, (col, _, scale) in enumerate(figs):
            for i, r in enumerate(runs):
                for v in variants:
                    part = table[table.variant == v].sort_values("load")
                    fig.add_trace(go.Scatter(x=part.load, y=part[f"{col} [{r.label}]"] * scale, mode="lines+markers",
                                             name=f"{v} [{r.label}]", legendgroup=f"{v} [{r.label}]", showlegend=j == 0,
                                             line={"color": colour_of(str(v)), "dash": dashes[i % len(dashes)]}),
                                  row=1, col=j + 1)
            fig.update_xaxes(title_text=str(table.axis.iloc[0]) if len(table) else "load", row=1, col=j + 1)
        fig.update_layout(title="sweeps side by side (line style = run)", height=480)
        out.append(("sweep", fig))
    else:
        option = table.strategy.astype(str) + " / " + table.gpu.astype(str)
        for col, lab, _ in PLAN_FIGURES[:2]:
            fig = go.Figure()
            for i, r in enumerate(runs):
                name = f"{col} [{r.label}]"
                if name in table:
                    # colour: the strategy's own (as in every chart); hatching: the run
                    fig.add_trace(go.Bar(x=option, y=pd.to_numeric(table[name], errors="coerce"), name=r.label,
                                         marker={"color": [colour_of(str(v)) for v in table.strategy],
                                                 "pattern": {"shape": patterns[i % len(patterns)]}}))
            fig.update_layout(title=f"{lab} per strategy / GPU, by run (hatching = run)", barmode="group", height=420,
                              xaxis_title="strategy / GPU", yaxis_title=lab)
            out.append((col, fig))
    return out


def write_html(runs: list[Run], table: pd.DataFrame, figs: list[tuple[str, Any]], out: Path) -> Path:
    import plotly.io as pio

    parts = [f'<section id="{n}">' + pio.to_html(f, include_plotlyjs=(i == 0), full_html=False, div_id=f"chart-{n}")
             + "</section>" for i, (n, f) in enumerate(figs)]
    runs_html = "".join(f"<li>{html.escape(r.label)}: {html.escape(str(r.path))} ({r.kind})</li>" for r in runs)
    diffs = "".join(f"<li>{html.escape(d)}</li>" for d in differences(runs)) or "<li>nothing in the recorded inputs</li>"
    tab = table.to_html(index=False, float_format=lambda x: f"{x:,.4g}", na_rep="", border=0, classes="compare")
    doc = f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>specrack compare</title>
<style>body{{font-family:system-ui,sans-serif;max-width:1400px;margin:2em auto;color:#222}}
table.compare{{border-collapse:collapse;font-size:90%}} table.compare td,table.compare th{{padding:3px 7px;border-bottom:1px solid #ddd;text-align:right}}</style>
</head><body>
<h1>specrack compare: {len(runs)} {runs[0].kind}s</h1>
<h2>Runs</h2><ul id="runs">{runs_html}</ul>
<h2>Inputs that differ</h2><ul id="differs">{diffs}</ul>
{''.join(parts)}
<h2>Side by side</h2>{tab}
</body></html>"""
    path = out / "compare.html"
    path.write_text(doc)
    return path


def terminal_text(table: pd.DataFrame) -> str:
    with pd.option_context("display.width", 250, "display.max_columns", None, "display.max_rows", 500):
        return table.to_string(index=False, float_format=lambda x: f"{x:.4g}", na_rep="-")


def main_compare(a: Any) -> int:
    formats = image_formats(a)  # (Kaleido checked before any work)
    out = Path(a.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a folder; name a folder for compare.csv and compare.html")
    runs = load_runs(a.runs)
    table = compare_table(runs)
    out.mkdir(parents=True, exist_ok=True)
    table.to_csv(out / "compare.csv", index=False)
    figs = figures(runs, table)
    page = write_html(runs, table, figs, out)
    print(terminal_text(table))
    print(differs_line(runs))
    images = write_images(figs, out, formats, "compare")
    print(f"wrote {out / 'compare.csv'}, {page}" + "".join(f", {p}" for p in images))
    return 0
