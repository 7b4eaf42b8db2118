"""Capacity planning: for a traffic, an SLO and candidate strategies, the smallest rack that
meets the SLO, found by search with the simulator (never by extrapolation), its monthly cost
(serving plus amortised retraining) and its quality, plus the analyses around it.

The rooms, in the order they build on each other: `planfile` reads the file's tables,
`plan_racks` builds a strategy's scenario on a rack, `plan_day` reads and runs [day],
`plan_spec` holds the validated plan, `plan_search` judges racks and searches for the
smallest (its docstring tells how), `plan_headroom` measures capacity ladders and headroom,
`plan_studies` runs the analyses, `plan_report` draws them. This module composes them:
`load_plan` (the file to a checked `PlanSpec`) and `run_search` / `run_plan` / `run_tables`
(the plan's tables)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pandas as pd

from experiments.plan_cost import parse_cost
from experiments.plan_day import DaySpec, day_traffic, parse_day
from experiments.plan_disagg import search_layouts
from experiments.plan_headroom import add_headroom, headroom, headroom_tasks, measure_capacities, measure_ladders
from experiments.plan_miss import another_gpu
from experiments.plan_racks import scenario_for
from experiments.plan_search import pareto, plan_row, rank
from experiments.plan_spec import PlanSpec
from experiments.plan_store import ladder_of
from experiments.plan_studies import (
    base_capacity,
    curve_tasks,
    curves_table,
    map_cell,
    map_table,
    map_tasks,
    plan_acceptance,
    retraining_table,
    sensitivity_table,
    sensitivity_tasks,
    shift_cell,
    shift_table,
    shift_tasks,
    winners,
)
from experiments.planfile import (
    QUICK_SECTIONS,
    TABLE_KEYS,
    TOP_KEYS,
    Strategy,
    Traffic,
    check_keys,
    measured_requests,
    near,
    num,
    nums,
    parse_search,
    parse_strategies,
    positive,
    resolve_traffic,
    string,
    strings,
    table,
)
from experiments.pool import call, pmap
from models.catalog import GPUS, get_gpu
from models.errors import ConfigError
from sim.deployment import gpus_per_replica
from sim.scenario import Scenario, gpu_name, load_scenario, read_toml

MIN_JUDGED = 500  # fewer measured requests than this make a p99 too noisy to buy hardware on
MAX_RATE_SHIFT = 0.10  # --quick may not move the simulated rate further than this from the plan's


def load_plan(path: str | Path, quick: bool = False, points: str | Path | None = None,
              jobs: int | None = 1) -> PlanSpec:
    """Read and validate a plan file; one-line ConfigErrors name the field and the fix. `points`:
    a folder keeping every finished simulation, so that a rerun resumes (see plan_store). `jobs`:
    processes for the capacity ladders the reachability check measures (None: one per CPU)."""
    pts = None if points is None else str(points)
    p = Path(path)
    d, full, q_tab, base_path = _tables(p, quick)
    search, q, a = d["search"], d["quality"], d["analyses"]
    day, tr, dur, warm = _traffic(d, full, p, quick and bool(q_tab))
    base = _base(d, p, base_path, tr, dur, warm)
    gpus = tuple(gpu_name(g) for g in strings(search, "gpus", "search", [base.rack.gpu]))
    prices = _prices(search, gpus)
    max_gpus = int(num(search, "max_gpus", "search", 64, lo=1, integer=True))
    seeds = _seeds(search)
    strategies = parse_strategies(d)
    not_applicable = _applicability(p.name, base, strategies, gpus, prices, tr)
    search_spec = parse_search(search)
    if base.disaggregation is not None:
        raise ConfigError(f"{p.name}: base: the plan sizes its racks itself; remove [disaggregation] from the base "
                          "scenario and set search.layouts = ['aggregated', 'disaggregated']")
    if "disaggregated" in search_spec.layouts and (tr.kind != "rate" or day is not None):
        raise ConfigError("search.layouts: the disaggregated layout is searched for a constant rate only (traffic.rate_rps, "
                          "no [day]); set search.layouts = ['aggregated'] or use traffic.rate_rps")
    # (a disaggregated rack's decode pool may carry more per GPU than an aggregated one: no refusal then)
    _check_reachable(p.name, base, strategies, gpus, prices, tr.headline_rps,
                     max_gpus if search_spec.layouts == ("aggregated",) else 10**9, not_applicable, pts, jobs)
    floor = num(q, "floor_tail", "quality", 0.0, lo=0, hi=1)
    cost = parse_cost(d["cost"], gpus, search_spec.gpus_per_node)
    expected = measured_requests(tr, base.workload.duration_s, warm)
    warnings: list[str] = []
    if expected < MIN_JUDGED:
        warnings.append(f"WARNING: each run measures only ~{expected} requests (< {MIN_JUDGED}): its p99 rests on "
                        f"~{max(expected // 100, 0)} requests{'; --quick shortened it' if quick else ''}; "
                        "lengthen the run (search.duration_s or traffic.window) before buying on it")
    return PlanSpec(
        name=string(d, "name", "", p.stem), base=base, rate_rps=tr.headline_rps, strategies=tuple(strategies), gpus=gpus,
        prices=prices, max_gpus=max_gpus, seeds=tuple(seeds), quality_floor_tail=floor,
        teacher_updates_per_month=num(q, "teacher_updates_per_month", "quality", 1.0, lo=0),
        curve_multipliers=nums(a, "curve_multipliers", [0.25, 0.5, 1.0, 2.0, 4.0], lo=0, lo_open=True),
        map_utilisation=nums(a, "map_utilisation", [0.3, 0.5, 0.7, 0.85], lo=0, lo_open=True, hi=5),
        map_acceptance=nums(a, "map_acceptance", [0.4, 0.6, 0.8], lo=0, hi=0.999),
        shift_tail_shares=nums(a, "shift_tail_shares", [0.0, 0.2, 0.4, 0.6], lo=0, hi=0.999),
        shift_utilisation=num(a, "shift_utilisation", "analyses", 0.5, lo=0, lo_open=True, hi=5),
        traffic=tr, not_applicable=not_applicable, expected_requests=expected, warnings=tuple(warnings),
        search=search_spec, cost=cost, day=day, points=pts,
    )


def _tables(p: Path, quick: bool) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], str]:
    """The plan file's tables, keys checked: (as simulated, with [quick] applied when `quick`; as
    written; the [quick] table; the base scenario's path as written)."""
    d = read_toml(p, "plan")
    check_keys(d, p.name, TOP_KEYS)
    if "base" not in d:
        raise ConfigError(f"{p.name}: missing 'base' (a scenario file giving the traffic mix and deployment defaults)")
    base_path = string(d, "base", "")
    if "name" in d:
        string(d, "name", "")
    for section in (*TABLE_KEYS, "base_set"):
        d[section] = dict(table(d, section))
        if section in TABLE_KEYS:
            check_keys(d[section], section, TABLE_KEYS[section])
    q_tab = table(d, "quick")
    check_keys(q_tab, "quick", QUICK_SECTIONS)
    full = {k: dict(v) if isinstance(v, dict) else v for k, v in d.items()}
    for section in q_tab:
        values = table(q_tab, section, "quick.")
        check_keys(values, f"quick.{section}", TABLE_KEYS[section])
        if quick:
            if section == "traffic" and ("window" in values or "start_s" in values or "end_s" in values):
                for k in ("window", "start_s", "end_s"):
                    d["traffic"].pop(k, None)
            if section == "search" and values.get("configurations") is False:  # a quick plan may skip the grid
                for k in ("tp", "max_num_batched_tokens", "max_num_seqs", "k"):
                    d["search"].pop(k, None)
            d[section].update(values)
    return d, full, q_tab, base_path


