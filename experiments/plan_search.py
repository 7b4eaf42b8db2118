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

import math
from typing import Any

import pandas as pd

from experiments.plan_cost import HOURS_PER_MONTH, monthly_cost
from experiments.plan_miss import (
    closest_columns,
    not_applicable_columns,
    pruned_columns,
    rack_rules_columns,
    rejection_columns,
)
from experiments.plan_racks import config_of, configured, scenario_for
from experiments.plan_spec import PlanSpec
from experiments.plan_store import capacity_of, ladder_of, summary
from experiments.planfile import DEFAULT_K, DEFAULT_MBT, TP_DEGREES, Strategy, Traffic
from models.catalog import get_gpu
from models.engines import resolve
from models.errors import ConfigError
from sim.capacity import Capacity
from sim.deployment import gpus_per_replica
from sim.metrics import relaxation_s
from sim.scenario import MAX_REQUESTS, Scenario

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
    worst = max(rows, key=lambda r: (not r["slo_met"], binding(r)[1]))
    return {"meets_slo": all(r["slo_met"] for r in rows), "summary": worst}


def binding(sm: dict[str, Any]) -> tuple[str, float]:
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
    per = gpus_per_replica(scenario_for(base, s, gpu, prices, 1, rate, traffic=traffic))
    max_rep = max_gpus // per
    if max_rep < 1:
        return {"feasible": False, "reason": f"one replica needs {per} GPUs > max_gpus {max_gpus}", "needs_gpus": per}
    if floor > max_rep:
        return {"feasible": False, "reason": f"the rack rules need >= {floor} replicas = {floor * per} GPUs > max_gpus {max_gpus}",
                "needs_gpus": floor * per}
    cache: dict[int, dict[str, Any]] = {}

    def ok(r: int) -> bool:
        if r not in cache:
            cache[r] = evaluate(scenario_for(base, s, gpu, prices, r, rate, teacher_updates, traffic=traffic), seeds, points,
                                None if cap_rps is None else r * cap_rps)
        return cache[r]["meets_slo"]

    lo, hi = floor - 1, max(floor, min(start, max_rep))  # lo fails (or is not allowed), hi to be tested
    while not ok(hi):
        lo = hi
        if hi == max_rep:  # (the largest rack allowed: the closest to passing)
            return {"feasible": False, "reason": f"SLO not met even with {max_rep * per} GPUs (max_gpus)",
                    "evaluations": len(cache), "closest": cache[hi], "closest_replicas": hi, "gpus_per_replica": per}
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


def one_replica(spec: PlanSpec, s: Strategy, gpu: str, rate: float) -> Scenario:
    return scenario_for(spec.base, s, gpu, spec.prices, 1, rate, traffic=spec.traffic)


def replica_bounds(spec: PlanSpec, cap_rps: float, rate: float) -> tuple[int, int]:
    """(floor, lower bound) on the minimal passing replica count before n+1: the floor is what the
    rules demand (min_replicas, max_utilisation), the bound adds the capacity's: no rack carries
    its capacity or more (r replicas need r x capacity > rate; `evaluate` fails the others unrun)."""
    floor = spec.search.min_replicas
    if spec.search.max_utilisation is not None:
        floor = max(floor, math.ceil(rate / (spec.search.max_utilisation * cap_rps) - 1e-9))
    return floor, max(floor, math.floor(rate / cap_rps + 1e-9) + 1)


