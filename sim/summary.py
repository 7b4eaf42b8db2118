"""A run's summary, assembled from sections that own disjoint keys.

Each section is a plain function of what the run produced (its `RunOutput`, the runtime, the
scenario, other sections' figures passed in as arguments) returning only the keys it owns:

    throughput   `sim.metrics.summarise`: latencies, throughput, goodput, busy shares, batch,
                 speculation, prefix caching
    parts        `sim.attribution.latency_parts`: mean TPOT and E2E split into what they were spent on
    stability    `sim.metrics.stability` / `closed_loop_stability`: backlog and trend figures
    verdict      `verdict_section`: verdict, its reason, stable, slo_met, decided once from the
                 stability test, a rate that varies on purpose and a stop on a certain SLO failure
    slo          `slo_section`: each SLO target against the run's figure
    run          `run_section`: how the run went (loop, truncated, horizon, window, rejected, rate)
    fleet        `fleet_section`: replicas and GPU-hours over the run, follow-load switches
    stopped      `stopped_section`: the certain SLO failure the run stopped at
    benchmark    `vllm bench serve`'s figures (`sim.metrics.bench_metrics`)
    economics    `economics_section`: quality and cost per token
    deployment   `deployment_section`: engine profile, replicas, KV cache
    capacity     `RunCapacity.as_dict`: the deployment's capacity figures (when asked for)
    provenance   `provenance_section`: the scenario, seed and versions

`assemble` merges them: a key written by two sections raises, and so does a key the layout does
not place. `LAYOUT` fixes the order of the keys (what summary.json and a results table's columns
show) and, with it, which section owns each key.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import numpy as np

from sim.capacity import Capacity, package_versions
from sim.deployment import ReplicaRuntime
from sim.frame import column
from sim.metrics import (
    MIN_JUDGED_REQUESTS,
    Stability,
    against_capacity,
    replica_counts,
    replica_seconds,
    slo_checks,
    unfinished,
)
from sim.run import RunOutput
from sim.scenario import Scenario

if TYPE_CHECKING:
    from sim.frame import Table

VERSION = "0.1.0"


def _capacity_keys(prefix: str) -> tuple[str, ...]:
    return tuple(Capacity(rps=0.0, tok_s=0.0).as_dict(prefix))


# (section, its keys), in the order the summary shows them; a section may own several groups
LAYOUT: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("throughput", ("ttft_s", "tpot_s", "itl_s", "itl_samples", "e2e_s", "queue_s", "offered_requests",
                    "completed_requests", "offered_rps", "throughput_rps", "throughput_tok_s", "goodput_rps",
                    "slo_attainment", "gpu_busy_fraction", "mfu", "hbm_bw_utilisation", "mean_batch_size",
                    "preemptions", "acceptance_rate", "tokens_per_step", "draft_share", "spec_overhead_share",
                    "queue_growth_rps", "cache_hit_rate", "cache_request_hit_rate", "prefill_tokens_saved",
                    "prefill_tokens_computed", "prefill_tokens_after_preemption",
                    "prefill_tokens_cached_after_preemption", "preempted_requests", "ttft_hit_s", "ttft_miss_s", "cache_hbm_hit_rate", "cache_host_hit_rate",
                    "ttft_hbm_hit_s", "ttft_host_hit_s", "host_evicted_blocks")),
    ("parts", ("latency_parts",)),
    ("stability", ("backlog", "judged_requests", "settle_s", "ramp_s", "trend_only", "lifetime_s", "in_system_mean", "in_system_growth",
                   "in_system_trend_t", "ttft_growth_s", "ttft_trend_t", "client_wait_growth_s",
                   "client_wait_trend_t")),
    ("verdict", ("verdict", "verdict_reason", "stable", "judged_utilisation")),
    ("run", ("truncated", "horizon_s")),
    ("slo", ("slo",)),
    ("verdict", ("slo_met",)),
    ("run", ("loop",)),
    ("fleet", ("autoscaled", "replicas_mean", "replicas_peak", "gpus_peak", "gpu_hours", "gpu_hours_per_day",
               "replica_warmup_s", "follow_load_switches")),
    ("stopped", ("stopped_early",)),
    ("run", ("concurrency", "window_start_s", "window_end_s")),
    ("benchmark", ("benchmark",)),
    ("economics", ("quality_in_distribution", "quality_tail", "quality_by_class", "quality_overall",
                   "retraining_usd_per_month", "usd_per_gpu_hour", "serving_usd_per_month", "usd_per_mtok_serving",
                   "usd_per_mtok_retraining", "usd_per_mtok")),
    ("run", ("rejected_requests", "rejected_share", "rejected_reason", "rejected_lines")),
    ("deployment", ("engine_profile", "num_replicas", "kv_capacity_tokens", "kv_pool_gib")),
    ("disaggregation", ("disaggregation",)),
    ("run", ("offered_rate_rps",)),
    ("capacity", (*_capacity_keys(""), *_capacity_keys("speculative_"))),
    ("provenance", ("scenario", "seed", "versions")),
)
OWNER: dict[str, str] = {k: sec for sec, keys in LAYOUT for k in keys}
ORDER: tuple[str, ...] = tuple(k for _, keys in LAYOUT for k in keys)
assert len(OWNER) == len(ORDER), "a key placed twice in LAYOUT"


def assemble(sections: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The summary: every section's keys, in LAYOUT's order. Raises ValueError when two sections
    write the same key, or a section writes a key LAYOUT gives to another (or to none)."""
    merged: dict[str, Any] = {}
    by: dict[str, str] = {}
    for name, section in sections.items():
        for key, value in section.items():
            if key in by:
                raise ValueError(f"summary key '{key}' written by two sections, '{by[key]}' and '{name}'")
            if OWNER.get(key) != name:
                raise ValueError(f"summary key '{key}' from section '{name}': LAYOUT gives it to "
                                 f"{repr(OWNER[key]) if key in OWNER else 'no section'}; place it in sim/summary.py")
            by[key] = name
            merged[key] = value
    return {k: merged[k] for k in ORDER if k in by}


