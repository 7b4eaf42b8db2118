"""Catalogue-derived quantities (weight and KV bytes per format), the memory planner, and the
one-line errors for unknown catalogue names."""

from __future__ import annotations

import re
from itertools import pairwise

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.catalog import (
    GIB,
    GPUS,
    KV_FORMATS,
    MODELS,
    WEIGHT_FORMATS,
    get_gpu,
    get_kv_format,
    get_model,
    get_weight_format,
    kv_bytes_per_token,
    weight_bytes,
)
from models.cost import CostModel, check_tp
from models.errors import ConfigError
from models.memory import BLOCK_SIZE, plan_memory

model_names = st.sampled_from(sorted(MODELS))


# ---------------------------------------------------------------- catalogue


@settings(max_examples=50, deadline=None)
@given(model_names)
def test_weight_bytes_order_by_format(name: str) -> None:
    m = MODELS[name]
    b = {f: weight_bytes(m, WEIGHT_FORMATS[f]) for f in WEIGHT_FORMATS}
    assert b["int4"] < b["fp8"] < b["bf16"]
    assert b["int8"] == b["fp8"]
    # bf16 is exactly 2 bytes per parameter (embeddings are bf16 in every format)
    assert b["bf16"] == pytest.approx(2.0 * m.params_total, rel=1e-12)


@settings(max_examples=100, deadline=None)
@given(model_names, st.sampled_from(["fp8", "int8", "int4"]), st.sampled_from([1, 2, 4, 8]),
       st.sampled_from(sorted(GPUS)))
def test_quantized_never_needs_more_memory_than_bf16(name: str, weights: str, tp: int, gpu: str) -> None:
    m = MODELS[name]
    try:
        check_tp(m, tp)
        q = CostModel(m, gpu, tp, weights)
    except ConfigError:  # TP the heads do not allow, or FP8 on a GPU without FP8 tensor cores
        return
    parent = CostModel(m, gpu, tp, "bf16")
    assert q.weight_bytes_per_gpu <= parent.weight_bytes_per_gpu
    assert q.uniform(8, 1000, 1).weight_bytes <= parent.uniform(8, 1000, 1).weight_bytes


@settings(max_examples=50, deadline=None)
@given(model_names)
def test_fp8_kv_bytes_per_token_is_half_of_bf16(name: str) -> None:
    m = MODELS[name]
    bf, f8 = kv_bytes_per_token(m, KV_FORMATS["bf16"]), kv_bytes_per_token(m, KV_FORMATS["fp8"])
    assert f8 == pytest.approx(bf / 2, rel=1e-12)
    if m.mla:  # multi-head latent attention: one compressed latent plus the RoPE key per layer
        assert bf == m.num_layers * (m.kv_lora_rank + m.qk_rope_head_dim) * 2
    else:  # GQA: K and V, every layer, the KV heads only
        assert bf == 2 * m.num_layers * m.num_kv_heads * m.head_dim * 2


def test_70b_kv_per_token_matches_hand_count() -> None:
    # Llama-3.1-70B: 80 layers x 8 KV heads x 128 dims x (K, V) x 2 bytes = 320 KiB per token
    assert kv_bytes_per_token(get_model("llama-3.1-70b"), get_kv_format("bf16")) == 327680


@pytest.mark.parametrize(("getter", "bad", "near"), [
    (get_gpu, "h100", "h100-sxm"),
    (get_gpu, "a100", "a100-80gb"),
    (get_model, "llama-3.1-7b", "llama-3.1-"),
    (get_model, "llama3-70b", "llama-3."),  # llama-3.1-70b or llama-3.3-70b
    (get_weight_format, "int3", "int"),
    (get_kv_format, "fp16", ""),
])
def test_unknown_name_suggests_nearest(getter: object, bad: str, near: str) -> None:
    with pytest.raises(ConfigError) as e:
        getter(bad)  # type: ignore[operator]
    msg = str(e.value)
    assert "\n" not in msg
    assert f"'{bad}'" in msg
    if near:
        hit = re.search(r"did you mean '([^']+)'", msg)
        assert hit and hit.group(1).startswith(near), msg


