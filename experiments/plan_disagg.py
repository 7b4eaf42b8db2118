"""The planner's disaggregated layout (`[search] layouts = ["aggregated", "disaggregated"]`): per
strategy and GPU type, racks of P prefill replicas and D decode replicas (sim/disagg.py; the
decode pool carries the strategy's speculation), each pool at its own tensor parallelism, judged
by the same long runs as the aggregated racks (`plan_search.evaluate`: stable and every SLO target
met on every seed), and the cheapest passing one set against the aggregated search's answer.

Configurations: the decode pool's as the aggregated grid (TP, max_num_seqs, k; its chunk budget is
the strategy's own: a decode replica's steps carry one prompt token per admitted request), times
the prefill pool's TP (search.tp, else every degree of TP_DEGREES that fits; with configurations =
false the decode pool's own). Both pools run on the GPU type being searched.

Pruning (no disaggregated capacity is measured; `sim.capacity.measure_ladder` refuses one). The
pools run one after the other (sim/disagg.py): the prefill pool is exactly an aggregated rack of P
prefill replicas serving the traffic with one output token per request, and the decode pool an
aggregated rack of D replicas serving it with each prompt's KV preloaded. So:
  * P > rate / Cp, Cp the capacity (closed-loop peak) of one prefill replica on the prefill-only
    work (the plan's traffic with one output token): the same rule the aggregated search keeps,
    a rack offered its capacity or more fails;
  * D > rate / Cd, Cd the capacity of one decode replica on the traffic with one-token prompts:
    an upper bound on its capacity for the real decode work (the same requests and outputs, whose
    steps attend over the preloaded prompts and hold their KV: never faster, never more
    sequences), so the bound removes only racks whose decode pool is offered at least its
    capacity;
  * min_replicas applies to each pool.
A configuration whose smallest such rack exceeds max_gpus, or costs more than the best passing
rack so far (aggregated or disaggregated), is not simulated.

The search within a configuration (racks pass monotonely in P and in D, as the aggregated search
assumes in replicas): for P = P_lb, P_lb + 1, ..., the fewest decode replicas that pass (doubling
from D_lb, then bisection, each below the fewest that passed with one prefill replica fewer); it
stops once P prefill replicas with D_lb decode replicas cost more than the best passing rack, once
they exceed max_gpus, or once one more prefill replica no longer brings the largest rack tried
closer to passing (its binding miss ratio does not fall: more prefill replicas do not help).
Judged runs: with the bottleneck pool's capacity min(P Cp, D Cd) as the rack's capacity (its run
length by relaxation time, and offered >= it fails unrun); Cd being an upper bound, such a run may
be shorter than the aggregated rule would ask of a rack of that true capacity.

Not searched: n+1 redundancy and max_utilisation (refused with the layout), trace and [day]
traffic (refused), another GPU type for the prefill pool, the link (the scenario's default,
InfiniBand NDR) and draft_prefill (transfer). The analyses (headroom, curves, sensitivity, the
decision map) stay aggregated; a disaggregated answer is reported without them."""

from __future__ import annotations

import math
from typing import Any, cast

from experiments.plan_cost import monthly_cost
from experiments.plan_miss import closest_columns, rejection_columns
from experiments.plan_racks import config_of, configured, scenario_for
from experiments.plan_search import _cost_key, binding, evaluate, grid, one_replica, run_columns, search_row
from experiments.plan_spec import PlanSpec
from experiments.plan_store import ladder_of
from experiments.planfile import TP_DEGREES, Strategy
from models.catalog import get_gpu
from models.engines import resolve
from models.errors import ConfigError
from sim.deployment import gpus_per_replica, prefill_pool
from sim.scenario import Scenario

ONE_TOKEN = {"dist": "fixed", "value": 1}


def label(p: int, d: int, ptp: int, dtp: int) -> str:
    """plan.csv's layout of a disaggregated rack: '1P:2D TP4/TP4' (prefill TP / decode TP)."""
    return f"{p}P:{d}D TP{ptp}/TP{dtp}"


def disagg_scenario(spec: PlanSpec, s: Strategy, gpu: str, p: int, d: int, ptp: int, rate: float,
                    tu: float | None = None) -> Scenario:
    """The strategy's decode pool of `d` replicas on this GPU type, with `p` prefill replicas at TP `ptp`."""
    sc = scenario_for(spec.base, s, gpu, spec.prices, d, rate, tu, traffic=spec.traffic)
    return sc.with_overrides({"disaggregation": {"prefill_replicas": p, "prefill_tensor_parallel": ptp,
                                                 "prefill_gpu": gpu}})


