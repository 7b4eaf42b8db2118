"""The day in the planner (`[day]` in a plan file): a day-long rate profile or trace, replayed per
strategy on an autoscaled fleet, next to the fixed rack sized for the day's peak.

The fixed-rack answer is the ordinary plan at the day's peak rate (the rack that carries the
busiest moment at the SLO, found by simulation). For each strategy's answer (its GPU type and
configuration), the day is then simulated with `[day] autoscale` (the `[autoscale]` table of a
scenario) between `min_replicas` and the fixed rack's replica count, and the day reports its
peak GPUs, GPU-hours per day, the cost per day (GPU-hours x the GPU's hourly price: autoscaling
saves rent; in buy mode the GPUs are owned and only power would move) and whether the SLO held
in every interval (`day_intervals.csv` has them all, `day.html` charts them).
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from pydantic import ValidationError

from experiments.plan_racks import configured, row_config, scenario_for
from experiments.plan_store import STORE
from experiments.planfile import DAY_KEYS, check_keys, num, table
from experiments.report import timeseries_chart
from models.catalog import get_gpu
from models.errors import ConfigError
from sim.scenario import Autoscale, CsvProfile, DiurnalProfile, format_validation_error
from sim.simulate import capacity_for, simulate
from sim.traces import load_rate_csv, load_trace
from sim.workload import profile_integral, profile_peak_rps

DEFAULT_AUTOSCALE = {"policy": "target_utilisation", "target": 0.7}


@dataclass(frozen=True)
class DaySpec:
    """A validated `[day]` table: the workload overrides that replay the day, its length, peak and
    mean rate (req/s), the autoscaler, the interval of the per-interval table, the seeds."""

    workload: dict[str, Any]
    duration_s: float
    peak_rps: float
    mean_rps: float
    autoscale: dict[str, Any]
    interval_s: float
    seeds: tuple[int, ...]
    source: str

    def describe(self) -> str:
        a = self.autoscale
        return (f"{self.source}: {self.duration_s / 3600:.2f} h, peak {self.peak_rps:.2f} req/s, mean "
                f"{self.mean_rps:.2f} req/s; autoscale {a['policy']} target {a['target']:g}, intervals of "
                f"{self.interval_s:g} s")


def parse_day(d: dict[str, Any], plan_dir: Path) -> DaySpec | None:
    """`[day]` of a plan file (None without one); one-line ConfigErrors naming `day.<key>`."""
    t = dict(table(d, "day"))
    if not t:
        return None
    check_keys(t, "day", DAY_KEYS)
    if ("rate_profile" in t) == ("trace" in t):
        raise ConfigError("day: set rate_profile = { shape = \"diurnal\", peak_rps = ..., trough_rps = ... } "
                          "(or shape = \"csv\", file = ...) or trace = '<path>', exactly one")
    interval = num(t, "interval_s", "day", 900.0, lo=0, lo_open=True)
    seeds = t.get("seeds", [1])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                                                          for x in seeds):
        raise ConfigError(f"day.seeds: must be a non-empty list of integers >= 0, got {seeds!r}")
    auto_in = t.get("autoscale", DEFAULT_AUTOSCALE)
    if not isinstance(auto_in, dict):
        raise ConfigError(f"day.autoscale: must be a table like {{ policy = \"target_utilisation\", target = 0.7 }}, "
                          f"got {auto_in!r}")
    try:
        auto = Autoscale.model_validate(auto_in).model_dump(mode="json", exclude_none=True)
    except ValidationError as err:
        raise ConfigError(f"day.autoscale.{format_validation_error(err)}") from None
    if "rate_profile" in t:
        prof_in = t["rate_profile"]
        if not isinstance(prof_in, dict):
            raise ConfigError(f"day.rate_profile: must be a table like {{ shape = \"diurnal\", peak_rps = 20, "
                              f"trough_rps = 4 }}, got {prof_in!r}")
        prof_in = dict(prof_in)
        if isinstance(prof_in.get("file"), str) and not Path(prof_in["file"]).is_absolute():
            prof_in["file"] = str((plan_dir / prof_in["file"]).resolve())
        try:
            model = DiurnalProfile if prof_in.get("shape") == "diurnal" else CsvProfile
            prof = model.model_validate(prof_in)
        except ValidationError as err:
            raise ConfigError(f"day.rate_profile.{format_validation_error(err)}") from None
        if isinstance(prof, DiurnalProfile):
            dur = prof.day_s
        else:
            starts, _ = load_rate_csv(prof.file)
            dur = float(starts[-1] + (starts[-1] - starts[-2] if starts.size > 1 else 3600.0))
        peak = profile_peak_rps(prof, dur)
        mean = float(profile_integral(prof, 0.0, dur)) / dur
        wl = {"workload.arrival": "poisson", "workload.rate_rps": None, "workload.utilisation": None,
              "workload.rate_profile": prof.model_dump(mode="json"), "workload.duration_s": dur}
        source = f"rate profile {prof.shape}"
    else:
        trace = str((plan_dir / str(t["trace"])).resolve())
        fmt = str(t.get("trace_format", "auto"))
        df = load_trace(trace, fmt)
        a = df.arrival_s.to_numpy(np.float64)
        dur = float(a[-1]) + 1e-6
        counts = np.histogram(a, bins=np.arange(0.0, dur + interval, interval))[0]
        peak = float(counts.max()) / interval
        mean = a.size / dur
        wl = {"workload.arrival": "trace", "workload.trace": trace, "workload.trace_format": fmt,
              "workload.rate_rps": None, "workload.utilisation": None, "workload.duration_s": dur}
        source = f"trace {Path(trace).name} (its own timing)"
    wl.update({"workload.num_requests": None, "workload.warmup_s": 0.0, "workload.trace_start_s": None,
               "workload.trace_end_s": None})
    return DaySpec(wl, dur, peak, mean, auto, interval, tuple(seeds), source)


def day_traffic(traffic: dict[str, Any], day: DaySpec) -> dict[str, Any]:
    """The [traffic] table the fixed-rack answer is planned at: the day's peak rate."""
    if traffic:
        raise ConfigError(f"traffic: a plan with [day] is sized for the day's peak ({day.peak_rps:.2f} req/s); "
                          f"remove [traffic] ({', '.join(traffic)})")
    return {"rate_rps": day.peak_rps}


