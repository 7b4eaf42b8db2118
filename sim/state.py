"""A replica's state between steps, and the counts the router and fused runs read.

Running sequences are packed in the first `n_running` entries of fixed-size integer slot arrays, in
admission order (admissions append, departures compact in order): the oldest is first, the
youngest (the preemption victim) last, and every per-step operation touches only the running
sequences, never history. The KV pool is `free_blocks` (truly free + unreferenced cached blocks)
plus each entry's `blocks`; with prefix caching (sim/prefix_cache.py; only when requests carry
block hashes, decided once per replica) an admitted request references its longest cached prefix,
the full blocks a prefill completes join the cache, and a leaving (or preempted) sequence caches its
remaining full blocks and drops its references.

`FuseBound` is what a fused run of steps must not cross: the next thing that could reach the
replica (an arrival, a closed-loop send), a metric window boundary, the horizon; `backlog_stop`
the arrival at which the backlog limit could stop the run.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import simpy

from models.memory import BLOCK_SIZE
from sim.prefix_cache import PrefixCache
from sim.pricing import StepPricer
from sim.tables import Requests, StepLog, add_reduce

if TYPE_CHECKING:
    from sim.deployment import ReplicaRuntime

# a replica's lifecycle in an autoscaled fleet (sim.fleet)
OFF, WARMING, LIVE, DRAINING = "off", "warming", "live", "draining"


class ReplicaState:
    """One tensor-parallel replica's engine state: the slot arrays of its running sequences, its
    waiting queue, its KV pool and prefix cache, its step pricer (`price`), and, while a fused run or
    a joint piece is in flight, what the router must see of the steps inside it (`gone`, `taken`,
    `pre_t`). `fuse`: the bound of its fused runs (None: fusion off)."""

    # the integer state, one row each of one (fields x slots) array, so a departure compacts all in one operation
    INT_FIELDS = ("rid", "computed", "target", "blocks", "gen", "out", "n_acc", "n_prop", "n_verify", "n_vemit",
                  "n_units", "c_blocks")

    def __init__(self, env: simpy.Environment, idx: int, rt: ReplicaRuntime, reqs: Requests,
                 rng: np.random.Generator, log: StepLog, fuse: FuseBound | None, scalar_steps: bool) -> None:
        self.env, self.idx, self.rt, self.reqs, self.rng, self.log = env, idx, rt, reqs, rng, log
        self.fuse = fuse
        # a speculative step is priced in scalars (`StepPricer.spec_step`) and planned step by step
        # (`sim.fusion.plan_spec_steps`): decided by the models, not by fusion, so the unfused engine (the
        # oracle) chooses k the same way
        self.scalar_steps = scalar_steps
        self.price = StepPricer(rt, idx)
        s = rt.max_num_seqs
        self.ints = np.zeros((len(self.INT_FIELDS), s), dtype=np.int64)
        (self.rid,  # request id of the entry
         self.computed,  # tokens whose KV is computed
         self.target,  # tokens to prefill before decoding
         self.blocks,  # KV blocks held
         self.gen,  # output tokens generated (kept across preemption)
         self.out,  # output tokens the request will generate
         self.n_acc,  # drafted tokens accepted so far
         self.n_prop,  # drafted tokens proposed so far
         self.n_verify,  # verification steps so far
         self.n_vemit,  # tokens emitted by those verifications
         self.n_units,  # prefix caching: leading units of its request the entry references
         self.c_blocks,  # prefix caching: KV blocks of those units (shared, not private)
         ) = self.ints  # row views
        self.rid[:] = -1
        self.free_blocks = rt.plan.num_blocks  # truly free + unreferenced cached (evictable) blocks
        # prefix caching, decided once: only when enabled and some request carries block hashes
        self.cache = PrefixCache(rt.host_kv_blocks) if (rt.prefix_caching and reqs.unit_off is not None) else None
        self.load_s = 0.0  # host-tier loads of the admissions of the step being planned (`attach_prefix`)
        self.waiting: deque[int] = deque()
        self.n_running = 0
        self.gone: list[tuple[float, int]] = []  # a fused run in flight: (time, sequences) completing inside it
        # a piece of the joint plan in flight: its completion times and the sequences completed before each
        # (gone_n[i]: those before gone_t[i]; one entry more), read by `outstanding`
        self.gone_t: list[float] = []
        self.gone_n: list[int] = [0]
        self.gone_i = 0  # the piece's completions before the last `outstanding` call
        self.taken: list[float] = []  # a fused run in flight: the start of each admission inside it
        self.pre_t: list[float] = []  # a joint piece in flight: the start of each step that preempted inside it
        self.loop_hard = False  # a closed loop's piece ended before a step the ordinary step must take

    # ------------------------------------------------------------- routing
    def outstanding(self) -> int:
        """Requests running or waiting here now: during a fused run through completions, less the
        sequences whose completion inside the run has already passed (they leave the slot arrays
        only when the run ends; the router must see what the unfused engine would show)."""
        o = self.n_running + len(self.waiting)
        if self.gone:  # (a list: empty is the common case)
            now = self.env._now
            if self.gone_t:  # a joint plan's piece: (times, cumulative counts)
                # the completions before now (`bisect_left`): the clock only moves on, so the count
                # is found by stepping on from the last call's, in C doubles
                gt = self.gone_t
                i, n = self.gone_i, len(gt)
                t_now: float = now
                while i < n and gt[i] < t_now:
                    i += 1
                self.gone_i = i
                return o - self.gone_n[i]
            for t, count in self.gone:
                if t < now:  # an arrival at the same instant comes first (URGENT), as unfused
                    o -= count
        return o

    def queued(self) -> int:
        """Requests waiting here now, as the unfused engine would show them: during a fused run
        that admits requests, less those whose admitting step has already started (they leave
        the queue only when the run ends; an arrival at the same instant as a step start comes
        first, URGENT, and still sees them waiting), plus those a joint piece's steps preempted,
        from their step's start (they join the queue only when the piece ends)."""
        if self.pre_t:  # (a victim waits from its step's start; its readmission is one of `_taken`)
            now = self.env._now
            return len(self.waiting) - bisect.bisect_left(self.taken, now) + bisect.bisect_left(self.pre_t, now)
        if self.taken:
            return len(self.waiting) - bisect.bisect_left(self.taken, self.env._now)
        return len(self.waiting)

    # ------------------------------------------------------------- state
    def sync_entries(self, idx: np.ndarray | slice) -> None:
        """Write per-request counters of these running entries back to the request table."""
        r = self.rid[idx]
        reqs = self.reqs
        reqs.generated[r] = self.gen[idx]
        if self.rt.spec is None:  # the draft counters stay as admitted (zero) without speculation
            return
        reqs.accepted[r] = self.n_acc[idx]
        reqs.proposed[r] = self.n_prop[idx]
        reqs.verify_steps[r] = self.n_verify[idx]
        reqs.verify_emitted[r] = self.n_vemit[idx]

    def sync(self) -> None:
        """Flush the running sequences' counters (at the end of a run)."""
        self.sync_entries(slice(0, self.n_running))

    def admit(self, rid: int) -> int:
        i = self.n_running
        reqs = self.reqs
        self.rid[i] = rid
        self.computed[i] = 0
        self.blocks[i] = 0
        self.gen[i] = reqs.generated[rid]
        self.out[i] = reqs.output[rid]
        self.target[i] = reqs.prompt[rid] + reqs.generated[rid]  # recompute: prompt + output so far
        self.n_acc[i] = reqs.accepted[rid]
        self.n_prop[i] = reqs.proposed[rid]
        self.n_verify[i] = reqs.verify_steps[rid]
        self.n_vemit[i] = reqs.verify_emitted[rid]
        self.n_running = i + 1
        if self.cache is not None:
            self.attach_prefix(i, rid)
        pre = reqs.preloaded
        if pre is not None and pre[rid]:  # its KV came from a prefill replica (first admission only)
            p = int(pre[rid])
            pre[rid] = 0
            b = -(-p // BLOCK_SIZE)
            self.computed[i] = p
            self.blocks[i] = b
            self.free_blocks -= b
        return i

    # ------------------------------------------------------------- prefix caching
    def units(self, rid: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Request rid's unit keys, cumulative KV blocks and KV blocks per unit."""
        reqs = self.reqs
        assert reqs.unit_off is not None
        lo, hi = int(reqs.unit_off[rid]), int(reqs.unit_off[rid + 1])
        return reqs.unit_key[lo:hi], reqs.unit_cum[lo:hi], reqs.unit_nb[lo:hi]

    def hit(self, rid: int, tokens: int) -> tuple[int, int]:
        """(units, KV blocks) of rid's longest prefix cached in HBM that leaves at least one of its
        `tokens` to compute (the last token's logits are needed: vLLM caps a hit at tokens - 1)."""
        h, blocks, _, _ = self.hit_tiers(rid, tokens)
        return h, blocks

    def hit_tiers(self, rid: int, tokens: int) -> tuple[int, int, int, int]:
        """`hit` and its continuation in the host tier: (HBM units, HBM KV blocks, host units after
        them, their KV blocks), together capped at tokens - 1 as `hit` is."""
        cache = self.cache
        assert cache is not None
        keys, cum, _ = self.units(rid)
        cache.reclaim(self.free_blocks)
        h = cache.match(keys)
        cap = int(np.searchsorted(cum, (tokens - 1) // BLOCK_SIZE, side="right"))
        hh = min(cache.match_host(keys[h:]), cap - h) if (cache.host_blocks and h < cap) else 0
        h = min(h, cap)
        blocks = int(cum[h - 1]) if h else 0
        return h, blocks, hh, (int(cum[h + hh - 1]) - blocks if hh else 0)

    def prefix_match_tokens(self, rid: int) -> int:
        """Tokens of rid's prompt this replica holds cached, in HBM or its host tier (for the
        prefix-affinity router)."""
        if self.cache is None:
            return 0
        _, blocks, _, host_blocks = self.hit_tiers(rid, int(self.reqs.prompt[rid]) + 1)
        return (blocks + host_blocks) * BLOCK_SIZE

    def attach_prefix(self, i: int, rid: int) -> None:
        """At admission: reference the request's prefix cached in HBM, then load the host tier's
        continuation of it, whole units while the free KV blocks hold them (each load's seconds,
        its KV bytes per GPU over the GPU's host link, join `load_s`: the price of the step that
        admits it); its prefill starts after them (the cost model then charges the chunks'
        attention over the cached context)."""
        reqs, cache = self.reqs, self.cache
        assert cache is not None
        target = int(self.target[i])
        h, blocks, hh, _ = self.hit_tiers(rid, target)
        keys, cum, _ = self.units(rid)
        self.free_blocks -= cache.acquire(keys[:h])
        loaded = 0
        if hh:  # host units whose blocks fit in the free blocks left, whole, in chain order
            hh = int(np.searchsorted(cum[h:h + hh], blocks + self.free_blocks, side="right"))
            if hh:
                loaded = cache.load(keys[h:h + hh])
                self.free_blocks -= loaded
                self.load_s += loaded * self.rt.host_load_s_per_block
                h += hh
        blocks += loaded
        self.computed[i] = blocks * BLOCK_SIZE  # the prefill starts at the first uncached block
        self.blocks[i] = self.c_blocks[i] = blocks
        self.n_units[i] = h
        if np.isnan(reqs.scheduled[rid]):  # the first admission (set just after it)
            reqs.cached_tokens[rid] = blocks * BLOCK_SIZE
            reqs.host_cached[rid] = loaded * BLOCK_SIZE
        reqs.prefill_cached[rid] += blocks * BLOCK_SIZE
        reqs.prefill_tokens[rid] += target

    def register(self, i: int) -> None:
        """Entry i's units that are now fully computed join the cache (after a prefill chunk, and
        before it leaves: the output's full blocks too, when its units cover them)."""
        cache = self.cache
        assert cache is not None
        keys, cum, nb = self.units(int(self.rid[i]))
        u0 = int(self.n_units[i])
        u1 = int(np.searchsorted(cum, int(self.computed[i]) // BLOCK_SIZE, side="right"))
        if u1 > u0:
            cache.reclaim(self.free_blocks)
            self.free_blocks += cache.insert(keys[u0:u1], nb[u0:u1])
            self.n_units[i] = u1
            self.c_blocks[i] = int(cum[u1 - 1])

    def kv_accounting(self) -> dict[str, int]:
        """The paged-KV pool by use (for tests): blocks private to running sequences, cached and
        referenced, cached and unreferenced (free capacity), and the engine's free blocks; private +
        referenced + free = the pool, always."""
        n = self.n_running
        cache = self.cache
        private = int(add_reduce(self.blocks[:n]))
        referenced = 0
        if cache is not None:
            private -= int(add_reduce(self.c_blocks[:n]))
            referenced = sum(cache.nb[k] for k, r in cache.ref.items() if r > 0)
        return {"private": private, "referenced": referenced, "evictable": cache.evictable if cache else 0,
                "free": self.free_blocks, "pool": self.rt.plan.num_blocks}

    def release(self, i: int) -> None:
        """Entry i leaves (finished or preempted): its full units are cached, its private blocks
        freed, its references dropped (units nobody references become free capacity)."""
        cache = self.cache
        assert cache is not None
        self.register(i)
        keys = self.units(int(self.rid[i]))[0]
        cache.reclaim(self.free_blocks)
        freed = int(self.blocks[i] - self.c_blocks[i]) + cache.release(keys[: int(self.n_units[i])])
        self.free_blocks += freed

    def preempt_youngest(self) -> None:
        """Preempt by recompute the most recently admitted sequence (the last entry)."""
        i = self.n_running - 1
        self.sync_entries(slice(i, i + 1))
        rid = int(self.rid[i])
        if self.cache is None:
            self.free_blocks += int(self.blocks[i])
        else:
            # a prefill cut short stood for only the tokens it got to (cached or computed)
            self.reqs.prefill_tokens[rid] -= max(0, int(self.target[i] - self.computed[i]))
            self.release(i)
        self.reqs.preemptions[rid] += 1
        self.reqs.requeued += 1
        self.waiting.appendleft(rid)
        self.n_running = i

    def compact(self, keep: np.ndarray) -> None:
        n = self.n_running
        ints = self.ints
        kept = ints[:, :n][:, keep]
        m = kept.shape[1]
        ints[:, :m] = kept
        self.n_running = m

    def leave(self, now: float, stay: np.ndarray | None = None) -> None:
        """Finished sequences leave: completion times, blocks freed, the closed loop told.
        `stay`: the running entries that have not finished, when known (a fused run's plan)."""
        reqs = self.reqs
        n = self.n_running
        fin = self.gen[:n] >= self.out[:n] if stay is None else ~stay
        if stay is not None or fin.any():
            f = fin.nonzero()[0]
            self.sync_entries(f)
            reqs.completion[self.rid[f]] = now
            reqs.n_done += int(f.size)
            if self.cache is None:
                self.free_blocks += int(add_reduce(self.blocks[f]))
            else:
                for j in f.tolist():
                    self.release(j)
            self.compact(~fin if stay is None else stay)
            if reqs.on_complete is not None:
                reqs.on_complete(int(f.size))

    def finish_requests(self, rids: list[int], times: list[float],
                        counters: tuple[list[int], list[int], list[int], list[int]] | None) -> None:
        """Requests that completed inside a fused run or piece, in the order they left: their
        completion times, their whole output generated and, speculating, their draft counters
        (proposed, accepted, verifications, verification-emitted tokens)."""
        reqs = self.reqs
        g = np.array(rids, dtype=np.int64)
        reqs.completion[g] = times
        reqs.generated[g] = reqs.output[g]  # a finished request has generated its whole output
        if counters is not None:
            reqs.proposed[g], reqs.accepted[g], reqs.verify_steps[g], reqs.verify_emitted[g] = counters
        reqs.n_done += len(rids)

    def restore(self, rid: list[int], c: list[int], left: list[int], tgt: list[int],
                counters: tuple[list[int], list[int], list[int], list[int]] | None, free: int) -> None:
        """The running entries after a fused run or piece, in slot order (request, context,
        tokens left, prefill target and, speculating, draft counters), each holding the KV blocks
        its context needs, and the blocks left free."""
        m = len(rid)
        self.ints[:, :m] = 0
        if m:
            ra = np.array(rid, dtype=np.int64)
            cm = np.array(c, dtype=np.int64)
            self.rid[:m] = ra
            self.computed[:m] = cm
            self.blocks[:m] = (cm + (BLOCK_SIZE - 1)) // BLOCK_SIZE
            self.target[:m] = tgt
            self.out[:m] = self.reqs.output[ra]
            self.gen[:m] = self.out[:m] - np.array(left, dtype=np.int64)
            if counters is not None:
                self.n_prop[:m], self.n_acc[:m], self.n_verify[:m], self.n_vemit[:m] = counters
        self.n_running = m
        self.free_blocks = free

    def enqueue(self, rid: int) -> None:
        """Request rid joins the waiting queue (the arrival process's `submit` also wakes the
        process; a fused run's own sends land while it runs)."""
        self.waiting.append(rid)
        self.reqs.replica[rid] = self.idx


class FuseBound:
    """What a replica needs to fuse steps exactly: `next_s(now, replica)`, a time no later than
    anything that could next reach the replica (an arrival, a closed-loop send) or a metric
    window boundary (`cuts_s`); and the run's horizon.

    Open loop: the arrival process's next event (`next_arrival_s`, kept up to date by it, with
    `next_index`, the request it brings), or later when the router cannot send the next
    requests to this replica (`routing`: the queued times of the whole table, the replicas, the
    backlog limit and the router). Round robin sends request i to replica i mod R. Least
    outstanding sends a request to the first replica with the fewest requests (running +
    waiting); until a run ends, this replica's count o_R is fixed and another replica S's can
    only fall (completions) or grow by the requests it is sent, one each, so the next
    sum_S max(0, o_R + [S before R] - o_S) requests all go elsewhere. Either way the bound is
    also never past the arrival at which the backlog limit could first stop the run. Closed loop
    (`arrivals=False`): the next event of the whole simulation (env.peek()), since any send comes
    from a later event."""

    def __init__(self, env: simpy.Environment, horizon_s: float, cuts_s: tuple[float, ...] = (),
                 arrivals: bool = True, routing: tuple[np.ndarray, Sequence[ReplicaState], int, str] | None = None,
                 period_s: float | None = None) -> None:
        self.env, self.horizon_s, self.arrivals, self.routing = env, horizon_s, arrivals, routing
        # periodic cuts k x period_s, k >= 1 (the intervals table's ends), found on the fly: a list of
        # them would grow with the horizon (a long drain makes it billions of entries)
        self.period_s = period_s if period_s is not None and period_s > 0 and math.isfinite(period_s) else None
        cuts = np.asarray(cuts_s, dtype=np.float64)
        self.cuts_s: list[float] = np.unique(cuts[np.isfinite(cuts)]).tolist()
        self.next_arrival_s = math.inf
        self.next_index = 0
        self._times: list[float] | None = None

    def times(self) -> list[float]:
        """The queued arrival times as Python floats (built once: a run admitting arrivals reads
        them one by one, which numpy scalars make slow)."""
        if self._times is None:
            self._times = self.routing[0].tolist() if self.routing is not None else []
        return self._times

    def _routed_s(self, replica: int, outstanding: int | None = None) -> tuple[float, float]:
        """The earliest arrival that could be sent to this replica, and the earliest at which
        the backlog limit could stop the run (open loop, with routing); `outstanding`: the
        replica's count to assume (a fused run planned past its completions), else its own."""
        assert self.routing is not None
        _, reps, limit, router = self.routing
        g = self.next_index
        outs = [s.outstanding() for s in reps]  # (read once: the route bound and the backlog bound)
        if router == "round_robin":
            j = g + (replica - g) % len(reps)
        elif router == "prefix_affinity":
            j = g  # the next request may come here (its route depends on the caches)
        else:
            o = outs[replica] if outstanding is None else outstanding
            j = g
            for s, o_s in zip(reps, outs, strict=True):
                if s.idx != replica:
                    d = o + (s.idx < replica) - o_s
                    if d > 0:
                        j += d
        stop = backlog_stop(g, reps, limit, replica, outs)
        return self._arrival_s(min(j, stop)), self._arrival_s(stop)

    def _arrival_s(self, j: int) -> float:
        if j == self.next_index:
            return self.next_arrival_s
        queued = self.routing[0] if self.routing is not None else np.zeros(0)
        # an arrival event lands on now + (t - now), within an ulp or two of t
        return float(queued[j]) * (1.0 - 1e-15) if j < queued.size else math.inf

    def next_cut_s(self, now: float) -> float:
        """The first metric window boundary (a cut or a period end) after `now`."""
        t = math.inf
        i = bisect.bisect_right(self.cuts_s, now)
        if i < len(self.cuts_s):
            t = self.cuts_s[i]
        if self.period_s is not None:
            # the first k x period_s after now, with the same float product as np.arange(1, n) x period_s
            k = math.floor(now / self.period_s) + 1
            while k * self.period_s <= now:
                k += 1
            while k > 1 and (k - 1) * self.period_s > now:
                k -= 1
            t = min(t, k * self.period_s)
        return t

    def next_s(self, now: float, replica: int = 0, outstanding: int | None = None) -> tuple[float, float]:
        """(bound, end bound): every step of a fused run must start before the bound (then
        nothing has reached the replica when it is planned) and the run must end before the end
        bound (the run's horizon, or an arrival at which the backlog limit could stop the run:
        steps still in flight then are never completed)."""
        end = self.horizon_s
        if not self.arrivals:
            t = self.env.peek()
        elif self.routing is None or self.next_arrival_s == math.inf:
            t = self.next_arrival_s
            end = min(end, t)
        else:
            t, stop = self._routed_s(replica, outstanding)
            end = min(end, stop)
        return min(t, self.next_cut_s(now)), end


def backlog_stop(g: int, reps: Sequence[ReplicaState], limit: int, replica: int, outs: list[int] | None = None) -> int:
    """The first arrival (its index; g is the next one) at which the backlog limit could stop the
    run, while a fused run of `replica` is in flight. The requests waiting anywhere grow only by
    arrivals (one each) and by preemptions, which put a running sequence back in its queue: this
    replica preempts nothing during a fused run (its queue grows by its arrivals only), and
    another's queue can hold at most what it has outstanding now (waiting and running) plus what
    it is sent. So nothing can stop the run before arrival g + limit - that sum. `outs`: the
    replicas' `outstanding()`, when already read."""
    if outs is None:
        outs = [s.outstanding() for s in reps]
    held = sum(s.queued() if s.idx == replica else o for s, o in zip(reps, outs, strict=True))
    return g + max(0, limit - held)
