"""The speculation methods beyond a draft model, EAGLE-1 and n-gram (issue 14): EAGLE-3 heads,
native multi-token prediction (MTP), token trees, self-speculation with a KV window or skipped
layers, and suffix decoding. Tokens per verification against each method's closed form through
the engine, draft costs by method, a self-draft's cost flat in the context, MagicDec's
long-context result as a check (never fitted), and one-line errors for bad input."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from experiments.mechanics import fixed_batch_speedup
from models.errors import ConfigError
from models.speculative import DraftShape, expected_tokens
from sim.deployment import build_runtime
from sim.scenario import Scenario, scenario_from_dict
from specrack import simulate

ROOT_SWEEPS = Path(__file__).resolve().parents[1] / "experiments" / "sweeps"


def _one_slot(spec: dict[str, Any] | None, *, acceptance: float = 0.8, prompt: int = 128, output: int = 1500,
              num_requests: int = 4, suffix_match: float | None = None, max_num_seqs: int = 1,
              model: str = "llama-3.1-70b", tp: int = 4) -> Scenario:
    """Batch 1 (max_num_seqs 1) on one replica, fixed lengths, one class without spread."""
    cls: dict[str, Any] = {"name": "c", "share": 1.0, "acceptance": acceptance, "acceptance_spread": 0.0}
    if suffix_match is not None:
        cls["suffix_match"] = suffix_match
    data: dict[str, Any] = {
        "rack": {"gpu": "h100-sxm", "num_gpus": tp},
        "deployment": {"model": model, "tensor_parallel": tp, "max_num_seqs": max_num_seqs},
        "workload": {"rate_rps": 10.0, "num_requests": num_requests, "duration_s": 60.0, "warmup_s": 0.0,
                     "prompt_tokens": {"dist": "fixed", "value": prompt},
                     "output_tokens": {"dist": "fixed", "value": output}, "classes": [cls]},
        "sim": {"drain_s": 1e5},
    }
    if spec is not None:
        data["speculative"] = spec
    return scenario_from_dict(data)


def _verification_sample(spec: dict[str, Any], seeds: tuple[int, ...], **kw: Any) -> np.ndarray:
    """Tokens emitted by each verification step at batch 1, each request's last (capped by its
    remaining output) dropped, pooled over seeds."""
    out = []
    for seed in seeds:
        res = simulate(_one_slot(spec, **kw), seed=seed)
        st = res.steps
        assert res.requests.completion_s.notna().all()
        dec = (st.decode_seqs.to_numpy() == 1) & (st.k.to_numpy() > 0)
        pre = st.prefill_tokens.to_numpy() > 0
        last = dec & np.append(pre[1:], True)
        out.append(st.emitted_tokens.to_numpy()[dec & ~last])
    return np.concatenate(out)


def _within_ci(x: np.ndarray, exact: float) -> None:
    se = x.std(ddof=1) / np.sqrt(x.size)
    assert abs(x.mean() - exact) <= 4 * se, (x.mean(), exact, se)


# ----------------------------------------------------------------------------- closed forms


def test_tree_tokens_per_verification_match_closed_form() -> None:
    """A token tree [2, 2, 1, 1] with the ranked-candidate model (Sequoia): depth i is reached
    with P_i = 1 - prod_r (1 - a f_i g^(r-1)); mean tokens = 1 + sum_i prod_{j<=i} P_j, written
    out here independently of models.speculative. Every verification runs all 1 + 14 tree
    tokens through the target."""
    a, g, branching = 0.7, 0.5, (2, 2, 1, 1)
    spec = {"method": "tree", "num_speculative_tokens": 4, "tree_branching": list(branching), "tree_rank_decay": g}
    reach = [1.0 - np.prod([1.0 - a * g**r for r in range(b)]) for b in branching]
    exact = 1.0 + float(np.sum(np.cumprod(reach)))
    assert exact == pytest.approx(DraftShape((1.0,) * 4, branching, g).expected_tokens(a), rel=1e-12)
    assert exact > float(expected_tokens(a, 4))  # the tree accepts more than the chain of its depth
    x = _verification_sample(spec, (1, 2, 3), acceptance=a, output=1000)
    assert x.min() >= 1 and x.max() <= 5
    _within_ci(x, exact)
    st = simulate(_one_slot(spec, acceptance=a, num_requests=1, output=200), seed=1).steps
    ver = st[(st.k > 0) & (st.decode_seqs == 1)]
    assert (ver.decode_tokens == 15).all()  # verify cost charged for every tree node


def test_mtp_tokens_per_verification_match_closed_form() -> None:
    """MTP with three modules and an explicit per-depth profile: 1 + a + a^2 f_2 + a^3 f_2 f_3."""
    a, prof = 0.85, (1.0, 0.9, 0.8)
    spec = {"method": "mtp", "mtp_depth": 3, "num_speculative_tokens": 3, "acceptance_profile": list(prof)}
    exact = 1.0 + a + a * (a * prof[1]) + a * (a * prof[1]) * (a * prof[2])
    x = _verification_sample(spec, (1, 2, 3), acceptance=a)
    _within_ci(x, exact)


def test_mtp_depth_one_is_deepseek_v3s_second_token() -> None:
    """DeepSeek-V3 (arXiv 2412.19437, section 5.4.3): the second token is accepted 85-90% of the
    time, giving 1.8x TPS. One MTP module at those rates emits 1.85-1.90 tokens per step; through
    the engine at batch 1 (a dense 70B target here: the catalogue's DeepSeek-V3 lands with
    issue 14's other items) the TPOT speedup falls below that by the module's cost, near 1.8x."""
    base = simulate(_one_slot(None, num_requests=2, output=600), seed=1).summary["tpot_s"]["mean"]
    for a in (0.85, 0.90):
        spec = {"method": "mtp", "mtp_depth": 1, "num_speculative_tokens": 1}
        x = _verification_sample(spec, (1,), acceptance=a, num_requests=2, output=600)
        _within_ci(x, 1.0 + a)
        tpot = simulate(_one_slot(spec, acceptance=a, num_requests=2, output=600), seed=1).summary["tpot_s"]["mean"]
        assert 1.55 < base / tpot < 1.0 + a, (a, base / tpot)


def test_suffix_tokens_per_step_with_matches() -> None:
    """Suffix decoding proposes only where the suffix tree matches (probability m per step):
    mean tokens per decoding step = 1 + m (E_k - 1); a verification (a matched step) emits E_k."""
    a, m, k = 0.7, 0.4, 4
    res = simulate(_one_slot({"method": "suffix", "num_speculative_tokens": k}, acceptance=a, suffix_match=m,
                             num_requests=3, output=1500), seed=2)
    st = res.steps
    dec = st[(st.decode_seqs == 1) & (st.prefill_tokens == 0)].iloc[:-1]
    x = dec.emitted_tokens.to_numpy()
    exact = 1.0 + m * (float(expected_tokens(a, k)) - 1.0)
    _within_ci(x[x.size // 8:], exact)
    assert set(np.unique(dec.decode_tokens)) <= {1.0, k + 1.0}  # unmatched steps verify nothing
    assert float(st.draft_s.sum()) == 0.0


# ----------------------------------------------------------------------------- draft costs


def _draft_pass_s(spec: dict[str, Any], batch: int, context: int) -> float:
    """One draft pass per drafted token at this batch and context (k = 1), from the engine."""
    sc = _one_slot({**spec, "num_speculative_tokens": 1}, suffix_match=0.5, max_num_seqs=256)
    return float(fixed_batch_speedup(sc, [batch], context, 0.8).draft_s.iloc[0])


@pytest.mark.parametrize("batch", [1, 64])
def test_draft_cost_ordering(batch: int) -> None:
    """ngram and suffix draft nothing on the GPU; a one-layer head (EAGLE, EAGLE-3, an MTP
    module) costs less than a 16-layer Llama-3.2-1B draft model, which costs less than an
    8B draft model; all far below the 70B target's decode step."""
    ctx = 2000
    cost = {name: _draft_pass_s(spec, batch, ctx) for name, spec in {
        "ngram": {"method": "ngram"}, "suffix": {"method": "suffix"},
        "eagle": {"method": "eagle"}, "eagle3": {"method": "eagle3"}, "mtp": {"method": "mtp", "mtp_depth": 1},
        "draft-1b": {"method": "draft_model", "draft_model": "llama-3.2-1b"},
        "draft-8b": {"method": "draft_model", "draft_model": "llama-3.1-8b"}}.items()}
    assert cost["ngram"] == cost["suffix"] == 0.0
    for head in ("eagle", "eagle3", "mtp"):
        assert 0.0 < cost[head] < cost["draft-1b"] < cost["draft-8b"], cost
    assert cost["eagle3"] < cost["eagle"]  # the 32k draft vocabulary's LM head
    target = build_runtime(_one_slot(None, max_num_seqs=256)).cost.decode_s(batch, batch * ctx)
    assert cost["draft-8b"] < target


def test_self_spec_window_draft_cost_flat_in_context() -> None:
    """A windowed self-draft reads at most W KV tokens per sequence: its cost is the same at 8K
    and 32K contexts (and at 1K it reads less than the window), while the target's decode, a
    layer-skipped self-draft and a standalone draft model all grow with the context."""
    win = {"method": "self_spec", "self_spec_window": 512}
    at = {c: _draft_pass_s(win, 32, c) for c in (1000, 8000, 32000)}
    assert at[8000] == pytest.approx(at[32000], rel=1e-12)
    skip = {"method": "self_spec", "self_spec_mode": "layer_skip", "self_spec_layer_fraction": 0.5}
    draft = {"method": "draft_model", "draft_model": "llama-3.2-1b"}
    for spec in (skip, draft):
        assert _draft_pass_s(spec, 32, 32000) > 1.5 * _draft_pass_s(spec, 32, 8000)
    # the layer-skipped draft reads half the target's layers' KV: half the target's KV time
    cost = build_runtime(_one_slot(None, max_num_seqs=256)).cost
    target_kv = cost.uniform(32, 32000).kv_read_bytes
    skip_rt = build_runtime(_one_slot(skip, max_num_seqs=256))
    assert skip_rt.spec is not None and skip_rt.spec.draft_cost is not None
    assert skip_rt.spec.draft_cost.uniform(32, 32000).kv_read_bytes == pytest.approx(0.5 * target_kv)


def test_fixed_batch_speedup_is_what_the_engine_simulates() -> None:
    """The fixed-batch figure (the engine's step code on a static batch) equals the simulated
    steps of a batch that decodes together: 8 requests at once, a 6K prompt, self-speculation."""
    spec = {"method": "self_spec", "num_speculative_tokens": 3}
    sc = _one_slot(spec, acceptance=0.8, prompt=6000, output=400, num_requests=8, max_num_seqs=8,
                   model="llama-3.1-8b", tp=1)
    st = simulate(sc, seed=1).steps
    full = st[(st.decode_seqs == 8) & (st.prefill_tokens == 0)]
    assert len(full) > 20
    fb = fixed_batch_speedup(sc, [8], 6200, 0.8)  # mid-decode context
    assert float(full.duration_s.mean()) == pytest.approx(float(fb.spec_step_s.iloc[0]), rel=0.05)


# ----------------------------------------------------------------------------- MagicDec, as a check


# MagicDec (Chen et al., arXiv 2408.11049; project page tables, github.com/Infini-AI-Lab/MagicDec):
# Llama-3.1-8B self-speculation with a StreamingLLM draft (KV budget 512), 32K prefill, PG-19,
# 8-way tensor parallel, optimal speculation length 3-4, acceptance 0.81 at 32K on PG-19.
MAGICDEC = {"a100-80gb": {32: 1.22, 64: 1.38, 128: 1.47}, "h100-sxm": {32: 1.23, 64: 1.43}}


@pytest.mark.parametrize("gpu", list(MAGICDEC))
def test_self_spec_long_context_speedup_rises_with_batch_like_magicdec(gpu: str) -> None:
    """At 32K context the KV reads dominate a decode step: a windowed self-draft's cost stays
    flat while verification shares one KV read among k + 1 tokens, so the decode speedup RISES
    with the batch (MagicDec's result), unlike a standalone draft model whose own KV grows with
    the batch. Compared at MagicDec's acceptance, never fitted: the default engine profile
    (vllm-v1) lands within 30% of each published point, with the same rising trend. (MagicDec ran
    on its own engine; vllm-v1's fixed costs, fitted on vLLM 0.11, are half vLLM 0.6's per layer,
    so the self-draft's passes cost it less than MagicDec's: its points sit 16-28% above.)"""
    def sc(spec: dict[str, Any]) -> Scenario:
        return scenario_from_dict({
            "rack": {"gpu": gpu, "num_gpus": 8}, "deployment": {"model": "llama-3.1-8b", "tensor_parallel": 8},
            "workload": {"rate_rps": 1.0, "classes": [{"name": "c", "share": 1.0, "acceptance": 0.81}]},
            "speculative": {**spec, "num_speculative_tokens": 3}})

    batches = [1, 8, 32, 64, 128]
    selfspec = fixed_batch_speedup(sc({"method": "self_spec", "self_spec_window": 512}), batches, 32000, 0.81)
    draft = fixed_batch_speedup(sc({"method": "draft_model", "draft_model": "llama-3.2-1b"}), batches, 32000, 0.81)
    s = dict(zip(selfspec.batch, selfspec.speedup, strict=True))
    d = dict(zip(draft.batch, draft.speedup, strict=True))
    assert all(s[a] < s[b] for a, b in itertools.pairwise(batches))  # rising with the batch
    assert s[1] < 1.0  # at batch 1 the self-draft (the whole target's weights per pass) does not pay
    assert s[128] > d[128]  # and at large batch it beats the standalone draft
    assert d[128] - d[32] < s[128] - s[32]
    for b, published in MAGICDEC[gpu].items():
        assert s[b] == pytest.approx(published, rel=0.30), (gpu, b, s[b], published)


# ----------------------------------------------------------------------------- hostile input


@pytest.mark.parametrize(("spec", "cls_extra", "needle"), [
    ({"method": "tree"}, {}, "tree_branching"),
    ({"method": "tree", "tree_branching": [2, 2]}, {}, "tree_branching has 2 entries"),
    ({"method": "tree", "tree_branching": [16, 16, 1, 1]}, {}, "at most 256"),
    ({"method": "mtp"}, {}, "mtp_depth"),
    ({"method": "mtp", "mtp_depth": 2, "num_speculative_tokens": 4}, {}, "exceeds mtp_depth=2"),
    ({"method": "suffix"}, {}, "suffix_match"),
    ({"method": "eagle3", "placement": "dedicated", "draft_gpus": 1}, {}, "placement 'dedicated'"),
    ({"method": "eagle3", "tree_branching": [2, 1, 1, 1]}, {}, "tree_branching only applies to method 'tree'"),
    ({"method": "eagle3", "self_spec_window": 256}, {}, "self_spec_window only applies"),
    ({"method": "eagle3", "acceptance_profile": [0.9, 0.8, 0.7, 0.6]}, {}, "first entry must be 1.0"),
    ({"method": "eagle3", "acceptance_profile": [1.0, 0.9]}, {}, "acceptance_profile has 2 entries"),
    ({"method": "eagle3", "acceptance_profile": [1.0, 0.9, 0.9, 0.9], "acceptance_decay": 0.9}, {}, "not both"),
    ({"method": "tree", "tree_branching": [2, 1, 1, 1], "tree_drafter": "draft_model"}, {}, "needs draft_model"),
    ({"method": "self_spec", "self_spec_mode": "sparse"}, {}, "self_spec_mode"),
    ({"method": "tree", "tree_branching": [2, 1, 1, 1]}, {"acceptance": {"tree": 0.8}}, "no entry for method 'eagle3'"),
])
def test_bad_method_input_is_one_line_naming_the_field(spec: dict[str, Any], cls_extra: dict[str, Any],
                                                       needle: str) -> None:
    cls = {"name": "c", "share": 1.0, **cls_extra}
    with pytest.raises(ConfigError) as err:
        scenario_from_dict({"rack": {"gpu": "h100-sxm", "num_gpus": 4},
                            "deployment": {"model": "llama-3.1-70b", "tensor_parallel": 4},
                            "workload": {"rate_rps": 1.0, "classes": [cls]}, "speculative": spec})
    msg = str(err.value)
    assert "\n" not in msg and needle in msg, msg


# ----------------------------------------------------------------------------- the bundled long-context sweep


def test_long_context_sweep_quick(tmp_path: Any) -> None:
    """The bundled long-context sweep (--quick: 8 and 64 closed-loop clients, 8K-32K prompts):
    the windowed self-draft's TPOT speedup rises with the clients, from below 1 (at 8 clients the
    self-draft's passes read the whole target's weights for little KV saved) to above the
    standalone draft's at 64."""
    from experiments.analysis import speedups
    from experiments.sweep import load_sweep, run_sweep

    spec = load_sweep(ROOT_SWEEPS / "long-context.toml", quick=True)
    assert spec.axis == "concurrency" and [v.name for v in spec.variants] == ["baseline", "self-spec", "draft-1b"]
    df, _ = run_sweep(spec, tmp_path, jobs=1, executor="serial", progress=False)
    assert (df.error == "").all()
    sp = speedups(df, spec.reference, x=spec.axis)
    tpot = sp[sp.metric == "tpot_s_mean"].set_index(["variant", "concurrency"])["mean"]
    assert tpot["self-spec", 8] < 1.0 < tpot["self-spec", 64]
    assert tpot["self-spec", 64] > tpot["draft-1b", 64]


def test_tree_under_kv_pressure_completes_and_frees_every_block() -> None:
    """A wide tree (4 x 4 x 2 x 1 = 84 nodes per sequence, their KV reserved for the step) on a KV
    cache of 431 blocks (6896 tokens) with prompts up to 6000 tokens: sequences are preempted
    (about a hundred times), yet every request completes with exactly its output, never more blocks are held
    than exist, and all blocks are free at the end (the rejected nodes' slots released)."""
    sc = scenario_from_dict({
        "rack": {"gpu": "h100-sxm", "num_gpus": 1},
        "deployment": {"model": "llama-3.1-8b", "tensor_parallel": 1, "gpu_memory_utilization": 0.24},
        "workload": {"rate_rps": 5.0, "num_requests": 12, "duration_s": 60.0, "warmup_s": 0.0,
                     "prompt_tokens": {"dist": "lognormal", "median": 2000, "p90": 5000, "max": 6000},
                     "output_tokens": {"dist": "fixed", "value": 200},
                     "classes": [{"name": "c", "share": 1.0, "acceptance": 0.7}]},
        "speculative": {"method": "tree", "num_speculative_tokens": 4, "tree_branching": [4, 4, 2, 1]},
        "sim": {"drain_s": 1e4}})
    rt = build_runtime(sc)
    res = simulate(sc, seed=1)
    req, st = res.requests, res.steps
    assert req.preemptions.sum() > 10
    fits = req.prompt_tokens + req.output_tokens <= rt.max_model_len
    assert req.completion_s[fits].notna().all()
    assert (req.output_tokens[fits] == 200).all()
    assert st.kv_blocks_used.max() <= rt.plan.num_blocks
    assert int(st.kv_blocks_used.iloc[-1]) == 0
    assert (req.draft_accepted <= req.draft_proposed).all()


def test_tree_pays_at_small_batch_and_costs_at_large_batch() -> None:
    """A token tree verifies 15 tokens per sequence for a longer accepted path: at batch 1 (weights
    read once, compute idle) it beats the EAGLE-3 chain of the same depth; at batch 256 the
    verification is compute-bound and the tree is slower than no speculation, the chain is not."""
    def fb(spec: dict[str, Any]) -> dict[int, float]:
        sc = _one_slot({**spec, "num_speculative_tokens": 4}, max_num_seqs=256)
        df = fixed_batch_speedup(sc, [1, 256], 2000, 0.8)
        return dict(zip(df.batch, df.speedup, strict=True))

    tree, chain = fb({"method": "tree", "tree_branching": [2, 2, 1, 1]}), fb({"method": "eagle3"})
    assert tree[1] > chain[1] > 1.0
    assert tree[256] < 1.0 < chain[256]


def test_mtp_reads_deepseek_v3s_module_from_the_catalogue() -> None:
    """DeepSeek-V3's config.json has num_nextn_predict_layers = 1, recorded on the catalogue model:
    `method = "mtp"` needs no mtp_depth there, k = 2 exceeds its one module (a one-line error), and
    at batch 1 on 8x H200 (FP8, as shipped) one module at 0.85-0.9 acceptance speeds TPOT up, below
    the 1.88 tokens a step it yields: the module's pass pays vllm-v1's per-draft-pass overhead (0.9 ms,
    fitted to vLLM's draft-cost ratios), a quarter of this step."""
    def sc(spec: dict[str, Any] | None) -> Scenario:
        data: dict[str, Any] = {
            "rack": {"gpu": "h200", "num_gpus": 8},
            "deployment": {"model": "deepseek-v3", "tensor_parallel": 8, "max_num_seqs": 1, "weights": "fp8"},
            "workload": {"rate_rps": 10.0, "num_requests": 2, "duration_s": 60.0, "warmup_s": 0.0,
                         "prompt_tokens": {"dist": "fixed", "value": 128},
                         "output_tokens": {"dist": "fixed", "value": 300},
                         "classes": [{"name": "c", "share": 1.0, "acceptance": 0.88, "acceptance_spread": 0.0}]},
            "sim": {"drain_s": 1e5},
        }
        if spec is not None:
            data["speculative"] = spec
        return scenario_from_dict(data)
    with pytest.raises(ConfigError, match="num_speculative_tokens=2 exceeds"):
        build_runtime(sc({"method": "mtp", "num_speculative_tokens": 2}))
    base = simulate(sc(None), seed=1).summary["tpot_s"]["mean"]
    mtp = simulate(sc({"method": "mtp", "num_speculative_tokens": 1}), seed=1).summary["tpot_s"]["mean"]
    assert 1.1 < base / mtp < 1.88, base / mtp


def test_a_requests_acceptance_outcomes_do_not_depend_on_load_router_or_batch() -> None:
    """Each request's verification outcomes are drawn before the run (`acceptance_draws`), so with
    a fixed k the same request accepts the same drafts in the same number of verifications at any
    load, under either router and in any batch (common random numbers across the points of a
    sweep); only when it gets them moves."""
    def run(rate: float, router: str) -> Any:
        sc = scenario_from_dict({
            "rack": {"gpu": "h100-sxm", "num_gpus": 8},
            "deployment": {"model": "llama-3.1-70b", "tensor_parallel": 4, "router": router},
            "workload": {"rate_rps": rate, "duration_s": 40.0, "warmup_s": 0.0},
            "speculative": {"method": "draft_model", "draft_model": "llama-3.2-1b", "num_speculative_tokens": 4},
        })
        return simulate(sc, seed=4).requests.set_index("id")

    cols = ["draft_accepted", "draft_proposed", "verify_steps", "verify_emitted"]
    ref = run(2.0, "least_outstanding")
    assert ref.completion_s.notna().all() and (ref.verify_steps > 3).all()
    for rate, router in ((2.0, "round_robin"), (6.0, "least_outstanding")):
        other = run(rate, router)
        both = ref.index.intersection(other.index)
        assert len(both) == len(ref)
        latency = [(r.completion_s - r.arrival_s).loc[both].to_numpy() for r in (ref, other)]
        assert not np.allclose(*latency)  # the requests ran differently ...
        np.testing.assert_array_equal(ref.loc[both, cols].to_numpy(), other.loc[both, cols].to_numpy())  # ... alike
