"""The engine run: a request table replayed through one continuous-batching engine per replica,
open loop (arrivals at the table's times) or closed loop (clients that send their next request
when the previous one completes). `run_table` returns the request and step tables; metrics and
economics live in `sim.metrics` and `sim.simulate`.

Order at equal simulated times, by construction: arrivals are URGENT (an URGENT event, or taken
without one where no event comes first: `_arrivals`), so a request arriving at the instant a step
ends is queued before that replica plans its next step; replicas
at the same instant go in index order (SimPy processes same-time events FIFO).
"""

from __future__ import annotations

import gc
import math
import sys
import time
from collections import deque
from collections.abc import Generator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import simpy
from simpy.events import URGENT, EventPriority

from models.speculative import acceptance_at_quantile, acceptance_draws
from sim.deployment import ReplicaRuntime, check_fits, rejection_reason
from sim.deployment import fits as request_fits
from sim.engine import Replica
from sim.fleet import Autoscaler, Fleet, FleetBound, FollowLoad, change_times, timeout_with
from sim.frame import Frame, as_frame, column
from sim.joint import RackPlanner
from sim.metrics import SloWatch
from sim.scenario import Scenario
from sim.state import FuseBound
from sim.tables import STEP_INT_COLUMNS, Requests, StepLog
from sim.workload import streams

if TYPE_CHECKING:
    from sim.frame import Table

PROGRESS_TICKS = 200  # progress bar updates over a run's arrivals (`_watch_done`)
GC_YOUNG_THRESHOLD = 200_000  # allocations between collections of the GC's youngest generation during a run


@dataclass(frozen=True, eq=False)
class RunOutput:
    """What one engine run returns (`run_table`): the request table (one row per request of the
    table that fitted the deployment) and the step table (one row per engine step, or per run of
    fused decode steps), whether the run stopped at the backlog limit (`truncated`), the simulated
    time it ended at (`horizon_s`), the requests rejected as too long for the deployment, and
    what the run's processes recorded: the certain SLO failure it stopped at (`stopped_early`:
    `SloWatch.failed`'s answer), the fleet's state changes (`fleet`: rows of time, replica, state
    code; `sim.fleet`), the autoscaler's decisions (`autoscale`: time, signal, desired, live
    after) and the follow-load speculation switches (`follow_load`: time, load, speculating
    after); each None when the run had no such process. `window_start_s`, `window_end_s`: the
    metric window [start, end) when the run itself decides it (a closed loop: `run_closed`), else
    None (start None: warmup_s). `host_evicted_blocks`: the KV blocks the replicas' host tiers dropped
    over the whole run (None without a host tier)."""

    requests: Frame
    steps: Frame
    truncated: bool
    horizon_s: float
    rejected: int = 0
    rejected_arrival_s: np.ndarray | None = None
    rejected_reason: str = ""
    rejected_lines: tuple[int, ...] = ()
    stopped_early: dict[str, Any] | None = None
    fleet: list[tuple[float, int, int]] | None = None
    autoscale: list[tuple[float, float, int, int]] | None = None
    follow_load: list[tuple[float, float, bool]] | None = None
    window_end_s: float | None = None
    window_start_s: float | None = None
    host_evicted_blocks: int | None = None


def fixed_set_window(sent: np.ndarray, completion: np.ndarray | None, warmup_s: float,
                     horizon_s: float = math.inf, frontend_s: float = 0.0) -> tuple[float, float]:
    """The metric window [start, end) of a run of a fixed set of requests (`num_requests`, a
    trace replayed to its end, a closed loop that sent them all), from the send times of its
    requests (`sent`, NaN for never sent) and their completions: from warmup_s until the last
    request reaches the engine's queue (its send plus the frontend's latency, `frontend_s`),
    included (`end` is the next float after it), so the last send counts. (A fused run of steps
    never straddles that instant, an event of the run: step metrics stay exact.) A burst (every
    request sent at one instant, as benchmark tools send) has no arrival process to warm up
    through or to time: its window runs from that instant (or warmup_s, if earlier) over its
    whole drain, to the last completion included (to `horizon_s` when some request never
    completed; just past its queueing before the run, `completion` None)."""
    t = sent[~np.isnan(sent)]
    if t.size == 0:
        return warmup_s, warmup_s
    first, last = float(t.min()), float(t.max())
    if last > first:
        return warmup_s, float(np.nextafter(last + frontend_s, math.inf))
    end = first + frontend_s
    if completion is not None:
        done = completion[~np.isnan(completion)]
        end = float(done.max()) if 0 < done.size == t.size else horizon_s
    return min(warmup_s, first), float(np.nextafter(max(end, first), math.inf))