def test_unknown_name_lists_known_ones() -> None:
    with pytest.raises(ConfigError) as e:
        get_gpu("tpu-v5")
    assert all(g in str(e.value) for g in GPUS)


def test_lookup_is_case_insensitive() -> None:
    assert get_gpu("H100-SXM") is GPUS["h100-sxm"]
    assert get_model("Llama-3.1-70B") is MODELS["llama-3.1-70b"]


# ---------------------------------------------------------------- memory planner


@pytest.fixture(scope="module")
def c70() -> CostModel:
    return CostModel("llama-3.1-70b", "h100-sxm", 4, "bf16", "bf16")


def test_70b_tp4_h100_has_kv_room(c70: CostModel) -> None:
    p = plan_memory(c70)
    assert p.kv_capacity_tokens > 0
    assert p.kv_capacity_tokens == p.num_blocks * BLOCK_SIZE
    # the pieces add up to the usable HBM (pool is what is left; blocks round down within it)
    assert p.usable_bytes == pytest.approx(0.9 * 80 * GIB, rel=1e-12)
    assert p.weight_bytes + p.activation_bytes + p.runtime_bytes + p.extra_bytes + p.kv_pool_bytes == \
        pytest.approx(p.usable_bytes, rel=1e-12)
    assert 0 <= p.kv_pool_bytes - p.kv_capacity_tokens * p.kv_bytes_per_token < BLOCK_SIZE * p.kv_bytes_per_token
    # 17.6 GB of weights per GPU leaves tens of GiB: order 10^5 tokens of 320 KiB / 4 GPUs
    assert 1e5 < p.kv_capacity_tokens < 2e6


def test_model_that_does_not_fit_says_short_by() -> None:
    cost = CostModel("llama-3.1-405b", "h100-sxm", 1, "bf16")
    with pytest.raises(ConfigError) as e:
        plan_memory(cost)
    msg = str(e.value)
    assert "\n" not in msg
    assert "short by" in msg
    short = float(re.search(r"short by ([\d.]+) GiB", msg).group(1))
    # 405B params x 2 bytes = 756 GiB of weights against 72 GiB usable
    assert short > 600


def test_draft_extra_bytes_can_tip_it_over(c70: CostModel) -> None:
    p = plan_memory(c70)
    with pytest.raises(ConfigError, match="short by"):
        plan_memory(c70, extra_bytes=p.kv_pool_bytes + GIB)
    smaller = plan_memory(c70, extra_bytes=GIB, extra_kv_bytes_per_token=1000.0)
    assert smaller.kv_capacity_tokens < p.kv_capacity_tokens


def test_max_num_seqs_decreases_with_context(c70: CostModel) -> None:
    p = plan_memory(c70)
    seqs = [p.max_num_seqs_at_context(c) for c in (1, 16, 17, 128, 1024, 4096, 16384, 65536)]
    assert all(a >= b for a, b in pairwise(seqs)), seqs
    assert seqs[0] > seqs[-1]
    assert p.max_num_seqs_at_context(16) == p.num_blocks  # one block each
    assert p.max_num_seqs_at_context(17) == p.num_blocks // 2


def test_fp8_kv_roughly_doubles_capacity(c70: CostModel) -> None:
    f8 = CostModel("llama-3.1-70b", "h100-sxm", 4, "bf16", "fp8")
    ratio = plan_memory(f8).kv_capacity_tokens / plan_memory(c70).kv_capacity_tokens
    # same pool (weights, activation reserve unchanged), half the bytes per token; block rounding
    assert 1.9 <= ratio <= 2.2


def test_quantized_weights_free_memory_for_kv(c70: CostModel) -> None:
    f8 = CostModel("llama-3.1-70b", "h100-sxm", 4, "fp8", "bf16")
    assert plan_memory(f8).kv_capacity_tokens > plan_memory(c70).kv_capacity_tokens


@pytest.mark.parametrize("util", [0.0, -0.1, 1.5])
def test_bad_gpu_memory_utilization(c70: CostModel, util: float) -> None:
    with pytest.raises(ConfigError, match="gpu_memory_utilization"):
        plan_memory(c70, gpu_memory_utilization=util)
