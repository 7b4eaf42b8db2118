"""Step cost: closed-form limits of the roofline, monotonicity properties, and bad input.

The closed forms below are recomputed from the catalogue records (parameter counts, layer shapes,
datasheet peaks), not from CostModel's own precomputed attributes, so a wrong constant in the
cost model shows up as a mismatch.
"""

from __future__ import annotations

import re
from itertools import pairwise

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from models.catalog import MODELS, get_gpu, get_model
from models.cost import ACT_BYTES, CostModel, check_tp
from models.errors import ConfigError

TP4 = dict(model="llama-3.1-70b", gpu="h100-sxm", tp=4, weights="bf16", kv_cache="bf16")


@pytest.fixture(scope="module")
def c70() -> CostModel:
    return CostModel(**TP4)


def _mfu(cost: CostModel, tokens: float) -> float:
    e = cost.eff
    return e.mfu_max * tokens / (tokens + e.mfu_half_tokens)


# ---------------------------------------------------------------- closed-form limits


def test_batch1_decode_is_weight_streaming(c70: CostModel) -> None:
    m, g, e = get_model("llama-3.1-70b"), get_gpu("h100-sxm"), c70.eff
    s = c70.uniform(1, 128, 1)
    bw = g.mem_bw_bytes_s * e.bw_eff
    # bf16 weights, embeddings in bf16 too: 2 bytes per parameter, split over 4 GPUs
    w_gpu = m.params_total * 2.0 / 4
    assert s.weight_bytes == pytest.approx(w_gpu, rel=1e-9)
    # the memory term is exactly all bytes touched over the effective bandwidth (pure arithmetic)
    assert s.memory_s == pytest.approx((s.weight_bytes + s.kv_read_bytes + s.kv_write_bytes + s.act_bytes) / bw, rel=1e-9)
    assert s.bytes == pytest.approx(s.weight_bytes + s.kv_read_bytes + s.kv_write_bytes + s.act_bytes, rel=1e-12)
    # two ring all-reduces per layer of one token's bf16 hidden state
    comm = 2 * m.num_layers * (e.allreduce_latency_s + 2 * 3 / 4 * m.hidden_size * ACT_BYTES / (g.interconnect_bytes_s * e.comm_eff))
    assert s.comm_s == pytest.approx(comm, rel=1e-9)
    assert s.overhead_s == pytest.approx(e.step_overhead_s + m.num_layers * e.layer_overhead_s + e.seq_overhead_s,
                                         rel=1e-9)
    # total: between (max of the rooflines) and (their sum), plus comm and overhead
    fixed = s.comm_s + s.overhead_s
    assert max(s.compute_s, s.memory_s) + fixed <= s.total_s * (1 + 1e-12)
    assert s.total_s <= (s.compute_s + s.memory_s + fixed) * (1 + 1e-12)
    assert s.memory_s > 5 * s.compute_s  # memory-bound
    # at context 128 the KV cache (10 MB) and activations are < 0.1% of the 35 GB of weights and
    # the attention compute is microseconds: within 1% of the pure weight-streaming limit
    assert s.total_s == pytest.approx(w_gpu / bw + comm + s.overhead_s, rel=0.01)


def test_long_prefill_is_compute_bound(c70: CostModel) -> None:
    m, g = get_model("llama-3.1-70b"), get_gpu("h100-sxm")
    t = 8192
    s = c70.uniform(1, 0, t)
    # 2 FLOPs per matmul parameter per token (the input embedding is a lookup, not a matmul),
    # plus 4 x layers x heads x head_dim per causal (query, key) pair; all divided over 4 GPUs
    lin = 2.0 * (m.params_total - m.embedding_params) * t / 4
    attn = 4.0 * m.num_layers * m.num_heads * m.head_dim * t * (t + 1) / 2 / 4
    assert s.flops == pytest.approx(lin + attn, rel=1e-9)
    # linear layers at the step's token-count efficiency; attention kernels work per sequence and
    # run at the full achieved efficiency
    expected = lin / (g.bf16_flops * _mfu(c70, t)) + attn / (g.bf16_flops * c70.eff.mfu_max)
    assert s.compute_s == pytest.approx(expected, rel=1e-9)
    assert s.compute_s > 5 * s.memory_s
    fixed = s.comm_s + s.overhead_s
    assert s.total_s >= (s.compute_s + fixed) * (1 - 1e-12)
    # compute dominates: what is left (memory not hidden, if any) is < 15% on top of it
    assert s.total_s <= 1.15 * (s.compute_s + fixed)
    assert s.compute_s / s.total_s > 0.75


