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

A replica's steps follow the step rules (`sim.step`, called here, not restated): plain decode
segments in closed form (`sim.step.kv_steps`, `decode_clock_steps`), speculative steps one by one
(`sim.policies` for k, `sim.step.reserve_need`, `StepPricer.spec_step`, `sim.step.decode_spec`), and
the mixed step that continues the partial
prefills and admits the waiting requests (FCFS, chunked in the token budget left, or whole
without chunked prefill; a preempted request recomputes its prompt and output so far). What a
cursor cannot plan (a decode step that would preempt, a step with nothing that fits, a step
ending past the horizon) is the ordinary step's: the replica is "out" from that step's start to
its end, its count being its outstanding requests at the start plus those sent to it since; it
rejoins at its next step boundary. An arrival at exactly a step boundary of a replica, or a backlog that could reach the
limit, ends joint planning for the rest of the run (each replica plans alone again).

A closed loop of one replica is planned by a cursor too (`loop_piece`): its sends are made at its
completions and reach the queue after the frontend's latency, so they are known before any step
they could reach is planned; the replica's own runs plan what they can and the cursor the rest
(partial prefills, chunked admissions), so the capacity ladders leave the ordinary step.

Each replica executes its planned steps as pieces (`Piece`, one SimPy timeout each, ending exactly
at the planned time) and applies them when the timeout fires, as `sim.fusion.absorbing_run` applies
a run; the arrival process keeps routing requests itself (by `Replica.outstanding`, which a piece
keeps exact), and a piece's admissions are checked against the waiting queue it routed them to.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from models.memory import BLOCK_SIZE
from sim.plans import ADMIT_OP, FUSE_MAX_STEPS, NEAR, PREEMPT_OP, SendFeed
from sim.policies import ADAPTIVE, adaptive_choice, adaptive_pick, policy_k
from sim.pricing import VerifyPlan
from sim.state import LIVE, FuseBound, ReplicaState
from sim.step import (
    blocks_over,
    decode_clock_steps,
    decode_one,
    decode_spec,
    kv_steps,
    new_blocks_first,
    prefill_budget,
    prefill_chunk,
    prefill_sums,
    prefill_sums_one,
    reserve_need,
    whole_fits,
)
from sim.tables import ROW, row_waiting, with_waiting

B: Final = BLOCK_SIZE  # (Final: the compiled build reads constants as C values, not module attributes)
LOOP_STEPS: Final = 1024  # most steps one piece of a closed loop's plan holds (`loop_piece`)
# `PlainCursor.heap`: a decoding entry e finishing at step FIN as one int, FIN << HEAP_SHIFT | e (no
# tuple to build or compare: ordered by FIN, then e, as the tuple (FIN, e) would be)
HEAP_SHIFT: Final = 32
HEAP_ENTRY: Final = (1 << HEAP_SHIFT) - 1
FEW_LEFT: Final = 8  # completions at once that leave the batch list in place (`drop_entries`)
EXTEND_ARRIVALS: Final = 512  # arrivals routed by one extension of the plan (then every replica's steps become a piece)
QUIET_MARGIN: Final = 1e-9  # relative: a replica is left unplanned up to an arrival only this clearly before its next completion

# a step's outcome for `Cursor.advance` (PREEMPT: a decode step that would preempt, which
# `Cursor._mixed` plans as the ordinary step takes it)
DONE: Final = 0
WAIT: Final = 1
HARD: Final = 2
PREEMPT: Final = 3
# a request's output so far and draft counters (proposed, accepted, verifications, verification-emitted)
# before it is first admitted
FRESH: Final = (0, 0, 0, 0, 0)


@dataclass
class Piece:
    """A replica's planned steps, executed in one timeout and applied at its end: the step rows
    (`packed`: each row as doubles, `sim.tables.ROW`, in order: a planned step's row is packed as
    it is planned, so no tuple of boxed floats lives until the piece is applied), admissions
    (request, step start), first tokens (request, time), completions (request, time, draft
    counters), the completions inside it (`gone`, for `Replica.outstanding`), the admissions'
    step starts (`taken`, for `Replica.queued`), and its entries after it, in slot order
    (request, context, tokens left, prefill target, draft counters). Where it preempted,
    the preemptions in order (request, output so far, drafts proposed, accepted, verifications,
    verification-emitted tokens), their steps' starts (`pre_t`, for `Replica.queued`) and the
    queue operations in order (`ops`: admissions and preemptions, which put a request back at
    the head of the queue)."""

    start_s: float
    end_s: float
    steps: int
    admitted: list[tuple[int, float]]
    first: list[tuple[int, float]]
    done: list[tuple[int, float, int, int, int, int]]
    gone: list[tuple[float, int]]
    taken: list[float]
    state: tuple[list[int], ...]
    free: int
    preempted: list[tuple[int, int, int, int, int, int]] = field(default_factory=list)
    pre_t: list[float] = field(default_factory=list)
    ops: list[tuple[int, int]] | None = None
    packed: bytes = b""


