"""`specrack plan`: the search, the analyses and the report of a plan file, resumable, with the
ranked table on stdout."""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
from pathlib import Path
from typing import Any

import pandas as pd

from experiments.commands.common import image_flags
from experiments.images import image_formats
from experiments.plan import load_plan, run_tables
from experiments.plan_day import print_day, run_day
from experiments.plan_miss import rejection_line
from experiments.plan_report import plan_images, write_plan_report
from experiments.plan_spec import PlanSpec
from experiments.plan_store import clean, count, use_cache
from experiments.sweep import check_out_dir
from models import _native
from models.errors import ConfigError
from sim.capacity import CACHE_ENV, default_cache_dir


def add_parser(sub: Any, name: str, summary: str) -> None:
    pl = sub.add_parser(name, help=summary)
    pl.add_argument("plan_file")
    pl.add_argument("--out", default="results/plan")
    pl.add_argument("--quick", action="store_true", help="shorter runs and coarser analyses")
    pl.add_argument("--jobs", type=int, default=None)
    pl.add_argument("--no-analyses", action="store_true", help="only the ranked plan (no curves, map, shift)")
    pl.add_argument("--no-cache", action="store_true",
                    help="measure capacities anew, neither reading nor writing the capacity cache "
                         f"(${CACHE_ENV}; default ~/.cache/specrack/capacity)")
    image_flags(pl)
    pl.set_defaults(fn=run)


def run(a: argparse.Namespace) -> int:
    """`specrack plan`, with --png/--svg: Kaleido checked before any run, the figures after."""
    formats = image_formats(a)  # (Kaleido checked before any run)
    code = main_plan(a)
    images = plan_images(Path(a.out), formats) if code == 0 else []
    if formats:
        print("wrote " + ", ".join(map(str, images)) if images else "no figures to export (--no-analyses)")
    return code