def _arrivals(env: simpy.Environment, times: np.ndarray, replicas: list[Replica], router: str,
              stop: simpy.Event, backlog_limit: int, fuse: FuseBound | None = None,
              pool: list[Replica] | None = None, every: bool = False) -> Generator[simpy.Event, Any, None]:
    """Replay the request table: one URGENT event per distinct arrival time (published to
    `fuse`, when given, as the time before which fused steps must end), or none where no other
    event comes before it (the process moves the clock there itself: the same events in the same
    order, at the same times; most arrivals of a fused or jointly planned run). The run stops once more
    than `backlog_limit` requests wait at the replicas the router may send to, checked after each
    arrival. That sum is taken only when an upper bound on it exceeds the limit: the last sum over
    every replica of the run (`pool`, filled before the first arrival; by default `replicas`),
    plus the requests queued since (arrivals and preemptions). With an autoscaler the routable
    replicas change (a draining replica brought back rejoins the sum with its queue), so the
    bound is kept over all of them. `every`: the sum after every arrival (the bound's oracle, in
    the tests)."""
    n = times.size
    # Python floats (the same values): numpy scalars make every comparison and subtraction slow
    at: list[float] = fuse.times() if fuse is not None and fuse.routing is not None else times.tolist()
    i = 0
    rr = 0
    everyone = replicas if pool is None else pool
    bound = 0  # at least the requests waiting now, at every replica
    requeued = 0
    queue = env._queue
    while i < n:
        t = at[i]
        now = env._now  # (the clock itself: `now` is a property, a Python call per read)
        if t > now:
            t_ev = now + (t - now)  # the arrival event's exact time (SimPy's `schedule` adds the delay to now)
            if fuse is not None:
                fuse.next_arrival_s = t_ev
                fuse.next_index = i
            if queue and (queue[0][0] < t_ev or (queue[0][0] == t_ev and queue[0][1] <= URGENT)):
                yield timeout_with(env, t - now, URGENT)
            else:  # no event comes before it: it is the next event, taken now (no SimPy event, same order)
                env._now = t_ev
        now = env._now
        while i < n and at[i] <= now:
            _route(replicas, router, rr, i).submit(i)
            rr += 1
            i += 1
            bound += 1
        if everyone:
            reqs = everyone[0].reqs
            bound += reqs.requeued - requeued
            requeued = reqs.requeued
        if bound > backlog_limit or every:
            waiting = sum(r.queued() for r in replicas)
            if waiting > backlog_limit and not stop.triggered:
                stop.succeed("backlog")
                return
            bound = waiting if everyone is replicas else sum(r.queued() for r in everyone)
    if fuse is not None:
        fuse.next_arrival_s = float("inf")
        fuse.next_index = n  # every request delivered


# prefix_affinity's guards, SGLang's cache-aware router defaults (sgl-router / SMG: --cache-threshold
# 0.3, --balance-abs-threshold 64, --balance-rel-threshold 1.5)
AFFINITY_MIN_MATCH: Final = 0.3  # share of the prompt the best replica must hold cached to win the request
AFFINITY_BALANCE_ABS: Final = 64  # imbalanced when max - min outstanding exceeds this ...
AFFINITY_BALANCE_REL: Final = 1.5  # ... and max exceeds min x this: then least outstanding, caches ignored


