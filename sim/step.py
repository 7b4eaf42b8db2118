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

import bisect
import math

import numpy as np

from models.cost import CostModel
from models.memory import BLOCK_SIZE
from sim.policies import choose_k
from sim.pricing import VerifyPlan, needs_general
from sim.state import ReplicaState
from sim.tables import add_reduce


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
    """These entries' draft counters from the offsets `sim.fusion.plan_spec_steps` keeps them as,
    in place (each entry once: after this they are counters again)."""
    for e in entries:
        d = C[e] - PS
        nx = NX[e] + V
        PROP[e] = PROP[e] + KS
        ACC[e] = ACC[e] + (d - nx + fix.get(e, 0))
        VER[e] = VER[e] + nx
        VEM[e] = VEM[e] + d


# ------------------------------------------------------------- engine loop
def prefill_budget(budget_max: int, decode_tokens: int) -> int:
    """The step's token budget left for prefill chunks (rule 2): `max_num_batched_tokens` less the
    decoding sequences' tokens (k + 1 each when speculating, a tree's every node: verification
    tokens displace prefill)."""
    return budget_max - decode_tokens


def chunk_tokens(remaining: int, budget: int, alone: bool, chunked: bool) -> int:
    """Tokens of a prefill chunk in a step's token budget: with chunked prefill what is left, up to
    the budget; without, the whole remainder when it fits the budget or goes alone in the step
    (`alone`: the budget is whole; a prompt that must wait is `whole_fits`'s to say)."""
    if not chunked and (alone or remaining <= budget):
        return remaining
    return remaining if remaining < budget else budget


def prefill_chunk(remaining: int, have: int, budget: int, alone: bool, chunked: bool, free: int) -> tuple[int, int]:
    """(tokens, new KV blocks) of a prefill chunk: `chunk_tokens` of what is left, then the blocks
    beyond the `have` tokens of room in those its sequence holds, as many as are free (the chunk
    then shrinks to what they hold)."""
    c = chunk_tokens(remaining, budget, alone, chunked)
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