class Cursor:
    """One replica's planned future: its entries (context, prefill target, tokens left, request,
    next verification outcome and draft counters) in slot order, those still prefilling
    (`partials`), the requests sent to it and not yet admitted with their arrival times (FCFS),
    its free KV blocks, and `t`, the start of its next step (inf when idle). `advance(a)` plans
    its steps that end before a, by the step rules (`sim.step`): the decoding
    sequences' KV reservation (preempting the youngest while it does not fit: `_victims`,
    `_preempt`), then the token budget left to the partial prefills in slot order and to the
    waiting requests FCFS (none after a preemption; chunked, or whole without chunked prefill), the step's price, the
    decoding sequences' outcomes, the prefills' progress (a finished one samples its token), and
    the completions. Every entry holds ceil(context / B) KV blocks between steps (`held`)."""

    def __init__(self, rep: ReplicaState, t: float) -> None:
        self.rep, self.rt, self.reqs = rep, rep.rt, rep.reqs
        rt, reqs = self.rt, self.reqs
        self.spec = rt.spec
        if self.spec is not None:  # per step: k under the fixed policy (-1: chosen each step), q_v by k
            self._k_fixed = self.spec.k if self.spec.policy == "fixed" else -1
            self._qv = [1] + [self.spec.verify_tokens(j) for j in range(1, self.spec.k + 1)]
            self._qv_max = max(self._qv)
        n = rep.n_running
        self.C: list[int] = rep.computed[:n].tolist()
        self.R: list[int] = (rep.out[:n] - rep.gen[:n]).tolist()
        self.RID: list[int] = rep.rid[:n].tolist()
        self.TGT: list[int] = rep.target[:n].tolist()
        if self.spec is not None:
            self.NX: list[int] = (reqs.lead_off[rep.rid[:n]] + rep.n_verify[:n]).tolist()
            self.PROP: list[int] = rep.n_prop[:n].tolist()
            self.ACC: list[int] = rep.n_acc[:n].tolist()
            self.VEM: list[int] = rep.n_vemit[:n].tolist()
        self.active = list(range(n))
        self.partials = [e for e in range(n) if self.C[e] < self.TGT[e]]
        # Draft counters of the decoding entries (`_decode`): every one of them decodes at every step,
        # so they are kept as offsets from what the cursor keeps anyway (`_counters`; the adaptive
        # policy reads them through `_acc_prop`): the hot loop updates none of them
        self.KS = 0  # drafts proposed per sequence since the offsets were taken (k summed over steps)
        self.PS = 0  # steps without drafts since then (each adds a token to every decoding context)
        self.VS = 0  # steps with drafts since then (each advances every decoding entry's next outcome)
        self._fix: dict[int, int] = {}  # an entry's accepted drafts its last step's cap left out
        if self.spec is not None:
            self._offsets(self._decoders())
        # (built in C: a closed loop's queue holds most of its clients, and a cursor may plan few steps)
        self.pending: deque[tuple[int, float]] = deque(zip(rep.waiting, itertools.repeat(-math.inf)))
        self.free = rep.free_blocks
        # (annotated: inferred, both were Any, and compiled every operation on them generic)
        self.held: int = sum([(c + (B - 1)) // B for c in self.C])
        self.ctx: int = sum([self.C[e] for e in self._decoders()])  # the decoding sequences' contexts
        self.since = t  # it describes the replica from this time on
        self.t = t if (n or self.pending) else math.inf
        self.end_s = t  # when it last went idle
        self.num_blocks = rt.plan.num_blocks
        self.budget_max = rt.max_num_batched_tokens
        self.max_seqs = rt.max_num_seqs
        self.chunked = rt.chunked_prefill
        self.idx = rep.idx
        self._min_left: int | None = None  # fewest tokens left among the decoding sequences (cached)
        # `quiet(a)` holds for every a before this (its last finding; -inf: not known); any step
        # planned, request sent here or wake forgets it (`advance`, `wake`, `RackPlanner._route`)
        self.q_until = -math.inf
        # the step from wait_t ends at wait_end: `advance` stopped there, waiting for an arrival (`waits`)
        self.wait_t, self.wait_end = math.nan, -math.inf
        self._peek: tuple[float, Any] | None = None  # the next step's plan, kept while it waits for an arrival
        self._dec_held = 0  # what the last `_decode` with drafts left: blocks held, the finished (`_mixed`)
        self._dec_left: list[int] = []
        self.stop_done = False  # `advance` returns after a step with completions (a closed loop: `loop_piece`)
        # the requests it preempted (`_victims`, `_preempt`: as the ordinary step does) and has not
        # readmitted: output so far and draft counters
        self.victims: dict[int, tuple[int, int, int, int, int]] = {}
        self.split_done = False  # a plain segment logs its step with completions apart (`_segment`)
        self._open()

    @staticmethod
    def joinable(rep: ReplicaState) -> bool:
        """Whether a replica's state can be planned from: every entry holds the KV blocks its
        context needs (no more: a step's reservation is released between steps)."""
        n = rep.n_running
        c = rep.computed[:n]
        return not (n and (rep.blocks[:n] != (c + (B - 1)) // B).any())

    def _open(self) -> None:
        """Start a new piece at t."""
        self.p_start = self.t
        self.p_steps = 0
        self.packed: list[bytes] = []  # the piece's step rows, in order, each packed as doubles at once (`ROW`)
        self.admitted: list[tuple[int, float]] = []
        self.first: list[tuple[int, float]] = []
        self.done: list[tuple[int, float, int, int, int, int]] = []
        self.gone: list[tuple[float, int]] = []
        self.preempted: list[tuple[int, int, int, int, int, int]] = []
        self.pre_t: list[float] = []
        self.ops: list[tuple[int, int]] = []

    def add_waits(self, waits: int) -> None:
        """Requests that joined the queue at the end of the last step planned: its row's waiting
        count grows by them."""
        last = self.packed[-1]
        self.packed[-1] = with_waiting(last, row_waiting(last) + waits)

    def count(self) -> int:
        """Requests running or waiting here at the next arrival (its planned steps end before it)."""
        return len(self.active) + len(self.pending)

    def _decoders(self) -> list[int]:
        """The entries that decode (their prefill done), in slot order."""
        partials = self.partials
        if not partials:
            return self.active
        act = self.active
        m = len(partials)
        if act[len(act) - m:] == partials:  # (the common case: the prefilling entries are the youngest, in order)
            return act[:len(act) - m]
        p = set(partials)
        return [e for e in act if e not in p]

    def _entries(self) -> tuple[list[int], ...]:
        """Every entry's (request, context, tokens left, prefill target), in slot order."""
        act = self.active
        return ([self.RID[e] for e in act], [self.C[e] for e in act], [self.R[e] for e in act],
                [self.TGT[e] for e in act])

    def close(self) -> Piece | None:
        """The steps planned since the last piece, as a piece (None when there are none); the
        entries are renumbered in slot order."""
        if not self.p_steps:
            return None
        act = self.active
        spec = self.spec is not None
        rid, c, r, tgt = self._entries()
        if spec:
            cnt = [self._counters(e) for e in act]
            prop, acc, vem = ([list(x) for x in zip(*cnt, strict=True)] if cnt else [[], [], []])
        state = (rid, c, r, tgt, prop if spec else [], acc if spec else [],
                 [self._verified(e) for e in act] if spec else [], vem if spec else [])
        end = self.t if self.t < math.inf else self.end_s
        piece = Piece(self.p_start, end, self.p_steps, self.admitted, self.first, self.done, self.gone,
                      [s for _, s in self.admitted], state, self.free, self.preempted, self.pre_t,
                      self.ops if self.preempted else None, b"".join(self.packed))
        # renumber the entries (copies: the piece keeps its state as of its end, the cursor plans on)
        pos = {e: i for i, e in enumerate(act)}
        self.partials = [pos[e] for e in self.partials]
        self._renumber(state)
        self._peek = None
        self.wait_t = math.nan  # (the next extension plans that step anew, as it does without the skip)
        self._open()
        if self.t == math.inf:
            self.p_start = end
        return piece

    def _renumber(self, state: tuple[list[int], ...]) -> None:
        self.RID, self.C, self.R, self.TGT = state[0][:], state[1][:], state[2][:], state[3][:]
        if self.spec is not None:
            self.PROP, self.ACC, self.VEM = state[4][:], state[5][:], state[7][:]
            self.NX = [int(self.reqs.lead_off[r]) + v for r, v in zip(self.RID, state[6], strict=True)]
        self.active = list(range(len(self.RID)))
        if self.spec is not None:
            self.KS = self.PS = self.VS = 0
            self._fix = {}
            self._offsets(self._decoders())

    def _offsets(self, entries: list[int]) -> None:
        """These decoding entries' draft counters (as they stand) kept as offsets from now on (a
        speculative cursor's): proposed = PROP + KS; verification-emitted tokens =
        VEM + C - PS (a verification's tokens are all its context gains; a step without drafts
        adds one token to every decoding context and none to the counters); accepted = ACC + C -
        PS - NX, plus the drafts accepted beyond the tokens left at its last step (`_fix`):
        every verification emits its accepted drafts + 1, and advances NX by one; so NX itself is
        kept as an offset too: the next outcome's index is NX + VS (VS: the steps with drafts since
        the offsets were taken), and a step updates none of these."""
        C, NX, PROP, ACC, VEM = self.C, self.NX, self.PROP, self.ACC, self.VEM
        KS, PS, VS = self.KS, self.PS, self.VS
        for e in entries:  # (applied once per entry: at the cursor's start, at its prefill's end)
            d = C[e] - PS
            PROP[e] = PROP[e] - KS
            VEM[e] = VEM[e] - d
            nx = NX[e]
            ACC[e] = ACC[e] - (d - nx)
            NX[e] = nx - VS

    def _counters(self, e: int) -> tuple[int, int, int]:
        """Entry e's drafts proposed, accepted and its verification-emitted tokens (`_offsets`)."""
        if e in self.partials:
            return self.PROP[e], self.ACC[e], self.VEM[e]
        d = self.C[e] - self.PS
        return (self.PROP[e] + self.KS, self.ACC[e] + d - (self.NX[e] + self.VS) + self._fix.get(e, 0),
                self.VEM[e] + d)

    def _verified(self, e: int) -> int:
        """Entry e's verifications so far: its next outcome's index less its request's first
        (NX advances once per verification, so the count is not kept apart; a decoding entry's
        is an offset from VS: `_offsets`)."""
        nx = self.NX[e] if e in self.partials else self.NX[e] + self.VS
        return nx - self.reqs.lead_off_v[self.RID[e]]

    def wake(self, t: float) -> None:
        """An arrival at t wakes an idle replica: its next step starts then."""
        self.t = t
        self.q_until = -math.inf
        if not self.p_steps:
            self.p_start = t

    # ------------------------------------------------------------------ planning
    def quiet(self, a: float) -> bool:
        """Whether nothing here can change its count before a without planning: nothing waits or
        prefills, and its fewest tokens left, at the most tokens a step emits, take steps that
        cannot end before a (a step lasts at least the plain decode step of the running batch at
        its context), and the KV blocks those steps can grow into are free (a step that preempts
        shrinks the batch, and a smaller batch steps faster): s steps add at most s q_v tokens to a
        sequence, so at most (s q_v) // B + 1 blocks. The time before which that holds is kept
        (`q_until`)."""
        if self.pending or self.partials or not self.active:
            return not (self.pending or self.partials)
        m, qmax = self._fewest_steps()
        n = len(self.active)
        d = self.rt.cost.decode_s(n, float(self.ctx))
        u = _quiet_until(self.t + m * d)
        f = self.free // n
        s_max = (f * B - 1) // qmax if f else 0  # the most steps whose blocks are free
        kv = _quiet_until(self.t + d * (s_max - 1)) if s_max > 1 else -math.inf
        self.q_until = u if u < kv else kv
        return a < self.q_until

    def _fewest_steps(self) -> tuple[int, int]:
        """(The fewest steps before a decoding sequence can finish: its fewest tokens left at the
        most tokens a step emits; the most tokens a step adds to a sequence's KV, q_v at most.)"""
        m = self._min_left
        if m is None:
            R, act = self.R, self.active
            lo = R[act[0]]  # (typed int, a loop of C ints: no list, no generic comparison)
            for e in act:
                r = R[e]
                if r < lo:
                    lo = r
            m = self._min_left = lo
        if self.spec is None:
            return m, 1
        return -(-m // (self.spec.k + 1)), self._qv_max

    def advance(self, a: float, end_bound: float, fb: FuseBound, lazy: bool = False) -> bool:
        """Plan the steps that end before a; False when the step at t cannot be planned here (the
        ordinary step must take it: a step in which nothing fits, a step ending at or past
        `end_bound`). `lazy` (the plan routing an arrival at a, which
        needs only the count at a): once a step is planned, stop before plain decode steps that
        cannot change the count before a (`quiet`), which a later call plans in one segment with
        those that follow (not cut at a)."""
        self.q_until = -math.inf
        check = False  # (the caller has found it not quiet at t)
        while self.t < a:
            act, pend = self.active, self.pending
            if pend and pend[0][1] > self.t and not act:  # idle until the first one arrives
                self.t = pend[0][1]
                continue
            if not act and not pend:
                self.end_s = self.t
                self.t = math.inf
                return True
            if self.partials or (pend and pend[0][1] <= self.t and len(act) < self.max_seqs):
                got = self._mixed(a, end_bound)
            elif self.spec is not None:
                got = self._spec_steps(a, end_bound)
            else:
                if check and self.quiet(a):
                    return True
                got = self._segment(a, end_bound, fb)
            check = lazy
            if got == PREEMPT:  # (a decode step that preempts: planned by the mixed step's rules)
                got = self._mixed(a, end_bound)
            if got == WAIT:
                self.wait_t = self.t
                return True
            if got == HARD:
                return False
            if self.stop_done and self.gone and self.gone[-1][0] == self.t:
                return True  # (completions at t: a closed loop's sends)
        return True

    def waits(self, a: float) -> bool:
        """Whether `advance(a)` would plan nothing and return at once: its last call stopped at
        the step from t (nothing has moved t since) because that step ends at `wait_end` >= a. A
        request routed here since arrives after t, so that step is planned the same (it admits
        what had arrived by t). `close` forgets it with the step's plan when it makes a piece
        (the next extension plans that step anew); a cursor that planned nothing keeps both, as
        it kept the plan before (`_peek`)."""
        return self.wait_t == self.t and a <= self.wait_end

    def _k(self, n_run: int, dec: list[int]) -> int:
        """The step's k, as `sim.policies.choose_k` chooses it (in scalars)."""
        spec = self.spec
        assert spec is not None
        k = policy_k(spec, n_run, self.rep.price.speculating)
        if k != ADAPTIVE or not dec:
            return k if k != ADAPTIVE else 0
        acc, prop = self._acc_prop(dec)  # (unpacked, not starred: a native call)
        return adaptive_pick(self.rep.price, acc, prop, float(self.ctx))

    def _acc_prop(self, dec: list[int]) -> tuple[list[int], list[int]]:
        """The decoding entries' drafts accepted and proposed so far (the adaptive policy's
        estimates), from their offsets (`_offsets`)."""
        C, NX, ACC, PROP = self.C, self.NX, self.ACC, self.PROP
        PS, KS, VS = self.PS, self.KS, self.VS
        return [ACC[e] + C[e] - PS - (NX[e] + VS) for e in dec], [PROP[e] + KS for e in dec]

    def _reserve(self, k: int, dec: list[int], drop: list[int] | None = None) -> tuple[int, int]:
        """(q_v, KV blocks the decoding sequences' reservation takes): k + 1 tokens capped by what
        is left, a tree's every node capped by the model's length, one token without speculation.
        (`drop`: decoding entries left out of `dec`, for `PlainCursor`, which counts all of them.)"""
        if not k:
            return 1, reserve_need(self.C, self.R, dec, 1, 1, self.rt.max_model_len)
        spec = self.spec
        assert spec is not None
        qv = spec.verify_tokens(k)
        return qv, reserve_need(self.C, self.R, dec, k + 1, qv, self.rt.max_model_len)

    def _prefill_plan(self, n_dec: int, qv: int, free: int, partials: list[int] | None = None, admit: bool = True
                      ) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]], int]:
        """The step's prefill chunks by the rules `sim.step.plan_prefill` follows (`prefill_chunk`,
        `whole_fits`): the token budget
        left after the decodes goes to the partial prefills in slot order, then to the waiting
        requests arrived by t, FCFS, while a slot and a free block remain (a prompt chunked in the
        budget and the blocks left, or whole without chunked prefill). Returns the partials'
        chunks (entry, tokens), the admissions (request, tokens, prefill target) and the blocks
        left. (`partials`: those a preemption leaves; `admit`: false in a step that preempted, as
        in the ordinary step: the victim, back at the head of the queue, would take back the
        blocks just taken from it.)"""
        reqs = self.reqs
        budget = full = prefill_budget(self.budget_max, n_dec * qv)
        C, TGT = self.C, self.TGT
        chunked = self.chunked
        parts: list[tuple[int, int]] = []
        for e in (self.partials if partials is None else partials):
            if budget <= 0:
                break
            have = ((C[e] + (B - 1)) // B) * B - C[e]  # room in its blocks
            c, extra = prefill_chunk(TGT[e] - C[e], have, budget, budget == full, chunked, free)
            free -= extra
            if c <= 0:
                break
            parts.append((e, c))
            budget -= c
        adm: list[tuple[int, int, int]] = []
        running = len(self.active)
        t = self.t
        victims = self.victims
        for rid, arrived in (self.pending if admit else ()):
            if arrived > t or not (budget > 0 and running < self.max_seqs and free > 0):
                break
            # a preempted request recomputes its output too
            tokens = reqs.prompt_v[rid] + (victims[rid][0] if rid in victims else reqs.generated_v[rid])
            alone = budget == full
            if not chunked and not whole_fits(tokens, -(-tokens // B), budget, alone, free):
                break  # it waits whole
            c, extra = prefill_chunk(tokens, 0, budget, alone, chunked, free)
            free -= extra
            adm.append((rid, c, tokens))
            budget -= c
            running += 1
        return parts, adm, free

    def _waiting_at(self, end: float) -> int:
        """Requests sent here and not admitted, by the end of a step at `end` (those not arrived
        by then are at the tail: `pending` is in arrival order; a long queue is not walked)."""
        pend = self.pending
        w = len(pend)
        while w and pend[w - 1][1] > end:  # (from the tail: a deque's ends are read in O(1))
            w -= 1
        return w

    def _mixed(self, a: float, end_bound: float) -> int:
        """A step with prefill work (partial prefills, or waiting requests to admit): the ordinary
        step's rules, every decoding sequence decoding too."""
        rep, reqs = self.rep, self.reqs
        spec = self.spec
        peek = self._peek
        # (typed here, not by the kept plan's first assignment below: compiled, an untyped local is
        # a Python object and every operation on it generic)
        k: int
        qv: int
        dec: list[int]
        need: int
        parts: list[tuple[int, int]]
        adm: list[tuple[int, int, int]]
        cost: tuple[float, float, float, float, float, float, float]
        victims: int
        total: float
        target: float
        draft: float
        over: float
        flops: float
        nbytes: float
        pre_tokens: float
        if peek is not None and peek[0] == self.t and len(peek[1]) == 8:
            k, qv, dec, need, parts, adm, cost, victims = peek[1]
            total, target, draft, over, flops, nbytes, pre_tokens = cost
        else:
            dec = self._decoders()
            n_dec = len(dec)
            k = self._k(len(self.active), dec) if spec is not None else 0
            victims = vfree = vctx = 0  # the entries the step preempts, their blocks, their decoding contexts
            partials = None
            if k and self.chunked and self.free > n_dec * (self._qv[k] // B + 1) + self.budget_max // B + len(
                    self.partials) + len(self.pending):
                # room for every sequence's whole reservation (qv // B + 1 blocks at most) and for
                # every chunk the budget allows (its tokens / B + 1 blocks at most): it fits, and
                # the prefill plan never runs short of blocks, whatever the reservation is exactly
                # (with drafts the blocks held after the step do not depend on it: `_blocks_after`)
                qv, need = self._qv[k], 0
            else:
                qv, need = self._reserve(k, dec)
                if need > self.free:  # it preempts
                    victims, vpart, vfree, vctx, dec, qv, need = self._victims(k, dec)
                    n_dec = len(dec)
                    partials = self.partials[:len(self.partials) - vpart]
            parts, adm, _ = self._prefill_plan(n_dec, qv, self.free + vfree - need, partials, not victims)
            n_pre = len(parts) + len(adm)
            if not n_dec and not n_pre:
                return HARD  # nothing fits: the ordinary step preempts
            if n_pre == 1:  # (the usual case: no lists)
                e_or_r, c = parts[0] if parts else adm[0][:2]
                pre_tokens, pre_ctx, pre_pairs = prefill_sums_one(c, self.C[e_or_r] if parts else 0)
            else:
                pre_tokens, pre_ctx, pre_pairs = prefill_sums([c for _, c in parts] + [c for _, c, _ in adm],
                                                              [self.C[e] for e, _ in parts] + [0] * len(adm))
            ctx = float(self.ctx - vctx) if n_dec else 0.0
            if spec is None:
                total, flops, nbytes = rep.price.plain_step(n_dec, ctx, n_pre, pre_tokens, pre_ctx, pre_pairs)
                target, draft, over = total, 0.0, 0.0
            else:
                plan = None
                if spec.shape is not None and k and n_dec:
                    tri = qv * qv if not spec.shape.chain else qv * (qv + 1) / 2.0
                    plan = VerifyPlan(float(n_dec) * qv, ctx * qv + float(n_dec) * tri, float(n_dec), ctx)
                total, target, draft, over, flops, nbytes = rep.price.spec_cost(n_dec, ctx, k, n_pre, pre_tokens,
                                                                                 pre_ctx, pre_pairs, plan)
        t = self.t
        end = t + total
        if end >= end_bound or end >= a:  # (the plan kept for the next call: no tuples on a step taken now)
            self._peek = (t, (k, qv, dec, need, parts, adm, (total, target, draft, over, flops, nbytes, pre_tokens),
                              victims))
            if end >= end_bound:
                return HARD
            self.wait_end = end
            return WAIT
        self._peek = None
        for _ in range(victims):  # (the youngest first, as the ordinary step's reservation loop)
            self._preempt()
        n_dec = len(dec)
        others = self.partials[:] if k else []  # entries that do not decode (the admitted ones join below)
        emitted = self._decode(k, dec)
        done_pre: list[int] = []
        C, TGT = self.C, self.TGT
        taken = 0  # blocks the prefill chunks take
        for e, c in parts:
            x = C[e]
            C[e] = x + c
            taken += (x + c + (B - 1)) // B - (x + (B - 1)) // B
            if x + c >= TGT[e]:
                done_pre.append(e)
        pend = self.pending
        for rid, c, tokens in adm:
            pend.popleft()
            e = self._add(rid, c, tokens)
            taken += (c + (B - 1)) // B
            others.append(e)
            self.admitted.append((rid, t))
            self.ops.append((ADMIT_OP, rid))
            if c >= tokens:
                done_pre.append(e)
        if done_pre:  # a prefill done samples its first token (a recomputed one its next token)
            R = self.R
            for e in done_pre:
                if R[e] == reqs.output_v[self.RID[e]]:
                    self.first.append((self.RID[e], end))
                R[e] = R[e] - 1
            emitted += len(done_pre)
            self._prefilled(done_pre)
        self._min_left = None
        if k:
            # with drafts every entry holds ceil(context / B) blocks after the step: the decoding
            # ones' were summed by `_decode`, with those that finished (in slot order), so only the
            # others are summed here and the entries are not scanned again (as `_blocks_after` and
            # `_finish` would), unless a prefill done leaves at once (a one-token output)
            R = self.R
            held = self._dec_held + sum([(C[e] + (B - 1)) // B for e in others])
            self.free -= held - self.held
            self.held = held
            left = self._dec_left
            if done_pre and min([R[e] for e in done_pre]) <= 0:
                left = [e for e in self.active if R[e] <= 0]
            if left:
                self._leave(left, end)
        else:
            self._blocks_after(need, taken)
            self._finish(end)
        n_pre = len(parts) + len(adm)
        self.packed.append(ROW.pack(self.idx, t, total, n_dec + n_pre, n_dec, pre_tokens, n_dec * qv, emitted, k,
                                    self.num_blocks - self.free, self._waiting_at(end), flops, nbytes, target, draft,
                                    over, total if n_dec else 0.0, 1, 0.0))
        self.p_steps += 1
        self.t = end
        return DONE

    def _ctx_left(self, e: int) -> tuple[int, int]:
        """Entry e's context and tokens left."""
        return self.C[e], self.R[e]

    def _victims(self, k: int, dec: list[int]) -> tuple[int, int, int, int, list[int], int, int]:
        """The youngest entries (the last in slot order) a step of depth k must preempt, one by
        one until the decoding sequences left fit their reservation in the free blocks and theirs
        (`sim.step.reserve_decode`'s loop, over `reserve_need`), without preempting them yet: how many, how many of them
        were prefilling, the blocks and decoding contexts they free, the decoding entries left,
        and their q_v and reservation."""
        act = self.active
        part = set(self.partials)
        v = vpart = vfree = vctx = n_drop = 0
        while True:
            v += 1
            e = act[-v]
            c, _ = self._ctx_left(e)
            vfree += (c + (B - 1)) // B
            if e in part:
                vpart += 1
            else:
                n_drop += 1
                vctx += c
            left = dec[:len(dec) - n_drop]
            qv, need = self._reserve(k, left, dec[len(dec) - n_drop:])
            if need <= self.free + vfree:
                return v, vpart, vfree, vctx, left, qv, need

    def _preempt(self) -> None:
        """The ordinary step's preemption by recompute (`ReplicaState.preempt_youngest`): the youngest
        entry leaves its slot and its KV blocks and goes back to the head of the queue, keeping
        its output so far and its draft counters for its readmission (`victims`, `_add`)."""
        e = self.active[-1]
        rid = self.RID[e]
        c, left = self._ctx_left(e)
        prop = acc = ver = vem = 0
        if self.spec is not None:
            prop, acc, vem = self._counters(e)
            ver = self._verified(e)
        self.active.pop()
        nb = (c + (B - 1)) // B
        self.free += nb
        self.held -= nb
        if e in self.partials:
            self.partials.remove(e)
        else:
            self.ctx -= c
            self._unindex(e)
        gen = self.reqs.output_v[rid] - left
        self.victims[rid] = (gen, prop, acc, ver, vem)
        self.preempted.append((rid, gen, prop, acc, ver, vem))
        self.pre_t.append(self.t)
        self.ops.append((PREEMPT_OP, rid))
        self.pending.appendleft((rid, -math.inf))
        self._min_left = None

    def _unindex(self, e: int) -> None:
        """A decoding entry leaves without finishing (`PlainCursor` forgets its indexes)."""

    def _add(self, rid: int, c: int, tokens: int) -> int:
        """An admitted request, prefilling `c` of its `tokens` this step: its entry (its draft
        counters as it left them, when it was preempted)."""
        reqs = self.reqs
        e = len(self.C)
        self.C.append(c)
        v = self.victims.pop(rid, None) if self.victims else None  # (preempted by this cursor)
        if v is None:
            if reqs.preemptions_v[rid]:  # preempted before, by an ordinary step: as the request table holds it
                v = (int(reqs.generated[rid]), int(reqs.proposed[rid]), int(reqs.accepted[rid]),
                     int(reqs.verify_steps[rid]), int(reqs.verify_emitted[rid]))
            else:  # never admitted before: nothing generated, no drafts counted (only preemptions write them back)
                v = FRESH
        self.R.append(reqs.output_v[rid] - v[0])
        self.RID.append(rid)
        self.TGT.append(tokens)
        if self.spec is not None:
            self.NX.append(reqs.lead_off_v[rid] + v[3])
            self.PROP.append(v[1])
            self.ACC.append(v[2])
            self.VEM.append(v[4])
        self.active.append(e)
        if c < tokens:
            self.partials.append(e)
        return e

    def _prefilled(self, done: list[int]) -> None:
        """These entries' prefill is done: they decode from the next step."""
        if self.partials:
            d = set(done)
            self.partials = [e for e in self.partials if e not in d]
        C = self.C
        self.ctx += sum([C[e] for e in done])
        if self.spec is not None:
            self._offsets(done)

    def _blocks_after(self, need: int, taken: int) -> None:
        """A step without drafts: the decoding sequences hold what they reserved (`need` more), the
        prefills what their chunks took (`taken`); the free blocks follow. (With drafts every entry
        holds ceil(context / B) blocks after the step, a reservation's rejected drafts released:
        `_mixed` sums them.)"""
        held = self.held + need + taken
        self.free -= held - self.held
        self.held = held

    def _decode(self, k: int, dec: list[int]) -> int:
        """Every decoding sequence's tokens this step: accepted drafts + 1 (capped by what is left)
        read from its outcomes, or one without speculation; contexts grow (the draft counters
        follow from them: `_offsets`). Returns the tokens, and keeps the decoding entries' blocks
        after the step (ceil(context / B), summed) and those that finished, in slot order
        (`_dec_held`, `_dec_left`: `_mixed` and `_spec_steps` read them). One pass over the
        batch: the speculative steps' hot loop."""
        C, R = self.C, self.R
        if not k:
            self._dec_held, self._dec_left = decode_one(C, R, dec)
            self.ctx += len(dec)
            self.PS += 1
            return len(dec)
        self.KS += k
        emitted, self._dec_held, self._dec_left = decode_spec(C, R, self.NX, self.VS, self.reqs.lead_b, k, dec,
                                                              self._fix)
        self.VS += 1
        self.ctx += emitted
        return emitted

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
            if spec:
                p, a, v = self._counters(e)
                self.done.append((rid[e], t, p, a, self._verified(e), v))
            else:
                self.done.append((rid[e], t, 0, 0, 0, 0))
        act = self.active
        if len(left) <= FEW_LEFT:  # (`left` is every entry with nothing left)
            drop_entries(act, left)
        else:
            self.active = [e for e in act if R[e] > 0]
        self.gone.append((t, len(left)))
        self._min_left = None

    def _segment(self, a: float, end_bound: float, fb: FuseBound) -> int:
        """Plain decode steps in closed form: `PlainCursor`'s (a speculative cursor steps one by one)."""
        raise NotImplementedError

    def _spec_steps(self, a: float, end_bound: float) -> int:
        """Speculative decode steps (nothing admitted: nothing waiting has arrived, or no slot), one
        after another for as long as `advance` would choose one again (DONE when it would not), each
        with its outcomes, the rejected drafts' blocks and the completions in one pass over the
        batch. (Held blocks after a step are ceil(context / B) whatever was reserved, so the
        reservation matters only for whether it fits; with room for every sequence's whole
        reservation it is not summed.) The loop keeps what every step reads in locals: a small
        batch's step is mostly this fixed cost."""
        price = self.rep.price  # (its methods called on it, not through bound-method locals: native calls, unboxed)
        adaptive = self.spec is not None and self.spec.policy == "adaptive"
        packed = self.packed  # (each step's row packed at once: no tuple of boxed floats kept)
        k_fixed, qvs = self._k_fixed, self._qv
        pend = self.pending
        max_seqs, idx, num_blocks = self.max_seqs, self.idx, self.num_blocks
        stop = self.stop_done
        t = self.t
        act = self.active
        while True:
            n = len(act)
            peek = self._peek
            k: int
            qv: int
            cost: tuple[float, float, float, float, float, float] | None  # (typed: see `_mixed`)
            if peek is not None and peek[0] == t and len(peek[1]) == 3:
                k, qv, cost = peek[1]
                assert cost is not None
                total, target_s, draft_s, over_s, flops, nbytes = cost  # (C doubles from here: `cost` is an object)
            else:
                if k_fixed >= 0:
                    k, cost = k_fixed, None
                elif adaptive:  # the choice prices every k: the chosen one's figures come with it
                    acc, prop = self._acc_prop(act)  # (unpacked, not starred: a native call)
                    k, cost = adaptive_choice(price, acc, prop, float(self.ctx))
                else:
                    k, cost = self._k(n, act), None
                qv = qvs[k]
                if self.free < n * (qv // B + 1) and self._reserve(k, act)[1] > self.free:
                    return PREEMPT  # it would preempt
                if cost is None:  # (the common step: a native call, its figures C doubles, never boxed)
                    total, target_s, draft_s, over_s, flops, nbytes = price.spec_step(n, float(self.ctx), k)
                else:
                    total, target_s, draft_s, over_s, flops, nbytes = cost
            end = t + total
            if end >= end_bound or end >= a:  # the step is the ordinary one's, or waits for the arrival at a
                self._peek = (t, (k, qv, (total, target_s, draft_s, over_s, flops, nbytes)))
                self.wait_end = end
                return HARD if end >= end_bound else WAIT
            self._peek = None
            emitted = self._decode(k, act)  # (every running sequence decodes: `act` is every entry)
            held, left = self._dec_held, self._dec_left
            self.free += self.held - held
            self.held = held
            self._min_left = None
            if left:
                self._leave(left, end)
                act = self.active
            packed.append(ROW.pack(idx, t, total, n, n, 0.0, n * qv, emitted, k, num_blocks - self.free,
                                   self._waiting_at(end) if pend else 0, flops, nbytes, target_s, draft_s, over_s,
                                   total, 1, 0.0))
            self.p_steps += 1
            self.t = t = end
            # `advance`'s choice for the next step: this one again unless the arrival at a is
            # reached, the replica empties, or a request has arrived for a free slot
            if t >= a or not act or (pend and pend[0][1] <= t and len(act) < max_seqs) or (left and stop):
                return DONE


class PlainCursor(Cursor):
    """A cursor without speculation: every decoding sequence gains one token a step, so a decoding
    entry e has context C_e + S after the cursor's S-th step (`C` holds its base) and finishes at
    step FIN_e; the context sum, the KV blocks the next steps take (a histogram of base mod B) and
    the next completion (a heap of FIN, `HEAP_SHIFT`) are kept without touching every entry
    (`sim.fusion.plan_absorbing`'s scalars). Entries still prefilling keep their context in `C`."""

    def __init__(self, rep: ReplicaState, t: float) -> None:
        super().__init__(rep, t)
        self._index()

    def _index(self) -> None:
        """S = 0: the decoding entries' bases are their contexts, FIN their tokens left."""
        self.S = 0
        n = len(self.C)
        self.FIN = self.R[:]
        self.hist = [0] * B
        self.alive = [True] * n
        p = set(self.partials)
        heap = []
        for e in range(n):
            if e not in p:
                h = self.C[e] % B
                self.hist[h] = self.hist[h] + 1
                heap.append((self.FIN[e] << HEAP_SHIFT) | e)
        heapq.heapify(heap)
        self.heap = heap

    def _entries(self) -> tuple[list[int], ...]:
        S, p = self.S, set(self.partials)
        act = self.active
        C = [self.C[e] if e in p else self.C[e] + S for e in act]
        R = [self.R[e] if e in p else self.FIN[e] - S for e in act]
        return [self.RID[e] for e in act], C, R, [self.TGT[e] for e in act]

    def _renumber(self, state: tuple[list[int], ...]) -> None:
        super()._renumber(state)
        self._index()

    def _ctx_left(self, e: int) -> tuple[int, int]:
        if e in self.partials:
            return self.C[e], self.R[e]
        return self.C[e] + self.S, self.FIN[e] - self.S

    def _unindex(self, e: int) -> None:
        h = self.C[e] % B
        self.hist[h] = self.hist[h] - 1
        self.alive[e] = False
        self._pop_dead()

    def _pop_dead(self) -> None:
        """Drop preempted entries off the heap's top: its top is the next completion."""
        heap, alive = self.heap, self.alive
        while heap and not alive[heap[0] & HEAP_ENTRY]:
            heapq.heappop(heap)

    def _fewest_steps(self) -> tuple[int, int]:
        return (self.heap[0] >> HEAP_SHIFT) - self.S, 1  # (the next completion, from the heap)

    def _reserve(self, k: int, dec: list[int], drop: list[int] | None = None) -> tuple[int, int]:
        S = self.S
        need = self.hist[(-S) % B]  # the decoding sequences whose next token opens a block
        if drop:
            C = self.C
            need -= sum([1 for e in drop if not (C[e] + S) % B])
        return 1, need

    def _decode(self, k: int, dec: list[int]) -> int:
        self.S += 1
        self.ctx += len(dec)
        return len(dec)

    def _prefilled(self, done: list[int]) -> None:
        """Entries whose prefill is done join the decoding ones (base = context - S)."""
        super()._prefilled(done)
        S = self.S
        for e in done:
            if e >= len(self.alive):
                self.alive.append(True)
                self.FIN.append(0)
            be = self.C[e] - S
            self.C[e] = be
            f = S + self.R[e]
            self.FIN[e] = f
            heapq.heappush(self.heap, (f << HEAP_SHIFT) | e)
            h = be % B
            self.hist[h] = self.hist[h] + 1

    def _add(self, rid: int, c: int, tokens: int) -> int:
        e = super()._add(rid, c, tokens)
        while len(self.alive) <= e:
            self.alive.append(True)
            self.FIN.append(0)
        return e

    def _finish(self, t: float) -> None:
        heap, S = self.heap, self.S
        if not heap or heap[0] >> HEAP_SHIFT > S:
            return
        count = 0
        alive = self.alive
        gone: list[int] = []
        while heap and heap[0] >> HEAP_SHIFT <= S:
            e = heapq.heappop(heap) & HEAP_ENTRY
            if not alive[e]:
                continue  # (preempted)
            c = self.C[e] + S
            nb = (c + (B - 1)) // B
            self.free += nb
            self.held -= nb
            self.ctx -= c
            h = self.C[e] % B
            self.hist[h] = self.hist[h] - 1
            self.alive[e] = False
            self.done.append((self.RID[e], t, 0, 0, 0, 0))
            count += 1
            gone.append(e)
        self._pop_dead()
        act = self.active
        if count <= FEW_LEFT:
            drop_entries(act, gone)
        else:
            self.active = [e for e in act if alive[e]]
        self.gone.append((t, count))

    def _segment(self, a: float, end_bound: float, fb: FuseBound) -> int:
        """Plain decode steps from t in closed form (`sim.step.kv_steps`, `decode_clock_steps`): the
        steps that start before the next metric cut and before the first waiting request arrives
        (the step after it admits it), end before a and before `end_bound`, up to the first
        completion and while the KV blocks they grow into are free. A step during which a waiting
        request arrives is logged apart (its waiting count differs)."""
        rep = self.rep
        cost = self.rt.cost
        n = len(self.active)
        t, S = self.t, self.S
        m = (self.heap[0] >> HEAP_SHIFT) - S
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
        first = new_blocks_first(self.hist, S)
        fit = kv_steps(n, mm, free, first)
        if fit != mm:
            mm = fit
            if mm < 1:
                return PREEMPT  # it would preempt
        k, slope, st = decode_clock_steps(cost, n, ctx0, d0, t, mm, sb, el)
        if k < 1:  # its first step ends at or after a (it waits for the arrival's routing), or past the end bound
            self.wait_end = t + d0
            return HARD if t + d0 >= end_bound else WAIT
        end = float(st[k])
        used0 = self.num_blocks - free
        but_last = blocks_over(n, k - 1, first)
        new_blocks = blocks_over(n, k, first)
        self.free = free - new_blocks
        self.held += new_blocks
        self.S = S + k
        self.ctx += n * k
        self._finish(end)
        used = self.num_blocks - self.free
        # a request arrives during its last step, or a completion at its end sends requests that
        # wait at once (a closed loop without frontend latency, `loop_piece`): that step's row apart
        if end >= arrive or (self.split_done and k == m):
            if k > 1:
                self.packed.append(ROW.pack(*rep.price.run_row(t, k - 1, d0, slope, n, ctx0, used0 + but_last,
                                                   self._waiting_at(float(st[k - 1])))))
            self.packed.append(ROW.pack(*rep.price.run_row(float(st[k - 1]), 1, d0 + (k - 1) * slope, 0.0, n, ctx0 + (k - 1) * n,
                                               used, self._waiting_at(end))))
        else:
            self.packed.append(ROW.pack(*rep.price.run_row(t, k, d0, slope, n, ctx0, used, self._waiting_at(end))))
        self.p_steps += k
        self.t = end
        return DONE


def drop_entries(act: list[int], gone: list[int]) -> None:
    """These entries leave the batch list in place, its order kept: for a few of them a scan of C
    ints each is cheaper than a new list (`FEW_LEFT`)."""
    for e in gone:
        i = 0
        while act[i] != e:
            i += 1
        del act[i]


def _quiet_until(x: float) -> float:
    """The arrival times a with a + QUIET_MARGIN * max(a, 1) < x are those before this (a little
    earlier: `quiet` may only err towards planning)."""
    return x - 2.0 * QUIET_MARGIN * (x if x > 1.0 else 1.0)


def cursor_for(rep: ReplicaState, t: float) -> Cursor:
    """A replica's cursor from its state at t: speculative steps one by one, or plain decode in
    closed form (`PlainCursor`); it plans the steps that preempt."""
    return Cursor(rep, t) if rep.rt.spec is not None else PlainCursor(rep, t)


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

    def __init__(self, replicas: Sequence[ReplicaState], fuse: FuseBound, horizon_s: float, limit: int) -> None:
        self.replicas, self.fuse, self.horizon_s, self.limit = replicas, fuse, horizon_s, limit
        r = len(replicas)
        self.cursors: list[Cursor | None] = [None] * r
        self.frozen: list[Cursor | None] = [None] * r
        self.outs: list[list[Out]] = [[] for _ in range(r)]
        self.pieces: list[deque[Piece]] = [deque() for _ in range(r)]
        self.j = -1  # the next arrival to route (-1: not started)
        self.broken = False
        # an autoscaled fleet (sim.fleet): the router sends to live replicas only, and the live set (and
        # speculation that follows load) changes only at these times, which the plan never passes
        # before the run has (the autoscaler's ticks read completions and counts as they are then)
        self.fleet: Any = None
        self.changes: list[float] = []
        self.routed: dict[int, int] = {}  # arrival -> the replica the plan sent it to, until the arrival process does
        # requests the plan sent to a replica whose cursor it then dropped, arriving after the drop: they
        # count for its next ordinary step (`ordinary`)
        self.carry: list[list[tuple[int, float]]] = [[] for _ in range(r)]
        # the arrival process's event times: now + (t - now) from the previous event (`sim.run._arrivals`),
        # again while that lands short of t (an ulp short when t - now rounds down: it waits once more)
        ev: list[float] = []
        now = 0.0
        for t in fuse.times():
            while t > now:
                now = now + (t - now)
            ev.append(now)
        self.event_s = ev

    # ------------------------------------------------------------------ the replicas' side
    def boundary(self, rep: ReplicaState) -> Piece | None:
        """A replica at a step boundary (now): its next planned piece, planning more when none is
        left; None when its next step is not planned (it takes an ordinary step: `ordinary`)."""
        r = rep.idx
        q = self.pieces[r]
        if q:
            return q.popleft()
        if self.broken:
            return None
        now = rep.env._now
        if self.j < 0:  # the first boundary: every idle replica is known (empty)
            self.j = self.fuse.next_index
            for s in self.replicas:
                if s.idx != r and s.n_running == 0 and not s.waiting:
                    self.cursors[s.idx] = cursor_for(s, now)
        if self.cursors[r] is None:
            # rejoin from its state now, once the plan has routed every arrival the queues hold
            self._extend(r, catch_up=True)
            if self.broken or self.j < self.fuse.next_index or not Cursor.joinable(rep):
                return None
            self.cursors[r] = cursor_for(rep, now)
        self._extend(r)
        return q.popleft() if q else None

    def check(self, rid: int, replica: int) -> None:
        """The arrival process sent request `rid` to `replica`: where the plan sent it (a plan that
        routes otherwise has gone wrong: fail loudly, never silently)."""
        planned = self.routed.pop(rid, replica)
        assert planned == replica, f"request {rid}: the joint plan routed it to replica {planned}, the router to {replica}"

    def ordinary(self, rep: ReplicaState, end_s: float) -> None:
        """A replica starts an ordinary step now, ending at `end_s`: its count until then is its
        outstanding requests now plus those the plan sent it that arrive later."""
        if self.broken:
            return
        r = rep.idx
        now = rep.env._now
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

    def went_idle(self, rep: ReplicaState) -> None:
        """A replica waits for work from now: known again (empty) from now on."""
        r = rep.idx
        if not self.broken and self.cursors[r] is None and self.j >= 0 and not self.pieces[r]:
            c = self.cursors[r] = cursor_for(rep, rep.env._now)
            later = [p for p in self.carry[r] if p[1] > c.since]
            self.carry[r] = []
            if later:  # (sent here by the plan, arriving later)
                c.pending.extend(later)
                c.wake(later[0][1])


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

    def _route(self, j: int, a: float, w: Cursor | Out) -> None:
        """Arrival j, at a, waits at the replica whose cursor (or ordinary step) is `w`."""
        if isinstance(w, Cursor):
            if w.t == math.inf:
                w.wake(a)
            w.pending.append((j, a))
            w.q_until = -math.inf
        else:
            w.sent += 1
        self.j = j + 1

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
        changes = self.changes
        stop_s = math.inf  # the next change of the live set after now: nothing is planned past it yet
        if changes:
            i = bisect.bisect_right(changes, fb.env._now)
            stop_s = changes[i] if i < len(changes) else math.inf
        fleet = self.fleet
        while not self.broken:
            j = self.j
            if j >= nq or (catch_up and j >= fb.next_index):
                break
            a = at[j]
            if a >= stop_s:
                break
            if j < fb.next_index:  # already routed by the arrival process (the plan caught up): where it went
                best = int(self.replicas[0].reqs.replica[j])
                got = self._count(best, a)
                if got is None:
                    break  # (where it waits is not known yet)
                self._route(j, a, got[1])
                continue
            # each replica's count at a (`_count`, inlined for a cursor), planning first the steps
            # that can change it (a replica past one whose count is not known is planned up to a
            # below, as every replica is)
            counts: list[int] = []
            where: list[Cursor | Out] = []
            tie = False
            for r in range(R):
                c = cur[r]
                if c is not None:
                    if (c.t < a and a >= c.q_until and not c.waits(a) and not c.quiet(a)
                            and not c.advance(a, end_bound, fb, lazy=True)):
                        self.frozen[r] = c  # its step at c.t is the ordinary step's
                        self._drop(r, c, c.t)
                    elif a > c.since:
                        counts.append(len(c.active) + len(c.pending))
                        where.append(c)
                        continue
                got = self._count(r, a)
                if got is None:
                    break
                counts.append(got[0])
                where.append(got[1])
                tie = tie or (isinstance(got[1], Out) and got[1].start_s == a)
            if len(counts) < R:
                break  # a replica's count at a is not known yet
            total = best = 0  # (the sum, and the first replica with the fewest: one loop of C ints)
            least = counts[0]
            for r in range(R):
                n_r = counts[r]
                total += n_r
                if n_r < least:
                    best, least = r, n_r
            if total + 1 > self.limit or tie:
                self.broken = True  # the backlog could stop the run here, or a tie SimPy's event order decides
                break
            if fleet is not None:
                live = [r for r in range(R) if fleet.state[r] == LIVE]
                best = min(live, key=counts.__getitem__)
            self.routed[j] = best
            self._route(j, a, where[best])
            routed += 1
            if routed >= EXTEND_ARRIVALS and not catch_up:
                rc = cur[requester]
                if rc is None or rc.p_steps:
                    break
        # every replica's steps that end before the next arrival (and the next change), then the pieces
        a = at[self.j] if self.j < nq else math.inf
        if stop_s < a:
            a = stop_s
        for r in range(R):
            c = cur[r]
            if c is not None and c.t < a and not self.broken and not c.waits(a) and not c.advance(a, end_bound, fb):
                self.frozen[r] = c
                self._drop(r, c, c.t)
            for c in (cur[r], self.frozen[r]):
                if c is not None:
                    p = c.close()
                    if p is not None:
                        self.pieces[r].append(p)
            self.frozen[r] = None
            self.outs[r] = [o for o in self.outs[r] if o.end_s > a]


def loop_piece(rep: ReplicaState) -> tuple[Piece, SendFeed, bool] | None:
    """The next steps of a replica serving a closed loop alone (`sim.fusion.can_absorb`: it plans the
    loop's sends itself, `SendFeed`), planned by a cursor as one piece: what the one-replica runs
    (`sim.fusion.absorbing_run`, `sim.fusion.spec_steps_run`) leave to the ordinary step, partial
    prefills and chunked admissions included, by the same rules (`Cursor.advance`).

    Each completion sends the table's next request at once (`sim.run.ClosedLoop`): it waits for
    the next step without a frontend latency (the step that completed counts it waiting, as the
    ordinary step logs its queue after its completions), or reaches the queue that latency later.
    So every send that reaches the queue during a step is known before the step is planned (a
    send comes from a completion, at an earlier step's end): the cursor plans up to the next one
    not yet reached, stopping at each completion to send. The piece ends before a step it cannot
    plan (the ordinary step takes it: a preemption, nothing fits, the horizon), before a step
    ending within NEAR of a send reaching the queue (which comes first is SimPy's event order), where the
    replica goes idle, at the completion that finds the table sent out (`SendFeed.exhausted`:
    the run's end is watched in the engine), or after LOOP_STEPS steps. Returns the piece, its
    sends and whether it ended before a step the ordinary step must take (a cursor built at the
    piece's end would stop there at once); None when it plans no step."""
    if not Cursor.joinable(rep):
        return None
    fb = rep.fuse
    assert fb is not None
    now = rep.env._now
    c = cursor_for(rep, now)
    if c.t == math.inf:
        return None
    feed = SendFeed(rep.reqs.closed)
    c.stop_done, c.split_done = True, feed.f <= 0
    fly = deque(zip(feed.times, feed.rids, strict=True))  # sends on their way to the queue, in order
    pend = c.pending
    end_bound = fb.horizon_s
    hard = False
    while c.p_steps < LOOP_STEPS:
        t = c.t
        a = bound = tol = math.inf
        if fly:
            a = fly[0][0]
            tol = NEAR * (a if a > 1.0 else 1.0)
            bound = a - tol
            if bound <= t + NEAR * (t if t > 1.0 else 1.0):
                break  # a send reaches the queue at the step boundary t
        g = len(c.gone)
        if not c.advance(bound, end_bound, fb):
            hard = True
            break  # the step at t is the ordinary step's
        if c.t == math.inf:
            break  # the replica is idle
        if len(c.gone) > g:  # completions at c.t (the last step planned): as many sends
            n0 = len(feed.times)
            ready: list[int] = []
            waits = feed.complete(c.t, c.gone[-1][1], ready)
            if waits:  # (no frontend latency: waiting from now)
                pend.extend([(rid, c.t) for rid in ready])
                c.add_waits(waits)
            fly.extend(zip(feed.times[n0:], feed.rids[n0:], strict=True))
            if feed.exhausted:
                break
        elif fly and c.wait_t == c.t and c.wait_end > a + tol:
            pend.append(fly.popleft()[::-1])  # it reaches the queue during the step at t (not admitted by it)
        else:
            break  # that step ends within NEAR of the send's arrival
    piece = c.close()
    return None if piece is None else (piece, feed, hard)
