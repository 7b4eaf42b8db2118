"""Step fusion for one replica: runs of steps the ordinary step would take one by one, planned ahead
and advanced in one SimPy timeout, then applied to the replica's state as if taken one by one (the
request table bit for bit; the step table run-length).

Which run is tried is the engine's choice (`sim.engine.Replica.run`):
- `plan_run` / `fused_run`: pure decode steps of the same batch in closed form (each step's
  duration affine in the context), through completions when nothing outside reacts to them;
- `absorbing_run`: also admitting the arrivals that reach this replica (one replica or round robin,
  or a closed loop of one replica, whose sends it plans: `sim.plans.SendFeed`);
- `spec_run` (numpy, large fixed-k chains) and `spec_steps_run` (scalars, step by step): speculative
  steps with every verification outcome drawn before the run;
- `run_piece`: a piece of the rack's joint plan under least outstanding (`sim.joint`), or of a
  closed loop's (`loop_run`).
Each returns the steps it advanced (0: none; the ordinary step is taken, and nothing has changed).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Generator
from typing import Any

import numpy as np
import simpy

from models.memory import BLOCK_SIZE
from sim.joint import Piece, loop_piece
from sim.plans import (
    FUSE_MAX_DRAWS,
    FUSE_MAX_PIECES,
    FUSE_MAX_STEPS,
    NEAR,
    PREEMPT_OP,
    SPEC_STEP_SEQS,
    RunSegment,
    SendFeed,
    SpecSegment,
    land_at,
)
from sim.policies import adaptive_choice, choose_k, policy_k
from sim.pricing import VerifyPlan
from sim.state import ReplicaState
from sim.step import (
    blocks_over,
    chunk_tokens,
    decode_clock_steps,
    decode_one,
    decode_spec,
    draft_counters,
    kv_steps,
    new_blocks_first,
    prefill_budget,
    prefill_sums,
    reserve_need,
)
from sim.tables import ROW, add_reduce, row_waiting, with_waiting


# ------------------------------------------------------------- step fusion
def fused_steps(rep: ReplicaState, absorbs: bool, loops: bool) -> Generator[simpy.Event, Any, int]:
    """The fused run the replica's state allows now, if any (the engine asks at every step boundary
    where fusion is on): without speculation a run admitting arrivals (`absorbs`: `can_absorb`, with
    room for every request waiting), else one of pure decode steps; with speculation a run planned
    step by step in scalars or, for a large batch of a plain fixed-policy chain, by arrays; then, for
    a closed loop of one replica (`loops`), a cursor's piece (partial prefills, chunked admissions).
    Returns the steps advanced (0: none; the ordinary step is taken)."""
    rt, spec = rep.rt, rep.rt.spec
    # (a run admitting arrivals admits every request waiting at its start, or none starts)
    room = absorbs and (not rep.waiting or rep.n_running + len(rep.waiting) <= rt.max_num_seqs)
    done_steps = 0
    if spec is None:
        if room:
            done_steps = yield from absorbing_run(rep)
        if not done_steps:
            segs = plan_run(rep)
            if segs is not None:
                done_steps = yield from fused_run(rep, segs)
    else:
        array = spec.shape is None and spec.policy != "adaptive"  # `spec_run` plans it too
        if not array or rep.n_running <= SPEC_STEP_SEQS:
            done_steps = yield from spec_steps_run(rep, room)
        if not done_steps and array:
            done_steps = yield from spec_run(rep)
    if not done_steps and loops:
        done_steps = yield from loop_run(rep)
    return done_steps


def can_chain(rep: ReplicaState) -> bool:
    """Whether a fused run may go on through completions: nothing outside the replica reacts
    to one (no `on_complete` hook: not a closed loop, no autoscaler), an open loop's bound
    (a closed loop's is the next event anywhere) and no prefix cache (a leaving sequence's
    blocks would join the cache the router reads)."""
    fb = rep.fuse
    return fb is not None and fb.arrivals and rep.reqs.on_complete is None and rep.cache is None


def plan_run(rep: ReplicaState) -> list[RunSegment] | None:
    """The next n >= 2 steps as one fused run, when they are pure decode steps the unfused loop
    would take one by one with nothing else changing: every running sequence decodes one token
    (no partial prefill, no speculation), no admission is possible (nothing waits, or no slot
    or no free block), the KV blocks the sequences grow into are free at every step (no
    preemption), no sequence finishes before the last step, every step of the run starts
    before anything could reach this replica (`FuseBound.next_s`; so the steps all start on
    one side of each metric window boundary) and the run ends before the horizon.

    When the run's last step completes a sequence, nothing waits and nothing outside reacts
    to a completion (`can_chain`), the run goes on with the smaller batch: the finished
    sequences leave at the exact end of that step and the next segment is planned from
    there, the same way (a segment of one step included), with the bound recomputed from the
    replica's reduced outstanding count under least-outstanding routing (fewer outstanding
    here: more arrivals may come here; the bound can only tighten). The segments, advanced
    in one timeout by `fused_run`, are returned; None for an ordinary step."""
    n = rep.n_running
    fb = rep.fuse
    assert fb is not None
    if n == 0 or (rep.waiting and n < rep.rt.max_num_seqs and rep.free_blocks > 0):
        return None
    c = rep.computed[:n]
    if (c < rep.target[:n]).any():
        return None
    rem = rep.out[:n] - rep.gen[:n]
    m = int(rem.min())  # a sequence finishes at step m
    if m < 2:
        return None
    t = rep.env._now
    bound, end_bound = fb.next_s(t, rep.idx)
    held = int(add_reduce(rep.blocks[:n]))
    seg = plan_segment(rep, t, n, c, m, rep.free_blocks, held, bound, end_bound, 2)
    if seg is None:
        return None
    segs = [seg]
    if not seg.finishing or seg.split or rep.waiting or not can_chain(rep):
        return segs
    least = fb.routing is not None and fb.routing[3] == "least_outstanding"
    free = rep.free_blocks
    while True:
        rem = rem - seg.steps
        keep = rem > 0
        held_all = held + seg.new_blocks
        c, rem, ba = seg.computed_after[keep], rem[keep], seg.blocks_after[keep]
        held = int(add_reduce(ba))
        segs[-1] = seg._replace(leaving=n - c.size, stay=keep)
        free += held_all - held - seg.new_blocks  # the finished sequences' blocks are freed
        n = c.size
        if n == 0:
            break
        t = seg.end_s
        if least:
            bound, end_bound = fb.next_s(t, rep.idx, outstanding=n)
        seg = plan_segment(rep, t, n, c, int(rem.min()), free, held, bound, end_bound, 1)
        if seg is None:
            break
        segs.append(seg)
        if not seg.finishing or seg.split:
            break
    return segs


# ------------------------------------------------------------- fused runs that admit arrivals
def can_absorb(rep: ReplicaState) -> bool:
    """Whether a fused run may also admit requests (`absorbing_run`): a run through
    completions (`can_chain`: an open loop, nothing reacting to a completion, no prefix cache)
    with mixed prefill, where the router sends a request regardless of the replicas' state
    (one replica, or round robin), so the arrivals that reach this replica, and when, are known
    from the request table. Under least outstanding a run could only admit the requests waiting
    when it starts and stop where a request could next be sent to it (often the next arrival):
    planning that costs as much as the ordinary step it replaces (measured: the default mix on
    two replicas 25% slower), so least outstanding keeps `plan_run`."""
    fb = rep.fuse
    if fb is None or rep.rt.prefill == "separate" or rep.reqs.preloaded is not None:
        return False  # (an admission with transferred KV: the ordinary step's rule, `step.preload_blocks`)
    loop = rep.reqs.closed
    if not fb.arrivals:  # a closed loop of one replica: the run plans the sends (`SendFeed`)
        return loop is not None and rep.cache is None
    if fb.routing is None or not can_chain(rep):
        return False
    _, reps, _, router = fb.routing
    return len(reps) == 1 or router == "round_robin"


def absorbing_run(rep: ReplicaState) -> Generator[simpy.Event, Any, int]:
    """A fused run that goes on through completions and through the arrivals that reach this
    replica, in one timeout; returns its steps (0: none planned, take an ordinary step).

    It is planned as the unfused loop would take its steps, in plain Python over scalars
    (`plan_absorbing`): pure decode segments while nothing arrives (priced and bounded as
    `plan_segment` does), and, after a step during which requests arrived, the mixed step
    that admits them and prefills them whole (priced by `StepPricer.spec_cost` as the ordinary step),
    then decode segments again. Every running sequence gains one token a step, so sequence e
    has context base_e + S after the run's S-th step: the context sum, the KV blocks the next
    steps take (a 16-bin histogram of base_e mod 16) and the next completion (a heap of the
    steps at which each finishes) are kept without arrays. The plan is applied when the
    timeout fires: admissions (from the waiting queue, where the arrival process has put
    them), completions, the slot arrays and the step rows, in the unfused engine's order."""
    plan = plan_absorbing(rep)
    if plan is None:
        return 0
    end_s, steps, rows, (done, gone), admitted, entries, s_end, free, feed = plan
    # (the completions inside the run are not shown to `outstanding` while it is in flight, as
    # `fused_run` shows them: with one replica or round robin no router reads it); the
    # admissions are, to `queued` (the backlog limit counts the requests waiting)
    rep.taken = [start for _, start, _ in admitted]
    yield from land_at(rep.env, end_s)  # (the end its plan counted with)
    rep.taken = []
    reqs = rep.reqs
    take_admitted(rep, admitted, feed)
    base, fin, rids, alive = entries
    n0 = rep.n_running
    if done:
        rep.finish_requests([rids[e] for e in gone], done, None)
    # the survivors, in slot order: the run's first sequences, then the admitted ones
    live = np.array(alive, dtype=bool)
    if not live[:n0].all():
        rep.compact(live[:n0])
    m0 = rep.n_running
    m = m0 + int(add_reduce(live[n0:]))
    if m > m0:
        nr = np.array(rids[n0:], dtype=np.int64)[live[n0:]]
        rep.ints[:, m0:m] = 0
        rep.rid[m0:m] = nr
        rep.target[m0:m] = reqs.prompt[nr] + reqs.generated[nr]
        rep.out[m0:m] = reqs.output[nr]
    if m:
        b = np.array(base, dtype=np.int64)[live] + s_end  # their contexts now
        rep.computed[:m] = b
        rep.blocks[:m] = (b + (BLOCK_SIZE - 1)) // BLOCK_SIZE
        rep.gen[:m] = rep.out[:m] - (np.array(fin, dtype=np.int64)[live] - s_end)
    rep.n_running = m
    rep.free_blocks = free
    end_absorbing(rep, rows, admitted, feed, end_s)
    return steps


