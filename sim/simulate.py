"""`simulate(scenario, seed) -> Result`: a run is a pure function; writing is a separate step.
The engine run itself (`run_table`, open or closed loop) is in `sim.run`; capacity in
`sim.capacity`."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import simpy

from models.catalog import peak_flops
from sim.capacity import Capacity, baseline_of, capacity
from sim.deployment import ReplicaRuntime, build_runtime
from sim.fleet import default_warmup_s
from sim.metrics import bench_metrics, intervals, replica_counts, replica_seconds, request_latencies, summarise
from sim.run import RunOutput, run_table
from sim.scenario import MAX_REQUESTS, Scenario
from sim.workload import LengthSampler, generate, think_mean

__all__ = ["Capacity", "Result", "baseline_of", "capacity", "capacity_summary", "flatten", "run_table", "simulate"]

VERSION = "0.1.0"


LATENCY_COLUMNS = ("ttft_s", "tpot_s", "e2e_s")  # per-request latencies added to the requests table


@dataclass
class Result:
    """One run: the scenario and seed, the requests table (one row per request, with its latencies
    `ttft_s`, `tpot_s`, `e2e_s`), the steps table (one row per engine step), the summary and the
    intervals table (one row per `[sim] interval_s`: latencies, throughput, replicas running, load;
    docs/METRICS.md), computed when first read (a sweep point never reads it), and the engine
    run's record (`run`: the fleet timeline, autoscaler decisions, speculation switches, ...)."""

    scenario: Scenario
    seed: int
    requests: pd.DataFrame
    steps: pd.DataFrame
    summary: dict[str, Any]
    run: RunOutput | None = field(default=None, repr=False, compare=False)
    intervals_of: Callable[[], pd.DataFrame] | None = field(default=None, repr=False, compare=False)
    _intervals: pd.DataFrame | None = field(default=None, init=False, repr=False, compare=False)

    @property
    def intervals(self) -> pd.DataFrame | None:
        """One row per [sim] interval_s of the run (docs/METRICS.md, 'Intervals')."""
        if self._intervals is None and self.intervals_of is not None:
            self._intervals = self.intervals_of()
        return self._intervals

    def table(self) -> pd.DataFrame:
        """The summary as a one-row DataFrame with the flat column names of a sweep's results
        table (`ttft_s_p99`, `slo_ttft_p99_s_met`, ...; see `flatten`), plus `seed`."""
        return pd.DataFrame([flatten(self.summary)])

    def write(self, out: str | Path) -> Path:
        """Write requests.parquet, steps.parquet, summary.json and intervals.parquet/.csv into `out`."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        self.requests.to_parquet(out / "requests.parquet", index=False)
        self.steps.to_parquet(out / "steps.parquet", index=False)
        if self.intervals is not None:
            self.intervals.to_parquet(out / "intervals.parquet", index=False)
            self.intervals.to_csv(out / "intervals.csv", index=False)
        (out / "summary.json").write_text(json.dumps(self.summary, indent=2, default=_json_default))
        return out


def flatten(summary: dict[str, Any]) -> dict[str, Any]:
    """Summary dict to one flat row: nested latencies become `ttft_s_p99` etc. (the scenario and
    versions are left out)."""
    row: dict[str, Any] = {}
    for k, v in summary.items():
        if k in ("scenario", "versions"):
            continue
        if isinstance(v, dict):
            for kk, vv in v.items():
                if isinstance(vv, dict):  # SLO checks: slo_ttft_p99_s_value, ..._target, ..._met
                    for kkk, vvv in vv.items():
                        row[f"{k}_{kk}_{kkk}"] = vvv
                else:
                    row[f"{k}_{kk}"] = vv
        else:
            row[k] = v
    return row


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    raise TypeError(type(o).__name__)


def versions() -> dict[str, str]:
    import pandas
    import scipy

    return {"specrack": VERSION, "python": platform.python_version(), "numpy": np.__version__,
            "simpy": simpy.__version__, "scipy": scipy.__version__, "pandas": pandas.__version__}


def offered_rate(sc: Scenario) -> float | None:
    """Requests/s to offer: rate_rps, or utilisation x the baseline deployment's capacity."""
    wl = sc.workload
    if wl.rate_rps is not None:
        return wl.rate_rps
    if wl.utilisation is not None:
        return wl.utilisation * capacity(sc).rps
    return None


