"""`simulate(scenario, seed, capacity=...) -> Result`: a run is a pure function; writing is a
separate step. A run's lifecycle: build (the runtime and the request table), run (the engine:
`run_table`, open or closed loop, in `sim.run`, returning one `RunOutput`), collect (the summary,
assembled from sections that own disjoint keys: `sim.summary`). The capacity a run needs is an
input, measured before it when asked (`sim.capacity.capacity_for`)."""

from __future__ import annotations

import dataclasses
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from models.catalog import get_model, get_weight_format, weight_bytes
from sim.attribution import METRICS, latency_parts, step_shares
from sim.capacity import (
    Capacity,
    CapacityStore,
    RunCapacity,
    baseline_of,
    capacity,
    capacity_for,
    needs_capacity,
)
from sim.deployment import ReplicaRuntime, build_runtime, rejection_reason
from sim.disagg import Pools, disaggregation_section, rack_figures, run_disaggregated, saturation
from sim.fleet import default_warmup_s
from sim.frame import Frame, column
from sim.metrics import bench_metrics, closed_loop_stability, intervals, request_latencies, stability, summarise
from sim.run import RunOutput, fixed_set_window, run_table
from sim.scenario import MAX_REQUESTS, Scenario
from sim.summary import (
    assemble,
    deployment_section,
    economics_section,
    fleet_section,
    provenance_section,
    slo_section,
    stopped_section,
    verdict_section,
)
from sim.workload import LengthSampler, conversation_ramp_s, generate, think_mean

if TYPE_CHECKING:
    import pandas as pd

__all__ = ["Capacity", "CapacityStore", "Result", "RunCapacity", "RunOutput", "baseline_of", "capacity",
           "capacity_for", "capacity_summary", "flatten", "needs_capacity", "run_table", "simulate"]


LATENCY_COLUMNS = ("ttft_s", "tpot_s", "e2e_s")  # per-request latencies added to the requests table


