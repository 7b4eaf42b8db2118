"""The live replica set over time: which replicas exist, which the router may send to, and the
processes that change it (the autoscaler, `[autoscale]`) or the speculation of its replicas (the
follow-load policy, `speculative.policy = "follow_load"`). docs/METRICS.md, 'Autoscaling'.

A replica is `off` (not allocated, not billed), `warming` (allocated and billed, loading the
model: it serves after the warm-up delay), `live` (routable) or `draining` (billed, finishing what
it holds: no new requests; it leaves, `off`, when empty). The router sends only to live
replicas. Without `[autoscale]` every replica is live from t = 0 to the end.

Decisions are taken at fixed ticks k x interval_s (and a replica warms up for a fixed delay), so
every time at which the routable set can change is known before the run: they are metric cuts
for step fusion (`change_times`), fused runs never straddle one, and `FleetBound` bounds when the
router can next reach a replica over the routable set only. Ticks fire URGENT (before any step
ending at the same instant), as arrivals do.
"""

from __future__ import annotations

import math
from collections.abc import Generator
from typing import Any

import numpy as np
import simpy
from simpy.events import URGENT, EventPriority

from sim.engine import Replica
from sim.scenario import Autoscale, Scenario
from sim.state import DRAINING, LIVE, OFF, WARMING, FuseBound, backlog_stop

BILLED = (WARMING, LIVE, DRAINING)
STATE_CODE = {OFF: 0, WARMING: 1, LIVE: 2, DRAINING: 3}
LOAD_BANDWIDTH_B_S = 5e9  # weights read from local NVMe at 5 GB/s (a healthy PCIe 4 drive)
ENGINE_START_S = 60.0  # vLLM start-up after the weights: torch.compile and CUDA-graph capture


def tick_times(interval_s: float, end_s: float) -> list[float]:
    """The times at which a process that starts at 0 and waits `t_k - now` before its k-th tick
    (t_k = k x interval_s) wakes up, computed with the same float operations SimPy makes
    (now + delay), so that they can be fusion cuts exactly."""
    out: list[float] = []
    now = 0.0
    k = 1
    while k * interval_s < end_s:
        now = now + (k * interval_s - now)
        out.append(now)
        k += 1
    return out


def timeout_with(env: simpy.Environment, delay: float, priority: EventPriority) -> simpy.Event:
    """A timeout of the given SimPy priority: URGENT fires before the ordinary events of its
    instant (steps ending then), a larger number after them."""
    ev = env.event()
    ev._ok = True
    ev._value = None
    env.schedule(ev, priority, delay)
    return ev


def _urgent(env: simpy.Environment, delay: float) -> simpy.Event:
    """A timeout that fires before the ordinary events of its instant (steps ending then)."""
    return timeout_with(env, delay, URGENT)


class Fleet:
    """The replicas of a run, their states over time and the routable (live) list, kept in index
    order (least-outstanding routing takes the first of the least loaded)."""

    def __init__(self, env: simpy.Environment, replicas: list[Replica], live: int,
                 routable: list[Replica] | None = None) -> None:
        self.env = env
        self.replicas = replicas
        self.state = [LIVE if i < live else OFF for i in range(len(replicas))]
        self.routable: list[Replica] = routable if routable is not None else []  # updated in place
        self.routable[:] = [r for r in replicas if self.state[r.idx] == LIVE]
        self.timeline: list[tuple[float, int, int]] = [(0.0, i, STATE_CODE[s]) for i, s in enumerate(self.state)]

    def set_state(self, i: int, state: str) -> None:
        if self.state[i] == state:
            return
        self.state[i] = state
        self.timeline.append((self.env._now, i, STATE_CODE[state]))
        self.routable[:] = [r for r in self.replicas if self.state[r.idx] == LIVE]

    def count(self, *states: str) -> int:
        return sum(s in states for s in self.state)

    def on_complete(self, _count: int) -> None:
        """A draining replica that has just emptied leaves (called as requests complete)."""
        for i, s in enumerate(self.state):
            if s == DRAINING and self._empty(i):
                self.set_state(i, OFF)

    def _empty(self, i: int) -> bool:
        r = self.replicas[i]
        return r.n_running == 0 and not r.waiting