def _traffic(d: dict[str, Any], full: dict[str, Any], p: Path,
             quick: bool) -> tuple[DaySpec | None, Traffic, float, float]:
    """([day], the traffic, the run's duration and warm-up); with `quick` (a [quick] table
    applied), a quick traffic that moves the plan's rate by more than MAX_RATE_SHIFT is refused."""
    day = parse_day(d, p.parent)  # [day]: the fixed rack is sized for the day's peak (experiments/plan_day.py)
    if day is not None:
        d["traffic"] = day_traffic(d["traffic"], day)
        full_day = parse_day(full, p.parent)
        assert full_day is not None
        full["traffic"] = day_traffic(full["traffic"], full_day)
    tr, dur, warm = resolve_traffic(d, p)
    if quick:  # the quick plan must still judge the plan's traffic
        full_tr, _, _ = resolve_traffic(full, p)
        shift = tr.headline_rps / full_tr.headline_rps - 1.0
        if abs(shift) > MAX_RATE_SHIFT:
            raise ConfigError(f"--quick would simulate {tr.headline_rps:.2f} req/s ({tr.window or 'rate'}) against the plan's "
                              f"{full_tr.headline_rps:.2f} req/s ({full_tr.window or 'rate'}), {100 * shift:+.0f}% "
                              f"(more than {100 * MAX_RATE_SHIFT:.0f}%); fix [quick] traffic or run without --quick")
    return day, tr, dur, warm