@dataclass
class Result:
    """One run: the scenario and seed, the requests table (one row per request, with its latencies
    `ttft_s`, `tpot_s`, `e2e_s`), the steps table (one row per engine step), the summary and the
    intervals table (one row per `[sim] interval_s`: latencies, throughput, replicas running, load;
    docs/METRICS.md), computed when first read (a sweep point never reads it), and the engine
    run's record (`run`: the fleet timeline, autoscaler decisions, speculation switches, ...).

    The tables are kept as Frames (`request_table`, `step_table`, `interval_table`: numpy columns,
    `sim.frame`); `requests`, `steps` and `intervals` are the same as DataFrames of their own, made
    when first read (pandas is imported then, not by a run): editing one changes neither the run's
    tables nor the files `write` writes from them."""

    scenario: Scenario
    seed: int
    request_table: Frame
    step_table: Frame
    summary: dict[str, Any]
    run: RunOutput | None = field(default=None, repr=False, compare=False)
    intervals_of: Callable[[], Frame] | None = field(default=None, repr=False, compare=False)
    _intervals: Frame | None = field(default=None, init=False, repr=False, compare=False)
    _frames: dict[str, pd.DataFrame] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def interval_table(self) -> Frame | None:
        """One row per [sim] interval_s of the run (docs/METRICS.md, 'Intervals')."""
        if self._intervals is None and self.intervals_of is not None:
            self._intervals = self.intervals_of()
        return self._intervals

    @property
    def requests(self) -> pd.DataFrame:
        """The request table as a DataFrame."""
        return self._frame("requests", self.request_table)

    @property
    def steps(self) -> pd.DataFrame:
        """The step table as a DataFrame."""
        return self._frame("steps", self.step_table)

    @property
    def intervals(self) -> pd.DataFrame | None:
        """The intervals table as a DataFrame (None when the run has none)."""
        iv = self.interval_table
        return None if iv is None else self._frame("intervals", iv)

    def _frame(self, name: str, table: Frame) -> pd.DataFrame:
        if name not in self._frames:
            self._frames[name] = table.to_pandas()
        return self._frames[name]

    def table(self) -> pd.DataFrame:
        """The summary as a one-row DataFrame with the flat column names of a sweep's results
        table (`ttft_s_p99`, `slo_ttft_p99_s_met`, ...; see `flatten`), plus `seed`."""
        import pandas as pd  # (heavy: only a DataFrame asked for needs it)

        return pd.DataFrame([flatten(self.summary)])

    def write(self, out: str | Path) -> Path:
        """Write requests.parquet, steps.parquet, summary.json and intervals.parquet/.csv into `out`."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        self.request_table.write_parquet(out / "requests.parquet")
        self.step_table.write_parquet(out / "steps.parquet")
        iv = self.interval_table
        if iv is not None:
            iv.write_parquet(out / "intervals.parquet")
            iv.write_csv(out / "intervals.csv")
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


def _missing(sc: Scenario, why: str, fix: str) -> ValueError:
    return ValueError(f"{sc.name}: {why} needs the deployment's measured capacity; pass capacity={fix} "
                      "(sim.capacity; specrack.simulate measures it for you)")


def offered_rate(sc: Scenario, capacity: RunCapacity | None = None) -> float | None:
    """Requests/s to offer: rate_rps, or utilisation x the baseline deployment's capacity
    (`capacity.baseline`, measured beforehand: `capacity_for`)."""
    wl = sc.workload
    if wl.rate_rps is not None:
        return wl.rate_rps
    if wl.utilisation is not None:
        if capacity is None:
            raise _missing(sc, f"workload.utilisation = {wl.utilisation:g}", "capacity_for(sc)")
        return wl.utilisation * capacity.baseline.rps
    return None


def simulate(sc: Scenario, seed: int | None = None, *, capacity: RunCapacity | None = None, progress: bool = False,
             with_capacity: bool = False) -> Result:
    """Run one scenario with one seed: build (the runtime, the request table), run (the engine:
    `run_table`, or `run_closed`), collect (the summary from its sections: `sim.summary`). Pure:
    no I/O (but an optional progress bar on stderr), same inputs give the same tables.

    `capacity`: the deployment's measured capacity (`capacity_for(sc)`), needed when the load is
    set as utilisation, or with a target-utilisation autoscaler or a follow-load policy
    (`needs_capacity`): without it such a run raises a one-line ValueError naming the fix.
    `with_capacity` adds the capacity figures to the summary (then `capacity_for(sc,
    with_capacity=True)`)."""
    seed = sc.seed if seed is None else int(seed)
    why = needs_capacity(sc)
    if capacity is None and (why is not None or with_capacity):
        raise _missing(sc, why or "with_capacity", f"capacity_for(sc{', with_capacity=True' if with_capacity else ''})")
    if with_capacity and sc.speculative is not None and capacity is not None and capacity.speculative is None:
        raise _missing(sc, "with_capacity (speculation on)", "capacity_for(sc, with_capacity=True)")
    # build
    rt = build_runtime(sc)
    rate = offered_rate(sc, capacity)
    configured = rate  # (a trace at its own timing reports its own rate, below, but is not judged by it)
    replica_cap = replica_capacity(sc, rt, capacity)
    warmup_s = replica_warmup_s(sc)
    wl = sc.workload
    # run
    lag = None
    pools: Pools | None = None
    start_s = wl.warmup_s
    if wl.closed:
        out = run_closed(sc, rt, seed, progress=progress)
        assert out.window_end_s is not None
        end_s = out.window_end_s
        start_s = out.window_start_s if out.window_start_s is not None else start_s
        loop = "closed"
    else:
        table = generate(wl, seed, rate)
        # a fixed set of requests (num_requests, a trace that runs out before duration_s) is measured
        # up to its last arrival, included
        fixed = bool(table.attrs.get("runs_out"))
        times = column(table, "arrival_s", np.float64)
        if fixed:
            start_s, end_s = fixed_set_window(times, None, wl.warmup_s, frontend_s=rt.cost.eff.frontend_s)
        else:
            end_s = wl.duration_s
        if rate is None and wl.replays_trace:  # the trace's own rate over its span (inf: a burst)
            span = float(times.max() - times.min())
            rate = (times.size - 1) / span if span > 0 else float("inf")
        if sc.disaggregation is not None:  # prefill pool, KV transfers, decode pool (sim/disagg.py)
            out, pools = run_disaggregated(sc, rt, table, seed, backlog_limit=sc.sim.backlog_limit, progress=progress)
            loop = "open"
        elif wl.max_concurrency is None:
            out = run_table(sc, rt, table, seed, backlog_limit=sc.sim.backlog_limit, progress=progress,
                            replica_capacity_rps=replica_cap, warmup_s=warmup_s,
                            stop_on_slo=(start_s, end_s, sc.slo.targets()) if sc.sim.stop_on_slo_fail else None)
            loop = "open"
        else:  # vllm bench serve --request-rate R --max-concurrency N: a send waits for a free client
            out = run_table(sc, rt, table, seed, concurrency=wl.max_concurrency, gate_arrivals=True, progress=progress)
            ids = table["id"]
            order = np.argsort(ids, kind="stable")  # each request's row in the table, by its id
            due = column(table, "arrival_s", np.float64)[order[np.searchsorted(ids, out.requests["id"], sorter=order)]]
            lag = column(out.requests, "arrival_s", np.float64) - due  # how long each request waited for a client
            loop = "gated"
        if fixed:  # what was sent (a gated send lags its arrival), the drain of a burst
            start_s, end_s = fixed_set_window(column(out.requests, "arrival_s", np.float64),
                                              column(out.requests, "completion_s", np.float64), wl.warmup_s,
                                              out.horizon_s, rt.cost.eff.frontend_s)
    # collect
    early = out.stopped_early
    if early is not None:  # stopped once its SLO was certain to fail: figures over the part simulated
        end_s = max(start_s, min(end_s, float(early["at_s"])))
    s = collect(sc, rt, seed, out, loop=loop, end_s=end_s, rate=rate, send_lag_s=lag, warmup_s=warmup_s,
                capacity=capacity if with_capacity else None, own_rho=own_utilisation(sc, configured, capacity),
                start_s=start_s, pools=pools)
    req, steps = out.requests, out.steps
    rack = rack_figures(sc, rt, pools)
    iv = functools.partial(intervals, req, steps, interval_s=sc.sim.interval_s, end_s=end_s, replicas=rack.replicas,
                           gpus_per_replica=rack.gpus / rack.replicas, timeline=out.fleet,
                           replica_capacity_rps=replica_cap if replica_cap is not None else float("nan"),
                           slo=sc.slo.targets())
    lat = request_latencies(req)  # the latencies behind the summary's percentiles, per request
    for col in LATENCY_COLUMNS:
        req[col] = column(lat, col, np.float64)
    return Result(sc, seed, req, steps, s, out, iv)


def collect(sc: Scenario, rt: ReplicaRuntime, seed: int, out: RunOutput, *, loop: str, end_s: float,
            rate: float | None, send_lag_s: np.ndarray | None, warmup_s: float,
            capacity: RunCapacity | None, own_rho: float = float("nan"), start_s: float | None = None,
            pools: Pools | None = None) -> dict[str, Any]:
    """The run's summary, assembled from its sections (`sim.summary`; each owns its keys).
    `end_s`: the metric window's end; `start_s`: its start (None: workload.warmup_s; earlier for
    a burst: `sim.run.fixed_set_window`); `warmup_s`: a new replica's warm-up delay; `capacity`:
    the capacity figures to report, or None; `own_rho`: the offered rate over the deployment's
    own capacity, where known (`own_utilisation`); `pools`: a disaggregated run's pools."""
    wl = sc.workload
    req, steps = out.requests, out.steps
    # never clamped: a run whose arrivals all fall in warm-up is 'insufficient'
    warm = wl.warmup_s if start_s is None else start_s
    rack = rack_figures(sc, rt, pools)
    fleet, busy_scale = fleet_section(sc, rt, out, end_s, warmup_s, rack.replicas, rack.gpus)
    targets = sc.slo.targets()
    tp = summarise(req, steps, warmup_s=warm, end_s=end_s, replicas=rack.replicas,
                   gpus_per_replica=rack.gpus / rack.replicas, peak_flops=rack.peak_flops,
                   mem_bw=rack.mem_bw, slo=targets, busy_scale=busy_scale,
                   rejected_arrival_s=out.rejected_arrival_s, host_evicted_blocks=out.host_evicted_blocks)
    if loop == "open":
        ramp = conversation_ramp_s(wl.conversations) if wl.conversations is not None else 0.0
        judged = stability(req, warmup_s=warm, end_s=end_s, truncated=out.truncated, ramp_s=ramp)
    else:
        concurrency = wl.concurrency or wl.max_concurrency
        assert concurrency is not None
        judged = closed_loop_stability(req, warmup_s=warm, end_s=end_s, truncated=out.truncated,
                                       concurrency=concurrency, send_lag_s=send_lag_s if loop == "gated" else None)
    dis = disaggregation_section(req, steps, pools, warm, end_s) if pools is not None else None
    slo = slo_section(tp, targets, out.stopped_early)
    clients = wl.concurrency if wl.closed else wl.max_concurrency
    run = {"truncated": bool(out.truncated), "horizon_s": float(out.horizon_s), "loop": loop, "concurrency": clients,
           "window_start_s": warm, "window_end_s": end_s, **rejected_fields(out, len(req)),
           "offered_rate_rps": rate if rate is not None else float("nan")}
    # vllm bench serve's figures, computed as its script does: over the whole run, no warm-up
    bench = {**bench_metrics(req, steps), "max_concurrency": clients,
             "request_rate": rate if rate is not None and not wl.closed else float("inf")}
    shares = step_shares(steps, warm, end_s)  # (the same steps split both metrics)
    parts = {m: latency_parts(req, steps, m, warm, end_s, shares) for m in METRICS}
    return assemble({
        "throughput": tp,
        "parts": {"latency_parts": parts},
        "stability": judged.figures,
        "verdict": verdict_section(judged, slo["slo"], truncated=out.truncated,
                                   time_varying_open=time_varying(sc) and loop == "open",
                                   stopped_early=out.stopped_early,
                                   own_rho=own_rho if loop == "open" else float("nan"),
                                   e2e_mean_s=float(tp["e2e_s"]["mean"]), window_s=end_s - float(judged.figures["settle_s"]),
                                   saturated=saturation(dis) if dis is not None else ""),
        "run": run,
        "slo": slo,
        "fleet": fleet,
        "stopped": stopped_section(out.stopped_early),
        "benchmark": {"benchmark": bench},
        "economics": economics_section(sc, rt, req, replicas_mean=fleet["replicas_mean"],
                                       throughput_tok_s=tp["throughput_tok_s"],
                                       gpus=sc.rack.num_gpus + rack.gpus - rt.num_replicas * rt.gpus_per_replica,
                                       usd_per_gpu_hour=rack.usd_per_gpu_hour),
        "deployment": deployment_section(rt),
        "disaggregation": {} if dis is None else {"disaggregation": dis},
        "capacity": capacity.as_dict() if capacity is not None else {},
        "provenance": provenance_section(sc, seed),
    })


