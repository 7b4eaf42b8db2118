"""Reading a plan file: the keys each table takes (did-you-mean for a typo, the right table for a
key written in the wrong one), the checked readers of numbers, names and lists, and the parsed
tables that need nothing but the file: [traffic] (`Traffic`), [search] (`SearchSpec`) and the
strategies (built-in names or name/set tables). `experiments.plan.load_plan` composes them."""

from __future__ import annotations

import difflib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from experiments.plan_cost import COST_KEYS
from experiments.sweep import Variant, check_distinct, default_sweep_path, parse_variant
from models.errors import ConfigError, unknown
from sim.scenario import SLO_KEYS, read_toml, slo_key_hint
from sim.traces import load_trace, trace_rate_rps

TP_DEGREES = (1, 2, 4, 8)  # the tensor-parallel degrees searched by default (those that fit)
DEFAULT_MBT = (2048, 8192)  # max_num_batched_tokens searched by default, with the base's own
LAYOUTS = ("aggregated", "disaggregated")  # [search] layouts: prefill and decode on one pool, or on two
DEFAULT_K = (2, 4)  # speculative k searched by default (speculating strategies), with the strategy's own


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
    layouts: tuple[str, ...] = ("aggregated",)  # "aggregated" and/or "disaggregated" (experiments.plan_disagg)

    def describe(self) -> str:
        if not self.configurations:
            return "off (each strategy as configured)"
        def g(v: tuple[int, ...] | None, default: str) -> str:
            return default if v is None else str(list(v))
        return (f"TP {g(self.tp, 'every degree of ' + str(list(TP_DEGREES)) + ' that fits')}, max_num_batched_tokens "
                f"{g(self.max_num_batched_tokens, str(list(DEFAULT_MBT)) + ' + the base')}, max_num_seqs "
                f"{g(self.max_num_seqs, 'the base')}, k (speculating strategies) {g(self.k, str(list(DEFAULT_K)) + ' + the strategy' + chr(39) + 's')}; "
                "pruned by capacity (more than rate / capacity per replica replicas) "
                "and by the best passing cost so far"
                + ("; layouts " + ", ".join(self.layouts) if self.layouts != ("aggregated",) else ""))

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


DAY_KEYS = ("rate_profile", "trace", "trace_format", "autoscale", "interval_s", "seeds")  # [day]: experiments.plan_day
# the keys each plan table takes; anything else is a typo (did-you-mean) or a key in the wrong table
TOP_KEYS = ("name", "base", "base_set", "strategies", "traffic", "slo", "search", "cost", "quality", "analyses", "quick",
            "day")
TABLE_KEYS: dict[str, tuple[str, ...]] = {
    "traffic": ("rate_rps", "trace", "trace_format", "growth", "window", "start_s", "end_s"),
    "search": ("gpus", "usd_per_gpu_hour", "max_gpus", "duration_s", "warmup_s", "seeds", "configurations", "tp",
               "max_num_batched_tokens", "max_num_seqs", "k", "min_replicas", "redundancy", "max_utilisation",
               "gpus_per_node", "layouts"),
    "cost": COST_KEYS,
    "quality": ("floor_tail", "teacher_updates_per_month", "training_gpu", "training_usd_per_gpu_hour"),
    "analyses": ("curve_multipliers", "map_utilisation", "map_acceptance", "shift_tail_shares", "shift_utilisation"),
    "slo": SLO_KEYS,
    "day": DAY_KEYS,
}
QUICK_SECTIONS = ("traffic", "search", "cost", "quality", "analyses", "slo", "day")


def near(key: str, known: tuple[str, ...] | list[str]) -> str:
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


def check_keys(d: dict[str, Any], where: str, known: tuple[str, ...]) -> None:
    for key in d:
        if key in known:
            continue
        if where.endswith("slo"):
            raise ConfigError(f"{where}.{key}: {slo_key_hint(str(key))}")
        home = _home(str(key))
        if home:
            raise ConfigError(f"{where}.{key}: belongs in {home}, not in [{where}]")
        raise ConfigError(f"{where}: unknown key '{key}'{near(str(key), known)} (known: {', '.join(known)})")