def end_absorbing(rep: ReplicaState, rows: list[bytes], admitted: list[tuple[int, float, float]],
                   feed: SendFeed | None, end_s: float) -> None:
    """The end of a run admitting arrivals, its slots rebuilt: a closed loop's sends committed,
    the rows logged (each packed as doubles as it was planned, `ROW`; the last one's waiting
    count, when left to the queue, read from it)."""
    if feed is not None:
        feed.commit(rep, {r for r, _, _ in admitted}, end_s)
    if row_waiting(rows[-1]) < 0:  # its waiting count left to the queue (the run ends there)
        rows[-1] = with_waiting(rows[-1], len(rep.waiting))
    rep.log.extend_packed(b"".join(rows))


def take_admitted(rep: ReplicaState, admitted: list[tuple[int, float, float]], feed: SendFeed | None) -> None:
    """A run's admissions, once its timeout fired: taken from the waiting queue (where the
    arrival process, or the closed loop's frontend, put them; a send the run planned is not
    there), with their schedule and first-token times."""
    reqs = rep.reqs
    planned = {r for r, _ in feed.sent} if feed is not None else ()
    for rid, start, _ in admitted:
        if rid not in planned:
            got = rep.waiting.popleft()
            assert got == rid, (got, rid)
        if math.isnan(reqs.scheduled[rid]):
            reqs.scheduled[rid] = start
    if admitted:
        a = np.array([r for r, _, _ in admitted], dtype=np.int64)
        reqs.first_token[a] = np.array([f for _, _, f in admitted])


def leave_planned(heap: list[tuple[int, int]], S: int, t: float, base: list[int], hist: list[int],
                   alive: list[bool], done: list[float], gone: list[int], n: int, free: int,
                   sum_base: int) -> tuple[int, int, int]:
    """`plan_absorbing`'s completions after its S-th step, at time t: the entries finishing
    there leave the plan's state (their blocks freed); returns (sequences, free blocks,
    context base sum) after them."""
    B = BLOCK_SIZE
    while heap and heap[0][0] == S:
        _, e = heapq.heappop(heap)
        be = base[e]
        free += (be + S + (B - 1)) // B
        sum_base -= be
        h = be % B
        hist[h] = hist[h] - 1
        alive[e] = False
        done.append(t)
        gone.append(e)
        n -= 1
    return n, free, sum_base


