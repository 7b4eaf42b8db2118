"""One continuous-batching engine per replica: a SimPy process, one timeout per engine step.

Each step, in this order (vLLM v1-like):
0. with `prefill = "separate"` (vLLM 0.6's default scheduler, SGLang): if any prefill can be
   scheduled (a partly prefilled sequence, or a waiting request with a slot and a block), the step
   is a prefill step of its own (step 2 with the whole budget) and nothing decodes; with
   multi-step scheduling (`scheduler_steps` n > 1, vLLM 0.6's --num-scheduler-steps) a decode
   step is followed by n - 1 more before prefills are considered again;
1. decode: every running sequence whose prompt is fully computed gets 1 new token (k+1 when
   speculating: k drafted tokens verified plus one from the target; a token tree verifies all
   its nodes; with suffix decoding only sequences whose suffix tree matches this step, drawn
   first, speculate); KV blocks for them are reserved (a tree's for all its nodes), preempting
   the youngest sequences (recompute) while blocks run short;
2. prefill (`prefill = "mixed"`: vLLM V1, TensorRT-LLM): the token budget left
   (max_num_batched_tokens) goes to partly prefilled sequences in admission order, then to
   waiting requests (FCFS) while a slot (max_num_seqs) and blocks exist, unless step 1 preempted
   (vLLM v1 admits nothing in such a step); without chunked prefill a prompt goes whole or waits;
3. the step lasts the cost model's time for that batch (plus draft passes and machinery overhead
   when speculating); at its end tokens are emitted, finished sequences leave.

Prefix caching (sim/prefix_cache.py; only when requests carry block hashes, decided once per
replica): in step 2 an admitted request first references its longest cached prefix and its
prefill starts after it; in step 3 the full blocks the step's prefill chunks completed join the
cache, and a leaving (or, in step 1, a preempted) sequence caches its remaining full blocks and
drops its references. `free_blocks` counts unreferenced cached blocks as free; the cache evicts
them (LRU) when the engine has taken more than the truly free ones.

State lives in fixed-size numpy slot arrays, so per-step work is independent of history.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Generator, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import simpy

from models.cost import CostModel
from models.memory import BLOCK_SIZE
from models.speculative import expected_tokens_table
from sim.prefix_cache import PrefixCache

if TYPE_CHECKING:
    from sim.deployment import ReplicaRuntime
    from sim.joint import Piece, RackPlanner

STEP_COLUMNS = (
    "replica", "start_s", "duration_s", "batch_size", "decode_seqs", "prefill_tokens", "decode_tokens", "emitted_tokens",
    "k", "kv_blocks_used", "waiting", "flops", "bytes", "target_s", "draft_s", "spec_overhead_s", "chunk_gap_s",
    "count", "gap_step_s",
)
STEP_INT_COLUMNS = ("replica", "batch_size", "decode_seqs", "k", "kv_blocks_used", "waiting", "count")  # int64
# a joint piece's queue operations in order, where it preempted (`sim.joint.Piece.ops`)
ADMIT_OP, PREEMPT_OP = 0, 1
FUSE_MAX_STEPS = 4096  # longest fused run planned at once (a longer one is planned again at its end)
FUSE_MAX_PIECES = 1024  # most segments and mixed steps a fused run admitting arrivals plans at once
NEAR = 1e-9  # an arrival this close (relative) to a step boundary ends a run admitting arrivals
# most acceptance uniforms a fused speculative run draws at once (steps x sequences x k; its memory
# and the draws wasted when it stops early stay bounded; a longer run continues in the next one)
FUSE_MAX_DRAWS = 1 << 16
# a fused speculative run of at most this many steps is priced step by step in scalars (measured: 8
# steps of 2 sequences with a draft, 79 us with numpy's arrays, ~3 us a step in scalars)
SPEC_SCALAR_STEPS = 24
# a speculative run of a plain chain with a fixed k starting with more sequences than this is planned by
# numpy's arrays (`Replica._spec_run`); a smaller one, and every tree or adaptive run, step by step in
# scalars (`Replica._spec_steps_run`)
SPEC_STEP_SEQS = 64
ADAPTIVE_SCALAR_SEQS = 40  # the adaptive policy weighs a larger batch's acceptance estimates with numpy


# `Replica._spec_step`'s cached terms, typed item by item (compiled, its arithmetic is then on C
# doubles, not Python objects): a draft pass's (half its context growth, `CostModel.pass_parts`, the
# draft's attention FLOPs per pair, attention peak, KV bytes per token, bandwidth, TP); the plain
# decode pass's (linear, KV written, communication, overhead, and the same four); the step's (q, pairs of
# an empty context, the verification's `pass_parts`, the target's four and TP, the draft's, the
# plain pass's, the machinery's overhead fraction)
DraftParts = tuple[float, float, float, float, float, float, float, float, float, float, float, float, int]
PlainParts = tuple[float, float, float, float, float, float, float, float]
StepParts = tuple[int, float, float, float, float, float, float, float, float, float, float, float, float, int,
                  DraftParts | None, PlainParts | None, float | None]


class VerifyPlan(NamedTuple):
    """The decode part of a speculating step for the methods beyond the plain chain (trees, a
    windowed self-draft, suffix matches): target tokens and attention pairs of the decoding
    sequences, and the sequences that draft with the sum of the draft's contexts."""

    tokens: float
    pairs: float
    n_draft: float
    draft_ctx: float


class RunSegment(NamedTuple):
    """One segment of a fused run of plain decode steps (`Replica._plan_run`): `steps` steps of
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
    """One segment of a fused run of speculative steps (`Replica._plan_spec_segment`): `steps`
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


def decode_one(C: list[int], R: list[int], entries: list[int]) -> tuple[int, list[int]]:
    """A planned step without drafts: every entry (its context in C, its tokens left in R) decodes
    one token. Returns the KV blocks they hold after it (ceil(context / B), summed) and those that
    finished, in order (the speculative planners' step with k = 0)."""
    held = 0
    left: list[int] = []
    for e in entries:
        c = C[e] + 1
        C[e] = c
        r = R[e] - 1
        R[e] = r
        if not r:
            left.append(e)
        held += (c + (BLOCK_SIZE - 1)) // BLOCK_SIZE
    return held, left


def decode_spec(C: list[int], R: list[int], NX: list[int], V: int, lead: bytes, k: int, entries: list[int],
                fix: dict[int, int]) -> tuple[int, int, list[int]]:
    """A planned step of depth k > 0 whose draft counters are kept as offsets (`Cursor._offsets`):
    every entry reads its next verification outcome (`lead` at NX + V, capped at k: NX is kept as
    an offset from V, the steps with drafts so far, which the caller advances, so no entry's NX is
    written) and emits its accepted drafts + 1, capped by its tokens left (the drafts the cap
    leaves out go to `fix`).
    Returns the tokens emitted, the KV blocks the entries hold after it (ceil(context / B),
    summed) and those that finished, in order. The speculative planners' hot loop."""
    emitted = held = 0
    left: list[int] = []
    for e in entries:
        a = lead[NX[e] + V]
        if a > k:
            a = k
        x = a + 1
        r = R[e]
        if x >= r:
            fix[e] = x - r
            x = r
            left.append(e)
        c = C[e] + x
        C[e] = c
        R[e] = r - x
        held += (c + (BLOCK_SIZE - 1)) // BLOCK_SIZE
        emitted += x
    return emitted, held, left


def _counters(entries: list[int], C: list[int], NX: list[int], V: int, PROP: list[int], ACC: list[int],
              VER: list[int], VEM: list[int], KS: int, PS: int, fix: dict[int, int]) -> None:
    """These entries' draft counters from the offsets `Replica._plan_spec_steps` keeps them as,
    in place (each entry once: after this they are counters again)."""
    for e in entries:
        d = C[e] - PS
        nx = NX[e] + V
        PROP[e] = PROP[e] + KS
        ACC[e] = ACC[e] + (d - nx + fix.get(e, 0))
        VER[e] = VER[e] + nx
        VEM[e] = VEM[e] + d


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
    d = exact_delay(env.now, end_s)
    if env.now + d != end_s:
        yield env.timeout(0.75 * end_s - env.now)
        d = end_s - env.now
    yield env.timeout(d)


class StepLog:
    """Column store for the step table, in blocks (amortised O(1) appends; no block is ever
    copied until `table`, so the peak is the rows plus one copy of them, not three). Single rows
    wait in a short list and are written into the block together (one numpy assignment per
    `PENDING_ROWS` rows, not one per row)."""

    BLOCK_ROWS = 1 << 16
    PENDING_ROWS = 512

    def __init__(self, capacity: int = 4096) -> None:
        self.n = 0  # rows logged
        self._done: list[np.ndarray] = []  # full (or closed) blocks, trimmed
        self._cur = np.zeros((capacity, len(STEP_COLUMNS)))
        self._i = 0  # rows in the current block
        self._pending: list[Sequence[float]] = []  # single rows not yet in the block

    def _next_block(self, rows: int) -> None:
        self._done.append(self._cur[: self._i])
        self._cur = np.zeros((max(self.BLOCK_ROWS, rows), len(STEP_COLUMNS)))
        self._i = 0

    def append(self, row: tuple[float, ...]) -> None:
        self._pending.append(row)
        self.n += 1
        if len(self._pending) >= self.PENDING_ROWS:
            self._flush()

    def extend(self, rows: Sequence[Sequence[float]]) -> None:
        """Rows in order, at once (a fused run admitting arrivals)."""
        self._pending.extend(rows)
        self.n += len(rows)
        if len(self._pending) >= self.PENDING_ROWS:
            self._flush()

    def _flush(self) -> None:
        rows = self._pending
        if not rows:
            return
        self._pending = []
        if self._i + len(rows) > self._cur.shape[0]:
            self._next_block(len(rows))
        # (one float iterator over the row tuples: about a quarter faster than converting the list; a
        # row of the wrong length would shift the rest, so the iterator must end exactly there)
        values = itertools.chain.from_iterable(rows)
        self._cur[self._i: self._i + len(rows)] = np.fromiter(
            values, dtype=np.float64, count=len(rows) * self._cur.shape[1]).reshape(len(rows), -1)
        if next(values, None) is not None:
            raise ValueError("a step row longer than the step table's columns")
        self._i += len(rows)

    def block(self, rows: int) -> np.ndarray:
        """`rows` new rows at once, to be filled in place (a fused run of speculative steps)."""
        self._flush()
        if self._i + rows > self._cur.shape[0]:
            self._next_block(rows)
        self._i += rows
        self.n += rows
        return self._cur[self._i - rows: self._i]

    def columns(self, ints: tuple[str, ...] = ()) -> dict[str, np.ndarray]:
        """The step table as one array per column (`ints` as int64), the log emptied: each block is
        copied into the columns and dropped in turn, so the peak is the rows plus one block, not
        the rows twice (the columns' pages are touched only as they are filled)."""
        self._flush()
        self._done.append(self._cur[: self._i])
        blocks, self._done = self._done, []
        self._cur, self._i = np.zeros((0, len(STEP_COLUMNS))), 0
        out = {c: np.empty(self.n, dtype=np.int64 if c in ints else np.float64) for c in STEP_COLUMNS}
        cols = list(out.values())
        at = 0
        blocks.reverse()
        while blocks:
            b = blocks.pop()
            for j, col in enumerate(cols):
                col[at: at + b.shape[0]] = b[:, j]
            at += b.shape[0]
            del b
        self.n = 0
        return out

    def table(self) -> np.ndarray:
        self._flush()
        if not self._done:
            return self._cur[: self._i]
        return np.concatenate([*self._done, self._cur[: self._i]])


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
                 arrivals: bool = True, routing: tuple[np.ndarray, list[Replica], int, str] | None = None,
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


def backlog_stop(g: int, reps: list[Replica], limit: int, replica: int, outs: list[int] | None = None) -> int:
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


