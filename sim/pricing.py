"""The price of an engine step: seconds, FLOPs and bytes of a step's target pass, draft passes and
speculation machinery, from the replica's cost models (`models.cost.CostModel`). One `StepPricer`
per replica prices every step the engine takes, whichever path takes it (the ordinary step, a
fused run, the rack planner): the scalar forms (`spec_step`, `shape_step`) and the vectorised one
(`spec_cost_many`) are `spec_cost`'s operations in its order, bit for bit."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final, NamedTuple, final

import numpy as np

from models.cost import CostModel
from sim.tables import add_reduce

if TYPE_CHECKING:
    from sim.deployment import ReplicaRuntime

# a fused speculative run of at most this many steps is priced step by step in scalars (measured: 8
# steps of 2 sequences with a draft, 79 us with numpy's arrays, ~3 us a step in scalars)
SPEC_SCALAR_STEPS: Final = 24

@final
class StepParts:
    """`StepPricer.spec_step`'s cached terms for one (batch, k, speculating), as a native class
    (compiled, its fields are C doubles and ints read in place: a tuple's items would be unboxed at
    every step): the step's q and pairs of an empty context, the verification's
    `CostModel.pass_parts`, the target's attention FLOPs per pair, attention peak, KV bytes per
    token, bandwidth and TP; a draft pass's (`has_draft`: half its context growth, its
    `pass_parts`, the same four and TP); the plain decode pass's (`has_plain`: linear, KV written,
    communication, overhead and the same four); the machinery's overhead fraction (`has_frac`) and
    host seconds (`host_s`); `expand`: batch expansion's extra context read (-1: none)."""

    def __init__(self, q: int, pairs0: float, target: tuple[float, float, float, float, float, float, float],
                 apf: float, peak: float, kvb: float, bw: float, tp: int) -> None:
        self.q = q
        self.pairs0 = pairs0
        self.lin, self.kv_w, self.w, self.act, self.comm_s, self.over_s, self.lin_f = target
        self.apf, self.peak, self.kvb, self.bw, self.tp = apf, peak, kvb, bw, tp
        self.has_draft = False
        self.d_half = self.d_lin = self.d_kv_w = self.d_w = self.d_act = self.d_comm = self.d_over = 0.0
        self.d_lin_f = self.d_apf = self.d_peak = self.d_kvb = self.d_bw = 0.0
        self.d_tp = 0
        self.has_plain = False
        self.p_lin = self.p_kv_w = self.p_comm = self.p_over = self.p_apf = self.p_peak = self.p_kvb = self.p_bw = 0.0
        self.has_frac = False
        self.frac = 0.0
        self.host = 0.0
        self.expand = -1.0


@final
class PassTerms:
    """One pass's `CostModel.pass_parts` and the model's constants `CostModel.pass_sums` reads, as a
    native class (C doubles read in place): `sums` is `pass_sums` with its operations in its order."""

    def __init__(self, cost: CostModel, parts: tuple[float, float, float, float, float, float, float]) -> None:
        self.lin, self.kv_w, self.w, self.act, self.comm_s, self.over_s, self.lin_f = parts
        self.apf = cost.attn_flops_per_pair
        self.peak = cost._peak_attn
        self.kvb = cost.kv_bytes_per_token_gpu
        self.bw = cost.bw

    def sums(self, context_tokens: float, attn_pairs: float) -> tuple[float, float, float]:
        """(total_s, flops, bytes) of the pass: `CostModel.pass_sums`, bit for bit."""
        attn_f = self.apf * attn_pairs
        attn_c = attn_f / self.peak
        kv_r = self.kvb * context_tokens
        kv_w = self.kv_w
        attn_m = (kv_r + kv_w) / self.bw
        total = self.lin + (attn_c if attn_c > attn_m else attn_m) + self.comm_s + self.over_s
        return total, self.lin_f + attn_f, self.w + kv_r + kv_w + self.act


@final
class ShapeParts:
    """`StepPricer.shape_step`'s cached terms for one (batch, k, speculating): q and the tile's
    pairs per context-free sequence (`tri`), the verification pass, one draft pass per depth with
    the tokens it runs on (`parents`), the plain decode pass the machinery's overhead is a
    fraction of (None when not speculating), that fraction and the host seconds."""

    def __init__(self, q: int, tri: float, tp: int, target: PassTerms, d_tp: int, depths: list[PassTerms],
                 parents: list[float], plain: PassTerms | None, frac: float, host: float) -> None:
        self.q, self.tri, self.tp, self.target = q, tri, tp, target
        self.d_tp, self.depths, self.parents = d_tp, depths, parents
        self.plain, self.frac, self.host = plain, frac, host


