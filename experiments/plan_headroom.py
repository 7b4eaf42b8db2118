"""Capacity ladders and headroom: every searched configuration's capacity ladder per replica,
measured in parallel before the search, and the headroom of the leading racks after it (the
highest rate each still serves within the SLO, found by simulation)."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd

from experiments.plan_racks import configured, row_config, scenario_for
from experiments.plan_search import evaluate, grid, one_replica
from experiments.plan_spec import PlanSpec
from experiments.plan_store import STORE, ladder_of
from experiments.planfile import Strategy
from experiments.pool import pmap
from models.errors import ConfigError
from sim.capacity import Capacity, capacity_key
from sim.deployment import gpus_per_replica
from sim.scenario import Scenario

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
        sc = scenario_for(spec.base, s, gpu, spec.prices, replicas, r, tu, traffic=spec.traffic)
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


def measure_ladders(ones: list[Scenario], points: str | None, jobs: int | None, label: str = "") -> None:
    """These one-replica deployments' capacity ladders (each deployment once, in the order
    given), measured in `jobs` processes and kept in this process's cache: the pools forked
    after it inherit them (in OUT/points too, with `points`)."""
    todo: dict[str, Scenario] = {}
    for one in ones:
        todo.setdefault(capacity_key(one, speculative=True), one)
    for key, cap in pmap(_ladder_task, [(one, points) for one in todo.values()], jobs, label):
        STORE.remember(key, cap, is_ladder=True)


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
                    one = one_replica(spec, configured(s, spec.base, cfg), g, spec.rate_rps)
                except ConfigError:
                    continue
                per = gpus_per_replica(one)
                if spec.search.gpus_per_node is not None and per > spec.search.gpus_per_node:
                    continue
                ones.append(one)
    # the longest first (speculation measures more populations; fewer GPUs a replica, more steps a second)
    ones.sort(key=lambda sc: (sc.speculative is None, gpus_per_replica(sc)))
    measure_ladders(ones, spec.points, jobs, label)


def _headroom_rows(ranked: pd.DataFrame) -> pd.DataFrame:
    """The leading HEADROOM_TOP passing options, whose racks' headroom is measured."""
    if "feasible" not in ranked:
        return ranked.iloc[:0]
    ok = ranked.feasible.astype(bool)
    if "layout" in ranked:  # a disaggregated rack's headroom is not searched (experiments.plan_disagg)
        ok &= ranked.layout.fillna("aggregated") == "aggregated"
    return ranked[ok].head(HEADROOM_TOP)


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
