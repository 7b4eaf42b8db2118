"""MoE-aware step cost (models/cost.py): expected distinct experts against Monte Carlo, the
weights a step reads as a function of its tokens, expert parallelism, multi-head latent
attention, sliding windows, and the speculation physics on a MoE target against the published
trend (MoESD, arXiv 2505.19645: a check, never fitted)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from models.catalog import get_model
from models.cost import CostModel, expected_experts, expert_inclusion
from models.errors import ConfigError
from models.memory import plan_memory


def _uniform_routing(rng: np.random.Generator, trials: int, tokens: int, e: int, k: int) -> np.ndarray:
    """Distinct experts touched per trial: each token picks k distinct experts uniformly."""
    picks = np.argpartition(rng.random((trials, tokens, e)), k, axis=2)[:, :, :k]
    hit = np.zeros((trials, e), dtype=bool)
    np.put_along_axis(hit, picks.reshape(trials, -1), True, axis=1)
    return hit.sum(axis=1)


def _systematic_routing(rng: np.random.Generator, trials: int, tokens: int, pi: np.ndarray) -> np.ndarray:
    """Distinct experts per trial when each token draws k = sum(pi) distinct experts with inclusion
    probabilities pi exactly (systematic sampling over a random order of the experts)."""
    e, k = pi.size, round(pi.sum())
    hit = np.zeros((trials, e), dtype=bool)
    for t in range(trials):
        for _ in range(tokens):
            order = rng.permutation(e)
            edges = np.concatenate([[0.0], np.cumsum(pi[order])])
            points = rng.random() + np.arange(k)
            chosen = order[np.searchsorted(edges, points, side="right") - 1]
            assert np.unique(chosen).size == k
            hit[t, chosen] = True
    return hit.sum(axis=1)


@pytest.mark.parametrize(("e", "k"), [(8, 2), (128, 8), (256, 8)])
def test_closed_form_matches_monte_carlo_uniform(e: int, k: int) -> None:
    rng = np.random.default_rng(7)
    for tokens in (1, 3, 16, 64):
        n = _uniform_routing(rng, 400, tokens, e, k)
        se = n.std(ddof=1) / np.sqrt(n.size) + 1e-9
        assert abs(n.mean() - expected_experts(tokens, e, k)) < 4 * se + 1e-3, (tokens, n.mean())


def test_closed_form_matches_monte_carlo_skewed() -> None:
    rng = np.random.default_rng(11)
    e, k, skew = 64, 6, 0.9
    pi = expert_inclusion(e, k, skew)
    assert pi.sum() == pytest.approx(k) and pi.max() <= 1.0 + 1e-12
    for tokens in (2, 10):
        n = _systematic_routing(rng, 300, tokens, pi)
        se = n.std(ddof=1) / np.sqrt(n.size)
        assert abs(n.mean() - expected_experts(tokens, e, k, skew)) < 4 * se


def test_coverage_is_monotone_and_saturates() -> None:
    t = np.arange(1, 4000, dtype=np.float64)
    for skew in (0.0, 0.7, 1.5):
        n = expected_experts(t, 128, 8, skew)
        assert n[0] == pytest.approx(8)  # one token touches exactly its k experts
        assert (np.diff(n) >= 0).all() and (np.diff(n[:200]) > 0).all() and n[-1] <= 128
        assert expected_experts(1e6, 128, 8, skew) == pytest.approx(128, rel=1e-6)
    # skewed routing touches fewer distinct experts for the same tokens
    assert expected_experts(32, 128, 8, 1.0) < expected_experts(32, 128, 8, 0.0)
    with pytest.raises(ConfigError):
        expert_inclusion(8, 9)


@pytest.mark.parametrize(("model", "tp", "kw"), [("qwen3-30b-a3b", 1, {}), ("deepseek-v3", 8, {"moe_routing_skew": 0.6}),
                                                 ("mixtral-8x7b", 2, {"expert_parallel": True})])
def test_weights_read_follow_the_tokens_of_a_step(model: str, tp: int, kw: dict) -> None:
    cm = CostModel(model, "h200", tp, **kw)
    w = [cm.uniform(b, 500, 1).weight_bytes for b in (1, 2, 4, 8, 32, 128, 1024, 8192)]
    assert all(a <= b for a, b in itertools.pairwise(w)) and w[0] < w[1] < w[2] < w[3] < w[4]
    assert w[-1] == pytest.approx(cm.weight_bytes_per_gpu, rel=1e-3)  # every expert read
    m = cm.model
    one = cm.dense_weight_bytes + cm.expert_weight_bytes * m.experts_per_token / m.num_experts
    assert w[0] == pytest.approx(one, rel=1e-12)  # one token: its k experts per MoE layer
    # k+1 verified tokens of one sequence read as many experts as k+1 decoding sequences
    assert cm.uniform(1, 500, 5).weight_bytes == pytest.approx(cm.uniform(5, 500, 1).weight_bytes)
    # the vectorised pricing the adaptive policy uses is the same formula
    many = cm.total_s_many(4, np.array([4.0, 8.0, 20.0]), np.full(3, 2000.0), np.array([2010.0, 2030.0, 2100.0]))
    one_by_one = [cm.step_sums(4, t, 2000.0, p).total_s for t, p in ((4.0, 2010.0), (8.0, 2030.0), (20.0, 2100.0))]
    np.testing.assert_allclose(many, one_by_one, rtol=1e-12)


def test_dense_models_read_all_weights_every_step() -> None:
    cm = CostModel("qwen3-32b", "h200", 1)
    assert cm.uniform(1, 100).weight_bytes == cm.uniform(256, 100).weight_bytes == cm.weight_bytes_per_gpu


def test_expert_parallel_same_mean_weights_alltoall_comm() -> None:
    tp_ = CostModel("qwen3-235b-a22b", "h200", 8)
    ep = CostModel("qwen3-235b-a22b", "h200", 8, expert_parallel=True)
    for b in (1, 16, 256):
        a, e = tp_.uniform(b, 1000), ep.uniform(b, 1000)
        assert e.weight_bytes == pytest.approx(a.weight_bytes)
        assert e.flops == pytest.approx(a.flops)
        assert e.comm_s != a.comm_s
    assert ep.n_allreduce == 2 * 94 - 94 and ep.n_alltoall == 2 * 94
    # a token's 8 experts over 8 GPUs of 16 experts each: it reaches 1 - C(112,8)/C(128,8) of the others
    miss = np.prod([(112 - i) / (128 - i) for i in range(8)])
    assert ep.a2a_factor == pytest.approx(7 * (1 - miss) / 8)


def test_expert_parallel_is_validated(make_scenario) -> None:
    with pytest.raises(ConfigError, match="dense model"):
        make_scenario(deployment={"model": "llama-3.1-70b", "tensor_parallel": 4, "expert_parallel": True})
    with pytest.raises(ConfigError, match="do not split evenly"):
        make_scenario(rack={"gpu": "h100-sxm", "num_gpus": 16},
                      deployment={"model": "mixtral-8x7b", "tensor_parallel": 16, "expert_parallel": True})
    with pytest.raises(ConfigError, match="moe_routing_skew"):
        make_scenario(deployment={"model": "qwen3-30b-a3b", "tensor_parallel": 4, "moe_routing_skew": -1.0})


def test_mla_attention_and_kv_are_the_latent() -> None:
    cm = CostModel("deepseek-v3", "h200", 8, weights="fp8")
    # absorbed MLA: scores against 512 + 64 latent dims, values from 512, for each of 128 heads / TP
    assert cm.attn_flops_per_pair == pytest.approx(61 * 128 * 2 * (2 * 512 + 64) / 8)
    assert cm.kv_bytes_per_token_gpu == 61 * 576 * 2  # the latent is on every GPU (not split by TP)


def test_sliding_window_bounds_kv_read_and_memory() -> None:
    cm = CostModel("gpt-oss-120b", "h200", 1, weights="mxfp4")
    win = cm.kv_win_bytes_per_token_gpu
    assert win == cm.kv_full_bytes_per_token_gpu == 18 * 2 * 8 * 64 * 2
    short, long_, longer = (cm.step_sums(4, 4.0, 4 * c, 4 * c + 4).kv_read_bytes for c in (100, 10_000, 20_000))
    assert short == pytest.approx((cm.kv_full_bytes_per_token_gpu + win) * 400)  # inside the window: all layers
    # beyond the window only the full layers' read grows
    assert longer - long_ == pytest.approx(cm.kv_full_bytes_per_token_gpu * 4 * 10_000)
    assert not cm.affine_in_context
    # the vectorised pricing (adaptive policy) bounds the window the same way
    ctx, toks = np.array([100.0, 2000.0, 40_000.0]), np.array([4.0, 12.0, 20.0])
    pairs = ctx + toks * 3
    many = cm.total_s_many(4, toks, ctx, pairs)
    np.testing.assert_allclose(many, [cm.step_sums(4, t, c, p).total_s for t, c, p in zip(toks, ctx, pairs, strict=True)],
                               rtol=1e-12)
    plan = plan_memory(cm, max_num_seqs=64)
    assert plan.extra_bytes == pytest.approx(win * 128 * 64)  # the windows of every sequence, reserved
    assert plan.kv_bytes_per_token == cm.kv_full_bytes_per_token_gpu


def _spec_speedup(target: CostModel, draft: CostModel, batch: int, k: int = 4, accept: float = 0.7,
                  context: int = 1500) -> float:
    """Tokens per second with speculation over without, for a batch of identical sequences, from
    the step costs alone (k draft passes + one verify of k+1 tokens per sequence vs a decode step)."""
    emitted = (1 - accept ** (k + 1)) / (1 - accept)
    plain = target.uniform(batch, context, 1).total_s
    spec = target.uniform(batch, context, k + 1).total_s + k * draft.uniform(batch, context, 1, step_overhead=False).total_s
    return emitted * plain / spec


def test_speculation_on_moe_against_the_published_trend() -> None:
    """MoESD (Huang et al., NeurIPS 2025, arXiv 2505.19645) measured that speculative decoding is
    ineffective on sparse MoE targets at small batch (the k+1 verified tokens touch more experts)
    and pays more on MoE than on dense targets at medium batch (all experts are touched anyway;
    the active compute is small), up to 2.29x on Qwen2-57B-A14B. The simulated trend, at one
    acceptance for both targets and the same draft, has that shape."""
    draft = CostModel("qwen3-0.6b", "h200", 1)
    moe, dense = CostModel("qwen3-30b-a3b", "h200", 1), CostModel("qwen3-32b", "h200", 1)
    batches = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    s_moe = [_spec_speedup(moe, draft, b) for b in batches]
    s_dense = [_spec_speedup(dense, draft, b) for b in batches]
    # verification costs more than a decode step at batch 1 only on the MoE target
    assert moe.uniform(1, 1500, 5).total_s / moe.uniform(1, 1500, 1).total_s > 1.3
    assert dense.uniform(1, 1500, 5).total_s / dense.uniform(1, 1500, 1).total_s < 1.05
    assert s_moe[0] < max(s_moe)  # MoE: rises from batch 1 to a medium batch
    assert batches[int(np.argmax(s_moe))] >= 16
    assert s_dense[0] >= max(s_dense) - 1e-2  # dense: best at small batch, then fades
    assert s_dense[-1] < s_dense[0]
    assert s_moe[batches.index(64)] > s_dense[batches.index(64)]  # medium batch: MoE benefits more
    assert s_moe[0] < s_dense[0]  # small batch: dense benefits more


def test_catalogue_moe_models_have_consistent_expert_accounting() -> None:
    for name in ("qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "gpt-oss-20b", "gpt-oss-120b", "mixtral-8x7b"):
        m = get_model(name)
        inactive = m.moe_layers * (m.num_experts - m.experts_per_token) * m.params_per_expert
        assert m.params_total - m.params_active == inactive
        assert 0 < m.expert_params < m.params_total


def test_mixtral_batch_one_decode_against_a_published_measurement() -> None:
    """Baseten, "Faster Mixtral inference with TensorRT-LLM and quantization" (2024): Mixtral-8x7B
    INT8 on one A100 with TensorRT-LLM, 512 input / 128 output tokens, one request: TTFT 127 ms and
    81 perceived tokens/s (128 tokens over TTFT + 127 gaps), so a decode step of ~11.4 ms. A check
    (never fitted): at batch 1 a step reads 2 of 8 experts per layer (13 GB of the 47 GB of INT8
    weights). The measurement lies between the tuned and untuned TensorRT-LLM profiles, and
    reading every expert would put the step near twice the measurement."""
    itl_s = (128 / 81 - 0.127) / 127
    cm = CostModel("mixtral-8x7b", "a100-80gb", 1, "int8", engine="trtllm")
    tuned = cm.uniform(1, 576, 1)
    untuned = CostModel("mixtral-8x7b", "a100-80gb", 1, "int8", engine="trtllm-untuned").uniform(1, 576, 1)
    assert tuned.total_s < itl_s < untuned.total_s
    assert abs(tuned.total_s / itl_s - 1) < 0.35 and abs(untuned.total_s / itl_s - 1) < 0.35
    # the same tuned step if it read the other 6 experts of every layer too (memory-bound at batch 1)
    every_s = tuned.total_s + cm.expert_weight_bytes * (1 - 2 / 8) / cm.bw
    assert every_s > 1.8 * itl_s