def reserve_need(C: list[int], R: list[int], entries: list[int], q: int, qv: int, max_len: int) -> int:
    """Rule 1 in scalars: the KV blocks the decoding `entries` (contexts C, tokens left R) take for a
    step verifying q = k + 1 tokens, beyond the ceil(context / B) each holds. A sequence reserves
    one token without drafts (a running sequence always has one left); a tree's every node, qv,
    never past the model's length (vLLM and SGLang reserve slots for the whole tree); else k + 1,
    never past its remaining output. (`reserve_decode` is this rule over the slot arrays;
    tests/test_engine.py holds the two equal.)"""
    B = BLOCK_SIZE
    if q == 1:
        return sum([1 for e in entries if not C[e] % B])
    if qv != q:
        return sum([(C[e] + (qv if qv < max_len - C[e] else max_len - C[e]) + (B - 1)) // B - (C[e] + (B - 1)) // B
                    for e in entries])
    return sum([(C[e] + (q if q < R[e] else R[e]) + (B - 1)) // B - (C[e] + (B - 1)) // B for e in entries])


def new_blocks_first(hist: list[int], S: int) -> list[int]:
    """first[r], r = 0..B: the new KV blocks plain-decoding sequences take over their next r steps,
    from `hist`, their count by (context - S) mod B (a sequence takes a block at the step its
    context passes a multiple of B)."""
    s0 = (-S) % BLOCK_SIZE
    first = [0] * (BLOCK_SIZE + 1)
    acc = 0
    for r in range(BLOCK_SIZE):
        acc += hist[(s0 - r) % BLOCK_SIZE]  # the sequences that take a block at step r + 1
        first[r + 1] = acc
    return first


def blocks_over(n: int, steps: int, first: list[int]) -> int:
    """New KV blocks n plain-decoding sequences take over `steps` steps (`first`: over the first r
    steps of a cycle of B, `new_blocks_first`)."""
    return (steps // BLOCK_SIZE) * n + first[steps % BLOCK_SIZE]


def kv_steps(n: int, m: int, free: int, first: list[int]) -> int:
    """The most plain decode steps of n sequences, up to m, whose new KV blocks are free (a step
    that would need more preempts: the ordinary step's to take): all m when even m // B + 1 blocks
    each fit, else the whole cycles of B steps that fit, then step by step."""
    if n * (m // BLOCK_SIZE + 1) <= free or blocks_over(n, m, first) <= free:
        return m
    s = (free // n) * BLOCK_SIZE
    while s < m and blocks_over(n, s + 1, first) <= free:
        s += 1
    return s


def decode_clock_steps(cost: CostModel, n: int, ctx0: float, d0: float, t: float, m: int, starts_before: float,
                       ends_before: float) -> tuple[int, float, list[float] | np.ndarray]:
    """Of m plain decode steps of n sequences from t, the first at context sum ctx0 lasting d0
    (step j lasts d0 + j x slope: the step cost is affine in the context), how many start before
    `starts_before` (the last may end after it) and all end before `ends_before`, on the unfused
    engine's clock (`CostModel.decode_clock`): (steps, slope, the clock's m + 1 times)."""
    last = m - 1
    slope = (cost.decode_s(n, ctx0 + last * n) - d0) / last if last else 0.0
    st = cost.decode_clock(n, ctx0, t, m)
    k = min(bisect.bisect_left(st, starts_before, 0, m), bisect.bisect_left(st, ends_before, 1, m + 1) - 1)
    return k, slope, st


def prefill_sums_one(chunk: int, ctx: int) -> tuple[float, float, float]:
    """`prefill_sums` of one chunk (the usual case, without lists): the same figures (exact)."""
    tokens, c = float(chunk), float(ctx)
    return tokens, c, tokens * c + 0.5 * (tokens * (tokens + 1.0))


def prefill_sums(chunks: list[int], ctxs: list[int]) -> tuple[float, float, float]:
    """(tokens, contexts, attention pairs) of a step's prefill chunks, chunk c at context x attending
    to c x + c (c + 1) / 2 pairs: what the pricer charges for them (`StepPricer.spec_cost`). The
    sums are of integers, so exact whatever their order."""
    if len(chunks) == 1:  # (the usual case)
        return prefill_sums_one(chunks[0], ctxs[0])
    if len(ctxs) != len(chunks):
        raise ValueError(f"{len(chunks)} prefill chunks, {len(ctxs)} contexts")
    tokens = ctx = cx = cc = 0  # (whole numbers: the same sums in any order; a loop of C ints)
    for i in range(len(chunks)):
        c, x = chunks[i], ctxs[i]
        tokens += c
        ctx += x
        cx += c * x
        cc += c * (c + 1)
    return float(tokens), float(ctx), float(cx) + 0.5 * float(cc)


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
        for j in (~dec).nonzero()[0].tolist():
            if budget <= 0:
                break
            c = fit_chunk(rep, j, budget, budget == full)
            if c <= 0:
                break
            chunk_idx.append(j)
            chunks.append(c)
            budget -= c
    while (admit and budget > 0 and rep.waiting and rep.n_running < rt.max_num_seqs and rep.free_blocks > 0
           and rep.free_blocks >= preload_blocks(rep, rep.waiting[0])):
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


def preload_blocks(rep: ReplicaState, rid: int) -> int:
    """KV blocks a request whose prompt KV arrives from a prefill replica (disaggregated decode,
    `Requests.preloaded`) takes at its first admission: the transferred tokens' and the one it
    computes; 0 for any other request (its admission needs one free block)."""
    pre = rep.reqs.preloaded
    if pre is None or not pre[rid]:
        return 0
    return -(-(int(pre[rid]) + 1) // BLOCK_SIZE)


def fits_whole(rep: ReplicaState, rid: int, budget: int, alone: bool) -> bool:
    """Without chunked prefill: the whole prompt (plus output so far, when recomputing) fits
    in the budget (or goes alone in an empty step) and in the free KV blocks. With a prefix
    cache, only the uncached tokens count, and a hit on unreferenced cached blocks takes them
    from the free capacity."""
    tokens = int(rep.reqs.prompt[rid] + rep.reqs.generated[rid])
    need = -(-tokens // BLOCK_SIZE)
    pre = rep.reqs.preloaded
    if pre is not None:  # the transferred KV is not computed, but takes its blocks
        tokens -= int(pre[rid])
    if rep.cache is not None:
        h, blocks, _, host_blocks = rep.hit_tiers(rid, tokens)
        tokens -= (blocks + host_blocks) * BLOCK_SIZE  # (host-tier blocks are loaded, not computed ...
        need -= blocks  # ... and take free blocks like a fresh allocation)
        if h:  # unreferenced cached blocks of the hit are free capacity the admission takes
            need += rep.cache.evictable_blocks(rep.units(rid)[0][:h])
    return whole_fits(tokens, need, budget, alone, rep.free_blocks)


def fit_chunk(rep: ReplicaState, i: int, budget: int, alone: bool = False) -> int:
    """Largest prefill chunk for entry i within the token budget and the free KV blocks;
    reserves its blocks. Without chunked prefill the whole remainder (which _fits_whole
    checked), even past the budget when it goes alone."""
    remaining = int(rep.target[i] - rep.computed[i])
    have = int(rep.blocks[i]) * BLOCK_SIZE - int(rep.computed[i])  # room in held blocks
    c, extra = prefill_chunk(remaining, have, budget, alone, rep.rt.chunked_prefill, rep.free_blocks)
    if extra:
        rep.blocks[i] += extra
        rep.free_blocks -= extra
    return max(0, c)


class StepPlan:
    """One ordinary step, planned (`plan_step`): its decoding entries (`ds`, `n_dec` of the `n`
    running; `dec` over them), depth k, the suffix matches drawn (`matched`), the verification plan
    of the general methods, its prefill chunks (entries, tokens) and their priced sums, and its
    price (seconds, FLOPs, bytes by part). `decoding`: a decode step (not a prefill step of its
    own), which multi-step scheduling counts; `stalling`: a prefill-only step while sequences
    wait to decode; `empty`: nothing fitted (the youngest sequence was preempted instead)."""

    def __init__(self, n: int, dec: np.ndarray, ds: slice | np.ndarray, n_dec: int, k: int, matched: np.ndarray | None,
                 plan: VerifyPlan | None, chunk_idx: list[int], chunks: list[int], decoding: bool,
                 stalling: bool) -> None:
        self.n, self.dec, self.ds, self.n_dec, self.k, self.matched, self.plan = n, dec, ds, n_dec, k, matched, plan
        self.chunk_idx, self.chunks, self.decoding, self.stalling = chunk_idx, chunks, decoding, stalling
        self.empty = n_dec == 0 and not chunk_idx
        self.pre_tokens = self.pre_ctx = self.pre_pairs = 0.0
        self.total_s = self.target_s = self.draft_s = self.over_s = self.flops = self.nbytes = 0.0

    def row(self, idx: int, start: float, emitted: int, used_blocks: int, waiting: int, gap: float) -> tuple[float, ...]:
        """The step's row of the step table (`sim.tables.STEP_COLUMNS`)."""
        n_pre = len(self.chunk_idx)
        dec_tok = self.n_dec * (self.k + 1) if self.plan is None else self.plan.tokens
        return (idx, start, self.total_s, self.n_dec + n_pre, self.n_dec, self.pre_tokens, dec_tok, emitted, self.k,
                used_blocks, waiting, self.flops, self.nbytes, self.target_s, self.draft_s, self.over_s, gap, 1, 0.0)


def reserve_decode(rep: ReplicaState, k: int, qv: int, matched: np.ndarray | None, dec: np.ndarray,
                   all_dec: bool) -> tuple[np.ndarray, bool]:
    """Rule 1's reservation over the slot arrays: KV blocks for the tokens each decoding sequence
    can write this step (`reserve_need`'s rule, vectorised; with suffix matches one token where none
    matched), preempting the youngest while blocks run short. Returns the decoding flags over the
    sequences left and whether it preempted. (tests/test_engine.py checks it against the scalar rule.)"""
    rt = rep.rt
    q = k + 1
    preempted = False
    n = rep.n_running
    while True:
        grow: int | np.ndarray
        if q == 1:
            grow = 1
        elif qv != q:
            grow = np.minimum(qv, rt.max_model_len - rep.computed[:n])
        elif matched is not None:
            grow = np.where(matched[:n], np.minimum(q, rep.out[:n] - rep.gen[:n]), 1)
        else:
            grow = np.minimum(q, rep.out[:n] - rep.gen[:n])
        need = (rep.computed[:n] + (grow + BLOCK_SIZE - 1)) // BLOCK_SIZE - rep.blocks[:n]
        if not all_dec:
            need *= dec  # blocks for the decoding sequences only
        need_total = int(add_reduce(need))
        if need_total <= rep.free_blocks:
            break
        rep.preempt_youngest()
        preempted = True
        n = rep.n_running
        dec = dec[:n]
    if need_total:
        rep.blocks[:n] += need
        rep.free_blocks -= need_total
    return dec, preempted


def plan_step(rep: ReplicaState, separate: bool, decode_due: bool) -> StepPlan:
    """Rules 0-3 up to the step's price: a prefill step of its own (`separate`, unless multi-step
    scheduling has a decode step due, `decode_due`, and something decodes), or the decode
    reservation (k from the policy) then the prefill chunks in the budget left (mixed prefill; none
    admitted in a step that preempted, as in vLLM v1: the victim, back at the head of the queue,
    would be readmitted into the blocks just taken from it), priced by the replica's pricer. When
    nothing fits, the youngest sequence is preempted and the plan is `empty`."""
    rt = rep.rt
    spec = rt.spec
    budget_max = rt.max_num_batched_tokens
    n = rep.n_running
    dec = rep.computed[:n] >= rep.target[:n]
    all_dec = bool(dec.all())
    chunk_idx: list[int] = []
    chunks: list[int] = []
    if separate and not (decode_due and dec.any()) and prefill_pending(rep):
        # prefill steps of their own, scheduled first (vLLM V0's default scheduler, SGLang):
        # decodes wait while any prompt can be prefilled
        chunk_idx, chunks = plan_prefill(rep, budget_max, dec, True, all_dec)
    plan: VerifyPlan | None = None
    matched = None
    if chunk_idx:
        step = StepPlan(n, dec, slice(0, 0), 0, 0, None, None, chunk_idx, chunks, False, bool(dec.any()))
    else:
        k = choose_k(rep, dec)
        q = k + 1
        general = spec is not None and k > 0 and needs_general(spec)
        qv = spec.verify_tokens(k) if general and spec is not None else q
        if general and spec is not None and spec.on_match:
            # suffix decoding proposes only where the suffix tree has a match this step
            matched = rep.rng.random(n) < rep.reqs.match[rep.rid[:n]]
        dec, preempted = reserve_decode(rep, k, qv, matched, dec, all_dec)
        n = rep.n_running
        n_dec = n if all_dec else int(add_reduce(dec))
        # decoding entries: a slice (a cheap view) when every running sequence decodes
        ds = slice(0, n) if n_dec == n else dec.nonzero()[0]
        plan = (rep.price.verify_plan(rep.computed[ds], k, None if matched is None else matched[:n][ds])
                if general else None)
        if not separate:
            dec_tokens = n_dec * q if plan is None else round(plan.tokens)
            chunk_idx, chunks = plan_prefill(rep, prefill_budget(budget_max, dec_tokens), dec, not preempted, all_dec)
        step = StepPlan(n, dec, ds, n_dec, k, matched, plan, chunk_idx, chunks, True, False)
    if step.empty:
        if rep.n_running:
            rep.preempt_youngest()
        return step
    if chunk_idx:
        step.pre_tokens, step.pre_ctx, step.pre_pairs = prefill_sums(chunks, rep.computed[chunk_idx].tolist())
    ctx_dec = float(add_reduce(rep.computed[step.ds])) if step.n_dec else 0.0
    (step.total_s, step.target_s, step.draft_s, step.over_s, step.flops, step.nbytes) = rep.price.spec_cost(
        step.n_dec, ctx_dec, step.k, len(chunk_idx), step.pre_tokens, step.pre_ctx, step.pre_pairs, plan)
    if rep.reqs.draft_pending is not None and chunk_idx:
        draft_recompute(rep, step)
    if rep.load_s:  # the step waits for its admissions' host-tier loads (`ReplicaState.attach_prefix`)
        step.total_s += rep.load_s
        rep.load_s = 0.0
    return step


def draft_recompute(rep: ReplicaState, step: StepPlan) -> None:
    """A disaggregated decode replica that recomputes the draft's prefill (`draft_prefill =
    "recompute"`): the step of a request's first chunk also runs the draft over the prompt the
    prefill pool sent (`Requests.draft_pending`, from context 0), priced as the draft's prefill."""
    pending = rep.reqs.draft_pending
    assert pending is not None
    rids = rep.rid[step.chunk_idx]
    toks = pending[rids]
    if not toks.any():
        return
    pending[rids] = 0
    nz = toks[toks > 0].tolist()
    d_s, d_f, d_b = rep.price.draft_prefill(len(nz), *prefill_sums(nz, [0] * len(nz)))
    step.total_s += d_s
    step.draft_s += d_s
    step.flops += d_f
    step.nbytes += d_b


def verify_outcomes(rep: ReplicaState, step: StepPlan) -> int:
    """Rule 3's decode results: each decoding sequence emits its accepted drafts + 1 (its
    verification outcome, drawn before the run: `Requests.drafts_accepted`), capped by its tokens
    left, or one token without drafts; the draft counters advance, and blocks reserved for rejected
    drafts are released. Returns the tokens emitted."""
    n, n_dec, ds, k, matched = step.n, step.n_dec, step.ds, step.k, step.matched
    if not n_dec:
        return 0
    spec = rep.rt.spec
    if spec is not None and k > 0 and matched is not None:
        # suffix: sequences without a match decoded one token and verified nothing
        hit = matched[:n][ds]
        acc = np.zeros(n_dec, dtype=np.int64)
        d_hit = np.arange(n)[ds][hit]
        acc[hit] = rep.reqs.drafts_accepted(rep.rid[d_hit], rep.n_verify[d_hit], k)
        emit = np.minimum(acc + 1, rep.out[ds] - rep.gen[ds])
        rep.n_prop[ds] += k * hit
        rep.n_acc[ds] += acc
        rep.n_verify[ds] += hit
        rep.n_vemit[ds] += emit * hit
        emitted = int(add_reduce(emit))
    elif spec is not None and k > 0:
        acc = rep.reqs.drafts_accepted(rep.rid[ds], rep.n_verify[ds], k)
        emit = np.minimum(acc + 1, rep.out[ds] - rep.gen[ds])
        rep.n_prop[ds] += k  # a tree counts its depth (accepted <= proposed), not its nodes
        rep.n_acc[ds] += acc  # drafted tokens the target agreed with (vLLM's count)
        rep.n_verify[ds] += 1
        rep.n_vemit[ds] += emit
        emitted = int(add_reduce(emit))
    else:
        rep.gen[ds] += 1  # one token each: a running sequence always has one left
        rep.computed[ds] += 1
        return n_dec
    rep.gen[ds] += emit
    rep.computed[ds] += emit
    # release blocks reserved for rejected draft tokens
    keep = -(-rep.computed[ds] // BLOCK_SIZE)
    rep.free_blocks += int(add_reduce(rep.blocks[ds] - keep))
    rep.blocks[ds] = keep
    return emitted


def finish_step(rep: ReplicaState, step: StepPlan, now: float) -> int:
    """The step's end (rule 3): decode results (`verify_outcomes`), prefill progress (a prefill
    done samples one token; its full blocks join the prefix cache), and the finished sequences
    leave. Returns the tokens emitted."""
    reqs = rep.reqs
    emitted = verify_outcomes(rep, step)
    for j, chunk in zip(step.chunk_idx, step.chunks, strict=True):  # (entries are distinct)
        rep.computed[j] += chunk
        if rep.cache is not None:  # prefill work done, and its full units join the cache
            reqs.prefill_computed[rep.rid[j]] += chunk
            rep.register(j)
    for j in step.chunk_idx:
        if rep.computed[j] >= rep.target[j]:
            if rep.gen[j] == 0:
                reqs.first_token[rep.rid[j]] = now
            rep.gen[j] += 1
            emitted += 1
    rep.leave(now)
    return emitted
