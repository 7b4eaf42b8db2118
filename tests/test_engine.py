"""The continuous-batching engine: invariants on random small workloads (hypothesis), forced
preemption, determinism, an exact hand-checked step log, and overload."""

from __future__ import annotations

import dataclasses
import json
import time

import numpy as np
import pandas as pd
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from models.catalog import get_gpu
from models.cost import ServiceTimeCost
from models.memory import BLOCK_SIZE
from sim.deployment import build_runtime
from sim.scenario import load_scenario
from sim.simulate import run_table
from sim.workload import generate
from specrack import simulate

# ----------------------------------------------------------------------------- helpers


def _table(arrival, prompt, output, accept_q=None) -> pd.DataFrame:
    n = len(arrival)
    return pd.DataFrame({
        "id": np.arange(n, dtype=np.int64),
        "arrival_s": np.asarray(arrival, dtype=np.float64),
        "prompt_tokens": np.asarray(prompt, dtype=np.int64),
        "output_tokens": np.asarray(output, dtype=np.int64),
        "cls": np.zeros(n, dtype=np.int64),
        "accept_q": np.full(n, 0.5) if accept_q is None else np.asarray(accept_q, dtype=np.float64),
    })


def _shrink_kv(rt, num_blocks: int):
    """The runtime with a KV cache of `num_blocks` blocks (and the model length it allows)."""
    plan = dataclasses.replace(rt.plan, num_blocks=num_blocks, kv_capacity_tokens=num_blocks * BLOCK_SIZE)
    return dataclasses.replace(rt, plan=plan, max_model_len=min(rt.max_model_len, plan.kv_capacity_tokens))


def check_invariants(req: pd.DataFrame, steps: pd.DataFrame, rt, table: pd.DataFrame) -> None:
    """What must hold after any run that was not cut short."""
    # every request was accepted, completed once and got exactly its output tokens
    assert len(req) == len(table)
    assert req.completion_s.notna().all(), "a request never completed"
    np.testing.assert_array_equal(req.generated_tokens, req.output_tokens)
    # tokens conserved: every emitted token belongs to some request, none twice
    assert int(steps.emitted_tokens.sum()) == int(req.output_tokens.sum())
    # time: monotone per request
    assert (req.scheduled_s >= req.arrival_s).all()
    assert (req.first_token_s >= req.scheduled_s).all()
    assert (req.completion_s >= req.first_token_s).all()
    assert req.replica.between(0, rt.num_replicas - 1).all()
    # speculation: accepted drafts never exceed proposed ones
    assert (req.draft_accepted <= req.draft_proposed).all()
    assert (req.draft_accepted >= 0).all()
    # per step
    assert (steps.kv_blocks_used >= 0).all()
    assert (steps.kv_blocks_used <= rt.plan.num_blocks).all(), "KV over capacity"
    assert (steps.batch_size >= 1).all()
    assert (steps.batch_size <= rt.max_num_seqs).all()
    assert (steps.prefill_tokens + steps.decode_tokens <= np.maximum(rt.max_num_batched_tokens, steps.decode_tokens)).all()
    assert (steps.duration_s > 0).all()
    assert (steps.waiting >= 0).all()
    for _, s in steps.groupby("replica"):
        start = s.start_s.to_numpy()
        end = start + s.duration_s.to_numpy()
        assert (np.diff(start) >= 0).all(), "step start times go backwards"
        assert (start[1:] >= end[:-1] - 1e-9).all(), "steps of one replica overlap"
        # nothing left behind: the last step frees every block and leaves no one waiting
        assert s.kv_blocks_used.iloc[-1] == 0, "KV blocks leaked"
        assert s.waiting.iloc[-1] == 0


# ----------------------------------------------------------------------------- invariants

SPECS = [
    None,
    {"method": "ngram", "num_speculative_tokens": 3},
    {"method": "draft_model", "draft_model": "llama-3.2-1b", "num_speculative_tokens": 4},
    {"method": "eagle", "num_speculative_tokens": 5, "policy": "adaptive", "acceptance_decay": 0.9},
    {"method": "draft_model", "draft_model": "llama-3.2-1b", "policy": "disable_above_batch", "disable_batch_size": 2},
]


