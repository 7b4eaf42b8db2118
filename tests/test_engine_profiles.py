"""Engine profiles: names and aliases, scheduling behaviour (separate or mixed prefill, whole or
chunked prompts, multi-step), the per-sequence host cost, the frontend latency, and where the
speculation machinery overhead is charged."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest
from helpers import one_line_error

from models.cost import CostModel
from models.engines import ALIASES, DEFAULT_PROFILE, PROFILES, efficiency_for, get_profile
from models.errors import ConfigError
from sim.deployment import build_runtime
from sim.engine import Replica
from sim.metrics import expand_steps
from sim.tables import Requests, StepLog
from specrack import simulate


def _run(make_scenario, engine: str, *, rate: float = 3.0, duration: float = 60.0, **dep):
    sc = make_scenario(deployment={"engine": engine, **dep},
                       workload={"rate_rps": rate, "duration_s": duration, "warmup_s": 0.0})
    return sc, simulate(sc, 1)


def test_aliases_resolve_and_unknown_names_are_one_line_errors(make_scenario) -> None:
    for alias, name in ALIASES.items():
        assert make_scenario(deployment={"engine": alias}).deployment.engine == name
    assert make_scenario().deployment.engine == DEFAULT_PROFILE == "vllm-v1"
    with pytest.raises(ConfigError, match=r"unknown engine profile 'vllm-0\.5'"):
        make_scenario(deployment={"engine": "vllm-0.5"})
    out = subprocess.run([sys.executable, "-m", "experiments.cli", "cost", "--engine", "vllm-0.5"],
                         capture_output=True, text=True)
    assert out.returncode == 2
    assert "unknown engine profile" in one_line_error(out.stderr)


def test_profile_scheduling_defaults_and_overrides(make_scenario) -> None:
    rt = build_runtime(make_scenario(deployment={"engine": "vllm-v1"}))
    assert (rt.prefill, rt.chunked_prefill, rt.max_num_batched_tokens, rt.max_num_seqs) == ("mixed", True, 8192, 1024)
    rt = build_runtime(make_scenario(deployment={"engine": "vllm-0.6"}))
    assert (rt.prefill, rt.chunked_prefill, rt.max_num_seqs) == ("separate", False, 256)
    rt = build_runtime(make_scenario(deployment={"engine": "vllm-0.6", "max_num_seqs": 64, "scheduler_steps": 4,
                                                 "prefill": "mixed"}))
    assert (rt.prefill, rt.max_num_seqs, rt.scheduler_steps) == ("mixed", 64, 4)
    assert rt.engine == "vllm-0.6"


def test_per_sequence_host_cost_is_linear_in_the_batch() -> None:
    base = efficiency_for("hopper", "vllm-v1")
    plain = CostModel("llama-3.1-8b", "h100-sxm", 1, efficiency=dataclasses.replace(base, seq_overhead_s=0.0))
    host = CostModel("llama-3.1-8b", "h100-sxm", 1, efficiency=dataclasses.replace(base, seq_overhead_s=5e-5))
    for b in (1, 16, 256):
        a, c = plain.uniform(b, 1000), host.uniform(b, 1000)
        assert c.total_s - a.total_s == pytest.approx(b * 5e-5, rel=1e-9)
        assert c.seq_overhead_s == pytest.approx(b * 5e-5, rel=1e-12)
    # a draft pass pays the per-draft-pass overhead, not the engine step's costs
    d = host.uniform(64, 1000, step_overhead=False)
    assert d.seq_overhead_s == 0.0
    assert d.overhead_s == pytest.approx(host.pass_overhead_s + base.draft_pass_overhead_s)


def test_separate_prefill_steps_never_carry_decodes(make_scenario) -> None:
    _, sep = _run(make_scenario, "vllm-0.6", rate=4.0)
    st = sep.steps
    assert ((st.decode_seqs > 0) & (st.prefill_tokens > 0)).sum() == 0
    assert (st.prefill_tokens > 0).sum() > 50 and (st.decode_seqs > 0).sum() > 50
    _, mixed = _run(make_scenario, "vllm-v1", rate=4.0)
    assert ((mixed.steps.decode_seqs > 0) & (mixed.steps.prefill_tokens > 0)).sum() > 50


def test_whole_prompts_without_chunked_prefill(make_scenario) -> None:
    fixed = {"prompt_tokens": {"dist": "fixed", "value": 3000}, "output_tokens": {"dist": "fixed", "value": 50}}
    for engine, chunked in (("trtllm", False), ("vllm-v1", True)):
        sc = make_scenario(deployment={"engine": engine, "max_num_batched_tokens": 2048},
                           workload={"rate_rps": 2.0, "duration_s": 40.0, "warmup_s": 0.0, **fixed})
        st = simulate(sc, 1).steps
        pre = st.prefill_tokens[st.prefill_tokens > 0].to_numpy()
        whole = np.all(pre % 3000 == 0)
        assert whole != chunked, engine
        if chunked:
            assert pre.max() <= 2048


def test_multi_step_scheduling_runs_decodes_in_groups(make_scenario) -> None:
    _, res = _run(make_scenario, "vllm-0.6", rate=4.0, scheduler_steps=4)
    is_dec = (expand_steps(res.steps).to_pandas().decode_seqs > 0).to_numpy()  # one row per step (fused runs expanded)
    runs, n = [], 0
    for d in is_dec:
        if d:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    runs = np.array(runs)  # decode runs that a prefill step interrupted
    assert runs.size > 20
    assert np.mean(runs % 4 == 0) > 0.9  # a run ends early only when its last decoder finished


def test_itl_counts_the_prefill_steps_a_decode_waited_through(make_scenario) -> None:
    _, sep = _run(make_scenario, "vllm-0.6", rate=4.0)
    steps = expand_steps(sep.steps).to_pandas()  # one row per step (fused runs expanded)
    dec = steps[steps.decode_seqs > 0]
    assert (dec.chunk_gap_s >= dec.duration_s - 1e-15).all()
    assert (dec.chunk_gap_s > dec.duration_s * 1.5).sum() > 10  # some decodes waited through prefills
    # the stalls are exactly the prefill-only steps run while sequences were waiting to decode
    stalled = (dec.chunk_gap_s - dec.duration_s).sum()
    pre_only = steps[(steps.decode_seqs == 0)].duration_s.sum()
    assert 0 < stalled <= pre_only + 1e-9
    _, mixed = _run(make_scenario, "vllm-v1", rate=4.0)
    d = expand_steps(mixed.steps).to_pandas()
    d = d[d.decode_seqs > 0]
    assert (d.chunk_gap_s == d.duration_s).all()
    assert sep.summary["itl_s"]["p99"] > sep.summary["tpot_s"]["p99"]


def test_frontend_latency_adds_to_ttft_only(make_scenario) -> None:
    one = {"rate_rps": 1.0, "num_requests": 1, "duration_s": 10.0, "warmup_s": 0.0}
    ttft = []
    for f in (0.0, 0.05):
        sc = make_scenario(deployment={"engine": "vllm-v1", "efficiency": {"frontend_s": f}}, workload=one)
        r = simulate(sc, 1).requests
        ttft.append(float((r.first_token_s - r.arrival_s).iloc[0]))
    assert ttft[1] - ttft[0] == pytest.approx(0.05, abs=1e-9)


def test_speculation_overhead_is_charged_on_decoding_sequences_not_prefill(make_scenario) -> None:
    sc = make_scenario(speculative={"method": "draft_model", "draft_model": "llama-3.2-1b", "num_speculative_tokens": 4})
    rt = build_runtime(sc)
    import simpy

    env = simpy.Environment()
    one = np.zeros(1)
    rep = Replica(env, 0, rt, Requests(one, one.astype(np.int64) + 1, one.astype(np.int64) + 1, one),
                  np.random.default_rng(0), StepLog())
    n_dec, ctx = 32, 32 * 1500.0
    no_pre = rep.price.spec_cost(n_dec, ctx, 4, 0, 0.0, 0.0, 0.0)
    with_pre = rep.price.spec_cost(n_dec, ctx, 4, 1, 4096.0, 0.0, 4096 * 4097 / 2)
    assert with_pre[3] == pytest.approx(no_pre[3], rel=1e-12)  # overhead unchanged by a prefill chunk
    assert with_pre[1] > no_pre[1] * 1.5  # while the target pass grew
    plain = rt.cost.step_sums(n_dec, n_dec, ctx, ctx + n_dec).total_s
    frac = rt.spec.overhead_frac_at_2 + rt.spec.overhead_frac_per_seq * (n_dec - 2)
    assert no_pre[3] == pytest.approx(plain * frac, rel=1e-12)


def test_every_profile_has_its_engine_and_fit_named() -> None:
    for name, p in PROFILES.items():
        assert get_profile(name) is p
        assert p.engine and p.fitted_to
        eff = efficiency_for("hopper", name)
        assert name in eff.source
    assert "uncalibrated" in efficiency_for("ampere", "vllm-v1").source


def test_summary_names_the_engine_profile(make_scenario) -> None:
    _, res = _run(make_scenario, "tuned", rate=1.0, duration=20.0)
    assert res.summary["engine_profile"] == "trtllm"