def plan_row(spec: PlanSpec, s: Strategy, gpu: str, rate: float, start: int = 1,
             teacher_updates: float | None = None, *, cap_rps: float | None = None,
             explain: bool = False) -> dict[str, Any]:
    """The planning answer for one strategy (one configuration) on one GPU type at one traffic
    rate, keeping the plan's rack rules (min_replicas, max_utilisation, n+1, whole nodes). With
    `explain`, a row with no passing rack keeps what `explained` needs to tell its closest rack,
    what binds there, how far it misses and the cheapest change (under the key '_explain')."""
    tu = spec.teacher_updates_per_month if teacher_updates is None else teacher_updates
    engine = resolve(str(s.overrides.get("deployment.engine", spec.base.deployment.engine)))
    row: dict[str, Any] = {"strategy": s.name, "gpu": gpu, "engine_profile": engine, "rate_rps": rate}
    why = spec.not_applicable.get((s.name, gpu)) if not spec.search.configurations else None
    if why is None:
        try:
            one = one_replica(spec, s, gpu, rate)
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
        if explain:
            row["_explain"] = (r, per, cap_rps, extra, tu)
        return row
    sm, replicas = r["summary"], r["replicas"]
    row["minimal_replicas"] = replicas
    if extra:  # n+1: the rack that meets the SLO with one replica down; its own run is reported
        replicas += 1
        ev = evaluate(scenario_for(spec.base, s, gpu, spec.prices, replicas, rate, tu, traffic=spec.traffic), spec.seeds,
                      spec.points, replicas * cap_rps, stop_on_fail=False)  # (its summary is reported, pass or fail)
        sm = ev["summary"]
        row["evaluations"] += 1
    price = sm["usd_per_gpu_hour"]
    row.update(
        layout="aggregated",
        replicas=replicas, gpus=replicas * per, gpus_per_replica=per, redundancy=rules.redundancy,
        one_fewer_meets_slo=True if extra else r["one_fewer_meets_slo"])
    if cap_rps is not None:
        row.update(capacity_per_replica_rps=cap_rps, capacity_rps=cap_rps * replicas,
                   utilisation=rate / (cap_rps * replicas))
    cost = monthly_cost(spec.cost, gpu, price, replicas, per, rules.gpus_per_node, sm["gpu_busy_fraction"])
    return run_columns(spec, row, sm, cost, one)


def run_columns(spec: PlanSpec, row: dict[str, Any], sm: dict[str, Any], cost: dict[str, Any],
                one: Scenario) -> dict[str, Any]:
    """A passing rack's row completed from its judged run `sm` and its monthly cost split `cost`
    (`monthly_cost`): the run's figures, every SLO check, the totals and the rejected requests."""
    row.update(
        simulated_rate_rps=sm["offered_rps"], judged_requests=sm["judged_requests"], itl_samples=sm["itl_samples"],
        run_warmup_s=sm.get("run_warmup_s"), run_window_s=sm.get("run_window_s"),
        verdict=sm["verdict"],
        ttft_p50_s=sm["ttft_s"]["p50"], tpot_p50_s=sm["tpot_s"]["p50"], itl_p50_s=sm["itl_s"]["p50"],
        ttft_p99_s=sm["ttft_s"]["p99"], tpot_p99_s=sm["tpot_s"]["p99"], itl_p99_s=sm["itl_s"]["p99"],
        tpot_mean_s=sm["tpot_s"]["mean"], e2e_p99_s=sm["e2e_s"]["p99"], mfu=sm["mfu"], mean_batch_size=sm["mean_batch_size"],
        gpu_busy_fraction=sm["gpu_busy_fraction"], throughput_tok_s=sm["throughput_tok_s"],
        quality_in_distribution=sm["quality_in_distribution"], quality_tail=sm["quality_tail"],
        usd_per_gpu_hour=sm["usd_per_gpu_hour"],
    )
    if "cache_hit_rate" in sm:  # prefix caching acted (requests carry block hashes): docs/METRICS.md
        row.update(cache_hit_rate=sm["cache_hit_rate"], prefill_tokens_saved=sm["prefill_tokens_saved"],
                   ttft_hit_p99_s=sm["ttft_hit_s"]["p99"], ttft_miss_p99_s=sm["ttft_miss_s"]["p99"])
    row.update(cost)
    row["retraining_usd_per_month"] = sm["retraining_usd_per_month"]
    for key, c in sm["slo"].items():  # every check by name: slo_ttft_p99_s_value, _target, _met
        row[f"slo_{key}_value"], row[f"slo_{key}_target"], row[f"slo_{key}_met"] = c["value"], c["target"], c["met"]
    row["binding_slo"] = binding(sm)[0]
    row["total_usd_per_month"] = row["serving_usd_per_month"] + row["power_usd_per_month"] + row["retraining_usd_per_month"]
    mtok = sm["throughput_tok_s"] * HOURS_PER_MONTH * 3600.0 / 1e6  # output tokens served per month at this rate
    row["usd_per_mtok_at_slo"] = row["total_usd_per_month"] / mtok if mtok > 0 else float("nan")
    row["passes_quality_floor"] = bool(sm["quality_tail"] >= spec.quality_floor_tail)
    row.update(rejection_columns(sm, one))
    return row


