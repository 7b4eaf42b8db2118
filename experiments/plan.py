"""Capacity planning: for a traffic, an SLO and candidate strategies, the smallest rack that
meets the SLO, found by search with the simulator (never by extrapolation), its monthly cost
(serving plus amortised retraining) and its quality, plus capacity curves, a decision map over
utilisation x acceptance, the acceptance shift from benchmark to production traffic, and the
retraining obligation vs teacher update cadence.

The search: for each strategy and GPU type, double the number of replicas until the simulated
run meets the SLO (stable, p99 TTFT and p99 TPOT within bounds), then bisect between the last
failing and the first passing count. Meeting the SLO is assumed monotone in replicas (tested).

The configuration search (on by default, `[search] configurations = false` turns it off) repeats
that over a small grid per strategy and GPU type: tensor-parallel degree (every degree that fits
the model), max_num_batched_tokens, max_num_seqs and, where the strategy speculates, k. Before any
rack is simulated each configuration is pruned analytically with its measured capacity C per
replica (sim.capacity, peak sustainable req/s): it needs more than rate / C replicas (no rack
carries more than its capacity: `evaluate` fails one offered its capacity or more without
simulating it), more if min_replicas, max_utilisation or n+1 ask for them. A configuration whose lower
bound exceeds max_gpus is skipped, and configurations are simulated in order of the cost of that
cheapest possible rack; one whose cheapest possible rack already costs more than the best passing
rack found so far is skipped without simulation. The answer per strategy is the cheapest passing
configuration; `configs.csv` keeps every configuration (simulated, pruned, not applicable).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import difflib
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from experiments.plan_cost import COST_KEYS, CostSpec, monthly_cost, parse_cost
from experiments.plan_day import DAY_KEYS, DaySpec, day_traffic, parse_day
from experiments.plan_store import capacity_of, ladder_of, summary
from experiments.sweep import Variant, check_distinct, default_sweep_path, parse_variant
from models import _native
from models.catalog import GPUS, get_gpu
from models.engines import get_profile, resolve
from models.errors import ConfigError, unknown
from sim.capacity import Capacity, capacity_key, remember
from sim.deployment import build_runtime, gpus_per_replica
from sim.metrics import relaxation_s
from sim.scenario import MAX_REQUESTS, SLO_KEYS, Scenario, gpu_name, load_scenario, read_toml, slo_key_hint
from sim.traces import load_trace, trace_rate_rps

TP_DEGREES = (1, 2, 4, 8)  # the tensor-parallel degrees searched by default (those that fit)
DEFAULT_MBT = (2048, 8192)  # max_num_batched_tokens searched by default, with the base's own
DEFAULT_K = (2, 4)  # speculative k searched by default (speculating strategies), with the strategy's own
CADENCES = {"never": 0.0, "quarterly": 1.0 / 3.0, "monthly": 1.0, "weekly": 52.0 / 12.0}
HOURS_PER_MONTH = 720.0


# a plan's strategy is a sweep's variant: a name and overrides of the base scenario
Strategy = Variant


@dataclass(frozen=True)
class SearchSpec:
    """The configuration grid (None: the default grid) and the rules every rack must keep."""

    configurations: bool = True
    tp: tuple[int, ...] | None = None
    max_num_batched_tokens: tuple[int, ...] | None = None
    max_num_seqs: tuple[int, ...] | None = None
    k: tuple[int, ...] | None = None
    min_replicas: int = 1
    redundancy: str = "none"  # "none" | "n+1"
    max_utilisation: float | None = None  # offered rate <= this fraction of the rack's capacity
    gpus_per_node: int | None = None

    def describe(self) -> str:
        if not self.configurations:
            return "off (each strategy as configured)"
        def g(v: tuple[int, ...] | None, default: str) -> str:
            return default if v is None else str(list(v))
        return (f"TP {g(self.tp, 'every degree of ' + str(list(TP_DEGREES)) + ' that fits')}, max_num_batched_tokens "
                f"{g(self.max_num_batched_tokens, str(list(DEFAULT_MBT)) + ' + the base')}, max_num_seqs "
                f"{g(self.max_num_seqs, 'the base')}, k (speculating strategies) {g(self.k, str(list(DEFAULT_K)) + ' + the strategy' + chr(39) + 's')}; "
                "pruned by capacity (more than rate / capacity per replica replicas) "
                "and by the best passing cost so far")

    def rules(self) -> str:
        u = "none" if self.max_utilisation is None else f"offered <= {self.max_utilisation:g} x capacity"
        node = "GPUs one at a time" if self.gpus_per_node is None else (
            f"whole nodes of {self.gpus_per_node} GPUs (a replica never straddles nodes)")
        return f"min_replicas {self.min_replicas}, redundancy {self.redundancy}, max_utilisation {u}, {node}"


@dataclass(frozen=True)
class Traffic:
    """What a plan offers: a Poisson/gamma rate, or a window of a real trace at a growth factor.

    A trace window is chosen on the trace's own clock ([lo, hi) s from its first request) and
    replayed with its timing compressed by the growth factor g = rate / window_rate_rps, so the
    simulated offered rate is the window's own rate times the growth. Before the window, up to
    warmup_s x g of the trace's preceding requests are replayed as a lead-in (unmeasured), so the
    measured window is the chosen one whenever the trace has that much history before it."""

    kind: str  # "rate" | "trace"
    headline_rps: float  # the rate the plan is judged at (the window's rate x growth for traces)
    growth: float = 1.0
    trace: str | None = None
    trace_format: str = "auto"
    trace_rate_rps: float = float("nan")  # the whole trace's mean rate (its own clock)
    window: str = ""  # as written: "whole", "peak-1h", "12.0-600.0 s"
    lo_s: float = 0.0
    hi_s: float = float("inf")
    window_rate_rps: float = float("nan")  # requests/s inside the window, trace clock
    warmup_s: float = 0.0

    def overrides(self, rate: float) -> dict[str, Any]:
        """Workload overrides offering `rate` req/s (for a trace: the window, time-compressed)."""
        if self.kind == "rate":
            return {"workload.rate_rps": rate}
        g = rate / self.window_rate_rps
        lead = min(self.warmup_s * g, self.lo_s)
        start = self.lo_s - lead
        return {"workload.arrival": "trace", "workload.trace": self.trace, "workload.trace_format": self.trace_format,
                "workload.rate_rps": self.trace_rate_rps * g, "workload.num_requests": None,
                "workload.trace_start_s": start if start > 0 else None, "workload.trace_end_s": self.hi_s,
                "workload.duration_s": (self.hi_s - start) / g, "workload.warmup_s": self.warmup_s}

    def describe(self) -> str:
        if self.kind == "rate":
            return f"{self.headline_rps:.2f} req/s (Poisson/gamma as the base scenario says)"
        return (f"trace {Path(self.trace or '').name}, window {self.window} ({self.hi_s - self.lo_s:.0f} s of its clock, "
                f"{self.window_rate_rps:.2f} req/s) x growth {self.growth:g} = {self.headline_rps:.2f} req/s")


@dataclass(frozen=True)
class PlanSpec:
    name: str
    base: Scenario
    rate_rps: float
    strategies: tuple[Strategy, ...]
    gpus: tuple[str, ...]
    prices: dict[str, float]
    max_gpus: int
    seeds: tuple[int, ...]
    quality_floor_tail: float
    teacher_updates_per_month: float
    curve_multipliers: tuple[float, ...]
    map_utilisation: tuple[float, ...]
    map_acceptance: tuple[float, ...]
    shift_tail_shares: tuple[float, ...]
    shift_utilisation: float
    traffic: Traffic | None = None
    not_applicable: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)  # (strategy, gpu) -> why
    expected_requests: int = 0  # requests arriving in the measured window of one run at the plan's rate
    day: DaySpec | None = None  # [day]: the day replayed on an autoscaled fleet (experiments/plan_day.py)
    warnings: tuple[str, ...] = ()
    search: SearchSpec = dataclasses.field(default_factory=lambda: SearchSpec(configurations=False))
    cost: CostSpec = dataclasses.field(default_factory=CostSpec)
    points: str | None = None  # OUT/points: finished simulations kept for a resumed run (experiments.plan_store)
    progress: bool = False  # progress bars with an ETA on stderr (`specrack plan`; off in the API and notebooks)

    def inputs(self) -> dict[str, str]:
        """The effective inputs, for the terminal header and the report."""
        b = self.base
        dep, dist, wl = b.deployment, b.deployment.distillation, b.workload
        sched = dep.scheduling()
        prices = ", ".join(f"{g} ${self.prices[g]:g}/h" if g in self.prices else f"{g} (catalogue ${get_gpu(g).usd_per_gpu_hour:g}/h)"
                           for g in self.gpus)
        train_price = dist.training_usd_per_gpu_hour
        train_price = get_gpu(dist.training_gpu).usd_per_gpu_hour if train_price is None else train_price
        traffic = self.traffic.describe() if self.traffic else f"{self.rate_rps:.2f} req/s"
        return {
            "model": f"{dep.model}, TP{dep.tensor_parallel}, weights {dep.weights}, KV cache {dep.kv_cache} (precision)",
            "engine": f"{dep.engine} ({get_profile(dep.engine).engine}): {sched.prefill} prefill"
                      f"{', chunked' if sched.chunked_prefill else ', whole prompts'}, max_num_batched_tokens "
                      f"{sched.max_num_batched_tokens}, max_num_seqs {sched.max_num_seqs}",
            "base rack": f"{b.rack.num_gpus}x {b.rack.gpu} (the search sizes racks of {', '.join(self.gpus)} up to {self.max_gpus} GPUs)",
            "routing and prefix caching": f"router {dep.router}, prefix caching {'on' if dep.prefix_caching else 'off'}"
                                          + (f"; conversations of {wl.conversations.turns} turns" if wl.conversations
                                             else ""),
            "strategies": ", ".join(s.name for s in self.strategies),
            "SLO": f"{b.slo.describe()}, judged on a stable run (every seed)",
            "tail-quality floor": f"{self.quality_floor_tail:g}",
            "configuration search": self.search.describe(),
            "rack rules": self.search.rules(),
            "cost": self.cost.describe(self.gpus),
            "prices": prices if self.cost.mode == "rent" else f"{prices} (rent prices; unused in buy mode)",
            "retraining": f"{self.teacher_updates_per_month:g} teacher updates/month, trained on {dist.training_gpu} at ${train_price:g}/h",
            "traffic": traffic + (" (the peak of [day])" if self.day else ""),
            **({"day": self.day.describe()} if self.day else {}),
            "simulated": f"{wl.duration_s:.0f} s per run after {wl.warmup_s:.0f} s warm-up included; "
                         f"~{self.expected_requests} measured requests per run; seeds {list(self.seeds)}",
        }


# the keys each plan table takes; anything else is a typo (did-you-mean) or a key in the wrong table
TOP_KEYS = ("name", "base", "base_set", "strategies", "traffic", "slo", "search", "cost", "quality", "analyses", "quick",
            "day")
TABLE_KEYS: dict[str, tuple[str, ...]] = {
    "traffic": ("rate_rps", "trace", "trace_format", "growth", "window", "start_s", "end_s"),
    "search": ("gpus", "usd_per_gpu_hour", "max_gpus", "duration_s", "warmup_s", "seeds", "configurations", "tp",
               "max_num_batched_tokens", "max_num_seqs", "k", "min_replicas", "redundancy", "max_utilisation",
               "gpus_per_node"),
    "cost": COST_KEYS,
    "quality": ("floor_tail", "teacher_updates_per_month", "training_gpu", "training_usd_per_gpu_hour"),
    "analyses": ("curve_multipliers", "map_utilisation", "map_acceptance", "shift_tail_shares", "shift_utilisation"),
    "slo": SLO_KEYS,
    "day": DAY_KEYS,
}
QUICK_SECTIONS = ("traffic", "search", "cost", "quality", "analyses", "slo", "day")
MIN_JUDGED = 500  # fewer measured requests than this make a p99 too noisy to buy hardware on
MAX_RATE_SHIFT = 0.10  # --quick may not move the simulated rate further than this from the plan's


def _near(key: str, known: tuple[str, ...] | list[str]) -> str:
    """'; did you mean 'x'?' for a misspelt or reordered key (tail_floor -> floor_tail), else ''."""
    parts = sorted(key.lower().split("_"))
    same = [k for k in known if sorted(k.split("_")) == parts]
    near = same or difflib.get_close_matches(key.lower(), list(known), n=1, cutoff=0.6)
    return f"; did you mean '{near[0]}'?" if near else ""


def _home(key: str) -> str | None:
    """The table a known key belongs to, for a key written in the wrong one."""
    if key in TOP_KEYS:
        return "the top level (before the first [table]: TOML puts a key written after [x] into table x)"
    for t, keys in TABLE_KEYS.items():
        if key in keys:
            return f"[{t}]"
    return None


def _check_keys(d: dict[str, Any], where: str, known: tuple[str, ...]) -> None:
    for key in d:
        if key in known:
            continue
        if where.endswith("slo"):
            raise ConfigError(f"{where}.{key}: {slo_key_hint(str(key))}")
        home = _home(str(key))
        if home:
            raise ConfigError(f"{where}.{key}: belongs in {home}, not in [{where}]")
        raise ConfigError(f"{where}: unknown key '{key}'{_near(str(key), known)} (known: {', '.join(known)})")


def _table(d: dict[str, Any], key: str, where: str = "") -> dict[str, Any]:
    v = d.get(key, {})
    if not isinstance(v, dict):
        raise ConfigError(f"{where}{key}: must be a table ([{key}] with keys such as "
                          f"{', '.join(TABLE_KEYS.get(key, QUICK_SECTIONS)[:3])}), got {v!r}")
    return v


def _positive(d: dict[str, Any], key: str, where: str, default: float | None = None) -> float:
    v = d.get(key, default)
    if v is None:
        raise ConfigError(f"{where}.{key}: missing (a positive number)")
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not (v > 0 and math.isfinite(v)):
        raise ConfigError(f"{where}.{key}: must be a positive finite number, got {v!r}")
    return float(v)


def _str(d: dict[str, Any], key: str, where: str, default: str | None = None) -> str:
    v = d.get(key, default)
    if not isinstance(v, str) or not v:
        raise ConfigError(f"{where}{key}: must be a non-empty string, got {v!r}")
    return v


def _strings(d: dict[str, Any], key: str, where: str, default: list[str]) -> list[str]:
    v = d.get(key, default)
    if isinstance(v, str):
        raise ConfigError(f"{where}.{key}: must be a list, e.g. {key} = [\"{v}\"], got the string {v!r}")
    if not isinstance(v, list) or not v or not all(isinstance(x, str) for x in v):
        raise ConfigError(f"{where}.{key}: must be a non-empty list of names, got {v!r}")
    if len(set(v)) != len(v):
        raise ConfigError(f"{where}.{key}: lists a name twice: {v!r}")
    return v


_WINDOW = re.compile(r"^peak-(\d+(?:\.\d+)?)(s|m|h)$")


def _traffic(t: dict[str, Any], plan_dir: Path, warmup_s: float) -> Traffic:
    """Validate [traffic] and resolve a trace window (see Traffic)."""
    growth = _positive(t, "growth", "traffic", 1.0)
    if "trace" not in t:
        for k in ("window", "start_s", "end_s", "trace_format"):
            if k in t:
                raise ConfigError(f"traffic.{k}: only meaningful with traffic.trace = '<path>'")
        if "rate_rps" not in t:
            raise ConfigError("traffic: set rate_rps = <requests/s> or trace = '<path to a trace file>'")
        return Traffic("rate", _positive(t, "rate_rps", "traffic") * growth, growth)
    if "rate_rps" in t:
        raise ConfigError("traffic: set rate_rps or trace, not both (a trace replays its own timing; scale it with growth)")
    trace = str((plan_dir / _str(t, "trace", "traffic.")).resolve())
    fmt = _str(t, "trace_format", "traffic.", "auto")
    if fmt not in ("auto", "azure", "mooncake", "csv"):
        raise unknown("trace format", fmt, ("auto", "azure", "mooncake", "csv"))
    df = load_trace(trace, fmt)
    mean = trace_rate_rps(df)
    a = df.arrival_s.to_numpy(np.float64)
    span = float(a[-1])
    if "window" in t and ("start_s" in t or "end_s" in t):
        raise ConfigError("traffic: set window or start_s/end_s, not both")
    if "start_s" in t or "end_s" in t:
        lo = _num(t, "start_s", "traffic", 0.0, lo=0)
        hi = _num(t, "end_s", "traffic", span, lo=0, lo_open=True)
        if lo >= span:
            raise ConfigError(f"traffic.start_s ({lo:g}) is past the trace's last request ({span:.0f} s after its first)")
        if hi <= lo:
            raise ConfigError(f"traffic.end_s ({hi:g}) must be after traffic.start_s ({lo:g})")
        n = int(np.searchsorted(a, hi, "left") - np.searchsorted(a, lo, "left"))
        label = f"{lo:g}-{hi:g} s"
    else:
        w = _str(t, "window", "traffic.", "whole")
        m = _WINDOW.match(w)
        if w == "whole":
            lo, hi, n, label = 0.0, span, len(a) - 1, "whole"  # (n - 1) / span: the trace's own mean rate
        elif m:
            length = float(m.group(1)) * {"s": 1.0, "m": 60.0, "h": 3600.0}[m.group(2)]
            if not length > 0:
                raise ConfigError(f"traffic.window '{w}': the length must be positive")
            if length > span:
                raise ConfigError(f"traffic.window '{w}' is longer than the trace ({span / 60:.1f} min of arrivals); "
                                  "use window = 'whole' or a shorter peak")
            counts = np.searchsorted(a, a + length, "left") - np.arange(a.size)
            i = int(np.argmax(counts))
            lo, hi, n, label = float(a[i]), float(a[i]) + length, int(counts[i]), w
        else:
            raise ConfigError(f"traffic.window: '{w}' is not a window; use 'whole', 'peak-1h', 'peak-<N>m' or "
                              "'peak-<N>s', or start_s/end_s")
    if n < 2:
        raise ConfigError(f"traffic: the window {label} holds {n} request(s) of the trace; choose a wider window")
    rate = n / (hi - lo) if label != "whole" else mean
    return Traffic("trace", rate * growth, growth, trace, fmt, mean, label, lo, hi, rate, warmup_s)


def _measured_requests(tr: Traffic, duration_s: float, warmup_s: float) -> int:
    """Requests arriving in one run's measured window at the plan's rate (expected for a rate)."""
    if tr.kind == "rate":
        return int(tr.headline_rps * (duration_s - warmup_s))
    a = load_trace(tr.trace or "", tr.trace_format).arrival_s.to_numpy()
    g = tr.headline_rps / tr.window_rate_rps
    o = tr.overrides(tr.headline_rps)
    start = o["workload.trace_start_s"] or 0.0
    return int(((a >= start + warmup_s * g) & (a < tr.hi_s)).sum())


def _resolve_traffic(d: dict[str, Any], p: Path) -> tuple[Traffic, float, float]:
    search, traffic = d["search"], d["traffic"]
    warm = _num(search, "warmup_s", "search", 20, lo=0)
    if "trace" in traffic and "duration_s" in search:
        raise ConfigError("search.duration_s: a trace plan simulates its traffic window (traffic.window or "
                          "start_s/end_s), not a duration; remove search.duration_s")
    tr = _traffic(traffic, p.parent, warm)
    dur = _num(search, "duration_s", "search", 180, lo=0, lo_open=True) if tr.kind == "rate" else float("nan")
    if tr.kind == "rate" and warm >= dur:
        raise ConfigError(f"search.warmup_s ({warm:g}) must be shorter than search.duration_s ({dur:g})")
    return tr, dur, warm


def load_plan(path: str | Path, quick: bool = False, points: str | Path | None = None,
              jobs: int | None = 1) -> PlanSpec:
    """Read and validate a plan file; one-line ConfigErrors name the field and the fix. `points`:
    a folder keeping every finished simulation, so that a rerun resumes (see plan_store). `jobs`:
    processes for the capacity ladders the reachability check measures (None: one per CPU)."""
    pts = None if points is None else str(points)
    p = Path(path)
    d = read_toml(p, "plan")
    _check_keys(d, p.name, TOP_KEYS)
    if "base" not in d:
        raise ConfigError(f"{p.name}: missing 'base' (a scenario file giving the traffic mix and deployment defaults)")
    base_path = _str(d, "base", "")
    if "name" in d:
        _str(d, "name", "")
    for section in (*TABLE_KEYS, "base_set"):
        d[section] = dict(_table(d, section))
        if section in TABLE_KEYS:
            _check_keys(d[section], section, TABLE_KEYS[section])
    q_tab = _table(d, "quick")
    _check_keys(q_tab, "quick", QUICK_SECTIONS)
    full = {k: dict(v) if isinstance(v, dict) else v for k, v in d.items()}
    for section in q_tab:
        values = _table(q_tab, section, "quick.")
        _check_keys(values, f"quick.{section}", TABLE_KEYS[section])
        if quick:
            if section == "traffic" and ("window" in values or "start_s" in values or "end_s" in values):
                for k in ("window", "start_s", "end_s"):
                    d["traffic"].pop(k, None)
            if section == "search" and values.get("configurations") is False:  # a quick plan may skip the grid
                for k in ("tp", "max_num_batched_tokens", "max_num_seqs", "k"):
                    d["search"].pop(k, None)
            d[section].update(values)
    search, q, a = d["search"], d["quality"], d["analyses"]
    day = parse_day(d, p.parent)  # [day]: the fixed rack is sized for the day's peak (experiments/plan_day.py)
    if day is not None:
        d["traffic"] = day_traffic(d["traffic"], day)
        full_day = parse_day(full, p.parent)
        assert full_day is not None
        full["traffic"] = day_traffic(full["traffic"], full_day)
    tr, dur, warm = _resolve_traffic(d, p)
    warnings: list[str] = []
    if quick and q_tab:  # the quick plan must still judge the plan's traffic
        full_tr, _, _ = _resolve_traffic(full, p)
        shift = tr.headline_rps / full_tr.headline_rps - 1.0
        if abs(shift) > MAX_RATE_SHIFT:
            raise ConfigError(f"--quick would simulate {tr.headline_rps:.2f} req/s ({tr.window or 'rate'}) against the plan's "
                              f"{full_tr.headline_rps:.2f} req/s ({full_tr.window or 'rate'}), {100 * shift:+.0f}% "
                              f"(more than {100 * MAX_RATE_SHIFT:.0f}%); fix [quick] traffic or run without --quick")
    base_set: dict[str, Any] = {"workload.warmup_s": warm}
    if tr.kind == "rate":
        base_set["workload.duration_s"] = dur
    try:
        base = load_scenario((p.parent / base_path).resolve(), {**base_set, **d["base_set"]})
    except ConfigError as err:
        raise ConfigError(f"{p.name}: base (with base_set): {err}") from None
    slo = d["slo"]
    if slo:  # the plan's [slo] replaces the base scenario's targets
        for key in slo:
            _positive(slo, key, "slo")
        base = base.with_overrides({"slo": dict(slo)})
    # retraining runs on its own training GPU, priced apart from the serving rack
    train: dict[str, Any] = {}
    if "training_gpu" in q:
        train["deployment.distillation.training_gpu"] = gpu_name(_str(q, "training_gpu", "quality."))
    if "training_usd_per_gpu_hour" in q:
        train["deployment.distillation.training_usd_per_gpu_hour"] = _positive(q, "training_usd_per_gpu_hour", "quality")
    base = base.with_overrides({**train, **tr.overrides(tr.headline_rps)})
    gpus = tuple(gpu_name(g) for g in _strings(search, "gpus", "search", [base.rack.gpu]))
    prices_in = search.get("usd_per_gpu_hour", {})
    if not isinstance(prices_in, dict):
        raise ConfigError(f"search.usd_per_gpu_hour: must be a table of prices by GPU, e.g. {{ {gpus[0]} = 2.5 }}, got {prices_in!r}")
    prices = {}
    for g in prices_in:
        if g.lower() not in gpus:
            raise ConfigError(f"search.usd_per_gpu_hour.{g}: prices a GPU not in search.gpus ({', '.join(gpus)})"
                              f"{_near(g, gpus)}; add it to search.gpus or remove the price")
        prices[g.lower()] = _positive(prices_in, g, "search.usd_per_gpu_hour")
    max_gpus = int(_num(search, "max_gpus", "search", 64, lo=1, integer=True))
    seeds = search.get("seeds", [1])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in seeds):
        raise ConfigError(f"search.seeds: must be a non-empty list of integers >= 0, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"search.seeds: lists a seed twice: {seeds!r}")
    strategies = _strategies(d)
    not_applicable = _applicability(p.name, base, strategies, gpus, prices, tr)
    _check_reachable(p.name, base, strategies, gpus, prices, tr.headline_rps, max_gpus, not_applicable, pts, jobs)
    floor = _num(q, "floor_tail", "quality", 0.0, lo=0, hi=1)
    search_spec = _search_spec(search)
    cost = parse_cost(d["cost"], gpus, search_spec.gpus_per_node)
    expected = _measured_requests(tr, base.workload.duration_s, warm)
    if expected < MIN_JUDGED:
        warnings.append(f"WARNING: each run measures only ~{expected} requests (< {MIN_JUDGED}): its p99 rests on "
                        f"~{max(expected // 100, 0)} requests{'; --quick shortened it' if quick else ''}; "
                        "lengthen the run (search.duration_s or traffic.window) before buying on it")
    return PlanSpec(
        name=_str(d, "name", "", p.stem), base=base, rate_rps=tr.headline_rps, strategies=tuple(strategies), gpus=gpus,
        prices=prices, max_gpus=max_gpus, seeds=tuple(seeds), quality_floor_tail=floor,
        teacher_updates_per_month=_num(q, "teacher_updates_per_month", "quality", 1.0, lo=0),
        curve_multipliers=_nums(a, "curve_multipliers", [0.25, 0.5, 1.0, 2.0, 4.0], lo=0, lo_open=True),
        map_utilisation=_nums(a, "map_utilisation", [0.3, 0.5, 0.7, 0.85], lo=0, lo_open=True, hi=5),
        map_acceptance=_nums(a, "map_acceptance", [0.4, 0.6, 0.8], lo=0, hi=0.999),
        shift_tail_shares=_nums(a, "shift_tail_shares", [0.0, 0.2, 0.4, 0.6], lo=0, hi=0.999),
        shift_utilisation=_num(a, "shift_utilisation", "analyses", 0.5, lo=0, lo_open=True, hi=5),
        traffic=tr, not_applicable=not_applicable, expected_requests=expected, warnings=tuple(warnings),
        search=search_spec, cost=cost, day=day, points=pts,
    )


def _ints(d: dict[str, Any], key: str, lo: int) -> tuple[int, ...] | None:
    """A grid of integers from [search] (None when absent: the default grid)."""
    if key not in d:
        return None
    v = d[key]
    if not isinstance(v, list) or not v:
        raise ConfigError(f"search.{key}: must be a non-empty list of integers, e.g. {key} = [{lo}], got {v!r}")
    out = tuple(int(_num({key: x}, key, "search", 0, lo=lo, integer=True)) for x in v)
    if len(set(out)) != len(out):
        raise ConfigError(f"search.{key}: lists a value twice: {v!r}")
    return out


def _search_spec(search: dict[str, Any]) -> SearchSpec:
    """Validate [search]'s grid and rack rules."""
    on = search.get("configurations", True)
    if not isinstance(on, bool):
        raise ConfigError(f"search.configurations: must be true or false, got {on!r}")
    red = search.get("redundancy", "none")
    if red not in ("none", "n+1"):
        raise ConfigError(f"search.redundancy: must be 'none' or 'n+1', got {red!r}")
    util = None
    if "max_utilisation" in search:
        util = _num(search, "max_utilisation", "search", 1.0, lo=0, lo_open=True, hi=1)
    gpn = None
    if "gpus_per_node" in search:
        gpn = int(_num(search, "gpus_per_node", "search", 8, lo=1, integer=True))
    grids = {k: _ints(search, k, lo) for k, lo in (("tp", 1), ("max_num_batched_tokens", 16), ("max_num_seqs", 1), ("k", 1))}
    if not on:
        given = [k for k, v in grids.items() if v is not None]
        if given:
            raise ConfigError(f"search.{given[0]}: a grid needs search.configurations = true (it is false)")
    return SearchSpec(configurations=on, tp=grids["tp"], max_num_batched_tokens=grids["max_num_batched_tokens"],
                      max_num_seqs=grids["max_num_seqs"], k=grids["k"],
                      min_replicas=int(_num(search, "min_replicas", "search", 1, lo=1, integer=True)),
                      redundancy=red, max_utilisation=util, gpus_per_node=gpn)