REJECTED_LINES_SHOWN = 10  # trace lines named in the summary (the count is always whole)


def rejected_fields(out: RunOutput, accepted: int) -> dict[str, Any]:
    """The run section's rejected-request keys: how many the deployment refused, their share of
    every request the run was offered, why, and (a trace) the first rows by line number."""
    total = out.rejected + accepted
    return {"rejected_requests": int(out.rejected), "rejected_share": out.rejected / total if total else 0.0,
            "rejected_reason": out.rejected_reason, "rejected_lines": lines_text(out.rejected_lines)}


def lines_text(lines: tuple[int, ...]) -> str:
    """Trace line numbers as the summary shows them: '17, 243' (the first REJECTED_LINES_SHOWN,
    then how many more)."""
    shown = ", ".join(str(x) for x in sorted(lines)[:REJECTED_LINES_SHOWN])
    more = len(lines) - REJECTED_LINES_SHOWN
    return shown + (f" and {more:,} more" if more > 0 else "")


def own_utilisation(sc: Scenario, rate: float | None, capacity: RunCapacity | None) -> float:
    """The offered rate's share of the deployment's own measured capacity (speculation as
    configured), where the run was given it; NaN otherwise."""
    if rate is None or capacity is None or sc.disaggregation is not None:  # (its capacity is not measured)
        return float("nan")
    own = capacity.baseline if sc.speculative is None else capacity.speculative
    return rate / own.rps if own is not None and own.rps > 0 else float("nan")