def simulate(sc: Scenario, seed: int | None = None, *, progress: bool = False, with_capacity: bool = False) -> Result:
    """Run one scenario with one seed. Pure: no I/O (but an optional progress bar on stderr),
    same inputs give the same tables. `with_capacity` adds the deployment's capacity figures
    (`capacity_summary`) to the summary."""
    seed = sc.seed if seed is None else int(seed)
    rt = build_runtime(sc)
    rate = offered_rate(sc)
    wl = sc.workload
    lag = None
    if wl.closed:
        out = run_closed(sc, rt, seed, progress=progress)
        assert out.window_end_s is not None
        end_s = out.window_end_s
        loop = "closed"
    else:
        table = generate(wl, seed, rate)
        end_s = float(table.arrival_s.max()) if wl.num_requests else wl.duration_s
        if wl.max_concurrency is None:
            out = run_table(sc, rt, table, seed, backlog_limit=sc.sim.backlog_limit, progress=progress,
                            replica_capacity_rps=replica_capacity(sc, rt), warmup_s=replica_warmup_s(sc),
                            stop_on_slo=(wl.warmup_s, end_s, sc.slo.targets()) if sc.sim.stop_on_slo_fail else None)
            loop = "open"
        else:  # vllm bench serve --request-rate R --max-concurrency N: a send waits for a free client
            out = run_table(sc, rt, table, seed, concurrency=wl.max_concurrency, gate_arrivals=True, progress=progress)
            due = table.set_index("id").arrival_s.reindex(out.requests.id).to_numpy(np.float64)
            lag = out.requests.arrival_s.to_numpy(np.float64) - due  # how long each request waited for a client
            loop = "gated"
    req, steps, truncated, t_end = out.requests, out.steps, out.truncated, out.horizon_s
    warm = wl.warmup_s  # never clamped: a run whose arrivals all fall in warm-up is 'insufficient'
    peak = peak_flops(rt.cost.gpu, rt.cost.weights)
    early = out.stopped_early
    if early is not None:  # stopped once its SLO was certain to fail: figures over the part simulated
        end_s = max(warm, min(end_s, float(early["at_s"])))
    s = summarise(req, steps, warmup_s=warm, end_s=end_s, replicas=rt.num_replicas,
                  gpus_per_replica=rt.gpus_per_replica, peak_flops=peak, mem_bw=rt.cost.gpu.mem_bw_bytes_s,
                  slo=sc.slo.targets(), truncated=truncated, horizon_s=t_end,
                  loop=loop, concurrency=wl.concurrency or wl.max_concurrency, send_lag_s=lag)
    s["loop"] = loop
    s.update(_fleet_summary(sc, rt, out, s, end_s))
    if early is not None:
        s = _stopped(s, early)
    s["concurrency"] = wl.concurrency if wl.closed else wl.max_concurrency
    s["window_end_s"] = end_s
    # vllm bench serve's figures, computed as its script does: over the whole run, no warm-up
    s["benchmark"] = {**bench_metrics(req, steps), "max_concurrency": s["concurrency"],
                      "request_rate": rate if rate is not None and not wl.closed else float("inf")}
    s.update(_economics(sc, rt, req, s))
    s["rejected_requests"] = int(out.rejected)
    s["engine_profile"] = rt.engine  # the engine profile the step costs and scheduling came from
    s["num_replicas"] = rt.num_replicas
    s["kv_capacity_tokens"] = rt.plan.kv_capacity_tokens
    s["kv_pool_gib"] = rt.plan.kv_pool_bytes / 2**30
    s["offered_rate_rps"] = rate if rate is not None else float("nan")
    if with_capacity:
        s.update(capacity_summary(sc))
    s["scenario"] = sc.model_dump(mode="json")
    s["seed"] = seed
    s["versions"] = versions()
    cap = replica_capacity(sc, rt)
    iv = functools.partial(intervals, req, steps, interval_s=sc.sim.interval_s, end_s=end_s, replicas=rt.num_replicas,
                           gpus_per_replica=rt.gpus_per_replica, timeline=out.fleet,
                           replica_capacity_rps=cap if cap is not None else float("nan"), slo=sc.slo.targets())
    lat = request_latencies(req)  # the latencies behind the summary's percentiles, per request
    for col in LATENCY_COLUMNS:
        req[col] = lat[col].to_numpy(np.float64)
    return Result(sc, seed, req, steps, s, out, iv)