def _route(replicas: list[Replica], router: str, rr: int, rid: int) -> Replica:
    if router == "round_robin":
        return replicas[rr % len(replicas)]
    if router == "least_outstanding" or len(replicas) == 1:
        # the first with the fewest (`min` with a key, as a compiled loop: native calls, no key object)
        pick = replicas[0]
        least_o = pick.outstanding()
        for r in replicas[1:]:
            o = r.outstanding()
            if o < least_o:
                pick, least_o = r, o
        return pick
    # prefix_affinity (SGLang's cache-aware router): while the replicas are balanced, the one
    # holding the longest cached prefix of the prompt (ties: fewer outstanding, then lower index),
    # if it holds at least AFFINITY_MIN_MATCH of the prompt; otherwise least outstanding
    loads = [r.outstanding() for r in replicas]
    lo, hi = min(loads), max(loads)
    least = replicas[loads.index(lo)]
    if hi - lo > AFFINITY_BALANCE_ABS and hi > lo * AFFINITY_BALANCE_REL:
        return least
    match = [r.prefix_match_tokens(rid) for r in replicas]
    best = max(range(len(replicas)), key=lambda j: (match[j], -loads[j], -j))
    if match[best] < AFFINITY_MIN_MATCH * float(replicas[best].reqs.prompt[rid]):
        return least
    return replicas[best]


class ClosedLoop:
    """Closed-loop clients (as `vllm bench serve --max-concurrency N`): `concurrency` clients each
    send the table's next request when their previous one completes (after an optional think
    time), so the number of requests in the system stays at `concurrency`. With `not_before`
    (open-loop arrival times, as `--request-rate R --max-concurrency N`), a request is sent at
    the later of its arrival time and a free client. Arrival times are written into the request
    table as requests are sent (latencies count from the send, as vLLM's benchmark times them)."""

    def __init__(self, env: simpy.Environment, reqs: Requests, replicas: list[Replica], router: str,
                 concurrency: int, think_s: np.ndarray | None = None, not_before: np.ndarray | None = None,
                 until_s: float = np.inf, frontend_s: float = 0.0) -> None:
        self.env, self.reqs, self.replicas, self.router = env, reqs, replicas, router
        self.frontend_s = frontend_s
        self.think_s = think_s
        self.until_s = until_s  # no request is sent from this time on
        self.not_before = not_before  # open-loop arrival times behind a concurrency cap
        self.next = 0
        self.thinks = 0
        self.rr = 0
        # sends on their way through the frontend, in order: (time they reach the queue, request)
        self.inflight: deque[tuple[float, int]] = deque()
        reqs.on_complete = self._completed
        # one replica, each completion sending the table's next request at once: a fused run may
        # plan the sends itself (`sim.fusion.can_absorb`)
        reqs.closed = self if (think_s is None and not_before is None and until_s == np.inf
                               and len(replicas) == 1) else None
        for _ in range(concurrency):  # all clients send at t = 0
            self._send()

    def _send(self) -> None:
        if self.next >= self.reqs.arrival.size or self.env._now >= self.until_s:
            return
        i = self.next
        self.next += 1
        if self.not_before is not None and self.not_before[i] > self.env._now:
            self.env.process(self._submit_at(i, float(self.not_before[i])))
            return
        self._submit(i)

    def _submit(self, i: int) -> None:
        self.reqs.arrival[i] = self.env._now
        if self.frontend_s > 0:  # the request reaches the engine's queue after the frontend
            self.inflight.append((self.env._now + self.frontend_s, i))
            self.env.process(self._enqueue_after(i, self.frontend_s))
            return
        _route(self.replicas, self.router, self.rr, i).submit(i)
        self.rr += 1

    def _enqueue_after(self, i: int, delay: float) -> Generator[simpy.Event, Any, None]:
        yield self.env.timeout(delay)
        got = self.inflight.popleft()
        assert got[1] == i, (got, i)
        _route(self.replicas, self.router, self.rr, i).submit(i)
        self.rr += 1

    def enqueue_at(self, i: int, t: float) -> None:
        """Request i, sent inside a fused run that planned the send, reaches the queue at time t
        (after the run's end: through the frontend)."""
        self.inflight.append((t, i))
        self.env.process(self._enqueue_after(i, t - self.env._now))

    def _submit_at(self, i: int, t: float) -> Generator[simpy.Event, Any, None]:
        yield self.env.timeout(t - self.env._now)
        self._submit(i)

    def _after(self, delay: float) -> Generator[simpy.Event, Any, None]:
        yield self.env.timeout(delay)
        self._send()

    def _completed(self, count: int) -> None:
        for _ in range(count):
            if self.think_s is None:
                self._send()
            else:  # one think time per completion, in completion order (never shared between clients)
                delay = float(self.think_s[self.thinks]) if self.thinks < self.think_s.size else 0.0
                self.thinks += 1
                self.env.process(self._after(delay))