def _strategies(d: dict[str, Any]) -> list[Strategy]:
    """The plan's strategies: built-in names (variants of the default sweep) or name/set tables."""
    builtin = builtin_strategies()
    listed = d.get("strategies", ["baseline"])
    if not isinstance(listed, list) or not listed:
        raise ConfigError(f"strategies: must be a non-empty list of built-in names or tables, got {listed!r}")
    out: list[Strategy] = []
    for i, s in enumerate(listed):
        if isinstance(s, str):
            if s not in builtin:
                raise unknown("strategy", s, tuple(builtin))
            out.append(builtin[s])
        else:
            out.append(parse_variant(s, f"strategies[{i}]"))
    check_distinct(out, "strategies")
    return out


def _applicability(name: str, base: Scenario, strategies: list[Strategy], gpus: tuple[str, ...],
                   prices: dict[str, float], tr: Traffic) -> dict[tuple[str, str], str]:
    """(strategy, gpu) pairs that cannot run (fp8 weights without FP8 tensor cores, a model that
    does not fit), with the reason. A strategy that runs on no GPU of the catalogue (a typo in
    its overrides, an impossible combination) is an error of the plan file."""
    bad: dict[tuple[str, str], str] = {}
    for s in strategies:
        for g in gpus:
            try:
                _scenario(base, s, g, prices, 1, tr.headline_rps, traffic=tr)
            except ConfigError as err:
                bad[(s.name, g)] = str(err)
        if all((s.name, g) in bad for g in gpus) and not _runs_somewhere(base, s, tr):
            raise ConfigError(f"{name}: strategy '{s.name}': {bad[(s.name, gpus[0])]}")
    if len(bad) == len(strategies) * len(gpus):
        first = next(iter(bad.items()))
        raise ConfigError(f"{name}: no strategy can run on {', '.join(gpus)} (e.g. '{first[0][0]}' on {first[0][1]}: {first[1]})")
    return bad


