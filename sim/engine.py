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
from models.memory import BLOCK_SIZE
from sim.fusion import absorbing_run, can_absorb, fused_run, loop_run, plan_run, run_piece, spec_run, spec_steps_run
from sim.joint import RackPlanner
from sim.plans import SPEC_STEP_SEQS
from sim.policies import choose_k
from sim.pricing import VerifyPlan, needs_general, plannable
from sim.state import FuseBound, ReplicaState
from sim.step import plan_prefill, prefill_pending, prefill_sums
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
        if self.rack is not None:
            self.rack.check(rid, self.idx)
        self.enqueue(rid)
        if self.idle and not self.wakeup.triggered:
            self.wakeup.succeed()

    def run(self) -> Generator[simpy.Event, Any, None]:
        env, rt, reqs = self.env, self.rt, self.reqs
        budget_max = rt.max_num_batched_tokens
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
                # (a run admitting arrivals admits every request waiting at its start, or none starts)
                room = absorbs and (not self.waiting or self.n_running + len(self.waiting) <= rt.max_num_seqs)
                if spec is None:
                    if room:
                        done_steps = yield from absorbing_run(self)
                        if done_steps:
                            decode_left = (decode_left - done_steps) % rt.scheduler_steps
                            continue
                    segs = plan_run(self)
                    if segs is not None:
                        done_steps = yield from fused_run(self, segs)
                        decode_left = (decode_left - done_steps) % rt.scheduler_steps
                        continue
                else:
                    done_steps = 0
                    array = spec.shape is None and spec.policy != "adaptive"  # `_spec_run` plans it too
                    if not array or self.n_running <= SPEC_STEP_SEQS:
                        done_steps = yield from spec_steps_run(self, room)
                    if not done_steps and array:
                        done_steps = yield from spec_run(self)
                    if done_steps:
                        decode_left = (decode_left - done_steps) % rt.scheduler_steps
                        continue
                if loops and not loop_hard:  # (a closed loop's partial prefills and chunked admissions: a cursor plans them)
                    done_steps = yield from loop_run(self)
                    if done_steps:
                        continue
            n = self.n_running
            dec = self.computed[:n] >= self.target[:n]
            all_dec = bool(dec.all())
            chunk_idx: list[int] = []
            chunks: list[int] = []
            preempted = stalling = False
            if separate and not (decode_left and dec.any()) and prefill_pending(self):
                # prefill steps of their own, scheduled first (vLLM V0's default scheduler, SGLang):
                # decodes wait while any prompt can be prefilled
                chunk_idx, chunks = plan_prefill(self, budget_max, dec, True, all_dec)
            plan: VerifyPlan | None = None
            matched = None
            if chunk_idx:
                k, n_dec = 0, 0
                stalling = bool(dec.any())
                ds: slice | np.ndarray = slice(0, 0)
            else:
                k = choose_k(self, dec)
                q = k + 1
                general = spec is not None and k > 0 and needs_general(spec)
                qv = spec.verify_tokens(k) if general and spec is not None else q
                matched = None
                if general and spec is not None and spec.on_match:
                    # suffix decoding proposes only where the suffix tree has a match this step
                    matched = self.rng.random(n) < self.reqs.match[self.rid[:n]]
                # 1. reserve KV blocks for decode tokens, preempting the youngest while short
                while True:
                    # tokens this step can write: k+1, but never past the request's remaining output
                    # (a running sequence always has at least one token left, so 1 needs no check);
                    # a tree writes the KV of all its nodes during verification (vLLM/SGLang reserve
                    # slots for the whole tree), never past the model's length
                    grow: int | np.ndarray
                    if q == 1:
                        grow = 1
                    elif qv != q:
                        grow = np.minimum(qv, rt.max_model_len - self.computed[:n])
                    elif matched is not None:
                        grow = np.where(matched[:n], np.minimum(q, self.out[:n] - self.gen[:n]), 1)
                    else:
                        grow = np.minimum(q, self.out[:n] - self.gen[:n])
                    need = (self.computed[:n] + (grow + BLOCK_SIZE - 1)) // BLOCK_SIZE - self.blocks[:n]
                    if not all_dec:
                        need *= dec  # blocks for the decoding sequences only
                    need_total = int(need.sum())
                    if need_total <= self.free_blocks:
                        break
                    self.preempt_youngest()
                    preempted = True
                    n = self.n_running
                    dec = dec[:n]
                if need_total:
                    self.blocks[:n] += need
                    self.free_blocks -= need_total
                n_dec = n if all_dec else int(dec.sum())
                decode_left = decode_left - 1 if decode_left else rt.scheduler_steps - 1
                # decoding entries: a slice (a cheap view) when every running sequence decodes
                ds = slice(0, n) if n_dec == n else np.flatnonzero(dec)
                # 2. prefill chunks in the budget left (mixed steps only); as in vLLM v1, nothing
                # is admitted in a step that had to preempt (the victim, back at the head of the
                # queue, would be readmitted into the blocks just taken from it)
                plan = (self.price.verify_plan(self.computed[ds], k, None if matched is None else matched[:n][ds])
                        if general else None)
                if not separate:
                    dec_tokens = n_dec * q if plan is None else round(plan.tokens)
                    chunk_idx, chunks = plan_prefill(self, budget_max - dec_tokens, dec, not preempted, all_dec)
            q = k + 1
            n_pre = len(chunk_idx)
            if n_dec == 0 and n_pre == 0:
                # nothing fits (KV exhausted by partial prefills): preempt the youngest and retry
                if self.n_running:
                    self.preempt_youngest()
                continue
            pre_tokens, pre_ctx, pre_pairs = prefill_sums(chunks, self.computed[chunk_idx].tolist())
            ctx_dec = float(self.computed[ds].sum()) if n_dec else 0.0
            total_s, target_s, draft_s, over_s, flops, nbytes = self.price.spec_cost(
                n_dec, ctx_dec, k, n_pre, pre_tokens, pre_ctx, pre_pairs, plan)
            start = env.now
            if joint:
                assert rack is not None
                rack.ordinary(self, start + total_s)
            yield env.timeout(total_s)
            now = env.now
            # 3a. decode / verification results
            emitted_total = 0
            if n_dec:
                if spec is not None and k > 0 and matched is not None:
                    # suffix: sequences without a match decoded one token and verified nothing
                    hit = matched[:n][ds]
                    acc = np.zeros(n_dec, dtype=np.int64)
                    d_hit = np.arange(n)[ds][hit]
                    acc[hit] = self.reqs.drafts_accepted(self.rid[d_hit], self.n_verify[d_hit], k)
                    emit = np.minimum(acc + 1, self.out[ds] - self.gen[ds])
                    self.n_prop[ds] += k * hit
                    self.n_acc[ds] += acc
                    self.n_verify[ds] += hit
                    self.n_vemit[ds] += emit * hit
                    emitted_total += int(emit.sum())
                elif spec is not None and k > 0:
                    acc = self.reqs.drafts_accepted(self.rid[ds], self.n_verify[ds], k)
                    emit = np.minimum(acc + 1, self.out[ds] - self.gen[ds])
                    self.n_prop[ds] += k  # a tree counts its depth (accepted <= proposed), not its nodes
                    self.n_acc[ds] += acc  # drafted tokens the target agreed with (vLLM's count)
                    self.n_verify[ds] += 1
                    self.n_vemit[ds] += emit
                    emitted_total += int(emit.sum())
                else:
                    emit = 1  # one token each: a running sequence always has one left
                    emitted_total += n_dec
                self.gen[ds] += emit
                self.computed[ds] += emit
                # release blocks reserved for rejected draft tokens
                if k > 0:
                    keep = -(-self.computed[ds] // BLOCK_SIZE)
                    self.free_blocks += int((self.blocks[ds] - keep).sum())
                    self.blocks[ds] = keep
            # 3b. prefill progress; a finished prefill samples one token
            for j, chunk in zip(chunk_idx, chunks, strict=True):  # (entries are distinct)
                self.computed[j] += chunk
                if self.cache is not None:  # prefill work done, and its full units join the cache
                    reqs.prefill_computed[self.rid[j]] += chunk
                    self.register(j)
            for j in chunk_idx:
                if self.computed[j] >= self.target[j]:
                    if self.gen[j] == 0:
                        reqs.first_token[self.rid[j]] = now
                    self.gen[j] += 1
                    emitted_total += 1
            # 3c. finished sequences leave
            self.leave(now)
            used_blocks = self.rt.plan.num_blocks - self.free_blocks
            # the gap the decoding sequences saw since their previous streamed chunk: this step,
            # plus the prefill-only steps that ran since the last decode (separate prefill)
            gap = 0.0
            if n_dec:
                gap, stalled_s = total_s + stalled_s, 0.0
            elif chunk_idx and stalling:
                stalled_s += total_s
            dec_tok = n_dec * q if plan is None else plan.tokens
            self.log.append((self.idx, start, total_s, n_dec + n_pre, n_dec, pre_tokens, dec_tok, emitted_total, k,
                             used_blocks, len(self.waiting), flops, nbytes, target_s, draft_s, over_s, gap, 1, 0.0))
