"""Capacity planning: for a traffic, an SLO and candidate strategies, the smallest rack that
meets the SLO, found by search with the simulator (never by extrapolation), its monthly cost
(serving plus amortised retraining) and its quality, plus capacity curves, a decision map over
utilisation x acceptance, the acceptance shift from benchmark to production traffic, and the
retraining obligation vs teacher update cadence.

The search: for each strategy and GPU type, double the number of replicas until the simulated
run meets the SLO (stable, p99 TTFT and p99 TPOT within bounds), then bisect between the last
failing and the first passing count. Meeting the SLO is assumed monotone in replicas (tested).
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from experiments.sweep import Variant, default_sweep_path
from models.errors import ConfigError, unknown
from sim.deployment import build_runtime, gpus_per_replica
from sim.scenario import Scenario, load_scenario, read_toml
from sim.simulate import simulate
from sim.traces import load_trace, trace_rate_rps

CADENCES = {"never": 0.0, "quarterly": 1.0 / 3.0, "monthly": 1.0, "weekly": 52.0 / 12.0}
HOURS_PER_MONTH = 720.0


# a plan's strategy is a sweep's variant: a name and overrides of the base scenario
Strategy = Variant


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


def _positive(d: dict[str, Any], key: str, where: str, default: float | None = None) -> float:
    v = d.get(key, default)
    if v is None:
        raise ConfigError(f"{where}.{key}: missing (a positive number)")
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
        raise ConfigError(f"{where}.{key}: must be a positive number, got {v!r}")
    return float(v)


def load_plan(path: str | Path, quick: bool = False) -> PlanSpec:
    """Read and validate a plan file; one-line ConfigErrors name the field and the fix."""
    p = Path(path)
    d = read_toml(p, "plan")
    known = {"name", "base", "traffic", "slo", "search", "quality", "strategies", "analyses", "quick"}
    extra = set(d) - known
    if extra:
        raise ConfigError(f"{p.name}: unknown field(s) {sorted(extra)} (known: {', '.join(sorted(known))})")
    if "base" not in d:
        raise ConfigError(f"{p.name}: missing 'base' (a scenario file giving the traffic mix and deployment defaults)")
    if quick and "quick" in d:
        for section, values in d["quick"].items():
            if isinstance(values, dict):
                d.setdefault(section, {}).update(values)
    search = d.get("search", {})
    base_set = {"workload.duration_s": _num(search, "duration_s", "search", 180, lo=0, lo_open=True),
                "workload.warmup_s": _num(search, "warmup_s", "search", 20, lo=0)}
    slo = d.get("slo", {})
    base = load_scenario((p.parent / d["base"]).resolve(), base_set)
    if slo:  # the plan's [slo] replaces the base scenario's targets
        from sim.scenario import SLO_KEYS, slo_key_hint

        for key in slo:
            if key not in SLO_KEYS:
                raise ConfigError(f"{p.name}: slo.{key}: {slo_key_hint(str(key))}")
            _positive(slo, key, "slo")
        base = base.with_overrides({"slo": dict(slo)})
    # traffic: a rate, or a trace (at its own mean rate) times a growth factor
    t = d.get("traffic", {})
    growth = _positive(t, "growth", "traffic", 1.0)
    if "trace" in t:
        trace = str((p.parent / t["trace"]).resolve())
        rate = trace_rate_rps(load_trace(trace, t.get("trace_format", "auto"))) * growth
        base = base.with_overrides({"workload.arrival": "trace", "workload.trace": trace,
                                    "workload.trace_format": t.get("trace_format", "auto")})
    else:
        rate = _positive(t, "rate_rps", "traffic") * growth
    gpus = tuple(search.get("gpus", [base.rack.gpu]))
    prices = dict(search.get("usd_per_gpu_hour", {}))
    max_gpus = int(_num(search, "max_gpus", "search", 64, lo=1, integer=True))
    seeds = search.get("seeds", [1])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(x, int) and not isinstance(x, bool) for x in seeds):
        raise ConfigError(f"search.seeds: must be a non-empty list of integers, got {seeds!r}")
    strategies = []
    builtin = builtin_strategies()
    listed = d.get("strategies", d.get("quality", {}).pop("strategies", ["baseline"]))
    if not isinstance(listed, list) or not listed:
        raise ConfigError(f"strategies: must be a non-empty list of built-in names or tables, got {listed!r}")
    for i, s in enumerate(listed):
        if isinstance(s, str):  # a built-in strategy: a variant of the default sweep
            if s not in builtin:
                raise unknown("strategy", s, tuple(builtin))
            strategies.append(builtin[s])
            continue
        if not isinstance(s, dict) or "name" not in s:
            raise ConfigError(f"{p.name}: strategies[{i}] must be a built-in name or a table with name and set")
        strategies.append(Strategy(s["name"], dict(s.get("set", {}))))
    for gpu in gpus:
        for s in strategies:
            try:
                _scenario(base, s, gpu, prices, 1, rate)
            except ConfigError as err:
                raise ConfigError(f"{p.name}: strategy '{s.name}' on {gpu}: {err}") from None
    _check_reachable(p.name, base, strategies, gpus, prices, rate, max_gpus)
    q = d.get("quality", {})
    a = d.get("analyses", {})
    floor = _num(q, "floor_tail", "quality", 0.0, lo=0, hi=1)
    return PlanSpec(
        name=d.get("name", p.stem), base=base, rate_rps=rate, strategies=tuple(strategies), gpus=gpus, prices=prices,
        max_gpus=max_gpus, seeds=tuple(seeds), quality_floor_tail=floor,
        teacher_updates_per_month=_num(q, "teacher_updates_per_month", "quality", 1.0, lo=0),
        curve_multipliers=_nums(a, "curve_multipliers", [0.25, 0.5, 1.0, 2.0, 4.0], lo=0, lo_open=True),
        map_utilisation=_nums(a, "map_utilisation", [0.3, 0.5, 0.7, 0.85], lo=0, lo_open=True, hi=5),
        map_acceptance=_nums(a, "map_acceptance", [0.4, 0.6, 0.8], lo=0, hi=0.999),
        shift_tail_shares=_nums(a, "shift_tail_shares", [0.0, 0.2, 0.4, 0.6], lo=0, hi=0.999),
        shift_utilisation=_num(a, "shift_utilisation", "analyses", 0.5, lo=0, lo_open=True, hi=5),
    )


def _num(d: dict[str, Any], key: str, where: str, default: float, *, lo: float | None = None, hi: float | None = None,
         lo_open: bool = False, integer: bool = False) -> float:
    """A number from a plan table, checked; one-line ConfigError naming the field otherwise."""
    v = d.get(key, default)
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v == v
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
        kind = "an integer" if integer else "a number"
        raise ConfigError(f"{where}.{key}: must be {kind}{' ' + rng if rng else ''}, got {v!r}")
    return float(v)


def _nums(d: dict[str, Any], key: str, default: list[float], **bounds: Any) -> tuple[float, ...]:
    v = d.get(key, default)
    if not isinstance(v, list) or not v:
        raise ConfigError(f"analyses.{key}: must be a non-empty list of numbers, got {v!r}")
    return tuple(_num({key: x}, key, "analyses", 0.0, **bounds) for x in v)


def builtin_strategies() -> dict[str, Strategy]:
    """The default sweep's variants, usable by name in plan files."""
    d = read_toml(default_sweep_path(), "sweep")
    return {v["name"]: Strategy(v["name"], dict(v.get("set", {}))) for v in d["variants"]}


