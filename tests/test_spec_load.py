"""Speculation under load: the mechanisms each engine profile charges when speculative decoding is
configured (read from the engine's source, models.engines.SpecBehaviour), the attribution of a
speedup's change to its causes (sim.attribution), and vLLM 0.6's published load curve reproduced
from the mechanisms with acceptance set at the lightest load only (experiments.spec_anchors)."""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import pytest

from experiments import spec_anchors
from models.engines import get_profile
from models.errors import ConfigError
from sim.attribution import CAUSES, attribute, latency_parts, main_cause, shares
from sim.deployment import build_runtime
from sim.pricing import StepPricer
from sim.scenario import Scenario, scenario_from_dict
from sim.simulate import simulate

DRAFT = {"method": "draft_model", "draft_model": "llama-3.2-1b", "num_speculative_tokens": 4}


def _sc(engine: str, spec: dict[str, Any] | None = None, **dep: Any) -> Scenario:
    data: dict[str, Any] = {"rack": {"gpu": "h100-sxm", "num_gpus": 4},
                            "deployment": {"model": "llama-3.1-70b", "tensor_parallel": 4, "engine": engine, **dep},
                            "workload": {"rate_rps": 2.0, "duration_s": 30.0, "warmup_s": 5.0}}
    if spec is not None:
        data["speculative"] = spec
    return scenario_from_dict(data)


# ----------------------------------------------------------------------------- vLLM 0.6's mechanisms


def test_batch_expansion_scores_k_plus_1_one_token_sequences() -> None:
    """vLLM 0.6 (vllm/spec_decode/batch_expansion.py) runs each decoding sequence as k + 1
    one-token sequences, the j-th reading its context + j tokens: the target pass is priced as
    that batch, and reads the KV cache k + 1 times where a multi-query scorer reads it once."""
    rt = build_runtime(_sc("vllm-0.6", {**DRAFT, "draft_tensor_parallel": 1}))
    assert rt.spec is not None and rt.spec.batch_expansion
    price = StepPricer(rt, 0)
    n, ctx, k = 16, 16 * 900.0, 4
    q = k + 1
    _total, target, *_ = price.spec_cost(n, ctx, k, 0, 0.0, 0.0, 0.0)
    expanded = rt.cost.step_sums(n * q, n * q, ctx * q + n * q * (q - 1) / 2.0, ctx * q + n * q * (q + 1) / 2.0)
    assert target == expanded.total_s
    mq = build_runtime(_sc("vllm-v1", DRAFT))
    assert mq.spec is not None and not mq.spec.batch_expansion
    single = mq.cost.step_sums(n, n * q, ctx, ctx * q + n * q * (q + 1) / 2.0)
    assert expanded.bytes > single.bytes + (q - 1) * rt.cost.kv_bytes_per_token_gpu * ctx * 0.99
    # the fast forms price it bit for bit (as every other step: tests/test_fusion.py runs it fused)
    assert price.spec_step(n, ctx, k) == price.spec_cost(n, ctx, k, 0, 0.0, 0.0, 0.0)


def test_speculation_turns_vllm06s_host_overlap_off() -> None:
    """vLLM 0.6 turns async output processing off when speculating (vllm/config.py): the output
    processing per sequence joins the step's critical path, once per token a sequence verifies
    beyond the first (the multi-token output processor); without speculation it stays hidden,
    unless the deployment turns it off itself."""
    soft = get_profile("vllm-0.6").software
    on = build_runtime(_sc("vllm-0.6"))
    spec = build_runtime(_sc("vllm-0.6", {**DRAFT, "draft_tensor_parallel": 1}))
    off = build_runtime(_sc("vllm-0.6", async_output=False))
    sched = soft["sched_seq_s"]
    assert on.cost.eff.seq_overhead_s == pytest.approx(soft["seq_overhead_s"] + sched)
    assert spec.cost.eff.seq_overhead_s == pytest.approx(soft["seq_overhead_s"] + sched + soft["output_seq_s"])
    assert off.cost.eff.seq_overhead_s == spec.cost.eff.seq_overhead_s
    assert spec.spec is not None and spec.spec.host_s_per_token == soft["output_seq_s"] > 0
    price = StepPricer(spec, 0)
    assert price.host_s(10, 4) == pytest.approx(10 * 4 * soft["output_seq_s"])
    # multi-step scheduling amortises the scheduling over its steps
    ms = build_runtime(_sc("vllm-0.6", scheduler_steps=10))
    assert ms.cost.eff.seq_overhead_s == pytest.approx(soft["seq_overhead_s"] + sched / 10)


