"""The run's two tables as the engine fills them: the request table (`Requests`, arrays indexed by
request id) and the step table (`StepLog`, one row per engine step or per run of pure decode steps,
`STEP_COLUMNS`)."""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable, Sequence
from typing import Any, Final

import numpy as np

STEP_COLUMNS = (
    "replica", "start_s", "duration_s", "batch_size", "decode_seqs", "prefill_tokens", "decode_tokens", "emitted_tokens",
    "k", "kv_blocks_used", "waiting", "flops", "bytes", "target_s", "draft_s", "spec_overhead_s", "chunk_gap_s",
    "count", "gap_step_s",
)
ROW = struct.Struct(f"{len(STEP_COLUMNS)}d")  # a step row packed as doubles (`pack_rows`)
WAITING: Final = STEP_COLUMNS.index("waiting")
# `x.sum()` of a 1-D array, called without numpy's Python wrapper (`_methods._sum`, about a
# microsecond a call; the engine sums slot arrays several times a step): the same reduction, the same sum
add_reduce: Final = np.add.reduce


def row_waiting(row: bytes) -> float:
    """A packed step row's waiting count."""
    return float(ROW.unpack(row)[WAITING])


def with_waiting(row: bytes, waiting: float) -> bytes:
    """A packed step row with its waiting count replaced."""
    r = ROW.unpack(row)
    return ROW.pack(*r[:WAITING], waiting, *r[WAITING + 1:])


def pack_rows(rows: Sequence[Sequence[float]]) -> bytes:
    """Step rows packed as doubles, in order (`StepLog.extend_packed` reads them): a long plan's
    rows leave their tuples early, so their objects are reused instead of piling up (the same
    values: whole numbers and floats convert to doubles as the log converts them)."""
    return b"".join(itertools.starmap(ROW.pack, rows))


STEP_INT_COLUMNS = ("replica", "batch_size", "decode_seqs", "k", "kv_blocks_used", "waiting", "count")  # int64


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

    def extend_packed(self, buf: bytes) -> None:
        """Rows packed as doubles (`ROW`, `pack_rows`: a planned piece's or fused run's), in order
        (after the rows logged before)."""
        if not buf:
            return
        self._flush()
        self._write(buf)
        self.n += len(buf) // ROW.size

    def _flush(self) -> None:
        """The single rows waiting, into the block (packed as doubles, row by row: a third faster
        than a float iterator over the tuples, and a row of the wrong length is refused, never
        shifting the rest)."""
        rows = self._pending
        if not rows:
            return
        self._pending = []
        self._write(pack_rows(rows))

    def _write(self, buf: bytes) -> None:
        """Packed rows into the current block (a new one when they do not fit)."""
        rows = len(buf) // ROW.size
        if self._i + rows > self._cur.shape[0]:
            self._next_block(rows)
        self._cur[self._i: self._i + rows] = np.frombuffer(buf, dtype=np.float64).reshape(rows, -1)
        self._i += rows

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


def _int_view(a: np.ndarray) -> memoryview:
    """A flat int64 array's items as Python ints (`Requests`' views), without a copy."""
    if a.dtype != np.int64 or a.ndim != 1 or not a.flags.c_contiguous:
        raise ValueError(f"a request column must be a flat int64 array, got {a.dtype} of shape {a.shape}")
    return a.data


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
        self.host_cached = np.zeros(n, dtype=np.int64)  # ... of them, loaded from the host tier
        self.prefill_cached = np.zeros(n, dtype=np.int64)  # prefill tokens served from the cache (all admissions)
        self.prefill_computed = np.zeros(n, dtype=np.int64)  # prefill tokens computed (all admissions)
        # tokens the admissions prefilled, cached or computed: the prompt, plus after a preemption what
        # was prefilled before it and the prompt + output so far again (prefill_cached + computed = this)
        self.prefill_tokens = np.zeros(n, dtype=np.int64)
        # disaggregated decode (sim/disagg.py): prompt tokens whose KV arrives with the request from a
        # prefill replica, taken at its first admission (None: none do), and the draft's prefill
        # tokens the decode replica recomputes in the step of the request's first chunk
        self.preloaded: np.ndarray | None = None
        self.draft_pending: np.ndarray | None = None
        # the columns a joint plan reads one request at a time, as views whose items are Python ints
        # (a numpy scalar per read costs an object and a conversion; the same memory, so the views
        # follow the simulation's writes)
        self.prompt_v = _int_view(prompt)
        self.output_v = _int_view(output)
        self.generated_v = _int_view(self.generated)
        self.preemptions_v = _int_view(self.preemptions)
        self.lead_off_v = _int_view(self.lead_off)

    def set_draws(self, lead: bytes, offsets: np.ndarray) -> None:
        """Give each request its verification outcomes (`models.speculative.acceptance_draws`)."""
        self.lead_b = lead
        self.lead = np.frombuffer(lead, dtype=np.uint8)
        self.lead_off = offsets
        self.lead_off_v = _int_view(offsets)

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
