"""`specrack run`: simulate one scenario and write its tables."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from experiments.commands.common import load, rejected_line, scenario_parser
from experiments.why import LIGHT_UTILISATION, why_lines, why_speedup
from models.errors import ConfigError
from sim.capacity import CACHE_ENV, CapacityStore, default_cache_dir, needs_capacity
from sim.metrics import expand_steps
from sim.scenario import Scenario
from sim.simulate import capacity_for, simulate


def add_parser(sub: Any, name: str, summary: str) -> None:
    s = scenario_parser(sub, name, summary)
    s.add_argument("--out", default="results/run")
    s.add_argument("--steps", choices=("runs", "full"), default="runs",
                   help="steps.parquet: fused decode runs as one run-length row each (default), or one row per step")
    s.add_argument("--capacity", action="store_true",
                   help="also measure the deployment's capacity (and with [speculative] its capacity with "
                        "speculation) and report it; on when the load is a utilisation")
    s.add_argument("--chart", action="store_true",
                   help="also write intervals.html, the run over time (on when the scenario sets [sim] interval_s)")
    s.add_argument("--no-cache", action="store_true",
                   help="measure capacities anew, neither reading nor writing the capacity cache "
                        "($SPECRACK_CAPACITY_CACHE; default ~/.cache/specrack/capacity)")
    s.add_argument("--why", nargs="?", type=float, const=LIGHT_UTILISATION, default=None, metavar="LIGHT",
                   help="with [speculative]: why the TPOT speedup here differs from the one at a light load "
                        f"(utilisation LIGHT, default {LIGHT_UTILISATION:g}): 3-4 more runs")
    s.set_defaults(fn=run)


def run(a: argparse.Namespace) -> int:
    out_dir = Path(a.out)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out {out_dir}: exists and is not a folder; name a folder (it is created if missing)")
    sc = load(a)
    if a.why is not None and sc.speculative is None:
        raise ConfigError("--why explains a speculative speedup; the scenario has no [speculative] section")
    if a.why is not None and not 0 < a.why < 1:
        raise ConfigError(f"--why {a.why:g}: the light load is a utilisation in (0, 1); try --why 0.1")
    store = CapacityStore(None if a.no_cache else default_cache_dir())
    # the capacity is measured (or read from the cache) when the run needs it or it was asked for
    with_capacity = a.capacity or needs_capacity(sc) is not None
    res = simulate(sc, a.seed, capacity=capacity_for(sc, with_capacity=with_capacity, store=store), progress=True,
                   with_capacity=with_capacity)
    s = res.summary
    if (not with_capacity and s["verdict"] == "overloaded" and s.get("trend_only") and s["loop"] == "open"
            and sc.disaggregation is None):
        # an overload read off a trend alone: judged again against the deployment's own capacity
        # (measured now, or read from the capacity cache), as every sweep point is
        # (docs/METRICS.md, 'Stability': judged against capacity)
        res = simulate(sc, a.seed, capacity=capacity_for(sc, with_capacity=True, store=store), with_capacity=True)
    if a.steps == "full":  # one row per engine step: fused runs of decode steps expanded
        res = dataclasses.replace(res, step_table=expand_steps(res.step_table))
    out = res.write(a.out)
    s = res.summary
    verdict = {"stable": "stable", "overloaded": "OVERLOADED", "insufficient": "INSUFFICIENT TO JUDGE",
               "unjudged": "STOPPED: SLO CERTAIN TO FAIL"}[s["verdict"]]
    rejected = f" ({s['rejected_requests']:,} rejected)" if s["rejected_requests"] else ""
    print(f"{sc.name} seed {res.seed}: {s['completed_requests']}/{s['offered_requests']} requests{rejected}, "
          f"{s['offered_rps']:.2f} req/s {'offered' if s['loop'] == 'open' else 'sent'}, {s['throughput_rps']:.2f} served, {s['throughput_tok_s']:.0f} tok/s; "
          f"{verdict}{' (' + s['verdict_reason'] + ')' if s['verdict_reason'] else ''} -> {out}")
    note = rejected_line(s["rejected_requests"], s["rejected_share"], s["rejected_reason"], s["rejected_lines"])
    if note:
        print(note)
    note = window_note(sc, s, res.request_table["arrival_s"])
    if note:
        print(note)
    if "capacity_rps" in s and "disaggregation" in s:
        print(f"  capacity of the aggregated rack on these GPUs {s['capacity_rps']:.2f} req/s (a disaggregated "
              "rack's own is not measured)")
    elif "capacity_rps" in s:
        print(f"  capacity {s['capacity_rps']:.2f} req/s" + (f", with speculation {s['speculative_capacity_rps']:.2f}"
                                                            if "speculative_capacity_rps" in s else ""))
    if "disaggregation" in s:
        print(disagg_line(s["disaggregation"]))
    if "cache_hit_rate" in s:  # prefix caching acted (requests carry block hashes)
        print(cache_line(s))
    if s["loop"] != "open":
        _print_benchmark(s)
    for name, c in s["slo"].items():
        metric, pct, _ = name.split("_")
        print(f"  SLO {name}: {pct} {metric.upper()} {c['value'] * 1e3:.1f} ms vs target {c['target'] * 1e3:.1f} ms "
              f"{'met' if c['met'] else 'MISSED'}")
    print(f"  SLO {'met' if s['slo_met'] else 'NOT met'}")
    if a.why is not None:
        for line in why_lines(why_speedup(sc, res, a.seed, a.why, store)):
            print(line)
    iv = res.interval_table
    if iv is not None and len(iv) > 1:  # the run over time: intervals.csv/.parquet, and a chart when asked
        chart = a.chart or "interval_s" in sc.sim.model_fields_set
        if chart:
            from experiments.report import timeseries_chart  # (plotly: loaded only for the chart)

            timeseries_chart(iv.to_pandas()).write_html(out / "intervals.html", include_plotlyjs="inline")
        met = float(iv["slo_met"].mean())
        print(f"  {len(iv)} intervals of {sc.sim.interval_s:g} s ({met:.0%} meet the SLO): replicas peak "
              f"{s['replicas_peak']}, mean {s['replicas_mean']:.2f}, {s['gpu_hours']:.1f} GPU-hours "
              f"({s['gpu_hours_per_day']:.0f} per day) -> {out / ('intervals.html' if chart else 'intervals.csv')}")
    elif a.chart:
        print(f"  no intervals.html: the run spans one interval of {sc.sim.interval_s:g} s; set a shorter "
              "[sim] interval_s (--set sim.interval_s=60) to chart it over time")
    if store.write_error is not None:
        print(f"  note: capacity not cached ({store.write_error}); set {CACHE_ENV} to a writable folder, or to off")
    return 0


def window_note(sc: Scenario, s: dict[str, Any], sent: np.ndarray) -> str | None:
    """One line on a fixed set of requests (num_requests, a trace) whose window is not the usual
    [warmup_s, last arrival]: a burst, measured over its drain, or a warm-up that holds every
    request (docs/METRICS.md, 'Window'); None otherwise."""
    wl = sc.workload
    t = sent[~np.isnan(sent)]
    if (wl.num_requests is None and not wl.replays_trace) or t.size == 0:
        return None
    start, end = s["window_start_s"], s["window_end_s"]
    if t.min() == t.max():
        skipped = f"; warmup_s = {wl.warmup_s:g} does not apply" if start < wl.warmup_s else ""
        return (f"  a burst: all {t.size} requests sent at {t.min():g} s, measured over their drain "
                f"[{start:g}, {end:.1f}] s{skipped}")
    if end <= start:
        return (f"  no request measured: warmup_s = {wl.warmup_s:g} s ends after the last arrival ({t.max():.1f} s); "
                "lower it, e.g. --set workload.warmup_s=0")
    return None


def disagg_line(d: dict[str, Any]) -> str:
    """A disaggregated run's pools, transfers and TTFT parts, one line (docs/METRICS.md,
    'Disaggregated serving')."""
    return (f"  disaggregated: {d['prefill_replicas']} prefill x TP{d['prefill_tensor_parallel']} "
            f"({d['prefill_gpus']} {d['prefill_gpu']}, busy {d['prefill_busy_fraction']:.0%}) -> {d['decode_replicas']} "
            f"decode ({d['decode_gpus']} GPUs, busy {d['decode_busy_fraction']:.0%}) over {d['link']}; KV "
            f"{d['kv_transfer_bytes_mean'] / 1e6:,.0f} MB per request in {d['kv_transfer_s_mean'] * 1e3:.1f} ms "
            f"(p99 {d['kv_transfer_s_p99'] * 1e3:.1f}); mean TTFT = prefill {d['ttft_prefill_s_mean'] * 1e3:.0f} + "
            f"transfer {d['ttft_transfer_s_mean'] * 1e3:.0f} + decode {d['ttft_decode_s_mean'] * 1e3:.0f} ms")


def cache_line(s: dict[str, Any]) -> str:
    """The prefix-cache figures of a summary, one line (docs/METRICS.md, 'Prefix caching')."""
    again = ""
    if s["preempted_requests"]:  # prefill redone after preemptions, apart from the first admissions' savings
        again = (f"; {s['preemptions']:,} preemptions of {s['preempted_requests']:,} requests: "
                 f"{s['prefill_tokens_after_preemption']:,} tokens prefilled again, "
                 f"{s['prefill_tokens_cached_after_preemption']:,} of them from the cache")
    host = ""
    if "cache_host_hit_rate" in s:  # a host tier behind the cache: the hit by tier, and its TTFT
        evicted = s["host_evicted_blocks"]
        host = (f" (HBM {s['cache_hbm_hit_rate']:.1%}, host tier {s['cache_host_hit_rate']:.1%}"
                f"{'' if evicted is None else f', {evicted:,} blocks evicted from it'})")
        ttft = (f"{_ms(s['ttft_hbm_hit_s']['mean'])} on an HBM hit, {_ms(s['ttft_host_hit_s']['mean'])} on a "
                f"host-tier hit")
    else:
        ttft = f"{_ms(s['ttft_hit_s']['mean'])} on a hit"
    return (f"  prefix cache: {s['cache_hit_rate']:.1%} of prompt tokens cached at first admission{host} "
            f"({s['cache_request_hit_rate']:.0%} of requests hit), {s['prefill_tokens_saved']:,} prefill tokens saved "
            f"there, {s['prefill_tokens_computed']:,} computed in all{again}; TTFT mean "
            f"{ttft}, {_ms(s['ttft_miss_s']['mean'])} on a miss")


def _ms(x: float) -> str:
    """Seconds as '123 ms', or 'none' when no request had that (NaN)."""
    return f"{x * 1e3:.0f} ms" if x == x else "none"


def _print_benchmark(s: dict[str, Any]) -> None:
    """The headline figures of the summary's `benchmark` block, named and laid out as
    `vllm bench serve` prints them (whole run, no warm-up; docs/METRICS.md)."""
    b = s["benchmark"]
    if not b.get("completed"):
        print("  benchmark: no request completed")
        return
    clients = (f"{s['concurrency']} clients" if s["loop"] == "closed"
               else f"request rate {b['request_rate']:.2f}/s, max concurrency {s['concurrency']}")
    print(f"  as vllm bench serve reports it ({clients}; whole run, {b['completed']:.0f} requests, "
          f"{b['duration']:.1f} s):")
    print(f"    Request throughput (req/s):        {b['request_throughput']:10.2f}")
    print(f"    Output token throughput (tok/s):   {b['output_throughput']:10.2f}")
    print(f"    Total token throughput (tok/s):    {b['total_token_throughput']:10.2f}")
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL")):
        print(f"    {label:<4} mean / median / p99 (ms): {b[f'mean_{name}_ms']:10.2f} {b[f'median_{name}_ms']:10.2f} "
              f"{b[f'p99_{name}_ms']:10.2f}")