def test_engines_refuse_what_their_source_refuses() -> None:
    with pytest.raises(ConfigError, match="refuses speculative decoding with multi-step scheduling") as e:
        _sc("vllm-0.6", {**DRAFT, "draft_tensor_parallel": 1}, scheduler_steps=8)
    assert "\n" not in str(e.value) and "scheduler_steps = 1" in str(e.value)
    with pytest.raises(ConfigError, match="batch expansion"):
        _sc("vllm-0.6", {"method": "tree", "num_speculative_tokens": 3, "tree_branching": [2, 1, 1]})


def test_sglang_caps_its_batch_when_speculating_unless_told() -> None:
    """SGLang 0.5 (server_args.py, _handle_speculative_decoding): max_running_requests 48 with EAGLE."""
    eagle = {"method": "eagle3", "num_speculative_tokens": 3}
    assert build_runtime(_sc("sglang-0.5")).max_num_seqs == 1024
    assert build_runtime(_sc("sglang-0.5", eagle)).max_num_seqs == 48
    assert build_runtime(_sc("sglang-0.5", eagle, max_num_seqs=200)).max_num_seqs == 200
    # and its overlap scheduler: hidden host work without speculation, serial with it
    soft = get_profile("sglang-0.5").software
    assert build_runtime(_sc("sglang-0.5")).cost.eff.seq_overhead_s == 0.0
    assert build_runtime(_sc("sglang-0.5", eagle)).cost.eff.seq_overhead_s == soft["output_seq_s"] > 0
    # TensorRT-LLM keeps its overlap scheduler for one-model EAGLE-3 and MTP only
    assert build_runtime(_sc("trtllm-1.2", eagle)).spec is not None


def test_a_colocated_draft_runs_at_its_own_tensor_parallelism() -> None:
    """vLLM's speculative_draft_tensor_parallel_size: Qwama-0.5B (14 heads) cannot split over 4
    GPUs; at TP 1 its weights sit whole on one GPU of the group, whose KV pool then bounds all."""
    with pytest.raises(ConfigError, match="draft_tensor_parallel") as e:
        _sc("vllm-v1", {"method": "draft_model", "draft_model": "qwama-0.5b", "num_speculative_tokens": 4})
    assert "14 attention heads" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="must divide"):
        _sc("vllm-v1", {**DRAFT, "draft_tensor_parallel": 3})
    with pytest.raises(ConfigError, match="colocated draft model"):
        _sc("vllm-v1", {"method": "eagle", "num_speculative_tokens": 3, "draft_tensor_parallel": 1})
    tp4 = build_runtime(_sc("vllm-v1", DRAFT))
    tp1 = build_runtime(_sc("vllm-v1", {**DRAFT, "draft_tensor_parallel": 1}))
    assert tp1.spec is not None and tp1.spec.draft_cost is not None and tp1.spec.draft_cost.tp == 1
    assert tp1.plan.num_blocks < tp4.plan.num_blocks


# ----------------------------------------------------------------------------- attribution


def test_attribution_sums_to_the_change_of_the_speedup() -> None:
    """Each cause's share is a part of ln S1 - ln S0, exactly (logarithmic means), whatever the parts."""
    rng = np.random.default_rng(3)
    for _ in range(50):
        parts = [dict(zip(("queue", "target", "draft", "host", "stall"), rng.uniform(0.01, 2.0, 5), strict=True))
                 for _ in range(5)]
        for p in (parts[0], parts[2]):
            p["draft"] = p["host"] = 0.0  # the reference has no drafter and no machinery
        a = attribute(parts[0], parts[1], parts[2], parts[3], kv_free1=parts[4])
        s0 = sum(parts[0].values()) / sum(parts[1].values())
        s1 = sum(parts[2].values()) / sum(parts[3].values())
        assert a["dln_speedup"] == pytest.approx(math.log(s1 / s0), abs=1e-12)
        assert sum(a[c] for c in CAUSES) == pytest.approx(a["dln_speedup"], abs=1e-9)


def test_attribution_names_the_cost_that_grew() -> None:
    base0 = {"queue": 0.1, "target": 2.0, "draft": 0.0, "host": 0.0, "stall": 0.0}
    spec0 = {"queue": 0.1, "target": 0.8, "draft": 0.3, "host": 0.1, "stall": 0.0}
    spec1 = {**spec0, "draft": 0.9}  # only the drafter's time grew
    a = attribute(base0, spec0, base0, spec1)
    assert a["draft"] == pytest.approx(a["dln_speedup"]) and a["dln_speedup"] < 0
    assert main_cause(a) == "drafter compute"
    assert shares(a)["draft"] == pytest.approx(1.0)
    assert all(math.isnan(v) for v in shares(attribute(base0, spec0, base0, spec0)).values())


