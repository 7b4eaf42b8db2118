"""One continuous-batching engine per replica: a SimPy process, one timeout per engine step (or
per fused run of steps).

`Replica` is the process: it waits while idle, takes the rack's joint plan's next piece when it has
one (`sim.joint`), else the longest fused run its state allows (`sim.fusion`), else one ordinary
step by the step rules (`sim.step`: their order is written there), priced by its `StepPricer`
(`sim.pricing`), with k from its speculation policy (`sim.policies`). The state it works on is
`sim.state.ReplicaState`; the unfused step is the oracle the fused paths are tested against
(tests/test_fusion.py).
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import numpy as np
import simpy

from models.cost import CostModel
from sim.fusion import can_absorb, fused_steps, run_piece
from sim.joint import RackPlanner
from sim.pricing import plannable
from sim.state import FuseBound, ReplicaState
from sim.step import finish_step, plan_step
from sim.tables import Requests, StepLog

if TYPE_CHECKING:
    from sim.deployment import ReplicaRuntime


class Replica(ReplicaState):
    """A tensor-parallel replica running a continuous-batching engine loop (the SimPy process)."""

    def __init__(self, env: simpy.Environment, idx: int, rt: ReplicaRuntime, reqs: Requests,
                 rng: np.random.Generator, log: StepLog, fuse: FuseBound | None = None) -> None:
        # step fusion: off when None, for a cost model without arrays, for a step cost not affine
        # in the context (sliding-window layers), and for the speculation methods of the general
        # path (trees, depth profiles, windowed self-drafts, suffix matches: `spec_cost_many`
        # prices the plain chain only)
        spec = rt.spec
        spec_ok = spec is None or (plannable(spec) and (
            spec.draft_cost is None or (isinstance(spec.draft_cost, CostModel) and spec.draft_cost.affine_in_context)))
        scalar = spec_ok and isinstance(rt.cost, CostModel) and rt.cost.affine_in_context
        super().__init__(env, idx, rt, reqs, rng, log, fuse if scalar else None, spec is not None and scalar)
        self.wakeup = env.event()
        self.idle = True
        self.rack: RackPlanner | None = None  # least outstanding over several replicas: planned jointly (sim/joint.py)
        self.proc = env.process(self.run())

    def submit(self, rid: int) -> None:
        """A request routed here joins the waiting queue (checked against the rack planner's
        routing, when it plans); an idle replica wakes."""
        if self.rack is not None:
            self.rack.check(rid, self.idx)
        self.enqueue(rid)
        if self.idle and not self.wakeup.triggered:
            self.wakeup.succeed()

    def run(self) -> Generator[simpy.Event, Any, None]:
        """The engine loop: idle until a request arrives; then, at each step boundary, the rack
        planner's piece, a fused run or one ordinary step (the module docstring)."""
        env, rt = self.env, self.rt
        spec = rt.spec
        separate = rt.prefill == "separate"
        stalled_s = 0.0  # prefill-only steps run since the last decode while sequences were ready to decode
        decode_left = 0  # multi-step scheduling: decode steps still due before prefills are considered again
        absorbs = can_absorb(self)  # fixed for the run (router, replicas, prefill mode, hooks, cache)
        loops = absorbs and self.fuse is not None and not self.fuse.arrivals and not (
            spec is not None and spec.policy == "adaptive" and spec.shape is not None)  # a closed loop of one replica
        rack = self.rack
        while True:
            if self.n_running == 0 and not self.waiting:
                self.idle = True
                self.wakeup = env.event()
                if rack is not None:
                    rack.went_idle(self)
                yield self.wakeup
                self.idle = False
            joint = False  # this step is the joint plan's (it could not plan it: reported as ordinary)
            loop_hard, self.loop_hard = self.loop_hard, False  # (read at the boundary right after that piece)
            if rack is not None:
                piece = rack.boundary(self)
                if piece is not None:
                    done_steps = yield from run_piece(self, piece)
                    decode_left = (decode_left - done_steps) % rt.scheduler_steps
                    continue
                joint = not rack.broken
            if self.fuse is not None and stalled_s == 0.0 and not joint:
                done_steps = yield from fused_steps(self, absorbs, loops and not loop_hard)
                if done_steps:
                    decode_left = (decode_left - done_steps) % rt.scheduler_steps
                    continue
            step = plan_step(self, separate, decode_left > 0)
            if step.decoding:
                decode_left = decode_left - 1 if decode_left else rt.scheduler_steps - 1
            if step.empty:  # nothing fits (KV exhausted by partial prefills): the youngest was preempted
                continue
            start = env._now
            if joint:
                assert rack is not None
                rack.ordinary(self, start + step.total_s)
            yield env.timeout(step.total_s)
            emitted = finish_step(self, step, env._now)
            # the gap the decoding sequences saw since their previous streamed chunk: this step,
            # plus the prefill-only steps that ran since the last decode (separate prefill)
            gap = 0.0
            if step.n_dec:
                gap, stalled_s = step.total_s + stalled_s, 0.0
            elif step.stalling:
                stalled_s += step.total_s
            self.log.append(step.row(self.idx, start, emitted, self.rt.plan.num_blocks - self.free_blocks,
                                     len(self.waiting), gap))