class Requests:
    """The request table as arrays, plus what the simulation fills in."""

    def __init__(self, arrival: np.ndarray, prompt: np.ndarray, output: np.ndarray, acceptance: np.ndarray) -> None:
        n = arrival.size
        self.arrival = arrival
        self.prompt = prompt
        self.output = output
        self.acceptance = acceptance
        self.first_token = np.full(n, np.nan)
        self.completion = np.full(n, np.nan)
        self.scheduled = np.full(n, np.nan)  # first time a step included it
        self.replica = np.full(n, -1, dtype=np.int64)
        self.preemptions = np.zeros(n, dtype=np.int64)
        self.proposed = np.zeros(n, dtype=np.int64)
        self.accepted = np.zeros(n, dtype=np.int64)
        self.generated = np.zeros(n, dtype=np.int64)  # kept across preemptions (recompute)
        self.verify_steps = np.zeros(n, dtype=np.int64)
        self.verify_emitted = np.zeros(n, dtype=np.int64)
        self.match = np.zeros(n)  # suffix decoding: probability of a suffix-tree match at a decoding step
        # speculation: every request's verification outcomes, drawn before the run
        # (`models.speculative.acceptance_draws`): its v-th verification of depth k accepts
        # min(lead[lead_off[r] + v], k) drafted tokens, whatever replica, batch or step it runs in
        self.lead_b = b""  # the outcomes as bytes (a Python index gives an int, cheaply) ...
        self.lead = np.zeros(0, dtype=np.uint8)  # ... and as an array (a view of the same bytes)
        self.lead_off = np.zeros(n + 1, dtype=np.int64)
        self.n_done = 0  # requests completed so far
        self.requeued = 0  # preemptions so far (each puts a request back in a waiting queue)
        self.on_complete: Callable[[int], None] | None = None  # closed loop: told how many just completed
        self.closed: Any = None  # a closed loop whose sends a fused run may plan (sim.run.ClosedLoop)
        # prefix caching (sim/prefix_cache.py): None when no request carries block hashes. Request r's
        # units are unit_key[unit_off[r]:unit_off[r + 1]]; unit_cum holds, per unit, the KV blocks of
        # the request's stream up to and including it (cumulative within the request)
        self.unit_off: np.ndarray | None = None
        self.unit_key = np.zeros(0, dtype=np.int64)
        self.unit_cum = np.zeros(0, dtype=np.int64)
        self.unit_nb = np.zeros(0, dtype=np.int64)
        self.cached_tokens = np.zeros(n, dtype=np.int64)  # prompt tokens found cached at the first admission
        self.prefill_cached = np.zeros(n, dtype=np.int64)  # prefill tokens served from the cache (all admissions)
        self.prefill_computed = np.zeros(n, dtype=np.int64)  # prefill tokens computed (all admissions)
        # tokens the admissions prefilled, cached or computed: the prompt, plus after a preemption what
        # was prefilled before it and the prompt + output so far again (prefill_cached + computed = this)
        self.prefill_tokens = np.zeros(n, dtype=np.int64)

    def set_draws(self, lead: bytes, offsets: np.ndarray) -> None:
        """Give each request its verification outcomes (`models.speculative.acceptance_draws`)."""
        self.lead_b = lead
        self.lead = np.frombuffer(lead, dtype=np.uint8)
        self.lead_off = offsets

    def drafts_accepted(self, rid: np.ndarray, verified: np.ndarray, k: int) -> np.ndarray:
        """Drafted tokens accepted by the next verification (of depth k) of requests `rid`, which
        have had `verified` verifications so far."""
        return np.minimum(self.lead[self.lead_off[rid] + verified], k).astype(np.int64)

    def set_units(self, keys: list[np.ndarray], blocks: list[np.ndarray]) -> None:
        """Give each request its cache units: unit keys and the full KV blocks each covers."""
        lens = np.array([k.size for k in keys], dtype=np.int64)
        self.unit_off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        self.unit_key = np.concatenate(keys).astype(np.int64) if keys else np.zeros(0, dtype=np.int64)
        self.unit_nb = np.concatenate(blocks).astype(np.int64) if blocks else np.zeros(0, dtype=np.int64)
        cum = np.cumsum(self.unit_nb)
        base = np.concatenate([[0], cum])[self.unit_off[:-1]]  # blocks before each request's first unit
        self.unit_cum = cum - np.repeat(base, lens)


class SendFeed:
    """The closed-loop sends a fused run plans itself (one replica; `Replica._absorbs`): each
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

    def commit(self, replica: Replica, admitted: set[int], end_s: float) -> None:
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
                replica.submit(rid)
                loop.rr += 1
            else:
                loop.enqueue_at(rid, q)


# whether this module runs compiled (mypyc: a shared object, not this source): over a large batch the
# adaptive policy's sums then run in compiled scalars, where the interpreter hands them to numpy (the
# same figures bit for bit either way: tests/test_speculative_math.py)
COMPILED = not __file__.endswith(".py")


def expected_sums(n: int, acc: list[int], prop: list[int], dp: list[float]) -> list[float]:
    """The adaptive policy's expected tokens of a step at each k = 0..k_max, summed over the
    decoding sequences: n + the sum over them of their first k survival products, each
    sequence's acceptance estimated as (accepted + 2.8) / (proposed + 4), sequence by sequence
    (each sequence's running sum of survival products added to each depth's total). Up to 6
    depths the totals are local variables, written out depth by depth (compiled: C doubles, not
    a list's boxed floats; 2.6-4.3x faster at 40 sequences), with the same operations in the
    same order as the loop beyond."""
    nf = float(n)
    k_max = len(dp)
    if not k_max:
        return [nf]
    if k_max <= 6:
        d = dp + [0.0] * (6 - k_max)
        d0, d1, d2, d3, d4, d5 = d[0], d[1], d[2], d[3], d[4], d[5]
        e1 = e2 = e3 = e4 = e5 = e6 = nf
        for j in range(len(acc)):
            a = (acc[j] + 2.8) / (prop[j] + 4.0)
            s = a * d0
            t = s
            e1 += t
            if k_max == 1:
                continue
            s *= a * d1
            t += s
            e2 += t
            if k_max == 2:
                continue
            s *= a * d2
            t += s
            e3 += t
            if k_max == 3:
                continue
            s *= a * d3
            t += s
            e4 += t
            if k_max == 4:
                continue
            s *= a * d4
            t += s
            e5 += t
            if k_max == 5:
                continue
            s *= a * d5
            t += s
            e6 += t
        return [nf, e1, e2, e3, e4, e5, e6][:k_max + 1]
    e = [nf] * (k_max + 1)
    for j in range(len(acc)):
        a = (acc[j] + 2.8) / (prop[j] + 4.0)
        s = a * dp[0]
        t = s
        e[1] = e[1] + t  # (a list item's `+=` compiles to generic object arithmetic)
        for i in range(1, k_max):
            s *= a * dp[i]
            t += s
            e[i + 1] = e[i + 1] + t
    return e


def expected_sums_by_depth(n: int, acc: list[int], prop: list[int], dp: list[float]) -> list[float]:
    """The same expected tokens summed as numpy sums a large batch's (`Replica._adaptive_choice`,
    k_max >= 2): each depth's survival products over the sequences in order (numpy's sum over
    the rows of a (sequences x depths) array adds row by row), cumulated over the depths, plus n;
    bit for bit numpy's figures, in scalars (what the compiled build runs)."""
    k_max = len(dp)
    S = [0.0] * k_max
    for j in range(len(acc)):
        a = (acc[j] + 2.8) / (prop[j] + 4.0)
        s = a * dp[0]
        S[0] = s if j == 0 else S[0] + s
        for i in range(1, k_max):
            s = s * (a * dp[i])
            S[i] = s if j == 0 else S[i] + s
    out = [float(n)]
    c = 0.0
    for i in range(k_max):
        c = S[i] if i == 0 else c + S[i]
        out.append(n + c)
    return out


