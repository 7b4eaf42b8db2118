"""`specrack sweep`: a utilisation sweep over strategies, with its report."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from experiments.analysis import attributions, crossovers, speedups
from experiments.commands.common import image_flags, rejected_line
from experiments.images import image_formats, write_images
from experiments.report import report_figures, write_report
from experiments.sweep import check_out_dir, curve_rows, executor_for, load_sweep, run_sweep, write_tables
from models import _native
from models.errors import ConfigError
from sim.capacity import CACHE_ENV, default_cache_dir


def add_parser(sub: Any, name: str, summary: str) -> None:
    w = sub.add_parser(name, help=summary)
    w.add_argument("sweep_file", nargs="?", default=None)
    w.add_argument("--out", default="results")
    w.add_argument("--quick", action="store_true", help="a small version that finishes in well under a minute")
    w.add_argument("--jobs", type=int, default=None, help="parallel processes (default: all cores)")
    w.add_argument("--executor", default="process", choices=["process", "serial", "dask-local", "dask"],
                   help="process: local process pool (default); dask-local: a Dask LocalCluster; dask: --scheduler")
    w.add_argument("--scheduler", default=None, help="Dask scheduler address for --executor dask, e.g. tcp://10.0.0.5:8786")
    w.add_argument("--scheduler-timeout", type=float, default=10.0, help="seconds to wait for the Dask scheduler")
    w.add_argument("--no-cache", action="store_true",
                   help="measure the variants' capacities anew, neither reading nor writing the capacity cache "
                        f"(${CACHE_ENV}; default ~/.cache/specrack/capacity)")
    image_flags(w)
    w.set_defaults(fn=run)


def fade_cause(why: pd.DataFrame, variant: str, x: str) -> str:
    """'; from u0 to u1 it moves by N%, mostly <cause>' for a variant's attribution rows ('' if none)."""
    g = why[why.variant == variant].sort_values(x)
    if len(g) < 2 or not g.main_cause.iloc[-1]:
        return ""
    last = g.iloc[-1]
    return (f"; over {last.against}, from {x} {g[x].iloc[0]:.2f} to {last[x]:.2f} it moves "
            f"{100 * math.expm1(last.dln_speedup):+.0f}%, mostly {last.main_cause}")


def run(a: argparse.Namespace) -> int:
    formats = image_formats(a)  # (Kaleido checked before any run)

    if a.jobs is not None and a.jobs < 1:
        raise ConfigError(f"--jobs must be a positive number of parallel processes, got {a.jobs}")
    timeout_s = getattr(a, "scheduler_timeout", 10.0)
    if not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ConfigError(f"--scheduler-timeout must be a positive number of seconds, got {timeout_s}")
    spec = load_sweep(a.sweep_file, quick=a.quick)
    out = Path(a.out)
    check_out_dir(out)
    if a.executor == "dask" and not a.scheduler:
        raise ConfigError("--executor dask needs --scheduler tcp://HOST:PORT (or use --executor dask-local)")
    n = len(spec.variants) * len(spec.points) * len(spec.seeds)
    print(f"sweep '{spec.name}': {len(spec.variants)} variants x {len(spec.points)} {spec.axis} points x "
          f"{len(spec.seeds)} seeds = {n} runs -> {out}/ (engine build: {_native.build_label()})", file=sys.stderr)
    try:
        with executor_for(a.executor, jobs=a.jobs, scheduler=getattr(a, "scheduler", None),
                          timeout_s=getattr(a, "scheduler_timeout", 10.0)) as executor:
            df, caps = run_sweep(spec, out, jobs=a.jobs, executor=executor,
                                 cache=None if a.no_cache else default_cache_dir())
    except KeyboardInterrupt:
        print(f"\ninterrupted: finished points are in {out / 'points'}; run the same command again to resume",
              file=sys.stderr)
        return 130
    write_tables(df, out)
    pd.DataFrame([{"variant": v, "concurrency": r[0], "rps": r[1], "tok_s": r[2], "mean_batch": r[3]}
                  for v, c in caps.items() for r in curve_rows(c)]).to_csv(out / "capacity.csv", index=False)
    failed = int((df.error != "").sum()) if "error" in df else 0
    if failed == len(df):
        first = (str(df.error.iloc[0]).splitlines() or [""])[0] if len(df) else "no point ran"
        raise ConfigError(f"every point of the sweep failed ({failed} of {n}; details above, rows in "
                          f"{out / 'results.csv'}); first error: {first}")
    ok = df[df.error == ""] if "error" in df else df
    sp = speedups(ok, spec.reference, x=spec.axis)
    sp.to_csv(out / "speedups.csv", index=False)
    why = attributions(ok, spec.reference, x=spec.axis, pairs=spec.pairs)
    why.to_csv(out / "attribution.csv", index=False)
    if len(why):  # the report reads each speculative row's causes beside its figures
        ok = ok.merge(why.drop(columns=["dln_speedup", "against"]), on=["variant", spec.axis], how="left")
    report = write_report(ok, sp, out, spec=spec, capacities=caps)
    images = (write_images(report_figures(ok, sp, spec=spec, capacities=caps), out, formats, "report")
              if formats else [])
    print(f"wrote {out / 'results.parquet'}, {out / 'results.csv'}, {out / 'speedups.csv'}, {report}"
          + "".join(f", {p}" for p in images))
    spec_variants = set(ok[ok.speculative_method != "none"].variant) if "speculative_method" in ok else set()
    for v, u in crossovers(sp).items():
        if v in spec_variants:
            where = f"crosses 1.0 at {spec.axis} {u:.2f}" if np.isfinite(u) else "stays above 1.0 over the sweep"
            print(f"  {v}: ITL (TPOT) speedup {where}{fade_cause(why, v, spec.axis)}")
    for line in rejected_lines(ok):
        print(line)
    if failed:
        print(f"{failed} point(s) failed; see stderr above", file=sys.stderr)
        return 1
    return 0


def rejected_lines(df: pd.DataFrame) -> list[str]:
    """One line per variant whose runs rejected requests (too long for the deployment): the
    worst point's count, share and reason (`rejected_line`; 'WARNING' over 1%)."""
    if "rejected_requests" not in df or not (df.rejected_requests > 0).any():
        return []
    out = []
    for v, g in df[df.rejected_requests > 0].groupby("variant", sort=False):
        worst = g.loc[g.rejected_share.idxmax()]
        line = rejected_line(int(worst.rejected_requests), float(worst.rejected_share), str(worst.rejected_reason),
                             str(worst.rejected_lines))
        if line:
            out.append(f"  {v} (worst point, of {len(g)} with rejections):" + line[1:])
    return out