def fleet_section(sc: Scenario, rt: ReplicaRuntime, run: RunOutput, end_s: float,
                  replica_warmup_s: float, replicas: int, gpus: int) -> tuple[dict[str, Any], float | None]:
    """Replicas and GPU-hours over the day [0, end_s) (the replicas actually running: warming,
    live or draining) and the follow-load speculation switches; and the busy shares' scale for
    `summarise` (an autoscaled run: the window's replica-seconds over those actually running),
    else None."""
    timeline = run.fleet
    if timeline is None and replicas != rt.num_replicas:  # a disaggregated rack: both pools, fixed
        return {"autoscaled": False, "replicas_mean": float(replicas), "replicas_peak": replicas, "gpus_peak": gpus,
                "gpu_hours": end_s * gpus / 3600.0, "gpu_hours_per_day": 24.0 * gpus if end_s > 0 else float("nan"),
                "replica_warmup_s": replica_warmup_s}, None
    knots = replica_counts(timeline, rt.num_replicas)
    rep_s = float(replica_seconds(knots, 0.0, end_s))
    out: dict[str, Any] = {"autoscaled": sc.autoscale is not None}
    out["replicas_mean"] = rep_s / end_s if end_s > 0 else float("nan")
    if timeline:
        t, f = knots
        counts = np.diff(f) / np.diff(t)
        out["replicas_peak"] = round(float(counts[t[:-1] < end_s].max()))
    else:
        out["replicas_peak"] = rt.num_replicas
    out["gpus_peak"] = out["replicas_peak"] * rt.gpus_per_replica
    out["gpu_hours"] = rep_s * rt.gpus_per_replica / 3600.0
    out["gpu_hours_per_day"] = out["gpu_hours"] * 86400.0 / end_s if end_s > 0 else float("nan")
    out["replica_warmup_s"] = replica_warmup_s
    scale = None
    if timeline and sc.autoscale is not None:  # busy shares over the replicas actually running in the window
        warm = sc.workload.warmup_s
        run_s = float(replica_seconds(knots, warm, end_s))
        if run_s > 0:
            scale = (end_s - warm) * rt.num_replicas / run_s
    sw = run.follow_load
    if sw is not None:
        out["follow_load_switches"] = int(sum(1 for a, b in itertools.pairwise(sw) if a[2] != b[2]))
    return out, scale


TIME_VARYING_NOTE = "time-varying rate or rack: judged by work left unfinished; see the intervals table per interval"


def verdict_section(judged: Stability, slo: dict[str, dict[str, Any]], *, truncated: bool,
                    time_varying_open: bool, stopped_early: dict[str, Any] | None,
                    own_rho: float = float("nan"), e2e_mean_s: float = float("nan"),
                    window_s: float = float("nan"), saturated: str = "") -> dict[str, Any]:
    """The verdict, decided once: a run stopped on a certain SLO failure is 'unjudged' (and
    fails); a time-varying open-loop run (a rate profile, autoscaling) is judged by the work left
    unfinished (the trend tests of a stationary run do not apply to a rate that moves on purpose;
    the intervals table checks the SLO interval by interval); any other by its stability test,
    and, where the offered load's share `own_rho` of the deployment's own capacity is known,
    against it (`sim.metrics.against_capacity`: never 'stable' at or above capacity, a short
    trend 'insufficient'). `saturated`: why a part of the rack ran at its capacity through the
    window (a disaggregated prefill pool busy throughout: `sim.disagg.saturation`), which a short
    run's trend tests may not see: never 'stable' then, 'insufficient'. `slo_met`: stable and every
    SLO target met."""
    if stopped_early is not None:
        e = stopped_early
        reason = (f"stopped at {e['at_s']:.0f} s: {e['over']} of the window's {e['judged']} requests already miss "
                  f"{e['target']} (it fails once {e['needed']} do); figures over the window up to the stop; "
                  "stability not judged")
        return {"verdict": "unjudged", "verdict_reason": reason, "stable": False, "slo_met": False}
    if time_varying_open:
        reasons = unfinished(bool(truncated), int(judged.figures["backlog"]))
        verdict = "overloaded" if reasons else (
            "insufficient" if judged.figures["judged_requests"] < MIN_JUDGED_REQUESTS else "stable")
        reasons = [*reasons, TIME_VARYING_NOTE]
        own_rho = float("nan")
    else:
        verdict, reasons = against_capacity(judged.verdict, judged.reasons,
                                            trend_only=bool(judged.figures.get("trend_only", False)),
                                            rho=own_rho, e2e_mean_s=e2e_mean_s, window_s=window_s)
    if verdict == "stable" and saturated:
        verdict, reasons = "insufficient", [*reasons, saturated]
    stable = verdict == "stable"
    return {"verdict": verdict, "verdict_reason": "; ".join(reasons), "stable": stable, "judged_utilisation": own_rho,
            "slo_met": bool(stable and all(c["met"] for c in slo.values()))}