def test_verification_costs_like_one_decode_at_batch_one(c70: CostModel) -> None:
    for ctx in (128, 2048, 8192):
        r = c70.uniform(1, ctx, 5).total_s / c70.uniform(1, ctx, 1).total_s
        assert 1.0 < r < 1.1, (ctx, r)


def test_verification_cost_grows_with_batch_towards_k_plus_1(c70: CostModel) -> None:
    def ratio(b: int, ctx: int) -> float:
        return c70.uniform(b, ctx, 5).total_s / c70.uniform(b, ctx, 1).total_s

    assert ratio(256, 128) > 2.0
    by_batch = [ratio(b, 128) for b in (1, 16, 64, 256, 1024)]
    assert all(x < y for x, y in pairwise(by_batch)), by_batch
    by_ctx = [ratio(256, c) for c in (8192, 2048, 512, 128)]
    assert all(x < y for x, y in pairwise(by_ctx)), by_ctx
    # weights are read once and the step overhead paid once for all 5 tokens: never 5x
    assert max(by_batch + by_ctx) < 5.0


# ---------------------------------------------------------------- properties


def _tp_ok(m: object, tp: int) -> bool:
    try:
        check_tp(m, tp)  # type: ignore[arg-type]
    except ConfigError:
        return False
    return True


DEPLOYMENTS = [
    ("llama-3.1-70b", "h100-sxm", 4, "bf16", "bf16"),
    ("llama-3.1-8b", "h100-sxm", 1, "fp8", "fp8"),
    ("llama-3.1-8b", "a100-80gb", 2, "int4", "bf16"),
    ("mixtral-8x7b", "h200", 2, "bf16", "bf16"),
    ("qwen2.5-72b", "b200", 8, "int8", "fp8"),
    ("llama-3.2-1b", "l40s", 1, "bf16", "bf16"),
]
_COSTS = {d: CostModel(*d) for d in DEPLOYMENTS}
deployments = st.sampled_from(DEPLOYMENTS).map(_COSTS.__getitem__)
batches = st.integers(1, 6).flatmap(
    lambda b: st.tuples(st.lists(st.integers(0, 600), min_size=b, max_size=b),
                        st.lists(st.integers(0, 32768), min_size=b, max_size=b)))


@settings(max_examples=150, deadline=None)
@given(deployments, st.integers(1, 512), st.integers(0, 32768), st.integers(1, 600), st.integers(1, 600))
def test_uniform_total_monotone_in_new_tokens(cost: CostModel, batch: int, ctx: int, n: int, dn: int) -> None:
    assert cost.uniform(batch, ctx, n + dn).total_s >= cost.uniform(batch, ctx, n).total_s


@settings(max_examples=150, deadline=None)
@given(deployments, batches, st.data())
def test_total_monotone_in_context(cost: CostModel, nc: tuple[list[int], list[int]], data: st.DataObject) -> None:
    new, ctx = nc
    i = data.draw(st.integers(0, len(new) - 1))
    more = list(ctx)
    more[i] += data.draw(st.integers(1, 10000))
    assert cost.step(new, more).total_s >= cost.step(new, ctx).total_s


