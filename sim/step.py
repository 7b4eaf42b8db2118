"""The step rules: what one engine step of a replica does, as plain functions over its state
(`sim.state.ReplicaState`). The ordinary step (`sim.engine.Replica.run`) calls them one step at a
time; the fused runs (`sim.fusion`) and the rack planner (`sim.joint`) plan many steps with the
same rules in scalars (`decode_one`, `decode_spec`).

Each step, in this order (vLLM v1-like):
0. with `prefill = "separate"` (vLLM 0.6's default scheduler, SGLang): if any prefill can be
   scheduled (`prefill_pending`), the step is a prefill step of its own (step 2 with the whole
   budget) and nothing decodes; with multi-step scheduling (`scheduler_steps` n > 1) a decode
   step is followed by n - 1 more before prefills are considered again;
1. decode: every running sequence whose prompt is fully computed gets 1 new token (k + 1 when
   speculating, k from the policy: `sim.policies`); KV blocks for them are reserved, preempting
   the youngest sequences (recompute) while blocks run short;
2. prefill (`prefill = "mixed"`): the token budget left goes to partly prefilled sequences in
   admission order, then to waiting requests (FCFS) while a slot and blocks exist, unless step 1
   preempted (`plan_prefill`, `fit_chunk`; without chunked prefill a prompt goes whole or waits:
   `fits_whole`);
3. the step lasts the pricer's time for that batch (`sim.pricing.StepPricer.spec_cost`); at its
   end tokens are emitted, finished sequences leave.
"""

from __future__ import annotations

import math

import numpy as np

from models.memory import BLOCK_SIZE
from sim.state import ReplicaState


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


def draft_counters(entries: list[int], C: list[int], NX: list[int], V: int, PROP: list[int], ACC: list[int],
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


# ------------------------------------------------------------- engine loop
def chunk_tokens(remaining: int, budget: int, alone: bool, chunked: bool) -> int:
    """Tokens of a prefill chunk in a step's token budget: with chunked prefill what is left, up to
    the budget; without, the whole remainder when it fits the budget or goes alone in the step
    (`alone`: the budget is whole; a prompt that must wait is `whole_fits`'s to say)."""
    if not chunked and (alone or remaining <= budget):
        return remaining
    return remaining if remaining < budget else budget


def chunk_blocks(c: int, have: int, free: int) -> tuple[int, int]:
    """(tokens, new KV blocks) of a prefill chunk of c tokens with `have` tokens of room in the
    blocks its sequence holds: the blocks beyond that room, as many as are free (the chunk then
    shrinks to what they hold)."""
    if c <= have:
        return c, 0
    extra = -(-(c - have) // BLOCK_SIZE)
    if extra > free:
        extra = free
        c = min(c, have + extra * BLOCK_SIZE)
    return c, extra


def whole_fits(tokens: int, blocks: int, budget: int, alone: bool, free: int) -> bool:
    """Without chunked prefill a prompt is admitted whole or waits: it fits the budget (or goes
    alone in the step) and its KV blocks are free."""
    return (tokens <= budget or alone) and blocks <= free


def prefill_sums(chunks: list[int], ctxs: list[int]) -> tuple[float, float, float]:
    """(tokens, contexts, attention pairs) of a step's prefill chunks, chunk c at context x attending
    to c x + c (c + 1) / 2 pairs: what the pricer charges for them (`StepPricer.spec_cost`). The
    sums are of integers, so exact whatever their order."""
    if len(chunks) == 1:  # (the usual case)
        tokens, ctx = float(chunks[0]), float(ctxs[0])
        return tokens, ctx, tokens * ctx + 0.5 * (tokens * (tokens + 1.0))
    if not chunks:
        return 0.0, 0.0, 0.0
    pairs = float(sum([c * x for c, x in zip(chunks, ctxs, strict=True)])) + 0.5 * float(sum([c * (c + 1) for c in chunks]))
    return float(sum(chunks)), float(sum(ctxs)), pairs


def prefill_pending(rep: ReplicaState) -> bool:
    """Whether prefill work could be scheduled now: a partly prefilled sequence, or a waiting
    request with a free slot and a free block."""
    n = rep.n_running
    return bool((rep.computed[:n] < rep.target[:n]).any()) or bool(
        rep.waiting and n < rep.rt.max_num_seqs and rep.free_blocks > 0)


def plan_prefill(rep: ReplicaState, budget: int, dec: np.ndarray, admit: bool, all_dec: bool) -> tuple[list[int], list[int]]:
    """Prefill chunks within the token budget: partial prefills (oldest first), then new
    admissions (FCFS) while a slot and blocks exist and `admit`. Without chunked prefill a
    prompt goes whole or waits (one longer than the whole budget goes alone)."""
    rt, reqs = rep.rt, rep.reqs
    chunk_idx: list[int] = []
    chunks: list[int] = []
    full = budget
    if not all_dec:
        for j in np.flatnonzero(~dec).tolist():
            if budget <= 0:
                break
            c = fit_chunk(rep, j, budget, budget == full)
            if c <= 0:
                break
            chunk_idx.append(j)
            chunks.append(c)
            budget -= c
    while admit and budget > 0 and rep.waiting and rep.n_running < rt.max_num_seqs and rep.free_blocks > 0:
        rid = rep.waiting[0]
        if not rt.chunked_prefill and not fits_whole(rep, rid, budget, budget == full):
            break
        rep.waiting.popleft()
        i = rep.admit(rid)
        c = fit_chunk(rep, i, budget, budget == full)
        if math.isnan(reqs.scheduled[rid]):
            reqs.scheduled[rid] = rep.env.now
        if c > 0:  # 0 only when a prefix-cache hit took the last free blocks: it waits for more
            chunk_idx.append(i)
            chunks.append(c)
            budget -= c
    return chunk_idx, chunks


def fits_whole(rep: ReplicaState, rid: int, budget: int, alone: bool) -> bool:
    """Without chunked prefill: the whole prompt (plus output so far, when recomputing) fits
    in the budget (or goes alone in an empty step) and in the free KV blocks. With a prefix
    cache, only the uncached tokens count, and a hit on unreferenced cached blocks takes them
    from the free capacity."""
    tokens = int(rep.reqs.prompt[rid] + rep.reqs.generated[rid])
    need = -(-tokens // BLOCK_SIZE)
    if rep.cache is not None:
        h, blocks = rep.hit(rid, tokens)
        tokens -= blocks * BLOCK_SIZE
        need -= blocks
        if h:  # unreferenced cached blocks of the hit are free capacity the admission takes
            need += rep.cache.evictable_blocks(rep.units(rid)[0][:h])
    return whole_fits(tokens, need, budget, alone, rep.free_blocks)


def fit_chunk(rep: ReplicaState, i: int, budget: int, alone: bool = False) -> int:
    """Largest prefill chunk for entry i within the token budget and the free KV blocks;
    reserves its blocks. Without chunked prefill the whole remainder (which _fits_whole
    checked), even past the budget when it goes alone."""
    remaining = int(rep.target[i] - rep.computed[i])
    c = chunk_tokens(remaining, budget, alone, rep.rt.chunked_prefill)
    have = int(rep.blocks[i]) * BLOCK_SIZE - int(rep.computed[i])  # room in held blocks
    c, extra = chunk_blocks(c, have, rep.free_blocks)
    if extra:
        rep.blocks[i] += extra
        rep.free_blocks -= extra
    return max(0, c)