def time_varying(sc: Scenario) -> bool:
    """Whether the offered rate or the rack changes over the run (a rate profile, autoscaling)."""
    return sc.workload.rate_profile is not None or sc.autoscale is not None


def replica_capacity(sc: Scenario, rt: ReplicaRuntime, capacity: RunCapacity | None = None) -> float | None:
    """The speculation-off capacity of one replica (req/s), when the run needs it: a
    target-utilisation autoscaler or a follow-load speculation policy (else None)."""
    spec = sc.speculative
    if not ((sc.autoscale is not None and sc.autoscale.policy == "target_utilisation")
            or (spec is not None and spec.policy == "follow_load")):
        return None
    assert capacity is not None  # (`simulate` has already named the fix when it is missing)
    return capacity.baseline.rps / rt.num_replicas


def replica_warmup_s(sc: Scenario) -> float:
    """A new replica's warm-up delay: autoscale.replica_warmup_s, or the weights' load time
    (sim.fleet.default_warmup_s); 0 without autoscaling."""
    auto = sc.autoscale
    if auto is None:
        return 0.0
    if auto.replica_warmup_s is not None:
        return auto.replica_warmup_s
    fmt = get_weight_format(sc.deployment.weights)
    total = weight_bytes(get_model(sc.deployment.model), fmt)
    spec = sc.speculative
    if spec is not None and spec.draft_model:
        total += weight_bytes(get_model(spec.draft_model), fmt)
    return default_warmup_s(total)


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
    """A closed loop (`arrival = "closed"`): its `RunOutput`, with the window (`window_start_s`,
    `window_end_s`).

    Sized by `num_requests`, the clients send them all and the window ends as the last send
    reaches the engine, included (after it the population shrinks); when they all went at t = 0 (N clients, at most N
    requests), over their drain (`sim.run.fixed_set_window`). Sized by `duration_s`, the clients
    send until duration_s from a pool of requests big enough never to run dry (checked: a pool
    that ran dry is doubled and the run repeated, so the result does not depend on the first
    guess), the requests in flight then complete, and the window ends at duration_s; requests
    never sent are not in the table. A
    trace sends each of its requests once, in order: one that runs out ends the window early, at
    its last send (included)."""
    wl = sc.workload
    assert wl.concurrency is not None
    pool = None if wl.num_requests is not None else closed_pool(sc, rt)
    while True:
        table = generate(wl, seed, None, pool=pool)
        think = column(table, "think_s") if "think_s" in table else None
        out = run_table(sc, rt, table, seed, concurrency=wl.concurrency, think_s=think, progress=progress,
                        send_until_s=None if pool is None else wl.duration_s)
        req = out.requests
        sent = ~np.isnan(column(req, "arrival_s", np.float64))
        if pool is None or not sent.all() or len(table) < pool or pool >= MAX_REQUESTS:
            break
        pool = min(MAX_REQUESTS, 2 * pool)  # the clients ran dry before duration_s: a bigger pool
    if pool is not None and not sent.all():
        end_s = wl.duration_s  # N clients were busy (or thinking) right up to duration_s
        reached = int(column(req, "id")[sent].max()) + 1  # the pool's requests the clients got to
        req = req.rows(sent)
        # the pool's requests the clients got to but never sent: too long for the deployment,
        # skipped (as vLLM rejects)
        skipped = reached - len(req)
        return dataclasses.replace(out, requests=req, rejected=skipped, window_end_s=end_s,
                                   rejected_reason=rejection_reason(rt) if skipped else "")
    start_s, end_s = fixed_set_window(column(req, "arrival_s", np.float64), column(req, "completion_s", np.float64),
                                      wl.warmup_s, out.horizon_s, rt.cost.eff.frontend_s)
    return dataclasses.replace(out, window_start_s=start_s, window_end_s=end_s)


def capacity_summary(sc: Scenario, store: CapacityStore | None = None) -> dict[str, Any]:
    """Capacity figures for summary.json and `specrack capacity --json`, measured now (or found
    in `store`): `capacity_rps` and friends for the deployment with speculation off (the
    reference of `utilisation`), and with a [speculative] table also `speculative_capacity_rps`
    (peak sustainable rate), `speculative_full_batch_rps` (the collapse figure),
    `speculative_peak_rps`, ...; and the closed-loop curve behind each."""
    cap = capacity_for(sc, with_capacity=True, store=store)
    assert cap is not None
    return cap.as_dict()