def default_warmup_s(weight_bytes_per_replica: float) -> float:
    """A new replica's warm-up: its weights read at LOAD_BANDWIDTH_B_S plus ENGINE_START_S (140 GB
    of Llama-3.1-70B bf16: 28 s + 60 s). Weights from network storage take minutes: set
    autoscale.replica_warmup_s."""
    return weight_bytes_per_replica / LOAD_BANDWIDTH_B_S + ENGINE_START_S


class Autoscaler:
    """`[autoscale]`: every interval_s, the desired live replica count from the last interval
    (`target_utilisation`: ceil(offered rate / (target x capacity per replica)); `queue`:
    ceil(requests in system / target)), clipped to [min, max]. Up: draining replicas come back
    first (they are loaded), then off replicas start warming. Down: to the highest desired count of
    the last scale_down_window_s, replicas still warming are cancelled first, then the live replicas
    with the fewest outstanding requests drain."""

    def __init__(self, env: simpy.Environment, fleet: Fleet, cfg: Autoscale, *, max_replicas: int,
                 arrival: np.ndarray, done_count: Any, replica_capacity_rps: float, warmup_s: float,
                 end_s: float) -> None:
        self.env, self.fleet, self.cfg = env, fleet, cfg
        self.max_replicas, self.arrival, self.done_count = max_replicas, arrival, done_count
        self.cap, self.warmup_s, self.end_s = replica_capacity_rps, warmup_s, end_s
        self.history: list[tuple[float, int]] = []  # (tick, desired)
        self.starts = [0] * len(fleet.replicas)  # warm-ups started per replica (a cancelled one is stale)
        self.decisions: list[tuple[float, float, int, int]] = []  # (t, signal, desired, live after)
        env.process(self.run())

    def signal(self, now: float) -> float:
        """The policy's measured input: offered utilisation of the live replicas' capacity over
        the last interval, or requests in system."""
        if self.cfg.policy == "queue":
            return float(np.searchsorted(self.arrival, now, "right") - self.done_count())
        lo = np.searchsorted(self.arrival, now - self.cfg.interval_s, "left")
        hi = np.searchsorted(self.arrival, now, "left")
        return float(hi - lo) / self.cfg.interval_s

    def desired(self, sig: float) -> int:
        if self.cfg.policy == "queue":
            want = math.ceil(sig / self.cfg.target - 1e-9)
        else:
            want = math.ceil(sig / (self.cfg.target * self.cap) - 1e-9) if self.cap > 0 else self.max_replicas
        return int(min(self.max_replicas, max(self.cfg.min_replicas, want)))

    def run(self) -> Generator[simpy.Event, Any, None]:
        env, fleet = self.env, self.fleet
        for t in tick_times(self.cfg.interval_s, self.end_s):
            yield _urgent(env, t - env._now)
            now = env._now
            sig = self.signal(now)
            want = self.desired(sig)
            self.history.append((now, want))
            keep = [d for (tk, d) in self.history if tk > now - self.cfg.scale_down_window_s - 1e-9]
            target = max(want, max(keep))  # scale-down stabilisation: the highest recent recommendation
            up = fleet.count(LIVE, WARMING)
            if target > up:
                need = target - up
                for i, s in enumerate(fleet.state):
                    if need and s == DRAINING:
                        fleet.set_state(i, LIVE)
                        need -= 1
                for i, s in enumerate(fleet.state):
                    if need and s == OFF:
                        fleet.set_state(i, WARMING)
                        self.starts[i] += 1
                        env.process(self._warm(i, self.starts[i]))
                        need -= 1
            elif target < up:
                drop = up - target
                for i in reversed(range(len(fleet.state))):  # replicas still warming are cancelled first
                    if drop and fleet.state[i] == WARMING:
                        fleet.set_state(i, OFF)
                        drop -= 1
                live = [r for r in fleet.replicas if fleet.state[r.idx] == LIVE]
                for r in sorted(live, key=lambda r: (r.outstanding(), -r.idx))[:drop]:
                    fleet.set_state(r.idx, DRAINING)
                    if fleet._empty(r.idx):
                        fleet.set_state(r.idx, OFF)
            self.decisions.append((now, sig, want, fleet.count(LIVE)))

    def _warm(self, i: int, start: int) -> Generator[simpy.Event, Any, None]:
        yield _urgent(self.env, self.warmup_s)
        if self.fleet.state[i] == WARMING and self.starts[i] == start:  # not cancelled (and restarted) since
            self.fleet.set_state(i, LIVE)