def main_plan(a: Any) -> int:
    """`specrack plan`: the search, the analyses and the report, resumable (finished simulations
    are kept in OUT/points; see plan_store), with progress and an ETA on stderr."""
    out = Path(a.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a folder; name a folder for plan.csv and report.html")
    fresh = not out.exists()
    check_out_dir(out)
    use_cache(None if getattr(a, "no_cache", False) else default_cache_dir())
    points = str(out / "points")
    clean(points)
    kept = count(points)
    if sys.stderr.isatty():  # a sign of life before the capacity measurements (a bad file stays one error line)
        print(f"reading {a.plan_file}: checking it and measuring each strategy's capacity per replica...",
              file=sys.stderr)
    try:
        spec = dataclasses.replace(load_plan(a.plan_file, quick=a.quick, points=points, jobs=a.jobs), progress=True)
    except ConfigError:
        if fresh:  # a bad plan leaves nothing behind (capacity measurements of a plan that never ran)
            shutil.rmtree(out, ignore_errors=True)
        raise
    out.mkdir(parents=True, exist_ok=True)
    print(f"plan '{spec.name}'{' (--quick)' if a.quick else ''}:", file=sys.stderr)
    for k, v in spec.inputs().items():
        print(f"  {k}: {v}", file=sys.stderr)
    print(f"  engine build: {_native.build_label()}", file=sys.stderr)
    for w in spec.warnings:
        print(f"specrack: {w}", file=sys.stderr)
    if kept:
        print(f"resuming: {kept} finished simulations and capacities in {points} are reused", file=sys.stderr)
    try:
        tables = run_tables(spec, a.jobs, analyses=not a.no_analyses)
    except KeyboardInterrupt:
        print(f"\ninterrupted: {count(points)} finished simulations are kept in {points}; run the same command "
              "again to resume", file=sys.stderr)
        return 130
    for k, v in tables.items():
        v.to_csv(out / f"{k}.csv", index=False)
    report = write_plan_report(spec, tables, out)
    print(f"simulations and capacity measurements: {count(points) - kept} run now, {kept} reused from {points}",
          file=sys.stderr)
    print_ranked(tables["plan"], spec)
    print_outcome(tables["plan"], spec, out)
    if spec.day is not None:  # the day on an autoscaled fleet, next to the fixed rack sized for its peak
        print_day(spec.day, run_day(spec, tables["plan"], out)[0])
    print(f"wrote {out / 'plan.csv'}, {out / 'configs.csv'}, {report}")
    return 0


def print_ranked(df: pd.DataFrame, spec: PlanSpec | None = None) -> None:
    """The ranked table: each option's configuration, each SLO target's value (its percentile),
    the binding check by name, its monthly cost split ($/month), $ per million output tokens and
    its headroom (max rps: the highest req/s the rack serves within the SLO)."""
    if spec is not None:
        b = spec.base
        print(f"model {b.deployment.model} ({b.deployment.weights} weights, {b.deployment.kv_cache} KV), engine "
              f"{b.deployment.engine}, base rack {b.rack.num_gpus}x {b.rack.gpu} TP{b.deployment.tensor_parallel}, traffic "
              f"{spec.rate_rps:.2f} req/s; cost mode {spec.cost.mode}; {spec.search.rules()}")
    if "feasible" in df and not df.feasible.astype(bool).any():  # nothing passes: how close each option came
        print(f"{'rank':>4} {'strategy':<20} {'gpu':<9}  closest rack: what binds, how far it misses; the cheapest change")
        for i, r in df.iterrows():
            print(f"{i + 1:>4} {r.strategy:<20} {r.gpu:<9}  no rack: {no_rack_text(r)}")
        return
    checks = [c.removeprefix("slo_").removesuffix("_value") for c in df.columns if c.startswith("slo_") and c.endswith("_value")]
    heads = [f"{c.split('_')[0].upper()} {c.split('_')[1]}" for c in checks]
    lay = "layout" in df and bool((df.layout.fillna("aggregated") != "aggregated").any())
    print(f"{'rank':>4} {'strategy':<20} {'gpu':<9} " + (f"{'layout':<16} " if lay else "") + f"{'TP':>2} {'MBT':>5} {'seqs':>4} {'k':>2} {'reps':>4} {'GPUs':>5} "
          + " ".join(f"{h:>9}" for h in heads)
          + f" {'serving $/mo':>12} {'power $/mo':>10} {'total $/mo':>12} {'$/Mtok':>7} {'q tail':>6} {'max rps':>7}  floor"
          "  binding")
    for i, r in df.iterrows():
        if not r.feasible:
            print(f"{i + 1:>4} {r.strategy:<20} {r.gpu:<9}  no rack: {no_rack_text(r)}")
            continue
        vals = " ".join(f"{_fmt_s(r[f'slo_{c}_value']):>9}" for c in checks)
        b = r.get("binding_slo")
        binding = f"{b} ({r[f'slo_{b}_value'] / r[f'slo_{b}_target']:.0%} of target)" if isinstance(b, str) and b else "-"
        k = "-" if r.get("k") is None or r.get("k") != r.get("k") else f"{int(r.k)}"
        h = r.get("headroom_rps")
        hr = "-" if h is None or h != h else f"{float(h):.2f}"
        layout = f"{r.get('layout') or 'aggregated'!s:<16} " if lay else ""
        print(f"{i + 1:>4} {r.strategy:<20} {r.gpu:<9} {layout}{int(r.tp):>2} {int(r.max_num_batched_tokens):>5} "
              f"{int(r.max_num_seqs):>4} {k:>2} {int(r.replicas):>4} {int(r.billed_gpus):>5} {vals} "
              f"{r.serving_usd_per_month:>12,.0f} {r.power_usd_per_month:>10,.0f} {r.total_usd_per_month:>12,.0f} "
              f"{r.usd_per_mtok_at_slo:>7.2f} {r.quality_tail:>6.3f} {hr:>7}  {'pass' if r.passes_quality_floor else 'FAIL'}"
              f"   {binding}")


def no_rack_text(r: pd.Series) -> str:
    """An option with no passing rack on one line: its closest rack, what binds there and how far
    it misses, the cheapest change (plan_miss's columns); its reason alone where they are absent."""
    detail, fix = r.get("miss_detail"), r.get("fix")
    if not isinstance(detail, str) or not detail:
        return str(r.get("reason", ""))
    gpus = r.get("closest_gpus")
    where = f"closest rack {int(gpus)} GPUs: " if gpus is not None and gpus == gpus else ""
    return f"{where}{detail}" + (f"; change: {fix}" if isinstance(fix, str) and fix else "")


def print_outcome(df: pd.DataFrame, spec: PlanSpec, out: Path) -> None:
    """After the ranked table: one line when no option passes, and one when a run rejects more
    than 1% of its requests."""
    if "feasible" in df and not df.feasible.astype(bool).any():
        print(f"no rack passes: none of the {len(df)} options meets the SLO within max_gpus = {spec.max_gpus}; each "
              f"one's closest rack, what binds and the cheapest change are above, in {out / 'plan.csv'} (miss_* and fix* "
              f"columns) and in {out / 'report.html'} ('No rack passes')")
    line = rejection_line(df)
    if line:
        print(f"specrack: WARNING: {line}", file=sys.stderr)


def _fmt_s(v: float) -> str:
    return f"{v:.2f}s" if v >= 1 else f"{v * 1e3:.1f}ms"