def explained(spec: PlanSpec, s: Strategy, gpu: str, rate: float, one: Scenario,
              ctx: tuple[dict[str, Any], int, float, int, float]) -> dict[str, Any]:
    """The miss columns (`plan_miss`) of a configuration `plan_row(explain=True)` found no rack
    for (`ctx`: its '_explain'), with the closest rack's rejected requests; the closest rack (the
    largest tried) is rerun in full when its run stopped early, for its figures."""
    r, per, cap_rps, extra, tu = ctx
    if "closest" not in r:  # one replica, or the rack rules' floor, needs more GPUs than max_gpus
        return rack_rules_columns(r["reason"], int(r["needs_gpus"]) + extra * per, spec.max_gpus)
    ev, reps = r["closest"], int(r["closest_replicas"])
    sm = ev.get("summary")
    if sm is not None and ("stopped_early" in sm or any(c["value"] != c["value"] for c in sm["slo"].values())):
        sc = scenario_for(spec.base, s, gpu, spec.prices, reps, rate, tu, traffic=spec.traffic)
        ev = evaluate(sc, spec.seeds, spec.points, reps * cap_rps, stop_on_fail=False)
    out = closest_columns(ev, rate=rate, cap_rps=cap_rps, per=per, replicas=reps, extra=extra,
                          max_gpus=spec.max_gpus)
    if ev.get("summary") is not None:
        out.update(rejection_columns(ev["summary"], one))
    return out


def grid(spec: PlanSpec, s: Strategy, gpu: str, rate: float) -> list[dict[str, int | None]]:
    """The configurations searched for a strategy on a GPU type (the strategy as configured first)."""
    g = spec.search
    if not g.configurations:
        return [{}]
    try:
        own = config_of(one_replica(spec, s, gpu, rate))
    except ConfigError:  # not on this GPU as configured (too little memory at its TP, say): on the base's GPU
        try:
            own = config_of(one_replica(spec, s, spec.base.rack.gpu, rate))
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
        base_row: dict[str, Any] = {"strategy": s.name, "gpu": gpu, "layout": "aggregated", **cfg}
        try:
            one = one_replica(spec, sc_s, gpu, rate)
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
            configs.append({**base_row, "status": "pruned", "reason": why,
                            **_pruned_miss(spec, lb, per, lad.rps, lad.upper_bound, rate)})
            continue
        cands.append((lb_usd, per, len(cands), lb, sc_s, one, lad, base_row))
    cands.sort(key=lambda c: c[:3])
    best: dict[str, Any] | None = None
    failed: list[tuple[int, Strategy, Scenario, tuple[Any, ...]]] = []  # (configs' index, ..., '_explain')
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
            configs.append({**base_row, "status": "pruned", "reason": why,
                            **_pruned_miss(spec, lb, per, cap, lad.upper_bound and cap == lad.rps, rate)})
            continue
        row = plan_row(spec, sc_s, gpu, rate, cap_rps=cap, explain=True)
        ctx = row.pop("_explain", None)
        ok = bool(row["feasible"])
        if ctx is not None:
            failed.append((len(configs), sc_s, one, ctx))
        configs.append({**base_row, **row, "status": "passes" if ok else "fails"})
        if ok and (best is None or _cost_key(row) < _cost_key(best)):
            best = row
    if best is None:
        best = _no_rack(spec, s, gpu, rate, configs, failed)
    else:
        best = {**best, "configurations_searched": len(configs),
                "configurations_simulated": sum(c["status"] in ("passes", "fails") for c in configs),
                "evaluations": sum(int(c.get("evaluations", 0) or 0) for c in configs)}
    return {"row": best, "configs": configs}