def _stopped(s: dict[str, Any], early: dict[str, Any]) -> dict[str, Any]:
    """The summary of a run stopped once its SLO was certain to fail (`sim.stop_on_slo_fail`):
    its figures cover the window up to the stop, stability is not judged, and the failing
    target's value is NaN (the run's figure was not reached)."""
    s["stopped_early"] = early
    s["slo_met"] = False
    s["stable"] = False
    s["verdict"] = "unjudged"
    s["slo"][early["target"]].update(value=float("nan"), met=False)
    s["verdict_reason"] = (f"stopped at {early['at_s']:.0f} s: {early['over']} of the window's {early['judged']} "
                           f"requests already miss {early['target']} (it fails once {early['needed']} do); figures "
                           "over the window up to the stop; stability not judged")
    return s


def time_varying(sc: Scenario) -> bool:
    """Whether the offered rate or the rack changes over the run (a rate profile, autoscaling)."""
    return sc.workload.rate_profile is not None or sc.autoscale is not None


def replica_capacity(sc: Scenario, rt: ReplicaRuntime) -> float | None:
    """The speculation-off capacity of one replica (req/s), when the run needs it: a
    target-utilisation autoscaler or a follow-load speculation policy (else None)."""
    spec = sc.speculative
    if not ((sc.autoscale is not None and sc.autoscale.policy == "target_utilisation")
            or (spec is not None and spec.policy == "follow_load")):
        return None
    return capacity(sc).rps / rt.num_replicas


def replica_warmup_s(sc: Scenario) -> float:
    """A new replica's warm-up delay: autoscale.replica_warmup_s, or the weights' load time
    (sim.fleet.default_warmup_s); 0 without autoscaling."""
    auto = sc.autoscale
    if auto is None:
        return 0.0
    if auto.replica_warmup_s is not None:
        return auto.replica_warmup_s
    from models.catalog import get_model, get_weight_format, weight_bytes

    fmt = get_weight_format(sc.deployment.weights)
    total = weight_bytes(get_model(sc.deployment.model), fmt)
    spec = sc.speculative
    if spec is not None and spec.draft_model:
        total += weight_bytes(get_model(spec.draft_model), fmt)
    return default_warmup_s(total)


def _fleet_summary(sc: Scenario, rt: ReplicaRuntime, run: RunOutput, s: dict[str, Any],
                   end_s: float) -> dict[str, Any]:
    """Replicas and GPU-hours over the day [0, end_s) (the replicas actually running: warming,
    live or draining), and, for a time-varying run, its verdict: the trend tests of a stationary
    run do not apply to a rate that moves on purpose, so it is judged by what is left unfinished
    (and the backlog limit), and the intervals table checks the SLO interval by interval."""
    timeline = run.fleet
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
    out["replica_warmup_s"] = replica_warmup_s(sc)
    if timeline and sc.autoscale is not None:  # busy shares over the replicas actually running in the window
        warm = sc.workload.warmup_s
        run_s = float(replica_seconds(knots, warm, end_s))
        if run_s > 0:
            scale = (end_s - warm) * rt.num_replicas / run_s
            for key in ("gpu_busy_fraction", "mfu", "hbm_bw_utilisation"):
                out[key] = s[key] * scale
    sw = run.follow_load
    if sw is not None:
        out["follow_load_switches"] = int(sum(1 for a, b in itertools.pairwise(sw) if a[2] != b[2]))
    if time_varying(sc) and s["loop"] == "open":
        from sim.metrics import _unfinished

        reasons = _unfinished(bool(s["truncated"]), int(s["backlog"]))
        verdict = "overloaded" if reasons else ("insufficient" if s["judged_requests"] < 100 else "stable")
        note = "time-varying rate or rack: judged by work left unfinished; see the intervals table per interval"
        out.update(verdict=verdict, stable=verdict == "stable", verdict_reason="; ".join([*reasons, note]))
        out["slo_met"] = bool(out["stable"] and all(c["met"] for c in s["slo"].values()))
    return out