def run_day(spec: Any, answer: pd.DataFrame, out: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Per feasible strategy x GPU of the plan: the day on the autoscaled fleet (max replicas: the
    fixed rack's). Returns (day table, per-interval table); writes day.csv, day_intervals.csv, day.html."""
    day: DaySpec = spec.day
    rows, ivs = [], []
    for _, r in answer.iterrows():
        if not bool(r.feasible):
            continue
        strat = next(s for s in spec.strategies if s.name == r.strategy)
        chosen = configured(strat, spec.base, row_config(r))
        reps = int(r.replicas)
        sc = scenario_for(spec.base, chosen, r.gpu, spec.prices, reps, None)
        price = sc.rack.usd_per_gpu_hour if sc.rack.usd_per_gpu_hour is not None else get_gpu(r.gpu).usd_per_gpu_hour
        auto = {**day.autoscale, "max_replicas": min(reps, int(day.autoscale.get("max_replicas", reps)))}
        auto["min_replicas"] = min(int(auto.get("min_replicas", 1)), auto["max_replicas"])
        auto.pop("initial_replicas", None)
        sc = sc.with_overrides({**day.workload, "sim.interval_s": day.interval_s, "autoscale": auto})
        for seed in day.seeds:
            res = simulate(sc, seed, capacity=capacity_for(sc, store=STORE))
            s, iv = res.summary, res.intervals
            assert iv is not None
            per_gpu = int(r.billed_gpus) / reps if reps else 0.0
            fixed_gpu_h = float(r.billed_gpus) * day.duration_s / 3600.0
            rows.append({
                "strategy": r.strategy, "gpu": r.gpu, "seed": seed, "fixed_replicas": reps,
                "fixed_gpus": int(r.billed_gpus), "fixed_gpu_hours_per_day": fixed_gpu_h * 86400.0 / day.duration_s,
                "fixed_usd_per_day": fixed_gpu_h * price * 86400.0 / day.duration_s,
                "peak_replicas": s["replicas_peak"], "peak_gpus": round(s["replicas_peak"] * per_gpu),
                "mean_replicas": s["replicas_mean"], "gpu_hours_per_day": s["gpu_hours_per_day"],
                "usd_per_day": s["gpu_hours_per_day"] * price, "usd_per_gpu_hour": price,
                "day_verdict": s["verdict"], "day_slo_met": bool(s["slo_met"]),
                "intervals_slo_met_share": float(iv.slo_met.mean()),
                "ttft_s_p99": s["ttft_s"]["p99"], "tpot_s_p99": s["tpot_s"]["p99"],
            })
            ivs.append(iv.assign(strategy=r.strategy, gpu=r.gpu, seed=seed))
    table = pd.DataFrame(rows)
    if len(table):
        table["saving_vs_fixed"] = 1.0 - table.usd_per_day / table.fixed_usd_per_day
    intervals_df = pd.concat(ivs, ignore_index=True) if ivs else pd.DataFrame()
    table.to_csv(out / "day.csv", index=False)
    intervals_df.to_csv(out / "day_intervals.csv", index=False)
    write_day_report(day, table, intervals_df, out / "day.html")
    return table, intervals_df


def print_day(day: DaySpec, table: pd.DataFrame) -> None:
    print(f"day: {day.describe()}")
    print(f"{'strategy':<22} {'gpu':<9} {'fixed GPUs':>10} {'fixed $/day':>11} {'peak GPUs':>9} {'GPU-h/day':>9} "
          f"{'$/day':>9} {'saving':>7}  SLO intervals")
    for _, r in table.iterrows():
        print(f"{r.strategy:<22} {r.gpu:<9} {r.fixed_gpus:>10} {r.fixed_usd_per_day:>11,.0f} {r.peak_gpus:>9} "
              f"{r.gpu_hours_per_day:>9.1f} {r.usd_per_day:>9,.0f} {r.saving_vs_fixed:>7.0%}  "
              f"{r.intervals_slo_met_share:.0%} met")


def write_day_report(day: DaySpec, table: pd.DataFrame, intervals_df: pd.DataFrame, path: Path) -> Path:
    """A self-contained page: the day's table and the time series (experiments.report.timeseries_chart)."""
    parts = [f"<h1>The day: autoscaled vs the fixed rack sized for the peak</h1><p>{html.escape(day.describe())}</p>",
             table.to_html(index=False, float_format=lambda v: f"{v:,.3g}")]
    if len(intervals_df):
        fig = timeseries_chart(intervals_df, by="strategy")
        parts.append(fig.to_html(full_html=False, include_plotlyjs="inline"))
    path.write_text("<!doctype html><html><head><meta charset='utf-8'><title>day</title></head><body>"
                    + "\n".join(parts) + "</body></html>")
    return path