@st.composite
def workloads(draw):
    n = draw(st.integers(1, 12))
    arrival = sorted(draw(st.lists(st.integers(0, 40), min_size=n, max_size=n)))  # x 0.05 s: ties happen
    prompt = draw(st.lists(st.integers(1, 300), min_size=n, max_size=n))
    output = draw(st.lists(st.integers(1, 40), min_size=n, max_size=n))
    accept_q = draw(st.lists(st.floats(0.0, 1.0, exclude_max=True), min_size=n, max_size=n))
    longest = max(p + o for p, o in zip(prompt, output, strict=True))
    num_blocks = -(-longest // BLOCK_SIZE) + draw(st.integers(0, 12))
    return {
        "table": _table(np.asarray(arrival) * 0.05, prompt, output, accept_q),
        "num_blocks": num_blocks,
        "max_num_seqs": draw(st.integers(1, 6)),
        "max_num_batched_tokens": draw(st.integers(16, 256)),
        "replicas": draw(st.sampled_from([1, 2])),
        "router": draw(st.sampled_from(["round_robin", "least_outstanding"])),
        "spec": draw(st.sampled_from(SPECS)),
        "spread": draw(st.sampled_from([0.0, 0.15])),
    }


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(w=workloads())
def test_invariants_on_random_workloads(w, make_scenario, time_limit):
    sc = make_scenario(
        rack={"num_gpus": 4 * w["replicas"]},
        deployment={"max_num_seqs": w["max_num_seqs"], "max_num_batched_tokens": w["max_num_batched_tokens"],
                    "router": w["router"]},
        speculative=w["spec"],
        workload={"classes": [{"name": "c", "share": 1.0, "acceptance": 0.7, "acceptance_spread": w["spread"]}]},
        sim={"drain_s": 1e5},
    )
    rt = _shrink_kv(build_runtime(sc), w["num_blocks"])
    with time_limit(20):
        out = run_table(sc, rt, w["table"], seed=5, backlog_limit=10**6)
        req, steps, truncated = out.requests.to_pandas(), out.steps.to_pandas(), out.truncated
    assert not truncated
    check_invariants(req, steps, rt, w["table"])
    if w["spec"] is not None and w["spec"].get("policy", "fixed") == "fixed":
        np.testing.assert_array_equal(req.draft_proposed, w["spec"]["num_speculative_tokens"] * req.verify_steps)


# ----------------------------------------------------------------------------- preemption


def test_full_kv_preempts_and_finishes(make_scenario, time_limit):
    """A KV cache far too small for the load: sequences are preempted (recompute), yet the run
    ends and every request completes with all its tokens."""
    sc = make_scenario(
        deployment={"max_num_seqs": 32, "max_num_batched_tokens": 512},
        workload={"rate_rps": 20.0, "num_requests": 150,
                  "prompt_tokens": {"dist": "lognormal", "median": 200, "p90": 600, "max": 1500},
                  "output_tokens": {"dist": "lognormal", "median": 60, "p90": 200, "max": 400}},
        sim={"drain_s": 1e5},
    )
    rt = _shrink_kv(build_runtime(sc), 120)  # 1920 tokens for up to 32 sequences
    table = generate(sc.workload, 2, 20.0).to_pandas()
    table = table[table.prompt_tokens + table.output_tokens <= rt.max_model_len].reset_index(drop=True)
    t0 = time.perf_counter()
    with time_limit(30):
        out = run_table(sc, rt, table, seed=2, backlog_limit=10**6)
        req, steps, truncated = out.requests.to_pandas(), out.steps.to_pandas(), out.truncated
    assert time.perf_counter() - t0 < 30
    assert not truncated
    check_invariants(req, steps, rt, table)
    assert req.preemptions.sum() > 0
    assert steps.kv_blocks_used.max() > 0.9 * rt.plan.num_blocks  # the cache really was full


def test_full_kv_through_simulate(make_scenario, time_limit):
    """The same end to end: a gpu_memory_utilization that leaves room for ~4k tokens of KV."""
    probe = make_scenario()
    plan = build_runtime(probe).plan
    want_tokens = 4096
    need = plan.weight_bytes + plan.activation_bytes + plan.runtime_bytes + plan.extra_bytes
    util = (need + want_tokens * plan.kv_bytes_per_token) / get_gpu("h100-sxm").hbm_bytes
    sc = make_scenario(
        deployment={"gpu_memory_utilization": round(util, 6)},
        workload={"rate_rps": 8.0, "duration_s": 30.0, "warmup_s": 5.0},
        sim={"drain_s": 1e4},
    )
    rt = build_runtime(sc)
    assert 3000 < rt.plan.kv_capacity_tokens < 5000
    with time_limit(60):
        res = simulate(sc, seed=1)
    s = res.summary
    assert s["preemptions"] > 0
    assert s["backlog"] == 0
    ok = res.requests[res.requests.completion_s.notna()]
    assert len(ok) == len(res.requests)
    np.testing.assert_array_equal(ok.generated_tokens, ok.output_tokens)
    assert (res.steps.kv_blocks_used <= rt.plan.num_blocks).all()


# ----------------------------------------------------------------------------- determinism


def _summary_blob(summary: dict) -> str:
    """The summary as text (NaN == NaN there), without the library versions."""
    return json.dumps({k: v for k, v in summary.items() if k != "versions"}, sort_keys=True, default=str)


@pytest.mark.parametrize("spec", [None, {"method": "draft_model", "draft_model": "llama-3.2-1b"}])
def test_determinism(example_path, spec):
    sc = load_scenario(example_path, {"workload.duration_s": 40, "workload.warmup_s": 5})
    if spec is not None:
        sc = sc.with_overrides({"speculative": spec})
    a, b, c = simulate(sc, 1), simulate(sc, 1), simulate(sc, 2)
    pd.testing.assert_frame_equal(a.requests, b.requests)
    pd.testing.assert_frame_equal(a.steps, b.steps)
    assert _summary_blob(a.summary) == _summary_blob(b.summary)
    assert not a.requests.arrival_s.equals(c.requests.arrival_s)
    assert not a.steps.equals(c.steps)


# ----------------------------------------------------------------------------- exact step log


@pytest.fixture
def one_slot(make_scenario):
    """One replica, steps of exactly 1 s (any batch), up to `max_num_seqs` sequences."""

    def make(max_num_seqs: int):
        sc = make_scenario(deployment={"max_num_seqs": max_num_seqs})
        rt = build_runtime(sc)
        return sc, dataclasses.replace(rt, cost=ServiceTimeCost(rt.cost, 1.0, "constant"))

    return make


@pytest.mark.parametrize(("arrival", "output"), [(list(range(10)), [1] * 10), ([0.0, 5.0, 9.0], [1, 1, 1]),
                                               ([2.0, 3.0, 4.0], [1, 1, 1]), ([0.0] * 5 + [6.0], [1] * 6)])
def test_a_run_ends_at_the_instant_of_its_last_completion(one_slot, arrival, output):
    """The run ends when every request has completed, checked once per simulated second, after
    everything else due at that instant: a last completion at exactly a whole second ends the run
    there, whichever event was scheduled first (and however early the checks start)."""
    sc, rt = one_slot(1)
    out = run_table(sc, rt, _table(arrival, [10] * len(arrival), output), seed=1)
    req, truncated, t_end = out.requests.to_pandas(), out.truncated, out.horizon_s
    assert not truncated
    last = float(req.completion_s.max())
    assert last == int(last) and t_end == last


def test_hand_checked_step_log(one_slot):
    """Three one-token requests at 0.0, 1.0 (the instant the first step ends) and 1.5, one at a time."""
    sc, rt = one_slot(1)
    table = _table([0.0, 1.0, 1.5], [10, 10, 10], [1, 1, 1])
    out = run_table(sc, rt, table, seed=1)
    req, steps, truncated = out.requests.to_pandas(), out.steps.to_pandas(), out.truncated
    assert not truncated
    assert steps.start_s.tolist() == [0.0, 1.0, 2.0]
    assert steps.duration_s.tolist() == [1.0, 1.0, 1.0]
    assert steps.batch_size.tolist() == [1, 1, 1]
    assert steps.prefill_tokens.tolist() == [10.0, 10.0, 10.0]
    assert steps.emitted_tokens.tolist() == [1, 1, 1]
    # logged when each step ends: request 1 arrived at that very instant (t = 1.0), request 2 at 1.5
    assert steps.waiting.tolist() == [1, 1, 0]
    assert req.scheduled_s.tolist() == [0.0, 1.0, 2.0]
    assert req.first_token_s.tolist() == [1.0, 2.0, 3.0]
    assert req.completion_s.tolist() == [1.0, 2.0, 3.0]


def test_arrival_at_step_end_joins_the_next_step(one_slot):
    """The documented order at equal times: a request arriving at the instant a step ends is queued
    before the replica plans its next step. Request 0 (t = 0, 2 tokens) prefills in [0, 1) and
    decodes in [1, 2); request 1 arriving at exactly t = 1 must join that second step, not wait for
    a third one."""
    sc, rt = one_slot(2)
    table = _table([0.0, 1.0], [10, 10], [2, 1])
    out = run_table(sc, rt, table, seed=1)
    req, steps = out.requests.to_pandas(), out.steps.to_pandas()
    assert steps.start_s.tolist() == [0.0, 1.0]
    assert steps.batch_size.tolist() == [1, 2]
    assert steps.decode_seqs.tolist() == [0, 1]
    assert steps.emitted_tokens.tolist() == [1, 2]
    assert req.scheduled_s.tolist() == [0.0, 1.0]
    assert req.first_token_s.tolist() == [1.0, 2.0]
    assert req.completion_s.tolist() == [2.0, 2.0]


def test_same_instant_arrivals_are_fcfs(one_slot):
    """Ties in arrival time keep table order (FCFS) on one replica."""
    sc, rt = one_slot(1)
    table = _table([0.0, 0.0, 0.0], [10, 10, 10], [1, 1, 1])
    out = run_table(sc, rt, table, seed=1)
    req, steps = out.requests.to_pandas(), out.steps.to_pandas()
    assert req.first_token_s.tolist() == [1.0, 2.0, 3.0]
    assert req.scheduled_s.tolist() == steps.start_s.tolist() == [0.0, 1.0, 2.0]


# ----------------------------------------------------------------------------- overload


def test_overload_is_flagged_unstable(example_path, time_limit):
    over = {"workload.utilisation": 1.5, "workload.duration_s": 60, "workload.warmup_s": 10}
    with time_limit(60):
        s = simulate(load_scenario(example_path, over), 1).summary
        # a short drain leaves the backlog visible
        short = simulate(load_scenario(example_path, {**over, "sim.drain_s": 5}), 1).summary
        # a small backlog limit stops the run early
        cut = simulate(load_scenario(example_path, {**over, "sim.backlog_limit": 50}), 1).summary
    assert s["stable"] is False
    assert s["throughput_rps"] < 0.8 * s["offered_rps"]
    assert short["stable"] is False and short["backlog"] > 0
    assert short["horizon_s"] <= 60 + 5 + 1e-9
    assert cut["stable"] is False and cut["truncated"] is True and cut["backlog"] > 0


def test_backlog_stop_from_the_bound_is_the_exact_sums_stop(make_scenario, monkeypatch) -> None:
    """The arrival process sums the replicas' queues only when an upper bound on the sum (the
    last sum plus the requests queued since: arrivals and preemptions) passes the backlog limit:
    the run stops at the same arrival as summing after every arrival, also with preemptions
    putting requests back (a ~2k-token KV cache: without counting them the bound stops this run
    later) and with several replicas."""
    from models.catalog import get_gpu
    from sim import run as run_mod
    from sim.deployment import build_runtime

    plan = build_runtime(make_scenario()).plan
    need = plan.weight_bytes + plan.activation_bytes + plan.runtime_bytes + plan.extra_bytes
    util = (need + 2048 * plan.kv_bytes_per_token) / get_gpu("h100-sxm").hbm_bytes
    sc = make_scenario(rack={"gpu": "h100-sxm", "num_gpus": 8},
                       deployment={"gpu_memory_utilization": round(util, 6), "router": "round_robin"},
                       workload={"rate_rps": 4.0, "duration_s": 30.0}, sim={"backlog_limit": 5})
    fast = simulate(sc, 1)
    inner = run_mod._arrivals
    monkeypatch.setattr(run_mod, "_arrivals", lambda *a, **k: inner(*a, **{**k, "every": True}))
    every = simulate(sc, 1)
    assert fast.summary["truncated"] is True and fast.summary["preemptions"] > 0
    assert fast.summary["horizon_s"] == every.summary["horizon_s"]
    pd.testing.assert_frame_equal(fast.requests, every.requests)


@pytest.mark.parametrize("spec", [None, {"method": "draft_model", "draft_model": "llama-3.2-1b", "num_speculative_tokens": 4},
                                  {"method": "tree", "num_speculative_tokens": 3, "tree_branching": [3, 2, 1]}])
def test_the_ordinary_reservation_is_the_scalar_rule(make_scenario, spec) -> None:
    """The ordinary step reserves KV over the slot arrays (`sim.step.reserve_decode`, vectorised);
    the fused runs and the rack planner with the scalar rule (`reserve_need`):
    on random running batches (contexts near block boundaries and the model's length, few tokens
    left) both take the same blocks at every k."""
    import simpy

    from sim.engine import Replica
    from sim.step import reserve_decode, reserve_need
    from sim.tables import Requests, StepLog

    sc = make_scenario(**({"speculative": spec} if spec else {}))
    rt = build_runtime(sc)
    rng = np.random.default_rng(7)
    n_req = 64
    reqs = Requests(np.zeros(n_req), np.full(n_req, 100, dtype=np.int64), np.full(n_req, 50, dtype=np.int64),
                    np.full(n_req, 0.7))
    checked = 0
    for trial in range(40):
        rep = Replica(simpy.Environment(), 0, rt, reqs, np.random.default_rng(0), StepLog(16))
        n = int(rng.integers(1, 48))
        ml = rt.max_model_len
        c = np.where(rng.random(n) < 0.3, ml - rng.integers(1, 8, n), rng.integers(1, 4 * BLOCK_SIZE, n))
        c = np.where(rng.random(n) < 0.3, (c // BLOCK_SIZE) * BLOCK_SIZE, c).astype(np.int64)
        out = rng.integers(1, 60, n)
        gen = (out - rng.integers(1, 6, n)).clip(0)
        rep.n_running = n
        rep.rid[:n] = np.arange(n)
        rep.computed[:n] = rep.target[:n] = c
        rep.blocks[:n] = (c + BLOCK_SIZE - 1) // BLOCK_SIZE
        rep.out[:n], rep.gen[:n] = out, gen
        rep.free_blocks = 10**6
        k = 0 if spec is None else int(rng.integers(0, 4))
        qv = rt.spec.verify_tokens(k) if (rt.spec is not None and k and rt.spec.shape is not None) else k + 1
        dec = rng.random(n) < 0.8 if trial % 2 else np.ones(n, dtype=bool)
        held = int(rep.blocks[:n].sum())
        reserve_decode(rep, k, qv, None, dec, bool(dec.all()))
        entries = np.flatnonzero(dec).tolist()
        want = reserve_need(c.tolist(), (out - gen).tolist(), entries, k + 1, qv, ml)
        assert int(rep.blocks[:n].sum()) - held == want == 10**6 - rep.free_blocks, (trial, k)
        checked += want > 0
    assert checked > 10