def test_adding_a_sequence_never_makes_a_step_faster_regression() -> None:
    # Qwen2.5-72B, TP4 on A100: one decode at 126k context, plus a new decode at 2k context (this
    # once got faster: attention was charged at the step's small-batch efficiency)
    cost = CostModel("qwen2.5-72b", "a100-80gb", 4, "bf16", "bf16")
    ctx = [2031, 126365]
    assert cost.step([1, 1], ctx).total_s >= cost.step([0, 1], ctx).total_s


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(["llama-3.1-8b", "llama-3.1-70b", "qwen2.5-72b", "mixtral-8x7b", "llama-3.2-1b"]),
       st.sampled_from(["h100-sxm", "a100-80gb", "l40s"]),
       st.lists(st.tuples(st.integers(0, 600), st.integers(0, 130000)), min_size=1, max_size=12),
       st.integers(1, 600), st.integers(0, 130000))
def test_adding_a_sequence_never_makes_a_step_faster(name: str, gpu: str, batch: list[tuple[int, int]],
                                                     new: int, ctx: int) -> None:
    cost = CostModel(name, gpu, 1 if gpu == "l40s" and name == "llama-3.2-1b" else (4 if "7" in name else 1))
    n = [b[0] for b in batch]
    c = [b[1] for b in batch]
    assert cost.step([*n, new], [*c, ctx]).total_s >= cost.step(n, c).total_s * (1 - 1e-12)


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(sorted(MODELS)), st.sampled_from(["bf16", "fp8", "int8", "int4"]))
def test_tp2_halves_weight_bytes_per_gpu(name: str, weights: str) -> None:
    m = MODELS[name]
    assume(_tp_ok(m, 2))
    one = CostModel(m, "h200", 1, weights)
    two = CostModel(m, "h200", 2, weights)
    assert two.weight_bytes_per_gpu == pytest.approx(one.weight_bytes_per_gpu / 2, rel=1e-9)
    assert two.uniform(1, 0, 1).weight_bytes == pytest.approx(one.uniform(1, 0, 1).weight_bytes / 2, rel=1e-9)


@settings(max_examples=50, deadline=None)
@given(st.sampled_from(sorted(MODELS)), st.sampled_from([1, 2, 4, 8]))
def test_fp8_kv_is_half_of_bf16_per_gpu(name: str, tp: int) -> None:
    m = MODELS[name]
    assume(_tp_ok(m, tp))
    bf = CostModel(m, "h100-sxm", tp, "bf16", "bf16")
    f8 = CostModel(m, "h100-sxm", tp, "bf16", "fp8")
    assert f8.kv_bytes_per_token_gpu == pytest.approx(bf.kv_bytes_per_token_gpu / 2, rel=1e-12)
    s_bf, s_f8 = bf.uniform(3, 1000, 2), f8.uniform(3, 1000, 2)
    assert s_f8.kv_read_bytes == pytest.approx(s_bf.kv_read_bytes / 2, rel=1e-12)
    assert s_f8.kv_write_bytes == pytest.approx(s_bf.kv_write_bytes / 2, rel=1e-12)


# ---------------------------------------------------------------- bad input


def test_tp_not_dividing_heads_lists_valid_tps() -> None:
    with pytest.raises(ConfigError) as e:
        CostModel("llama-3.1-70b", "h100-sxm", 3)
    msg = str(e.value)
    assert "\n" not in msg
    assert "tensor_parallel=3" in msg
    listed = [int(x) for x in re.search(r"\[([\d, ]+)\]", msg).group(1).split(",")]
    assert listed == [1, 2, 4, 8, 16]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_suggested_tp_is_accepted(name: str) -> None:
    """The list an invalid TP suggests holds exactly the TPs (up to 16) that check_tp accepts."""
    m = MODELS[name]
    accepted = []
    messages = []
    for tp in range(1, 17):
        try:
            check_tp(m, tp)
            accepted.append(tp)
        except ConfigError as e:
            messages.append(str(e))
    for msg in messages:
        hit = re.search(r"use one of \[([\d, ]+)\]", msg)
        assert hit, msg
        assert [int(x) for x in hit.group(1).split(",")] == accepted, msg


