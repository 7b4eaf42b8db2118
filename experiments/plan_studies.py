"""The analyses around a plan's answer: capacity curves (GPUs and cost vs traffic), the decision
map (the cheapest strategy over utilisation x acceptance), sensitivity (acceptance, traffic
growth, GPU price), the acceptance shift from benchmark to production traffic and the retraining
obligation vs the teacher's update cadence. Each comes as tasks (the arguments of one function,
mapped in a pool) and a table built from their answers, so that `experiments.plan.run_tables`
runs them all in one pool; `capacity_curves`, `decision_map`, `sensitivity` and
`acceptance_shift` run one on its own."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pandas as pd

from experiments.plan_cost import monthly_cost
from experiments.plan_racks import at_rate, configured, on_base_rack, row_config, scenario_for
from experiments.plan_search import one_replica, plan_row
from experiments.plan_spec import PlanSpec
from experiments.plan_store import capacity_of, summary
from experiments.planfile import Strategy, Traffic
from experiments.pool import pmap
from models.errors import ConfigError
from sim.deployment import build_runtime
from sim.scenario import Scenario

CADENCES = {"never": 0.0, "quarterly": 1.0 / 3.0, "monthly": 1.0, "weekly": 52.0 / 12.0}


def capacity_curves(spec: PlanSpec, answer: pd.DataFrame, jobs: int | None = None) -> pd.DataFrame:
    """GPUs needed and monthly cost vs traffic (multiples of the plan's rate), per strategy."""
    tasks = curve_tasks(spec, answer)
    return curves_table(spec, pmap(plan_row, tasks, jobs, "capacity curves" if spec.progress else ""))


def curve_tasks(spec: PlanSpec, answer: pd.DataFrame) -> list[tuple[Any, ...]]:
    """`plan_row`'s arguments for each strategy's capacity curve."""
    tasks = []
    for g in spec.gpus:
        for s in spec.strategies:
            hit = answer[(answer.strategy == s.name) & (answer.gpu == g)]
            found = len(hit) and bool(hit.feasible.iloc[0]) and hit.iloc[0].get("layout", "aggregated") in ("aggregated", None)
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
    return map_table(layout, pmap(map_cell, tasks, jobs, "decision map" if spec.progress else ""))


def map_tasks(spec: PlanSpec, gpu: str | None = None,
              answer: pd.DataFrame | None = None) -> tuple[list[tuple[Any, ...]], list[tuple[float, int]]]:
    """`map_cell`'s arguments for the decision map's distinct searches, and the map's layout: for
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
        return one_replica(spec, s, gpu, rate).speculative is not None
    except ConfigError:
        return True


def map_table(layout: list[tuple[float, int]], found: list[dict[str, Any]]) -> pd.DataFrame:
    """The decision map's cells (`map_tasks`'s layout) from its searches' answers."""
    return pd.DataFrame([{**found[i], "acceptance": a} for a, i in layout])


def map_cell(spec: PlanSpec, name: str, s: Strategy, gpu: str, u: float, a: float, rate: float,
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
        row: dict[str, Any] = {"utilisation": u, "acceptance": a, "rate_rps": float(g.rate_rps.iloc[0])}
        if ok.empty:  # (a map where nothing passes has no cost column at all)
            out.append({**row, "winner": "none", "margin": float("nan"), "rack": "", "total_usd_per_month": float("nan"),
                        "runner_up": ""})
            continue
        ok = ok.sort_values(["total_usd_per_month", "gpus", "strategy"])
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
    found = pmap(plan_row, tasks, jobs, "sensitivity" if spec.progress else "") if tasks else []
    return sensitivity_table(spec, answer, found, curves)


def _sensitivity_options(answer: pd.DataFrame) -> pd.DataFrame:
    """The winner and the runner-up: the two cheapest passing options that keep the quality floor."""
    floor = answer["passes_quality_floor"].fillna(False).astype(bool) if "passes_quality_floor" in answer else True
    agg = answer.layout.fillna("aggregated") == "aggregated" if "layout" in answer else True  # (aggregated racks only)
    return answer[answer.feasible.astype(bool) & floor & agg].head(2)


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
    if not has_tail_split(spec.base):
        raise ConfigError("acceptance shift needs the base scenario to have an in-distribution class and a tail class (tail = true)")
    tasks = shift_tasks(spec)
    return shift_table(pmap(shift_cell, tasks, jobs, "acceptance shift" if spec.progress else ""))


def has_tail_split(base: Scenario) -> bool:
    """Whether the traffic has an in-distribution class and a tail class (what the acceptance
    shift varies the share of)."""
    classes = base.workload.classes
    return any(c.tail for c in classes) and any(not c.tail for c in classes)


def shift_tasks(spec: PlanSpec) -> list[tuple[Any, ...]]:
    """`shift_cell`'s arguments: each runnable strategy at each tail share (the first, the
    reference, at every share); none when the traffic has no tail class to shift (a plan then
    leaves the analysis out and says so: `has_tail_split`)."""
    base = spec.base
    if not has_tail_split(base):
        return []
    cap = capacity_of(base, spec.points)
    tail = [c for c in base.workload.classes if c.tail]
    head = [c for c in base.workload.classes if not c.tail]
    runnable = []  # strategies that run on the base rack's GPU
    for s in spec.strategies:
        try:
            on_base_rack(base, s)
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
    """`acceptance_shift`'s table from `shift_cell`'s answers (the first strategy is the reference)."""
    rows = pd.DataFrame(found, columns=["strategy", "tail_share", "tpot_mean_s", "acceptance_rate"])
    if not len(rows):
        return rows.assign(speedup=pd.Series(dtype=float))
    ref = rows[rows.strategy == rows.strategy.iloc[0]].set_index("tail_share").tpot_mean_s
    rows["speedup"] = rows.tail_share.map(ref) / rows.tpot_mean_s
    return rows


def shift_cell(base: Scenario, s: Strategy, classes: list[dict[str, Any]], rate: float, seeds: tuple[int, ...],
                share: float, traffic: Traffic | None = None, points: str | None = None) -> dict[str, Any]:
    sc = on_base_rack(base, s).with_overrides({"workload.classes": classes, **at_rate(traffic, rate)})
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
        sc = scenario_for(spec.base, s, r.gpu, spec.prices, int(r.replicas), spec.rate_rps, traffic=spec.traffic)
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