def _runs_somewhere(base: Scenario, s: Strategy, tr: Traffic) -> bool:
    for g in sorted(GPUS, key=lambda x: -get_gpu(x).hbm_gib):
        try:
            _scenario(base, s, g, {}, 1, tr.headline_rps, traffic=tr)
            return True
        except ConfigError:
            continue
    return False


def _num(d: dict[str, Any], key: str, where: str, default: float, *, lo: float | None = None, hi: float | None = None,
         lo_open: bool = False, integer: bool = False) -> float:
    """A number from a plan table, checked; one-line ConfigError naming the field otherwise."""
    v = d.get(key, default)
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if ok and integer:
        ok = float(v).is_integer()
    if ok and lo is not None:
        ok = v > lo if lo_open else v >= lo
    if ok and hi is not None:
        ok = v <= hi
    if not ok:
        if lo is not None and hi is not None:
            rng = f"in {'(' if lo_open else '['}{lo:g}, {hi:g}]"
        elif lo is not None:
            rng = f"{'>' if lo_open else '>='} {lo:g}"
        else:
            rng = f"<= {hi:g}" if hi is not None else ""
        kind = "an integer" if integer else "a finite number"
        raise ConfigError(f"{where}.{key}: must be {kind}{' ' + rng if rng else ''}, got {v!r}")
    return float(v)


def _nums(d: dict[str, Any], key: str, default: list[float], **bounds: Any) -> tuple[float, ...]:
    v = d.get(key, default)
    if not isinstance(v, list) or not v:
        raise ConfigError(f"analyses.{key}: must be a non-empty list of numbers, got {v!r}")
    return tuple(_num({key: x}, key, "analyses", 0.0, **bounds) for x in v)


# built-in strategies beyond the default sweep's variants (not swept by `specrack sweep`):
# speculation that follows the load (speculative.policy "follow_load", docs/METRICS.md), its
# thresholds near where the 1B draft stops paying on the default mix
EXTRA_STRATEGIES: dict[str, dict[str, Any]] = {
    "draft-1b-follow-load": {"speculative": {"method": "draft_model", "draft_model": "llama-3.2-1b",
                                             "num_speculative_tokens": 4, "policy": "follow_load",
                                             "load_off_above": 0.7, "load_on_below": 0.6}},
}


def builtin_strategies() -> dict[str, Strategy]:
    """The default sweep's variants, the further built-in strategies of
    experiments/sweeps/strategies.toml (not swept by default) and EXTRA_STRATEGIES, usable by name
    in plan files."""
    out: dict[str, Strategy] = {}
    for path in (default_sweep_path(), default_sweep_path().with_name("strategies.toml")):
        for v in read_toml(path, "sweep")["variants"]:
            out.setdefault(v["name"], Strategy(v["name"], dict(v.get("set", {}))))
    out.update({k: Strategy(k, dict(v)) for k, v in EXTRA_STRATEGIES.items()})
    return out