class FollowLoad:
    """`speculative.policy = "follow_load"`: every load_interval_s, the load (offered rate over the
    last interval / (live replicas x speculation-off capacity per replica)); speculation turns off
    on every replica when it exceeds load_off_above, and on again only below load_on_below."""

    def __init__(self, env: simpy.Environment, fleet: Fleet, *, off_above: float, on_below: float,
                 interval_s: float, arrival: np.ndarray, replica_capacity_rps: float, end_s: float) -> None:
        self.env, self.fleet = env, fleet
        self.off_above, self.on_below, self.interval_s = off_above, on_below, interval_s
        self.arrival, self.cap, self.end_s = arrival, replica_capacity_rps, end_s
        self.on = True
        self.switches: list[tuple[float, float, bool]] = []  # (t, load, speculating after)
        env.process(self.run())

    def run(self) -> Generator[simpy.Event, Any, None]:
        for t in tick_times(self.interval_s, self.end_s):
            yield _urgent(self.env, t - self.env._now)
            now = self.env._now
            lo = np.searchsorted(self.arrival, now - self.interval_s, "left")
            hi = np.searchsorted(self.arrival, now, "left")
            live = max(1, self.fleet.count(LIVE))
            load = float(hi - lo) / self.interval_s / (live * self.cap) if self.cap > 0 else math.inf
            on = self.on
            if on and load > self.off_above:
                on = False
            elif not on and load < self.on_below:
                on = True
            if on != self.on:
                self.on = on
                for r in self.fleet.replicas:
                    r.price.speculating = on
            self.switches.append((now, load, on))


class FleetBound(FuseBound):
    """The fusion bound of an autoscaled open loop: the router sends only to live replicas (a
    replica not live gets nothing before the next change of the set, which is a cut); round robin
    over a changing set is bounded by the next arrival (conservative), least outstanding as in
    FuseBound over the live replicas."""

    fleet: Fleet

    def _routed_s(self, replica: int, outstanding: int | None = None) -> tuple[float, float]:
        assert self.routing is not None
        _, _, limit, router = self.routing
        fleet = self.fleet
        g = self.next_index
        stop = backlog_stop(g, fleet.replicas, limit, replica)
        if fleet.state[replica] != LIVE:
            j = stop
        elif router == "round_robin":
            j = g
        else:
            o = fleet.replicas[replica].outstanding() if outstanding is None else outstanding
            j = g + sum(max(0, o + (s.idx < replica) - s.outstanding()) for s in fleet.routable if s.idx != replica)
        return self._arrival_s(min(j, stop)), self._arrival_s(stop)


def change_times(sc: Scenario, warmup_s: float, end_s: float) -> list[float]:
    """Every time at which the routable set or the speculation switch can change: the
    autoscaler's ticks, each tick plus the warm-up delay (a replica started then becomes live),
    and the ticks of speculation that follows load (fused speculative runs never straddle one)."""
    out: list[float] = []
    cfg = sc.autoscale
    if cfg is not None:
        ticks = tick_times(cfg.interval_s, end_s)
        out += ticks + [t + warmup_s for t in ticks]
    spec = sc.speculative
    if spec is not None and spec.policy == "follow_load":
        out += tick_times(spec.load_interval_s, end_s)
    return out