def run_table(sc: Scenario, rt: ReplicaRuntime, table: Table, seed: int, *,
              horizon_s: float | None = None, backlog_limit: int | None = None,
              progress: bool = False, concurrency: int | None = None,
              think_s: np.ndarray | None = None, gate_arrivals: bool = False,
              send_until_s: float | None = None, replica_capacity_rps: float | None = None,
              warmup_s: float = 0.0,
              stop_on_slo: tuple[float, float, dict[str, float]] | None = None) -> RunOutput:
    """Run the engine over a request table. Returns its `RunOutput` (requests, steps, truncated,
    horizon and what the run's processes recorded).

    Open loop (default): requests arrive at the table's `arrival_s`. Closed loop (`concurrency`
    given): the table's arrival times are ignored; `concurrency` clients send its requests in
    order, each after its previous one completed (plus `think_s[i]` before request i if given);
    with `gate_arrivals`, also no earlier than the table's `arrival_s` (a concurrency cap on an
    open-loop stream). With `send_until_s`, the clients send nothing from that time on (requests
    of the table never sent keep a NaN arrival_s).

    Open loop only: with `[autoscale]` the live replica set changes over time (`sim.fleet`; a new
    replica serves `warmup_s` after it is started), and with speculative.policy "follow_load"
    speculation switches with the load; both need `replica_capacity_rps` (the speculation-off
    capacity of one replica). The fleet's state changes are in `RunOutput.fleet` (rows of time,
    replica, state code), the autoscaler's decisions in `RunOutput.autoscale`, the speculation
    switches in `RunOutput.follow_load`.

    `stop_on_slo` (open loop only): (warmup_s, end_s, SLO targets) of the run's window; the run
    ends as soon as its SLO is certain to fail (`sim.metrics.SloWatch`), with what made it fail in
    `RunOutput.stopped_early`."""
    table = as_frame(table)
    wl = sc.workload
    method = sc.speculative.acceptance_key if sc.speculative else "draft_model"
    means = np.array([c.acceptance_for(method) if sc.speculative else 0.0 for c in wl.classes])
    spreads = np.array([c.acceptance_spread for c in wl.classes])
    # requests longer than the model (or the KV cache) allows are rejected, as vLLM does
    check_fits(sc, rt, column(table, "prompt_tokens"), column(table, "output_tokens"))  # all rejected: error
    fits = request_fits(rt, column(table, "prompt_tokens"), column(table, "output_tokens"))
    rejected = int((~fits).sum())
    rej_arrival = column(table, "arrival_s", np.float64)[~fits]
    rejected_lines = tuple(int(x) for x in table["trace_line"][~fits]) if "trace_line" in table else ()
    known = column(table, "arrival_s", np.float64)
    known = known[~np.isnan(known)]  # (a closed loop's are NaN: sent during the run)
    table_arrival_max = float(known.max()) if known.size else float("nan")
    if rejected:
        table = table.rows(fits)
    arrival = column(table, "arrival_s", np.float64)
    cls = column(table, "cls")
    acc = acceptance_at_quantile(column(table, "accept_q"), means[cls], spreads[cls])
    reqs = Requests(arrival, column(table, "prompt_tokens", np.int64), column(table, "output_tokens", np.int64), acc)
    preloaded = None
    if "preloaded_tokens" in table:  # a disaggregated decode pool's requests (sim/disagg.py)
        preloaded = reqs.preloaded = column(table, "preloaded_tokens", np.int64).copy()
        if "draft_prefill_tokens" in table:
            reqs.draft_pending = column(table, "draft_prefill_tokens", np.int64).copy()
    if sc.speculative is not None and sc.speculative.method == "suffix":  # per-request match probability
        reqs.match = np.array([c.suffix_match or 0.0 for c in wl.classes])[cls]
    # prefix caching acts when it is on and the requests carry block hashes (sim/workload.py)
    units = rt.prefix_caching and "unit_keys" in table
    if units:
        reqs.set_units(table["unit_keys"].tolist(), table["unit_blocks"].tolist())
    env = simpy.Environment()
    log = StepLog()
    rs = streams(seed)
    engine_rng = rs["engine"]
    if rt.spec is not None and rt.spec.k > 0:  # every request's verification outcomes, drawn now
        reqs.set_draws(*acceptance_draws(rs["verify"], rt.spec.depth_probs(acc), reqs.output))
    rngs = [np.random.default_rng(s) for s in np.random.SeedSequence(int(engine_rng.integers(2**63))).spawn(rt.num_replicas)]
    stop = env.event()
    frontend = rt.cost.eff.frontend_s
    limit = backlog_limit if backlog_limit is not None else 20 * rt.max_num_seqs
    limit *= rt.num_replicas
    replicas: list[Replica] = []
    loop: ClosedLoop | None = None
    # fused steps never straddle the metric window's ends (warm-up, the last arrival or the
    # duration), so a run-length step row lies wholly inside or outside it (docs/METRICS.md)
    cuts: tuple[float, ...] = (wl.warmup_s, wl.duration_s, table_arrival_max)
    fleet: Fleet | None = None
    scaler: Autoscaler | None = None
    follow: FollowLoad | None = None
    if concurrency is None:
        # the engine queues a request after the frontend's latency (HTTP, tokenisation); its
        # arrival (the client's send) stays, so TTFT and E2E include the frontend
        queued = arrival + frontend if frontend > 0 else arrival
        drain = sc.sim.drain_s if sc.sim.drain_s is not None else max(wl.duration_s, 600.0)
        horizon = horizon_s if horizon_s is not None else (float(arrival[-1]) if arrival.size else 0.0) + drain
        # per-interval metrics (the intervals table) are exact: fused runs never straddle an interval's end
        # (the bound's periodic cuts, period_s = sim.interval_s)
        auto = sc.autoscale
        dynamic = auto is not None or (sc.speculative is not None and sc.speculative.policy == "follow_load")
        if dynamic:
            cuts += tuple(change_times(sc, warmup_s, horizon))
        routing = (queued, replicas, limit, sc.deployment.router)
        fuse = None
        if sc.sim.fuse_steps:
            fuse = FleetBound(env, horizon, cuts, routing=routing, period_s=sc.sim.interval_s) if auto is not None \
                else FuseBound(env, horizon, cuts, routing=routing, period_s=sc.sim.interval_s)
        routable: list[Replica] = [] if dynamic else replicas  # the replicas the router may send to
        env.process(_arrivals(env, queued, routable, sc.deployment.router, stop, limit, fuse, pool=replicas))
        replicas.extend(Replica(env, i, rt, reqs, rngs[i], log, fuse) for i in range(rt.num_replicas))
        spec = sc.speculative
        rack: RackPlanner | None = None
        if (fuse is not None and sc.deployment.router == "least_outstanding" and rt.num_replicas > 1
                and rt.prefill == "mixed" and not units and preloaded is None
                and all(r.fuse is not None for r in replicas)
                and not (spec is not None and spec.policy == "adaptive" and rt.spec is not None and rt.spec.shape is not None)):
            rack = RackPlanner(replicas, fuse, horizon, limit)  # the replicas planned jointly (sim/joint.py)
            for r in replicas:
                r.rack = rack
        if dynamic:
            start = rt.num_replicas
            if auto is not None:
                start = auto.initial_replicas or auto.min_replicas
            fleet = Fleet(env, replicas, start, routable)
            if isinstance(fuse, FleetBound):
                fuse.fleet = fleet
            if rack is not None:  # (it routes to live replicas only, and plans up to the next change of them)
                rack.fleet, rack.changes = fleet, sorted(set(change_times(sc, warmup_s, horizon)))
            cap = replica_capacity_rps if replica_capacity_rps is not None else 0.0
            if auto is not None:
                reqs.on_complete = fleet.on_complete
                scaler = Autoscaler(env, fleet, auto, max_replicas=auto.max_replicas or rt.num_replicas, arrival=queued,
                                    done_count=lambda: reqs.n_done, replica_capacity_rps=cap, warmup_s=warmup_s,
                                    end_s=horizon)
            spec = sc.speculative
            if spec is not None and spec.policy == "follow_load":
                follow = FollowLoad(env, fleet, off_above=spec.load_off_above, on_below=spec.load_on_below,
                                    interval_s=spec.load_interval_s, arrival=queued, replica_capacity_rps=cap,
                                    end_s=horizon)
    else:
        release = arrival.copy() if gate_arrivals else None
        arrival = reqs.arrival = np.full(arrival.size, np.nan)  # written as the clients send
        horizon = horizon_s if horizon_s is not None else 1e12  # a closed loop ends when its requests are done
        fuse = FuseBound(env, horizon, cuts, arrivals=False) if sc.sim.fuse_steps else None
        replicas.extend(Replica(env, i, rt, reqs, rngs[i], log, fuse) for i in range(rt.num_replicas))
        loop = ClosedLoop(env, reqs, replicas, sc.deployment.router, concurrency, think_s, release,
                          np.inf if send_until_s is None else send_until_s, frontend)
    bar = Progress(arrival.size, sc.name) if progress else None
    # open loop: no request can complete before the last one is queued (the check is skipped until then)
    quiet_s = float(queued[-1]) if concurrency is None and queued.size else 0.0
    done_ev = env.process(_watch_done(env, reqs, bar, loop, quiet_s))
    ends: list[simpy.Event] = [stop, env.timeout(horizon), done_ev]
    failed: simpy.Event | None = None
    if stop_on_slo is not None and concurrency is None:
        warm, end, targets = stop_on_slo
        watch = SloWatch(arrival, reqs.output, warmup_s=warm, end_s=end, targets=targets)
        if watch.checks:
            failed = env.event()
            ends.append(failed)
            env.process(_watch_slo(env, reqs, watch, warm, max(SLO_CHECK_PERIOD_MIN_S, (end - warm) / SLO_CHECKS), failed))
    # the run allocates a tuple per step row and per event, nearly all freed by reference counting
    # (no bundled scenario leaves more than a few hundred objects in cycles, a simulated day
    # included): the cyclic GC's youngest generation is collected less often meanwhile (the GC's
    # time over 60 of the default sweep's points: 4.2% of their CPU at 20,000, 1.6% at 200,000,
    # nearly all of it then outside the run), and set back after
    thresholds = gc.get_threshold()
    gc.set_threshold(max(thresholds[0], GC_YOUNG_THRESHOLD), *thresholds[1:])
    try:
        env.run(until=simpy.AnyOf(env, ends))
    finally:
        gc.set_threshold(*thresholds)
    if bar is not None:
        bar.close()
    for r in replicas:
        r.sync()
    truncated = stop.triggered
    req_df = Frame({
        "id": table["id"], "cls": table["cls"], "replica": reqs.replica,
        "arrival_s": arrival, "scheduled_s": reqs.scheduled, "first_token_s": reqs.first_token,
        "completion_s": reqs.completion, "prompt_tokens": reqs.prompt, "output_tokens": reqs.output,
        "generated_tokens": reqs.generated, "preemptions": reqs.preemptions, "acceptance": acc,
        "draft_proposed": reqs.proposed, "draft_accepted": reqs.accepted, "verify_steps": reqs.verify_steps,
        "verify_emitted": reqs.verify_emitted,
    })
    for col in ("conversation", "turn"):  # multi-turn conversations (sim/workload.py)
        if col in table:
            req_df[col] = table[col]
    if units:  # prefix caching: what each request found cached and computed (docs/METRICS.md)
        req_df["cached_tokens"] = reqs.cached_tokens
        req_df["prefill_cached_tokens"] = reqs.prefill_cached
        req_df["prefill_computed_tokens"] = reqs.prefill_computed
        req_df["prefill_tokens"] = reqs.prefill_tokens
        if rt.host_kv_blocks:  # a host tier behind the prefix cache
            req_df["host_cached_tokens"] = reqs.host_cached
    # one array per column, built block by block (no second copy of the rows), and not copied again
    steps = Frame(log.columns(STEP_INT_COLUMNS))
    return RunOutput(req_df, steps, truncated, float(env._now), rejected=rejected,
                     rejected_arrival_s=rej_arrival, rejected_lines=rejected_lines,
                     rejected_reason=rejection_reason(rt) if rejected else "",
                     stopped_early=failed.value if failed is not None and failed.triggered else None,
                     fleet=fleet.timeline if fleet is not None else None,
                     autoscale=scaler.decisions if scaler is not None else None,
                     follow_load=follow.switches if follow is not None else None,
                     host_evicted_blocks=host_evicted(replicas) if rt.host_kv_blocks else None)