def expanded(n_dec: Any, ctx: Any, q: Any) -> tuple[Any, Any]:
    """Batch expansion (vLLM 0.6, vllm/spec_decode/batch_expansion.py): n decoding sequences
    scored as n q one-token sequences, the j-th of each reading its context + j tokens: (sequences,
    context tokens read)."""
    return n_dec * q, ctx * q + n_dec * q * (q - 1) / 2.0

class VerifyPlan(NamedTuple):
    """The decode part of a speculating step for the methods beyond the plain chain (trees, a
    windowed self-draft, suffix matches): target tokens and attention pairs of the decoding
    sequences, and the sequences that draft with the sum of the draft's contexts."""

    tokens: float
    pairs: float
    n_draft: float
    draft_ctx: float


def plannable(spec: Any) -> bool:
    """Whether a method's steps can be planned ahead in scalars (`sim.fusion.plan_spec_steps`): the chain,
    a depth profile or a token tree; not a windowed self-draft, suffix matches or a host cost."""
    return spec.draft_window is None and not spec.on_match and not spec.host_s_per_seq > 0


def needs_general(spec: Any) -> bool:
    """Whether a method needs the general speculation path (a tree or depth profile, a windowed
    self-draft, suffix matches, a host cost); the plain chain keeps the original formulas."""
    return spec.shape is not None or spec.draft_window is not None or spec.on_match or spec.host_s_per_seq > 0