def _check_reachable(name: str, base: Scenario, strategies: list[Strategy], gpus: tuple[str, ...],
                     prices: dict[str, float], rate: float, max_gpus: int,
                     not_applicable: dict[tuple[str, str], str] | None = None, points: str | None = None,
                     jobs: int | None = 1) -> None:
    """Refuse a traffic no allowed rack can carry for any strategy (by measured capacity, or the
    closed-loop peak where the throughput collapses: an upper bound). The ladders are measured
    in `jobs` processes and kept in this process's cache (the search's workers inherit them)."""
    ones: list[tuple[Scenario, int]] = []
    for g in gpus:
        for s in strategies:
            if (s.name, g) in (not_applicable or {}):
                continue
            one = _scenario(base, s, g, prices, 1, None)
            per = gpus_per_replica(one)
            if per <= max_gpus:
                ones.append((one, per))
    _measure_ladders([one for one, _ in ones], points, jobs)
    best = 0.0
    for one, per in ones:
        best = max(best, ladder_of(one, points, speculative=True).rps * (max_gpus // per))  # (an upper bound)
    if rate > best:
        raise ConfigError(f"{name}: traffic {rate:.1f} req/s exceeds what {max_gpus} GPUs can serve with any strategy "
                          f"(at most {best:.1f} req/s at saturation); raise search.max_gpus or lower traffic.rate_rps")


def at_rate(traffic: Traffic | None, rate: float) -> dict[str, Any]:
    """Workload overrides offering `rate` req/s: the plan's traffic (a trace window, time-scaled)
    or, without one, a plain rate."""
    return traffic.overrides(rate) if traffic is not None else {"workload.rate_rps": rate}


def _scenario(base: Scenario, s: Strategy, gpu: str, prices: dict[str, float], replicas: int, rate: float | None,
              teacher_updates: float | None = None, *, traffic: Traffic | None = None) -> Scenario:
    """The strategy on `replicas` replicas of this GPU type, offered `rate` requests/s (a trace
    plan's window replayed at that rate when `traffic` is a trace; None keeps the base's)."""
    # any rack large enough for one replica while the strategy is applied; sized below
    sc = base.with_overrides({**s.overrides, "rack.gpu": gpu, "rack.num_gpus": 4096, "rack.allow_idle_gpus": True})
    over: dict[str, Any] = {"rack.num_gpus": replicas * gpus_per_replica(sc), "rack.allow_idle_gpus": base.rack.allow_idle_gpus}
    if rate is not None:
        over.update(at_rate(traffic, rate))
    if gpu in prices:
        over["rack.usd_per_gpu_hour"] = prices[gpu]
    elif base.rack.usd_per_gpu_hour is not None and gpu == base.rack.gpu:
        over["rack.usd_per_gpu_hour"] = base.rack.usd_per_gpu_hour
    else:
        over["rack.usd_per_gpu_hour"] = None
    if teacher_updates is not None and sc.deployment.distilled_from:
        over["deployment.distillation.teacher_updates_per_month"] = teacher_updates
    return sc.with_overrides(over)


EXTEND = 3.0  # a run too short to judge is rerun once with a measured window this many times longer
# Run length by the load's relaxation time (docs/METRICS.md, 'Planner run length'). A rack near capacity
# settles slowly: with requests in system N, throughput X(N) and dN/dt = rate - X(N), a departure
# from the fixed point decays at X'(N*); for step times affine in the batch (X = C N / (N + K))
# 1 / X'(N*) = tau / (1 - rho), tau the mean time in system and rho = rate / capacity. A run
# starting empty is judged only after RELAX_WARMUP relaxation times (e^-3: 5% of the start-up
# deficit left) over at least RELAX_JUDGE of them (the slow swings of the batch average out);
# without this a 150 s run passed one replica at 1.01x its capacity that 3000 s runs fail at 0.96x.
RELAX_WARMUP = 3.0
RELAX_JUDGE = 10.0
MAX_RUN_S = 7200.0  # a rack that needs a longer run to judge (within a few % of capacity) fails unjudged
RELAX_ROUNDS = 2  # reruns at most (each at the length the previous run's lifetimes ask for, RELAX_PAD x)
# A rerun lasts RELAX_PAD x what its run asked for (within MAX_RUN_S and a run's request cap): a
# run near capacity measures its lifetimes short (its batch is still growing), so the rerun asks
# for more again (chat plan, unpadded: 96 of 169 reruns, 1.06-1.72x, median 1.17x), and those
# discarded second runs were a third of the CPU of the plan's runs; padded, most second runs are
# judged as they are (7 of 169 rerun again). The rule judged by is unchanged (a run is judged when
# its own lifetimes ask for at most 5% more than it lasts), so a judged run is never shorter.
RELAX_PAD = 1.35


def _longer(sc: Scenario) -> Scenario | None:
    """The run with its measured window EXTEND times longer (None for a trace window, a closed
    loop or a fixed request count, whose length is the input's own)."""
    wl = sc.workload
    if not _stationary(sc):
        return None
    return sc.with_overrides({"workload.duration_s": wl.warmup_s + EXTEND * (wl.duration_s - wl.warmup_s)})


def _stationary(sc: Scenario) -> bool:
    """An open-loop stream at a constant rate whose run length is ours to choose (not a trace
    window, a closed loop, a rate profile or a fixed request count)."""
    wl = sc.workload
    return not (wl.replays_trace or wl.closed or wl.num_requests is not None or wl.rate_profile is not None)


def offered_rps(sc: Scenario) -> float | None:
    """The constant rate a stationary run offers (None otherwise, or when given as a utilisation)."""
    return sc.workload.rate_rps if _stationary(sc) else None


def judged_length(sc: Scenario, sm: dict[str, Any], capacity_rps: float) -> tuple[float, float] | None:
    """(warm-up, measured window) in seconds a run of this rack needs at its offered rate, from
    the lifetimes of a run `sm` of it; None when that is longer than MAX_RUN_S."""
    rate = offered_rps(sc)
    assert rate is not None
    tau = float(sm["e2e_s"]["mean"])
    t = relaxation_s(tau if tau == tau else 0.0, rate / capacity_rps)
    warm, window = RELAX_WARMUP * t, RELAX_JUDGE * t
    if warm + window > MAX_RUN_S:
        return None
    wl = sc.workload
    warm, window = max(wl.warmup_s, warm), max(wl.duration_s - wl.warmup_s, window)
    most = 0.9 * MAX_REQUESTS / rate  # one run's request cap (at such rates relaxation is fast)
    return (warm, window) if warm + window <= most else (warm * most / (warm + window), window * most / (warm + window))


def unjudged(reason: str) -> dict[str, Any]:
    """`evaluate`'s answer for a rack failed without a (long enough) run."""
    return {"meets_slo": False, "summary": None, "reason": reason}


def judged_run(sc: Scenario, seed: int, points: str | None = None,
               capacity_rps: float | None = None, stop_on_fail: bool = True) -> tuple[Scenario, dict[str, Any]] | str:
    """The run a rack is judged on for one seed, and its summary (see `evaluate`), or why it
    fails unjudged. With `stop_on_fail`, a rerun ends once its SLO is certain to fail
    (`sim.stop_on_slo_fail`): it is judged as it is, failing, and not rerun again."""
    rate = offered_rps(sc)
    rho = rate / capacity_rps if rate is not None and capacity_rps else None
    if rho is not None and rho >= 1.0:
        return f"offered {rate:.3g} req/s >= the rack's measured capacity {capacity_rps:.3g} req/s"
    sm = summary(sc, seed, points)
    run = sc
    if rho is not None and capacity_rps is not None:
        for _ in range(RELAX_ROUNDS):
            if "stopped_early" in sm:
                break
            need = judged_length(run, sm, capacity_rps)
            if need is None:
                return (f"at {rho:.0%} of capacity a run must last over {MAX_RUN_S:.0f} s to settle "
                        f"(relaxation time {relaxation_s(float(sm['e2e_s']['mean']), rho):.0f} s)")
            warm, window = need
            wl = run.workload
            if warm <= wl.warmup_s * 1.05 and window <= (wl.duration_s - wl.warmup_s) * 1.05:
                break
            rate_most = min(MAX_RUN_S, 0.9 * MAX_REQUESTS / rate) if rate else MAX_RUN_S
            pad = max(1.0, min(RELAX_PAD, rate_most / (warm + window)))
            warm, window = warm * pad, window * pad
            run = run.with_overrides({"workload.warmup_s": warm, "workload.duration_s": warm + window,
                                      **({"sim.stop_on_slo_fail": True} if stop_on_fail else {})})
            sm = summary(run, seed, points)
    elif sm["verdict"] == "insufficient":
        longer = _longer(sc)
        if longer is not None:
            run, sm = longer, summary(longer, seed, points)
    return run, sm


def evaluate(sc: Scenario, seeds: tuple[int, ...], points: str | None = None,
             capacity_rps: float | None = None, stop_on_fail: bool = True) -> dict[str, Any]:
    """Simulate a rack over seeds; it meets the SLO only if every seed's run is stable and meets
    every target (`slo_met`). The summary kept is the worst seed's: failing first, then the one
    closest to (or furthest over) its binding target. `points`: see plan_store.

    With the rack's measured capacity (`capacity_rps`, req/s) and a constant offered rate, the
    verdict is the one a long run gives: an offered rate at or above the capacity fails without
    simulation (no rack carries more than its capacity); otherwise each run is rerun (up to
    RELAX_ROUNDS times) as long as the relaxation time its lifetimes give asks for (warm-up
    RELAX_WARMUP and window RELAX_JUDGE relaxation times) and judged on that; a rack that would
    need more than MAX_RUN_S fails unjudged (it is within a few percent of capacity). Without a
    capacity, a run whose verdict is 'insufficient' (too short to judge stability) is rerun once
    EXTEND times longer and judged on that; if it is still insufficient it fails. A rerun whose
    SLO is certain to fail ends there, failing as it would in full, and is not rerun again (the
    next rerun would start empty the same way, and near capacity a longer run queues more);
    `stop_on_fail` off runs every rerun in full (a rack whose summary is reported pass or fail).
    With it on, the seeds after the first that fails are not run either (the rack fails whatever
    they give; its summary is then that seed's)."""
    rows = []
    for seed in seeds:
        judged = judged_run(sc, seed, points, capacity_rps, stop_on_fail)
        if isinstance(judged, str):
            return unjudged(judged)
        run, sm = judged
        wl = run.workload
        rows.append({**sm, "run_warmup_s": wl.warmup_s, "run_window_s": wl.duration_s - wl.warmup_s})
        if stop_on_fail and not sm["slo_met"]:
            break
    worst = max(rows, key=lambda r: (not r["slo_met"], _binding(r)[1]))
    return {"meets_slo": all(r["slo_met"] for r in rows), "summary": worst}


def _binding(sm: dict[str, Any]) -> tuple[str, float]:
    """The SLO check closest to (or furthest over) its target: (name, value / target)."""
    ratios = {k: (c["value"] / c["target"] if c["value"] == c["value"] else math.inf) for k, c in sm["slo"].items()}
    if not ratios:
        return "", 0.0
    k = max(ratios, key=ratios.__getitem__)
    return k, ratios[k]


def min_rack(base: Scenario, s: Strategy, gpu: str, prices: dict[str, float], rate: float, max_gpus: int,
             seeds: tuple[int, ...], teacher_updates: float, start: int = 1, *,
             traffic: Traffic | None = None, floor: int = 1, points: str | None = None,
             cap_rps: float | None = None) -> dict[str, Any]:
    """Smallest replica count >= floor meeting the SLO at this rate: from `start` (a guess),
    doubling until a run passes, then down to the minimum (the count below it is simulated and
    fails, unless it is below `floor`). `cap_rps`: the measured capacity of one replica (r
    replicas carry at most r x cap_rps; `evaluate` judges with it)."""
    per = gpus_per_replica(_scenario(base, s, gpu, prices, 1, rate, traffic=traffic))
    max_rep = max_gpus // per
    if max_rep < 1:
        return {"feasible": False, "reason": f"one replica needs {per} GPUs > max_gpus {max_gpus}"}
    if floor > max_rep:
        return {"feasible": False, "reason": f"the rack rules need >= {floor} replicas = {floor * per} GPUs > max_gpus {max_gpus}"}
    cache: dict[int, dict[str, Any]] = {}

    def ok(r: int) -> bool:
        if r not in cache:
            cache[r] = evaluate(_scenario(base, s, gpu, prices, r, rate, teacher_updates, traffic=traffic), seeds, points,
                                None if cap_rps is None else r * cap_rps)
        return cache[r]["meets_slo"]

    lo, hi = floor - 1, max(floor, min(start, max_rep))  # lo fails (or is not allowed), hi to be tested
    while not ok(hi):
        lo = hi
        if hi == max_rep:
            return {"feasible": False, "reason": f"SLO not met even with {max_rep * per} GPUs (max_gpus)",
                    "evaluations": len(cache)}
        hi = min(max_rep, hi * 2)
    # hi passes; a good start is the minimum, so try one fewer before bisecting down
    if lo < hi - 1 and ok(hi - 1):
        hi -= 1
        while lo < hi - 1:
            mid = (lo + hi) // 2
            if ok(mid):
                hi = mid
            else:
                lo = mid
    res = cache[hi]["summary"]
    return {"feasible": True, "replicas": hi, "gpus": hi * per, "gpus_per_replica": per, "summary": res,
            "evaluations": len(cache), "one_fewer_meets_slo": cache[hi - 1]["meets_slo"] if hi - 1 in cache else False}


def configured(s: Strategy, base: Scenario, cfg: dict[str, int | None]) -> Strategy:
    """The strategy with a configuration applied: tp, max_num_batched_tokens, max_num_seqs, k
    (None keeps the strategy's own)."""
    over = dict(s.overrides)
    for key, field in (("tp", "deployment.tensor_parallel"), ("max_num_batched_tokens", "deployment.max_num_batched_tokens"),
                       ("max_num_seqs", "deployment.max_num_seqs")):
        if cfg.get(key) is not None:
            over[field] = cfg[key]
    k = cfg.get("k")
    if k is not None:
        spec = over.get("speculative")
        if isinstance(spec, dict):
            over["speculative"] = {**spec, "num_speculative_tokens": k}
        elif base.speculative is not None and "speculative" not in over:
            over["speculative"] = {**base.speculative.model_dump(mode="json"), "num_speculative_tokens": k}
    return Strategy(s.name, over)


def config_of(sc: Scenario) -> dict[str, int | None]:
    """The configuration a scenario resolves to (plan.csv's tp, max_num_batched_tokens, ... columns)."""
    sched = sc.deployment.scheduling()
    return {"tp": sc.deployment.tensor_parallel, "max_num_batched_tokens": sched.max_num_batched_tokens,
            "max_num_seqs": sched.max_num_seqs, "k": sc.speculative.num_speculative_tokens if sc.speculative else None}


def _one(spec: PlanSpec, s: Strategy, gpu: str, rate: float) -> Scenario:
    return _scenario(spec.base, s, gpu, spec.prices, 1, rate, traffic=spec.traffic)


def replica_bounds(spec: PlanSpec, cap_rps: float, rate: float) -> tuple[int, int]:
    """(floor, lower bound) on the minimal passing replica count before n+1: the floor is what the
    rules demand (min_replicas, max_utilisation), the bound adds the capacity's: no rack carries
    its capacity or more (r replicas need r x capacity > rate; `evaluate` fails the others unrun)."""
    floor = spec.search.min_replicas
    if spec.search.max_utilisation is not None:
        floor = max(floor, math.ceil(rate / (spec.search.max_utilisation * cap_rps) - 1e-9))
    return floor, max(floor, math.floor(rate / cap_rps + 1e-9) + 1)


def plan_row(spec: PlanSpec, s: Strategy, gpu: str, rate: float, start: int = 1,
             teacher_updates: float | None = None, *, cap_rps: float | None = None) -> dict[str, Any]:
    """The planning answer for one strategy (one configuration) on one GPU type at one traffic
    rate, keeping the plan's rack rules (min_replicas, max_utilisation, n+1, whole nodes)."""
    tu = spec.teacher_updates_per_month if teacher_updates is None else teacher_updates
    engine = resolve(str(s.overrides.get("deployment.engine", spec.base.deployment.engine)))
    row: dict[str, Any] = {"strategy": s.name, "gpu": gpu, "engine_profile": engine, "rate_rps": rate}
    why = spec.not_applicable.get((s.name, gpu)) if not spec.search.configurations else None
    if why is None:
        try:
            one = _one(spec, s, gpu, rate)
        except ConfigError as err:
            why = str(err)
    if why is not None:
        return {**row, "feasible": False, "reason": f"not applicable: {why}", "evaluations": 0}
    row.update(config_of(one))
    per = gpus_per_replica(one)
    rules = spec.search
    if rules.gpus_per_node is not None and per > rules.gpus_per_node:
        return {**row, "feasible": False, "evaluations": 0,
                "reason": f"not applicable: a replica of {per} GPUs straddles nodes of {rules.gpus_per_node}"}
    if cap_rps is None:
        cap_rps = capacity_of(one, spec.points, speculative=True).rps
    floor, bound = replica_bounds(spec, cap_rps, rate)
    start = max(start, bound)
    extra = 1 if rules.redundancy == "n+1" else 0
    r = min_rack(spec.base, s, gpu, spec.prices, rate, spec.max_gpus - extra * per, spec.seeds, tu, start,
                 traffic=spec.traffic, floor=floor, points=spec.points, cap_rps=cap_rps)
    row.update(feasible=r["feasible"], evaluations=r.get("evaluations", 0))
    if not r["feasible"]:
        row["reason"] = r["reason"] + (" (one replica kept for n+1)" if extra else "")
        return row
    sm, replicas = r["summary"], r["replicas"]
    row["minimal_replicas"] = replicas
    if extra:  # n+1: the rack that meets the SLO with one replica down; its own run is reported
        replicas += 1
        ev = evaluate(_scenario(spec.base, s, gpu, spec.prices, replicas, rate, tu, traffic=spec.traffic), spec.seeds,
                      spec.points, replicas * cap_rps, stop_on_fail=False)  # (its summary is reported, pass or fail)
        sm = ev["summary"]
        row["evaluations"] += 1
    price = sm["usd_per_gpu_hour"]
    row.update(
        replicas=replicas, gpus=replicas * per, gpus_per_replica=per, redundancy=rules.redundancy,
        one_fewer_meets_slo=True if extra else r["one_fewer_meets_slo"],
        simulated_rate_rps=sm["offered_rps"], judged_requests=sm["judged_requests"], itl_samples=sm["itl_samples"],
        run_warmup_s=sm.get("run_warmup_s"), run_window_s=sm.get("run_window_s"),
        verdict=sm["verdict"],
        ttft_p50_s=sm["ttft_s"]["p50"], tpot_p50_s=sm["tpot_s"]["p50"], itl_p50_s=sm["itl_s"]["p50"],
        ttft_p99_s=sm["ttft_s"]["p99"], tpot_p99_s=sm["tpot_s"]["p99"], itl_p99_s=sm["itl_s"]["p99"],
        tpot_mean_s=sm["tpot_s"]["mean"], e2e_p99_s=sm["e2e_s"]["p99"], mfu=sm["mfu"], mean_batch_size=sm["mean_batch_size"],
        gpu_busy_fraction=sm["gpu_busy_fraction"], throughput_tok_s=sm["throughput_tok_s"],
        quality_in_distribution=sm["quality_in_distribution"], quality_tail=sm["quality_tail"],
        usd_per_gpu_hour=price,
    )
    if "cache_hit_rate" in sm:  # prefix caching acted (requests carry block hashes): docs/METRICS.md
        row.update(cache_hit_rate=sm["cache_hit_rate"], prefill_tokens_saved=sm["prefill_tokens_saved"],
                   ttft_hit_p99_s=sm["ttft_hit_s"]["p99"], ttft_miss_p99_s=sm["ttft_miss_s"]["p99"])
    if cap_rps is not None:
        row.update(capacity_per_replica_rps=cap_rps, capacity_rps=cap_rps * replicas,
                   utilisation=rate / (cap_rps * replicas))
    row.update(monthly_cost(spec.cost, gpu, price, replicas, per, rules.gpus_per_node, sm["gpu_busy_fraction"]))
    row["retraining_usd_per_month"] = sm["retraining_usd_per_month"]
    for key, c in sm["slo"].items():  # every check by name: slo_ttft_p99_s_value, _target, _met
        row[f"slo_{key}_value"], row[f"slo_{key}_target"], row[f"slo_{key}_met"] = c["value"], c["target"], c["met"]
    row["binding_slo"] = _binding(sm)[0]
    row["total_usd_per_month"] = row["serving_usd_per_month"] + row["power_usd_per_month"] + row["retraining_usd_per_month"]
    mtok = sm["throughput_tok_s"] * HOURS_PER_MONTH * 3600.0 / 1e6  # output tokens served per month at this rate
    row["usd_per_mtok_at_slo"] = row["total_usd_per_month"] / mtok if mtok > 0 else float("nan")
    row["passes_quality_floor"] = bool(sm["quality_tail"] >= spec.quality_floor_tail)
    return row


def grid(spec: PlanSpec, s: Strategy, gpu: str, rate: float) -> list[dict[str, int | None]]:
    """The configurations searched for a strategy on a GPU type (the strategy as configured first)."""
    g = spec.search
    if not g.configurations:
        return [{}]
    try:
        own = config_of(_one(spec, s, gpu, rate))
    except ConfigError:  # not on this GPU as configured (too little memory at its TP, say): on the base's GPU
        try:
            own = config_of(_one(spec, s, spec.base.rack.gpu, rate))
        except ConfigError:
            return [{}]  # the strategy as given, reported not applicable
    tps = g.tp or TP_DEGREES
    mbts = g.max_num_batched_tokens or tuple(sorted({*DEFAULT_MBT, int(own["max_num_batched_tokens"] or 0)}))
    mnss: tuple[int | None, ...] = g.max_num_seqs or (None,)  # None: the strategy's own (as configured)
    ks: tuple[int | None, ...] = (None,)
    if own["k"] is not None:
        ks = g.k or tuple(sorted({*DEFAULT_K, int(own["k"])}))
    out = [{"tp": t, "max_num_batched_tokens": m, "max_num_seqs": n, "k": k} for t in tps for m in mbts for n in mnss for k in ks]
    out.sort(key=lambda c: {**c, "max_num_seqs": c["max_num_seqs"] or own["max_num_seqs"]} != own)
    return out


def _lower_bound(spec: PlanSpec, one: Scenario, gpu: str, per: int, cap: float, rate: float,
                 extra: int) -> tuple[int, float]:
    """(replicas, serving + power $/month) of the cheapest rack a configuration of capacity (or
    capacity bound) `cap` per replica could pass with."""
    _, bound = replica_bounds(spec, cap, rate)
    lb = bound + extra
    price = one.rack.usd_per_gpu_hour if one.rack.usd_per_gpu_hour is not None else get_gpu(gpu).usd_per_gpu_hour
    lb_cost = monthly_cost(spec.cost, gpu, price, lb, per, spec.search.gpus_per_node, 0.0)
    return lb, float(lb_cost["serving_usd_per_month"]) + float(lb_cost["power_usd_per_month"])


def _pruned(spec: PlanSpec, lb: int, per: int, cap: float, bound: bool, rate: float, lb_usd: float,
            best_usd: float) -> str:
    """Why a configuration of capacity `cap` per replica (`bound`: the closed-loop peak, an upper
    bound on it) is pruned before simulation: its lower bound of `lb` replicas exceeds max_gpus,
    or its cheapest possible rack costs more than the best passing one so far; "" when it is not."""
    peak = " (its closed-loop peak, an upper bound on its capacity)" if bound else ""
    if lb * per > spec.max_gpus:
        return (f"needs >= {lb} replicas x {cap:.2f} req/s{peak} = {lb * per} GPUs > max_gpus {spec.max_gpus} "
                f"to reach {rate:.2f} req/s")
    if lb_usd > best_usd:
        return f"its cheapest possible rack costs ${lb_usd:,.0f}/month > the best passing rack's ${best_usd:,.0f}{peak}"
    return ""


def search_row(spec: PlanSpec, s: Strategy, gpu: str, rate: float, prune: bool = True) -> dict[str, Any]:
    """The cheapest passing configuration of a strategy on a GPU type, and every configuration
    tried (see the module docstring): {"row": ..., "configs": [...]}."""
    rules = spec.search
    extra = 1 if rules.redundancy == "n+1" else 0
    configs: list[dict[str, Any]] = []
    cands: list[tuple[float, int, int, int, Strategy, Scenario, Capacity, dict[str, Any]]] = []
    # capacities are cached per process; the plan's own configurations were measured when it was
    # loaded (_check_reachable), and forked workers inherit them
    for cfg in grid(spec, s, gpu, rate):
        sc_s = configured(s, spec.base, cfg)
        base_row: dict[str, Any] = {"strategy": s.name, "gpu": gpu, **cfg}
        try:
            one = _one(spec, sc_s, gpu, rate)
        except ConfigError as err:
            configs.append({**base_row, "status": "not applicable", "reason": str(err)})
            continue
        base_row.update(config_of(one))
        per = gpus_per_replica(one)
        if rules.gpus_per_node is not None and per > rules.gpus_per_node:
            configs.append({**base_row, "status": "not applicable",
                            "reason": f"a replica of {per} GPUs straddles nodes of {rules.gpus_per_node}"})
            continue
        lad = ladder_of(one, spec.points, speculative=True)  # the capacity, or an upper bound on it (a collapse)
        lb, lb_usd = _lower_bound(spec, one, gpu, per, lad.rps, rate, extra)
        base_row.update(gpus_per_replica=per, lower_bound_replicas=lb, lower_bound_usd_per_month=lb_usd,
                        **({"capacity_bound_rps": lad.rps} if lad.upper_bound else {"capacity_per_replica_rps": lad.rps}))
        why = _pruned(spec, lb, per, lad.rps, lad.upper_bound, rate, lb_usd, math.inf)
        if why:
            configs.append({**base_row, "status": "pruned", "reason": why})
            continue
        cands.append((lb_usd, per, len(cands), lb, sc_s, one, lad, base_row))
    cands.sort(key=lambda c: c[:3])
    best: dict[str, Any] | None = None
    for lb_usd, per, _, lb, sc_s, one, lad, base_row in cands:  # (each with its own lower bound)
        best_usd = (best["serving_usd_per_month"] + best["power_usd_per_month"]) if best else math.inf
        cap = lad.rps
        why = _pruned(spec, lb, per, cap, lad.upper_bound, rate, lb_usd, best_usd if prune else math.inf)
        if not why and lad.upper_bound:  # the capacity itself (the full-load throughput): the bounds tighten
            cap = capacity_of(one, spec.points, speculative=True).rps
            lb, lb_usd = _lower_bound(spec, one, gpu, per, cap, rate, extra)
            base_row.update(capacity_per_replica_rps=cap, lower_bound_replicas=lb, lower_bound_usd_per_month=lb_usd)
            why = _pruned(spec, lb, per, cap, False, rate, lb_usd, best_usd if prune else math.inf)
        if why:
            configs.append({**base_row, "status": "pruned", "reason": why})
            continue
        row = plan_row(spec, sc_s, gpu, rate, cap_rps=cap)
        ok = bool(row["feasible"])
        configs.append({**base_row, **row, "status": "passes" if ok else "fails"})
        if ok and (best is None or _cost_key(row) < _cost_key(best)):
            best = row
    if best is None:
        sim = [c for c in configs if c["status"] == "fails"]
        first = (sim or configs)[0] if (sim or configs) else {"reason": "no configuration"}
        best = {"strategy": s.name, "gpu": gpu, "rate_rps": rate, "feasible": False,
                "engine_profile": resolve(str(s.overrides.get("deployment.engine", spec.base.deployment.engine))),
                "reason": ("" if sim else "not applicable: " if all(c["status"] == "not applicable" for c in configs)
                           else "") + str(first.get("reason", "")) + (f" (best of {len(configs)} configurations)"
                                                                       if len(configs) > 1 else ""),
                "evaluations": sum(int(c.get("evaluations", 0) or 0) for c in configs)}
    else:
        best = {**best, "configurations_searched": len(configs),
                "configurations_simulated": sum(c["status"] in ("passes", "fails") for c in configs),
                "evaluations": sum(int(c.get("evaluations", 0) or 0) for c in configs)}
    return {"row": best, "configs": configs}


def _cost_key(row: dict[str, Any]) -> tuple[float, int, int, int, int, int]:
    """Cheapest first; ties to fewer GPUs, then the smaller configuration (deterministic)."""
    return (round(row["serving_usd_per_month"] + row["power_usd_per_month"], 6), int(row["gpus"]), int(row["tp"]),
            int(row["max_num_batched_tokens"]), int(row["max_num_seqs"]), int(row.get("k") or 0))


def pareto(configs: pd.DataFrame) -> pd.Series:
    """Whether a passing configuration is on the cost-vs-capacity frontier: no other passing one
    costs no more and carries at least as much, one of them strictly."""
    ok = configs.get("status", pd.Series(dtype=str)) == "passes"
    out = pd.Series(False, index=configs.index)
    if not ok.any() or "capacity_rps" not in configs:
        return out
    c = configs[ok]
    cost, cap = c.total_usd_per_month.to_numpy(float), c.capacity_rps.to_numpy(float)
    for i, idx in enumerate(c.index):
        dominated = ((cost <= cost[i]) & (cap >= cap[i]) & ((cost < cost[i]) | (cap > cap[i]))).any()
        out[idx] = not dominated
    return out


def _map(fn: Any, tasks: list[tuple[Any, ...]], jobs: int | None, label: str = "") -> list[Any]:
    """fn over the tasks (in processes when jobs allow), in order; with a label, a progress bar
    with elapsed time and ETA on stderr. Workers end with the plan's process (killed or not)."""
    from experiments.sweep import Progress, _die_with_parent

    bar = Progress(len(tasks) if label else 0, label)
    if (jobs or os.cpu_count() or 1) <= 1 or len(tasks) <= 1:
        out = []
        for t in tasks:
            out.append(fn(*t))
            bar.step()
        return out
    results: dict[int, Any] = {}
    with cf.ProcessPoolExecutor(max_workers=jobs or os.cpu_count(), initializer=_die_with_parent,
                                initargs=(os.getpid(),)) as ex:
        futs = {ex.submit(fn, *t): i for i, t in enumerate(tasks)}
        try:
            for fut in cf.as_completed(futs):
                results[futs[fut]] = fut.result()
                bar.step()
        except KeyboardInterrupt:
            for f in futs:
                f.cancel()
            raise
    return [results[i] for i in range(len(tasks))]


HEADROOM_TOL = 0.03  # the headroom bisection stops when the passing and failing rates are within 3%
HEADROOM_TOP = 3  # headroom is measured for the best ranked options (each costs ~5 simulations above the plan's rate)


def headroom(spec: PlanSpec, s: Strategy, gpu: str, row: dict[str, Any]) -> dict[str, Any]:
    """The headroom of a chosen rack: the highest offered rate (req/s) at which that very rack
    (same replicas and configuration) still meets the SLO, found by simulation: from the plan's
    rate (which it passes) double until a run fails (never beyond 4x), then bisect until the
    passing and failing rates are within HEADROOM_TOL. `headroom_rps` passed, `headroom_fail_rps`
    failed (inf: it passed even at 4x). Meeting the SLO is taken as monotone in the rate."""
    replicas, rate = int(row["replicas"]), float(row["rate_rps"])
    tu = spec.teacher_updates_per_month

    def ok(r: float) -> bool:
        sc = _scenario(spec.base, s, gpu, spec.prices, replicas, r, tu, traffic=spec.traffic)
        return bool(evaluate(sc, spec.seeds, spec.points, cap)["meets_slo"])

    lo, hi, runs = rate, math.inf, 0
    cap = row.get("capacity_rps")
    cap = float(cap) if cap is not None and cap == cap else None
    # no rack carries more than its capacity (evaluate fails it unrun): start just below it
    guess = 0.97 * cap if cap is not None and 0.97 * cap > rate else 2.0 * rate
    while hi == math.inf and lo < 4.0 * rate:
        trial = min(max(guess, lo * 1.1), 4.0 * rate)
        runs += 1
        if ok(trial):
            lo, guess = trial, 2.0 * trial
        else:
            hi = trial
    while hi < math.inf and hi / lo - 1.0 > HEADROOM_TOL:
        mid = 0.5 * (lo + hi)
        runs += 1
        if ok(mid):
            lo = mid
        else:
            hi = mid
    return {"headroom_rps": lo, "headroom_fail_rps": hi, "headroom_share": lo / rate - 1.0, "headroom_evaluations": runs}


def _ladder_task(one: Scenario, points: str | None) -> tuple[str, Capacity]:
    return capacity_key(one, speculative=True), ladder_of(one, points, speculative=True)


def _measure_ladders(ones: list[Scenario], points: str | None, jobs: int | None, label: str = "") -> None:
    """These one-replica deployments' capacity ladders (each deployment once, in the order
    given), measured in `jobs` processes and kept in this process's cache: the pools forked
    after it inherit them (in OUT/points too, with `points`)."""
    todo: dict[str, Scenario] = {}
    for one in ones:
        todo.setdefault(capacity_key(one, speculative=True), one)
    for key, cap in _map(_ladder_task, [(one, points) for one in todo.values()], jobs, label):
        remember(key, cap, is_ladder=True)


def measure_capacities(spec: PlanSpec, jobs: int | None = None, label: str = "") -> None:
    """Every searched configuration's capacity ladder per replica (`sim.capacity.ladder`: the
    capacity, or where the throughput collapses its peak, an upper bound on it; what `search_row`
    prunes with first), each deployment once, all measured in parallel before the search (a strategy's search then finds
    them: in OUT/points, or in this process's cache, which the search's workers inherit), so one
    strategy's many configurations do not keep a single worker busy while the others idle."""
    ones: list[Scenario] = []
    for g in spec.gpus:
        for s in spec.strategies:
            for cfg in grid(spec, s, g, spec.rate_rps):
                try:
                    one = _one(spec, configured(s, spec.base, cfg), g, spec.rate_rps)
                except ConfigError:
                    continue
                per = gpus_per_replica(one)
                if spec.search.gpus_per_node is not None and per > spec.search.gpus_per_node:
                    continue
                ones.append(one)
    # the longest first (speculation measures more populations; fewer GPUs a replica, more steps a second)
    ones.sort(key=lambda sc: (sc.speculative is None, gpus_per_replica(sc)))
    _measure_ladders(ones, spec.points, jobs, label)


def run_search(spec: PlanSpec, jobs: int | None = None, prune: bool = True,
               label: str = "", with_headroom: bool = True) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the ranked planning table: one row per strategy x GPU type at the plan's traffic, its
    cheapest passing configuration, with the leading options' headroom unless `with_headroom` is
    off (`run_tables` measures it beside the analyses); every configuration searched, with
    `pareto`)."""
    measure_capacities(spec, jobs, "capacities" if label else "")
    tasks = [(spec, s, g, spec.rate_rps, prune) for g in spec.gpus for s in spec.strategies]
    found = _map(search_row, tasks, jobs, label)
    configs = pd.DataFrame([c for f in found for c in f["configs"]])
    if len(configs):
        configs["cost_mode"] = spec.cost.mode
        configs["pareto"] = pareto(configs)
    ranked = rank(pd.DataFrame([f["row"] for f in found]))
    if with_headroom:
        htasks = headroom_tasks(spec, ranked)
        add_headroom(ranked, _map(headroom, htasks, jobs, "headroom" if label and htasks else ""))
    return ranked, configs


def _headroom_rows(ranked: pd.DataFrame) -> pd.DataFrame:
    """The leading HEADROOM_TOP passing options, whose racks' headroom is measured."""
    if "feasible" not in ranked:
        return ranked.iloc[:0]
    return ranked[ranked.feasible.astype(bool)].head(HEADROOM_TOP)


def headroom_tasks(spec: PlanSpec, ranked: pd.DataFrame) -> list[tuple[Any, ...]]:
    """`headroom`'s arguments for the leading passing options' racks (`_headroom_rows`)."""
    by_name = {x.name: x for x in spec.strategies}
    return [(spec, configured(by_name[r.strategy], spec.base, row_config(r)), r.gpu, r.to_dict())
            for _, r in _headroom_rows(ranked).iterrows()]


def add_headroom(ranked: pd.DataFrame, found: list[dict[str, Any]]) -> None:
    """`headroom`'s answers (for `headroom_tasks`, in order) into the ranked table's leading rows."""
    for i, h in zip(_headroom_rows(ranked).index, found, strict=True):
        for k, v in h.items():
            ranked.loc[i, k] = v


def run_plan(spec: PlanSpec, jobs: int | None = None) -> pd.DataFrame:
    """The ranked planning table (see run_search)."""
    return run_search(spec, jobs)[0]


def row_config(r: Any) -> dict[str, int | None]:
    """The configuration of a plan.csv row (tp, max_num_batched_tokens, max_num_seqs, k)."""
    out: dict[str, int | None] = {}
    for k in ("tp", "max_num_batched_tokens", "max_num_seqs", "k"):
        v = r.get(k) if hasattr(r, "get") else None
        out[k] = int(v) if v is not None and v == v else None
    return out


def rank(df: pd.DataFrame) -> pd.DataFrame:
    if df.empty or "total_usd_per_month" not in df:
        return df
    key = (~df.feasible.astype(bool)).astype(int) * 2 + (~df.get("passes_quality_floor", True).fillna(False).astype(bool)).astype(int)
    return df.assign(_k=key).sort_values(["_k", "total_usd_per_month"]).drop(columns="_k").reset_index(drop=True)


def capacity_curves(spec: PlanSpec, answer: pd.DataFrame, jobs: int | None = None) -> pd.DataFrame:
    """GPUs needed and monthly cost vs traffic (multiples of the plan's rate), per strategy."""
    tasks = curve_tasks(spec, answer)
    return curves_table(spec, _map(plan_row, tasks, jobs, "capacity curves" if spec.progress else ""))


def curve_tasks(spec: PlanSpec, answer: pd.DataFrame) -> list[tuple[Any, ...]]:
    """`plan_row`'s arguments for each strategy's capacity curve."""
    tasks = []
    for g in spec.gpus:
        for s in spec.strategies:
            hit = answer[(answer.strategy == s.name) & (answer.gpu == g)]
            found = len(hit) and bool(hit.feasible.iloc[0])
            base_rep = int(hit.replicas.iloc[0]) if found else 1
            chosen = configured(s, spec.base, row_config(hit.iloc[0])) if found else s  # the plan's configuration
            for m in spec.curve_multipliers:
                tasks.append((spec, chosen, g, spec.rate_rps * m, max(1, round(base_rep * m))))
    return tasks


def curves_table(spec: PlanSpec, rows: list[dict[str, Any]]) -> pd.DataFrame:
    df = pd.DataFrame(rows)
    df["traffic_multiplier"] = df.rate_rps / spec.rate_rps
    return df


def plan_acceptance(base: Scenario) -> float:
    """The base traffic's mean per-token acceptance (classes weighted by share): the plan's own
    operating point on the decision map's acceptance axis."""
    method = base.speculative.method if base.speculative is not None else "draft_model"
    cl = base.workload.classes
    vals = [c.acceptance_for(method) if isinstance(c.acceptance, dict) and method in c.acceptance
            else (float(np.mean(list(c.acceptance.values()))) if isinstance(c.acceptance, dict) else c.acceptance)
            for c in cl]
    return float(sum(c.share * v for c, v in zip(cl, vals, strict=True)) / sum(c.share for c in cl))


def with_acceptance(spec: PlanSpec, a: float) -> PlanSpec:
    """The plan with every traffic class's per-token acceptance set to `a`."""
    classes = [dict(c.model_dump(mode="json"), acceptance=a) for c in spec.base.workload.classes]
    return dataclasses.replace(spec, base=spec.base.with_overrides({"workload.classes": classes}))


def _chosen(spec: PlanSpec, answer: pd.DataFrame | None, s: Strategy, gpu: str) -> tuple[Strategy, int, float]:
    """(the strategy in its planned configuration, its planned replicas, the plan's rate), or the
    strategy as configured with one replica when the plan found no rack for it."""
    if answer is not None and len(answer):
        hit = answer[(answer.strategy == s.name) & (answer.gpu == gpu) & answer.feasible.astype(bool)]
        if len(hit):
            return configured(s, spec.base, row_config(hit.iloc[0])), int(hit.replicas.iloc[0]), spec.rate_rps
    return s, 1, spec.rate_rps


def base_capacity(spec: PlanSpec, gpu: str | None = None) -> float:
    """Capacity (req/s, speculation off) of the base rack on this GPU: the map's utilisation unit."""
    return capacity_of(spec.base.with_overrides({"rack.gpu": gpu or spec.gpus[0]}), spec.points).rps


def decision_map(spec: PlanSpec, jobs: int | None = None, gpu: str | None = None,
                 answer: pd.DataFrame | None = None) -> pd.DataFrame:
    """Cost at the SLO over traffic x acceptance: for each cell (traffic = utilisation x the base
    rack's capacity, every class's acceptance set to the cell's), each strategy's cheapest rack
    that meets the SLO there under the plan's rack rules (found by simulation, as the plan finds
    its own, in the configuration the plan chose for the strategy), its monthly cost and whether
    it keeps the quality floor. `winners` names the cheapest per cell."""
    tasks, layout = map_tasks(spec, gpu, answer)
    return map_table(layout, _map(_map_cell, tasks, jobs, "decision map" if spec.progress else ""))


def map_tasks(spec: PlanSpec, gpu: str | None = None,
              answer: pd.DataFrame | None = None) -> tuple[list[tuple[Any, ...]], list[tuple[float, int]]]:
    """`_map_cell`'s arguments for the decision map's distinct searches, and the map's layout: for
    every cell and strategy in order, (its acceptance, the index of the search that answers it).
    A strategy that does not speculate (in its planned configuration) runs the same simulations at
    every acceptance (no class's acceptance is read: same requests, steps and capacity), so its
    search at the first acceptance answers every acceptance of that utilisation (`map_table`)."""
    gpu = gpu or spec.gpus[0]
    cap = base_capacity(spec, gpu)
    tasks: list[tuple[Any, ...]] = []
    layout: list[tuple[float, int]] = []
    plain: dict[tuple[float, str], int] = {}  # (utilisation, strategy) -> its search, when it does not speculate
    for u in spec.map_utilisation:
        for a in spec.map_acceptance:
            for s in spec.strategies:
                if (s.name, gpu) not in spec.not_applicable:
                    chosen, reps, rate0 = _chosen(spec, answer, s, gpu)
                    if (u, s.name) in plain:
                        layout.append((a, plain[(u, s.name)]))
                        continue
                    if not _speculates(spec, chosen, gpu, rate0):
                        plain[(u, s.name)] = len(tasks)
                    start = max(1, round(reps * u * cap / rate0))
                    layout.append((a, len(tasks)))
                    tasks.append((spec, s.name, chosen, gpu, u, a, u * cap, start))
    return tasks, layout


def _speculates(spec: PlanSpec, s: Strategy, gpu: str, rate: float) -> bool:
    """Whether the strategy speculates on this GPU type (True when it cannot be built: its own
    search reports why, at every acceptance)."""
    try:
        return _one(spec, s, gpu, rate).speculative is not None
    except ConfigError:
        return True


def map_table(layout: list[tuple[float, int]], found: list[dict[str, Any]]) -> pd.DataFrame:
    """The decision map's cells (`map_tasks`'s layout) from its searches' answers."""
    return pd.DataFrame([{**found[i], "acceptance": a} for a, i in layout])


def _map_cell(spec: PlanSpec, name: str, s: Strategy, gpu: str, u: float, a: float, rate: float,
              start: int = 1) -> dict[str, Any]:
    r = plan_row(with_acceptance(spec, a), s, gpu, rate, start)
    out = {"utilisation": u, "acceptance": a, "rate_rps": rate, "strategy": name, "gpu": gpu,
           "feasible": bool(r["feasible"]), "meets_slo": bool(r["feasible"])}
    if r["feasible"]:
        out.update({k: r[k] for k in ("replicas", "gpus", "billed_gpus", "total_usd_per_month", "usd_per_mtok_at_slo",
                                      "tpot_mean_s", "ttft_p99_s", "quality_tail", "passes_quality_floor", "tp",
                                      "max_num_batched_tokens", "max_num_seqs", "k")})
    else:
        out.update(reason=r.get("reason", ""), passes_quality_floor=False)
    return out


def winners(cells: pd.DataFrame) -> pd.DataFrame:
    """Per cell: the cheapest strategy whose rack meets the SLO and keeps the quality floor, its
    rack and monthly cost, and its cost margin over the runner-up (relative; inf when it is the
    only one). 'none' where no strategy passes within max_gpus."""
    out = []
    for (u, a), g in cells.groupby(["utilisation", "acceptance"]):
        ok = g[g.feasible.astype(bool) & g.passes_quality_floor.fillna(False).astype(bool)]
        ok = ok.sort_values(["total_usd_per_month", "gpus", "strategy"])
        row: dict[str, Any] = {"utilisation": u, "acceptance": a, "rate_rps": float(g.rate_rps.iloc[0])}
        if ok.empty:
            out.append({**row, "winner": "none", "margin": float("nan"), "rack": "", "total_usd_per_month": float("nan"),
                        "runner_up": ""})
            continue
        best = ok.iloc[0]
        second = ok.iloc[1] if len(ok) > 1 else None
        out.append({**row, "winner": best.strategy, "rack": f"{int(best.gpus)}x {best.gpu}",
                    "replicas": int(best.replicas), "gpus": int(best.gpus),
                    "total_usd_per_month": float(best.total_usd_per_month),
                    "margin": float(second.total_usd_per_month / best.total_usd_per_month - 1.0) if second is not None
                    else float("inf"), "runner_up": "" if second is None else str(second.strategy)})
    return pd.DataFrame(out)


SENSITIVITY_PRICE = (0.5, 0.75, 1.0, 1.25, 1.5)  # GPU price multipliers (rent: $/GPU-hour; buy: capex per GPU)


def sensitivity(spec: PlanSpec, answer: pd.DataFrame, curves: pd.DataFrame | None = None,
                jobs: int | None = None) -> pd.DataFrame:
    """How the monthly cost at the SLO of the winner and the runner-up moves with per-token
    acceptance (the cheapest rack re-found by simulation at each of map_acceptance), traffic growth
    (the capacity curves' racks, each found by simulation) and GPU price (the planned rack repriced:
    closed form, serving cost is linear in the GPU price). One row per (strategy, factor, value)."""
    tasks = sensitivity_tasks(spec, answer)
    found = _map(plan_row, tasks, jobs, "sensitivity" if spec.progress else "") if tasks else []
    return sensitivity_table(spec, answer, found, curves)


def _sensitivity_options(answer: pd.DataFrame) -> pd.DataFrame:
    """The winner and the runner-up: the two cheapest passing options that keep the quality floor."""
    return answer[answer.feasible.astype(bool) & answer.get("passes_quality_floor", True).astype(bool)].head(2)


def sensitivity_tasks(spec: PlanSpec, answer: pd.DataFrame) -> list[tuple[Any, ...]]:
    """`plan_row`'s arguments for the winner's and the runner-up's racks at each map_acceptance."""
    tasks = []
    for _, r in _sensitivity_options(answer).iterrows():
        s = configured(next(x for x in spec.strategies if x.name == r.strategy), spec.base, row_config(r))
        for a in spec.map_acceptance:
            tasks.append((with_acceptance(spec, a), s, r.gpu, spec.rate_rps, int(r.replicas)))
    return tasks


def sensitivity_table(spec: PlanSpec, answer: pd.DataFrame, found: list[dict[str, Any]],
                      curves: pd.DataFrame | None) -> pd.DataFrame:
    """`sensitivity`'s rows from `plan_row`'s answers to `sensitivity_tasks` (in order)."""
    ok = _sensitivity_options(answer)
    rows: list[dict[str, Any]] = []
    i = 0
    for _, r in ok.iterrows():
        base_row = {"strategy": r.strategy, "gpu": r.gpu}
        for a in spec.map_acceptance:
            f = found[i]
            i += 1
            rows.append({**base_row, "factor": "acceptance", "value": a, "feasible": bool(f["feasible"]),
                         "gpus": f.get("gpus"), "total_usd_per_month": f.get("total_usd_per_month", float("nan"))})
        if curves is not None and len(curves):
            c = curves[(curves.strategy == r.strategy) & (curves.gpu == r.gpu)].sort_values("traffic_multiplier")
            for _, cr in c.iterrows():
                rows.append({**base_row, "factor": "traffic growth", "value": float(cr.traffic_multiplier),
                             "feasible": bool(cr.feasible), "gpus": cr.get("gpus"),
                             "total_usd_per_month": cr.get("total_usd_per_month", float("nan"))})
        per = int(r.gpus_per_replica)
        for m in SENSITIVITY_PRICE:
            cost = spec.cost
            if cost.mode == "buy":
                cost = dataclasses.replace(cost, capex_usd_per_gpu={**cost.capex_usd_per_gpu,
                                                                    r.gpu: cost.capex_usd_per_gpu[r.gpu] * m})
            mc = monthly_cost(cost, r.gpu, float(r.usd_per_gpu_hour) * m, int(r.replicas), per, spec.search.gpus_per_node,
                              float(r.gpu_busy_fraction))
            total = float(mc["serving_usd_per_month"]) + float(mc["power_usd_per_month"]) + float(r.retraining_usd_per_month)
            rows.append({**base_row, "factor": "GPU price", "value": m, "feasible": True, "gpus": int(r.gpus),
                         "total_usd_per_month": total})
    return pd.DataFrame(rows)


def acceptance_shift(spec: PlanSpec, jobs: int | None = None) -> pd.DataFrame:
    """Speedup of each speculative strategy on benchmark-like traffic (no tail) and on
    production-like traffic with a growing tail share, at the plan's shift utilisation."""
    tasks = shift_tasks(spec)
    return shift_table(_map(_shift_cell, tasks, jobs, "acceptance shift" if spec.progress else ""))


def shift_tasks(spec: PlanSpec) -> list[tuple[Any, ...]]:
    """`_shift_cell`'s arguments: each runnable strategy at each tail share (the first, the
    reference, at every share)."""
    base = spec.base
    cap = capacity_of(base, spec.points)
    tail = [c for c in base.workload.classes if c.tail]
    head = [c for c in base.workload.classes if not c.tail]
    if not tail or not head:
        raise ConfigError("acceptance shift needs the base scenario to have an in-distribution class and a tail class (tail = true)")
    runnable = []  # strategies that run on the base rack's GPU
    for s in spec.strategies:
        try:
            base.with_overrides(s.overrides)
            runnable.append(s)
        except ConfigError:
            continue
    if not runnable:
        raise ConfigError(f"acceptance shift: no strategy runs on the base rack's {base.rack.gpu}")
    tasks = []
    for share in spec.shift_tail_shares:
        classes = [dict(head[0].model_dump(mode="json"), share=1.0 - share)]
        if share > 0:
            classes = [dict(head[0].model_dump(mode="json"), share=1.0 - share), dict(tail[0].model_dump(mode="json"), share=share)]
        for s in runnable:
            tasks.append((base, s, classes, cap.rps * spec.shift_utilisation, spec.seeds, share, spec.traffic, spec.points))
    return tasks


def shift_table(found: list[dict[str, Any]]) -> pd.DataFrame:
    """`acceptance_shift`'s table from `_shift_cell`'s answers (the first strategy is the reference)."""
    rows = pd.DataFrame(found)
    ref = rows[rows.strategy == rows.strategy.iloc[0]].set_index("tail_share").tpot_mean_s
    rows["speedup"] = rows.tail_share.map(ref) / rows.tpot_mean_s
    return rows


def _shift_cell(base: Scenario, s: Strategy, classes: list[dict[str, Any]], rate: float, seeds: tuple[int, ...],
                share: float, traffic: Traffic | None = None, points: str | None = None) -> dict[str, Any]:
    sc = base.with_overrides({**s.overrides, "workload.classes": classes, **at_rate(traffic, rate)})
    sums = [summary(sc, seed, points) for seed in seeds]
    return {"strategy": s.name, "tail_share": share, "tpot_mean_s": float(np.mean([x["tpot_s"]["mean"] for x in sums])),
            "acceptance_rate": _nanmean([x["acceptance_rate"] for x in sums])}


def _nanmean(values: list[float]) -> float:
    finite = [v for v in values if v == v]
    return float(np.mean(finite)) if finite else float("nan")


def retraining_table(spec: PlanSpec, answer: pd.DataFrame) -> pd.DataFrame:
    """Monthly total cost of every planned option vs teacher update cadence; distilled options pay
    a re-distillation per update and lose quality while stale, the others pay nothing."""
    rows = []
    for _, r in answer[answer.feasible.astype(bool)].iterrows():
        s = configured(next(x for x in spec.strategies if x.name == r.strategy), spec.base, row_config(r))
        sc = _scenario(spec.base, s, r.gpu, spec.prices, int(r.replicas), spec.rate_rps, traffic=spec.traffic)
        rt = build_runtime(sc)
        power = float(r.get("power_usd_per_month", 0.0) or 0.0)
        for cad, per_month in CADENCES.items():
            if rt.retraining is not None:
                rtn = dataclasses.replace(rt.retraining, teacher_updates_per_month=per_month)
                retrain = rtn.usd_per_month
                q_tail = rtn.effective_quality(rt.quality[1])
            else:
                retrain, q_tail = 0.0, rt.quality[1]
            rows.append({"strategy": r.strategy, "gpu": r.gpu, "cadence": cad, "teacher_updates_per_month": per_month,
                         "training_gpu": rt.retraining.training_gpu if rt.retraining else "",
                         "cost_mode": r.get("cost_mode", "rent"), "serving_usd_per_month": r.serving_usd_per_month,
                         "power_usd_per_month": power, "retraining_usd_per_month": retrain,
                         "total_usd_per_month": r.serving_usd_per_month + power + retrain, "quality_tail": q_tail,
                         "quality_floor_tail": spec.quality_floor_tail})
    return pd.DataFrame(rows)


def main_plan(a: Any) -> int:
    """`specrack plan`: the search, the analyses and the report, resumable (finished simulations
    are kept in OUT/points; see plan_store), with progress and an ETA on stderr."""
    from experiments.plan_report import write_plan_report
    from experiments.plan_store import clean, count
    from experiments.sweep import check_out_dir

    out = Path(a.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: exists and is not a folder; name a folder for plan.csv and report.html")
    fresh = not out.exists()
    check_out_dir(out)
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
            import shutil

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
    if spec.day is not None:  # the day on an autoscaled fleet, next to the fixed rack sized for its peak
        from experiments.plan_day import print_day, run_day

        print_day(spec.day, run_day(spec, tables["plan"], out)[0])
    print(f"wrote {out / 'plan.csv'}, {out / 'configs.csv'}, {report}")
    return 0


def run_tables(spec: PlanSpec, jobs: int | None = None, analyses: bool = True) -> dict[str, pd.DataFrame]:
    """Every table of a plan by name: plan, configs and, with the analyses, curves, map_cells,
    map, shift, retraining and sensitivity (what `specrack plan` writes as <name>.csv)."""
    label = f"search ({len(spec.strategies) * len(spec.gpus)} strategy x GPU)"
    answer, configs = run_search(spec, jobs, label=label, with_headroom=not analyses)
    tables = {"plan": answer, "configs": configs}
    if analyses:
        # the headroom and every analysis in one pool, the longest tasks first: no worker idles
        # at the end of one analysis while another's tasks wait
        cell_tasks, layout = map_tasks(spec, answer=answer)
        parts = {"headroom": (headroom, headroom_tasks(spec, answer)), "map": (_map_cell, cell_tasks),
                 "curves": (plan_row, curve_tasks(spec, answer)), "sensitivity": (plan_row, sensitivity_tasks(spec, answer)),
                 "shift": (_shift_cell, shift_tasks(spec))}
        flat = [(name, fn, args) for name, (fn, tasks) in parts.items() for args in tasks]
        done = _map(_call, [(fn, args) for _, fn, args in flat], jobs,
                    f"headroom and analyses ({len(flat)} searches and runs)" if spec.progress else "")
        found: dict[str, list[Any]] = {name: [] for name in parts}
        for (name, _, _), res in zip(flat, done, strict=True):
            found[name].append(res)
        add_headroom(answer, found["headroom"])
        tables["curves"] = curves_table(spec, found["curves"])
        cells = map_table(layout, found["map"])
        tables["map_cells"] = cells
        gpu = spec.gpus[0]
        tables["map"] = winners(cells).assign(
            plan_utilisation=spec.rate_rps / base_capacity(spec, gpu), plan_acceptance=plan_acceptance(spec.base),
            plan_rate_rps=spec.rate_rps, base_rack=f"{spec.base.rack.num_gpus}x {gpu}",
            base_capacity_rps=base_capacity(spec, gpu))
        tables["shift"] = shift_table(found["shift"])
        tables["retraining"] = retraining_table(spec, answer)
        tables["sensitivity"] = sensitivity_table(spec, answer, found["sensitivity"], tables["curves"])
    return tables


def _call(fn: Any, args: tuple[Any, ...]) -> Any:
    """fn(*args), in a worker: `run_tables` maps the analyses' different functions in one pool."""
    return fn(*args)


def print_ranked(df: pd.DataFrame, spec: PlanSpec | None = None) -> None:
    """The ranked table: each option's configuration, each SLO target's value (its percentile),
    the binding check by name, its monthly cost split ($/month), $ per million output tokens and
    its headroom (max rps: the highest req/s the rack serves within the SLO)."""
    if spec is not None:
        b = spec.base
        print(f"model {b.deployment.model} ({b.deployment.weights} weights, {b.deployment.kv_cache} KV), engine "
              f"{b.deployment.engine}, base rack {b.rack.num_gpus}x {b.rack.gpu} TP{b.deployment.tensor_parallel}, traffic "
              f"{spec.rate_rps:.2f} req/s; cost mode {spec.cost.mode}; {spec.search.rules()}")
    checks = [c.removeprefix("slo_").removesuffix("_value") for c in df.columns if c.startswith("slo_") and c.endswith("_value")]
    heads = [f"{c.split('_')[0].upper()} {c.split('_')[1]}" for c in checks]
    print(f"{'rank':>4} {'strategy':<20} {'gpu':<9} {'TP':>2} {'MBT':>5} {'seqs':>4} {'k':>2} {'reps':>4} {'GPUs':>5} "
          + " ".join(f"{h:>9}" for h in heads)
          + f" {'serving $/mo':>12} {'power $/mo':>10} {'total $/mo':>12} {'$/Mtok':>7} {'q tail':>6} {'max rps':>7}  floor"
          "  binding")
    for i, r in df.iterrows():
        if not r.feasible:
            print(f"{i + 1:>4} {r.strategy:<20} {r.gpu:<9}  infeasible: {r.get('reason', '')}")
            continue
        vals = " ".join(f"{_fmt_s(r[f'slo_{c}_value']):>9}" for c in checks)
        b = r.get("binding_slo")
        binding = f"{b} ({r[f'slo_{b}_value'] / r[f'slo_{b}_target']:.0%} of target)" if isinstance(b, str) and b else "-"
        k = "-" if r.get("k") is None or r.get("k") != r.get("k") else f"{int(r.k)}"
        h = r.get("headroom_rps")
        hr = "-" if h is None or h != h else f"{float(h):.2f}"
        print(f"{i + 1:>4} {r.strategy:<20} {r.gpu:<9} {int(r.tp):>2} {int(r.max_num_batched_tokens):>5} "
              f"{int(r.max_num_seqs):>4} {k:>2} {int(r.replicas):>4} {int(r.billed_gpus):>5} {vals} "
              f"{r.serving_usd_per_month:>12,.0f} {r.power_usd_per_month:>10,.0f} {r.total_usd_per_month:>12,.0f} "
              f"{r.usd_per_mtok_at_slo:>7.2f} {r.quality_tail:>6.3f} {hr:>7}  {'pass' if r.passes_quality_floor else 'FAIL'}"
              f"   {binding}")


def _fmt_s(v: float) -> str:
    return f"{v:.2f}s" if v >= 1 else f"{v * 1e3:.1f}ms"