def prefill_only(sc: Scenario) -> Scenario:
    """One prefill replica of a disaggregated rack as an aggregated scenario, serving the traffic
    with one output token each (what its pool runs: sim/disagg.py)."""
    psc = cast(Scenario, prefill_pool(sc))
    return psc.with_overrides({"rack.num_gpus": gpus_per_replica(psc), "workload.output_tokens": ONE_TOKEN})


def decode_bound(sc: Scenario) -> Scenario:
    """One decode replica serving the traffic with one-token prompts (an upper bound on its
    capacity for the real decode work: see the module docstring)."""
    return sc.with_overrides({"disaggregation": None, "rack.num_gpus": gpus_per_replica(sc),
                              "workload.prompt_tokens": ONE_TOKEN})


def _pool_cost(spec: PlanSpec, gpu: str, price: float, p: int, per_p: int, d: int, per_d: int,
               busy: float) -> dict[str, Any]:
    """The monthly cost split of both pools (each on whole nodes of its own when gpus_per_node)."""
    a = monthly_cost(spec.cost, gpu, price, p, per_p, spec.search.gpus_per_node, busy)
    b = monthly_cost(spec.cost, gpu, price, d, per_d, spec.search.gpus_per_node, busy)
    out: dict[str, Any] = {"cost_mode": a["cost_mode"]}
    for k in ("nodes", "billed_gpus", "serving_usd_per_month", "power_usd_per_month"):
        out[k] = a[k] + b[k]  # type: ignore[operator]
    return out


def _usd(c: dict[str, Any]) -> float:
    return float(c["serving_usd_per_month"]) + float(c["power_usd_per_month"])


