"""Joint planning of a rack's replicas under least-outstanding routing (step fusion across replicas).

Under least outstanding a request goes to the replica with the fewest requests running or waiting
when it arrives, so which arrivals reach a replica depends on every replica's completions before
them: a replica planning alone must stop at the first arrival that could reach it (`FuseBound`),
which is nearly every arrival. `RackPlanner` plans all replicas together instead, as the unfused
engine would take their steps. Each replica's future is a `Cursor` (its running sequences and the
requests sent to it, in scalars), and arrivals are taken in order (the arrival process's own event
times): before routing one at time a, every replica's steps that end before a are planned, so its
count at a is its running sequences plus the requests sent to it and not yet admitted (a step in
progress at a has completed nothing yet; admissions and preemptions move requests between waiting
and running); the request goes to the lowest count, ties to the lower index, and waits in that
replica's queue until its first step that starts at or after a. A replica whose next completion
cannot come before a (its fewest tokens left times its current step time) is not planned up to a
at all, so its decode steps are planned in long stretches, not one per arrival. So no planned step
ends at or after the next arrival not yet routed: whatever stops the plan there (a backlog limit
reached at that arrival, the end of the run) finds every planned step completed, as the unfused
engine would.

A replica's steps follow the rules of the ordinary step (`sim.engine.Replica.run`): plain decode
segments in closed form (`Replica._plan_segment`'s expressions), speculative steps one by one (the
prices and outcomes of `Replica._plan_spec_steps`), and the mixed step that admits the waiting
requests (FCFS, prefilled whole). What a cursor cannot plan (a prompt prefilled in chunks, a
decode step that would preempt, a preempted request waiting, a step ending past the horizon) is
the ordinary step's: the replica is "out" from that step's start to its end, its count being its
outstanding requests at the start plus those sent to it since; it rejoins at its next step
boundary. An arrival at exactly a step boundary of a replica, or a backlog that could reach the
limit, ends joint planning for the rest of the run (each replica plans alone again).

Each replica executes its planned steps as pieces (`Piece`, one SimPy timeout each, ending exactly
at the planned time) and applies them when the timeout fires, as `Replica._absorbing_run` applies
a run; the arrival process keeps routing requests itself (by `Replica.outstanding`, which a piece
keeps exact), and a piece's admissions are checked against the waiting queue it routed them to.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from models.memory import BLOCK_SIZE

if TYPE_CHECKING:
    from sim.engine import FuseBound, Replica

B = BLOCK_SIZE
FUSE_MAX_STEPS = 4096  # longest plain decode segment planned at once
EXTEND_ARRIVALS = 512  # arrivals routed by one extension of the plan (then every replica's steps become a piece)
QUIET_MARGIN = 1e-9  # relative: a replica is left unplanned up to an arrival only this clearly before its next completion

# a step's outcome for `Cursor.advance`
DONE, WAIT, HARD = 0, 1, 2


@dataclass
class Piece:
    """A replica's planned steps, executed in one timeout and applied at its end: the step rows,
    admissions (request, step start, first token), completions (request, time, draft counters),
    the completions inside it (`gone`, for `Replica.outstanding`), the admissions' step starts
    (`taken`, for `Replica.queued`), and the running sequences after it, in slot order."""

    start_s: float
    end_s: float
    steps: int
    rows: list[list[float]]
    admitted: list[tuple[int, float, float]]
    done: list[tuple[int, float, int, int, int, int]]
    gone: list[tuple[float, int]]
    taken: list[float]
    state: tuple[list[int], ...]
    free: int


class Cursor:
    """One replica's planned future: its running sequences (entries: context, prefill target,
    tokens left, request, next verification outcome and draft counters) in slot order, the
    requests sent to it and not yet admitted with their arrival times (FCFS), its free KV blocks,
    and `t`, the start of its next step (inf when idle). `advance(a)` plans its steps that end
    before a."""

    def __init__(self, rep: Replica, t: float) -> None:
        self.rep, self.rt, self.reqs = rep, rep.rt, rep.reqs
        rt, reqs = self.rt, self.reqs
        self.spec = rt.spec
        n = rep.n_running
        self.C: list[int] = rep.computed[:n].tolist()
        self.R: list[int] = (rep.out[:n] - rep.gen[:n]).tolist()
        self.RID: list[int] = rep.rid[:n].tolist()
        self.TGT: list[int] = rep.target[:n].tolist()
        if self.spec is not None:
            self.NX: list[int] = (reqs.lead_off[rep.rid[:n]] + rep.n_verify[:n]).tolist()
            self.PROP: list[int] = rep.n_prop[:n].tolist()
            self.ACC: list[int] = rep.n_acc[:n].tolist()
            self.VER: list[int] = rep.n_verify[:n].tolist()
            self.VEM: list[int] = rep.n_vemit[:n].tolist()
        self.active = list(range(n))
        self.pending: deque[tuple[int, float]] = deque((rid, -math.inf) for rid in rep.waiting)
        self.free = rep.free_blocks
        self.held = sum([(c + (B - 1)) // B for c in self.C])
        self.ctx = sum(self.C)
        self.since = t  # it describes the replica from this time on
        self.t = t if (n or self.pending) else math.inf
        self.end_s = t  # when it last went idle
        self.num_blocks = rt.plan.num_blocks
        self.budget_max = rt.max_num_batched_tokens
        self.max_seqs = rt.max_num_seqs
        self.chunked = rt.chunked_prefill
        self.idx = rep.idx
        self._min_left: int | None = None  # fewest tokens left among the running sequences (cached)
        self._peek: tuple[float, Any] | None = None  # the next step's plan, kept while it waits for an arrival
        self._open()

    @staticmethod
    def joinable(rep: Replica) -> bool:
        """Whether a replica's state can be planned from: every running sequence decoding (no
        partial prefill), its KV blocks what the contexts hold, no preempted request waiting."""
        n = rep.n_running
        c = rep.computed[:n]
        if n and ((c < rep.target[:n]).any() or (rep.blocks[:n] != (c + (B - 1)) // B).any()):
            return False
        w = rep.waiting
        return not (w and rep.reqs.generated[list(w)].any())

    def _open(self) -> None:
        """Start a new piece at t."""
        self.p_start = self.t
        self.p_steps = 0
        self.rows: list[list[float]] = []
        self.admitted: list[tuple[int, float, float]] = []
        self.done: list[tuple[int, float, int, int, int, int]] = []
        self.gone: list[tuple[float, int]] = []

    def count(self) -> int:
        """Requests running or waiting here at the next arrival (its planned steps end before it)."""
        return len(self.active) + len(self.pending)

    def close(self) -> Piece | None:
        """The steps planned since the last piece, as a piece (None when there are none); the
        entries are compacted to the running ones."""
        if not self.p_steps:
            return None
        act = self.active
        spec = self.spec is not None
        state = ([self.RID[e] for e in act], [self.C[e] for e in act], [self.R[e] for e in act],
                 [self.TGT[e] for e in act],
                 [self.PROP[e] for e in act] if spec else [], [self.ACC[e] for e in act] if spec else [],
                 [self.VER[e] for e in act] if spec else [], [self.VEM[e] for e in act] if spec else [])
        end = self.t if self.t < math.inf else self.end_s
        piece = Piece(self.p_start, end, self.p_steps, self.rows, self.admitted, self.done, self.gone,
                      [s for _, s, _ in self.admitted], state, self.free)
        # compact the entries to the running ones (copies: the piece keeps its state as of its end)
        self.RID, self.C, self.R, self.TGT = state[0][:], state[1][:], state[2][:], state[3][:]
        if spec:
            self.PROP, self.ACC, self.VER, self.VEM = state[4][:], state[5][:], state[6][:], state[7][:]
            self.NX = [int(self.reqs.lead_off[r]) + v for r, v in zip(self.RID, self.VER, strict=True)]
        self.active = list(range(len(act)))
        self._peek = None
        self._open()
        if self.t == math.inf:
            self.p_start = end
        return piece

    def wake(self, t: float) -> None:
        """An arrival at t wakes an idle replica: its next step starts then."""
        self.t = t
        if not self.p_steps:
            self.p_start = t

    # ------------------------------------------------------------------ planning
    def quiet(self, a: float) -> bool:
        """Whether nothing here can change its count before a without planning: nothing waits, and
        its fewest tokens left, at the most tokens a step emits, take steps that cannot end before
        a (a step lasts at least the plain decode step of the running batch at its context)."""
        if self.pending or not self.active:
            return not self.pending
        m = self._min_left
        if m is None:
            R = self.R
            m = self._min_left = min([R[e] for e in self.active])
        if self.spec is not None:
            m = -(-m // (self.spec.k + 1))
        d = self.rt.cost.decode_s(len(self.active), float(self.ctx))
        return self.t + m * d > a + QUIET_MARGIN * (a if a > 1.0 else 1.0)

    def advance(self, a: float, end_bound: float, fb: FuseBound) -> bool:
        """Plan the steps that end before a; False when the step at t cannot be planned here (the
        ordinary step must take it: a chunked prefill, a preemption, a preempted request, a step
        ending at or past `end_bound`)."""
        while self.t < a:
            act, pend = self.active, self.pending
            if pend and pend[0][1] > self.t and not act:  # idle until the first one arrives
                self.t = pend[0][1]
                continue
            if not act and not pend:
                self.end_s = self.t
                self.t = math.inf
                return True
            if pend and pend[0][1] <= self.t and len(act) < self.max_seqs:
                got = self._mixed(a, end_bound)
            elif self.spec is not None:
                got = self._spec_step(a, end_bound)
            else:
                got = self._segment(a, end_bound, fb)
            if got == WAIT:
                return True
            if got == HARD:
                return False
        return True

    def _k(self, n: int) -> int:
        """The step's k, as `Replica._choose_k` chooses it (every running sequence decoding)."""
        spec = self.spec
        assert spec is not None
        policy = spec.policy
        if policy == "fixed":
            return spec.k
        if policy == "follow_load":
            return spec.k if self.rep.speculating else 0
        if policy == "disable_above_batch":
            return 0 if n > spec.disable_batch_size else spec.k
        if not n:
            return 0
        act = self.active
        return self.rep._adaptive_pick([self.ACC[e] for e in act], [self.PROP[e] for e in act], float(self.ctx))

    def _reserve(self, k: int) -> tuple[int, int]:
        """(q_v, KV blocks the decoding sequences' reservation takes): k + 1 tokens capped by what
        is left, a tree's every node capped by the model's length, one token without speculation."""
        C, act = self.C, self.active
        if not k:
            return 1, sum([(C[e] + B) // B for e in act]) - self.held
        spec = self.spec
        assert spec is not None
        q = k + 1
        qv = spec.verify_tokens(k)
        if qv != q:
            ml = self.rt.max_model_len
            return qv, sum([(C[e] + (qv if qv < ml - C[e] else ml - C[e]) + (B - 1)) // B for e in act]) - self.held
        R = self.R
        return q, sum([(C[e] + (q if q < R[e] else R[e]) + (B - 1)) // B for e in act]) - self.held

    def _admissions(self, n: int, qv: int, free: int) -> list[int] | None:
        """The prompts of the waiting requests the step at t admits (FCFS among those arrived by
        then, prefilled whole, by `_plan_prefill`'s and `_fits_whole`'s rules); None when the next
        one would be prefilled in chunks (the ordinary step)."""
        reqs = self.reqs
        budget = full = self.budget_max - n * qv
        chunks: list[int] = []
        running = n
        t = self.t
        for rid, arrived in self.pending:
            if arrived > t or not (budget > 0 and running < self.max_seqs and free > 0):
                break
            tokens = int(reqs.prompt[rid])
            nb = -(-tokens // B)
            if self.chunked:
                if tokens > budget or nb > free:
                    return None  # a chunk of it: the ordinary step
            elif not ((tokens <= budget or budget == full) and nb <= free):
                break  # it waits whole
            chunks.append(tokens)
            budget -= tokens
            free -= nb
            running += 1
        return chunks

    def _waiting_at(self, end: float) -> int:
        """Requests sent here and not admitted, by the end of a step at `end`."""
        w = 0
        for _, arrived in self.pending:
            if arrived > end:
                break
            w += 1
        return w

    def _mixed(self, a: float, end_bound: float) -> int:
        """The step that admits waiting requests (and decodes every running sequence)."""
        rep = self.rep
        spec = self.spec
        n = len(self.active)
        peek = self._peek
        if peek is not None and peek[0] == self.t and len(peek[1]) == 6:
            k, qv, need, chunks, total, cost = peek[1]
        else:
            k = self._k(n) if spec is not None else 0
            qv, need = self._reserve(k)
            if need > self.free:
                return HARD  # it would preempt
            got = self._admissions(n, qv, self.free - need)
            if got is None or (not n and not got):
                return HARD
            chunks = got
            n_pre = len(chunks)
            if n_pre == 1:
                pre_tokens = float(chunks[0])
                pre_pairs = pre_tokens * 0.0 + 0.5 * (pre_tokens * (pre_tokens + 1.0))
            elif n_pre:
                pre_tokens = float(sum(chunks))
                pre_pairs = 0.0 + 0.5 * float(sum([c * (c + 1) for c in chunks]))
            else:
                pre_tokens = pre_pairs = 0.0
            ctx = float(self.ctx) if n else 0.0
            if spec is None:
                cm = self.rt.cost
                total, flops, nbytes = cm.pass_sums(n + n_pre, n + pre_tokens, ctx + 0.0, ctx + n * 2 / 2.0 + pre_pairs)
                cost = (total, total, 0.0, 0.0, flops * cm.tp, nbytes * cm.tp, pre_tokens)
            else:
                plan = None
                if spec.shape is not None and k and n:
                    from sim.engine import VerifyPlan

                    tri = qv * qv if not spec.shape.chain else qv * (qv + 1) / 2.0
                    plan = VerifyPlan(float(n) * qv, ctx * qv + float(n) * tri, float(n), ctx)
                c6 = rep._spec_cost(n, ctx, k, n_pre, pre_tokens, 0.0, pre_pairs, plan)
                total = c6[0]
                cost = (*c6, pre_tokens)
            self._peek = (self.t, (k, qv, need, chunks, total, cost))
        t = self.t
        end = t + total
        if end >= end_bound:
            return HARD
        if end >= a:
            return WAIT
        self._peek = None
        total, target, draft, over, flops, nbytes, pre_tokens = cost
        n_pre = len(chunks)
        self.free -= need
        self.held += need
        emitted = self._decode_outcomes(k, n)
        if k:
            self._release()
        pend = self.pending
        for tokens in chunks:
            rid, _ = pend.popleft()
            self._add(rid, tokens)
            self.admitted.append((rid, t, end))
            nb = -(-tokens // B)
            self.free -= nb
            self.held += nb
            self.ctx += tokens
        self._min_left = None
        emitted += n_pre
        self._finish(end)
        self.rows.append([self.idx, t, total, n + n_pre, n, pre_tokens, n * qv, emitted, k, self.num_blocks - self.free,
                          self._waiting_at(end), flops, nbytes, target, draft, over, total if n else 0.0, 1, 0.0])
        self.p_steps += 1
        self.t = end
        return DONE

    def _add(self, rid: int, tokens: int) -> None:
        """An admitted request, its prompt prefilled whole this step: its entry."""
        reqs = self.reqs
        e = len(self.C)
        self.C.append(tokens)
        self.R.append(int(reqs.output[rid]) - 1)  # its first token, sampled at the end of its prefill
        self.RID.append(rid)
        self.TGT.append(tokens)
        if self.spec is not None:
            self.NX.append(int(reqs.lead_off[rid]))
            self.PROP.append(0)
            self.ACC.append(0)
            self.VER.append(0)
            self.VEM.append(0)
        self.active.append(e)

    def _decode_outcomes(self, k: int, n: int) -> int:
        """Every running sequence's tokens this step: accepted drafts + 1 (capped by what is left)
        read from its outcomes, or one without speculation; contexts grow. Returns the tokens."""
        C, R, act = self.C, self.R, self.active
        if not k:
            for e in act:
                C[e] += 1
                R[e] -= 1
            if self._min_left is not None:
                self._min_left -= 1
            self.ctx += n
            return n
        lead = self.reqs.lead_b
        NX, PROP, ACC, VER, VEM = self.NX, self.PROP, self.ACC, self.VER, self.VEM
        emitted = 0
        for e in act:
            a = lead[NX[e]]
            if a > k:
                a = k
            NX[e] += 1
            x = a + 1
            r = R[e]
            if x > r:
                x = r
            PROP[e] += k
            ACC[e] += a
            VER[e] += 1
            VEM[e] += x
            C[e] += x
            R[e] = r - x
            emitted += x
        self._min_left = None
        self.ctx += emitted
        return emitted

    def _release(self) -> None:
        """Blocks reserved for rejected drafts released: every sequence holds ceil(context / B)."""
        C = self.C
        held = sum([(C[e] + (B - 1)) // B for e in self.active])
        self.free -= held - self.held
        self.held = held

    def _finish(self, t: float) -> None:
        """Sequences with nothing left leave at t (blocks freed, draft counters kept)."""
        R = self.R
        left = [e for e in self.active if R[e] <= 0]
        if left:
            self._leave(left, t)

    def _leave(self, left: list[int], t: float) -> None:
        """These sequences leave at t."""
        R = self.R
        C, rid = self.C, self.RID
        spec = self.spec is not None
        for e in left:
            nb = (C[e] + (B - 1)) // B
            self.free += nb
            self.held -= nb
            self.ctx -= C[e]
            self.done.append((rid[e], t, self.PROP[e] if spec else 0, self.ACC[e] if spec else 0,
                              self.VER[e] if spec else 0, self.VEM[e] if spec else 0))
        self.active = [e for e in self.active if R[e] > 0]
        self.gone.append((t, len(left)))
        self._min_left = None

    def _spec_step(self, a: float, end_bound: float) -> int:
        """One speculative decode step (nothing admitted: nothing waiting has arrived, or no slot),
        its outcomes, the rejected drafts' blocks and the completions in one pass over the batch.
        (Held blocks after the step are ceil(context / B) whatever was reserved, so the
        reservation matters only for whether it fits; with room for every sequence's whole
        reservation it is not summed.)"""
        act = self.active
        n = len(act)
        peek = self._peek
        if peek is not None and peek[0] == self.t and len(peek[1]) == 3:
            k, qv, cost = peek[1]
        else:
            k = self._k(n)
            spec = self.spec
            assert spec is not None
            qv = spec.verify_tokens(k) if k else 1
            if self.free < n * (qv // B + 1) and self._reserve(k)[1] > self.free:
                return HARD  # it would preempt
            cost = self.rep._spec_step(n, float(self.ctx), k)
            self._peek = (self.t, (k, qv, cost))
        total = cost[0]
        t = self.t
        end = t + total
        if end >= end_bound:
            return HARD
        if end >= a:
            return WAIT
        self._peek = None
        C, R = self.C, self.R
        left: list[int] = []
        held = 0
        emitted = 0
        if k:
            lead = self.reqs.lead_b
            NX, PROP, ACC, VER, VEM = self.NX, self.PROP, self.ACC, self.VER, self.VEM
            for e in act:
                acc = lead[NX[e]]
                if acc > k:
                    acc = k
                NX[e] += 1
                x = acc + 1
                r = R[e]
                if x >= r:
                    x = r
                    left.append(e)
                PROP[e] += k
                ACC[e] += acc
                VER[e] += 1
                VEM[e] += x
                c = C[e] + x
                C[e] = c
                R[e] = r - x
                held += (c + (B - 1)) // B
                emitted += x
        else:
            for e in act:
                c = C[e] + 1
                C[e] = c
                r = R[e] - 1
                R[e] = r
                if not r:
                    left.append(e)
                held += (c + (B - 1)) // B
            emitted = n
        self.free += self.held - held
        self.held = held
        self.ctx += emitted
        self._min_left = None
        if left:
            self._leave(left, end)
        self.rows.append([self.idx, t, total, n, n, 0.0, n * qv, emitted, k, self.num_blocks - self.free,
                          self._waiting_at(end), cost[4], cost[5], cost[1], cost[2], cost[3], total, 1, 0.0])
        self.p_steps += 1
        self.t = end
        return DONE

    def _segment(self, a: float, end_bound: float, fb: FuseBound) -> int:
        """Plain decode steps from t in closed form (`Replica._plan_segment`'s expressions): the
        steps that start before the next metric cut and before the first waiting request arrives
        (the step after it admits it), end before a and before `end_bound`, up to the first
        completion and while the KV blocks they grow into are free. A step during which a waiting
        request arrives is logged apart (its waiting count differs)."""
        rep = self.rep
        cost = self.rt.cost
        C, R, act = self.C, self.R, self.active
        n = len(act)
        t = self.t
        m = self._min_left
        if m is None:
            m = self._min_left = min([R[e] for e in act])
        ctx0 = float(self.ctx)
        d0 = cost.decode_s(n, ctx0)
        sb = fb.next_cut_s(t)  # steps start before it
        arrive = math.inf  # the first request sent here that arrives after t
        for _, arrived in self.pending:
            if arrived > t:
                arrive = arrived
                break
        if arrive < sb:
            sb = arrive
        el = a if a < end_bound else end_bound  # steps end before it
        mm = min(m, FUSE_MAX_STEPS, int((el - t) / d0) + 1)
        free = self.free
        hist = [0] * B
        for e in act:
            hist[C[e] % B] += 1
        cnt = hist[0::-1] + hist[:0:-1]  # cnt[r]: sequences taking a new block at step r
        first = [0] * (B + 1)
        for r in range(B):
            first[r + 1] = first[r] + cnt[r]
        if n * (mm // B + 1) > free and (mm // B) * n + first[mm % B] > free:
            s_ = (free // n) * B
            while s_ < mm and ((s_ + 1) // B) * n + first[(s_ + 1) % B] <= free:
                s_ += 1
            mm = s_
            if mm < 1:
                return HARD  # it would preempt
        last = mm - 1
        slope = (cost.decode_s(n, ctx0 + last * n) - d0) / last if last else 0.0
        # the expressions and float order of `_plan_segment`'s start(j) and end
        k = mm
        x = y = x1 = y1 = 0.0
        while k >= 1:
            x1, y1 = (k - 1) * d0, slope * ((k - 1) * (k - 2) / 2.0)
            if t + x1 + y1 < sb:
                x, y = k * d0, slope * (k * (k - 1) / 2.0)
                if t + x + y < el:
                    break
            k -= 1
        if k < 1:  # its first step ends at or after a (it waits for the arrival's routing), or past the end bound
            return HARD if t + d0 >= end_bound else WAIT
        end = t + (x + y)
        used0 = self.num_blocks - free
        but_last = ((k - 1) // B) * n + first[(k - 1) % B]
        new_blocks = (k // B) * n + first[k % B]
        self.free = free - new_blocks
        self.held += new_blocks
        for e in act:
            C[e] += k
            R[e] -= k
        self._min_left = m - k
        self.ctx += n * k
        self._finish(end)
        used = self.num_blocks - self.free
        if end >= arrive:  # a request arrives during its last step: that step's row apart
            if k > 1:
                self.rows.append(list(rep._run_row(t, k - 1, d0, slope, n, ctx0, used0 + but_last,
                                                   self._waiting_at(t + (x1 + y1)))))
            self.rows.append(list(rep._run_row(t + (x1 + y1), 1, d0 + (k - 1) * slope, 0.0, n, ctx0 + (k - 1) * n,
                                               used, self._waiting_at(end))))
        else:
            self.rows.append(list(rep._run_row(t, k, d0, slope, n, ctx0, used, self._waiting_at(end))))
        self.p_steps += k
        self.t = end
        return DONE


class PlainCursor(Cursor):
    """A cursor without speculation: every running sequence gains one token a step, so entry e has
    context base_e + S after the cursor's S-th step and finishes at step FIN_e; the context sum, the
    KV blocks the next steps take (a histogram of base mod B) and the next completion (a heap of
    FIN) are kept without touching every entry (`Replica._plan_absorbing`'s scalars)."""

    def __init__(self, rep: Replica, t: float) -> None:
        super().__init__(rep, t)
        self.S = 0
        self.base: list[int] = self.C  # (S = 0)
        self.FIN: list[int] = self.R[:]
        self.hist = [0] * B
        for c in self.C:
            self.hist[c % B] += 1
        self.heap = [(f, e) for e, f in enumerate(self.FIN)]
        heapq.heapify(self.heap)
        self.alive = [True] * len(self.C)

    def close(self) -> Piece | None:
        if not self.p_steps:
            return None
        S = self.S
        act = self.active
        self.C = [self.base[e] + S for e in act]
        self.R = [self.FIN[e] - S for e in act]
        self.RID = [self.RID[e] for e in act]
        self.TGT = [self.TGT[e] for e in act]
        self.active = list(range(len(act)))
        piece = super().close()
        # (entries renumbered in slot order: base relative to S, as before)
        self.base = [c - S for c in self.C]
        self.FIN = [r + S for r in self.R]
        self.heap = [(f, e) for e, f in enumerate(self.FIN)]
        heapq.heapify(self.heap)
        self.alive = [True] * len(self.base)
        return piece

    def quiet(self, a: float) -> bool:
        if self.pending or not self.active:
            return not self.pending
        d = self.rt.cost.decode_s(len(self.active), float(self.ctx))
        return self.t + (self.heap[0][0] - self.S) * d > a + QUIET_MARGIN * (a if a > 1.0 else 1.0)

    def _reserve(self, k: int) -> tuple[int, int]:
        return 1, self.hist[(-self.S) % B]  # the sequences whose next token opens a block

    def _add(self, rid: int, tokens: int) -> None:
        e = len(self.base)
        be = tokens - self.S  # (after this step: S already counts it)
        self.base.append(be)
        f = self.S + int(self.reqs.output[rid]) - 1
        self.FIN.append(f)
        heapq.heappush(self.heap, (f, e))
        self.alive.append(True)
        self.hist[be % B] += 1
        self.RID.append(rid)
        self.TGT.append(tokens)
        self.active.append(e)

    def _decode_outcomes(self, k: int, n: int) -> int:
        self.S += 1
        self.ctx += n
        return n

    def _finish(self, t: float) -> None:
        heap, S = self.heap, self.S
        if not heap or heap[0][0] > S:
            return
        count = 0
        while heap and heap[0][0] <= S:
            _, e = heapq.heappop(heap)
            c = self.base[e] + S
            nb = (c + (B - 1)) // B
            self.free += nb
            self.held -= nb
            self.ctx -= c
            self.hist[self.base[e] % B] -= 1
            self.alive[e] = False
            self.done.append((self.RID[e], t, 0, 0, 0, 0))
            count += 1
        alive = self.alive
        self.active = [e for e in self.active if alive[e]]
        self.gone.append((t, count))

    def _segment(self, a: float, end_bound: float, fb: FuseBound) -> int:
        """Plain decode steps from t in closed form (`Replica._plan_segment`'s expressions): the
        steps that start before the next metric cut and before the first waiting request arrives
        (the step after it admits it), end before a and before `end_bound`, up to the first
        completion and while the KV blocks they grow into are free. A step during which a waiting
        request arrives is logged apart (its waiting count differs)."""
        rep = self.rep
        cost = self.rt.cost
        n = len(self.active)
        t, S = self.t, self.S
        m = self.heap[0][0] - S
        ctx0 = float(self.ctx)
        d0 = cost.decode_s(n, ctx0)
        sb = fb.next_cut_s(t)  # steps start before it
        arrive = math.inf  # the first request sent here that arrives after t
        for _, arrived in self.pending:
            if arrived > t:
                arrive = arrived
                break
        if arrive < sb:
            sb = arrive
        el = a if a < end_bound else end_bound  # steps end before it
        mm = min(m, FUSE_MAX_STEPS, int((el - t) / d0) + 1)
        free = self.free
        # first[r]: new blocks in the next r steps (entry e takes one at relative step r when
        # (base_e + S + r) % B == 0)
        hist = self.hist
        s0 = (-S) % B
        cnt = hist[s0::-1] + hist[:s0:-1]  # cnt[r] = hist[(-S - r) % B]
        first = list(itertools.accumulate(cnt, initial=0))
        if n * (mm // B + 1) > free and (mm // B) * n + first[mm % B] > free:
            s_ = (free // n) * B
            while s_ < mm and ((s_ + 1) // B) * n + first[(s_ + 1) % B] <= free:
                s_ += 1
            mm = s_
            if mm < 1:
                return HARD  # it would preempt
        last = mm - 1
        slope = (cost.decode_s(n, ctx0 + last * n) - d0) / last if last else 0.0
        # the expressions and float order of `_plan_segment`'s start(j) and end
        k = mm
        x = y = x1 = y1 = 0.0
        while k >= 1:
            x1, y1 = (k - 1) * d0, slope * ((k - 1) * (k - 2) / 2.0)
            if t + x1 + y1 < sb:
                x, y = k * d0, slope * (k * (k - 1) / 2.0)
                if t + x + y < el:
                    break
            k -= 1
        if k < 1:  # its first step ends at or after a (it waits for the arrival's routing), or past the end bound
            return HARD if t + d0 >= end_bound else WAIT
        end = t + (x + y)
        used0 = self.num_blocks - free
        but_last = ((k - 1) // B) * n + first[(k - 1) % B]
        new_blocks = (k // B) * n + first[k % B]
        self.free = free - new_blocks
        self.held += new_blocks
        self.S = S + k
        self.ctx += n * k
        self._finish(end)
        used = self.num_blocks - self.free
        if end >= arrive:  # a request arrives during its last step: that step's row apart
            if k > 1:
                self.rows.append(list(rep._run_row(t, k - 1, d0, slope, n, ctx0, used0 + but_last,
                                                   self._waiting_at(t + (x1 + y1)))))
            self.rows.append(list(rep._run_row(t + (x1 + y1), 1, d0 + (k - 1) * slope, 0.0, n, ctx0 + (k - 1) * n,
                                               used, self._waiting_at(end))))
        else:
            self.rows.append(list(rep._run_row(t, k, d0, slope, n, ctx0, used, self._waiting_at(end))))
        self.p_steps += k
        self.t = end
        return DONE


@dataclass
class Out:
    """An ordinary step of a replica the planner does not follow, from `start_s` to `end_s`: its
    count is `count` (its outstanding requests at the start) plus the requests sent to it since
    (`sent`)."""

    start_s: float
    end_s: float
    count: int
    sent: int = 0


class RackPlanner:
    """The joint plan of a rack's replicas (see the module docstring): one per run, shared by the
    replicas (`Replica.rack`). For each replica: its cursor (valid from `Cursor.since`), or none
    while it takes ordinary steps; the cursor that stopped at a step it could not plan (`frozen`,
    until its pieces are out); the ordinary steps it took that the plan has not routed past
    (`outs`); and its planned pieces."""

    def __init__(self, replicas: list[Replica], fuse: FuseBound, horizon_s: float, limit: int) -> None:
        self.replicas, self.fuse, self.horizon_s, self.limit = replicas, fuse, horizon_s, limit
        r = len(replicas)
        self.cursors: list[Cursor | None] = [None] * r
        self.frozen: list[Cursor | None] = [None] * r
        self.outs: list[list[Out]] = [[] for _ in range(r)]
        self.pieces: list[deque[Piece]] = [deque() for _ in range(r)]
        self.j = -1  # the next arrival to route (-1: not started)
        self.broken = False
        self.routed: dict[int, int] = {}  # arrival -> the replica the plan sent it to, until the arrival process does
        # requests the plan sent to a replica whose cursor it then dropped, arriving after the drop: they
        # count for its next ordinary step (`ordinary`)
        self.carry: list[list[tuple[int, float]]] = [[] for _ in range(r)]
        # the arrival process's event times: now + (t - now) from the previous event (`sim.run._arrivals`)
        ev: list[float] = []
        now = 0.0
        for t in fuse.times():
            if t > now:
                now = now + (t - now)
            ev.append(now)
        self.event_s = ev

    # ------------------------------------------------------------------ the replicas' side
    def boundary(self, rep: Replica) -> Piece | None:
        """A replica at a step boundary (now): its next planned piece, planning more when none is
        left; None when its next step is not planned (it takes an ordinary step: `ordinary`)."""
        r = rep.idx
        q = self.pieces[r]
        if q:
            return q.popleft()
        if self.broken:
            return None
        now = rep.env.now
        if self.j < 0:  # the first boundary: every idle replica is known (empty)
            self.j = self.fuse.next_index
            for s in self.replicas:
                if s.idx != r and s.n_running == 0 and not s.waiting:
                    self.cursors[s.idx] = self._cursor(s, now)
        if self.cursors[r] is None:
            # rejoin from its state now, once the plan has routed every arrival the queues hold
            self._extend(r, catch_up=True)
            if self.broken or self.j < self.fuse.next_index or not Cursor.joinable(rep):
                return None
            self.cursors[r] = self._cursor(rep, now)
        self._extend(r)
        return q.popleft() if q else None

    def check(self, rid: int, replica: int) -> None:
        """The arrival process sent request `rid` to `replica`: where the plan sent it (a plan that
        routes otherwise has gone wrong: fail loudly, never silently)."""
        planned = self.routed.pop(rid, replica)
        assert planned == replica, f"request {rid}: the joint plan routed it to replica {planned}, the router to {replica}"

    def ordinary(self, rep: Replica, end_s: float) -> None:
        """A replica starts an ordinary step now, ending at `end_s`: its count until then is its
        outstanding requests now plus those the plan sent it that arrive later."""
        if self.broken:
            return
        r = rep.idx
        now = rep.env.now
        c = self.cursors[r]
        if c is not None:  # (its cursor did not plan this step)
            self._drop(r, c, now)
        later = [p for p in self.carry[r] if p[1] > now]
        self.carry[r] = []
        self.outs[r].append(Out(now, end_s, rep.outstanding(), len(later)))

    def _drop(self, r: int, c: Cursor, t: float) -> None:
        """Replica r's cursor is dropped at t (its next step is the ordinary step's): the requests
        the plan sent to it are carried to the replica's next report (`ordinary`, `went_idle`),
        which counts those that have not arrived by then."""
        self.cursors[r] = None
        self.carry[r] = list(c.pending)  # (those that have not arrived when it next reports count)

    def went_idle(self, rep: Replica) -> None:
        """A replica waits for work from now: known again (empty) from now on."""
        r = rep.idx
        if not self.broken and self.cursors[r] is None and self.j >= 0 and not self.pieces[r]:
            c = self.cursors[r] = self._cursor(rep, rep.env.now)
            later = [p for p in self.carry[r] if p[1] > c.since]
            self.carry[r] = []
            if later:  # (sent here by the plan, arriving later)
                c.pending.extend(later)
                c.wake(later[0][1])

    def _cursor(self, rep: Replica, t: float) -> Cursor:
        return Cursor(rep, t) if rep.rt.spec is not None else PlainCursor(rep, t)

    # ------------------------------------------------------------------ planning
    def _count(self, r: int, a: float) -> tuple[int, Cursor | Out] | None:
        """Replica r's requests running or waiting at an arrival at a, and where a request sent to
        it goes (its cursor or its ordinary step), when known."""
        c = self.cursors[r]
        if c is not None and a > c.since:
            return c.count(), c
        for o in reversed(self.outs[r]):
            if o.start_s <= a <= o.end_s:  # (at its end its completions are still running)
                return o.count + o.sent, o
            if o.start_s < a:
                break
        return None

    def _extend(self, requester: int, catch_up: bool = False) -> None:
        """Route arrivals in order, planning each replica's steps that end before one first (but
        for replicas that cannot change their count before it), until EXTEND_ARRIVALS are routed
        and the requester has steps planned, the next arrival's counts are not known, or (with
        `catch_up`) the plan has routed the arrivals the queues already hold; then each replica's
        steps that end before the next arrival become a piece."""
        fb = self.fuse
        at = self.event_s
        nq = len(at)
        R = len(self.replicas)
        cur = self.cursors
        routed = 0
        end_bound = self.horizon_s
        while not self.broken:
            j = self.j
            if j >= nq or (catch_up and j >= fb.next_index):
                break
            a = at[j]
            for r in range(R):
                c = cur[r]
                if c is not None and c.t < a and not c.quiet(a) and not c.advance(a, end_bound, fb):
                    self.frozen[r] = c  # its step at c.t is the ordinary step's
                    self._drop(r, c, c.t)
            counts: list[int] = []
            where: list[Cursor | Out] = []
            for r in range(R):
                got = self._count(r, a)
                if got is None:
                    break
                counts.append(got[0])
                where.append(got[1])
            if len(counts) < R:
                break  # a replica's count at a is not known yet
            if sum(counts) + 1 > self.limit or any(isinstance(w, Out) and w.start_s == a for w in where):
                self.broken = True  # the backlog could stop the run here, or a tie SimPy's event order decides
                break
            best = counts.index(min(counts))
            self.routed[j] = best
            w = where[best]
            if isinstance(w, Cursor):
                if w.t == math.inf:
                    w.wake(a)
                w.pending.append((j, a))
            else:
                w.sent += 1
            self.j = j + 1
            routed += 1
            if routed >= EXTEND_ARRIVALS and not catch_up:
                rc = cur[requester]
                if rc is None or rc.p_steps:
                    break
        # every replica's steps that end before the next arrival, then the pieces
        a = at[self.j] if self.j < nq else math.inf
        for r in range(R):
            c = cur[r]
            if c is not None and c.t < a and not self.broken and not c.advance(a, end_bound, fb):
                self.frozen[r] = c
                self._drop(r, c, c.t)
            for c in (cur[r], self.frozen[r]):
                if c is not None:
                    p = c.close()
                    if p is not None:
                        self.pieces[r].append(p)
            self.frozen[r] = None
            self.outs[r] = [o for o in self.outs[r] if o.end_s > a]