@pytest.mark.parametrize("tp", [0, -2, 2.0, "4"])
def test_tp_must_be_a_positive_integer(tp: object) -> None:
    with pytest.raises(ConfigError, match="positive integer"):
        CostModel("llama-3.1-8b", "h100-sxm", tp)  # type: ignore[arg-type]


def test_negative_tokens_rejected(c70: CostModel) -> None:
    with pytest.raises(ConfigError, match=">= 0"):
        c70.step([2, -1], [10, 10])
    with pytest.raises(ConfigError, match=">= 0"):
        c70.step([1, 1], [10, -10])
    with pytest.raises(ConfigError, match=">= 0"):
        c70.uniform(4, 100, -1)
    with pytest.raises(ConfigError, match=">= 0"):
        c70.uniform(4, -100, 1)
    with pytest.raises(ConfigError, match="one entry per sequence"):
        c70.step([1, 1], [10])


def test_empty_step_costs_nothing(c70: CostModel) -> None:
    assert c70.step([], []).total_s == 0.0
    assert c70.step([0, 0], [100, 200]).total_s == 0.0
    assert c70.uniform(0, 100, 1).total_s == 0.0


def test_fp8_weights_need_fp8_tensor_cores() -> None:
    with pytest.raises(ConfigError, match="a100-80gb") as e:
        CostModel("llama-3.1-8b", "a100-80gb", 1, "fp8")
    assert "\n" not in str(e.value)


def test_step_matches_uniform(c70: CostModel) -> None:
    a = c70.step(np.full(7, 3), np.full(7, 900))
    b = c70.uniform(7, 900, 3)
    assert a.total_s == pytest.approx(b.total_s, rel=1e-12)
    assert a.flops == pytest.approx(b.flops, rel=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["llama-3.1-70b", "mixtral-8x7b", "llama-3.2-1b"]), st.sampled_from([1, 2, 4]),
       st.integers(1, 300), st.lists(st.tuples(st.integers(1, 5000), st.integers(0, 200000)), min_size=1, max_size=6))
def test_vectorised_totals_equal_step_sums(name: str, tp: int, n: int, cands: list[tuple[int, int]]) -> None:
    cost = CostModel(name, "h100-sxm", tp)
    tokens = np.array([float(t) for t, _ in cands])
    ctx = np.array([float(c) for _, c in cands])
    pairs = ctx + tokens * (tokens + 1) / 2
    many = cost.total_s_many(n, tokens, ctx, pairs)
    one = [cost.step_sums(n, t, c, p).total_s for t, c, p in zip(tokens, ctx, pairs, strict=True)]
    np.testing.assert_allclose(many, one, rtol=1e-12)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["llama-3.1-70b", "mixtral-8x7b", "llama-3.2-1b", "gpt-oss-20b"]), st.sampled_from([1, 2, 4]),
       st.integers(1, 300), st.lists(st.tuples(st.integers(1, 9000), st.integers(0, 400000)), min_size=1, max_size=6))
def test_pass_sums_equal_step_sums_bit_for_bit(name: str, tp: int, n: int, cands: list[tuple[int, int]]) -> None:
    """The cached scalar pass (a fused run's mixed steps) is step_sums itself, to the last bit,
    also when its per-(batch, tokens) terms come from the cache (each case priced twice)."""
    cost = CostModel(name, "h100-sxm", tp)
    for _ in range(2):
        for t, c in cands:
            tokens, ctx = float(t), float(c)
            pairs = ctx * 1.0 + tokens * (tokens + 1.0) / 2.0
            for over in (True, False):
                tc = cost.step_sums(n, tokens, ctx, pairs, step_overhead=over)
                assert cost.pass_sums(n, tokens, ctx, pairs, over) == (tc.total_s, tc.flops, tc.bytes)