def candidates(spec: PlanSpec, s: Strategy, gpu: str, rate: float) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(configurations not simulated: not applicable or pruned; candidates, each with its bounds)."""
    rules = spec.search
    skipped: list[dict[str, Any]] = []
    cands: list[dict[str, Any]] = []
    seen: set[tuple[Any, ...]] = set()
    for cfg in grid(spec, s, gpu, rate):
        cfg = {**cfg, "max_num_batched_tokens": None}  # the strategy's own chunk budget (decode steps carry one token each)
        key = tuple(sorted(cfg.items()))
        if key in seen:
            continue
        seen.add(key)
        sc_s = configured(s, spec.base, cfg)
        try:
            own_tp = one_replica(spec, sc_s, gpu, rate).deployment.tensor_parallel
        except ConfigError as err:
            skipped.append({"strategy": s.name, "gpu": gpu, "layout": "disaggregated", **cfg,
                            "status": "not applicable", "reason": str(err)})
            continue
        ptps = (own_tp,) if not rules.configurations else (rules.tp or TP_DEGREES)
        for ptp in ptps:
            row: dict[str, Any] = {"strategy": s.name, "gpu": gpu, "layout": "disaggregated", **cfg, "prefill_tp": ptp}
            try:
                one = disagg_scenario(spec, sc_s, gpu, 1, 1, ptp, rate)
                pre = prefill_only(one)
            except ConfigError as err:
                skipped.append({**row, "status": "not applicable", "reason": str(err)})
                continue
            row.update(config_of(one))
            per_d, per_p = gpus_per_replica(one), gpus_per_replica(pre)
            gpn = rules.gpus_per_node
            if gpn is not None and max(per_d, per_p) > gpn:
                skipped.append({**row, "status": "not applicable",
                                "reason": f"a replica of {max(per_d, per_p)} GPUs straddles nodes of {gpn}"})
                continue
            cp = ladder_of(pre, spec.points, speculative=True).rps
            cd = ladder_of(decode_bound(one), spec.points, speculative=True).rps
            p_lb = max(rules.min_replicas, math.floor(rate / cp + 1e-9) + 1)
            d_lb = max(rules.min_replicas, math.floor(rate / cd + 1e-9) + 1)
            price = one.rack.usd_per_gpu_hour if one.rack.usd_per_gpu_hour is not None else get_gpu(gpu).usd_per_gpu_hour
            lb_usd = _usd(_pool_cost(spec, gpu, price, p_lb, per_p, d_lb, per_d, 0.0))
            row.update(gpus_per_replica=per_d, prefill_gpus_per_replica=per_p, prefill_capacity_per_replica_rps=cp,
                       decode_capacity_bound_rps=cd, lower_bound_replicas=p_lb + d_lb,
                       lower_bound_usd_per_month=lb_usd, layout=label(p_lb, d_lb, ptp, int(row["tp"])))
            if p_lb * per_p + d_lb * per_d > spec.max_gpus:
                skipped.append({**row, "status": "pruned",
                                "reason": f"needs >= {p_lb} prefill replicas ({cp:.2f} req/s each) and >= {d_lb} decode "
                                          f"replicas (<= {cd:.2f} req/s each) = {p_lb * per_p + d_lb * per_d} GPUs > "
                                          f"max_gpus {spec.max_gpus} to reach {rate:.2f} req/s"})
                continue
            cands.append({"row": row, "strategy": sc_s, "one": one, "price": price, "per_p": per_p, "per_d": per_d,
                          "cp": cp, "cd": cd, "p_lb": p_lb, "d_lb": d_lb, "lb_usd": lb_usd})
    cands.sort(key=lambda c: (c["lb_usd"], c["per_p"] + c["per_d"]))
    return skipped, cands


def min_pools(spec: PlanSpec, c: dict[str, Any], gpu: str, rate: float, best_usd: float) -> dict[str, Any]:
    """The cheapest passing (P, D) of one configuration (see the module docstring), or the closest rack."""
    s, ptp, per_p, per_d = c["strategy"], int(c["row"]["prefill_tp"]), c["per_p"], c["per_d"]
    cache: dict[tuple[int, int], dict[str, Any]] = {}

    def ev(p: int, d: int) -> dict[str, Any]:
        if (p, d) not in cache:
            sc = disagg_scenario(spec, s, gpu, p, d, ptp, rate, spec.teacher_updates_per_month)
            cache[(p, d)] = evaluate(sc, spec.seeds, spec.points, min(p * c["cp"], d * c["cd"]), stop_on_fail=False)
        return cache[(p, d)]

    def usd(p: int, d: int) -> float:
        return _usd(_pool_cost(spec, gpu, c["price"], p, per_p, d, per_d, 0.0))

    best: tuple[int, int] | None = None
    closest: tuple[int, int] | None = None
    last_miss = math.inf
    d_top: int | None = None  # fewer decode replicas than this failed with fewer prefill replicas... (passes at d_top)
    p = c["p_lb"]
    while True:
        bound = min(best_usd, usd(*best) if best else math.inf)
        d_lb = c["d_lb"]
        d_max = (spec.max_gpus - p * per_p) // per_d
        if d_max < d_lb or usd(p, d_lb) > bound:
            break
        hi_cap = d_max if d_top is None else min(d_max, d_top - 1)
        while hi_cap >= d_lb and usd(p, hi_cap) > bound:  # (a rack costing more than the best passing one)
            hi_cap -= 1
        if hi_cap < d_lb:
            break
        lo, hi = d_lb - 1, d_lb
        while not ev(p, hi)["meets_slo"]:
            lo = hi
            if hi >= hi_cap:
                break
            hi = min(hi_cap, hi * 2)
        if ev(p, hi)["meets_slo"]:
            while lo < hi - 1:
                mid = (lo + hi) // 2
                if ev(p, mid)["meets_slo"]:
                    hi = mid
                else:
                    lo = mid
            d_top = hi
            if best is None or usd(p, hi) < usd(*best):
                best = (p, hi)
        else:
            sm = ev(p, hi).get("summary")
            miss = binding(sm)[1] if sm is not None else math.inf
            if closest is None or miss < last_miss:
                closest = (p, hi)
            if d_top is None and not miss < last_miss:
                break  # one more prefill replica did not bring the largest rack closer
            last_miss = miss
        p += 1
    return {"best": best, "closest": closest, "cache": cache}


def disagg_row(spec: PlanSpec, c: dict[str, Any], gpu: str, rate: float, found: dict[str, Any]) -> dict[str, Any]:
    """The configuration's row in configs.csv and, when it passes, plan.csv (`run_columns`)."""
    row = dict(c["row"])
    row["evaluations"] = len(found["cache"])
    s = c["strategy"]
    engine = resolve(str(s.overrides.get("deployment.engine", spec.base.deployment.engine)))
    row.update(engine_profile=engine, rate_rps=rate)
    if found["best"] is None:
        row.update(feasible=False, status="fails")
        pd_ = found["closest"]
        if pd_ is None:
            row["reason"] = "no disaggregated rack within max_gpus below the best passing rack's cost"
            return row
        p, d = pd_
        ev = found["cache"][(p, d)]
        row["layout"] = label(p, d, int(row["prefill_tp"]), int(row["tp"]))
        row["reason"] = (f"SLO not met even with {p} prefill and {d} decode replicas (the largest rack tried: within "
                         "max_gpus and no dearer than the best passing rack)")
        miss = closest_columns(ev, rate=rate, cap_rps=None, per=c["per_d"], replicas=d, extra=0, max_gpus=spec.max_gpus)
        miss.update(closest_replicas=p + d, closest_gpus=p * c["per_p"] + d * c["per_d"])
        row.update(miss)
        if ev.get("summary") is not None:
            row.update(rejection_columns(ev["summary"], c["one"]))
        return row
    p, d = found["best"]
    sm = found["cache"][(p, d)]["summary"]
    row.update(layout=label(p, d, int(row["prefill_tp"]), int(row["tp"])), feasible=True, status="passes",
               prefill_replicas=p, decode_replicas=d, replicas=p + d, gpus=p * c["per_p"] + d * c["per_d"],
               redundancy="none", one_fewer_meets_slo=False, minimal_replicas=p + d,
               capacity_rps=min(p * c["cp"], d * c["cd"]))
    cost = _pool_cost(spec, gpu, sm["usd_per_gpu_hour"], p, c["per_p"], d, c["per_d"], sm["gpu_busy_fraction"])
    return run_columns(spec, row, sm, cost, c["one"])