class Replica:
    """A tensor-parallel replica running a continuous-batching engine loop.

    Running sequences are packed in the first `n_running` entries of the state arrays, in
    admission order (admissions append, departures compact in order): the oldest is first, the
    youngest (the preemption victim) last, and every per-step operation touches only the running
    sequences, never history.
    """

    # the integer state, one row each of one (fields x slots) array, so a departure compacts all in one operation
    _INT_FIELDS = ("rid", "computed", "target", "blocks", "gen", "out", "n_acc", "n_prop", "n_verify", "n_vemit",
                   "n_units", "c_blocks")

    def __init__(self, env: simpy.Environment, idx: int, rt: ReplicaRuntime, reqs: Requests,
                 rng: np.random.Generator, log: StepLog, fuse: FuseBound | None = None) -> None:
        self.env, self.idx, self.rt, self.reqs, self.rng, self.log = env, idx, rt, reqs, rng, log
        # step fusion: off when None, for a cost model without arrays, for a step cost not affine
        # in the context (sliding-window layers), and for the speculation methods of the general
        # path (trees, depth profiles, windowed self-drafts, suffix matches: `_spec_cost_many`
        # prices the plain chain only)
        spec = rt.spec
        spec_ok = spec is None or (self._plannable(spec) and (
            spec.draft_cost is None or (isinstance(spec.draft_cost, CostModel) and spec.draft_cost.affine_in_context)))
        scalar = spec_ok and isinstance(rt.cost, CostModel) and rt.cost.affine_in_context
        self.fuse = fuse if scalar else None
        # a speculative step is priced in scalars (`_spec_step`) and planned step by step (`_plan_spec_steps`):
        # decided by the models, not by fusion, so the unfused engine (the oracle) chooses k the same way
        self._scalar_steps = spec is not None and scalar
        self._decay_pows = [spec.decay ** i for i in range(spec.k)] if spec is not None else []
        s = rt.max_num_seqs
        self._ints = np.zeros((len(self._INT_FIELDS), s), dtype=np.int64)
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
         ) = self._ints  # row views
        self.rid[:] = -1
        self.free_blocks = rt.plan.num_blocks  # truly free + unreferenced cached (evictable) blocks
        # prefix caching, decided once: only when enabled and some request carries block hashes
        self.cache = PrefixCache() if (rt.prefix_caching and reqs.unit_off is not None) else None
        self.waiting: deque[int] = deque()
        self.n_running = 0
        self.wakeup = env.event()
        self.idle = True
        self.speculating = True  # speculative.policy "follow_load": switched by sim.fleet.FollowLoad
        self._gone: list[tuple[float, int]] = []  # a fused run in flight: (time, sequences) completing inside it
        # a piece of the joint plan in flight: its completion times and the sequences completed before each
        # (_gone_n[i]: those before _gone_t[i]; one entry more), so `outstanding` bisects a long piece's list
        self._gone_t: list[float] = []
        self._gone_n: list[int] = [0]
        self._taken: list[float] = []  # a fused run in flight: the start of each admission inside it
        self._pre_t: list[float] = []  # a joint piece in flight: the start of each step that preempted inside it
        self._loop_hard = False  # a closed loop's piece ended before a step the ordinary step must take
        self._step_parts: dict[int, StepParts] = {}  # `_spec_step`'s cached terms, by `_spec_step`'s key
        self._parents_k: dict[int, list[float]] = {}  # `_parents`
        self.rack: RackPlanner | None = None  # least outstanding over several replicas: planned jointly (sim/joint.py)
        self.proc = env.process(self.run())

    # ------------------------------------------------------------- routing
    def outstanding(self) -> int:
        """Requests running or waiting here now: during a fused run through completions, less the
        sequences whose completion inside the run has already passed (they leave the slot arrays
        only when the run ends; the router must see what the unfused engine would show)."""
        o = self.n_running + len(self.waiting)
        if self._gone:  # (a list: empty is the common case)
            now = self.env.now
            if self._gone_t:  # a joint plan's piece: (times, cumulative counts), by bisection
                return o - self._gone_n[bisect.bisect_left(self._gone_t, now)]
            for t, count in self._gone:
                if t < now:  # an arrival at the same instant comes first (URGENT), as unfused
                    o -= count
        return o

    def queued(self) -> int:
        """Requests waiting here now, as the unfused engine would show them: during a fused run
        that admits requests, less those whose admitting step has already started (they leave
        the queue only when the run ends; an arrival at the same instant as a step start comes
        first, URGENT, and still sees them waiting), plus those a joint piece's steps preempted,
        from their step's start (they join the queue only when the piece ends)."""
        if self._pre_t:  # (a victim waits from its step's start; its readmission is one of `_taken`)
            now = self.env.now
            return len(self.waiting) - bisect.bisect_left(self._taken, now) + bisect.bisect_left(self._pre_t, now)
        if self._taken:
            return len(self.waiting) - bisect.bisect_left(self._taken, self.env.now)
        return len(self.waiting)

    def submit(self, rid: int) -> None:
        if self.rack is not None:
            self.rack.check(rid, self.idx)
        self.waiting.append(rid)
        self.reqs.replica[rid] = self.idx
        if self.idle and not self.wakeup.triggered:
            self.wakeup.succeed()

    # ------------------------------------------------------------- state
    def _sync(self, idx: np.ndarray | slice) -> None:
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
        self._sync(slice(0, self.n_running))

    def _admit(self, rid: int) -> int:
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
            self._attach_prefix(i, rid)
        return i

    # ------------------------------------------------------------- prefix caching
    def _units(self, rid: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Request rid's unit keys, cumulative KV blocks and KV blocks per unit."""
        reqs = self.reqs
        assert reqs.unit_off is not None
        lo, hi = int(reqs.unit_off[rid]), int(reqs.unit_off[rid + 1])
        return reqs.unit_key[lo:hi], reqs.unit_cum[lo:hi], reqs.unit_nb[lo:hi]

    def _hit(self, rid: int, tokens: int) -> tuple[int, int]:
        """(units, KV blocks) of rid's longest cached prefix that leaves at least one of its
        `tokens` to compute (the last token's logits are needed: vLLM caps a hit at tokens - 1)."""
        cache = self.cache
        assert cache is not None
        keys, cum, _ = self._units(rid)
        cache.reclaim(self.free_blocks)
        h = cache.match(keys)
        h = min(h, int(np.searchsorted(cum, (tokens - 1) // BLOCK_SIZE, side="right")))
        return h, (int(cum[h - 1]) if h else 0)

    def prefix_match_tokens(self, rid: int) -> int:
        """Tokens of rid's prompt this replica holds cached (for the prefix-affinity router)."""
        if self.cache is None:
            return 0
        _, blocks = self._hit(rid, int(self.reqs.prompt[rid]) + 1)
        return blocks * BLOCK_SIZE

    def _attach_prefix(self, i: int, rid: int) -> None:
        """At admission: reference the request's cached prefix; its prefill starts after it (the
        cost model then charges the chunks' attention over the cached context)."""
        reqs, cache = self.reqs, self.cache
        assert cache is not None
        target = int(self.target[i])
        h, blocks = self._hit(rid, target)
        self.free_blocks -= cache.acquire(self._units(rid)[0][:h])
        self.computed[i] = blocks * BLOCK_SIZE  # the prefill starts at the first uncached block
        self.blocks[i] = self.c_blocks[i] = blocks
        self.n_units[i] = h
        if np.isnan(reqs.scheduled[rid]):  # the first admission (set just after it)
            reqs.cached_tokens[rid] = blocks * BLOCK_SIZE
        reqs.prefill_cached[rid] += blocks * BLOCK_SIZE
        reqs.prefill_tokens[rid] += target

    def _register(self, i: int) -> None:
        """Entry i's units that are now fully computed join the cache (after a prefill chunk, and
        before it leaves: the output's full blocks too, when its units cover them)."""
        cache = self.cache
        assert cache is not None
        keys, cum, nb = self._units(int(self.rid[i]))
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
        private = int(self.blocks[:n].sum())
        referenced = 0
        if cache is not None:
            private -= int(self.c_blocks[:n].sum())
            referenced = sum(cache.nb[k] for k, r in cache.ref.items() if r > 0)
        return {"private": private, "referenced": referenced, "evictable": cache.evictable if cache else 0,
                "free": self.free_blocks, "pool": self.rt.plan.num_blocks}

    def _release(self, i: int) -> None:
        """Entry i leaves (finished or preempted): its full units are cached, its private blocks
        freed, its references dropped (units nobody references become free capacity)."""
        cache = self.cache
        assert cache is not None
        self._register(i)
        keys = self._units(int(self.rid[i]))[0]
        cache.reclaim(self.free_blocks)
        freed = int(self.blocks[i] - self.c_blocks[i]) + cache.release(keys[: int(self.n_units[i])])
        self.free_blocks += freed

    def _preempt_youngest(self) -> None:
        """Preempt by recompute the most recently admitted sequence (the last entry)."""
        i = self.n_running - 1
        self._sync(slice(i, i + 1))
        rid = int(self.rid[i])
        if self.cache is None:
            self.free_blocks += int(self.blocks[i])
        else:
            # a prefill cut short stood for only the tokens it got to (cached or computed)
            self.reqs.prefill_tokens[rid] -= max(0, int(self.target[i] - self.computed[i]))
            self._release(i)
        self.reqs.preemptions[rid] += 1
        self.reqs.requeued += 1
        self.waiting.appendleft(rid)
        self.n_running = i

    def _compact(self, keep: np.ndarray) -> None:
        n = self.n_running
        ints = self._ints
        kept = ints[:, :n][:, keep]
        m = kept.shape[1]
        ints[:, :m] = kept
        self.n_running = m

    def _choose_k(self, dec: np.ndarray) -> int:
        spec = self.rt.spec
        if spec is None:
            return 0
        if spec.policy == "fixed":
            return spec.k
        if spec.policy == "follow_load":
            return spec.k if self.speculating else 0
        if spec.policy == "disable_above_batch":
            return 0 if self.n_running > spec.disable_batch_size else spec.k
        # adaptive: maximise expected emitted tokens per second of step time, k = 0..k_max, with
        # each request's acceptance estimated from what it has had accepted (prior 0.7, weight 4)
        if not dec.any():
            return 0
        n = self.n_running
        if self._scalar_steps and spec.shape is None:
            return self._adaptive_pick(self.n_acc[:n][dec].tolist(), self.n_prop[:n][dec].tolist(),
                                       float(self.computed[:n][dec].sum()))
        est = (self.n_acc[:n][dec] + 0.7 * 4.0) / (self.n_prop[:n][dec] + 4.0)
        if self._general(spec):
            return self._choose_k_general(dec, est)
        ctx = float(self.computed[:n][dec].sum())
        return int(self._adaptive_k(est[None, :], np.array([ctx]), int(dec.sum()))[0])

    def _adaptive_pick(self, acc: list[int], prop: list[int], ctx: float) -> int:
        """The adaptive policy's k for one step of the plain chain (`_adaptive_choice`)."""
        return self._adaptive_choice(acc, prop, ctx)[0]

    def _adaptive_choice(self, acc: list[int], prop: list[int], ctx: float
                         ) -> tuple[int, tuple[float, float, float, float, float, float]]:
        """The adaptive policy's k for one step of the plain chain, in scalars, and that step's
        `_spec_step` figures: each decoding sequence's acceptance estimated from its drafts
        accepted and proposed so far (prior 0.7, weight 4), the expected tokens of each k =
        0..k_max summed over them, each k priced as the step itself would be (`_spec_step`), and
        the smallest k within rounding of the best rate. The unfused step and the fused planner
        both choose with it (one code path: the same k)."""
        spec = self.rt.spec
        assert spec is not None
        k_max = spec.k
        n = len(acc)
        dp = self._decay_pows
        if n > ADAPTIVE_SCALAR_SEQS and COMPILED and k_max >= 2:  # (numpy's figures, in compiled scalars)
            exp = expected_sums_by_depth(n, acc, prop, dp)
        elif n > ADAPTIVE_SCALAR_SEQS:  # (numpy over a large batch: the same choice wherever it is made)
            a_arr = (np.array(acc, dtype=np.float64) + 2.8) / (np.array(prop, dtype=np.float64) + 4.0)
            surv_arr = np.cumprod(a_arr[:, None] * np.array(dp)[None, :], axis=1)
            exp = [float(n), *(n + np.cumsum(surv_arr.sum(axis=0))).tolist()]
        else:
            exp = expected_sums(n, acc, prop, dp)
        costs = [self._spec_step(n, ctx, k) for k in range(k_max + 1)]
        rates = [exp[k] / costs[k][0] for k in range(k_max + 1)]
        top = max(rates) * (1.0 - 1e-9)
        for k, r in enumerate(rates):
            if r >= top:
                return k, costs[k]
        return 0, costs[0]

    def _adaptive_k(self, est: np.ndarray, ctx: np.ndarray, n_dec: int) -> np.ndarray:
        """The adaptive policy's k for each of m steps (rows): the decoding sequences' acceptance
        estimates `est` (m, n_dec) and their context sums `ctx` (m,). One row is one step's
        choice (`_choose_k`); a fused run evaluates every step of the run in one call."""
        spec = self.rt.spec
        assert spec is not None
        m = est.shape[0]
        exp_tokens = expected_tokens_table(est.ravel(), spec.k, spec.decay).reshape(m, -1, spec.k + 1).sum(axis=1)
        c = ctx[:, None]
        # every k = 0..k_max priced in one vectorised call per model (the same formulas as a step)
        k = np.arange(spec.k + 1, dtype=np.float64)
        q = k + 1.0
        target = self.rt.cost.total_s_many(n_dec, n_dec * q, c + 0.0 * k, c * q + n_dec * q * (q + 1) / 2.0)
        total = target + target[:, :1] * self._overhead_frac(n_dec)  # machinery: a fraction of the plain decode pass
        if spec.draft_cost is not None:
            mean_ctx = c + n_dec * (k - 1) / 2.0
            one = spec.draft_cost.total_s_many(n_dec, np.full_like(k, n_dec), mean_ctx, mean_ctx + n_dec,
                                               step_overhead=False)
            total = total + k * one
        rate = exp_tokens / total
        # the smallest k within rounding of the best
        return np.argmax(rate >= rate.max(axis=1, keepdims=True) * (1.0 - 1e-9), axis=1)

    @staticmethod
    def _plannable(spec: Any) -> bool:
        """Whether a method's steps can be planned ahead in scalars (`_plan_spec_steps`): the chain,
        a depth profile or a token tree; not a windowed self-draft, suffix matches or a host cost."""
        return spec.draft_window is None and not spec.on_match and not spec.host_s_per_seq > 0

    @staticmethod
    def _general(spec: Any) -> bool:
        """Whether a method needs the general speculation path (a tree or depth profile, a windowed
        self-draft, suffix matches, a host cost); the plain chain keeps the original formulas."""
        return spec.shape is not None or spec.draft_window is not None or spec.on_match or spec.host_s_per_seq > 0

    def _choose_k_general(self, dec: np.ndarray, est: np.ndarray) -> int:
        """The adaptive policy for the general methods: each k = 0..k_max priced by `_spec_cost`
        itself (the step's own formulas), expected tokens from the method's closed form."""
        spec = self.rt.spec
        assert spec is not None
        n = self.n_running
        ds = np.flatnonzero(dec)
        table = (spec.shape.expected_tokens_table(est, spec.k) if spec.shape is not None
                 else expected_tokens_table(est, spec.k, spec.decay))
        m = self.reqs.match[self.rid[:n][dec]] if spec.on_match else None
        exp_tokens = (table.sum(axis=0) if m is None else dec.sum() + (m[:, None] * (table - 1.0)).sum(axis=0))
        n_dec = int(ds.size)
        ctx_dec = float(self.computed[ds].sum())
        rate = np.zeros(spec.k + 1)
        for k in range(spec.k + 1):
            plan = self._verify_plan(ds, k, None if m is None else m) if k else None
            rate[k] = exp_tokens[k] / self._spec_cost(n_dec, ctx_dec, k, 0, 0.0, 0.0, 0.0, plan)[0]
        return int(np.argmax(rate >= rate.max() * (1.0 - 1e-9)))

    def _verify_plan(self, ds: np.ndarray | slice, k: int, matched: np.ndarray | None) -> VerifyPlan:
        """Target tokens and attention pairs of the decoding sequences `ds` verifying depth k, and
        who drafts. A tree verifies all its nodes, attention over context + tree under the tree
        mask, charged as the dense (tree tokens x (context + tree tokens)) tile the kernels
        compute; a chain the causal triangle. With suffix matches (`matched`, booleans or expected
        probabilities over `ds`) only matched sequences verify k + 1 tokens, the others decode one."""
        spec = self.rt.spec
        assert spec is not None
        ctx = self.computed[ds].astype(np.float64)
        n_dec = float(ctx.size)
        ctx_sum = float(ctx.sum())
        q = spec.verify_tokens(k)
        if matched is not None:
            w = np.asarray(matched, dtype=np.float64)
            n_m, ctx_m = float(w.sum()), float((w * ctx).sum())
            tokens = n_dec + k * n_m
            pairs = ctx_sum + n_dec + k * ctx_m + n_m * (q * (q + 1) / 2.0 - 1.0)
            return VerifyPlan(tokens, pairs, n_m, ctx_m)
        tri = q * q if (spec.shape is not None and not spec.shape.chain) else q * (q + 1) / 2.0
        draft_ctx = ctx_sum if spec.draft_window is None else float(np.minimum(ctx, spec.draft_window).sum())
        return VerifyPlan(n_dec * q, ctx_sum * q + n_dec * tri, n_dec, draft_ctx)

    def _draft_sums(self, plan: VerifyPlan, k: int) -> tuple[float, float, float]:
        """(seconds, FLOPs, bytes) of drafting depth k for the general methods: one draft pass per
        depth, over the nodes of the depth above (one token per sequence for a chain, N_(i-1)
        for a tree), each node attending to the draft's context (a window for a windowed
        self-draft) plus its i ancestors."""
        spec = self.rt.spec
        assert spec is not None and spec.draft_cost is not None
        dc = spec.draft_cost
        parents = spec.shape.parents(k) if spec.shape is not None else np.ones(k)
        n = plan.n_draft
        t = f = b = 0.0
        for i in range(1, k + 1):
            p = float(parents[i - 1])
            ctx = plan.draft_ctx + n * (i - 1)
            d = dc.step_sums(round(n), n * p, ctx, p * (ctx + n), step_overhead=False)
            t += d.total_s
            f += d.flops * dc.tp
            b += d.bytes * dc.tp
        return t, f, b

    def _overhead_frac(self, n_dec: int) -> float:
        """Speculation machinery overhead as a fraction of the plain decode pass of the decoding
        sequences; grows with their number (vLLM #49548 measured TPOT with nothing drafted)."""
        spec = self.rt.spec
        assert spec is not None
        return spec.overhead_frac_at_2 + spec.overhead_frac_per_seq * max(0, n_dec - 2)

    def _spec_cost(self, n_dec: int, ctx_dec: float, k: int, n_pre: int, pre_tokens: float,
                   pre_ctx: float, pre_pairs: float,
                   plan: VerifyPlan | None = None) -> tuple[float, float, float, float, float, float]:
        """(total_s, target_s, draft_s, overhead_s, flops, bytes) of a step; FLOPs and bytes are
        summed over all the replica's GPUs (target and draft). `plan`: the decode part of a
        general method (tree, windowed self-draft, suffix), else the plain chain of k + 1 tokens."""
        rt = self.rt
        q = k + 1
        if plan is None:
            tokens = n_dec * q + pre_tokens
            pairs = ctx_dec * q + n_dec * q * (q + 1) / 2.0 + pre_pairs
        else:
            tokens = plan.tokens + pre_tokens
            pairs = plan.pairs + pre_pairs
        tc = rt.cost.step_sums(n_dec + n_pre, tokens, ctx_dec + pre_ctx, pairs)
        flops, nbytes = tc.flops * rt.cost.tp, tc.bytes * rt.cost.tp
        draft_s = 0.0
        over = 0.0
        spec = rt.spec
        if spec is not None:
            dc = spec.draft_cost
            if dc is not None:
                if k > 0 and n_dec and plan is not None:
                    if plan.n_draft > 0:
                        d_s, d_f, d_b = self._draft_sums(plan, k)
                        draft_s += d_s
                        flops += d_f
                        nbytes += d_b
                elif k > 0 and n_dec:
                    # k autoregressive draft passes over the decoding sequences, weights and KV
                    # read each pass; the context grows by one token per pass, so k passes cost
                    # k x the pass at the mean context (exact while the pass stays in one
                    # roofline regime)
                    # (`pass_sums`: `step_sums`'s figures, bit for bit, from terms cached per batch)
                    mean_ctx = ctx_dec + n_dec * (k - 1) / 2.0
                    d_s, d_f, d_b = dc.pass_sums(n_dec, n_dec, mean_ctx, mean_ctx + n_dec, False)
                    draft_s += k * d_s
                    flops += k * d_f * dc.tp
                    nbytes += k * d_b * dc.tp
                if pre_tokens and spec.method != "self_spec":  # a self-draft's prefill is the target's own
                    d = dc.step_sums(n_pre, pre_tokens, pre_ctx, pre_pairs, step_overhead=False)
                    draft_s += d.total_s
                    flops += d.flops * dc.tp
                    nbytes += d.bytes * dc.tp
            if n_dec and self.speculating:  # follow_load switched off: the plain decode path
                # the machinery (proposer, rejection sampler, bookkeeping) runs on every decoding
                # step of a speculation-enabled engine, also when k = 0. vLLM issue 49548 measured
                # it as a share of TPOT with nothing drafted, i.e. of a plain decode step over the
                # decoding sequences: it is charged on that, never on prefill tokens in the step
                # (`decode_s`: that pass's `step_sums` total, bit for bit, from terms cached per batch)
                plain_s = tc.total_s if (k == 0 and not n_pre) else rt.cost.decode_s(n_dec, ctx_dec)
                over = plain_s * self._overhead_frac(n_dec)
                if spec.host_s_per_seq:  # suffix decoding's CPU lookups, per decoding sequence
                    over += spec.host_s_per_seq * n_dec
        return tc.total_s + draft_s + over, tc.total_s, draft_s, over, flops, nbytes

    # ------------------------------------------------------------- engine loop
    def _prefill_pending(self) -> bool:
        """Whether prefill work could be scheduled now: a partly prefilled sequence, or a waiting
        request with a free slot and a free block."""
        n = self.n_running
        return bool((self.computed[:n] < self.target[:n]).any()) or bool(
            self.waiting and n < self.rt.max_num_seqs and self.free_blocks > 0)

    def _plan_prefill(self, budget: int, dec: np.ndarray, admit: bool, all_dec: bool) -> tuple[list[int], list[int]]:
        """Prefill chunks within the token budget: partial prefills (oldest first), then new
        admissions (FCFS) while a slot and blocks exist and `admit`. Without chunked prefill a
        prompt goes whole or waits (one longer than the whole budget goes alone)."""
        rt, reqs = self.rt, self.reqs
        chunk_idx: list[int] = []
        chunks: list[int] = []
        full = budget
        if not all_dec:
            for j in np.flatnonzero(~dec).tolist():
                if budget <= 0:
                    break
                c = self._fit_chunk(j, budget, budget == full)
                if c <= 0:
                    break
                chunk_idx.append(j)
                chunks.append(c)
                budget -= c
        while admit and budget > 0 and self.waiting and self.n_running < rt.max_num_seqs and self.free_blocks > 0:
            rid = self.waiting[0]
            if not rt.chunked_prefill and not self._fits_whole(rid, budget, budget == full):
                break
            self.waiting.popleft()
            i = self._admit(rid)
            c = self._fit_chunk(i, budget, budget == full)
            if math.isnan(reqs.scheduled[rid]):
                reqs.scheduled[rid] = self.env.now
            if c > 0:  # 0 only when a prefix-cache hit took the last free blocks: it waits for more
                chunk_idx.append(i)
                chunks.append(c)
                budget -= c
        return chunk_idx, chunks

    def _fits_whole(self, rid: int, budget: int, alone: bool) -> bool:
        """Without chunked prefill: the whole prompt (plus output so far, when recomputing) fits
        in the budget (or goes alone in an empty step) and in the free KV blocks. With a prefix
        cache, only the uncached tokens count, and a hit on unreferenced cached blocks takes them
        from the free capacity."""
        tokens = int(self.reqs.prompt[rid] + self.reqs.generated[rid])
        need = -(-tokens // BLOCK_SIZE)
        if self.cache is not None:
            h, blocks = self._hit(rid, tokens)
            tokens -= blocks * BLOCK_SIZE
            need -= blocks
            if h:  # unreferenced cached blocks of the hit are free capacity the admission takes
                need += self.cache.evictable_blocks(self._units(rid)[0][:h])
        return (tokens <= budget or alone) and need <= self.free_blocks

    def run(self) -> Generator[simpy.Event, Any, None]:
        env, rt, reqs = self.env, self.rt, self.reqs
        budget_max = rt.max_num_batched_tokens
        spec = rt.spec
        separate = rt.prefill == "separate"
        stalled_s = 0.0  # prefill-only steps run since the last decode while sequences were ready to decode
        decode_left = 0  # multi-step scheduling: decode steps still due before prefills are considered again
        absorbs = self._absorbs()  # fixed for the run (router, replicas, prefill mode, hooks, cache)
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
            loop_hard, self._loop_hard = self._loop_hard, False  # (read at the boundary right after that piece)
            if rack is not None:
                piece = rack.boundary(self)
                if piece is not None:
                    done_steps = yield from self._run_piece(piece)
                    decode_left = (decode_left - done_steps) % rt.scheduler_steps
                    continue
                joint = not rack.broken
            if self.fuse is not None and stalled_s == 0.0 and not joint:
                # (a run admitting arrivals admits every request waiting at its start, or none starts)
                room = absorbs and (not self.waiting or self.n_running + len(self.waiting) <= rt.max_num_seqs)
                if spec is None:
                    if room:
                        done_steps = yield from self._absorbing_run()
                        if done_steps:
                            decode_left = (decode_left - done_steps) % rt.scheduler_steps
                            continue
                    segs = self._plan_run()
                    if segs is not None:
                        done_steps = yield from self._fused_run(segs)
                        decode_left = (decode_left - done_steps) % rt.scheduler_steps
                        continue
                else:
                    done_steps = 0
                    array = spec.shape is None and spec.policy != "adaptive"  # `_spec_run` plans it too
                    if not array or self.n_running <= SPEC_STEP_SEQS:
                        done_steps = yield from self._spec_steps_run(room)
                    if not done_steps and array:
                        done_steps = yield from self._spec_run()
                    if done_steps:
                        decode_left = (decode_left - done_steps) % rt.scheduler_steps
                        continue
                if loops and not loop_hard:  # (a closed loop's partial prefills and chunked admissions: a cursor plans them)
                    done_steps = yield from self._loop_run()
                    if done_steps:
                        continue
            n = self.n_running
            dec = self.computed[:n] >= self.target[:n]
            all_dec = bool(dec.all())
            chunk_idx: list[int] = []
            chunks: list[int] = []
            preempted = stalling = False
            if separate and not (decode_left and dec.any()) and self._prefill_pending():
                # prefill steps of their own, scheduled first (vLLM V0's default scheduler, SGLang):
                # decodes wait while any prompt can be prefilled
                chunk_idx, chunks = self._plan_prefill(budget_max, dec, True, all_dec)
            plan: VerifyPlan | None = None
            matched = None
            if chunk_idx:
                k, n_dec = 0, 0
                stalling = bool(dec.any())
                ds: slice | np.ndarray = slice(0, 0)
            else:
                k = self._choose_k(dec)
                q = k + 1
                general = spec is not None and k > 0 and self._general(spec)
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
                    self._preempt_youngest()
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
                plan = self._verify_plan(ds, k, None if matched is None else matched[:n][ds]) if general else None
                if not separate:
                    dec_tokens = n_dec * q if plan is None else round(plan.tokens)
                    chunk_idx, chunks = self._plan_prefill(budget_max - dec_tokens, dec, not preempted, all_dec)
            q = k + 1
            n_pre = len(chunk_idx)
            if n_dec == 0 and n_pre == 0:
                # nothing fits (KV exhausted by partial prefills): preempt the youngest and retry
                if self.n_running:
                    self._preempt_youngest()
                continue
            if n_pre == 1:  # one chunk (the usual case): the sums below, of one element, in scalars
                pre_tokens = float(chunks[0])
                pre_ctx = float(self.computed[chunk_idx[0]])
                pre_pairs = pre_tokens * pre_ctx + 0.5 * (pre_tokens * (pre_tokens + 1.0))
            elif n_pre:
                cs = np.asarray(chunk_idx, dtype=np.int64)
                ch = np.asarray(chunks, dtype=np.float64)
                pre_ctx_arr = self.computed[cs].astype(np.float64)
                pre_tokens = float(ch.sum())
                pre_ctx = float(pre_ctx_arr.sum())
                pre_pairs = float((ch * pre_ctx_arr).sum() + 0.5 * (ch * (ch + 1.0)).sum())
            else:
                pre_tokens = pre_ctx = pre_pairs = 0.0
            ctx_dec = float(self.computed[ds].sum()) if n_dec else 0.0
            total_s, target_s, draft_s, over_s, flops, nbytes = self._spec_cost(
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
                    self._register(j)
            for j in chunk_idx:
                if self.computed[j] >= self.target[j]:
                    if self.gen[j] == 0:
                        reqs.first_token[self.rid[j]] = now
                    self.gen[j] += 1
                    emitted_total += 1
            # 3c. finished sequences leave
            self._leave(now)
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

    def _leave(self, now: float, stay: np.ndarray | None = None) -> None:
        """Finished sequences leave: completion times, blocks freed, the closed loop told.
        `stay`: the running entries that have not finished, when known (a fused run's plan)."""
        reqs = self.reqs
        n = self.n_running
        fin = self.gen[:n] >= self.out[:n] if stay is None else ~stay
        if stay is not None or fin.any():
            f = np.flatnonzero(fin)
            self._sync(f)
            reqs.completion[self.rid[f]] = now
            reqs.n_done += int(f.size)
            if self.cache is None:
                self.free_blocks += int(self.blocks[f].sum())
            else:
                for j in f.tolist():
                    self._release(j)
            self._compact(~fin if stay is None else stay)
            if reqs.on_complete is not None:
                reqs.on_complete(int(f.size))

    # ------------------------------------------------------------- step fusion
    def _chains(self) -> bool:
        """Whether a fused run may go on through completions: nothing outside the replica reacts
        to one (no `on_complete` hook: not a closed loop, no autoscaler), an open loop's bound
        (a closed loop's is the next event anywhere) and no prefix cache (a leaving sequence's
        blocks would join the cache the router reads)."""
        fb = self.fuse
        return fb is not None and fb.arrivals and self.reqs.on_complete is None and self.cache is None

    def _plan_run(self) -> list[RunSegment] | None:
        """The next n >= 2 steps as one fused run, when they are pure decode steps the unfused loop
        would take one by one with nothing else changing: every running sequence decodes one token
        (no partial prefill, no speculation), no admission is possible (nothing waits, or no slot
        or no free block), the KV blocks the sequences grow into are free at every step (no
        preemption), no sequence finishes before the last step, every step of the run starts
        before anything could reach this replica (`FuseBound.next_s`; so the steps all start on
        one side of each metric window boundary) and the run ends before the horizon.

        When the run's last step completes a sequence, nothing waits and nothing outside reacts
        to a completion (`_chains`), the run goes on with the smaller batch: the finished
        sequences leave at the exact end of that step and the next segment is planned from
        there, the same way (a segment of one step included), with the bound recomputed from the
        replica's reduced outstanding count under least-outstanding routing (fewer outstanding
        here: more arrivals may come here; the bound can only tighten). The segments, advanced
        in one timeout by `_fused_run`, are returned; None for an ordinary step."""
        n = self.n_running
        fb = self.fuse
        assert fb is not None
        if n == 0 or (self.waiting and n < self.rt.max_num_seqs and self.free_blocks > 0):
            return None
        c = self.computed[:n]
        if (c < self.target[:n]).any():
            return None
        rem = self.out[:n] - self.gen[:n]
        m = int(rem.min())  # a sequence finishes at step m
        if m < 2:
            return None
        t = self.env.now
        bound, end_bound = fb.next_s(t, self.idx)
        held = int(self.blocks[:n].sum())
        seg = self._plan_segment(t, n, c, m, self.free_blocks, held, bound, end_bound, 2)
        if seg is None:
            return None
        segs = [seg]
        if not seg.finishing or seg.split or self.waiting or not self._chains():
            return segs
        least = fb.routing is not None and fb.routing[3] == "least_outstanding"
        free = self.free_blocks
        while True:
            rem = rem - seg.steps
            keep = rem > 0
            held_all = held + seg.new_blocks
            c, rem, ba = seg.computed_after[keep], rem[keep], seg.blocks_after[keep]
            held = int(ba.sum())
            segs[-1] = seg._replace(leaving=n - c.size, stay=keep)
            free += held_all - held - seg.new_blocks  # the finished sequences' blocks are freed
            n = c.size
            if n == 0:
                break
            t = seg.end_s
            if least:
                bound, end_bound = fb.next_s(t, self.idx, outstanding=n)
            seg = self._plan_segment(t, n, c, int(rem.min()), free, held, bound, end_bound, 1)
            if seg is None:
                break
            segs.append(seg)
            if not seg.finishing or seg.split:
                break
        return segs

    # ------------------------------------------------------------- fused runs that admit arrivals
    def _absorbs(self) -> bool:
        """Whether a fused run may also admit requests (`_absorbing_run`): a run through
        completions (`_chains`: an open loop, nothing reacting to a completion, no prefix cache)
        with mixed prefill, where the router sends a request regardless of the replicas' state
        (one replica, or round robin), so the arrivals that reach this replica, and when, are known
        from the request table. Under least outstanding a run could only admit the requests waiting
        when it starts and stop where a request could next be sent to it (often the next arrival):
        planning that costs as much as the ordinary step it replaces (measured: the default mix on
        two replicas 25% slower), so least outstanding keeps `_plan_run`."""
        fb = self.fuse
        if fb is None or self.rt.prefill == "separate":
            return False
        loop = self.reqs.closed
        if not fb.arrivals:  # a closed loop of one replica: the run plans the sends (`SendFeed`)
            return loop is not None and self.cache is None
        if fb.routing is None or not self._chains():
            return False
        _, reps, _, router = fb.routing
        return len(reps) == 1 or router == "round_robin"

    def _absorbing_run(self) -> Generator[simpy.Event, Any, int]:
        """A fused run that goes on through completions and through the arrivals that reach this
        replica, in one timeout; returns its steps (0: none planned, take an ordinary step).

        It is planned as the unfused loop would take its steps, in plain Python over scalars
        (`_plan_absorbing`): pure decode segments while nothing arrives (priced and bounded as
        `_plan_segment` does), and, after a step during which requests arrived, the mixed step
        that admits them and prefills them whole (priced by `_spec_cost` as the ordinary step),
        then decode segments again. Every running sequence gains one token a step, so sequence e
        has context base_e + S after the run's S-th step: the context sum, the KV blocks the next
        steps take (a 16-bin histogram of base_e mod 16) and the next completion (a heap of the
        steps at which each finishes) are kept without arrays. The plan is applied when the
        timeout fires: admissions (from the waiting queue, where the arrival process has put
        them), completions, the slot arrays and the step rows, in the unfused engine's order."""
        plan = self._plan_absorbing()
        if plan is None:
            return 0
        end_s, steps, rows, (done, gone), admitted, entries, s_end, free, feed = plan
        # (the completions inside the run are not shown to `outstanding` while it is in flight, as
        # `_fused_run` shows them: with one replica or round robin no router reads it); the
        # admissions are, to `queued` (the backlog limit counts the requests waiting)
        self._taken = [start for _, start, _ in admitted]
        yield from land_at(self.env, end_s)  # (the end its plan counted with)
        self._taken = []
        reqs = self.reqs
        self._take_admitted(admitted, feed)
        base, fin, rids, alive = entries
        n0 = self.n_running
        if done:
            g = np.array([rids[e] for e in gone], dtype=np.int64)
            reqs.completion[g] = np.array(done)
            reqs.generated[g] = reqs.output[g]  # a finished request has generated its whole output
            reqs.n_done += len(gone)
        # the survivors, in slot order: the run's first sequences, then the admitted ones
        live = np.array(alive, dtype=bool)
        if not live[:n0].all():
            self._compact(live[:n0])
        m0 = self.n_running
        m = m0 + int(live[n0:].sum())
        if m > m0:
            nr = np.array(rids[n0:], dtype=np.int64)[live[n0:]]
            self._ints[:, m0:m] = 0
            self.rid[m0:m] = nr
            self.target[m0:m] = reqs.prompt[nr] + reqs.generated[nr]
            self.out[m0:m] = reqs.output[nr]
        if m:
            b = np.array(base, dtype=np.int64)[live] + s_end  # their contexts now
            self.computed[:m] = b
            self.blocks[:m] = (b + (BLOCK_SIZE - 1)) // BLOCK_SIZE
            self.gen[:m] = self.out[:m] - (np.array(fin, dtype=np.int64)[live] - s_end)
        self.n_running = m
        self.free_blocks = free
        self._end_absorbing(rows, admitted, feed, end_s)
        return steps

    def _end_absorbing(self, rows: list[tuple[float, ...]], admitted: list[tuple[int, float, float]],
                       feed: SendFeed | None, end_s: float) -> None:
        """The end of a run admitting arrivals, its slots rebuilt: a closed loop's sends committed,
        the rows logged (the last one's waiting count, when left to the queue, read from it)."""
        if feed is not None:
            feed.commit(self, {r for r, _, _ in admitted}, end_s)
        if rows[-1][10] < 0:  # its waiting count left to the queue (the run ends there)
            rows[-1] = (*rows[-1][:10], len(self.waiting), *rows[-1][11:])
        self.log.extend(rows)

    def _take_admitted(self, admitted: list[tuple[int, float, float]], feed: SendFeed | None) -> None:
        """A run's admissions, once its timeout fired: taken from the waiting queue (where the
        arrival process, or the closed loop's frontend, put them; a send the run planned is not
        there), with their schedule and first-token times."""
        reqs = self.reqs
        planned = {r for r, _ in feed.sent} if feed is not None else ()
        for rid, start, _ in admitted:
            if rid not in planned:
                got = self.waiting.popleft()
                assert got == rid, (got, rid)
            if math.isnan(reqs.scheduled[rid]):
                reqs.scheduled[rid] = start
        if admitted:
            a = np.array([r for r, _, _ in admitted], dtype=np.int64)
            reqs.first_token[a] = np.array([f for _, _, f in admitted])

    @staticmethod
    def _leave_planned(heap: list[tuple[int, int]], S: int, t: float, base: list[int], hist: list[int],
                       alive: list[bool], done: list[float], gone: list[int], n: int, free: int,
                       sum_base: int) -> tuple[int, int, int]:
        """`_plan_absorbing`'s completions after its S-th step, at time t: the entries finishing
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

    def _plan_absorbing(self) -> tuple[Any, ...] | None:
        """The plan of `_absorbing_run` (see there), or None when it cannot start now (nothing
        runs and nothing waits, a partial prefill, a preempted request waiting, or no piece
        possible). The run stops, before the piece that would break a rule, where the ordinary
        loop must decide: a request that cannot be admitted and prefilled whole in its step (no
        slot, no block, a prompt longer than the token budget left), a decode step that would have
        to preempt, a metric window boundary (cut) with nothing arrived, an arrival within NEAR of
        a step boundary (the order of the two events is left to SimPy), an idle replica, the end
        bound (horizon, backlog limit) or FUSE_MAX_PIECES pieces."""
        n = self.n_running
        waiting = self.waiting
        if n == 0 and not waiting:
            return None
        if waiting and (n + len(waiting) > self.rt.max_num_seqs or self.free_blocks <= 0):
            return None  # not all of them can be admitted: `_plan_run`'s runs with requests waiting
        c0 = self.computed[:n]
        B = BLOCK_SIZE
        if n and ((c0 < self.target[:n]).any()
                  or int(self.blocks[:n].sum()) != int(((c0 + (B - 1)) // B).sum())):
            return None
        fb, rt, reqs = self.fuse, self.rt, self.reqs
        assert fb is not None
        pending: list[int] = list(waiting)  # admitted at the next step, FCFS
        if pending and reqs.generated[pending].any():
            return None  # a preempted request (recompute): the ordinary loop
        rem0 = self.out[:n] - self.gen[:n]
        cost = rt.cost
        plain, tp = rt.spec is None, cost.tp
        feed, queued, stride, j = self._arrival_source()
        t = self.env.now
        _, end_bound = fb.next_s(t, self.idx)
        num_blocks = rt.plan.num_blocks
        budget_max = rt.max_num_batched_tokens
        base: list[int] = c0.tolist()
        fin: list[int] = rem0.tolist()  # the run step after which each finishes
        rids: list[int] = self.rid[:n].tolist()
        alive = [True] * n
        hist = np.bincount(c0 % B, minlength=B).tolist()
        sum_base = int(c0.sum())
        heap = [(fin[e], e) for e in range(n)]
        heapq.heapify(heap)
        free = self.free_blocks
        S = 0
        steps = 0
        rows: list[tuple[float, ...]] = []  # its step rows, in order
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
                # first[r]: new blocks in the next r steps (sequence e takes one at relative step r
                # when (base_e + S + r) % B == 0)
                s0 = (-S) % B
                cnt = hist[s0::-1] + hist[:s0:-1]  # cnt[r] = hist[(-S - r) % B]
                first = list(itertools.accumulate(cnt, initial=0))
                if n * (mm // B + 1) > free and (mm // B) * n + first[mm % B] > free:
                    s_ = (free // n) * B
                    while s_ < mm and ((s_ + 1) // B) * n + first[(s_ + 1) % B] <= free:
                        s_ += 1
                    mm = s_
                    if mm < min_steps:
                        break
                last = mm - 1
                slope = (cost.decode_s(n, ctx0 + last * n) - d0) / last if last else 0.0
                # the last step starts before the bound, the segment ends before the end bound, on the
                # unfused engine's clock (`CostModel.decode_clock`)
                st = cost.decode_clock(n, ctx0, t, mm)
                k = min(bisect.bisect_left(st, bound, 0, mm), bisect.bisect_left(st, end_bound, 1, mm + 1) - 1)
                if k < min_steps:
                    break
                end = float(st[k])
                split = end >= bound
                new_blocks = (k // B) * n + first[k % B]
                used0 = num_blocks - free
                but_last = ((k - 1) // B) * n + first[(k - 1) % B]
                free -= new_blocks
                S += k
                steps += k
                t_prev, t = t, end
                n_seg = n
                sends = 0
                if heap[0][0] == S:
                    n0_ = len(gone)
                    n, free, sum_base = self._leave_planned(heap, S, t, base, hist, alive, done, gone, n, free,
                                                            sum_base)
                    if feed is not None:
                        sends = feed.complete(t, len(gone) - n0_, pending)
                used = num_blocks - free
                stop = False
                waits = 0
                if split or sends:  # (its last step logs the requests waiting at its end: a row of its own)
                    if split:
                        a0 = len(pending)
                        j, waits, stop = self._arrived(queued, j, stride, t, pending)
                        if feed is not None and waits:
                            pending[a0:] = [feed.rids[x] for x in pending[a0:]]
                    if k > 1:
                        rows.append(self._run_row(t_prev, k - 1, d0, slope, n_seg, ctx0, used0 + but_last, 0))
                    rows.append(self._run_row(float(st[k - 1]), 1, d0 + (k - 1) * slope, 0.0, n_seg,
                                              ctx0 + (k - 1) * n_seg, used, -1 if stop else waits + sends))
                else:
                    rows.append(self._run_row(t_prev, k, d0, slope, n_seg, ctx0, used, sends))
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
            whole = self._whole_prompts(pending, budget_max - n, n, free2)
            if whole is None:
                break
            chunks, free2, (pre_tokens, pre_ctx, pre_pairs) = whole
            n_pre = len(chunks)
            ctx_dec = float(sum_base + n * S) if n else 0.0
            if plain:  # `_spec_cost` without speculation, its arithmetic in its order (cached terms)
                total_s, flops, nbytes = cost.pass_sums(n + n_pre, n + pre_tokens, ctx_dec + pre_ctx,
                                                        ctx_dec + n * 2 / 2.0 + pre_pairs)
                flops *= tp
                nbytes *= tp
                target_s, over_s = total_s, 0.0
            else:
                total_s, target_s, _, over_s, flops, nbytes = self._spec_cost(
                    n, ctx_dec, 0, n_pre, pre_tokens, pre_ctx, pre_pairs, None)
            end = t + total_s
            if end >= end_bound:
                break
            step_rids = pending
            j, pending, waits, near = self._arrived_at(queued, j, stride, end, feed)
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
                n, free, sum_base = self._leave_planned(heap, S, t, base, hist, alive, done, gone, n, free, sum_base)
                if feed is not None:
                    sends = feed.complete(t, len(gone) - n0_, pending)
            rows.append((self.idx, t_start, total_s, n_dec + n_pre, n_dec, pre_tokens, n_dec, n_dec + n_pre, 0,
                         num_blocks - free, waits + sends, flops, nbytes, target_s, 0.0, over_s,
                         total_s if n_dec else 0.0, 1, 0.0))
            pieces += 1
            min_steps = 1
            if (n == 0 and not pending) or t >= end_bound or (feed is not None and feed.exhausted):
                break
        if not rows:
            return None
        return t, steps, rows, (done, gone), admitted, (base, fin, rids, alive), S, free, feed

    def _arrival_source(self) -> tuple[SendFeed | None, list[float], int, int]:
        """Where a run admitting arrivals finds them: (the closed loop's planned sends or None,
        the times requests reach the queue, the stride between this replica's, the first one's
        index). Open loop: the request table's queued times, every `stride`-th from this
        replica's next (round robin); closed loop: the sends (`SendFeed`)."""
        fb = self.fuse
        assert fb is not None
        if not fb.arrivals:
            feed = SendFeed(self.reqs.closed)
            return feed, feed.times, 1, 0
        assert fb.routing is not None
        stride = len(fb.routing[1])
        g = fb.next_index
        return None, fb.times(), stride, g + (self.idx - g) % stride  # the next arrival that reaches this replica

    def _whole_prompts(self, pending: list[int], budget: int, running: int,
                       free: int) -> tuple[list[int], int, tuple[float, float, float]] | None:
        """A mixed step's admissions in a run's plan, by the ordinary step's rules (`_plan_prefill`,
        `_fits_whole`): every pending request, FCFS, prefilled whole in the token `budget` left
        after the decodes (without chunked prefill the first goes whole even past it), with a slot
        and its KV blocks among `free`; None when one cannot (a chunk of it, or it waits: the
        ordinary loop decides). Returns the chunks, the blocks then free and the prefill's sums
        (tokens, context, attention pairs) as the ordinary step sums them."""
        rt, reqs = self.rt, self.reqs
        B = BLOCK_SIZE
        max_seqs, chunked = rt.max_num_seqs, rt.chunked_prefill
        full = budget
        chunks: list[int] = []
        for rid in pending:
            if not (budget > 0 and running < max_seqs and free > 0):
                break
            tokens = int(reqs.prompt[rid])
            nb = -(-tokens // B)
            if tokens <= 0 or nb > free or (tokens > budget and (chunked or budget != full)):
                break
            chunks.append(tokens)
            budget -= tokens
            free -= nb
            running += 1
        n_pre = len(chunks)
        if n_pre < len(pending):
            return None
        if n_pre == 1:  # as the ordinary step sums one chunk
            pre_tokens = float(chunks[0])
            pre_ctx = 0.0
            pre_pairs = pre_tokens * pre_ctx + 0.5 * (pre_tokens * (pre_tokens + 1.0))
        else:
            ch = np.asarray(chunks, dtype=np.float64)
            pre_ctx_arr = np.zeros(n_pre)
            pre_tokens = float(ch.sum())
            pre_ctx = float(pre_ctx_arr.sum())
            pre_pairs = float((ch * pre_ctx_arr).sum() + 0.5 * (ch * (ch + 1.0)).sum())
        return chunks, free, (pre_tokens, pre_ctx, pre_pairs)

    def _arrived_at(self, queued: list[float], j: int, stride: int, t: float,
                    feed: SendFeed | None) -> tuple[int, list[int], int, bool]:
        """`_arrived` into a new list of pending requests (a closed loop's sends mapped from the
        feed's indices to their requests): (next index, the requests, how many, near)."""
        pending: list[int] = []
        j, waits, near = self._arrived(queued, j, stride, t, pending)
        if feed is not None and waits:
            pending = [feed.rids[x] for x in pending]
        return j, pending, waits, near

    @staticmethod
    def _arrived(queued: list[float], j: int, stride: int, t: float, pending: list[int]) -> tuple[int, int, bool]:
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

    def _plan_segment(self, t: float, n: int, c: np.ndarray, m: int, free: int, held: int, bound: float,
                      end_bound: float, min_steps: int) -> RunSegment | None:
        """One segment of a fused run from time t: n sequences at contexts c (blocks held
        ceil(c / B), `held` in all), the first finishing at step m, `free` blocks free; its steps
        start before `bound` and it ends before `end_bound`. None when fewer than `min_steps`.

        Step j has the batch of step 0 with the context grown by j tokens per sequence, so its
        duration is d0 + j x slope (the step cost is affine in the context: the attention roofline
        is proportional to context + new tokens in both its branches)."""
        cost = self.rt.cost
        finish = m
        ctx0 = float(c.sum())
        d0 = cost.decode_s(n, ctx0)
        limit = bound if bound < end_bound else end_bound
        m = min(m, FUSE_MAX_STEPS, int((limit - t) / d0) + 2)  # durations never fall as the context grows
        if m < min_steps:
            return None
        # KV: sequence i needs a new block at step j when (c_i + j) % B == 0, at most m // B + 1
        # times in m steps; when that may not fit, the new blocks over steps 0..s-1 are
        # (s // B) x n + first[s % B], first[r] = new blocks in the first r steps of a cycle
        if n * (m // BLOCK_SIZE + 1) > free:
            first = [0, *np.cumsum(np.bincount((-c) % BLOCK_SIZE, minlength=BLOCK_SIZE)).tolist()]
            if (m // BLOCK_SIZE) * n + first[m % BLOCK_SIZE] > free:
                s = (free // n) * BLOCK_SIZE  # whole cycles that fit, then step by step
                while s < m and ((s + 1) // BLOCK_SIZE) * n + first[(s + 1) % BLOCK_SIZE] <= free:
                    s += 1
                m = s
                if m < min_steps:
                    return None
        last = m - 1
        slope = (cost.decode_s(n, ctx0 + last * n) - d0) / last if last else 0.0
        # steps starting before the bound (the last may end after it), the segment ending before the
        # horizon, on the unfused engine's clock
        st = cost.decode_clock(n, ctx0, t, m)
        k = min(bisect.bisect_left(st, bound, 0, m), bisect.bisect_left(st, end_bound, 1, m + 1) - 1)
        if k < min_steps:
            return None
        after = c + k
        ba = (after + (BLOCK_SIZE - 1)) // BLOCK_SIZE
        split = bool(st[k] >= bound)
        # blocks held after the first k - 1 steps (the row of a split segment's first part; a finishing
        # one may be split too: `_fused_run`)
        but_last = int(((after + (BLOCK_SIZE - 2)) // BLOCK_SIZE).sum()) - held if split or k == finish else 0
        return RunSegment(k, d0, slope, split, ctx0, k == finish, t, float(st[k]), after, ba, int(ba.sum()) - held,
                          but_last, last_start_s=float(st[k - 1]))

    def _fused_run(self, segs: list[RunSegment]) -> Generator[simpy.Event, Any, int]:
        """Advance a planned run's segments in one timeout, then apply them in order: contexts,
        outputs and KV blocks, the finished sequences leaving at their segment's end; each segment
        logged as one run-length row (two when `split`: its last step apart). Returns the steps."""
        env = self.env
        waiting = len(self.waiting)  # nothing reaches the replica before the last step starts
        num_blocks = self.rt.plan.num_blocks
        self._gone = [(seg.end_s, seg.leaving) for seg in segs if seg.leaving]
        yield from land_at(env, segs[-1].end_s)
        self._gone = []
        steps = 0
        for seg in segs:
            n = self.n_running
            k = seg.steps
            steps += k
            used0 = num_blocks - self.free_blocks
            self.free_blocks -= seg.new_blocks
            self.computed[:n] = seg.computed_after
            self.blocks[:n] = seg.blocks_after
            self.gen[:n] += k
            sent = False
            if seg.finishing:
                queued = len(self.waiting)
                self._leave(seg.end_s, seg.stay)
                # (a closed loop without frontend latency submits the next requests inside the
                # completing step's end: that step logs them waiting, in a row of its own)
                sent = len(self.waiting) != queued
            used_blocks = num_blocks - self.free_blocks
            if seg.split or sent:
                if k > 1:
                    self._log_run(seg.start_s, k - 1, seg.d0, seg.slope, n, seg.ctx0,
                                  used0 + seg.new_blocks_but_last, waiting)
                self._log_run(seg.last_start_s, 1, seg.d0 + (k - 1) * seg.slope, 0.0, n, seg.ctx0 + (k - 1) * n,
                              used_blocks, len(self.waiting))
            else:
                self._log_run(seg.start_s, k, seg.d0, seg.slope, n, seg.ctx0, used_blocks, waiting)
        return steps

    def _log_run(self, start: float, steps: int, d0: float, slope: float, n: int, ctx0: float,
                 used_blocks: int, waiting: int) -> None:
        """One step row for `steps` pure decode steps of n sequences (`_run_row`)."""
        self.log.append(self._run_row(start, steps, d0, slope, n, ctx0, used_blocks, waiting))

    def _run_row(self, start: float, steps: int, d0: float, slope: float, n: int, ctx0: float,
                 used_blocks: int, waiting: int) -> tuple[float, ...]:
        """The step row of `steps` pure decode steps of n sequences, the first at context ctx0 and
        lasting d0, each next one `slope` longer: run-length (count, first duration, slope) when
        more than one."""
        cost = self.rt.cost
        total = steps * d0 + slope * (steps * (steps - 1) / 2.0)
        ctx_sum = steps * ctx0 + n * (steps * (steps - 1) / 2.0)
        flops, nbytes = cost.run_sums(float(n), ctx_sum, ctx_sum + steps * n, steps)
        return (self.idx, start, total, n, n, 0.0, n * steps, n * steps, 0, used_blocks, waiting,
                flops * cost.tp, nbytes * cost.tp, total, 0.0, 0.0, d0, steps, slope if steps > 1 else 0.0)

    def _spec_run(self) -> Generator[simpy.Event, Any, int]:
        """A run of speculative decode steps in one timeout; returns how many steps it advanced
        (0: none, the loop takes an ordinary step, and nothing, the RNG included, has changed).

        The conditions at the run's first step are those of `_plan_run` (every running sequence
        decodes, no admission possible, steps start before `FuseBound.next_s` and the run ends
        before the end bound), plus KV blocks held = ceil(computed / B) for every sequence (what
        every step leaves behind). Each segment of the run (`_plan_spec_segment`) draws the
        acceptance outcomes of its candidate steps in one call (the uniforms the unfused loop
        would draw, in its order) and, vectorised over the steps, the tokens each step emits, the
        contexts, every step's cost (bit-identical to the ordinary step's), the KV reservation
        (k + 1 tokens, capped by what is left, then released to what was kept) and, for the
        adaptive policy, each step's choice of k. A segment stops after the first step where a
        sequence finishes, before the first step whose reservation would not fit (it would
        preempt) or whose k differs, and at the time bounds; the uniforms drawn for steps beyond
        it are given back (the generator is rewound to just after its draws).

        When a segment ends with sequences finishing, nothing waits, nothing outside reacts to a
        completion (`_chains`) and k is not re-chosen from acceptance estimates (every policy but
        adaptive), the run goes on with the smaller batch from the exact end of that step, as
        `_plan_run` does (the bound recomputed under least outstanding): the finished sequences
        leave at that end. So a fused run is the unfused loop's steps, to the last bit of every
        number but the clock (one timeout of the steps' summed durations)."""
        rt, env = self.rt, self.env
        spec = rt.spec
        fb = self.fuse
        assert spec is not None and fb is not None
        n = self.n_running
        if n == 0 or (self.waiting and n < rt.max_num_seqs and self.free_blocks > 0):
            return 0
        c = self.computed[:n]
        if (c < self.target[:n]).any():
            return 0
        rem = self.out[:n] - self.gen[:n]
        held = (c + (BLOCK_SIZE - 1)) // BLOCK_SIZE
        if int(rem.min()) < 2 or (self.blocks[:n] != held).any():
            return 0
        k = self._choose_k(np.ones(n, dtype=bool))
        now = env.now
        bound, end_bound = fb.next_s(now, self.idx)
        free, held_sum = self.free_blocks, int(held.sum())
        nxt = self.reqs.lead_off[self.rid[:n]] + self.n_verify[:n]  # each sequence's next outcome
        seg = self._plan_spec_segment(now, c, rem, nxt, k, free, held_sum, bound, end_bound, 2)
        if seg is None:
            return 0
        segs = [seg]
        if seg.finishing and not self.waiting and spec.policy != "adaptive" and self._chains():
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
                    b2, e2 = fb.next_s(t, self.idx, outstanding=n)
                    bound, end_bound = min(bound, b2), min(end_bound, e2)
                if spec.policy == "disable_above_batch":
                    k = 0 if n > spec.disable_batch_size else spec.k
                seg = self._plan_spec_segment(t, c, rem, nxt, k, free, held_sum, bound, end_bound, 1)
                if seg is None:
                    break
                segs.append(seg)
                if not seg.finishing:
                    break
        waiting = len(self.waiting)
        self._gone = [(g.end_s, g.leaving) for g in segs if g.leaving]
        yield from land_at(env, segs[-1].end_s)
        self._gone = []
        num_blocks = rt.plan.num_blocks
        steps_all = 0
        for g in segs:
            # state after the segment (what the unfused steps leave behind)
            n, k, steps = g.n, g.k, g.steps
            steps_all += steps
            got = g.got
            if k:
                assert g.acc_sum is not None
                self.n_prop[:n] += k * steps
                self.n_acc[:n] += g.acc_sum
                self.n_verify[:n] += steps
                self.n_vemit[:n] += got
            self.gen[:n] += got
            self.computed[:n] += got
            free0, held0 = self.free_blocks, int(self.blocks[:n].sum())
            new_held = (self.computed[:n] + (BLOCK_SIZE - 1)) // BLOCK_SIZE
            self.free_blocks -= int((new_held - self.blocks[:n]).sum())
            self.blocks[:n] = new_held
            last = g is segs[-1]
            if last:
                self._leave(env.now)
            else:
                self._leave(g.end_s, g.stay)
            # one row per step, in one append
            q = k + 1
            rows = self.log.block(steps)
            rows[:] = (self.idx, 0.0, 0.0, n, n, 0.0, n * q, 0.0, k, 0.0, waiting, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1, 0.0)
            total, draft = g.total, g.draft
            rows[:, 1] = g.starts[:steps]
            rows[:, 2] = total[:steps]
            rows[:, 16] = rows[:, 2]
            rows[:, 7] = g.per_step[:steps]
            rows[:-1, 9] = g.held_after + (num_blocks - free0 - held0)
            rows[-1, 9] = num_blocks - self.free_blocks
            if last:
                rows[-1, 10] = len(self.waiting)
            rows[:, 11] = g.flops[:steps]
            rows[:, 12] = g.nbytes[:steps]
            rows[:, 13] = g.target[:steps]
            rows[:, 14] = draft if isinstance(draft, float) else draft[:steps]
            rows[:, 15] = g.over[:steps]
        return steps_all

    def _loop_run(self) -> Generator[simpy.Event, Any, int]:
        """The steps a cursor plans for a closed loop of this replica alone (`sim.joint.loop_piece`),
        as one piece; returns its steps (0: none planned, take an ordinary step)."""
        from sim.joint import loop_piece

        got = loop_piece(self)
        if got is None:
            return 0
        piece, feed, self._loop_hard = got  # (a cursor would stop at once at the next boundary: not tried there)
        return (yield from self._run_piece(piece, feed))

    def _run_piece(self, piece: Piece, feed: SendFeed | None = None) -> Generator[simpy.Event, Any, int]:
        """A piece of the rack's joint plan (`sim.joint.Piece`), or of a closed loop's (with the
        sends it planned, `feed`: `sim.joint.loop_piece`): its steps in one timeout (two where one
        cannot land on its end: `land_at`), applied at
        its end as a run admitting arrivals is (`_spec_steps_run`); returns its steps."""
        env = self.env
        assert abs(piece.start_s - env.now) <= 1e-9 * max(1.0, env.now), (piece.start_s, env.now)
        self._gone = piece.gone
        self._gone_t = [t for t, _ in piece.gone]
        self._gone_n = list(itertools.accumulate((c for _, c in piece.gone), initial=0))
        self._taken = piece.taken
        self._pre_t = piece.pre_t
        # (the arrival process's backlog bound counts these preemptions from the piece's start: an
        # upper bound stays one)
        self.reqs.requeued += len(piece.preempted)
        yield from land_at(env, piece.end_s)
        self._gone = []
        self._gone_t = []
        self._taken = []
        self._pre_t = []
        reqs = self.reqs
        planned = {r for r, _ in feed.sent} if feed is not None else set()  # (sent by the piece: never queued)
        if piece.ops is None:
            for adm, start in piece.admitted:  # (taken from the queue the arrival process put them in)
                if adm not in planned:
                    got = self.waiting.popleft()
                    assert got == adm, (got, adm)
                if math.isnan(reqs.scheduled[adm]):
                    reqs.scheduled[adm] = start
        else:  # it preempted: the queue's operations in order (a victim goes back to its head)
            fresh = set(planned)  # (a send's first admission takes it from no queue)
            for op, r in piece.ops:
                if op == PREEMPT_OP:
                    self.waiting.appendleft(r)
                elif r in fresh:
                    fresh.discard(r)
                else:
                    got = self.waiting.popleft()
                    assert got == r, (got, r)
            for adm, start in piece.admitted:
                if math.isnan(reqs.scheduled[adm]):
                    reqs.scheduled[adm] = start
            for r, *was in piece.preempted:  # (as `_preempt_youngest` syncs them)
                reqs.generated[r] = was[0]
                if self.rt.spec is not None:
                    reqs.proposed[r], reqs.accepted[r], reqs.verify_steps[r], reqs.verify_emitted[r] = was[1:]
                reqs.preemptions[r] += 1
        if piece.first:
            reqs.first_token[[r for r, _ in piece.first]] = [f for _, f in piece.first]
        if piece.done:
            g = np.array([d[0] for d in piece.done], dtype=np.int64)
            reqs.completion[g] = [d[1] for d in piece.done]
            reqs.generated[g] = reqs.output[g]  # a finished request has generated its whole output
            if self.rt.spec is not None:
                reqs.proposed[g] = [d[2] for d in piece.done]
                reqs.accepted[g] = [d[3] for d in piece.done]
                reqs.verify_steps[g] = [d[4] for d in piece.done]
                reqs.verify_emitted[g] = [d[5] for d in piece.done]
            reqs.n_done += len(piece.done)
        rid, c, left, tgt, prop, acc, ver, vem = piece.state
        m = len(rid)
        self._ints[:, :m] = 0
        if m:
            ra = np.array(rid, dtype=np.int64)
            cm = np.array(c, dtype=np.int64)
            self.rid[:m] = ra
            self.computed[:m] = cm
            self.blocks[:m] = (cm + (BLOCK_SIZE - 1)) // BLOCK_SIZE
            self.target[:m] = tgt
            self.out[:m] = reqs.output[ra]
            self.gen[:m] = self.out[:m] - np.array(left, dtype=np.int64)
            if self.rt.spec is not None:
                self.n_prop[:m] = prop
                self.n_acc[:m] = acc
                self.n_verify[:m] = ver
                self.n_vemit[:m] = vem
        self.n_running = m
        self.free_blocks = piece.free
        if feed is not None:  # (the closed loop's sends for its completions: the piece made them)
            feed.commit(self, {r for r, _ in piece.admitted}, piece.end_s)
        elif piece.done and reqs.on_complete is not None:  # (an autoscaled fleet: a draining replica emptied leaves)
            reqs.on_complete(len(piece.done))
        self.log.extend(piece.rows)
        return piece.steps

    def _spec_steps_run(self, absorb: bool) -> Generator[simpy.Event, Any, int]:
        """A fused run of speculative steps planned step by step in scalars (`_plan_spec_steps`),
        in one timeout; returns its steps (0: none planned, take an ordinary step). `absorb`: the
        run also admits the arrivals that reach this replica (`_absorbs`). Applied when the
        timeout fires: admissions from the waiting queue, completions with their counters, the
        slot arrays (the run's first sequences in their order, then the admitted ones) and the
        step rows."""
        plan = self._plan_spec_steps(absorb)
        if plan is None:
            return 0
        end_s, steps, rows, done, admitted, ent, free, feed, gone = plan
        self._taken = [start for _, start, _ in admitted]
        self._gone = gone
        yield from land_at(self.env, end_s)  # (the end its plan counted with)
        self._taken = []
        self._gone = []
        reqs = self.reqs
        self._take_admitted(admitted, feed)
        C, R, RID, TGT, PROP, ACC, VER, VEM, active = ent
        if self.cache is not None:
            # (with a prefix cache a run admits nothing and ends at its first completion: its
            # sequences keep their slots, and leave through `_leave`, which caches their blocks)
            n0 = self.n_running
            cm = np.array(C[:n0], dtype=np.int64)
            self.computed[:n0] = cm
            self.blocks[:n0] = (cm + (BLOCK_SIZE - 1)) // BLOCK_SIZE
            self.gen[:n0] = self.out[:n0] - np.array(R[:n0], dtype=np.int64)
            self.n_prop[:n0] = PROP[:n0]
            self.n_acc[:n0] = ACC[:n0]
            self.n_verify[:n0] = VER[:n0]
            self.n_vemit[:n0] = VEM[:n0]
            self.free_blocks = free - sum([(C[e] + (BLOCK_SIZE - 1)) // BLOCK_SIZE for e, _ in done])
            self._leave(end_s)
            self._end_absorbing(rows, admitted, feed, end_s)
            return steps
        if done:
            es = [e for e, _ in done]
            g = np.array([RID[e] for e in es], dtype=np.int64)
            reqs.completion[g] = np.array([t for _, t in done])
            reqs.generated[g] = reqs.output[g]  # a finished request has generated its whole output
            reqs.proposed[g] = [PROP[e] for e in es]
            reqs.accepted[g] = [ACC[e] for e in es]
            reqs.verify_steps[g] = [VER[e] for e in es]
            reqs.verify_emitted[g] = [VEM[e] for e in es]
            reqs.n_done += len(es)
        m = len(active)
        self._ints[:, :m] = 0
        if m:
            ra = np.array([RID[e] for e in active], dtype=np.int64)
            cm = np.array([C[e] for e in active], dtype=np.int64)
            self.rid[:m] = ra
            self.computed[:m] = cm
            self.blocks[:m] = (cm + (BLOCK_SIZE - 1)) // BLOCK_SIZE
            self.target[:m] = [TGT[e] for e in active]
            self.out[:m] = reqs.output[ra]
            self.gen[:m] = self.out[:m] - np.array([R[e] for e in active], dtype=np.int64)
            self.n_prop[:m] = [PROP[e] for e in active]
            self.n_acc[:m] = [ACC[e] for e in active]
            self.n_verify[:m] = [VER[e] for e in active]
            self.n_vemit[:m] = [VEM[e] for e in active]
        self.n_running = m
        self.free_blocks = free
        if done and reqs.on_complete is not None and feed is None:  # (a run ends at the first completion then)
            reqs.on_complete(len(done))
        self._end_absorbing(rows, admitted, feed, end_s)
        return steps

    def _plan_spec_steps(self, absorb: bool) -> tuple[Any, ...] | None:
        """The plan of `_spec_steps_run`: the steps the unfused loop would take, one by one in plain
        Python over the entries' scalars (context, tokens left, next outcome, counters), while
        every running sequence decodes: each step's k by the policy (adaptive: from the entries'
        estimates, `_adaptive_pick`), its KV reservation (k + 1 tokens capped by what is left; a
        tree's every node, capped by the model's length), with `absorb` the FCFS admission of the
        arrivals of the previous step prefilled whole in the budget left (`_whole_prompts`), its
        price (`_spec_step`, or `_spec_cost` with a prefill), each decoding sequence's outcome
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
        when a request waits for its slot or something outside reacts to it (`_chains`), an idle
        replica, or FUSE_MAX_PIECES steps."""
        rt, fb, reqs = self.rt, self.fuse, self.reqs
        spec = rt.spec
        assert spec is not None and fb is not None
        n = self.n_running
        waiting = self.waiting
        max_seqs = rt.max_num_seqs
        if absorb:
            if (n == 0 and not waiting) or (waiting and (n + len(waiting) > max_seqs or self.free_blocks <= 0)):
                return None
        elif n == 0 or (waiting and n < max_seqs and self.free_blocks > 0):
            return None
        policy = spec.policy
        shape = spec.shape
        if policy == "adaptive" and shape is not None:
            return None  # (its k is chosen by `_choose_k_general`, over arrays)
        B = BLOCK_SIZE
        c0 = self.computed[:n]
        if n and ((c0 < self.target[:n]).any() or (self.blocks[:n] != (c0 + (B - 1)) // B).any()):
            return None
        pending: list[int] = list(waiting) if absorb else []  # admitted at the next step, FCFS
        if pending and reqs.generated[pending].any():
            return None  # a preempted request (recompute): the ordinary loop
        # the entries (the run's sequences, then the admitted ones): context, tokens left, request,
        # next outcome in `lead_b`, prefill target, draft counters; `active`: the running ones in slot order
        C: list[int] = c0.tolist()
        R: list[int] = (self.out[:n] - self.gen[:n]).tolist()
        RID: list[int] = self.rid[:n].tolist()
        NX: list[int] = (reqs.lead_off[self.rid[:n]] + self.n_verify[:n]).tolist()
        TGT: list[int] = self.target[:n].tolist()
        PROP: list[int] = self.n_prop[:n].tolist()
        ACC: list[int] = self.n_acc[:n].tolist()
        VER: list[int] = self.n_verify[:n].tolist()
        VEM: list[int] = self.n_vemit[:n].tolist()
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
        t = self.env.now
        least = False
        feed: SendFeed | None = None
        queued: list[float] = []
        stride = j = 0
        if absorb:
            feed, queued, stride, j = self._arrival_source()
            _, end_bound = fb.next_s(t, self.idx)
            bound = math.inf
        else:
            bound, end_bound = fb.next_s(t, self.idx)
            least = fb.routing is not None and fb.routing[3] == "least_outstanding"
        chains = absorb or self._chains()
        blocked = bool(waiting) and not absorb  # a request waits for a slot or a block: a completion would admit it
        num_blocks = rt.plan.num_blocks
        budget_max = rt.max_num_batched_tokens
        max_len = rt.max_model_len
        free = self.free_blocks
        held = sum([(x + (B - 1)) // B for x in C])
        ctx = sum(C)
        idx = self.idx
        k_max = spec.k
        fixed_k = (k_max if self.speculating else 0) if policy == "follow_load" else k_max
        tree = shape is not None and not shape.chain
        rows: list[tuple[float, ...]] = []
        done: list[tuple[int, float]] = []  # (entry, completion time), in the order they leave
        gone: list[tuple[float, int]] = []  # (time, sequences) completing inside the run
        admitted: list[tuple[int, float, float]] = []
        steps = 0
        # step rows are one per step, so metric windows need no cut; speculation that follows the load
        # may switch at one (a FollowLoad tick): there the run ends
        cut = fb.next_cut_s(t) if policy == "follow_load" else math.inf
        waiting_now = len(waiting)
        while steps < FUSE_MAX_PIECES and t < cut and t < bound:
            n = len(active)
            if blocked and n < max_seqs and free > 0:
                break  # a waiting request could now be admitted: the ordinary step takes it
            chosen = None  # the adaptive choice prices every k: the chosen one's decode-only figures
            if policy == "adaptive":
                k, chosen = (self._adaptive_choice([ACC[e] + C[e] - PS - (NX[e] + V) for e in active],
                                                   [PROP[e] + KS for e in active], float(ctx)) if n else (0, None))
            elif policy == "disable_above_batch":
                k = 0 if n > spec.disable_batch_size else k_max
            else:
                k = fixed_k
            q = k + 1
            qv = spec.verify_tokens(k) if (tree and k) else q
            # the KV reservation of the decoding sequences (all of them): at most qv // B + 1 blocks
            # each, so with room for that and for every pending prompt whole it fits and admits
            # the same requests whatever it is exactly (its sum is not needed: held blocks after a
            # step are ceil(context / B), whatever was reserved)
            if free >= n * (qv // B + 1) + (sum([-(-int(reqs.prompt[rid]) // B) for rid in pending]) if pending else 0):
                need = 0
            elif q == 1:
                need = sum([(C[e] + B) // B for e in active]) - held
            elif qv != q:
                need = sum([(C[e] + (qv if qv < max_len - C[e] else max_len - C[e]) + (B - 1)) // B
                            for e in active]) - held
            else:
                need = sum([(C[e] + (q if q < R[e] else R[e]) + (B - 1)) // B for e in active]) - held
            if need > free:
                break  # it would preempt: the ordinary loop
            n_pre = 0
            if pending:
                whole = self._whole_prompts(pending, budget_max - n * qv, n, free - need)
                if whole is None:
                    break
                chunks, _, (pre_tokens, pre_ctx, pre_pairs) = whole
                n_pre = len(chunks)
                plan = (VerifyPlan(float(n) * qv, float(ctx) * qv + float(n) * (qv * qv if tree else qv * (qv + 1) / 2.0),
                                   float(n), float(ctx)) if shape is not None and k and n else None)
                cost = self._spec_cost(n, float(ctx) if n else 0.0, k, n_pre, pre_tokens, pre_ctx, pre_pairs, plan)
            elif n:
                cost = chosen if chosen is not None else self._spec_step(n, float(ctx), k)
            else:
                break
            total = cost[0]
            end = t + total
            if end >= end_bound:
                break
            arrived: list[int] = []
            waits = 0
            if absorb:
                j, arrived, waits, near = self._arrived_at(queued, j, stride, end, feed)
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
                _counters(left, C, NX, V, PROP, ACC, VER, VEM, KS, PS, fix)
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
            rows.append((idx, t_start, total, n + n_pre, n, pre_tokens if n_pre else 0.0, n * qv, emitted, k,
                         num_blocks - free, w, cost[4], cost[5], cost[1], cost[2], cost[3], total if n else 0.0, 1,
                         0.0))
            steps += 1
            if (not active and not pending) or t >= end_bound or (feed is not None and feed.exhausted):
                break
            if left and last:
                break
            if left and least:  # (never past the run's first bounds, as `_spec_run`)
                b2, e2 = fb.next_s(t, self.idx, outstanding=len(active))
                bound, end_bound = min(bound, b2), min(end_bound, e2)
            if not absorb and t >= bound:
                break
        if not rows:
            return None
        _counters(active, C, NX, V, PROP, ACC, VER, VEM, KS, PS, fix)  # (those done left with theirs)
        if not absorb and rows[-1][10] >= 0:  # (the last step's waiting count, read at the run's end)
            rows[-1] = (*rows[-1][:10], -1, *rows[-1][11:])
        return t, steps, rows, done, admitted, (C, R, RID, TGT, PROP, ACC, VER, VEM, active), free, feed, gone

    def _plan_spec_segment(self, now: float, c: np.ndarray, rem: np.ndarray, nxt: np.ndarray, k: int,
                           free: int, held_sum: int, bound: float, end_bound: float,
                           min_steps: int) -> SpecSegment | None:
        """One segment of `_spec_run` from time `now`: the sequences at contexts c (KV blocks held
        ceil(c / B), `held_sum` in all) with `rem` tokens left, their next verification outcomes
        at `nxt` in `Requests.lead` (each step of depth k > 0 takes the next one of every
        sequence), speculating k, `free` blocks free; None when fewer than `min_steps` steps fit."""
        rt = self.rt
        spec = rt.spec
        assert spec is not None
        n = c.size
        q = k + 1
        ctx0 = float(c.sum())
        # step 0's duration, as the ordinary step prices it; later steps last longer (a longer
        # context). A first segment of one step would be the ordinary step at a higher cost: none
        # when the second step could not start before the bounds
        first = self._spec_step(n, ctx0, k)
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
            acc = np.minimum(self.reqs.lead[nxt[None, :] + np.arange(m)[:, None]], k).astype(np.int64)
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
        total, target, draft, over, flops, nbytes = self._spec_cost_many(n, ctx[:steps], k)
        starts = np.cumsum(np.concatenate(([now], total)))
        steps = min(steps, int(np.searchsorted(starts[:steps], bound, "left")),
                    int(np.searchsorted(starts[1:], end_bound, "left")))
        if steps < min_steps or steps < 1:
            return None
        got = emit[:steps].sum(axis=0)
        c_after = c + got
        held_all = int(((c_after + (BLOCK_SIZE - 1)) // BLOCK_SIZE).sum())
        rem_after = rem - got
        done = rem_after <= 0
        finishing = bool(done.any())
        return SpecSegment(
            n, k, steps, float(starts[steps]), starts, total, target, draft, over, flops, nbytes, per_step, got,
            acc[:steps].sum(axis=0) if k else None,
            # blocks held after each step but the last (the last's are known after the segment)
            ((c + (BLOCK_SIZE - 1) + cum[:steps - 1]) // BLOCK_SIZE).sum(axis=1),
            finishing, c_after, rem_after, held_all,
            int(((c_after[done] + (BLOCK_SIZE - 1)) // BLOCK_SIZE).sum()) if finishing else 0)

    def _spec_step(self, n_dec: int, ctx: float, k: int) -> tuple[float, float, float, float, float, float]:
        """`_spec_cost` of one decode-only step (every sequence decoding, no prefill) at context
        sum `ctx`, in scalars with its operations in its order (bit-identical: the additions of
        an empty prefill, x + 0.0, are x), each pass priced as `CostModel.pass_sums` prices it, inline
        from the terms that depend on the batch and k only (`_spec_step_parts`, cached per batch, k
        and whether speculation is on): a short fused run's steps cost less so than with numpy."""
        if k and self.rt.spec is not None and self.rt.spec.shape is not None:
            return self._shape_step(n_dec, ctx, k)
        key = (n_dec * 1024 + k) * 2 + self.speculating  # (n_dec, k < 1024, speculating) as one int
        pr = self._step_parts.get(key)
        if pr is None:
            pr = self._step_parts[key] = self._spec_step_parts(n_dec, k)
        # pass_sums of each pass inline, its operations in its order: the target's verification
        # (context ctx, pairs ctx q + n q (q + 1) / 2), k draft passes at the mean draft context,
        # and the plain decode pass the machinery's overhead is a fraction of
        (q, pairs0, lin, kv_w, w, act, comm_s, over_s, lin_f, apf, peak, kvb, bw, tp,
         draft_p, plain_p, frac) = pr
        attn_f = apf * (ctx * q + pairs0)
        attn_c = attn_f / peak
        kv_r = kvb * ctx
        attn_m = (kv_r + kv_w) / bw
        total = lin + (attn_c if attn_c > attn_m else attn_m) + comm_s + over_s
        flops = (lin_f + attn_f) * tp
        nbytes = (w + kv_r + kv_w + act) * tp
        draft = 0.0
        if draft_p is not None:
            (half, d_lin, d_kv_w, d_w, d_act, d_comm, d_over, d_lin_f, d_apf, d_peak, d_kvb, d_bw, d_tp) = draft_p
            mean_ctx = ctx + half
            d_attn_f = d_apf * (mean_ctx + n_dec)
            d_attn_c = d_attn_f / d_peak
            d_kv_r = d_kvb * mean_ctx
            d_attn_m = (d_kv_r + d_kv_w) / d_bw
            draft = k * (d_lin + (d_attn_c if d_attn_c > d_attn_m else d_attn_m) + d_comm + d_over)
            flops += k * (d_lin_f + d_attn_f) * d_tp
            nbytes += k * (d_w + d_kv_r + d_kv_w + d_act) * d_tp
        step = total + draft
        if frac is None:
            over = 0.0
        elif plain_p is not None:
            p_lin, p_kv_w, p_comm, p_over, p_apf, p_peak, p_kvb, p_bw = plain_p
            p_attn_c = p_apf * (ctx + n_dec) / p_peak
            p_attn_m = (p_kvb * ctx + p_kv_w) / p_bw
            over = (p_lin + (p_attn_c if p_attn_c > p_attn_m else p_attn_m) + p_comm + p_over) * frac
        else:
            over = total * frac
        return step + over, total, draft, over, flops, nbytes

    def _shape_step(self, n_dec: int, ctx: float, k: int) -> tuple[float, float, float, float, float, float]:
        """`_spec_step` for a depth profile or a token tree (k > 0): `_spec_cost` of the decode-only
        step with the verification plan `_verify_plan` makes (every sequence verifying its q =
        `verify_tokens(k)` tokens, a tree's attention tile q x q) and the draft passes of
        `_draft_sums`, each pass priced by `CostModel.pass_sums` (bit-identical to `step_sums`)."""
        rt = self.rt
        spec = rt.spec
        cost = rt.cost
        assert spec is not None and spec.shape is not None and isinstance(cost, CostModel)
        q = spec.verify_tokens(k)
        tri = q * q if not spec.shape.chain else q * (q + 1) / 2.0
        nd = float(n_dec)
        total, fl, by = cost.pass_sums(n_dec, nd * q + 0.0, ctx + 0.0, (ctx * q + nd * tri) + 0.0)
        flops, nbytes = fl * cost.tp, by * cost.tp
        draft_s = 0.0
        dc = spec.draft_cost
        if dc is not None:
            assert isinstance(dc, CostModel)
            t = f = b = 0.0
            for i, p in enumerate(self._parents(k)):
                c_i = ctx + nd * i
                d_t, d_f, d_b = dc.pass_sums(round(nd), nd * p, c_i, p * (c_i + nd), False)
                t += d_t
                f += d_f * dc.tp
                b += d_b * dc.tp
            draft_s += t
            flops += f
            nbytes += b
        over = 0.0
        if self.speculating:
            over = cost.pass_sums(n_dec, n_dec, ctx, ctx + n_dec)[0] * self._overhead_frac(n_dec)
        return total + draft_s + over, total, draft_s, over, flops, nbytes

    def _parents(self, k: int) -> list[float]:
        """Tokens the drafter runs on at each depth 1..k (`DraftShape.parents`), cached per k."""
        got = self._parents_k.get(k)
        if got is None:
            spec = self.rt.spec
            assert spec is not None and spec.shape is not None
            got = self._parents_k[k] = [float(x) for x in spec.shape.parents(k)]
        return got

    def _spec_step_parts(self, n_dec: int, k: int) -> StepParts:
        """`_spec_step`'s terms that depend on the batch and k only (a fused replica's models have
        no sliding window, `affine_in_context`, so `pass_sums` would take them from its cache)."""
        rt = self.rt
        spec = rt.spec
        cost = rt.cost
        assert spec is not None and isinstance(cost, CostModel)
        dc = spec.draft_cost
        assert not cost.window and not (isinstance(dc, CostModel) and dc.window)
        assert k < 1024  # (`_spec_step`'s cache key; the scenario allows num_speculative_tokens <= 16)
        q = k + 1
        lin, kv_w, w, act, comm_s, over_s, lin_f = cost.pass_parts(n_dec, n_dec * q + 0.0)
        draft_p: DraftParts | None = None
        if dc is not None and k > 0:
            assert isinstance(dc, CostModel)
            d_lin, d_kv_w, d_w, d_act, d_comm, d_over, d_lin_f = dc.pass_parts(n_dec, n_dec, False)
            draft_p = (n_dec * (k - 1) / 2.0, d_lin, d_kv_w, d_w, d_act, d_comm, d_over, d_lin_f,
                       dc.attn_flops_per_pair, dc._peak_attn, dc.kv_bytes_per_token_gpu, dc.bw, dc.tp)
        plain_p: PlainParts | None = None
        if self.speculating and k > 0:
            pl = cost.pass_parts(n_dec, n_dec)
            plain_p = (pl[0], pl[1], pl[4], pl[5], cost.attn_flops_per_pair, cost._peak_attn, cost.kv_bytes_per_token_gpu,
                       cost.bw)
        return (q, n_dec * q * (q + 1) / 2.0, lin, kv_w, w, act, comm_s, over_s, lin_f, cost.attn_flops_per_pair,
                cost._peak_attn, cost.kv_bytes_per_token_gpu, cost.bw, cost.tp, draft_p, plain_p,
                self._overhead_frac(n_dec) if self.speculating else None)

    def _spec_cost_many(self, n_dec: int, ctx: np.ndarray, k: int) -> tuple[Any, ...]:
        """`_spec_cost` of decode-only steps (every sequence decoding, no prefill) at each context
        sum in `ctx`, vectorised, with the same operations in the same order (bit-identical); a
        few steps (SPEC_SCALAR_STEPS) step by step in scalars (`_spec_step`: numpy's per-call
        cost dominates arrays that short)."""
        rt = self.rt
        spec = rt.spec
        assert spec is not None and isinstance(rt.cost, CostModel)
        if ctx.size <= SPEC_SCALAR_STEPS:
            cols = list(zip(*[self._spec_step(n_dec, c, k) for c in ctx.tolist()], strict=True))
            if not cols:
                cols = [(), (), (), (), (), ()]
            return tuple(np.array(c, dtype=np.float64) for c in cols)
        q = k + 1
        # (x + 0.0 is x for x >= 0: the ordinary step's additions of its empty prefill are left out)
        pairs = ctx * q + n_dec * q * (q + 1) / 2.0
        total, flops, nbytes = rt.cost.step_sums_many(n_dec, n_dec * q + 0.0, ctx, pairs)
        flops *= rt.cost.tp
        nbytes *= rt.cost.tp
        dc = spec.draft_cost
        if dc is not None and k > 0:
            mean_ctx = ctx + n_dec * (k - 1) / 2.0
            d_total, d_flops, d_bytes = dc.step_sums_many(n_dec, n_dec, mean_ctx, mean_ctx + n_dec,
                                                          step_overhead=False)
            draft: np.ndarray | float = k * d_total
            flops += k * d_flops * dc.tp
            nbytes += k * d_bytes * dc.tp
            step = total + draft
        else:
            draft, step = 0.0, total
        plain = total if k == 0 else rt.cost.step_sums_many(n_dec, n_dec, ctx, ctx + n_dec, totals=True)[0]
        # follow_load switched off: the plain decode path, no machinery (as `_spec_cost`)
        over = plain * self._overhead_frac(n_dec) if self.speculating else 0.0 * plain
        return step + over, total, draft, over, flops, nbytes

    def _fit_chunk(self, i: int, budget: int, alone: bool = False) -> int:
        """Largest prefill chunk for entry i within the token budget and the free KV blocks;
        reserves its blocks. Without chunked prefill the whole remainder (which _fits_whole
        checked), even past the budget when it goes alone."""
        remaining = int(self.target[i] - self.computed[i])
        c = remaining if (not self.rt.chunked_prefill and (alone or remaining <= budget)) else min(remaining, budget)
        have = int(self.blocks[i]) * BLOCK_SIZE - int(self.computed[i])  # room in held blocks
        if c > have:
            extra_blocks = -(-(c - have) // BLOCK_SIZE)
            if extra_blocks > self.free_blocks:
                extra_blocks = self.free_blocks
                c = min(c, have + extra_blocks * BLOCK_SIZE)
            self.blocks[i] += extra_blocks
            self.free_blocks -= extra_blocks
        return max(0, c)