def _pruned_miss(spec: PlanSpec, lb: int, per: int, cap: float, bound: bool, rate: float) -> dict[str, Any]:
    """The miss columns of a configuration pruned because its lower bound exceeds max_gpus
    (none for one pruned on cost)."""
    if lb * per <= spec.max_gpus:
        return {}
    return pruned_columns(rate=rate, cap_rps=cap, per=per, lb=lb, max_gpus=spec.max_gpus, bound=bound)


# the row of a strategy on a GPU type with no passing configuration: what the configuration
# closest to passing gives, never its cost or latencies (nothing there is usable)
NO_RACK_KEYS = ("tp", "max_num_batched_tokens", "max_num_seqs", "k", "gpus_per_replica", "capacity_per_replica_rps",
                "capacity_bound_rps", "rejected_requests", "sent_requests", "rejected_share", "rejected_reason")


def _no_rack(spec: PlanSpec, s: Strategy, gpu: str, rate: float, configs: list[dict[str, Any]],
             failed: list[tuple[int, Strategy, Scenario, tuple[Any, ...]]]) -> dict[str, Any]:
    """The row of a strategy on a GPU type none of whose configurations passes: the one closest to
    passing (the smallest miss_ratio; every simulated one explained, `explained`), what binds
    there, how far it misses and the cheapest change."""
    for i, sc_s, one, ctx in failed:
        configs[i].update(explained(spec, sc_s, gpu, rate, one, ctx))
    for c in configs:
        if c["status"] == "not applicable":
            c.update(not_applicable_columns(str(c.get("reason", ""))))
    ranked = sorted(configs, key=lambda c: (c.get("miss_ratio") is None or c["miss_ratio"] != c["miss_ratio"],
                                            c.get("miss_ratio") or 0.0, c["status"] != "fails"))
    near = ranked[0] if ranked else {"reason": "no configuration"}
    applicable = any(c["status"] != "not applicable" for c in configs)
    row = {"strategy": s.name, "gpu": gpu, "layout": "aggregated", "rate_rps": rate, "feasible": False,
           "engine_profile": resolve(str(s.overrides.get("deployment.engine", spec.base.deployment.engine))),
           "reason": ("" if applicable else "not applicable: ") + str(near.get("reason", ""))
           + (f" (the closest of {len(configs)} configurations)" if len(configs) > 1 else ""),
           "evaluations": sum(int(c.get("evaluations", 0) or 0) for c in configs),
           "configurations_searched": len(configs),
           "configurations_simulated": sum(c["status"] in ("passes", "fails") for c in configs)}
    row.update({k: near[k] for k in NO_RACK_KEYS if k in near})
    row.update({k: v for k, v in near.items() if k.startswith(("closest_", "miss_", "fix"))})
    return row


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


def rank(df: pd.DataFrame) -> pd.DataFrame:
    """Passing options cheapest first (those below the quality floor after those above), then
    the options with no passing rack, the closest to passing (smallest miss_ratio) first."""
    if df.empty or "feasible" not in df:
        return df
    floor = df["passes_quality_floor"].fillna(False).astype(bool) if "passes_quality_floor" in df else True
    key = (~df.feasible.astype(bool)).astype(int) * 2 + (~pd.Series(floor, index=df.index)).astype(int)
    by = ["_k"] + [c for c in ("total_usd_per_month", "miss_ratio") if c in df]
    return df.assign(_k=key).sort_values(by, kind="stable").drop(columns="_k").reset_index(drop=True)