def _base(d: dict[str, Any], p: Path, base_path: str, tr: Traffic, dur: float, warm: float) -> Scenario:
    """The base scenario with base_set, the run length, the plan's [slo], the training GPU and
    the traffic applied."""
    q = d["quality"]
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
            positive(slo, key, "slo")
        base = base.with_overrides({"slo": dict(slo)})
    # retraining runs on its own training GPU, priced apart from the serving rack
    train: dict[str, Any] = {}
    if "training_gpu" in q:
        train["deployment.distillation.training_gpu"] = gpu_name(string(q, "training_gpu", "quality."))
    if "training_usd_per_gpu_hour" in q:
        train["deployment.distillation.training_usd_per_gpu_hour"] = positive(q, "training_usd_per_gpu_hour", "quality")
    base = base.with_overrides({**train, **tr.overrides(tr.headline_rps)})
    return base


def _prices(search: dict[str, Any], gpus: tuple[str, ...]) -> dict[str, float]:
    """search.usd_per_gpu_hour, checked: a price per searched GPU type (lower case)."""
    prices_in = search.get("usd_per_gpu_hour", {})
    if not isinstance(prices_in, dict):
        raise ConfigError(f"search.usd_per_gpu_hour: must be a table of prices by GPU, e.g. {{ {gpus[0]} = 2.5 }}, got {prices_in!r}")
    prices = {}
    for g in prices_in:
        if g.lower() not in gpus:
            raise ConfigError(f"search.usd_per_gpu_hour.{g}: prices a GPU not in search.gpus ({', '.join(gpus)})"
                              f"{near(g, gpus)}; add it to search.gpus or remove the price")
        prices[g.lower()] = positive(prices_in, g, "search.usd_per_gpu_hour")
    return prices