def table(d: dict[str, Any], key: str, where: str = "") -> dict[str, Any]:
    v = d.get(key, {})
    if not isinstance(v, dict):
        raise ConfigError(f"{where}{key}: must be a table ([{key}] with keys such as "
                          f"{', '.join(TABLE_KEYS.get(key, QUICK_SECTIONS)[:3])}), got {v!r}")
    return v


def positive(d: dict[str, Any], key: str, where: str, default: float | None = None) -> float:
    v = d.get(key, default)
    if v is None:
        raise ConfigError(f"{where}.{key}: missing (a positive number)")
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not (v > 0 and math.isfinite(v)):
        raise ConfigError(f"{where}.{key}: must be a positive finite number, got {v!r}")
    return float(v)


def string(d: dict[str, Any], key: str, where: str, default: str | None = None) -> str:
    v = d.get(key, default)
    if not isinstance(v, str) or not v:
        raise ConfigError(f"{where}{key}: must be a non-empty string, got {v!r}")
    return v


def strings(d: dict[str, Any], key: str, where: str, default: list[str]) -> list[str]:
    v = d.get(key, default)
    if isinstance(v, str):
        raise ConfigError(f"{where}.{key}: must be a list, e.g. {key} = [\"{v}\"], got the string {v!r}")
    if not isinstance(v, list) or not v or not all(isinstance(x, str) for x in v):
        raise ConfigError(f"{where}.{key}: must be a non-empty list of names, got {v!r}")
    if len(set(v)) != len(v):
        raise ConfigError(f"{where}.{key}: lists a name twice: {v!r}")
    return v


_WINDOW = re.compile(r"^peak-(\d+(?:\.\d+)?)(s|m|h)$")


def parse_traffic(t: dict[str, Any], plan_dir: Path, warmup_s: float) -> Traffic:
    """Validate [traffic] and resolve a trace window (see Traffic)."""
    growth = positive(t, "growth", "traffic", 1.0)
    if "trace" not in t:
        for k in ("window", "start_s", "end_s", "trace_format"):
            if k in t:
                raise ConfigError(f"traffic.{k}: only meaningful with traffic.trace = '<path>'")
        if "rate_rps" not in t:
            raise ConfigError("traffic: set rate_rps = <requests/s> or trace = '<path to a trace file>'")
        return Traffic("rate", positive(t, "rate_rps", "traffic") * growth, growth)
    if "rate_rps" in t:
        raise ConfigError("traffic: set rate_rps or trace, not both (a trace replays its own timing; scale it with growth)")
    trace = str((plan_dir / string(t, "trace", "traffic.")).resolve())
    fmt = string(t, "trace_format", "traffic.", "auto")
    if fmt not in ("auto", "azure", "mooncake", "csv"):
        raise unknown("trace format", fmt, ("auto", "azure", "mooncake", "csv"))
    df = load_trace(trace, fmt)
    mean = trace_rate_rps(df)
    a = df.arrival_s.to_numpy(np.float64)
    span = float(a[-1])
    if "window" in t and ("start_s" in t or "end_s" in t):
        raise ConfigError("traffic: set window or start_s/end_s, not both")
    if "start_s" in t or "end_s" in t:
        lo = num(t, "start_s", "traffic", 0.0, lo=0)
        hi = num(t, "end_s", "traffic", span, lo=0, lo_open=True)
        if lo >= span:
            raise ConfigError(f"traffic.start_s ({lo:g}) is past the trace's last request ({span:.0f} s after its first)")
        if hi <= lo:
            raise ConfigError(f"traffic.end_s ({hi:g}) must be after traffic.start_s ({lo:g})")
        n = int(np.searchsorted(a, hi, "left") - np.searchsorted(a, lo, "left"))
        label = f"{lo:g}-{hi:g} s"
    else:
        w = string(t, "window", "traffic.", "whole")
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


def measured_requests(tr: Traffic, duration_s: float, warmup_s: float) -> int:
    """Requests arriving in one run's measured window at the plan's rate (expected for a rate)."""
    if tr.kind == "rate":
        return int(tr.headline_rps * (duration_s - warmup_s))
    a = load_trace(tr.trace or "", tr.trace_format).arrival_s.to_numpy()
    g = tr.headline_rps / tr.window_rate_rps
    o = tr.overrides(tr.headline_rps)
    start = o["workload.trace_start_s"] or 0.0
    return int(((a >= start + warmup_s * g) & (a < tr.hi_s)).sum())