def search_disaggregated(spec: PlanSpec, s: Strategy, gpu: str, rate: float, best: dict[str, Any] | None,
                         prune: bool = True) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(the cheapest passing disaggregated row, cheaper than `best` (the aggregated answer, or
    None); every disaggregated configuration tried)."""
    configs, cands = candidates(spec, s, gpu, rate)
    best_d: dict[str, Any] | None = None
    for c in cands:
        ref = [r for r in (best, best_d) if r is not None]
        best_usd = min((_usd(r) for r in ref), default=math.inf) if prune else math.inf
        if c["lb_usd"] > best_usd:
            configs.append({**c["row"], "status": "pruned",
                            "reason": f"its cheapest possible rack costs ${c['lb_usd']:,.0f}/month > the best passing "
                                      f"rack's ${best_usd:,.0f}"})
            continue
        row = disagg_row(spec, c, gpu, rate, min_pools(spec, c, gpu, rate, best_usd))
        configs.append(row)
        if row["feasible"] and (best_d is None or _cost_key(row) < _cost_key(best_d)):
            best_d = row
    return best_d, configs


def search_layouts(spec: PlanSpec, s: Strategy, gpu: str, rate: float, prune: bool = True) -> dict[str, Any]:
    """`plan_search.search_row` over the plan's layouts: the cheapest passing rack of a strategy on
    a GPU type, aggregated or disaggregated, and every configuration tried."""
    lays = spec.search.layouts
    found = search_row(spec, s, gpu, rate, prune) if "aggregated" in lays else {"row": None, "configs": []}
    if "disaggregated" not in lays:
        return found
    agg = found["row"]
    agg_ok = agg if agg is not None and agg.get("feasible") else None
    best_d, dconfigs = search_disaggregated(spec, s, gpu, rate, agg_ok, prune)
    configs = [*found["configs"], *dconfigs]
    counts = {"configurations_searched": len(configs),
              "configurations_simulated": sum(c["status"] in ("passes", "fails") for c in configs),
              "evaluations": sum(int(c.get("evaluations", 0) or 0) for c in configs)}
    if best_d is not None and (agg_ok is None or _cost_key(best_d)[0] < _cost_key(agg_ok)[0]):  # (a tie: aggregated)
        row = {k: v for k, v in best_d.items() if k != "status"}
    elif agg_ok is not None:
        row = agg_ok
    else:  # nothing passes: the closest of the aggregated answer and the disaggregated configurations
        tried = [c for c in dconfigs if c.get("miss_ratio") is not None and c["miss_ratio"] == c["miss_ratio"]]
        near = min(tried, key=lambda c: c["miss_ratio"], default=None)
        if agg is not None and (near is None or not (near["miss_ratio"] < (agg.get("miss_ratio") or math.inf))):
            row = agg
        elif near is not None:
            row = {k: v for k, v in near.items() if k != "status"}
        else:
            why = dconfigs[0].get("reason", "no configuration") if dconfigs else "no configuration"
            row = {"strategy": s.name, "gpu": gpu, "layout": "disaggregated", "rate_rps": rate, "feasible": False,
                   "reason": str(why)}
    return {"row": {**row, **counts}, "configs": configs}