def test_latency_parts_split_a_runs_tpot() -> None:
    res = simulate(_sc("vllm-v1", DRAFT), seed=1)
    parts = latency_parts(res.requests, res.steps, "tpot")
    assert parts["queue"] == 0.0 and parts["draft"] > 0 and parts["target"] > parts["draft"]
    done = res.requests[res.requests.completion_s.notna() & (res.requests.output_tokens > 1)]
    tpot = ((done.completion_s - done.first_token_s) / (done.output_tokens - 1)).mean()
    assert sum(parts.values()) == pytest.approx(tpot, rel=1e-9)
    e2e = latency_parts(res.requests, res.steps, "e2e")
    assert sum(e2e.values()) == pytest.approx((done.completion_s - done.arrival_s).mean(), rel=1e-9)


# ----------------------------------------------------------------------------- vLLM 0.6's published curve


def test_vllm06_curve_falls_from_its_mechanisms_and_crosses_one() -> None:
    """The vLLM blog's curve (Qwama-0.5B for Llama-3-70B, 4x H100, k = 4), acceptance set at 1
    req/s only: the simulated speedup falls monotonically and crosses 1.0 within the published
    rates, within 5 points of the reference's utilisation of the published crossover; verification
    compute (batch expansion) is the largest cause of the fall."""
    c = spec_anchors.curve("vllm06-qwama-70b")
    rep = spec_anchors.report(c)
    rows = rep["rows"]
    assert abs(rep["gap_points"]) <= 5.0, rep["gap_points"]
    sim = [r["simulated"] for r in rows]
    assert sim[0] == pytest.approx(c.points[0][1], abs=0.03)
    assert all(x >= y - 0.01 for x, y in itertools.pairwise(sim))
    assert sim[-1] < 1.0 < sim[-2] + 0.2
    last = rows[-1]
    assert max(CAUSES, key=lambda k: -last[f"why_{k}"]) == "verify"


# ----------------------------------------------------------------------------- the report says why


def test_report_says_where_and_why_each_speedup_fades() -> None:
    """A sweep's report (the main job's) names, per speculative strategy, how far its speedup over
    its own reference moves from the lightest load and the cause that moved it most, and charts
    each cause's part."""
    from experiments.report import attribution_chart, why_text

    rows = []
    for v, method in (("baseline", "none"), ("draft-1b", "draft_model")):
        for u, tpot, parts in ((0.3, 0.030, (0.0, 0.020, 0.006, 0.002)), (0.85, 0.045, (0.0, 0.040, 0.007, 0.0025))):
            t = tpot if method == "none" else sum(parts)
            p = (0.0, t, 0.0, 0.0) if method == "none" else parts
            for seed in (1, 2):
                rows.append({"variant": v, "utilisation": u, "seed": seed, "speculative_method": method,
                             "model": "m", "tpot_s_mean": t, "error": "",
                             **{f"latency_parts_tpot_{k}": x for k, x in zip(("queue", "target", "draft", "host"), p,
                                                                            strict=True)},
                             "latency_parts_tpot_stall": 0.0})
    import pandas as pd

    from experiments.analysis import attributions

    df = pd.DataFrame(rows)
    why = attributions(df, "baseline")
    assert set(why.variant) == {"draft-1b"}
    merged = df.merge(why.drop(columns=["dln_speedup", "against"]), on=["variant", "utilisation"], how="left")
    text = why_text(merged, "draft-1b", "utilisation", 0.85)
    assert "mostly verification compute" in text and "-" in text
    fig = attribution_chart(merged)
    bars = {t.name: t.y for t in fig.data}
    assert set(bars) == {"verification compute", "drafter compute", "host work", "drafter KV (fewer admitted)",
                         "queueing"}
    assert sum(float(b[-1]) for b in bars.values()) == pytest.approx(100 * why.dln_speedup.iloc[-1])
    # the top of the report: the question, then the speculative family's paragraph with where the
    # speedup falls below 1.5x and 1.0x (1.07x -> 0.91x: crossing 1.0 between the two points) and why
    from experiments.analysis import crossovers, speedups
    from experiments.report import answer

    sp = speedups(merged, "baseline")
    paras = {p: t for p, _, t in answer(merged, sp, "baseline")}
    assert list(paras) == ["lead", "family-speculative"]
    assert paras["lead"].startswith("Where does each strategy's speedup fade, and by how much?")
    u = crossovers(sp)["draft-1b"]
    assert 0.3 < u < 0.85
    text = paras["family-speculative"]
    assert f"draft-1b 1.07x → 0.91x (below 1.5x already at u=0.30, below 1.0x from u≈{u:.2f})" in text
    assert "mostly through verification compute (draft-1b −" in text