class StepPricer:
    """Prices one replica's steps (`rt`: its runtime; `idx`: the replica, for step rows).
    `speculating`: speculation on (speculative.policy "follow_load" switches it: `sim.fleet.FollowLoad`);
    off, a step takes the plain decode path and pays no machinery."""

    def __init__(self, rt: ReplicaRuntime, idx: int) -> None:
        self.rt, self.idx = rt, idx
        spec = rt.spec
        self.speculating = True
        self.decay_pows = [spec.decay ** i for i in range(spec.k)] if spec is not None else []
        self._step_parts: dict[int, StepParts] = {}  # `spec_step`'s cached terms, by `spec_step`'s key
        self._shaped = spec is not None and spec.shape is not None  # (`spec_step`: priced by `shape_step`)
        self._shape_parts: dict[int, ShapeParts] = {}  # `shape_step`'s cached terms, by `spec_step`'s key
        self._shape_general: set[int] = set()  # ... and the keys priced pass by pass (`shape_parts` None)
        self._parents_k: dict[int, list[float]] = {}  # `parents`

    def verify_plan(self, computed: np.ndarray, k: int, matched: np.ndarray | None) -> VerifyPlan:
        """Target tokens and attention pairs of the decoding sequences `ds` verifying depth k, and
        who drafts. A tree verifies all its nodes, attention over context + tree under the tree
        mask, charged as the dense (tree tokens x (context + tree tokens)) tile the kernels
        compute; a chain the causal triangle. With suffix matches (`matched`, booleans or expected
        probabilities over `ds`) only matched sequences verify k + 1 tokens, the others decode one."""
        spec = self.rt.spec
        assert spec is not None
        ctx = computed.astype(np.float64)
        n_dec = float(ctx.size)
        ctx_sum = float(add_reduce(ctx))
        q = spec.verify_tokens(k)
        if matched is not None:
            w = np.asarray(matched, dtype=np.float64)
            n_m, ctx_m = float(add_reduce(w)), float(add_reduce(w * ctx))
            tokens = n_dec + k * n_m
            pairs = ctx_sum + n_dec + k * ctx_m + n_m * (q * (q + 1) / 2.0 - 1.0)
            return VerifyPlan(tokens, pairs, n_m, ctx_m)
        tri = q * q if (spec.shape is not None and not spec.shape.chain) else q * (q + 1) / 2.0
        draft_ctx = ctx_sum if spec.draft_window is None else float(add_reduce(np.minimum(ctx, spec.draft_window)))
        return VerifyPlan(n_dec * q, ctx_sum * q + n_dec * tri, n_dec, draft_ctx)

    def draft_sums(self, plan: VerifyPlan, k: int) -> tuple[float, float, float]:
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

    def overhead_frac(self, n_dec: int) -> float:
        """Speculation machinery overhead as a fraction of the plain decode pass of the decoding
        sequences; grows with their number (vLLM #49548 measured TPOT with nothing drafted)."""
        spec = self.rt.spec
        assert spec is not None
        return spec.overhead_frac_at_2 + spec.overhead_frac_per_seq * max(0, n_dec - 2)

    def host_s(self, n_dec: Any, k: Any) -> Any:
        """Host (CPU) seconds a speculating step of `n_dec` decoding sequences at depth k adds to the
        machinery's, serial with the GPU's work: suffix decoding's lookups, per decoding sequence,
        and the output processing of the k drafted tokens beyond the first where the engine runs it
        per token and serially (`SpecRuntime.host_s_per_token`). Every form of the price
        (`spec_cost`, `spec_step`, `shape_step`, `spec_cost_many`, the adaptive policy's) adds it,
        so a host cost that depends on the batch and k alone is written here, once."""
        spec = self.rt.spec
        if spec is None:
            return 0.0
        return spec.host_s_per_seq * n_dec + spec.host_s_per_token * n_dec * k

    def plain_step(self, n_dec: int, ctx_dec: float, n_pre: int, pre_tokens: float, pre_ctx: float,
                   pre_pairs: float) -> tuple[float, float, float]:
        """(total_s, flops, bytes) of a step without speculation: `spec_cost`'s figures, its
        arithmetic in its order, from the cost model's terms cached per batch (`pass_sums`)."""
        cost = self.rt.cost
        assert isinstance(cost, CostModel)
        total, flops, nbytes = cost.pass_sums(n_dec + n_pre, n_dec + pre_tokens, ctx_dec + pre_ctx,
                                              ctx_dec + n_dec * 2 / 2.0 + pre_pairs)
        return total, flops * cost.tp, nbytes * cost.tp

    def draft_prefill(self, n_pre: int, tokens: float, ctx: float, pairs: float) -> tuple[float, float, float]:
        """(seconds, FLOPs, bytes) of the draft's prefill of `tokens` prompt tokens of `n_pre`
        sequences (context sum `ctx`, attention pairs `pairs`: `step.prefill_sums`), over the
        draft's GPUs; no step overhead of its own (it runs inside the target's step)."""
        spec = self.rt.spec
        assert spec is not None and spec.draft_cost is not None
        dc = spec.draft_cost
        d = dc.step_sums(n_pre, tokens, ctx, pairs, step_overhead=False)
        return d.total_s, d.flops * dc.tp, d.bytes * dc.tp

    def spec_cost(self, n_dec: int, ctx_dec: float, k: int, n_pre: int, pre_tokens: float,
                   pre_ctx: float, pre_pairs: float,
                   plan: VerifyPlan | None = None) -> tuple[float, float, float, float, float, float]:
        """(total_s, target_s, draft_s, overhead_s, flops, bytes) of a step; FLOPs and bytes are
        summed over all the replica's GPUs (target and draft). `plan`: the decode part of a
        general method (tree, windowed self-draft, suffix), else the plain chain of k + 1 tokens."""
        rt = self.rt
        q = k + 1
        seqs, ctx_read = n_dec, ctx_dec
        if plan is None:
            tokens = n_dec * q + pre_tokens
            pairs = ctx_dec * q + n_dec * q * (q + 1) / 2.0 + pre_pairs
            if k and rt.spec is not None and rt.spec.batch_expansion:
                # batch expansion (vLLM 0.6, vllm/spec_decode/batch_expansion.py): each decoding
                # sequence runs as k + 1 one-token sequences, the j-th reading its context + j tokens
                seqs, ctx_read = expanded(n_dec, ctx_dec, q)
        else:
            tokens = plan.tokens + pre_tokens
            pairs = plan.pairs + pre_pairs
        tc = rt.cost.step_sums(seqs + n_pre, tokens, ctx_read + pre_ctx, pairs)
        flops, nbytes = tc.flops * rt.cost.tp, tc.bytes * rt.cost.tp
        draft_s = 0.0
        over = 0.0
        spec = rt.spec
        if spec is not None:
            dc = spec.draft_cost
            if dc is not None:
                if k > 0 and n_dec and plan is not None:
                    if plan.n_draft > 0:
                        d_s, d_f, d_b = self.draft_sums(plan, k)
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
                    d_s, d_f, d_b = self.draft_prefill(n_pre, pre_tokens, pre_ctx, pre_pairs)
                    draft_s += d_s
                    flops += d_f
                    nbytes += d_b
            if n_dec and self.speculating:  # follow_load switched off: the plain decode path
                # the machinery (proposer, rejection sampler, bookkeeping) runs on every decoding
                # step of a speculation-enabled engine, also when k = 0. vLLM issue 49548 measured
                # it as a share of TPOT with nothing drafted, i.e. of a plain decode step over the
                # decoding sequences: it is charged on that, never on prefill tokens in the step
                # (`decode_s`: that pass's `step_sums` total, bit for bit, from terms cached per batch)
                plain_s = tc.total_s if (k == 0 and not n_pre) else rt.cost.decode_s(n_dec, ctx_dec)
                over = plain_s * self.overhead_frac(n_dec) + self.host_s(n_dec, k)
        return tc.total_s + draft_s + over, tc.total_s, draft_s, over, flops, nbytes

    def spec_step(self, n_dec: int, ctx: float, k: int) -> tuple[float, float, float, float, float, float]:
        """`spec_cost` of one decode-only step (every sequence decoding, no prefill) at context
        sum `ctx`, in scalars with its operations in its order (bit-identical: the additions of
        an empty prefill, x + 0.0, are x), each pass priced as `CostModel.pass_sums` prices it, inline
        from the terms that depend on the batch and k only (`spec_step_parts`, cached per batch, k
        and whether speculation is on): a short fused run's steps cost less so than with numpy."""
        if k and self._shaped:
            return self.shape_step(n_dec, ctx, k)
        key = (n_dec * 1024 + k) * 2 + self.speculating  # (n_dec, k < 1024, speculating) as one int
        pr = self._step_parts.get(key)
        if pr is None:
            pr = self._step_parts[key] = self.spec_step_parts(n_dec, k)
        # pass_sums of each pass inline, its operations in its order: the target's verification
        # (context ctx, pairs ctx q + n q (q + 1) / 2), k draft passes at the mean draft context,
        # and the plain decode pass the machinery's overhead is a fraction of
        q = pr.q
        expand = pr.expand
        attn_f = pr.apf * (ctx * q + pr.pairs0)
        attn_c = attn_f / pr.peak
        kv_r = pr.kvb * (ctx * q + expand) if expand >= 0.0 else pr.kvb * ctx
        kv_w = pr.kv_w
        attn_m = (kv_r + kv_w) / pr.bw
        total = pr.lin + (attn_c if attn_c > attn_m else attn_m) + pr.comm_s + pr.over_s
        flops = (pr.lin_f + attn_f) * pr.tp
        nbytes = (pr.w + kv_r + kv_w + pr.act) * pr.tp
        draft = 0.0
        if pr.has_draft:
            mean_ctx = ctx + pr.d_half
            d_attn_f = pr.d_apf * (mean_ctx + n_dec)
            d_attn_c = d_attn_f / pr.d_peak
            d_kv_r = pr.d_kvb * mean_ctx
            d_kv_w = pr.d_kv_w
            d_attn_m = (d_kv_r + d_kv_w) / pr.d_bw
            draft = k * (pr.d_lin + (d_attn_c if d_attn_c > d_attn_m else d_attn_m) + pr.d_comm + pr.d_over)
            flops += k * (pr.d_lin_f + d_attn_f) * pr.d_tp
            nbytes += k * (pr.d_w + d_kv_r + d_kv_w + pr.d_act) * pr.d_tp
        step = total + draft
        if not pr.has_frac:
            over = 0.0
        elif pr.has_plain:
            p_attn_c = pr.p_apf * (ctx + n_dec) / pr.p_peak
            p_attn_m = (pr.p_kvb * ctx + pr.p_kv_w) / pr.p_bw
            over = (pr.p_lin + (p_attn_c if p_attn_c > p_attn_m else p_attn_m) + pr.p_comm + pr.p_over) * pr.frac
            over += pr.host
        else:
            over = total * pr.frac + pr.host
        return step + over, total, draft, over, flops, nbytes

    def shape_step(self, n_dec: int, ctx: float, k: int) -> tuple[float, float, float, float, float, float]:
        """`spec_step` for a depth profile or a token tree (k > 0): `spec_cost` of the decode-only
        step with the verification plan `verify_plan` makes (every sequence verifying its q =
        `verify_tokens(k)` tokens, a tree's attention tile q x q) and the draft passes of
        `draft_sums`, each pass priced by `CostModel.pass_sums` (bit-identical to `step_sums`), from
        the terms cached per batch and k (`shape_parts`; `pass_sums` itself where they are not)."""
        key = (n_dec * 1024 + k) * 2 + self.speculating  # (as `spec_step`'s)
        sp = self._shape_parts.get(key)  # (one lookup on the hot path; a miss is rare or uncached)
        if sp is None:
            if key in self._shape_general:
                return self._shape_step(n_dec, ctx, k)
            sp = self.shape_parts(n_dec, k)
            if sp is None:
                self._shape_general.add(key)
                return self._shape_step(n_dec, ctx, k)
            self._shape_parts[key] = sp
        nd = float(n_dec)
        q = sp.q
        total, fl, by = sp.target.sums(ctx + 0.0, (ctx * q + nd * sp.tri) + 0.0)
        flops, nbytes = fl * sp.tp, by * sp.tp
        draft_s = 0.0
        if sp.depths:
            t = f = b = 0.0
            d_tp = sp.d_tp
            parents = sp.parents
            depths = sp.depths
            for i in range(len(depths)):
                p = parents[i]
                c_i = ctx + nd * i
                d_t, d_f, d_b = depths[i].sums(c_i, p * (c_i + nd))
                t += d_t
                f += d_f * d_tp
                b += d_b * d_tp
            draft_s += t
            flops += f
            nbytes += b
        over = 0.0
        plain = sp.plain
        if plain is not None:
            over = plain.sums(ctx, ctx + n_dec)[0] * sp.frac + sp.host
        return total + draft_s + over, total, draft_s, over, flops, nbytes

    def shape_parts(self, n_dec: int, k: int) -> ShapeParts | None:
        """`shape_step`'s terms that depend on the batch and k only, or None where `pass_sums`
        would not take them from its cache (no sequence, a sliding window, batch expansion, a
        depth without tokens)."""
        rt = self.rt
        spec = rt.spec
        cost = rt.cost
        assert spec is not None and spec.shape is not None and isinstance(cost, CostModel)
        dc = spec.draft_cost
        parents = self.parents(k) if dc is not None else []
        if (n_dec <= 0 or spec.batch_expansion or cost.window or (isinstance(dc, CostModel) and dc.window)
                or any(p <= 0.0 for p in parents)):
            return None
        q = spec.verify_tokens(k)
        tri = float(q * q) if not spec.shape.chain else q * (q + 1) / 2.0  # (the same value as `_shape_step`'s)
        nd = float(n_dec)
        target = PassTerms(cost, cost.pass_parts(n_dec, nd * q + 0.0))
        depths: list[PassTerms] = []
        d_tp = 0
        if dc is not None:
            assert isinstance(dc, CostModel)
            d_tp = dc.tp
            depths = [PassTerms(dc, dc.pass_parts(round(nd), nd * p, False)) for p in parents]
        plain = PassTerms(cost, cost.pass_parts(n_dec, n_dec)) if self.speculating else None
        return ShapeParts(q, tri, cost.tp, target, d_tp, depths, parents, plain,
                          self.overhead_frac(n_dec) if self.speculating else 0.0, self.host_s(n_dec, k))

    def _shape_step(self, n_dec: int, ctx: float, k: int) -> tuple[float, float, float, float, float, float]:
        """`shape_step` from `CostModel.pass_sums` pass by pass (where its terms are not cached)."""
        rt = self.rt
        spec = rt.spec
        cost = rt.cost
        assert spec is not None and spec.shape is not None and isinstance(cost, CostModel)
        q = spec.verify_tokens(k)
        tri = q * q if not spec.shape.chain else q * (q + 1) / 2.0
        nd = float(n_dec)
        seqs, ctx_read = n_dec, ctx
        if spec.batch_expansion:  # (`spec_cost`; a batch-expansion engine has no trees: check_scenario)
            seqs, ctx_read = expanded(n_dec, ctx, q)
        total, fl, by = cost.pass_sums(seqs, nd * q + 0.0, ctx_read + 0.0, (ctx * q + nd * tri) + 0.0)
        flops, nbytes = fl * cost.tp, by * cost.tp
        draft_s = 0.0
        dc = spec.draft_cost
        if dc is not None:
            assert isinstance(dc, CostModel)
            t = f = b = 0.0
            for i, p in enumerate(self.parents(k)):
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
            over = cost.pass_sums(n_dec, n_dec, ctx, ctx + n_dec)[0] * self.overhead_frac(n_dec) + self.host_s(n_dec, k)
        return total + draft_s + over, total, draft_s, over, flops, nbytes

    def parents(self, k: int) -> list[float]:
        """Tokens the drafter runs on at each depth 1..k (`DraftShape.parents`), cached per k."""
        got = self._parents_k.get(k)
        if got is None:
            spec = self.rt.spec
            assert spec is not None and spec.shape is not None
            got = self._parents_k[k] = [float(x) for x in spec.shape.parents(k)]
        return got

    def spec_step_parts(self, n_dec: int, k: int) -> StepParts:
        """`spec_step`'s terms that depend on the batch and k only (a fused replica's models have
        no sliding window, `affine_in_context`, so `pass_sums` would take them from its cache)."""
        rt = self.rt
        spec = rt.spec
        cost = rt.cost
        assert spec is not None and isinstance(cost, CostModel)
        dc = spec.draft_cost
        assert not cost.window and not (isinstance(dc, CostModel) and dc.window)
        assert k < 1024  # (`spec_step`'s cache key; the scenario allows num_speculative_tokens <= 16)
        q = k + 1
        # batch expansion (`spec_cost`): n q one-token sequences reading ctx q + `expand` tokens; -1: none
        expand = n_dec * q * (q - 1) / 2.0 if (k and spec.batch_expansion) else -1.0
        pr = StepParts(q, n_dec * q * (q + 1) / 2.0,
                       cost.pass_parts(n_dec * q if expand >= 0.0 else n_dec, n_dec * q + 0.0),
                       cost.attn_flops_per_pair, cost._peak_attn, cost.kv_bytes_per_token_gpu, cost.bw, cost.tp)
        pr.expand = expand
        if dc is not None and k > 0:
            assert isinstance(dc, CostModel)
            pr.has_draft = True
            pr.d_half = n_dec * (k - 1) / 2.0
            (pr.d_lin, pr.d_kv_w, pr.d_w, pr.d_act, pr.d_comm, pr.d_over,
             pr.d_lin_f) = dc.pass_parts(n_dec, n_dec, False)
            pr.d_apf, pr.d_peak, pr.d_kvb, pr.d_bw, pr.d_tp = (dc.attn_flops_per_pair, dc._peak_attn,
                                                               dc.kv_bytes_per_token_gpu, dc.bw, dc.tp)
        if self.speculating and k > 0:
            pl = cost.pass_parts(n_dec, n_dec)
            pr.has_plain = True
            pr.p_lin, pr.p_kv_w, pr.p_comm, pr.p_over = pl[0], pl[1], pl[4], pl[5]
            pr.p_apf, pr.p_peak, pr.p_kvb, pr.p_bw = (cost.attn_flops_per_pair, cost._peak_attn,
                                                      cost.kv_bytes_per_token_gpu, cost.bw)
        if self.speculating:
            pr.has_frac = True
            pr.frac = self.overhead_frac(n_dec)
        pr.host = self.host_s(n_dec, k)
        return pr

    def spec_cost_many(self, n_dec: int, ctx: np.ndarray, k: int) -> tuple[Any, ...]:
        """`spec_cost` of decode-only steps (every sequence decoding, no prefill) at each context
        sum in `ctx`, vectorised, with the same operations in the same order (bit-identical); a
        few steps (SPEC_SCALAR_STEPS) step by step in scalars (`spec_step`: numpy's per-call
        cost dominates arrays that short)."""
        rt = self.rt
        spec = rt.spec
        assert spec is not None and isinstance(rt.cost, CostModel)
        if ctx.size <= SPEC_SCALAR_STEPS:
            cols = list(zip(*[self.spec_step(n_dec, c, k) for c in ctx.tolist()], strict=True))
            if not cols:
                cols = [(), (), (), (), (), ()]
            return tuple(np.array(c, dtype=np.float64) for c in cols)
        q = k + 1
        # (x + 0.0 is x for x >= 0: the ordinary step's additions of its empty prefill are left out)
        pairs = ctx * q + n_dec * q * (q + 1) / 2.0
        if k and spec.batch_expansion:  # (`spec_cost`)
            seqs, ctx_read = expanded(n_dec, ctx, q)
            total, flops, nbytes = rt.cost.step_sums_many(seqs, n_dec * q + 0.0, ctx_read, pairs)
        else:
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
        # follow_load switched off: the plain decode path, no machinery (as `spec_cost`)
        over = plain * self.overhead_frac(n_dec) + self.host_s(n_dec, k) if self.speculating else 0.0 * plain
        return step + over, total, draft, over, flops, nbytes

    def run_row(self, start: float, steps: int, d0: float, slope: float, n: int, ctx0: float,
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