def host_evicted(replicas: list[Replica]) -> int:
    """KV blocks the replicas' host tiers dropped (sim/prefix_cache.py)."""
    return sum(r.cache.host_evicted_blocks for r in replicas if r.cache is not None)


LATE = EventPriority(2)  # a SimPy event priority after URGENT (0) and NORMAL (1): processed after both at its instant
SLO_CHECKS = 100  # a run stopping on a certain SLO failure checks its window at least 100 times ...
SLO_CHECK_PERIOD_MIN_S = 10.0  # ... at least 10 simulated seconds apart while no count is under way ...
SLO_CHECK_MIN_S = 2.0  # ... and at least 2 s apart when one nears its failing count


def _watch_slo(env: simpy.Environment, reqs: Requests, watch: SloWatch, start_s: float, period_s: float,
               failed: simpy.Event) -> Generator[simpy.Event, Any, None]:
    """Triggers `failed` (with `SloWatch.failed`'s answer) at the first check, after everything
    else due at its instant, at which the run's SLO is certain to fail. Checks come every
    `period_s` from `start_s` on, and sooner (down to SLO_CHECK_MIN_S) once a target's count is
    under way: the next at the time its count, growing at its pace so far, would reach the
    failing count. It only reads the request table: the run is the same until it fires."""
    t = start_s + period_s
    while True:
        if t > env._now:
            yield timeout_with(env, t - env._now, LATE)
        got = watch.failed(reqs.first_token, reqs.completion, env._now)
        if got is not None:
            failed.succeed(got)
            return
        step = period_s
        p = watch.progress
        if p > 0.0:  # its count would reach the failing count in about (1 - p) / p times the time so far
            step = min(period_s, max(SLO_CHECK_MIN_S, (env._now - start_s) * (1.0 - p) / p))
        t = env._now + step


