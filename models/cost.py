"""Step cost: how long one engine step takes, from a roofline of the real model on the real GPU.

One call covers every kind of step. A batch is described per sequence by the tokens it adds this
step (`new_tokens`: a prefill chunk, 1 for plain decode, k+1 for speculative verification) and the
tokens already in its KV cache (`context`). The step is charged

    total_s = max(linear compute, linear memory) + max(attention compute, attention memory)
              + comm_s + overhead_s

    compute_s  = FLOPs / (peak x mfu(tokens))      matmuls: 2 x active params per token,
                                                   attention: 4 x layers x heads x head_dim per
                                                   (query, key) pair, quadratic inside a chunk
    memory_s   = bytes / (HBM bandwidth x bw_eff)   weights once per step (read by all tokens;
                                                   for MoE the routed experts the step's tokens
                                                   touch, `expected_experts`), KV read once per
                                                   sequence (shared by its k+1 verified tokens;
                                                   a sliding-window layer at most its window),
                                                   KV written, activations
    comm_s     = 2 all-reduces per layer (tensor parallel), each latency + ring volume / link;
                 with expert parallelism a MoE layer's second one is an all-to-all pair
    overhead_s = per-layer launch overhead of each forward pass, plus, for an engine step, the
                 per-step overhead and the per-sequence host cost x sequences, or, for a draft
                 pass (`step_overhead=False`), the per-draft-pass overhead

`mfu(tokens) = mfu_max * tokens / (tokens + mfu_half_tokens)`: the linear layers' GEMMs over a
step with few tokens reach a small fraction of peak. Attention kernels work per sequence and are
charged at `mfu_max` (so adding a sequence to a batch can never make a step faster). The factors
come from the engine profile (`models.engines`, fitted by `models.calibration` and
`experiments.calibrate`; docs/CALIBRATION.md).
Everything is per GPU: weights, heads and FLOPs are divided by the tensor-parallel degree.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Final

import numpy as np

from models.catalog import (
    GPU,
    LLM,
    KVFormat,
    WeightFormat,
    get_gpu,
    get_kv_format,
    get_model,
    get_weight_format,
    peak_flops,
    weight_bytes,
)
from models.engines import DEFAULT_PROFILE, Efficiency
from models.engines import efficiency_for as _family_efficiency
from models.errors import ConfigError

__all__ = ["ACT_BYTES", "CostModel", "Efficiency", "ServiceTimeCost", "StepCost", "check_tp", "efficiency_for"]

ACT_BYTES: Final = 2.0  # activations and all-reduce payloads are bf16 in every format we model
# `CostModel.pass_parts`: linear time, KV written, weights, activations, communication, overhead,
# linear FLOPs (a fixed shape: compiled, each item unboxes to a C double)
PassParts = tuple[float, float, float, float, float, float, float]


def expert_inclusion(num_experts: int, k: int, skew: float = 0.0) -> np.ndarray:
    """Probability that one token routes to each expert of a MoE layer (they sum to k).

    Uniform routing (`skew` 0): k / E each. With skew s > 0, expert popularity follows a Zipf law
    p_e ~ e^-s (e = 1..E) and a token picks a fixed-size sample of k distinct experts with
    inclusion probabilities pi_e = k p_e, capped at 1 with the excess spread over the others in
    proportion (a sample with exactly these inclusion probabilities exists: systematic sampling,
    which tests/test_moe.py draws). An assumption, stated in docs/MODEL.md: real routers are
    skewed per layer and per domain; s is a what-if input (`deployment.moe_routing_skew`)."""
    if num_experts < 1 or not 1 <= k <= num_experts:
        raise ConfigError(f"experts per token must be in 1..{num_experts}, got {k}")
    if skew < 0 or not np.isfinite(skew):
        raise ConfigError(f"moe_routing_skew must be >= 0, got {skew}")
    p = np.arange(1, num_experts + 1, dtype=np.float64) ** -float(skew)
    pi = k * p / p.sum()
    for _ in range(num_experts):  # cap at 1, redistribute the excess (terminates: one more expert capped each pass)
        over = pi > 1.0
        if not over.any():
            break
        free = ~over & (pi < 1.0)
        excess = (pi[over] - 1.0).sum()
        pi[over] = 1.0
        pi[free] += excess * pi[free] / pi[free].sum()
    return pi


def expected_experts(tokens: float | np.ndarray, num_experts: int, k: int, skew: float = 0.0) -> float | np.ndarray:
    """Expected distinct experts of one MoE layer touched by `tokens` tokens, each routed to k of
    E experts independently of the others:

        E[touched] = sum_e 1 - (1 - pi_e)^T,   uniform: E (1 - (1 - k/E)^T)

    Derivation: expert e is missed by one token with probability C(E-1, k)/C(E, k) = 1 - k/E
    (uniform; 1 - pi_e in general), by T independent tokens with that to the power T; linearity of
    expectation sums the indicator "touched" over the experts. Exact for sampling without
    replacement inside a token (only the marginal pi_e enters). Monotone in T, from k at T = 1 to
    E as T grows (the weights of all experts are then read)."""
    pi = expert_inclusion(num_experts, k, skew)
    t = np.asarray(tokens, dtype=np.float64)
    if skew == 0.0:
        out = num_experts * (1.0 - (1.0 - k / num_experts) ** t)
    else:
        out = (1.0 - (1.0 - pi)[:, None] ** t.reshape(1, -1)).sum(axis=0).reshape(t.shape)
    return float(out) if np.ndim(out) == 0 else out


@dataclass(init=False)
class StepCost:
    """Typed breakdown of one forward pass (or one engine step). Units in the names. A value: never
    changed once built. (Its `__init__` is written out, not generated, and it is not `frozen`: in
    the compiled build (models/_native.py) a dataclass's generated `__init__` runs interpreted,
    and a frozen one's 11 `object.__setattr__` calls per step were a tenth of a compiled closed
    loop's CPU.)"""

    flops: float
    weight_bytes: float
    kv_read_bytes: float
    kv_write_bytes: float
    act_bytes: float
    compute_s: float
    memory_s: float
    comm_s: float
    overhead_s: float
    total_s: float
    seq_overhead_s: float  # the per-sequence host cost inside overhead_s

    def __init__(self, flops: float, weight_bytes: float, kv_read_bytes: float, kv_write_bytes: float,
                 act_bytes: float, compute_s: float, memory_s: float, comm_s: float, overhead_s: float,
                 total_s: float, seq_overhead_s: float = 0.0) -> None:
        self.flops = flops
        self.weight_bytes = weight_bytes
        self.kv_read_bytes = kv_read_bytes
        self.kv_write_bytes = kv_write_bytes
        self.act_bytes = act_bytes
        self.compute_s = compute_s
        self.memory_s = memory_s
        self.comm_s = comm_s
        self.overhead_s = overhead_s
        self.total_s = total_s
        self.seq_overhead_s = seq_overhead_s

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_read_bytes + self.kv_write_bytes + self.act_bytes

    def as_dict(self) -> dict[str, float]:
        d = {f: getattr(self, f) for f in STEP_COST_FIELDS}
        d["bytes"] = self.bytes
        return d


STEP_COST_FIELDS = tuple(f.name for f in dataclasses.fields(StepCost))


def efficiency_for(gpu: GPU, engine: str = DEFAULT_PROFILE) -> Efficiency:
    """The calibrated efficiency of this GPU's family under an engine profile (models.engines)."""
    return _family_efficiency(gpu.family, engine)


# `CostModel.decode_clock`: a run of at most this many steps is summed in scalars, a longer one by numpy
DECODE_CLOCK_SCALAR: Final = 64
_STEPS = np.arange(1 << 13, dtype=np.float64)  # 0, 1, 2, ...: twice the longest run a fused planner asks for (4,096 steps)


class CostModel:
    """Step-cost calculator for one deployment: model x formats x GPU x tensor parallelism.

    Construction precomputes per-GPU constants; `step()` and `step_sums()` are cheap enough to
    call once per simulated engine step.
    """

    def __init__(
        self,
        model: LLM | str,
        gpu: GPU | str,
        tp: int = 1,
        weights: WeightFormat | str = "bf16",
        kv_cache: KVFormat | str = "bf16",
        efficiency: Efficiency | None = None,
        engine: str = DEFAULT_PROFILE,
        *,
        moe_routing_skew: float = 0.0,
        expert_parallel: bool = False,
    ) -> None:
        self.model = get_model(model) if isinstance(model, str) else model
        self.gpu = get_gpu(gpu) if isinstance(gpu, str) else gpu
        self.weights = get_weight_format(weights) if isinstance(weights, str) else weights
        self.kv = get_kv_format(kv_cache) if isinstance(kv_cache, str) else kv_cache
        self.tp = check_tp(self.model, tp)
        self.eff = efficiency or efficiency_for(self.gpu, engine)
        m, g, e = self.model, self.gpu, self.eff

        self.peak = peak_flops(g, self.weights)
        self.mfu_max = e.mfu_max if self.weights.name == "bf16" else e.mfu_max_quant
        self.bw = g.mem_bw_bytes_s * e.bw_eff
        # weights per GPU; for MoE the routed experts are split out (only touched experts are read):
        # expert bytes per GPU x expected touched fraction (expected_experts / E), the same mean with
        # experts sharded by tensor parallelism (each GPU a 1/tp slice of every expert) and with
        # expert parallelism (each GPU E/tp whole experts)
        total_w = weight_bytes(m, self.weights) / tp
        expert_w = m.expert_params * self.weights.bytes_per_param / tp
        self.dense_weight_bytes = total_w - expert_w
        self.expert_weight_bytes = expert_w
        self.weight_bytes_per_gpu = total_w
        self.moe_routing_skew = float(moe_routing_skew)
        self.expert_parallel = bool(expert_parallel) and m.num_experts > 0
        self._miss = (1.0 - expert_inclusion(m.num_experts, m.experts_per_token, moe_routing_skew)
                      if m.num_experts else np.zeros(0))
        self._uniform_miss = 1.0 - m.experts_per_token / m.num_experts if m.num_experts else 1.0
        self.flops_per_token = 2.0 * m.matmul_params_active * self.weights.dequant_flops_factor / tp
        # attention FLOPs per (query, key) pair: q.k and p.v over head_dim for every head; MLA in its
        # absorbed form (the decode kernels: FlashMLA, vLLM/SGLang) scores against the latent
        # (kv_lora_rank + rope dims) and reads values from it (kv_lora_rank)
        per_head = 2.0 * (2 * m.kv_lora_rank + m.qk_rope_head_dim) if m.mla else 4.0 * m.head_dim
        self.attn_flops_per_pair = m.num_layers * m.num_heads * per_head / tp
        # KV per token per GPU: GQA heads are split by TP (replicated when tp > kv_heads); the MLA
        # latent is shared by all heads, so every GPU holds all of it
        kv_heads_gpu = max(1.0, m.num_kv_heads / tp)
        layer_elems = m.kv_elements_per_token_layer() if m.mla else 2 * kv_heads_gpu * m.head_dim
        layer_bytes = layer_elems * self.kv.bytes_per_element
        # sliding-window layers keep (and read) at most `window` tokens of each sequence
        self.window = m.sliding_window if m.num_sliding_layers else 0
        n_win = m.num_sliding_layers if self.window else 0
        self.kv_win_bytes_per_token_gpu = n_win * layer_bytes
        self.kv_full_bytes_per_token_gpu = (m.num_layers - n_win) * layer_bytes
        # paged blocks hold the full-attention layers' KV (all layers' when every layer is windowed);
        # the windowed layers' is bounded per sequence (window_kv_bytes)
        self.kv_bytes_per_token_gpu = self.kv_full_bytes_per_token_gpu or self.kv_win_bytes_per_token_gpu
        self._win_in_blocks = self.kv_full_bytes_per_token_gpu == 0.0
        self.kv_write_bytes_per_token_gpu = self.kv_full_bytes_per_token_gpu + self.kv_win_bytes_per_token_gpu
        self.attn_win_flops_per_pair = self.attn_flops_per_pair * n_win / m.num_layers
        self.attn_full_flops_per_pair = self.attn_flops_per_pair - self.attn_win_flops_per_pair
        # activation traffic per token: replicated hidden-size tensors (norms, residual) plus the
        # sharded projections' inputs and outputs, read once and written once; a MoE layer's MLP
        # activations are those of its k routed and shared experts
        d = m.hidden_size
        ff: float = float(m.intermediate_size)
        if m.num_experts:
            moe_ff = (m.experts_per_token + m.num_shared_experts) * m.expert_ff
            ff = (m.num_dense_layers * m.intermediate_size + m.moe_layers * moe_ff) / m.num_layers
        q_kv = (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
        self.act_bytes_per_token = m.num_layers * ACT_BYTES * (4 * d + (q_kv + d + 3 * ff + d * 2) / tp)
        # tensor parallel: 2 all-reduces per layer. Expert parallel: a MoE layer's second one is an
        # all-to-all dispatch plus combine instead: each GPU sends its 1/tp share of the tokens to
        # the other GPUs holding their k experts (deduplicated per GPU, as DeepEP does) and back
        self.n_allreduce = 0 if tp == 1 else 2 * m.num_layers
        self.ring_factor = 2.0 * (tp - 1) / tp
        self.n_alltoall = 0
        self.a2a_factor = 0.0
        if self.expert_parallel and tp > 1:
            ex, k, per = m.num_experts, m.experts_per_token, m.num_experts // tp
            # P(a token sends nothing to a given other GPU) = C(E - E/tp, k) / C(E, k)
            miss = float(np.prod([(ex - per - i) / (ex - i) for i in range(k)])) if ex - per >= k else 0.0
            self.n_allreduce -= m.moe_layers
            self.n_alltoall = 2 * m.moe_layers
            self.a2a_factor = (tp - 1) * (1.0 - miss) / tp
        self.comm_bw = g.interconnect_bytes_s * e.comm_eff
        self.pass_overhead_s = m.num_layers * e.layer_overhead_s
        self._peak_attn = self.peak * self.mfu_max  # the attention kernels' compute roofline (step_sums)
        self._decode_parts: dict[int, tuple[float, float, float, float]] = {}  # decode_s's per-batch-size terms
        self._pass_parts: dict[tuple[int, float, bool], PassParts] = {}  # pass_sums's per-(batch, tokens) terms
        self._run_bytes: dict[float, float] = {}  # run_sums's per-step bytes but the KV read, per tokens

    # ------------------------------------------------------------------ MoE, windows
    @property
    def affine_in_context(self) -> bool:
        """Whether a step's duration is affine in the batch's context at a fixed batch (what step
        fusion assumes); a sliding window bounds the KV read per sequence, which is not."""
        return not self.window

    def touched_fraction(self, tokens: float) -> float:
        """Expected share of a MoE layer's routed experts that `tokens` tokens touch (0 for dense)."""
        if not self.expert_weight_bytes:
            return 0.0
        if self.moe_routing_skew == 0.0:
            return 1.0 - self._uniform_miss ** tokens
        return float((1.0 - self._miss ** tokens).sum()) / self._miss.size

    def _touched_many(self, t: np.ndarray) -> np.ndarray:
        if self.moe_routing_skew == 0.0:
            return 1.0 - self._uniform_miss ** t
        return (1.0 - self._miss[:, None] ** t.reshape(1, -1)).sum(axis=0).reshape(t.shape) / self._miss.size

    def _weights_read(self, tokens: float) -> float:
        w = self.dense_weight_bytes
        if self.expert_weight_bytes:
            w += self.expert_weight_bytes * self.touched_fraction(tokens)
        return w

    def _kv_read(self, num_seqs: float, context_tokens: float) -> float:
        """KV bytes read: full layers the whole context, windowed layers at most `window` tokens of
        each sequence (min(context, sequences x window): exact when all sequences are on one side of
        the window, an upper bound otherwise)."""
        if not self.window:
            return self.kv_bytes_per_token_gpu * context_tokens
        win = min(context_tokens, num_seqs * self.window)
        return self.kv_full_bytes_per_token_gpu * context_tokens + self.kv_win_bytes_per_token_gpu * win

    def _attn_flops(self, tokens: float, attn_pairs: float) -> float:
        if not self.window:
            return self.attn_flops_per_pair * attn_pairs
        return (self.attn_full_flops_per_pair * attn_pairs
                + self.attn_win_flops_per_pair * min(attn_pairs, tokens * self.window))

    def _comm_s(self, tokens: float) -> float:
        if not self.n_allreduce and not self.n_alltoall:
            return 0.0
        e = self.eff
        payload = tokens * self.model.hidden_size * ACT_BYTES
        comm = self.n_allreduce * (e.allreduce_latency_s + self.ring_factor * payload / self.comm_bw)
        if self.n_alltoall:
            comm += self.n_alltoall * (e.allreduce_latency_s + self.a2a_factor * payload / self.comm_bw)
        return comm

    def window_kv_bytes(self, num_seqs: int) -> float:
        """KV bytes per GPU the windowed layers hold for `num_seqs` sequences at most (their whole
        windows), reserved by the memory planner apart from the paged blocks."""
        if not self.window or self._win_in_blocks:
            return 0.0
        return self.kv_win_bytes_per_token_gpu * self.window * num_seqs

    # ------------------------------------------------------------------ core
    def step_sums(
        self,
        num_seqs: int,
        tokens: float,
        context_tokens: float,
        attn_pairs: float,
        *,
        step_overhead: bool = True,
    ) -> StepCost:
        """Cost from the batch's sums: sequences, new tokens, cached tokens read, and attention
        (query, key) pairs = sum(new * context + new * (new + 1) / 2)."""
        if tokens <= 0:
            return _ZERO
        e = self.eff
        # the common case (dense, no window, TP) inline: this runs once per engine step
        attn_f = self._attn_flops(tokens, attn_pairs) if self.window else self.attn_flops_per_pair * attn_pairs
        flops = self.flops_per_token * tokens + attn_f
        w = self.dense_weight_bytes
        if self.expert_weight_bytes:
            w += self.expert_weight_bytes * self.touched_fraction(tokens)
        kv_r = self._kv_read(num_seqs, context_tokens) if self.window else self.kv_bytes_per_token_gpu * context_tokens
        kv_w = self.kv_write_bytes_per_token_gpu * tokens
        act = self.act_bytes_per_token * tokens
        mfu = self.mfu_max * tokens / (tokens + e.mfu_half_tokens)
        # two kernel classes, each its own roofline: the linear layers (weights, activations) and
        # attention (KV cache); a step is the sum, since they run one after the other
        lin_c = self.flops_per_token * tokens / (self.peak * mfu)
        attn_c = attn_f / (self.peak * self.mfu_max)  # per-sequence kernels
        lin_m = (w + act) / self.bw
        attn_m = (kv_r + kv_w) / self.bw
        compute_s = lin_c + attn_c
        memory_s = lin_m + attn_m
        busy = (lin_c if lin_c > lin_m else lin_m) + (attn_c if attn_c > attn_m else attn_m)
        comm_s = self._comm_s(tokens) if self.n_allreduce else 0.0
        seq_s = e.seq_overhead_s * num_seqs if step_overhead else 0.0
        overhead_s = self.pass_overhead_s + (e.step_overhead_s if step_overhead else e.draft_pass_overhead_s) + seq_s
        total = busy + comm_s + overhead_s
        return StepCost(flops, w, kv_r, kv_w, act, compute_s, memory_s, comm_s, overhead_s, total, seq_s)

    def step_sums_many(self, num_seqs: int, tokens: float, context_tokens: np.ndarray, attn_pairs: np.ndarray,
                       *, step_overhead: bool = True, totals: bool = False) -> tuple[np.ndarray, ...]:
        """(total_s, flops, bytes) of `step_sums` for steps that differ only in their context and
        attention pairs (float arrays), with the same floating-point operations in the same order
        (bit-identical): a fused run of speculative steps prices all its steps in one call.
        `totals`: (total_s,) only."""
        ctx, pairs = context_tokens, attn_pairs
        if tokens <= 0:
            return (np.zeros_like(ctx),) if totals else (np.zeros_like(ctx),) * 3
        m, e = self.model, self.eff
        w = self.dense_weight_bytes
        if self.expert_weight_bytes:
            touched = 1.0 - (1.0 - m.experts_per_token / m.num_experts) ** tokens
            w += self.expert_weight_bytes * touched
        kv_r = self.kv_bytes_per_token_gpu * ctx
        kv_w = self.kv_bytes_per_token_gpu * tokens
        act = self.act_bytes_per_token * tokens
        mfu = self.mfu_max * tokens / (tokens + e.mfu_half_tokens)
        lin_c = self.flops_per_token * tokens / (self.peak * mfu)
        attn_c = self.attn_flops_per_pair * pairs / (self.peak * self.mfu_max)
        lin_m = (w + act) / self.bw
        attn_m = (kv_r + kv_w) / self.bw
        busy = np.maximum(attn_c, attn_m)  # max(a, b) is b when a <= b, as the scalar branch
        busy += lin_c if lin_c > lin_m else lin_m  # a + b == b + a: IEEE addition commutes
        if self.n_allreduce:
            payload = tokens * m.hidden_size * ACT_BYTES
            comm_s = self.n_allreduce * (e.allreduce_latency_s + self.ring_factor * payload / self.comm_bw)
        else:
            comm_s = 0.0
        seq_s = e.seq_overhead_s * num_seqs if step_overhead else 0.0
        overhead_s = self.pass_overhead_s + (e.step_overhead_s if step_overhead else e.draft_pass_overhead_s) + seq_s
        busy += comm_s
        busy += overhead_s
        if totals:
            return (busy,)
        flops = self.flops_per_token * tokens + self.attn_flops_per_pair * pairs
        kv_r += w
        kv_r += kv_w
        kv_r += act
        return busy, flops, kv_r

    def total_s_many(self, num_seqs: int, tokens: np.ndarray, context_tokens: np.ndarray, attn_pairs: np.ndarray,
                     *, step_overhead: bool = True) -> np.ndarray:
        """`step_sums(...).total_s` for many candidate steps at once (same formula, vectorised):
        the adaptive speculation policy prices every k in one call."""
        m, e = self.model, self.eff
        t = np.maximum(np.asarray(tokens, dtype=np.float64), 1e-12)
        w = np.full_like(t, self.dense_weight_bytes)
        if self.expert_weight_bytes:
            w = w + self.expert_weight_bytes * self._touched_many(t)
        mfu = self.mfu_max * t / (t + e.mfu_half_tokens)
        lin = np.maximum(self.flops_per_token * t / (self.peak * mfu), (w + self.act_bytes_per_token * t) / self.bw)
        pairs = np.asarray(attn_pairs, dtype=np.float64)
        ctx = np.asarray(context_tokens, dtype=np.float64)
        if self.window:
            attn_f = self.attn_full_flops_per_pair * pairs + self.attn_win_flops_per_pair * np.minimum(pairs, t * self.window)
            kv = (self.kv_full_bytes_per_token_gpu * ctx + self.kv_win_bytes_per_token_gpu * np.minimum(ctx, num_seqs * self.window)
                  + (self.kv_full_bytes_per_token_gpu + self.kv_win_bytes_per_token_gpu) * t)
        else:
            attn_f = self.attn_flops_per_pair * pairs
            kv = self.kv_bytes_per_token_gpu * (ctx + t)
        attn = np.maximum(attn_f / (self.peak * self.mfu_max), kv / self.bw)
        payload = t * m.hidden_size * ACT_BYTES
        comm = (self.n_allreduce * (e.allreduce_latency_s + self.ring_factor * payload / self.comm_bw)
                if self.n_allreduce else 0.0)
        if self.n_alltoall:
            comm = comm + self.n_alltoall * (e.allreduce_latency_s + self.a2a_factor * payload / self.comm_bw)
        over = self.pass_overhead_s + (e.step_overhead_s + e.seq_overhead_s * num_seqs if step_overhead
                                       else e.draft_pass_overhead_s)
        return np.where(np.asarray(tokens) > 0, lin + attn + comm + over, 0.0)

    def decode_clock(self, num_seqs: int, context_tokens: float, t: float, steps: int) -> list[float] | np.ndarray:
        """t and the running sums t + d_0, t + d_0 + d_1, ... (steps + 1 times) of plain decode
        steps of `num_seqs` sequences, the first at context sum `context_tokens` and each next one
        num_seqs tokens longer: d_j is `decode_s` bit for bit and the sums are taken in order, one
        rounding per step, as a clock that adds each step's duration in turn (SimPy's). Its
        operations are `decode_s`'s, the parts that depend on the batch only taken once; where the
        same branch of the attention roofline wins at both ends by a margin no rounding closes
        (their difference is affine in the context) only that branch is evaluated. A list in
        scalars up to DECODE_CLOCK_SCALAR steps, an array by numpy beyond (in place: its per-call
        cost dominates short runs)."""
        n = num_seqs
        if n <= 0 or self.window or steps < 1:
            out = [t]
            for j in range(steps):
                out.append(out[-1] + self.decode_s(n, context_tokens + j * n))
            return out
        parts = self._decode_parts.get(n)
        if parts is None:
            parts = self._decode_parts[n] = self._decode_parts_of(n)
        lin, kv_w, comm_s, overhead_s = parts
        apf, peak, kvb, bw = self.attn_flops_per_pair, self._peak_attn, self.kv_bytes_per_token_gpu, self.bw
        c0, c1 = context_tokens, context_tokens + (steps - 1) * n
        gap0 = apf * (c0 + n) / peak - (kvb * c0 + kv_w) / bw
        gap1 = apf * (c1 + n) / peak - (kvb * c1 + kv_w) / bw
        tol = 1e-9 * (lin + comm_s + overhead_s + abs(gap0) + abs(gap1))
        branch = 1 if (gap0 > tol and gap1 > tol) else -1 if (gap0 < -tol and gap1 < -tol) else 0
        if steps <= DECODE_CLOCK_SCALAR:
            out = [t]
            s, c = t, c0
            if branch < 0:  # memory-bound at every step (decode's usual case)
                for _ in range(steps):
                    s = s + (lin + (kvb * c + kv_w) / bw + comm_s + overhead_s)
                    out.append(s)
                    c = c + n
            elif branch > 0:
                for _ in range(steps):
                    s = s + (lin + apf * (c + n) / peak + comm_s + overhead_s)
                    out.append(s)
                    c = c + n
            else:
                for _ in range(steps):
                    a, b = apf * (c + n) / peak, (kvb * c + kv_w) / bw
                    s = s + (lin + (a if a > b else b) + comm_s + overhead_s)
                    out.append(s)
                    c = c + n
            return out
        ctx = (_STEPS[:steps] if steps <= _STEPS.size else np.arange(steps, dtype=np.float64)) * n
        ctx += context_tokens
        if branch < 0:
            ctx *= kvb
            ctx += kv_w
            ctx /= bw
            attn = ctx
        elif branch > 0:
            ctx += n
            ctx *= apf
            ctx /= peak
            attn = ctx
        else:
            attn = np.maximum(apf * (ctx + n) / peak, (kvb * ctx + kv_w) / bw)
        st = np.empty(steps + 1, dtype=np.float64)
        st[0] = t
        d = st[1:]
        np.add(lin, attn, out=d)
        d += comm_s
        d += overhead_s
        return np.cumsum(st, out=st)

    def decode_s(self, num_seqs: int, context_tokens: float) -> float:
        """The duration of a plain decode step (one new token per sequence): `step_sums` itself,
        so a fused run's first and last step are priced exactly as the ordinary step. Without a
        sliding window the parts that depend on the batch size only (the linear layers' roofline,
        communication, overheads, the KV written) are cached per batch size and the attention
        roofline is evaluated with `step_sums`'s own operations in its order (bit-identical;
        tests/test_fusion.py), about 5x cheaper than building a StepCost."""
        if num_seqs <= 0 or self.window:
            return self.step_sums(num_seqs, num_seqs + 0.0, context_tokens, context_tokens + num_seqs).total_s
        parts = self._decode_parts.get(num_seqs)
        if parts is None:
            parts = self._decode_parts[num_seqs] = self._decode_parts_of(num_seqs)
        lin, kv_w, comm_s, overhead_s = parts
        attn_c = self.attn_flops_per_pair * (context_tokens + num_seqs) / self._peak_attn
        attn_m = (self.kv_bytes_per_token_gpu * context_tokens + kv_w) / self.bw
        return lin + (attn_c if attn_c > attn_m else attn_m) + comm_s + overhead_s

    def pass_sums(self, num_seqs: int, tokens: float, context_tokens: float, attn_pairs: float,
                  step_overhead: bool = True) -> tuple[float, float, float]:
        """(total_s, flops, bytes) of `step_sums`, with its operations in its order (bit-identical;
        tests/test_cost.py), for a cost model without a sliding window: the terms that depend on
        the batch's sequences and new tokens only are cached per (sequences, tokens, overhead)
        (fused runs price their mixed steps and short speculative runs with it: the same batch
        recurs, and building a StepCost, or numpy over a few steps, costs more than the arithmetic)."""
        if tokens <= 0 or self.window:
            tc = self.step_sums(num_seqs, tokens, context_tokens, attn_pairs, step_overhead=step_overhead)
            return tc.total_s, tc.flops, tc.bytes
        lin, kv_w, w, act, comm_s, overhead_s, lin_f = self.pass_parts(num_seqs, tokens, step_overhead)
        attn_f = self.attn_flops_per_pair * attn_pairs
        attn_c = attn_f / self._peak_attn
        kv_r = self.kv_bytes_per_token_gpu * context_tokens
        attn_m = (kv_r + kv_w) / self.bw
        total = lin + (attn_c if attn_c > attn_m else attn_m) + comm_s + overhead_s
        return total, lin_f + attn_f, w + kv_r + kv_w + act

    def pass_parts(self, num_seqs: int, tokens: float, step_overhead: bool = True) -> PassParts:
        """`pass_sums`'s cached terms of a pass that depend on its sequences and new tokens only
        (tokens > 0, no sliding window): max(linear compute, linear memory) as `step_sums` takes
        it, KV written, weights, activations, communication, overhead, linear FLOPs."""
        key = (num_seqs, tokens, step_overhead)
        parts = self._pass_parts.get(key)
        if parts is None:
            if len(self._pass_parts) >= 4096:
                self._pass_parts.clear()
            tc = self.step_sums(num_seqs, tokens, 0.0, 0.0, step_overhead=step_overhead)
            e = self.eff
            mfu = self.mfu_max * tokens / (tokens + e.mfu_half_tokens)
            lin_c = self.flops_per_token * tokens / (self.peak * mfu)
            lin_m = (tc.weight_bytes + tc.act_bytes) / self.bw
            lin = lin_c if lin_c > lin_m else lin_m
            parts = self._pass_parts[key] = (lin, tc.kv_write_bytes, tc.weight_bytes, tc.act_bytes, tc.comm_s,
                                             tc.overhead_s, self.flops_per_token * tokens)
        return parts

    def _decode_parts_of(self, num_seqs: int) -> tuple[float, float, float, float]:
        """`step_sums`'s batch-size-only terms of a plain decode step of `num_seqs` sequences:
        max(linear compute, linear memory), KV bytes written, communication, overhead."""
        tokens = num_seqs + 0.0
        e = self.eff
        w = self.dense_weight_bytes
        if self.expert_weight_bytes:
            w += self.expert_weight_bytes * self.touched_fraction(tokens)
        act = self.act_bytes_per_token * tokens
        mfu = self.mfu_max * tokens / (tokens + e.mfu_half_tokens)
        lin_c = self.flops_per_token * tokens / (self.peak * mfu)
        lin_m = (w + act) / self.bw
        comm_s = self._comm_s(tokens) if self.n_allreduce else 0.0
        overhead_s = self.pass_overhead_s + e.step_overhead_s + e.seq_overhead_s * num_seqs
        return (lin_c if lin_c > lin_m else lin_m), self.kv_write_bytes_per_token_gpu * tokens, comm_s, overhead_s

    def run_sums(self, tokens: float, context_sum: float, pairs_sum: float, steps: int) -> tuple[float, float]:
        """(FLOPs, bytes) summed over `steps` engine steps of `tokens` new tokens each, whose
        contexts and attention pairs sum to `context_sum` and `pairs_sum` (per GPU; the step
        formulas are linear in both, without a sliding window: `affine_in_context`)."""
        per_step = self._run_bytes.get(tokens)  # a step's bytes but the KV read: its tokens only
        if per_step is None:
            if len(self._run_bytes) >= 4096:
                self._run_bytes.clear()
            w = self._weights_read(tokens)  # the experts a step touches depend on its tokens, not the context
            per_step = self._run_bytes[tokens] = w + (self.kv_bytes_per_token_gpu + self.act_bytes_per_token) * tokens
        flops = steps * self.flops_per_token * tokens + self.attn_flops_per_pair * pairs_sum
        nbytes = steps * per_step + self.kv_bytes_per_token_gpu * context_sum
        return flops, nbytes

    def step(self, new_tokens: np.ndarray | list[int], context: np.ndarray | list[int], *, step_overhead: bool = True) -> StepCost:
        """Cost of one forward pass over a batch: per sequence, new tokens and cached tokens."""
        n = np.asarray(new_tokens, dtype=np.float64)
        c = np.asarray(context, dtype=np.float64)
        if n.shape != c.shape:
            raise ConfigError("new_tokens and context must have one entry per sequence")
        if n.size and (n.min() < 0 or c.min() < 0):
            raise ConfigError("new_tokens and context must be >= 0")
        pairs = float((n * c).sum() + 0.5 * (n * (n + 1.0)).sum())
        return self.step_sums(int(np.count_nonzero(n)), float(n.sum()), float(c[n > 0].sum()), pairs, step_overhead=step_overhead)

    def uniform(self, batch: int, context: int, new_tokens: int = 1, *, step_overhead: bool = True) -> StepCost:
        """Cost of a batch of identical sequences (the what-if calculator's case)."""
        if batch < 0 or context < 0 or new_tokens < 0:
            raise ConfigError(f"batch, context and new_tokens must be >= 0, got {batch}, {context}, {new_tokens}")
        pairs = batch * (new_tokens * context + new_tokens * (new_tokens + 1) / 2)
        return self.step_sums(batch, batch * new_tokens, batch * context, pairs, step_overhead=step_overhead)


_ZERO = StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)


def check_tp(model: LLM, tp: int) -> int:
    """Tensor-parallel degree must be >= 1 and divide the attention heads (and the KV heads, or
    be a multiple of them, in which case KV heads are replicated)."""
    if not isinstance(tp, (int, np.integer)) or tp < 1:
        raise ConfigError(f"tensor_parallel must be a positive integer, got {tp!r}")
    valid = [d for d in range(1, 17)
             if model.num_heads % d == 0 and (model.num_kv_heads % d == 0 or d % model.num_kv_heads == 0)]
    if model.num_heads % tp:
        raise ConfigError(
            f"tensor_parallel={tp} does not divide {model.name}'s {model.num_heads} attention heads; "
            f"use one of {valid}"
        )
    if model.num_kv_heads % tp and tp % model.num_kv_heads:
        raise ConfigError(
            f"tensor_parallel={tp} neither divides nor is a multiple of {model.name}'s "
            f"{model.num_kv_heads} KV heads; use one of {valid}"
        )
    return int(tp)


class ServiceTimeCost:
    """A stand-in cost model whose every step lasts a given service time (constant or
    exponential), independent of the batch. For validating the engine against M/D/1 and M/M/1:
    with max_num_seqs = 1 and one output token per request, each request is one step."""

    def __init__(self, like: CostModel, mean_s: float, dist: str = "constant", rng: np.random.Generator | None = None) -> None:
        if dist not in ("constant", "exponential"):
            raise ConfigError(f"service dist must be 'constant' or 'exponential', got {dist!r}")
        self.model, self.gpu, self.tp, self.weights, self.kv = like.model, like.gpu, like.tp, like.weights, like.kv
        self.eff = dataclasses.replace(like.eff, frontend_s=0.0)  # the service time is all there is
        self.kv_bytes_per_token_gpu = like.kv_bytes_per_token_gpu
        self.mean_s, self.dist = mean_s, dist
        self.rng = rng or np.random.default_rng(0)

    def step_sums(self, num_seqs: int, tokens: float, context_tokens: float, attn_pairs: float, *, step_overhead: bool = True) -> StepCost:
        t = self.mean_s if self.dist == "constant" else float(self.rng.exponential(self.mean_s))
        return StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, t)