def slo_section(throughput: dict[str, Any], targets: dict[str, float],
                stopped_early: dict[str, Any] | None) -> dict[str, Any]:
    """Each SLO target against the run's figure; a run stopped on a certain failure of a target
    has that target's value NaN (the run's figure was not reached) and unmet."""
    checks = slo_checks(throughput, targets)
    if stopped_early is not None:
        checks[stopped_early["target"]].update(value=float("nan"), met=False)
    return {"slo": checks}


def stopped_section(stopped_early: dict[str, Any] | None) -> dict[str, Any]:
    """The certain SLO failure the run stopped at (`sim.stop_on_slo_fail`), when it did: its
    figures cover the window up to the stop."""
    return {} if stopped_early is None else {"stopped_early": stopped_early}


def economics_section(sc: Scenario, rt: ReplicaRuntime, req: Table, *, replicas_mean: float,
                      throughput_tok_s: float, gpus: int, usd_per_gpu_hour: float) -> dict[str, Any]:
    """Quality per class and overall, and cost per million output tokens (with retraining).
    `gpus`, `usd_per_gpu_hour`: the rack's billed GPUs (idle ones too) and their mean price
    (`sim.disagg.rack_figures`)."""
    q_in, q_tail = rt.quality
    if rt.retraining is not None:
        q_in, q_tail = rt.retraining.effective_quality(q_in), rt.retraining.effective_quality(q_tail)
    out: dict[str, Any] = {"quality_in_distribution": q_in, "quality_tail": q_tail}
    per_class = {}
    counts = np.bincount(column(req, "cls"), minlength=len(sc.workload.classes)) if len(req) else np.zeros(1)
    total = 0.0
    for i, c in enumerate(sc.workload.classes):
        q = q_tail if c.tail else q_in
        per_class[c.name] = q
        total += q * counts[i]
    out["quality_by_class"] = per_class
    out["quality_overall"] = total / max(1, counts.sum())
    billed: float = gpus  # (idle GPUs are billed)
    if sc.autoscale is not None:  # the replicas actually running, on average over the run
        billed = replicas_mean * rt.gpus_per_replica
    rack_usd_s = billed * usd_per_gpu_hour / 3600.0
    tok_s = throughput_tok_s
    retrain_month = rt.retraining.usd_per_month if rt.retraining else 0.0
    out["retraining_usd_per_month"] = retrain_month
    out["usd_per_gpu_hour"] = usd_per_gpu_hour
    out["serving_usd_per_month"] = rack_usd_s * 30 * 86400
    if tok_s > 0:
        serving = rack_usd_s / tok_s * 1e6
        retrain = retrain_month / (tok_s * 30 * 86400) * 1e6
    else:
        serving = retrain = float("nan")
    out["usd_per_mtok_serving"] = serving
    out["usd_per_mtok_retraining"] = retrain
    out["usd_per_mtok"] = serving + retrain
    return out


def deployment_section(rt: ReplicaRuntime) -> dict[str, Any]:
    """The engine profile the step costs and scheduling came from, the replicas and the KV cache."""
    return {"engine_profile": rt.engine, "num_replicas": rt.num_replicas,
            "kv_capacity_tokens": rt.plan.kv_capacity_tokens, "kv_pool_gib": rt.plan.kv_pool_bytes / 2**30}


def versions() -> dict[str, str]:
    """The versions a run ran with (`sim.capacity.package_versions`, in the summary's order)."""
    v = package_versions()
    return {"specrack": VERSION, **{k: v[k] for k in ("python", "numpy", "simpy", "scipy", "pandas")}}


def provenance_section(sc: Scenario, seed: int) -> dict[str, Any]:
    """What the run was: the scenario as validated, the seed and the versions that ran it."""
    return {"scenario": sc.model_dump(mode="json"), "seed": seed, "versions": versions()}