def closed_pool(sc: Scenario, rt: ReplicaRuntime) -> int:
    """Requests to generate for a closed loop sized by duration_s: generous, from a decode-only
    throughput bound (every step a decode of the full client batch at the mean prompt length,
    each sequence emitting k + 1 tokens with speculation); `run_closed` doubles it if the clients
    still run out before duration_s."""
    wl = sc.workload
    assert wl.concurrency is not None
    per_replica = max(1, min(rt.max_num_seqs, -(-wl.concurrency // rt.num_replicas)))
    mean_in = LengthSampler(wl.prompt_tokens, "prompt_tokens").mean()
    mean_out = max(1.0, LengthSampler(wl.output_tokens, "output_tokens").mean())
    step_s = rt.cost.uniform(per_replica, int(mean_in), 1).total_s
    k = sc.speculative.num_speculative_tokens if sc.speculative else 0
    rps = rt.num_replicas * per_replica * (k + 1) / step_s / mean_out
    rps = min(rps, wl.concurrency / think_mean(wl.think_time_s)) if wl.think_time_s is not None and think_mean(wl.think_time_s) > 0 else rps
    return int(min(MAX_REQUESTS, 1.5 * rps * wl.duration_s + 2 * wl.concurrency + 64))


def run_closed(sc: Scenario, rt: ReplicaRuntime, seed: int, *, progress: bool = False) -> RunOutput:
    """A closed loop (`arrival = "closed"`): its `RunOutput`, with the window's end (`window_end_s`).

    Sized by `num_requests`, the clients send them all and the window ends at the last send (after
    it the population shrinks). Sized by `duration_s`, the clients send until duration_s from a
    pool of requests big enough never to run dry (checked: a pool that ran dry is doubled and the
    run repeated, so the result does not depend on the first guess), the requests in flight then
    complete, and the window ends at duration_s; requests never sent are not in the table. A
    trace sends each of its requests once, in order: one that runs out ends the window early, at
    its last send."""
    wl = sc.workload
    assert wl.concurrency is not None
    pool = None if wl.num_requests is not None else closed_pool(sc, rt)
    while True:
        table = generate(wl, seed, None, pool=pool)
        think = table.think_s.to_numpy() if "think_s" in table else None
        out = run_table(sc, rt, table, seed, concurrency=wl.concurrency, think_s=think, progress=progress,
                        send_until_s=None if pool is None else wl.duration_s)
        req = out.requests
        sent = req.arrival_s.notna().to_numpy()
        if pool is None or not sent.all() or len(table) < pool or pool >= MAX_REQUESTS:
            break
        pool = min(MAX_REQUESTS, 2 * pool)  # the clients ran dry before duration_s: a bigger pool
    last_send = float(np.nanmax(req.arrival_s.to_numpy(np.float64))) if sent.any() else 0.0
    if pool is not None and not sent.all():
        end_s = wl.duration_s  # N clients were busy (or thinking) right up to duration_s
        reached = int(req.id.to_numpy()[sent].max()) + 1  # the pool's requests the clients got to
        req = req[sent].reset_index(drop=True)
        # the pool's requests the clients got to but never sent: too long for the deployment,
        # skipped (as vLLM rejects)
        return dataclasses.replace(out, requests=req, rejected=reached - len(req), window_end_s=end_s)
    return dataclasses.replace(out, window_end_s=last_send)


def _economics(sc: Scenario, rt: ReplicaRuntime, req: pd.DataFrame, s: dict[str, Any]) -> dict[str, Any]:
    """Quality per class and overall, and cost per million output tokens (with retraining)."""
    q_in, q_tail = rt.quality
    if rt.retraining is not None:
        q_in, q_tail = rt.retraining.effective_quality(q_in), rt.retraining.effective_quality(q_tail)
    out: dict[str, Any] = {"quality_in_distribution": q_in, "quality_tail": q_tail}
    per_class = {}
    counts = np.bincount(req.cls.to_numpy(), minlength=len(sc.workload.classes)) if len(req) else np.zeros(1)
    total = 0.0
    for i, c in enumerate(sc.workload.classes):
        q = q_tail if c.tail else q_in
        per_class[c.name] = q
        total += q * counts[i]
    out["quality_by_class"] = per_class
    out["quality_overall"] = total / max(1, counts.sum())
    gpus = sc.rack.num_gpus
    if sc.autoscale is not None:  # the replicas actually running, on average over the run
        gpus = s["replicas_mean"] * rt.gpus_per_replica
    rack_usd_s = gpus * rt.usd_per_gpu_hour / 3600.0
    tok_s = s["throughput_tok_s"]
    retrain_month = rt.retraining.usd_per_month if rt.retraining else 0.0
    out["retraining_usd_per_month"] = retrain_month
    out["usd_per_gpu_hour"] = rt.usd_per_gpu_hour
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


def capacity_summary(sc: Scenario) -> dict[str, Any]:
    """Capacity figures for summary.json and `specrack capacity --json`: `capacity_rps` and
    friends for the deployment with speculation off (the reference of `utilisation`), and with a
    [speculative] table also `speculative_capacity_rps` (peak sustainable rate),
    `speculative_full_batch_rps` (the collapse figure), `speculative_peak_rps`, ...; and the
    closed-loop curve behind each."""
    out: dict[str, Any] = capacity(sc).as_dict()
    if sc.speculative is not None:
        out.update(capacity(sc, speculative=True).as_dict("speculative_"))
    return out