def plan_absorbing(rep: ReplicaState) -> tuple[Any, ...] | None:
    """The plan of `absorbing_run` (see there), or None when it cannot start now (nothing
    runs and nothing waits, a partial prefill, a preempted request waiting, or no piece
    possible). The run stops, before the piece that would break a rule, where the ordinary
    loop must decide: a request that cannot be admitted and prefilled whole in its step (no
    slot, no block, a prompt longer than the token budget left), a decode step that would have
    to preempt, a metric window boundary (cut) with nothing arrived, an arrival within NEAR of
    a step boundary (the order of the two events is left to SimPy), an idle replica, the end
    bound (horizon, backlog limit) or FUSE_MAX_PIECES pieces."""
    n = rep.n_running
    waiting = rep.waiting
    if n == 0 and not waiting:
        return None
    if waiting and (n + len(waiting) > rep.rt.max_num_seqs or rep.free_blocks <= 0):
        return None  # not all of them can be admitted: `plan_run`'s runs with requests waiting
    c0 = rep.computed[:n]
    B = BLOCK_SIZE
    if n and ((c0 < rep.target[:n]).any()
              or int(add_reduce(rep.blocks[:n])) != int(add_reduce((c0 + (B - 1)) // B))):
        return None
    fb, rt, reqs = rep.fuse, rep.rt, rep.reqs
    assert fb is not None
    pending: list[int] = list(waiting)  # admitted at the next step, FCFS
    if pending and reqs.generated[pending].any():
        return None  # a preempted request (recompute): the ordinary loop
    rem0 = rep.out[:n] - rep.gen[:n]
    cost = rt.cost
    plain = rt.spec is None
    feed, queued, stride, j = arrival_source(rep)
    t = rep.env._now
    _, end_bound = fb.next_s(t, rep.idx)
    num_blocks = rt.plan.num_blocks
    budget_max = rt.max_num_batched_tokens
    base: list[int] = c0.tolist()
    fin: list[int] = rem0.tolist()  # the run step after which each finishes
    rids: list[int] = rep.rid[:n].tolist()
    alive = [True] * n
    hist = np.bincount(c0 % B, minlength=B).tolist()
    sum_base = int(add_reduce(c0))
    heap = [(fin[e], e) for e in range(n)]
    heapq.heapify(heap)
    free = rep.free_blocks
    S = 0
    steps = 0
    rows: list[bytes] = []  # its step rows, in order, each packed as doubles (`ROW`)
    done: list[float] = []  # completion times, in the order the entries leave ...
    gone: list[int] = []  # ... and those entries
    admitted: list[tuple[int, float, float]] = []
    min_steps = 2
    cut = fb.next_cut_s(t)  # the next metric window boundary (found again once passed)
    pieces = 0
    while pieces < FUSE_MAX_PIECES:
        if not pending:
            # ---- a decode segment from step S, time t
            m_fin = heap[0][0] - S
            ctx0 = float(sum_base + n * S)
            d0 = cost.decode_s(n, ctx0)
            if t >= cut:
                cut = fb.next_cut_s(t)
            arr_s = queued[j] * (1.0 - 1e-15) if j < len(queued) else math.inf
            bound = arr_s if arr_s < cut else cut
            limit = bound if bound < end_bound else end_bound
            mm = min(m_fin, FUSE_MAX_STEPS, int((limit - t) / d0) + 2)
            if mm < min_steps:
                break
            first = new_blocks_first(hist, S)
            mm = kv_steps(n, mm, free, first)
            if mm < min_steps:
                break
            # the last step starts before the bound, the segment ends before the end bound
            k, slope, st = decode_clock_steps(cost, n, ctx0, d0, t, mm, bound, end_bound)
            if k < min_steps:
                break
            end = float(st[k])
            split = end >= bound
            new_blocks = blocks_over(n, k, first)
            used0 = num_blocks - free
            but_last = blocks_over(n, k - 1, first)
            free -= new_blocks
            S += k
            steps += k
            t_prev, t = t, end
            n_seg = n
            sends = 0
            if heap[0][0] == S:
                n0_ = len(gone)
                n, free, sum_base = leave_planned(heap, S, t, base, hist, alive, done, gone, n, free,
                                                        sum_base)
                if feed is not None:
                    sends = feed.complete(t, len(gone) - n0_, pending)
            used = num_blocks - free
            stop = False
            waits = 0
            if split or sends:  # (its last step logs the requests waiting at its end: a row of its own)
                if split:
                    a0 = len(pending)
                    j, waits, stop = arrived(queued, j, stride, t, pending)
                    if feed is not None and waits:
                        pending[a0:] = [feed.rids[x] for x in pending[a0:]]
                if k > 1:
                    rows.append(ROW.pack(*rep.price.run_row(t_prev, k - 1, d0, slope, n_seg, ctx0, used0 + but_last,
                                                            0)))
                rows.append(ROW.pack(*rep.price.run_row(float(st[k - 1]), 1, d0 + (k - 1) * slope, 0.0, n_seg,
                                                        ctx0 + (k - 1) * n_seg, used, -1 if stop else waits + sends)))
            else:
                rows.append(ROW.pack(*rep.price.run_row(t_prev, k, d0, slope, n_seg, ctx0, used, sends)))
            pieces += 1
            min_steps = 1
            if stop or (n == 0 and not pending) or t >= end_bound or (feed is not None and feed.exhausted):
                break
            if not pending and (split or k != m_fin):
                break  # a cut, the KV blocks or the longest segment planned at once ended it
            continue
        # ---- the mixed step from step S, time t, admitting the `pending` requests
        need = hist[(-S) % B]  # decoding sequences taking a block this step
        if need > free:
            break
        free2 = free - need
        whole = whole_prompts(rep, pending, prefill_budget(budget_max, n), n, free2)
        if whole is None:
            break
        chunks, free2, (pre_tokens, pre_ctx, pre_pairs) = whole
        n_pre = len(chunks)
        ctx_dec = float(sum_base + n * S) if n else 0.0
        if plain:
            total_s, flops, nbytes = rep.price.plain_step(n, ctx_dec, n_pre, pre_tokens, pre_ctx, pre_pairs)
            target_s, over_s = total_s, 0.0
        else:
            total_s, target_s, _, over_s, flops, nbytes = rep.price.spec_cost(
                n, ctx_dec, 0, n_pre, pre_tokens, pre_ctx, pre_pairs, None)
        end = t + total_s
        if end >= end_bound:
            break
        step_rids = pending
        j, pending, waits, near = arrived_at(rep, queued, j, stride, end, feed)
        if near:  # an arrival at its end: which comes first is SimPy's
            break
        # the step is taken: admissions, one token each, completions
        free = free2
        n_dec = n
        for rid, chunk in zip(step_rids, chunks, strict=True):
            e = len(base)
            be = chunk - S - 1  # context `chunk` after this step
            base.append(be)
            out = int(reqs.output[rid])
            assert out >= 1
            fin.append(S + out)
            rids.append(rid)
            alive.append(True)
            heapq.heappush(heap, (S + out, e))
            h = be % B
            hist[h] = hist[h] + 1
            sum_base += be
            n += 1
            admitted.append((rid, t, end))
        S += 1
        steps += 1
        t_start, t = t, end
        sends = 0
        if heap[0][0] == S:
            n0_ = len(gone)
            n, free, sum_base = leave_planned(heap, S, t, base, hist, alive, done, gone, n, free, sum_base)
            if feed is not None:
                sends = feed.complete(t, len(gone) - n0_, pending)
        rows.append(ROW.pack(rep.idx, t_start, total_s, n_dec + n_pre, n_dec, pre_tokens, n_dec, n_dec + n_pre, 0,
                             num_blocks - free, waits + sends, flops, nbytes, target_s, 0.0, over_s,
                             total_s if n_dec else 0.0, 1, 0.0))
        pieces += 1
        min_steps = 1
        if (n == 0 and not pending) or t >= end_bound or (feed is not None and feed.exhausted):
            break
    if not rows:
        return None
    return t, steps, rows, (done, gone), admitted, (base, fin, rids, alive), S, free, feed


def arrival_source(rep: ReplicaState) -> tuple[SendFeed | None, list[float], int, int]:
    """Where a run admitting arrivals finds them: (the closed loop's planned sends or None,
    the times requests reach the queue, the stride between this replica's, the first one's
    index). Open loop: the request table's queued times, every `stride`-th from this
    replica's next (round robin); closed loop: the sends (`SendFeed`)."""
    fb = rep.fuse
    assert fb is not None
    if not fb.arrivals:
        feed = SendFeed(rep.reqs.closed)
        return feed, feed.times, 1, 0
    assert fb.routing is not None
    stride = len(fb.routing[1])
    g = fb.next_index
    return None, fb.times(), stride, g + (rep.idx - g) % stride  # the next arrival that reaches this replica


def whole_prompts(rep: ReplicaState, pending: list[int], budget: int, running: int,
                   free: int) -> tuple[list[int], int, tuple[float, float, float]] | None:
    """A mixed step's admissions in a run's plan, by the ordinary step's rules (`sim.step.plan_prefill`,
    `sim.step.fits_whole`): every pending request, FCFS, prefilled whole in the token `budget` left
    after the decodes (without chunked prefill the first goes whole even past it), with a slot
    and its KV blocks among `free`; None when one cannot (a chunk of it, or it waits: the
    ordinary loop decides). Returns the chunks, the blocks then free and the prefill's sums
    (tokens, context, attention pairs) as the ordinary step sums them."""
    rt, reqs = rep.rt, rep.reqs
    B = BLOCK_SIZE
    max_seqs, chunked = rt.max_num_seqs, rt.chunked_prefill
    full = budget
    chunks: list[int] = []
    for rid in pending:
        if not (budget > 0 and running < max_seqs and free > 0):
            break
        tokens = int(reqs.prompt[rid])
        nb = -(-tokens // B)
        if tokens <= 0 or nb > free or chunk_tokens(tokens, budget, budget == full, chunked) < tokens:
            break
        chunks.append(tokens)
        budget -= tokens
        free -= nb
        running += 1
    n_pre = len(chunks)
    if n_pre < len(pending):
        return None
    return chunks, free, prefill_sums(chunks, [0] * n_pre)


def arrived_at(rep: ReplicaState, queued: list[float], j: int, stride: int, t: float,
                feed: SendFeed | None) -> tuple[int, list[int], int, bool]:
    """`arrived` into a new list of pending requests (a closed loop's sends mapped from the
    feed's indices to their requests): (next index, the requests, how many, near)."""
    pending: list[int] = []
    j, waits, near = arrived(queued, j, stride, t, pending)
    if feed is not None and waits:
        pending = [feed.rids[x] for x in pending]
    return j, pending, waits, near


def arrived(queued: list[float], j: int, stride: int, t: float, pending: list[int]) -> tuple[int, int, bool]:
    """The arrivals that reach this replica (from j, `stride` apart) up to time t, appended to
    `pending`: (the next index, how many, whether one is within NEAR of t: then the run stops)."""
    a = 0
    nq = len(queued)
    while j < nq and queued[j] <= t:
        pending.append(j)
        j += stride
        a += 1
    # an arrival within NEAR (relative) of t: which of the two comes first is left to SimPy's
    # event order, not to the planner's float arithmetic
    tol = NEAR * (t if t > 1.0 else 1.0)
    near = (j < nq and abs(queued[j] - t) <= tol) or (a > 0 and abs(queued[j - stride] - t) <= tol)
    return j, a, near


def plan_segment(rep: ReplicaState, t: float, n: int, c: np.ndarray, m: int, free: int, held: int, bound: float,
                  end_bound: float, min_steps: int) -> RunSegment | None:
    """One segment of a fused run from time t: n sequences at contexts c (blocks held
    ceil(c / B), `held` in all), the first finishing at step m, `free` blocks free; its steps
    start before `bound` and it ends before `end_bound`. None when fewer than `min_steps`.

    Step j has the batch of step 0 with the context grown by j tokens per sequence, so its
    duration is d0 + j x slope (the step cost is affine in the context: the attention roofline
    is proportional to context + new tokens in both its branches)."""
    cost = rep.rt.cost
    finish = m
    ctx0 = float(add_reduce(c))
    d0 = cost.decode_s(n, ctx0)
    limit = bound if bound < end_bound else end_bound
    m = min(m, FUSE_MAX_STEPS, int((limit - t) / d0) + 2)  # durations never fall as the context grows
    if m < min_steps:
        return None
    # KV: sequence i needs a new block at step j when (c_i + j) % B == 0 (`kv_steps`; the
    # histogram only when even m // B + 1 blocks each may not fit)
    if n * (m // BLOCK_SIZE + 1) > free:
        first = [0, *np.cumsum(np.bincount((-c) % BLOCK_SIZE, minlength=BLOCK_SIZE)).tolist()]
        m = kv_steps(n, m, free, first)
        if m < min_steps:
            return None
    # steps starting before the bound (the last may end after it), the segment ending before the horizon
    k, slope, st = decode_clock_steps(cost, n, ctx0, d0, t, m, bound, end_bound)
    if k < min_steps:
        return None
    after = c + k
    ba = (after + (BLOCK_SIZE - 1)) // BLOCK_SIZE
    split = bool(st[k] >= bound)
    # blocks held after the first k - 1 steps (the row of a split segment's first part; a finishing
    # one may be split too: `fused_run`)
    but_last = int(add_reduce((after + (BLOCK_SIZE - 2)) // BLOCK_SIZE)) - held if split or k == finish else 0
    return RunSegment(k, d0, slope, split, ctx0, k == finish, t, float(st[k]), after, ba, int(add_reduce(ba)) - held,
                      but_last, last_start_s=float(st[k - 1]))


def fused_run(rep: ReplicaState, segs: list[RunSegment]) -> Generator[simpy.Event, Any, int]:
    """Advance a planned run's segments in one timeout, then apply them in order: contexts,
    outputs and KV blocks, the finished sequences leaving at their segment's end; each segment
    logged as one run-length row (two when `split`: its last step apart). Returns the steps."""
    env = rep.env
    waiting = len(rep.waiting)  # nothing reaches the replica before the last step starts
    num_blocks = rep.rt.plan.num_blocks
    rep.gone = [(seg.end_s, seg.leaving) for seg in segs if seg.leaving]
    yield from land_at(env, segs[-1].end_s)
    rep.gone = []
    steps = 0
    for seg in segs:
        n = rep.n_running
        k = seg.steps
        steps += k
        used0 = num_blocks - rep.free_blocks
        rep.free_blocks -= seg.new_blocks
        rep.computed[:n] = seg.computed_after
        rep.blocks[:n] = seg.blocks_after
        rep.gen[:n] += k
        sent = False
        if seg.finishing:
            queued = len(rep.waiting)
            rep.leave(seg.end_s, seg.stay)
            # (a closed loop without frontend latency submits the next requests inside the
            # completing step's end: that step logs them waiting, in a row of its own)
            sent = len(rep.waiting) != queued
        used_blocks = num_blocks - rep.free_blocks
        if seg.split or sent:
            if k > 1:
                log_run(rep, seg.start_s, k - 1, seg.d0, seg.slope, n, seg.ctx0,
                              used0 + seg.new_blocks_but_last, waiting)
            log_run(rep, seg.last_start_s, 1, seg.d0 + (k - 1) * seg.slope, 0.0, n, seg.ctx0 + (k - 1) * n,
                          used_blocks, len(rep.waiting))
        else:
            log_run(rep, seg.start_s, k, seg.d0, seg.slope, n, seg.ctx0, used_blocks, waiting)
    return steps


def log_run(rep: ReplicaState, start: float, steps: int, d0: float, slope: float, n: int, ctx0: float,
             used_blocks: int, waiting: int) -> None:
    """One step row for `steps` pure decode steps of n sequences (`StepPricer.run_row`)."""
    rep.log.append(rep.price.run_row(start, steps, d0, slope, n, ctx0, used_blocks, waiting))


def spec_run(rep: ReplicaState) -> Generator[simpy.Event, Any, int]:
    """A run of speculative decode steps in one timeout; returns how many steps it advanced
    (0: none, the loop takes an ordinary step, and nothing, the RNG included, has changed).

    The conditions at the run's first step are those of `plan_run` (every running sequence
    decodes, no admission possible, steps start before `FuseBound.next_s` and the run ends
    before the end bound), plus KV blocks held = ceil(computed / B) for every sequence (what
    every step leaves behind). Each segment of the run (`plan_spec_segment`) draws the
    acceptance outcomes of its candidate steps in one call (the uniforms the unfused loop
    would draw, in its order) and, vectorised over the steps, the tokens each step emits, the
    contexts, every step's cost (bit-identical to the ordinary step's), the KV reservation
    (k + 1 tokens, capped by what is left, then released to what was kept) and, for the
    adaptive policy, each step's choice of k. A segment stops after the first step where a
    sequence finishes, before the first step whose reservation would not fit (it would
    preempt) or whose k differs, and at the time bounds; the uniforms drawn for steps beyond
    it are given back (the generator is rewound to just after its draws).

    When a segment ends with sequences finishing, nothing waits, nothing outside reacts to a
    completion (`can_chain`) and k is not re-chosen from acceptance estimates (every policy but
    adaptive), the run goes on with the smaller batch from the exact end of that step, as
    `plan_run` does (the bound recomputed under least outstanding): the finished sequences
    leave at that end. So a fused run is the unfused loop's steps, to the last bit of every
    number but the clock (one timeout of the steps' summed durations)."""
    rt, env = rep.rt, rep.env
    spec = rt.spec
    fb = rep.fuse
    assert spec is not None and fb is not None
    n = rep.n_running
    if n == 0 or (rep.waiting and n < rt.max_num_seqs and rep.free_blocks > 0):
        return 0
    c = rep.computed[:n]
    if (c < rep.target[:n]).any():
        return 0
    rem = rep.out[:n] - rep.gen[:n]
    held = (c + (BLOCK_SIZE - 1)) // BLOCK_SIZE
    if int(rem.min()) < 2 or (rep.blocks[:n] != held).any():
        return 0
    k = choose_k(rep, np.ones(n, dtype=bool))
    now = env._now
    bound, end_bound = fb.next_s(now, rep.idx)
    free, held_sum = rep.free_blocks, int(add_reduce(held))
    nxt = rep.reqs.lead_off[rep.rid[:n]] + rep.n_verify[:n]  # each sequence's next outcome
    seg = plan_spec_segment(rep, now, c, rem, nxt, k, free, held_sum, bound, end_bound, 2)
    if seg is None:
        return 0
    segs = [seg]
    if seg.finishing and not rep.waiting and spec.policy != "adaptive" and can_chain(rep):
        least = fb.routing is not None and fb.routing[3] == "least_outstanding"
        while True:
            keep = seg.rem_after > 0
            c, rem = seg.c_after[keep], seg.rem_after[keep]
            nxt = (nxt + seg.steps if seg.k else nxt)[keep]
            segs[-1] = seg._replace(leaving=int(keep.size - c.size), stay=keep)
            # the blocks the segment took, then the finished sequences' freed
            free += seg.held_gone - (seg.held_all - held_sum)
            held_sum = seg.held_all - seg.held_gone
            n = c.size
            if n == 0:
                break
            t = seg.end_s
            if least:  # (never past the run's first bounds: a segment's last step may end past a
                # cut, such as a follow_load tick that switches speculation, and the next bound
                # found from there would be the cut after it)
                b2, e2 = fb.next_s(t, rep.idx, outstanding=n)
                bound, end_bound = min(bound, b2), min(end_bound, e2)
            k = policy_k(spec, n, rep.price.speculating)  # (not adaptive: fixed for the run, or by the batch)
            seg = plan_spec_segment(rep, t, c, rem, nxt, k, free, held_sum, bound, end_bound, 1)
            if seg is None:
                break
            segs.append(seg)
            if not seg.finishing:
                break
    waiting = len(rep.waiting)
    rep.gone = [(g.end_s, g.leaving) for g in segs if g.leaving]
    yield from land_at(env, segs[-1].end_s)
    rep.gone = []
    num_blocks = rt.plan.num_blocks
    steps_all = 0
    for g in segs:
        # state after the segment (what the unfused steps leave behind)
        n, k, steps = g.n, g.k, g.steps
        steps_all += steps
        got = g.got
        if k:
            assert g.acc_sum is not None
            rep.n_prop[:n] += k * steps
            rep.n_acc[:n] += g.acc_sum
            rep.n_verify[:n] += steps
            rep.n_vemit[:n] += got
        rep.gen[:n] += got
        rep.computed[:n] += got
        free0, held0 = rep.free_blocks, int(add_reduce(rep.blocks[:n]))
        new_held = (rep.computed[:n] + (BLOCK_SIZE - 1)) // BLOCK_SIZE
        rep.free_blocks -= int(add_reduce(new_held - rep.blocks[:n]))
        rep.blocks[:n] = new_held
        last = g is segs[-1]
        if last:
            rep.leave(env._now)
        else:
            rep.leave(g.end_s, g.stay)
        # one row per step, in one append
        q = k + 1
        rows = rep.log.block(steps)
        rows[:] = (rep.idx, 0.0, 0.0, n, n, 0.0, n * q, 0.0, k, 0.0, waiting, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1, 0.0)
        total, draft = g.total, g.draft
        rows[:, 1] = g.starts[:steps]
        rows[:, 2] = total[:steps]
        rows[:, 16] = rows[:, 2]
        rows[:, 7] = g.per_step[:steps]
        rows[:-1, 9] = g.held_after + (num_blocks - free0 - held0)
        rows[-1, 9] = num_blocks - rep.free_blocks
        if last:
            rows[-1, 10] = len(rep.waiting)
        rows[:, 11] = g.flops[:steps]
        rows[:, 12] = g.nbytes[:steps]
        rows[:, 13] = g.target[:steps]
        rows[:, 14] = draft if isinstance(draft, float) else draft[:steps]
        rows[:, 15] = g.over[:steps]
    return steps_all


def loop_run(rep: ReplicaState) -> Generator[simpy.Event, Any, int]:
    """The steps a cursor plans for a closed loop of this replica alone (`sim.joint.loop_piece`),
    as one piece; returns its steps (0: none planned, take an ordinary step)."""
    got = loop_piece(rep)
    if got is None:
        return 0
    piece, feed, rep.loop_hard = got  # (a cursor would stop at once at the next boundary: not tried there)
    return (yield from run_piece(rep, piece, feed))


def run_piece(rep: ReplicaState, piece: Piece, feed: SendFeed | None = None) -> Generator[simpy.Event, Any, int]:
    """A piece of the rack's joint plan (`sim.joint.Piece`), or of a closed loop's (with the
    sends it planned, `feed`: `sim.joint.loop_piece`): its steps in one timeout (two where one
    cannot land on its end: `land_at`), applied at
    its end as a run admitting arrivals is (`spec_steps_run`); returns its steps."""
    env = rep.env
    assert abs(piece.start_s - env._now) <= 1e-9 * max(1.0, env._now), (piece.start_s, env._now)
    rep.gone = piece.gone
    rep.gone_t = [t for t, _ in piece.gone]
    rep.gone_i = 0
    rep.gone_n = list(itertools.accumulate((c for _, c in piece.gone), initial=0))
    rep.taken = piece.taken
    rep.pre_t = piece.pre_t
    # (the arrival process's backlog bound counts these preemptions from the piece's start: an
    # upper bound stays one)
    rep.reqs.requeued += len(piece.preempted)
    yield from land_at(env, piece.end_s)
    rep.gone = []
    rep.gone_t = []
    rep.taken = []
    rep.pre_t = []
    reqs = rep.reqs
    planned = {r for r, _ in feed.sent} if feed is not None else set()  # (sent by the piece: never queued)
    if piece.ops is None:
        for adm, start in piece.admitted:  # (taken from the queue the arrival process put them in)
            if adm not in planned:
                got = rep.waiting.popleft()
                assert got == adm, (got, adm)
            if math.isnan(reqs.scheduled[adm]):
                reqs.scheduled[adm] = start
    else:  # it preempted: the queue's operations in order (a victim goes back to its head)
        fresh = set(planned)  # (a send's first admission takes it from no queue)
        for op, r in piece.ops:
            if op == PREEMPT_OP:
                rep.waiting.appendleft(r)
            elif r in fresh:
                fresh.discard(r)
            else:
                got = rep.waiting.popleft()
                assert got == r, (got, r)
        for adm, start in piece.admitted:
            if math.isnan(reqs.scheduled[adm]):
                reqs.scheduled[adm] = start
        for r, *was in piece.preempted:  # (as `ReplicaState.preempt_youngest` syncs them)
            reqs.generated[r] = was[0]
            if rep.rt.spec is not None:
                reqs.proposed[r], reqs.accepted[r], reqs.verify_steps[r], reqs.verify_emitted[r] = was[1:]
            reqs.preemptions[r] += 1
    if piece.first:
        reqs.first_token[[r for r, _ in piece.first]] = [f for _, f in piece.first]
    spec = rep.rt.spec is not None
    if piece.done:
        done = piece.done
        rep.finish_requests([d[0] for d in done], [d[1] for d in done],
                            ([d[2] for d in done], [d[3] for d in done], [d[4] for d in done], [d[5] for d in done])
                            if spec else None)
    rid, c, left, tgt, prop, acc, ver, vem = piece.state
    rep.restore(rid, c, left, tgt, (prop, acc, ver, vem) if spec else None, piece.free)
    if feed is not None:  # (the closed loop's sends for its completions: the piece made them)
        feed.commit(rep, {r for r, _ in piece.admitted}, piece.end_s)
    elif piece.done and reqs.on_complete is not None:  # (an autoscaled fleet: a draining replica emptied leaves)
        reqs.on_complete(len(piece.done))
    rep.log.extend_packed(piece.packed)
    return piece.steps


def spec_steps_run(rep: ReplicaState, absorb: bool) -> Generator[simpy.Event, Any, int]:
    """A fused run of speculative steps planned step by step in scalars (`plan_spec_steps`),
    in one timeout; returns its steps (0: none planned, take an ordinary step). `absorb`: the
    run also admits the arrivals that reach this replica (`can_absorb`). Applied when the
    timeout fires: admissions from the waiting queue, completions with their counters, the
    slot arrays (the run's first sequences in their order, then the admitted ones) and the
    step rows."""
    plan = plan_spec_steps(rep, absorb)
    if plan is None:
        return 0
    end_s, steps, rows, done, admitted, ent, free, feed, gone = plan
    rep.taken = [start for _, start, _ in admitted]
    rep.gone = gone
    yield from land_at(rep.env, end_s)  # (the end its plan counted with)
    rep.taken = []
    rep.gone = []
    reqs = rep.reqs
    take_admitted(rep, admitted, feed)
    C, R, RID, TGT, PROP, ACC, VER, VEM, active = ent
    if rep.cache is not None:
        # (with a prefix cache a run admits nothing and ends at its first completion: its
        # sequences keep their slots, and leave through `ReplicaState.leave`, which caches their blocks)
        n0 = rep.n_running
        cm = np.array(C[:n0], dtype=np.int64)
        rep.computed[:n0] = cm
        rep.blocks[:n0] = (cm + (BLOCK_SIZE - 1)) // BLOCK_SIZE
        rep.gen[:n0] = rep.out[:n0] - np.array(R[:n0], dtype=np.int64)
        rep.n_prop[:n0] = PROP[:n0]
        rep.n_acc[:n0] = ACC[:n0]
        rep.n_verify[:n0] = VER[:n0]
        rep.n_vemit[:n0] = VEM[:n0]
        rep.free_blocks = free - sum([(C[e] + (BLOCK_SIZE - 1)) // BLOCK_SIZE for e, _ in done])
        rep.leave(end_s)
        end_absorbing(rep, rows, admitted, feed, end_s)
        return steps
    if done:
        es = [e for e, _ in done]
        rep.finish_requests([RID[e] for e in es], [t for _, t in done],
                            ([PROP[e] for e in es], [ACC[e] for e in es], [VER[e] for e in es], [VEM[e] for e in es]))
    rep.restore([RID[e] for e in active], [C[e] for e in active], [R[e] for e in active], [TGT[e] for e in active],
                ([PROP[e] for e in active], [ACC[e] for e in active], [VER[e] for e in active],
                 [VEM[e] for e in active]), free)
    if done and reqs.on_complete is not None and feed is None:  # (a run ends at the first completion then)
        reqs.on_complete(len(done))
    end_absorbing(rep, rows, admitted, feed, end_s)
    return steps


def plan_spec_steps(rep: ReplicaState, absorb: bool) -> tuple[Any, ...] | None:
    """The plan of `spec_steps_run`: the steps the unfused loop would take, one by one in plain
    Python over the entries' scalars (context, tokens left, next outcome, counters), while
    every running sequence decodes: each step's k by the policy (adaptive: from the entries'
    estimates, `sim.policies.adaptive_pick`), its KV reservation (k + 1 tokens capped by what is left; a
    tree's every node, capped by the model's length), with `absorb` the FCFS admission of the
    arrivals of the previous step prefilled whole in the budget left (`whole_prompts`), its
    price (`StepPricer.spec_step`, or `StepPricer.spec_cost` with a prefill), each decoding sequence's outcome
    (`Requests.lead_b`), the rejected drafts' blocks released, first tokens and completions.

    None when no step can be planned now: nothing runs (and, with `absorb`, nothing waits), a
    partial prefill, KV blocks beyond what the contexts hold, a waiting request that cannot be
    admitted (with `absorb`) or could be (without: the ordinary step admits it), a preempted
    request waiting, or the adaptive policy over a tree. The run stops before the step that
    would break a rule, where the ordinary loop decides: a reservation that would preempt, a
    request that cannot be admitted whole, a step starting at the bound (without `absorb`: the
    first arrival that could reach this replica, recomputed after completions under least
    outstanding) or ending at the end bound, an arrival within NEAR of a step's end (with
    `absorb`), a metric cut under follow_load (a tick may switch speculation), a completion
    when a request waits for its slot or something outside reacts to it (`can_chain`), an idle
    replica, or FUSE_MAX_PIECES steps."""
    rt, fb, reqs = rep.rt, rep.fuse, rep.reqs
    spec = rt.spec
    assert spec is not None and fb is not None
    n = rep.n_running
    waiting = rep.waiting
    max_seqs = rt.max_num_seqs
    if absorb:
        if (n == 0 and not waiting) or (waiting and (n + len(waiting) > max_seqs or rep.free_blocks <= 0)):
            return None
    elif n == 0 or (waiting and n < max_seqs and rep.free_blocks > 0):
        return None
    policy = spec.policy
    shape = spec.shape
    if policy == "adaptive" and shape is not None:
        return None  # (its k is chosen by `sim.policies.choose_k_general`, over arrays)
    B = BLOCK_SIZE
    c0 = rep.computed[:n]
    if n and ((c0 < rep.target[:n]).any() or (rep.blocks[:n] != (c0 + (B - 1)) // B).any()):
        return None
    pending: list[int] = list(waiting) if absorb else []  # admitted at the next step, FCFS
    if pending and reqs.generated[pending].any():
        return None  # a preempted request (recompute): the ordinary loop
    # the entries (the run's sequences, then the admitted ones): context, tokens left, request,
    # next outcome in `lead_b`, prefill target, draft counters; `active`: the running ones in slot order
    C: list[int] = c0.tolist()
    R: list[int] = (rep.out[:n] - rep.gen[:n]).tolist()
    RID: list[int] = rep.rid[:n].tolist()
    NX: list[int] = (reqs.lead_off[rep.rid[:n]] + rep.n_verify[:n]).tolist()
    TGT: list[int] = rep.target[:n].tolist()
    PROP: list[int] = rep.n_prop[:n].tolist()
    ACC: list[int] = rep.n_acc[:n].tolist()
    VER: list[int] = rep.n_verify[:n].tolist()
    VEM: list[int] = rep.n_vemit[:n].tolist()
    active = list(range(n))
    # the draft counters are kept as offsets from what the loop keeps anyway (every entry
    # decodes at every step), so the outcome loop updates none of them: proposed = PROP + KS,
    # verifications = VER + NX, verification-emitted tokens = VEM + C - PS, accepted = ACC + C -
    # PS - NX (+ `fix`, the drafts accepted beyond the tokens left at an entry's last step);
    # see `joint.Cursor._offsets`. NX, the next outcome's index, is itself kept as an offset:
    # the index is NX + V (V: the steps with drafts so far), so no step writes it
    KS = PS = V = 0  # (V: steps with drafts; an entry's next outcome is at NX + V: `decode_spec`)
    fix: dict[int, int] = {}
    for e in active:
        ACC[e] = ACC[e] + (NX[e] - C[e])
        VER[e] = VER[e] - NX[e]
        VEM[e] = VEM[e] - C[e]
    lead = reqs.lead_b
    t = rep.env._now
    least = False
    feed: SendFeed | None = None
    queued: list[float] = []
    stride = j = 0
    if absorb:
        feed, queued, stride, j = arrival_source(rep)
        _, end_bound = fb.next_s(t, rep.idx)
        bound = math.inf
    else:
        bound, end_bound = fb.next_s(t, rep.idx)
        least = fb.routing is not None and fb.routing[3] == "least_outstanding"
    chains = absorb or can_chain(rep)
    blocked = bool(waiting) and not absorb  # a request waits for a slot or a block: a completion would admit it
    num_blocks = rt.plan.num_blocks
    budget_max = rt.max_num_batched_tokens
    max_len = rt.max_model_len
    free = rep.free_blocks
    held = sum([(x + (B - 1)) // B for x in C])
    ctx = sum(C)
    idx = rep.idx
    tree = shape is not None and not shape.chain
    rows: list[bytes] = []  # (each packed as doubles as it is planned: `ROW`)
    done: list[tuple[int, float]] = []  # (entry, completion time), in the order they leave
    gone: list[tuple[float, int]] = []  # (time, sequences) completing inside the run
    admitted: list[tuple[int, float, float]] = []
    steps = 0
    # step rows are one per step, so metric windows need no cut; speculation that follows the load
    # may switch at one (a FollowLoad tick): there the run ends
    cut = fb.next_cut_s(t) if policy == "follow_load" else math.inf
    speculating = rep.price.speculating  # (a FollowLoad tick, which switches it, ends the run: `cut`)
    waiting_now = len(waiting)
    while steps < FUSE_MAX_PIECES and t < cut and t < bound:
        n = len(active)
        if blocked and n < max_seqs and free > 0:
            break  # a waiting request could now be admitted: the ordinary step takes it
        chosen = None  # the adaptive choice prices every k: the chosen one's decode-only figures
        if policy == "adaptive":
            k, chosen = (adaptive_choice(rep.price, [ACC[e] + C[e] - PS - (NX[e] + V) for e in active],
                                               [PROP[e] + KS for e in active], float(ctx)) if n else (0, None))
        else:
            k = policy_k(spec, n, speculating)
        q = k + 1
        qv = spec.verify_tokens(k) if (tree and k) else q
        # the KV reservation of the decoding sequences (all of them): at most qv // B + 1 blocks
        # each, so with room for that and for every pending prompt whole it fits and admits
        # the same requests whatever it is exactly (its sum is not needed: held blocks after a
        # step are ceil(context / B), whatever was reserved)
        if free >= n * (qv // B + 1) + (sum([-(-int(reqs.prompt[rid]) // B) for rid in pending]) if pending else 0):
            need = 0
        else:
            need = reserve_need(C, R, active, q, qv, max_len)
        if need > free:
            break  # it would preempt: the ordinary loop
        n_pre = 0
        if pending:
            whole = whole_prompts(rep, pending, prefill_budget(budget_max, n * qv), n, free - need)
            if whole is None:
                break
            chunks, _, (pre_tokens, pre_ctx, pre_pairs) = whole
            n_pre = len(chunks)
            plan = (VerifyPlan(float(n) * qv, float(ctx) * qv + float(n) * (qv * qv if tree else qv * (qv + 1) / 2.0),
                               float(n), float(ctx)) if shape is not None and k and n else None)
            cost = rep.price.spec_cost(n, float(ctx) if n else 0.0, k, n_pre, pre_tokens, pre_ctx, pre_pairs, plan)
        elif n:
            cost = chosen if chosen is not None else rep.price.spec_step(n, float(ctx), k)
        else:
            break
        total = cost[0]
        end = t + total
        if end >= end_bound:
            break
        arrived: list[int] = []
        waits = 0
        if absorb:
            j, arrived, waits, near = arrived_at(rep, queued, j, stride, end, feed)
            if near:  # an arrival at its end: which comes first is SimPy's
                break
        # the step is taken: the decoding sequences' outcomes, then the admissions, then completions
        # (in the same pass: the blocks held after the step, ceil(context / B), and the finishing)
        if k:
            KS += k
            emitted, held2, left = decode_spec(C, R, NX, V, lead, k, active, fix)
            V += 1
        else:
            held2, left = decode_one(C, R, active)
            emitted = n
            PS += 1
        ctx += emitted
        free -= held2 - held
        held = held2
        for rid, chunk in zip(pending, chunks, strict=True) if n_pre else ():
            e = len(C)
            C.append(chunk)
            R.append(int(reqs.output[rid]) - 1)  # its first token, sampled at the end of its prefill
            RID.append(rid)
            nx = int(reqs.lead_off[rid])
            NX.append(nx - V)
            TGT.append(chunk)
            PROP.append(-KS)  # (offsets: nothing proposed, accepted or verified yet)
            ACC.append(PS - chunk + nx)
            VER.append(-nx)
            VEM.append(PS - chunk)
            active.append(e)
            nb = -(-chunk // B)
            free -= nb
            held += nb
            ctx += chunk
            admitted.append((rid, t, end))
            if R[e] <= 0:  # (after the decoding sequences: entries leave in slot order)
                left.append(e)
        emitted += n_pre
        t_start, t = t, end
        sends = 0
        if left:
            draft_counters(left, C, NX, V, PROP, ACC, VER, VEM, KS, PS, fix)
            for e in left:
                done.append((e, t))
                nb = (C[e] + (B - 1)) // B
                free += nb
                held -= nb
                ctx -= C[e]
            active = [e for e in active if R[e] > 0]
            gone.append((t, len(left)))
            if feed is not None:
                sends = feed.complete(t, len(left), arrived)
        pending = arrived
        last = not chains or (left and blocked) or (not absorb and t >= bound)
        # the requests waiting at its end: those that arrived during it (and a closed loop's sends);
        # without `absorb` nothing arrives before the bound (the run's last step's is read at its end)
        w = waits + sends if absorb else waiting_now
        rows.append(ROW.pack(idx, t_start, total, n + n_pre, n, pre_tokens if n_pre else 0.0, n * qv, emitted, k,
                             num_blocks - free, w, cost[4], cost[5], cost[1], cost[2], cost[3], total if n else 0.0, 1,
                             0.0))
        steps += 1
        if (not active and not pending) or t >= end_bound or (feed is not None and feed.exhausted):
            break
        if left and last:
            break
        if left and least:  # (never past the run's first bounds, as `spec_run`)
            b2, e2 = fb.next_s(t, rep.idx, outstanding=len(active))
            bound, end_bound = min(bound, b2), min(end_bound, e2)
        if not absorb and t >= bound:
            break
    if not rows:
        return None
    draft_counters(active, C, NX, V, PROP, ACC, VER, VEM, KS, PS, fix)  # (those done left with theirs)
    if not absorb and row_waiting(rows[-1]) >= 0:  # (the last step's waiting count, read at the run's end)
        rows[-1] = with_waiting(rows[-1], -1)
    return t, steps, rows, done, admitted, (C, R, RID, TGT, PROP, ACC, VER, VEM, active), free, feed, gone


def plan_spec_segment(rep: ReplicaState, now: float, c: np.ndarray, rem: np.ndarray, nxt: np.ndarray, k: int,
                       free: int, held_sum: int, bound: float, end_bound: float,
                       min_steps: int) -> SpecSegment | None:
    """One segment of `spec_run` from time `now`: the sequences at contexts c (KV blocks held
    ceil(c / B), `held_sum` in all) with `rem` tokens left, their next verification outcomes
    at `nxt` in `Requests.lead` (each step of depth k > 0 takes the next one of every
    sequence), speculating k, `free` blocks free; None when fewer than `min_steps` steps fit."""
    rt = rep.rt
    spec = rt.spec
    assert spec is not None
    n = c.size
    q = k + 1
    ctx0 = float(add_reduce(c))
    # step 0's duration, as the ordinary step prices it; later steps last longer (a longer
    # context). A first segment of one step would be the ordinary step at a higher cost: none
    # when the second step could not start before the bounds
    first = rep.price.spec_step(n, ctx0, k)
    d0 = first[0]
    limit = min(bound, end_bound)
    if min_steps >= 2 and now + d0 >= limit:
        return None
    m = min(int(rem.min()), FUSE_MAX_STEPS, int((limit - now) / d0) + 2,
            max(2, FUSE_MAX_DRAWS // (n * max(k, 1))))
    if m < min_steps:
        return None
    # 1. the candidate steps' outcomes: accepted drafts, tokens emitted (capped at what is left;
    # no sequence runs out of outcomes: m <= the tokens it has left)
    if k:
        acc = np.minimum(rep.reqs.lead[nxt[None, :] + np.arange(m)[:, None]], k).astype(np.int64)
        emit = acc + 1
    else:
        emit = np.ones((m, n), dtype=np.int64)
    cum = np.cumsum(emit, axis=0)
    fin = np.any(cum >= rem, axis=1)  # a sequence finishes at this step
    steps = int(np.argmax(fin)) + 1 if bool(fin[-1]) else m  # (once finished, always: cum only grows)
    cum, emit = cum[:steps], emit[:steps]
    before = cum - emit  # tokens emitted before each step
    emit = np.minimum(emit, rem - before)  # the finishing step emits what is left
    # 2. the KV reservation of each step fits (held blocks are ceil(c / B) at every step); it
    # surely does when every sequence could take steps x (k + 1) more tokens
    if free < n * ((steps * q) // BLOCK_SIZE + 1):
        grow = 1 if q == 1 else np.minimum(q, rem - before)
        fits = ((c + before + (grow + BLOCK_SIZE - 1)) // BLOCK_SIZE).sum(axis=1) <= free + held_sum
        if not fits.all():
            steps = int(np.argmin(fits))
    per_step = emit.sum(axis=1)
    ctx = (np.cumsum(per_step) - per_step + ctx0)[:steps]
    # 4. each step's cost, its start (the unfused clock: sequential sums) and the time bounds
    total, target, draft, over, flops, nbytes = rep.price.spec_cost_many(n, ctx[:steps], k)
    starts = np.cumsum(np.concatenate(([now], total)))
    steps = min(steps, int(np.searchsorted(starts[:steps], bound, "left")),
                int(np.searchsorted(starts[1:], end_bound, "left")))
    if steps < min_steps or steps < 1:
        return None
    got = emit[:steps].sum(axis=0)
    c_after = c + got
    held_all = int(add_reduce((c_after + (BLOCK_SIZE - 1)) // BLOCK_SIZE))
    rem_after = rem - got
    done = rem_after <= 0
    finishing = bool(done.any())
    return SpecSegment(
        n, k, steps, float(starts[steps]), starts, total, target, draft, over, flops, nbytes, per_step, got,
        acc[:steps].sum(axis=0) if k else None,
        # blocks held after each step but the last (the last's are known after the segment)
        ((c + (BLOCK_SIZE - 1) + cum[:steps - 1]) // BLOCK_SIZE).sum(axis=1),
        finishing, c_after, rem_after, held_all,
        int(add_reduce((c_after[done] + (BLOCK_SIZE - 1)) // BLOCK_SIZE)) if finishing else 0)
