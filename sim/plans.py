"""What fused plans are made of: their limits, the exact landing of a planned run's end on the
SimPy clock (`land_at`), a closed loop's sends planned inside a run (`SendFeed`), and the segments of
a one-replica run (`RunSegment`, `SpecSegment`). Used by `sim.fusion` (one replica's runs) and
`sim.joint` (the rack's joint plan)."""

from __future__ import annotations

import math
from collections.abc import Generator
from typing import Any, Final, NamedTuple

import numpy as np
import simpy

from sim.state import ReplicaState

# a joint piece's queue operations in order, where it preempted (`sim.joint.Piece.ops`)
ADMIT_OP: Final = 0
PREEMPT_OP: Final = 1
FUSE_MAX_STEPS: Final = 4096  # longest fused run planned at once (a longer one is planned again at its end)
FUSE_MAX_PIECES: Final = 1024  # most segments and mixed steps a fused run admitting arrivals plans at once
NEAR: Final = 1e-9  # an arrival this close (relative) to a step boundary ends a run admitting arrivals
# most acceptance uniforms a fused speculative run draws at once (steps x sequences x k; its memory
# and the draws wasted when it stops early stay bounded; a longer run continues in the next one)
FUSE_MAX_DRAWS: Final = 1 << 16
# a speculative run of a plain chain with a fixed k starting with more sequences than this is planned by
# numpy's arrays (`sim.fusion.spec_run`); a smaller one, and every tree or adaptive run, step by step in
# scalars (`sim.fusion.spec_steps_run`)
SPEC_STEP_SEQS: Final = 64


def exact_delay(now: float, end_s: float) -> float:
    """A delay that SimPy adds to `now` to land exactly on `end_s` (end_s - now may miss it by an
    ulp): a planned piece ends at the very time its plan counted with (`sim.joint`). None exists
    when end_s is over twice now and falls between the sums of now and two neighbouring delays
    (`land_at` then lands within a factor 2 of it first)."""
    d = end_s - now
    for _ in range(8):
        s = now + d
        if s == end_s:
            break
        d = math.nextafter(d, math.inf if s < end_s else -math.inf)
    return d


def land_at(env: simpy.Environment, end_s: float) -> Generator[simpy.Event, Any, None]:
    """Timeouts that end exactly at `end_s`: one (`exact_delay`), or, where no single delay lands
    on it (end_s over twice now, between two rounded sums), one to within a factor 2 of it first,
    from where end_s - now is exact (Sterbenz) and lands."""
    d = exact_delay(env._now, end_s)
    if env._now + d != end_s:
        yield env.timeout(0.75 * end_s - env._now)
        d = end_s - env._now
    yield env.timeout(d)


class SendFeed:
    """The closed-loop sends a fused run plans itself (one replica; `sim.fusion.can_absorb`): each
    completion sends the table's next request at once (`sim.run.ClosedLoop`), which reaches the
    queue after the frontend's latency, or at once without one (then it waits for the next step,
    as the closed loop submits it inside the completing step's end). `times`/`rids`: the sends on
    their way to the queue, those already in flight when the run starts first; `sent`: the sends
    the run made, (request, send time); `exhausted`: a completion found the table sent out (the run
    ends there, so the done-watcher never misses the last completion)."""

    def __init__(self, loop: Any) -> None:
        self.loop = loop
        self.times: list[float] = [t for t, _ in loop.inflight]
        self.rids: list[int] = [r for _, r in loop.inflight]
        self.f = float(loop.frontend_s)
        self.next = int(loop.next)
        self.total = int(loop.reqs.arrival.size)
        self.sent: list[tuple[int, float]] = []
        self.exhausted = False

    def complete(self, t: float, count: int, pending: list[int]) -> int:
        """`count` completions at time t send as many requests; returns how many went straight
        to `pending` (no frontend latency)."""
        now = 0
        for _ in range(count):
            if self.next >= self.total:
                self.exhausted = True
                break
            rid = self.next
            self.next += 1
            self.sent.append((rid, t))
            if self.f > 0:
                self.times.append(t + self.f)
                self.rids.append(rid)
            else:
                pending.append(rid)
                now += 1
        return now

    def commit(self, replica: ReplicaState, admitted: set[int], end_s: float) -> None:
        """The run's sends, once its timeout fired: their send times, the loop's counters, and
        each one the run did not admit queued (it reached the queue by the run's end) or sent on
        its way through the frontend."""
        loop, reqs = self.loop, replica.reqs
        loop.next = self.next
        for rid, t in self.sent:
            reqs.arrival[rid] = t
            q = t + self.f if self.f > 0 else t
            if rid in admitted:
                reqs.replica[rid] = replica.idx
                loop.rr += 1
            elif q <= end_s:
                replica.enqueue(rid)
                loop.rr += 1
            else:
                loop.enqueue_at(rid, q)


class RunSegment(NamedTuple):
    """One segment of a fused run of plain decode steps (`sim.fusion.plan_run`): `steps` steps of
    the same sequences from `start_s`, the first lasting d0, each next one `slope` longer, ending
    at `end_s` (when `finishing`, with a sequence finishing); the contexts and KV blocks after it,
    the blocks it takes (`new_blocks`; `new_blocks_but_last`: in its first steps - 1, when
    `split`: its last step ends at or after the bound and is logged apart)."""

    steps: int
    d0: float
    slope: float
    split: bool
    ctx0: float
    finishing: bool
    start_s: float
    end_s: float
    computed_after: np.ndarray
    blocks_after: np.ndarray
    new_blocks: int
    new_blocks_but_last: int
    leaving: int = 0  # sequences finishing at its end, when the run goes on after it
    stay: np.ndarray | None = None  # ... and which stay (known from the plan; else found at its end)
    last_start_s: float = math.nan  # when its last step starts (the unfused engine's clock)


class SpecSegment(NamedTuple):
    """One segment of a fused run of speculative steps (`sim.fusion.plan_spec_segment`): `steps`
    steps of the same n sequences speculating k, the first starting at starts[0], ending at
    `end_s`; per step (arrays over its steps, or longer: only the first `steps` count) the costs,
    the tokens emitted and the KV blocks held after it (all but the last); per sequence the tokens
    it got, the drafts accepted, its context and tokens left after the segment; `finishing` when
    a sequence finished at its last step (`held_all`: blocks held after it, `held_gone`: those of
    the finished ones)."""

    n: int
    k: int
    steps: int
    end_s: float
    starts: np.ndarray
    total: np.ndarray
    target: np.ndarray
    draft: np.ndarray | float
    over: np.ndarray
    flops: np.ndarray
    nbytes: np.ndarray
    per_step: np.ndarray
    got: np.ndarray
    acc_sum: np.ndarray | None
    held_after: np.ndarray
    finishing: bool
    c_after: np.ndarray
    rem_after: np.ndarray
    held_all: int
    held_gone: int
    leaving: int = 0  # sequences finishing at its end, when the run goes on after it
    stay: np.ndarray | None = None  # ... and which stay