def resolve_traffic(d: dict[str, Any], p: Path) -> tuple[Traffic, float, float]:
    search, traffic = d["search"], d["traffic"]
    warm = num(search, "warmup_s", "search", 20, lo=0)
    if "trace" in traffic and "duration_s" in search:
        raise ConfigError("search.duration_s: a trace plan simulates its traffic window (traffic.window or "
                          "start_s/end_s), not a duration; remove search.duration_s")
    tr = parse_traffic(traffic, p.parent, warm)
    dur = num(search, "duration_s", "search", 180, lo=0, lo_open=True) if tr.kind == "rate" else float("nan")
    if tr.kind == "rate" and warm >= dur:
        raise ConfigError(f"search.warmup_s ({warm:g}) must be shorter than search.duration_s ({dur:g})")
    return tr, dur, warm


def ints(d: dict[str, Any], key: str, lo: int) -> tuple[int, ...] | None:
    """A grid of integers from [search] (None when absent: the default grid)."""
    if key not in d:
        return None
    v = d[key]
    if not isinstance(v, list) or not v:
        raise ConfigError(f"search.{key}: must be a non-empty list of integers, e.g. {key} = [{lo}], got {v!r}")
    out = tuple(int(num({key: x}, key, "search", 0, lo=lo, integer=True)) for x in v)
    if len(set(out)) != len(out):
        raise ConfigError(f"search.{key}: lists a value twice: {v!r}")
    return out


def parse_search(search: dict[str, Any]) -> SearchSpec:
    """Validate [search]'s grid and rack rules."""
    on = search.get("configurations", True)
    if not isinstance(on, bool):
        raise ConfigError(f"search.configurations: must be true or false, got {on!r}")
    red = search.get("redundancy", "none")
    if red not in ("none", "n+1"):
        raise ConfigError(f"search.redundancy: must be 'none' or 'n+1', got {red!r}")
    util = None
    if "max_utilisation" in search:
        util = num(search, "max_utilisation", "search", 1.0, lo=0, lo_open=True, hi=1)
    gpn = None
    if "gpus_per_node" in search:
        gpn = int(num(search, "gpus_per_node", "search", 8, lo=1, integer=True))
    grids = {k: ints(search, k, lo) for k, lo in (("tp", 1), ("max_num_batched_tokens", 16), ("max_num_seqs", 1), ("k", 1))}
    layouts = tuple(strings(search, "layouts", "search", ["aggregated"]))
    for lay in layouts:
        if lay not in LAYOUTS:
            raise ConfigError(f"search.layouts: unknown layout {lay!r}{near(lay, LAYOUTS)} (known: {', '.join(LAYOUTS)})")
    if "disaggregated" in layouts and (red != "none" or util is not None):
        key = "redundancy" if red != "none" else "max_utilisation"
        raise ConfigError(f"search.{key}: not defined for a disaggregated rack (its capacity is not measured); remove it "
                          "or set search.layouts = ['aggregated']")
    if not on:
        given = [k for k, v in grids.items() if v is not None]
        if given:
            raise ConfigError(f"search.{given[0]}: a grid needs search.configurations = true (it is false)")
    return SearchSpec(configurations=on, tp=grids["tp"], max_num_batched_tokens=grids["max_num_batched_tokens"],
                      max_num_seqs=grids["max_num_seqs"], k=grids["k"],
                      min_replicas=int(num(search, "min_replicas", "search", 1, lo=1, integer=True)),
                      redundancy=red, max_utilisation=util, gpus_per_node=gpn, layouts=layouts)


def parse_strategies(d: dict[str, Any]) -> list[Strategy]:
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


def num(d: dict[str, Any], key: str, where: str, default: float, *, lo: float | None = None, hi: float | None = None,
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


def nums(d: dict[str, Any], key: str, default: list[float], **bounds: Any) -> tuple[float, ...]:
    v = d.get(key, default)
    if not isinstance(v, list) or not v:
        raise ConfigError(f"analyses.{key}: must be a non-empty list of numbers, got {v!r}")
    return tuple(num({key: x}, key, "analyses", 0.0, **bounds) for x in v)


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