def _seeds(search: dict[str, Any]) -> list[int]:
    """search.seeds, checked: distinct integers >= 0."""
    seeds = search.get("seeds", [1])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in seeds):
        raise ConfigError(f"search.seeds: must be a non-empty list of integers >= 0, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"search.seeds: lists a seed twice: {seeds!r}")
    return seeds


def _applicability(name: str, base: Scenario, strategies: list[Strategy], gpus: tuple[str, ...],
                   prices: dict[str, float], tr: Traffic) -> dict[tuple[str, str], str]:
    """(strategy, gpu) pairs that cannot run (fp8 weights without FP8 tensor cores, a model that
    does not fit), with the reason. A strategy that runs on no GPU of the catalogue (a typo in
    its overrides, an impossible combination) is an error of the plan file."""
    bad: dict[tuple[str, str], str] = {}
    for s in strategies:
        for g in gpus:
            try:
                scenario_for(base, s, g, prices, 1, tr.headline_rps, traffic=tr)
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
            scenario_for(base, s, g, {}, 1, tr.headline_rps, traffic=tr)
            return True
        except ConfigError:
            continue
    return False


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
            one = scenario_for(base, s, g, prices, 1, None)
            per = gpus_per_replica(one)
            if per <= max_gpus:
                ones.append((one, per))
    measure_ladders([one for one, _ in ones], points, jobs)
    best = 0.0
    for one, per in ones:
        best = max(best, ladder_of(one, points, speculative=True).rps * (max_gpus // per))  # (an upper bound)
    if rate > best:
        raise ConfigError(f"{name}: traffic {rate:.1f} req/s exceeds what {max_gpus} GPUs can serve with any strategy "
                          f"(at most {best:.1f} req/s at saturation); raise search.max_gpus or lower traffic.rate_rps")


def run_search(spec: PlanSpec, jobs: int | None = None, prune: bool = True,
               label: str = "", with_headroom: bool = True) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(the ranked planning table: one row per strategy x GPU type at the plan's traffic, its
    cheapest passing configuration, with the leading options' headroom unless `with_headroom` is
    off (`run_tables` measures it beside the analyses); every configuration searched, with
    `pareto`)."""
    ranked, configs, _ = _search(spec, jobs, prune, label, with_headroom)
    return ranked, configs


def _search(spec: PlanSpec, jobs: int | None, prune: bool, label: str, with_headroom: bool,
            side: Callable[[], list[tuple[Any, tuple[Any, ...]]] | None] | None = None
            ) -> tuple[pd.DataFrame, pd.DataFrame, list[Any] | None]:
    """`run_search`, and the results of `side()`'s (function, arguments) tasks (None when there
    is no side, or it returns None), which need the capacities but not the search: they run in
    the search's pool after its tasks, so they keep a worker busy while the longest searches finish."""
    measure_capacities(spec, jobs, "capacities" if label else "")
    tasks = [(search_layouts, (spec, s, g, spec.rate_rps, prune)) for g in spec.gpus for s in spec.strategies]
    side_tasks = side() if side is not None else None
    extra = side_tasks or []
    if label and extra:
        label = f"{label} and {len(extra)} runs besides"
    done = pmap(call, [*tasks, *extra], jobs, label)
    found = done[:len(tasks)]
    configs = pd.DataFrame([c for f in found for c in f["configs"]])
    if len(configs):
        configs["cost_mode"] = spec.cost.mode
        configs["pareto"] = pareto(configs)
    ranked = another_gpu(rank(pd.DataFrame([f["row"] for f in found])))
    if with_headroom:
        htasks = headroom_tasks(spec, ranked)
        add_headroom(ranked, pmap(headroom, htasks, jobs, "headroom" if label and htasks else ""))
    return ranked, configs, None if side_tasks is None else done[len(tasks):]


def run_plan(spec: PlanSpec, jobs: int | None = None) -> pd.DataFrame:
    """The ranked planning table (see run_search)."""
    return run_search(spec, jobs)[0]


def run_tables(spec: PlanSpec, jobs: int | None = None, analyses: bool = True) -> dict[str, pd.DataFrame]:
    """Every table of a plan by name: plan, configs and, with the analyses, curves, map_cells,
    map, shift, retraining and sensitivity (what `specrack plan` writes as <name>.csv)."""
    label = f"search ({len(spec.strategies) * len(spec.gpus)} strategy x GPU)"
    # the acceptance shift needs no search: its runs go in the search's pool, after its tasks (where
    # it cannot be set up, the analyses set it up again and say why, if they run)
    def shift_side() -> list[tuple[Any, tuple[Any, ...]]] | None:
        try:
            return [(shift_cell, t) for t in shift_tasks(spec)]
        except ConfigError:
            return None

    answer, configs, shifted = _search(spec, jobs, True, label, not analyses, shift_side if analyses else None)
    tables = {"plan": answer, "configs": configs}
    if analyses and "feasible" in answer and not answer.feasible.astype(bool).any():
        # nothing passes: every analysis compares passing racks, so each would come back empty
        if spec.progress:
            print("analyses skipped: no option has a passing rack (each one's miss and fix are in the plan table)",
                  file=sys.stderr)
        analyses = False
    if analyses:
        # the headroom and every analysis in one pool, the longest tasks first: no worker idles
        # at the end of one analysis while another's tasks wait
        cell_tasks, layout = map_tasks(spec, answer=answer)
        parts = {"headroom": (headroom, headroom_tasks(spec, answer)), "map": (map_cell, cell_tasks),
                 "curves": (plan_row, curve_tasks(spec, answer)), "sensitivity": (plan_row, sensitivity_tasks(spec, answer)),
                 "shift": (shift_cell, shift_tasks(spec) if shifted is None else [])}
        flat = [(name, fn, args) for name, (fn, tasks) in parts.items() for args in tasks]
        done = pmap(call, [(fn, args) for _, fn, args in flat], jobs,
                    f"headroom and analyses ({len(flat)} searches and runs)" if spec.progress else "")
        found: dict[str, list[Any]] = {name: [] for name in parts}
        for (name, _, _), res in zip(flat, done, strict=True):
            found[name].append(res)
        if shifted is not None:
            found["shift"] = shifted
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