def _watch_done(env: simpy.Environment, reqs: Requests, progress: Progress | None = None,
                loop: ClosedLoop | None = None, quiet_s: float = 0.0) -> Generator[simpy.Event, Any, None]:
    """Ends the run once every request has completed (checked once per simulated second), or
    for closed-loop clients that stopped sending (`send_until_s`), every request they sent; and
    drives the progress bar (share of requests completed) when one is given. The checks before
    `quiet_s` (when they cannot succeed) are one timeout to the last whole second before it, or
    with a bar at most PROGRESS_TICKS of them: the same check times after it (whole seconds, exact
    in floats), and no event a second over the arrivals (each would also stop the arrival process
    taking its arrivals without events: `_arrivals`). Each check runs after everything else due at
    its instant (priority LATE), so it sees a completion at exactly that time, whichever event was
    scheduled first."""
    total = reqs.completion.size
    skip = math.floor(quiet_s) if loop is None else 0
    if skip >= 2:
        tick = skip - 1 if progress is None else max(1, (skip - 1) // PROGRESS_TICKS)
        at = 0
        while at < skip - 1:
            step = min(tick, skip - 1 - at)
            yield timeout_with(env, float(step), LATE)
            at += step
            if progress is not None:
                progress.update(reqs.n_done)
    while True:
        yield timeout_with(env, 1.0, LATE)
        if progress is not None:
            progress.update(reqs.n_done)
        if loop is not None and env._now >= loop.until_s:
            total = loop.next  # nothing more is sent
        if reqs.n_done >= total:
            return


class Progress:
    """A progress bar on stderr that appears only once a run has taken more than `after_s`."""

    def __init__(self, total: int, label: str, after_s: float = 3.0) -> None:
        self.total, self.label, self.after_s = total, label, after_s
        self.t0 = time.perf_counter()
        self.last = 0.0
        self.shown = False

    def update(self, done: int) -> None:
        el = time.perf_counter() - self.t0
        if el < self.after_s or (el - self.last < 0.5 and done < self.total):
            return
        self.shown, self.last = True, el
        frac = done / max(1, self.total)
        sys.stderr.write(f"\r{self.label} [{'#' * int(30 * frac):<30}] {done}/{self.total} requests, {el:.0f}s")
        sys.stderr.flush()

    def close(self) -> None:
        if self.shown:
            sys.stderr.write("\n")