def _check_reachable(name: str, base: Scenario, strategies: list[Strategy], gpus: tuple[str, ...],
                     prices: dict[str, float], rate: float, max_gpus: int) -> None:
    """Refuse a traffic no allowed rack can carry for any strategy (by measured capacity)."""
    from sim.simulate import capacity

    best = 0.0
    for g in gpus:
        for s in strategies:
            one = _scenario(base, s, g, prices, 1, rate)
            per = gpus_per_replica(one)
            if per > max_gpus:
                continue
            best = max(best, capacity(one, speculative=True).rps * (max_gpus // per))
    if rate > best:
        raise ConfigError(f"{name}: traffic {rate:.1f} req/s exceeds what {max_gpus} GPUs can serve with any strategy "
                          f"(at most {best:.1f} req/s at saturation); raise search.max_gpus or lower traffic.rate_rps")


def _scenario(base: Scenario, s: Strategy, gpu: str, prices: dict[str, float], replicas: int, rate: float,
              teacher_updates: float | None = None) -> Scenario:
    """The strategy on `replicas` replicas of this GPU type, offered `rate` requests/s."""
    # any rack large enough for one replica while the strategy is applied; sized below
    sc = base.with_overrides({**s.overrides, "rack.gpu": gpu, "rack.num_gpus": 4096, "rack.allow_idle_gpus": True})
    over: dict[str, Any] = {"rack.num_gpus": replicas * gpus_per_replica(sc), "workload.rate_rps": rate,
                            "rack.allow_idle_gpus": base.rack.allow_idle_gpus}
    if gpu in prices:
        over["rack.usd_per_gpu_hour"] = prices[gpu]
    elif base.rack.usd_per_gpu_hour is not None and gpu == base.rack.gpu:
        over["rack.usd_per_gpu_hour"] = base.rack.usd_per_gpu_hour
    else:
        over["rack.usd_per_gpu_hour"] = None
    if teacher_updates is not None and sc.deployment.distilled_from:
        over["deployment.distillation.teacher_updates_per_month"] = teacher_updates
    return sc.with_overrides(over)


def evaluate(sc: Scenario, seeds: tuple[int, ...]) -> dict[str, Any]:
    """Simulate a rack over seeds; it meets the SLO only if every seed does."""
    rows = [simulate(sc, seed).summary for seed in seeds]
    worst = max(rows, key=lambda r: (not r["slo_met"], r["tpot_s"]["p99"]))
    return {"meets_slo": all(r["slo_met"] for r in rows), "summary": worst}


def min_rack(base: Scenario, s: Strategy, gpu: str, prices: dict[str, float], rate: float, max_gpus: int,
             seeds: tuple[int, ...], teacher_updates: float, start: int = 1) -> dict[str, Any]:
    """Smallest replica count meeting the SLO at this rate (doubling, then bisection)."""
    per = gpus_per_replica(_scenario(base, s, gpu, prices, 1, rate))
    max_rep = max_gpus // per
    if max_rep < 1:
        return {"feasible": False, "reason": f"one replica needs {per} GPUs > max_gpus {max_gpus}"}
    cache: dict[int, dict[str, Any]] = {}

    def ok(r: int) -> bool:
        if r not in cache:
            cache[r] = evaluate(_scenario(base, s, gpu, prices, r, rate, teacher_updates), seeds)
        return cache[r]["meets_slo"]

    lo, hi = 0, max(1, min(start, max_rep))  # lo fails (0 replicas always fails), hi to be tested
    while not ok(hi):
        lo = hi
        if hi == max_rep:
            return {"feasible": False, "reason": f"SLO not met even with {max_rep * per} GPUs (max_gpus)",
                    "evaluations": len(cache)}
        hi = min(max_rep, hi * 2)
    # when started above 1, make sure hi - 1 fails (the answer is minimal)
    while hi > 1 and lo < hi - 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    if hi > 1 and lo != hi - 1:
        ok(hi - 1)
    res = cache[hi]["summary"]
    return {"feasible": True, "replicas": hi, "gpus": hi * per, "gpus_per_replica": per, "summary": res,
            "evaluations": len(cache), "one_fewer_meets_slo": cache[hi - 1]["meets_slo"] if hi > 1 else False}


def plan_row(spec: PlanSpec, s: Strategy, gpu: str, rate: float, start: int = 1,
             teacher_updates: float | None = None) -> dict[str, Any]:
    """The planning answer for one strategy on one GPU type at one traffic rate."""
    tu = spec.teacher_updates_per_month if teacher_updates is None else teacher_updates
    r = min_rack(spec.base, s, gpu, spec.prices, rate, spec.max_gpus, spec.seeds, tu, start)
    row: dict[str, Any] = {"strategy": s.name, "gpu": gpu, "rate_rps": rate, "feasible": r["feasible"],
                           "evaluations": r.get("evaluations", 0)}
    if not r["feasible"]:
        row["reason"] = r["reason"]
        return row
    sm = r["summary"]
    price = sm["usd_per_gpu_hour"]
    row.update(
        replicas=r["replicas"], gpus=r["gpus"], one_fewer_meets_slo=r["one_fewer_meets_slo"],
        ttft_p99_s=sm["ttft_s"]["p99"], tpot_p99_s=sm["tpot_s"]["p99"], tpot_mean_s=sm["tpot_s"]["mean"],
        e2e_p99_s=sm["e2e_s"]["p99"], mfu=sm["mfu"], mean_batch_size=sm["mean_batch_size"],
        serving_usd_per_month=r["gpus"] * price * HOURS_PER_MONTH,
        retraining_usd_per_month=sm["retraining_usd_per_month"],
        quality_in_distribution=sm["quality_in_distribution"], quality_tail=sm["quality_tail"],
        usd_per_gpu_hour=price,
    )
    row["total_usd_per_month"] = row["serving_usd_per_month"] + row["retraining_usd_per_month"]
    row["passes_quality_floor"] = bool(sm["quality_tail"] >= spec.quality_floor_tail)
    return row


def _map(fn: Any, tasks: list[tuple[Any, ...]], jobs: int | None) -> list[Any]:
    if (jobs or os.cpu_count() or 1) <= 1 or len(tasks) <= 1:
        return [fn(*t) for t in tasks]
    with cf.ProcessPoolExecutor(max_workers=jobs or os.cpu_count()) as ex:
        return list(ex.map(fn, *zip(*tasks, strict=True)))


def run_plan(spec: PlanSpec, jobs: int | None = None) -> pd.DataFrame:
    """The ranked planning table: one row per strategy x GPU type at the plan's traffic."""
    tasks = [(spec, s, g, spec.rate_rps) for g in spec.gpus for s in spec.strategies]
    df = pd.DataFrame(_map(plan_row, tasks, jobs))
    return rank(df)


def rank(df: pd.DataFrame) -> pd.DataFrame:
    if df.empty or "total_usd_per_month" not in df:
        return df
    key = (~df.feasible.astype(bool)).astype(int) * 2 + (~df.get("passes_quality_floor", True).fillna(False).astype(bool)).astype(int)
    return df.assign(_k=key).sort_values(["_k", "total_usd_per_month"]).drop(columns="_k").reset_index(drop=True)


def capacity_curves(spec: PlanSpec, answer: pd.DataFrame, jobs: int | None = None) -> pd.DataFrame:
    """GPUs needed and monthly cost vs traffic (multiples of the plan's rate), per strategy."""
    tasks = []
    for g in spec.gpus:
        for s in spec.strategies:
            hit = answer[(answer.strategy == s.name) & (answer.gpu == g)]
            base_rep = int(hit.replicas.iloc[0]) if len(hit) and bool(hit.feasible.iloc[0]) else 1
            for m in spec.curve_multipliers:
                tasks.append((spec, s, g, spec.rate_rps * m, max(1, round(base_rep * m))))
    rows = _map(plan_row, tasks, jobs)
    df = pd.DataFrame(rows)
    df["traffic_multiplier"] = df.rate_rps / spec.rate_rps
    return df


def decision_map(spec: PlanSpec, jobs: int | None = None, gpu: str | None = None) -> pd.DataFrame:
    """On the base rack: for each (utilisation, acceptance) cell, every strategy's TPOT, whether
    it meets the SLO and the quality floor, the winner (lowest mean TPOT among those that do) and
    its margin over the runner-up. Utilisation is relative to the base deployment's capacity."""
    from sim.simulate import capacity

    gpu = gpu or spec.gpus[0]
    cap = capacity(spec.base.with_overrides({"rack.gpu": gpu}))
    tasks = []
    for u in spec.map_utilisation:
        for a in spec.map_acceptance:
            for s in spec.strategies:
                tasks.append((spec, s, gpu, u, a, u * cap.rps))
    cells = pd.DataFrame(_map(_map_cell, tasks, jobs))
    return cells


def _map_cell(spec: PlanSpec, s: Strategy, gpu: str, u: float, a: float, rate: float) -> dict[str, Any]:
    base = spec.base.with_overrides({"rack.gpu": gpu})
    classes = [dict(c.model_dump(mode="json"), acceptance=a) for c in base.workload.classes]
    sc = base.with_overrides({**s.overrides, "workload.classes": classes, "workload.rate_rps": rate})
    ev = evaluate(sc, spec.seeds[:1])
    sm = ev["summary"]
    return {"utilisation": u, "acceptance": a, "strategy": s.name, "tpot_mean_s": sm["tpot_s"]["mean"],
            "ttft_p99_s": sm["ttft_s"]["p99"], "meets_slo": ev["meets_slo"], "quality_tail": sm["quality_tail"],
            "passes_quality_floor": sm["quality_tail"] >= spec.quality_floor_tail}


def winners(cells: pd.DataFrame) -> pd.DataFrame:
    """Per cell: the winning strategy and its TPOT margin over the runner-up (relative)."""
    out = []
    for (u, a), g in cells.groupby(["utilisation", "acceptance"]):
        ok = g[g.meets_slo & g.passes_quality_floor].sort_values("tpot_mean_s")
        if ok.empty:
            out.append({"utilisation": u, "acceptance": a, "winner": "none", "margin": float("nan")})
            continue
        best = ok.iloc[0]
        margin = float(ok.iloc[1].tpot_mean_s / best.tpot_mean_s - 1.0) if len(ok) > 1 else float("inf")
        out.append({"utilisation": u, "acceptance": a, "winner": best.strategy, "margin": margin,
                    "winner_tpot_s": best.tpot_mean_s})
    return pd.DataFrame(out)


def acceptance_shift(spec: PlanSpec, jobs: int | None = None) -> pd.DataFrame:
    """Speedup of each speculative strategy on benchmark-like traffic (no tail) and on
    production-like traffic with a growing tail share, at the plan's shift utilisation."""
    from sim.simulate import capacity

    base = spec.base
    cap = capacity(base)
    tail = [c for c in base.workload.classes if c.tail]
    head = [c for c in base.workload.classes if not c.tail]
    if not tail or not head:
        raise ConfigError("acceptance shift needs the base scenario to have an in-distribution class and a tail class (tail = true)")
    tasks = []
    for share in spec.shift_tail_shares:
        classes = [dict(head[0].model_dump(mode="json"), share=1.0 - share)]
        if share > 0:
            classes = [dict(head[0].model_dump(mode="json"), share=1.0 - share), dict(tail[0].model_dump(mode="json"), share=share)]
        for s in spec.strategies:
            tasks.append((base, s, classes, cap.rps * spec.shift_utilisation, spec.seeds, share))
    rows = pd.DataFrame(_map(_shift_cell, tasks, jobs))
    ref = rows[rows.strategy == spec.strategies[0].name].set_index("tail_share").tpot_mean_s
    rows["speedup"] = rows.tail_share.map(ref) / rows.tpot_mean_s
    return rows


def _shift_cell(base: Scenario, s: Strategy, classes: list[dict[str, Any]], rate: float, seeds: tuple[int, ...],
                share: float) -> dict[str, Any]:
    sc = base.with_overrides({**s.overrides, "workload.classes": classes, "workload.rate_rps": rate})
    sums = [simulate(sc, seed).summary for seed in seeds]
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
        s = next(x for x in spec.strategies if x.name == r.strategy)
        sc = _scenario(spec.base, s, r.gpu, spec.prices, int(r.replicas), spec.rate_rps)
        rt = build_runtime(sc)
        for cad, per_month in CADENCES.items():
            if rt.retraining is not None:
                rtn = dataclasses.replace(rt.retraining, teacher_updates_per_month=per_month)
                retrain = rtn.usd_per_month
                q_tail = rtn.effective_quality(rt.quality[1])
            else:
                retrain, q_tail = 0.0, rt.quality[1]
            rows.append({"strategy": r.strategy, "gpu": r.gpu, "cadence": cad, "teacher_updates_per_month": per_month,
                         "serving_usd_per_month": r.serving_usd_per_month, "retraining_usd_per_month": retrain,
                         "total_usd_per_month": r.serving_usd_per_month + retrain, "quality_tail": q_tail})
    return pd.DataFrame(rows)


def main_plan(a: Any) -> int:
    from experiments.plan_report import write_plan_report

    spec = load_plan(a.plan_file, quick=a.quick)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"plan '{spec.name}': {spec.rate_rps:.2f} req/s, SLO {spec.base.slo.describe()}, "
          f"{len(spec.strategies)} strategies on {', '.join(spec.gpus)}",
          file=sys.stderr)
    answer = run_plan(spec, a.jobs)
    answer.to_csv(out / "plan.csv", index=False)
    tables = {"plan": answer}
    if not a.no_analyses:
        print("capacity curves...", file=sys.stderr)
        tables["curves"] = capacity_curves(spec, answer, a.jobs)
        print("decision map...", file=sys.stderr)
        cells = decision_map(spec, a.jobs)
        tables["map_cells"] = cells
        tables["map"] = winners(cells)
        print("acceptance shift...", file=sys.stderr)
        tables["shift"] = acceptance_shift(spec, a.jobs)
        tables["retraining"] = retraining_table(spec, answer)
        for k, v in tables.items():
            if k != "plan":
                v.to_csv(out / f"{k}.csv", index=False)
    report = write_plan_report(spec, tables, out)
    print_ranked(answer)
    print(f"wrote {out / 'plan.csv'}, {report}")
    return 0


def print_ranked(df: pd.DataFrame) -> None:
    print(f"{'rank':>4} {'strategy':<24} {'gpu':<10} {'GPUs':>5} {'TTFT p99':>9} {'TPOT p99':>9} "
          f"{'$/month':>10} {'q in':>6} {'q tail':>6}  floor")
    for i, r in df.iterrows():
        if not r.feasible:
            print(f"{i + 1:>4} {r.strategy:<24} {r.gpu:<10}  infeasible: {r.get('reason', '')}")
            continue
        print(f"{i + 1:>4} {r.strategy:<24} {r.gpu:<10} {int(r.gpus):>5} {r.ttft_p99_s:>8.2f}s {r.tpot_p99_s * 1e3:>7.1f}ms "
              f"{r.total_usd_per_month:>10,.0f} {r.quality_in_distribution:>6.3f} {r.quality_tail:>6.3f}  "
              f"{'pass' if r.passes_quality_floor else 'FAIL'}")
