"""Step fusion (`[sim] fuse_steps`): runs of pure decode steps advanced in one event must give
what the unfused engine (the oracle) gives: the same request table, bit for bit (a fused run's
clock is the unfused engine's running sum of step durations, `CostModel.decode_clock`), the
same summary (within 1e-9 relative: its step figures come from run-length rows in closed form),
and, expanded, the same step table."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pandas as pd
import pytest
from helpers import patch_fusion

from models.cost import CostModel
from sim.deployment import build_runtime
from sim.metrics import expand_steps
from sim.run import run_table
from sim.scenario import scenario_from_dict
from specrack import simulate

RTOL = 1e-9


def _close(a: Any, b: Any, path: str = "") -> list[str]:
    """Paths where two summaries differ: floats beyond RTOL relative and RTOL absolute (trend slopes
    near zero amplify the 1e-15 differences of timestamps)."""
    if isinstance(a, dict):
        return [p for k in a for p in _close(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, float):
        same = a == b or (np.isnan(a) and np.isnan(b)) or abs(a - b) <= RTOL * max(abs(a), abs(b), 1.0)
        return [] if same else [f"{path}: {a!r} != {b!r}"]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def _same_requests(a: pd.DataFrame, b: pd.DataFrame) -> None:
    """The same request table, every timestamp bit for bit."""
    assert list(a.columns) == list(b.columns) and len(a) == len(b)
    for c in a.columns:
        x, y = a[c].to_numpy(np.float64), b[c].to_numpy(np.float64)
        np.testing.assert_array_equal(y, x, err_msg=c)


def _same_steps(unfused: pd.DataFrame, fused: pd.DataFrame) -> None:
    """The fused table, expanded, is the unfused one: every step's start, duration, batch, tokens
    and chunk gap; FLOPs and bytes in total (expansion spreads a run's total evenly)."""
    assert (unfused["count"] == 1).all()
    assert (fused["count"] >= 1).all() and (fused["duration_s"] > 0).all(), "an empty run-length row"
    assert int(fused["count"].sum()) == len(unfused)
    e = expand_steps(fused).to_pandas()
    key = ["replica", "start_s"]
    u = unfused.sort_values(key, kind="stable").reset_index(drop=True)
    e = e.sort_values(key, kind="stable").reset_index(drop=True)
    for c in ("replica", "start_s", "duration_s", "batch_size", "decode_seqs", "prefill_tokens", "decode_tokens",
              "emitted_tokens", "k", "waiting", "target_s", "chunk_gap_s"):
        np.testing.assert_allclose(e[c].to_numpy(np.float64), u[c].to_numpy(np.float64), rtol=RTOL, atol=1e-15,
                                   err_msg=c)
    for c in ("flops", "bytes", "duration_s", "emitted_tokens"):
        assert fused[c].sum() == pytest.approx(unfused[c].sum(), rel=RTOL), c
    # the last step of every fused run: its KV blocks in use, exactly
    last = fused[fused["count"] > 1]
    for r in np.unique(last.replica):
        ur, lr = u[u.replica == r], last[last.replica == r]
        u_end = (ur.start_s + ur.duration_s).to_numpy()
        j = np.searchsorted(u_end, (lr.start_s + lr.duration_s).to_numpy() * (1 - 1e-12))
        np.testing.assert_array_equal(ur.kv_blocks_used.to_numpy()[j], lr.kv_blocks_used.to_numpy())


def _both(sc, seed: int = 1):
    on = simulate(sc.with_overrides({"sim.fuse_steps": True}), seed)
    off = simulate(sc.with_overrides({"sim.fuse_steps": False}), seed)
    return on, off


def _check(sc, seed: int = 1, *, min_fused: float = 2.0) -> None:
    on, off = _both(sc, seed)
    _same_requests(off.requests, on.requests)
    diff = _close({k: v for k, v in off.summary.items() if k != "scenario"},
                  {k: v for k, v in on.summary.items() if k != "scenario"})
    assert not diff, diff
    _same_steps(off.steps, on.steps)
    assert len(off.steps) / len(on.steps) >= min_fused, "fusion barely happened"


# ----------------------------------------------------------------------------- the cost model


@pytest.mark.parametrize(("model", "tp", "moe"), [
    ("llama-3.1-70b", 4, {}), ("llama-3.1-8b", 1, {}), ("mixtral-8x7b", 2, {}),
    # MoE: the experts a step touches depend on its tokens, not its context (skewed routing, expert
    # parallelism with all-to-all, multi-head latent attention)
    ("qwen3-30b-a3b", 1, {"moe_routing_skew": 1.2}), ("deepseek-v3", 8, {"expert_parallel": True}),
    ("qwen3-235b-a22b", 4, {"moe_routing_skew": 0.5, "expert_parallel": True}),
])
def test_decode_step_cost_is_affine_in_the_context(model: str, tp: int, moe: dict[str, Any]) -> None:
    """What a fused run relies on: step j of n decoding sequences at context c0 + j n lasts
    d0 + j x slope, within 1e-12 relative of the step's own cost; FLOPs and bytes sum in closed form."""
    cm = CostModel(model, "h100-sxm", tp, **moe)
    assert cm.affine_in_context
    rng = np.random.default_rng(0)
    for n in (1, 3, 64, 300):
        c0 = float(rng.integers(n, 4000 * n))
        ones = [cm.step_sums(n, n + 0.0, c0 + j * n, c0 + j * n + n) for j in range(400)]
        d0, slope = ones[0].total_s, (ones[-1].total_s - ones[0].total_s) / 399
        for j, o in enumerate(ones):
            assert d0 + j * slope == pytest.approx(o.total_s, rel=1e-12, abs=0)
        assert [cm.decode_s(n, c0 + j * n) for j in range(400)] == [o.total_s for o in ones]  # bit-identical
        ctx_sum = 400 * c0 + n * 399 * 400 / 2
        flops, nbytes = cm.run_sums(n + 0.0, ctx_sum, ctx_sum + 400 * n, 400)
        assert flops == pytest.approx(sum(o.flops for o in ones), rel=1e-12)
        assert nbytes == pytest.approx(sum(o.bytes for o in ones), rel=1e-12)


# ----------------------------------------------------------------------------- the matrix

_MATRIX = {
    "light": dict(workload={"rate_rps": 0.5, "duration_s": 120.0, "warmup_s": 7.3}),
    "heavy": dict(workload={"rate_rps": 6.0, "duration_s": 60.0, "warmup_s": 10.0}),
    "no-chunked-prefill": dict(deployment={"engine": "trtllm"}, workload={"rate_rps": 3.0, "duration_s": 60.0}),
    "separate-multistep": dict(deployment={"engine": "vllm-0.6", "scheduler_steps": 4},
                               workload={"rate_rps": 3.0, "duration_s": 60.0, "warmup_s": 5.0}),
    "separate": dict(deployment={"engine": "vllm-0.6"}, workload={"rate_rps": 4.0, "duration_s": 60.0}),
    "max-seqs-full": dict(deployment={"max_num_seqs": 8}, workload={"rate_rps": 3.0, "duration_s": 60.0}),
    "2-replicas-least": dict(rack={"gpu": "h100-sxm", "num_gpus": 8}, workload={"rate_rps": 5.0, "duration_s": 60.0}),
    "2-replicas-rr": dict(rack={"gpu": "h100-sxm", "num_gpus": 8}, deployment={"router": "round_robin"},
                          workload={"rate_rps": 5.0, "duration_s": 60.0}),
    "4-replicas-least": dict(rack={"gpu": "h100-sxm", "num_gpus": 16}, workload={"rate_rps": 8.0, "duration_s": 40.0}),
    # the joint plan (sim/joint.py): chunked prefills across steps (a 512-token budget), whole prompts
    # (TensorRT-LLM), a KV cache of ~4k tokens (preemptions: ordinary steps, the replica out and rejoining)
    "3-replicas-least-chunked": dict(rack={"gpu": "h100-sxm", "num_gpus": 12}, deployment={"max_num_batched_tokens": 512},
                                     workload={"rate_rps": 6.0, "duration_s": 40.0, "warmup_s": 4.0}),
    "2-replicas-least-trtllm": dict(rack={"gpu": "h100-sxm", "num_gpus": 8},
                                    deployment={"engine": "trtllm", "max_num_batched_tokens": 1024},
                                    workload={"rate_rps": 5.0, "duration_s": 40.0}),
    "2-replicas-least-kv": dict(rack={"gpu": "h100-sxm", "num_gpus": 8}, deployment={"gpu_memory_utilization": 0.455},
                                workload={"rate_rps": 7.0, "duration_s": 30.0}, sim={"drain_s": 1e4}),
    # overloaded: full slots (fused runs with requests waiting), stopped by the backlog limit
    "4-replicas-rr-backlog": dict(rack={"gpu": "h100-sxm", "num_gpus": 16},
                                  deployment={"router": "round_robin", "max_num_seqs": 16},
                                  workload={"rate_rps": 30.0, "duration_s": 40.0}, sim={"backlog_limit": 40}),
    "4-replicas-least-backlog": dict(rack={"gpu": "h100-sxm", "num_gpus": 16}, deployment={"max_num_seqs": 16},
                                     workload={"rate_rps": 30.0, "duration_s": 40.0}, sim={"backlog_limit": 40}),
    "closed": dict(workload={"arrival": "closed", "concurrency": 12, "num_requests": 300, "rate_rps": None,
                             "duration_s": 60.0, "warmup_s": 20.0}),
    # (no frontend latency: a completion's send waits for the next step; one client: the batch empties)
    "closed-trtllm": dict(deployment={"engine": "trtllm", "max_num_batched_tokens": 1024},
                          workload={"arrival": "closed", "concurrency": 10, "num_requests": 300, "rate_rps": None,
                                    "duration_s": 60.0, "warmup_s": 20.0}),
    # more clients than slots (the next requests wait with every slot full: `sim.fusion.plan_run`'s runs, whose
    # last step logs the requests a completion submitted at once), on two replicas too
    "closed-trtllm-full-slots": dict(deployment={"engine": "trtllm", "max_num_seqs": 4},
                                     workload={"arrival": "closed", "concurrency": 10, "num_requests": 60,
                                               "rate_rps": None, "duration_s": 60.0, "warmup_s": 5.0}),
    "closed-trtllm-2-replicas": dict(rack={"gpu": "h100-sxm", "num_gpus": 8}, deployment={"engine": "trtllm"},
                                     workload={"arrival": "closed", "concurrency": 8, "num_requests": 100,
                                               "rate_rps": None, "duration_s": 60.0, "warmup_s": 5.0}),
    "closed-one-client": dict(workload={"arrival": "closed", "concurrency": 1, "num_requests": 40, "rate_rps": None,
                                        "duration_s": 60.0, "warmup_s": 5.0}),
    "closed-think-2-replicas": dict(rack={"gpu": "h100-sxm", "num_gpus": 8},
                                    workload={"arrival": "closed", "concurrency": 16, "num_requests": 300,
                                              "rate_rps": None, "think_time_s": {"dist": "exponential", "mean": 0.5}}),
    "gated": dict(workload={"rate_rps": 4.0, "duration_s": 60.0, "max_concurrency": 6, "warmup_s": 5.0}),
    # a MoE target with skewed routing and expert parallelism (the weights read follow the tokens)
    "moe-ep": dict(rack={"gpu": "h100-sxm", "num_gpus": 2},
                   deployment={"model": "qwen3-30b-a3b", "tensor_parallel": 2, "expert_parallel": True,
                               "moe_routing_skew": 0.8},
                   workload={"rate_rps": 4.0, "duration_s": 40.0, "warmup_s": 5.0}),
}


@pytest.mark.parametrize("name", list(_MATRIX))
def test_fused_equals_unfused(make_scenario, name: str) -> None:
    sc = make_scenario(**_MATRIX[name])
    # a closed loop over several replicas fuses little (a run ends at the next event anywhere); near
    # a backlog stop with a limit (40) under what the replicas hold (4 x 16 slots) every run ends
    # before the next arrival (`engine.backlog_stop`: preemptions elsewhere could fill the queues);
    # a step that preempts is always the ordinary step's
    _check(sc, min_fused={"heavy": 1.5, "separate": 1.5, "closed-think-2-replicas": 1.0, "closed-trtllm-2-replicas": 1.0, "4-replicas-rr-backlog": 1.5,
                          "4-replicas-least-backlog": 1.25, "2-replicas-least-kv": 1.15}.get(name, 2.0))


def test_fused_equals_unfused_under_kv_pressure(make_scenario) -> None:
    """Preemption: a KV cache of ~4k tokens (gpu_memory_utilization), runs stop where blocks bind."""
    from models.catalog import get_gpu

    plan = build_runtime(make_scenario()).plan
    need = plan.weight_bytes + plan.activation_bytes + plan.runtime_bytes + plan.extra_bytes
    util = (need + 4096 * plan.kv_bytes_per_token) / get_gpu("h100-sxm").hbm_bytes
    sc = make_scenario(deployment={"gpu_memory_utilization": round(util, 6)},
                       workload={"rate_rps": 8.0, "duration_s": 30.0, "warmup_s": 5.0}, sim={"drain_s": 1e4})
    on, off = _both(sc)
    assert off.summary["preemptions"] > 0
    _same_requests(off.requests, on.requests)
    assert not _close({k: v for k, v in off.summary.items() if k != "scenario"},
                      {k: v for k, v in on.summary.items() if k != "scenario"})
    _same_steps(off.steps, on.steps)


def test_fused_equals_unfused_on_a_trace_like_table(make_scenario) -> None:
    """Bursts, identical timestamps and a long gap, replayed through run_table (open and closed)."""
    sc = make_scenario(workload={"rate_rps": 1.0, "duration_s": 60.0, "warmup_s": 0.0}, sim={"drain_s": 1e4})
    rng = np.random.default_rng(3)
    arrival = np.sort(np.concatenate([np.full(20, 1.0), rng.uniform(0, 30, 60), np.full(10, 31.25), [90.0, 90.0]]))
    n = arrival.size
    table = pd.DataFrame({"id": np.arange(n), "arrival_s": arrival, "prompt_tokens": rng.integers(10, 3000, n),
                          "output_tokens": rng.integers(1, 600, n), "cls": np.zeros(n, dtype=np.int64),
                          "accept_q": np.full(n, 0.5)})
    for kw in ({}, {"concurrency": 5}):
        res = {}
        for fuse in (True, False):
            s = sc.with_overrides({"sim.fuse_steps": fuse})
            res[fuse] = run_table(s, build_runtime(s), table, 1, **kw)
        _same_requests(res[False].requests.to_pandas(), res[True].requests.to_pandas())
        _same_steps(res[False].steps.to_pandas(), res[True].steps.to_pandas())
        assert res[False].horizon_s == pytest.approx(res[True].horizon_s, rel=RTOL)


@pytest.fixture
def run_counter(monkeypatch):
    """Per fused plain-decode run: its pieces, the completions inside it (before its end), the
    requests it admitted that were waiting when it started and those that arrived during it
    (`sim.fusion.fused_run`: a run through completions; `sim.fusion.plan_absorbing`: one that also admits)."""
    from sim import fusion

    seen: list[dict[str, int]] = []
    inner, plan = fusion.fused_run, fusion.plan_absorbing

    def counted(self, segs):
        seen.append({"pieces": len(segs), "inside": len(segs) - 1, "at_start": 0, "during": 0})
        return (yield from inner(self, segs))

    def planned(self):
        waiting = set(self.waiting)
        p = plan(self)
        if p is not None:
            end_s, _, rows, (done, _), admitted, *_ = p
            at_start = sum(rid in waiting for rid, _, _ in admitted)
            seen.append({"pieces": len(rows), "inside": sum(t < end_s for t in done), "at_start": at_start,
                         "during": len(admitted) - at_start})
        return p

    piece_run = fusion.run_piece

    def pieces(self, piece, feed=None):  # a piece of the rack's joint plan (least outstanding) or a closed loop's (sim/joint.py)
        waiting = set(self.waiting)
        at_start = sum(rid in waiting for rid, _ in piece.admitted)
        seen.append({"pieces": piece.steps, "inside": sum(c for t, c in piece.gone if t < piece.end_s),
                     "at_start": at_start, "during": len(piece.admitted) - at_start})
        return (yield from piece_run(self, piece, feed))

    patch_fusion(monkeypatch, "fused_run", counted)
    patch_fusion(monkeypatch, "plan_absorbing", planned)
    patch_fusion(monkeypatch, "run_piece", pieces)
    return seen


@pytest.mark.parametrize(("name", "chains", "admits"), [
    ("light", True, "during"), ("4-replicas-least", True, "during"), ("2-replicas-rr", True, "during"),
    ("no-chunked-prefill", True, "during"), ("separate", True, ""), ("closed", True, "during"),
    ("closed-trtllm", True, "during"), ("closed-think-2-replicas", False, ""), ("gated", False, "")])
def test_runs_go_on_through_completions_and_arrivals_only_where_nothing_reacts(
        make_scenario, run_counter, name: str, chains: bool, admits: str) -> None:
    """Open loop: a run whose last step completes a sequence goes on with the smaller batch; with
    mixed prefill and one replica or round robin (the arrivals that reach a replica are known) a
    run also admits the requests waiting when it starts and those that arrive during it, in the
    mixed steps the unfused loop takes (exact: the matrix above), and so do the pieces of the joint
    plan of replicas under least outstanding (sim/joint.py); with separate prefill a run admits
    nothing. A closed loop of one replica whose clients send at once
    (no think time, no arrival gate) plans the sends its completions make, so it goes on too; with
    think times over two replicas, or behind max_concurrency (arrival times gate the sends), a
    completion ends the run and the run admits nothing."""
    sc = make_scenario(**_MATRIX[name])
    sim = simulate(sc.with_overrides({"sim.fuse_steps": True}), 1)
    assert run_counter and (max(r["pieces"] for r in run_counter) > 1) == chains
    done = int(sim.requests.completion_s.notna().sum())
    if chains:  # most completions fall inside a run, not at its end
        assert sum(r["inside"] for r in run_counter) > 0.3 * done
    at_start, during = (sum(r[k] for r in run_counter) for k in ("at_start", "during"))
    assert during > 0.5 * len(sim.requests) if admits == "during" else during == 0
    if not admits:
        assert at_start == 0


def test_sliding_window_models_do_not_fuse(make_scenario) -> None:
    """gpt-oss's windowed layers read min(context, window) per sequence: not affine, so no fusion."""
    sc = make_scenario(rack={"gpu": "h100-sxm", "num_gpus": 1},
                       deployment={"model": "gpt-oss-20b", "tensor_parallel": 1, "weights": "mxfp4"},
                       workload={"rate_rps": 1.0, "duration_s": 20.0})
    assert not build_runtime(sc).cost.affine_in_context
    res = simulate(sc, 1)
    assert (res.steps["count"] == 1).all() and res.summary["completed_requests"] > 0


# ----------------------------------------------------------------------------- speculative runs

_DRAFT = {"method": "draft_model", "draft_model": "llama-3.2-1b", "num_speculative_tokens": 4}
_SPEC_MATRIX = {
    "draft-fixed": dict(speculative=_DRAFT, workload={"rate_rps": 2.0, "duration_s": 40.0, "warmup_s": 3.0}),
    "ngram-spread": dict(speculative={"method": "ngram", "num_speculative_tokens": 3},
                         workload={"rate_rps": 2.0, "duration_s": 40.0,
                                   "classes": [{"name": "chat", "share": 1.0, "acceptance": 0.6, "acceptance_spread": 0.2}]}),
    "eagle-adaptive-decay": dict(speculative={"method": "eagle", "num_speculative_tokens": 5, "policy": "adaptive",
                                              "acceptance_decay": 0.9},
                                 workload={"rate_rps": 3.0, "duration_s": 40.0}),
    "draft-adaptive": dict(speculative={**_DRAFT, "policy": "adaptive"}, workload={"rate_rps": 4.0, "duration_s": 30.0}),
    "draft-disable-above-batch": dict(speculative={**_DRAFT, "policy": "disable_above_batch", "disable_batch_size": 4},
                                      workload={"rate_rps": 4.0, "duration_s": 40.0}),
    "draft-dedicated-separate": dict(rack={"gpu": "h100-sxm", "num_gpus": 5}, deployment={"engine": "vllm-0.6"},
                                     speculative={**_DRAFT, "placement": "dedicated", "draft_gpus": 1},
                                     workload={"rate_rps": 2.0, "duration_s": 40.0}),
    # (vLLM 0.6 refuses speculation with multi-step scheduling: the path, under another profile)
    "ngram-separate-multistep": dict(deployment={"engine": "sglang", "scheduler_steps": 4},
                                     speculative={"method": "ngram", "num_speculative_tokens": 3},
                                     workload={"rate_rps": 3.0, "duration_s": 30.0, "warmup_s": 5.0}),
    # vLLM 0.6's speculation: batch expansion, serial per-token output processing, a TP-1 draft
    "draft-vllm06-batch-expansion": dict(deployment={"engine": "vllm-0.6"},
                                         speculative={**_DRAFT, "draft_tensor_parallel": 1},
                                         workload={"rate_rps": 3.0, "duration_s": 30.0}),
    "draft-vllm06-adaptive": dict(deployment={"engine": "vllm-0.6"}, speculative={**_DRAFT, "policy": "adaptive"},
                                  workload={"rate_rps": 4.0, "duration_s": 30.0}),
    "eagle3-sglang05-capped": dict(deployment={"engine": "sglang-0.5"},
                                   speculative={"method": "eagle3", "num_speculative_tokens": 3},
                                   workload={"rate_rps": 5.0, "duration_s": 30.0}),
    "eagle3-tree": dict(speculative={"method": "tree", "tree_drafter": "eagle3", "num_speculative_tokens": 4,
                                     "tree_branching": [2, 2, 1, 1]}, workload={"rate_rps": 3.0, "duration_s": 30.0}),
    "draft-profile-disable": dict(speculative={**_DRAFT, "acceptance_profile": [1.0, 0.9, 0.7, 0.5],
                                               "policy": "disable_above_batch", "disable_batch_size": 5},
                                  workload={"rate_rps": 3.0, "duration_s": 30.0}),
    "tree-2-replicas-least": dict(rack={"gpu": "h100-sxm", "num_gpus": 8},
                                  speculative={"method": "tree", "num_speculative_tokens": 3, "tree_branching": [3, 1, 1]},
                                  workload={"rate_rps": 6.0, "duration_s": 25.0}),
    "2-replicas-rr": dict(rack={"gpu": "h100-sxm", "num_gpus": 8}, deployment={"router": "round_robin"},
                          speculative=_DRAFT, workload={"rate_rps": 4.0, "duration_s": 30.0}),
    "2-replicas-least": dict(rack={"gpu": "h100-sxm", "num_gpus": 8}, speculative=_DRAFT,
                             workload={"rate_rps": 5.0, "duration_s": 30.0}),
    "3-replicas-least-chunked": dict(rack={"gpu": "h100-sxm", "num_gpus": 12}, deployment={"max_num_batched_tokens": 512},
                                     speculative=_DRAFT, workload={"rate_rps": 6.0, "duration_s": 30.0}),
    "2-replicas-rr-full": dict(rack={"gpu": "h100-sxm", "num_gpus": 8}, deployment={"max_num_seqs": 8, "router": "round_robin"},
                               speculative=_DRAFT, workload={"rate_rps": 20.0, "duration_s": 20.0}, sim={"backlog_limit": 30}),
    "2-replicas-least-backlog": dict(rack={"gpu": "h100-sxm", "num_gpus": 8}, deployment={"max_num_seqs": 8},
                                     speculative=_DRAFT, workload={"rate_rps": 20.0, "duration_s": 30.0},
                                     sim={"backlog_limit": 30}),
    "closed-trtllm": dict(deployment={"engine": "trtllm"}, speculative={**_DRAFT, "policy": "disable_above_batch",
                                                                        "disable_batch_size": 5},
                          workload={"arrival": "closed", "concurrency": 8, "num_requests": 120, "rate_rps": None,
                                    "duration_s": 60.0, "warmup_s": 10.0}),
    "closed": dict(speculative=_DRAFT, workload={"arrival": "closed", "concurrency": 8, "num_requests": 120,
                                                 "rate_rps": None, "duration_s": 60.0, "warmup_s": 10.0}),
}


def _same_kv(unfused: pd.DataFrame, fused: pd.DataFrame) -> None:
    """KV blocks in use after every step (speculative runs keep one row per step)."""
    def kv(t: pd.DataFrame) -> np.ndarray:
        return t.sort_values(["replica", "start_s"], kind="stable").kv_blocks_used.to_numpy()

    np.testing.assert_array_equal(kv(fused), kv(unfused))


@pytest.fixture
def spec_run_counter(monkeypatch):
    """Counts the steps advanced by fused speculative runs (`sim.fusion.spec_run` and
    `sim.fusion.spec_steps_run`; "absorbing": the latter's runs that admitted arrivals)."""
    from sim import fusion

    seen = {"runs": 0, "steps": 0, "absorbing": 0}

    def counting(name: str):
        inner = getattr(fusion, name)

        def counted(self, *args):
            steps = yield from inner(self, *args)
            seen["runs"] += bool(steps)
            seen["steps"] += steps
            if args and (args[0] is True or name == "run_piece"):
                seen["absorbing"] += bool(steps)
            return steps

        patch_fusion(monkeypatch, name, counted)

    counting("spec_run")
    counting("spec_steps_run")
    counting("run_piece")
    return seen


@pytest.mark.parametrize("name", list(_SPEC_MATRIX))
def test_speculative_fused_equals_unfused(make_scenario, spec_run_counter, name: str) -> None:
    """Fused speculative runs draw the uniforms the unfused loop would draw, in its order, and price
    every step with the same operations: the request table, the summary and the step table are the
    unfused engine's (in practice to the last bit)."""
    sc = make_scenario(**_SPEC_MATRIX[name])
    on = simulate(sc.with_overrides({"sim.fuse_steps": True}), 1)
    fused = dict(spec_run_counter)
    off = simulate(sc.with_overrides({"sim.fuse_steps": False}), 1)
    assert spec_run_counter == fused, "the unfused engine fused"
    _same_requests(off.requests, on.requests)
    assert not _close({k: v for k, v in off.summary.items() if k != "scenario"},
                      {k: v for k, v in on.summary.items() if k != "scenario"})
    _same_steps(off.steps, on.steps)
    _same_kv(off.steps, on.steps)
    assert on.requests.verify_steps.sum() > 0
    # fusion happened: most steps were advanced inside fused runs, several steps a run
    assert fused["steps"] >= 0.5 * len(off.steps) and fused["steps"] >= 2 * fused["runs"], fused


@pytest.mark.parametrize(("name", "chains"), [("draft-fixed", True), ("2-replicas-rr", True), ("2-replicas-least", True),
                                           ("2-replicas-least-backlog", True), ("draft-disable-above-batch", True),
                                           ("draft-adaptive", True), ("closed", True), ("closed-trtllm", True),
                                           ("2-replicas-rr-full", False)])
def test_speculative_runs_go_on_through_completions_only_where_nothing_reacts(
        make_scenario, monkeypatch, name: str, chains: bool) -> None:
    """A speculative run goes on through its sequences' completions with the smaller batch (an
    open loop, nothing waiting): many completions fall inside runs. With requests waiting for a
    slot (an overloaded rack: a completion admits one) a replica's own run ends at its first
    completion; the joint plan of replicas under least outstanding (sim/joint.py) plans that
    admission too, so its pieces go on."""
    from sim import fusion

    seen = {"runs": 0, "segments": 0, "inside": 0}
    plan_seg, plan_steps = fusion.plan_spec_segment, fusion.plan_spec_steps

    def counting(name: str):
        inner = getattr(fusion, name)

        def counted(self, *args):
            before = seen["segments"]
            steps = yield from inner(self, *args)
            if steps:
                seen["runs"] += 1
            else:
                seen["segments"] = before
            return steps

        patch_fusion(monkeypatch, name, counted)

    def planned(self, *args):
        seg = plan_seg(self, *args)
        if seg is not None:
            seen["segments"] += 1
        return seg

    def planned_steps(self, *args):
        got = plan_steps(self, *args)
        if got is not None:  # completions before the run's end
            seen["inside"] += sum(count for t, count in got[8] if t < got[0])
        return got

    counting("spec_run")
    counting("spec_steps_run")
    piece_run = fusion.run_piece

    def piece_counted(self, piece, feed=None):
        seen["inside"] += sum(c for t, c in piece.gone if t < piece.end_s)
        seen["runs"] += 1
        return (yield from piece_run(self, piece, feed))

    patch_fusion(monkeypatch, "run_piece", piece_counted)
    patch_fusion(monkeypatch, "plan_spec_segment", planned)
    patch_fusion(monkeypatch, "plan_spec_steps", planned_steps)
    sim = simulate(make_scenario(**_SPEC_MATRIX[name]).with_overrides({"sim.fuse_steps": True}), 1)
    assert seen["runs"] > (0 if chains else 20)
    # each segment but a run's last ended with a completion
    inside = seen["inside"] + max(0, seen["segments"] - seen["runs"])
    done = int(sim.requests.completion_s.notna().sum())
    if chains:
        assert inside > 0.2 * done, (seen, done)
    else:
        assert inside == 0, seen


def test_speculative_fused_equals_unfused_under_kv_pressure(make_scenario, spec_run_counter) -> None:
    """Preemption with k + 1 tokens reserved and the rejected ones released: runs stop before a
    reservation that would not fit."""
    from models.catalog import get_gpu

    base = make_scenario(speculative=_DRAFT)
    plan = build_runtime(base).plan
    need = plan.weight_bytes + plan.activation_bytes + plan.runtime_bytes + plan.extra_bytes
    util = (need + 4096 * plan.kv_bytes_per_token) / get_gpu("h100-sxm").hbm_bytes
    sc = make_scenario(speculative=_DRAFT, deployment={"gpu_memory_utilization": round(util, 6)},
                       workload={"rate_rps": 8.0, "duration_s": 20.0, "warmup_s": 2.0}, sim={"drain_s": 1e4})
    on, off = _both(sc)
    assert off.summary["preemptions"] > 0 and spec_run_counter["steps"] > 0
    _same_requests(off.requests, on.requests)
    _same_steps(off.steps, on.steps)
    _same_kv(off.steps, on.steps)


def test_speculative_runs_capped_by_draws_continue_exactly(make_scenario, monkeypatch, spec_run_counter) -> None:
    """A run capped by FUSE_MAX_DRAWS (few steps a run at a large batch) ends where the next one
    starts: still the unfused engine's tables."""
    from sim import fusion

    monkeypatch.setattr(fusion, "FUSE_MAX_DRAWS", 64)
    sc = make_scenario(speculative=_DRAFT, workload={"rate_rps": 6.0, "duration_s": 20.0})
    on, off = _both(sc)
    assert spec_run_counter["steps"] >= 2 * spec_run_counter["runs"] > 0
    _same_requests(off.requests, on.requests)
    _same_steps(off.steps, on.steps)
    _same_kv(off.steps, on.steps)


def test_step_log_blocks_keep_every_row_in_order() -> None:
    """The block-wise step log (single appends, packed rows, and whole blocks of speculative rows,
    across block boundaries) gives back every row, in order; a packed row holds the doubles the
    log makes of its values (whole numbers included)."""
    from sim.tables import STEP_COLUMNS, StepLog, pack_rows

    rng = np.random.default_rng(0)
    log = StepLog(8)
    log.BLOCK_ROWS = 16
    ref: list[np.ndarray] = []
    for _ in range(400):
        u = rng.random()
        if u < 0.35:
            row = rng.random(len(STEP_COLUMNS))
            log.append(tuple(row))
            ref.append(row[None, :])
        elif u < 0.6:
            rows = rng.random((int(rng.integers(0, 40)), len(STEP_COLUMNS)))
            rows[:, 0] = rng.integers(0, 2**40, rows.shape[0])  # (ints as the engine logs them)
            log.extend_packed(pack_rows([(int(r[0]), *map(float, r[1:])) for r in rows]))
            ref.append(rows)
        else:
            rows = rng.random((int(rng.integers(1, 40)), len(STEP_COLUMNS)))
            log.block(rows.shape[0])[:] = rows
            ref.append(rows)
    np.testing.assert_array_equal(log.table(), np.concatenate(ref))
    assert log.n == len(log.table())
    # the column arrays the step table is built from: the same rows, integer columns as int64
    cols = log.columns(("count",))
    assert list(cols) == list(STEP_COLUMNS) and cols["count"].dtype == np.int64
    whole = np.concatenate(ref)
    for j, c in enumerate(STEP_COLUMNS):
        np.testing.assert_array_equal(cols[c], whole[:, j].astype(cols[c].dtype))
    assert log.n == 0 and len(log.table()) == 0  # the log hands its rows over


def test_step_sums_many_is_bit_identical() -> None:
    """The vectorised step cost a fused speculative run uses is `step_sums`, bit for bit."""
    rng = np.random.default_rng(2)
    for model, tp in (("llama-3.1-70b", 4), ("llama-3.2-1b", 1), ("mixtral-8x7b", 2)):
        cm = CostModel(model, "h100-sxm", tp)
        for n, q in ((1, 1), (5, 5), (64, 3), (300, 2)):
            ctx = rng.integers(0, 4000 * n, 50).astype(np.float64)
            pairs = ctx * q + n * q * (q + 1) / 2.0
            for over in (True, False):
                total, flops, nbytes = cm.step_sums_many(n, n * q + 0.0, ctx, pairs, step_overhead=over)
                ones = [cm.step_sums(n, n * q + 0.0, c, p, step_overhead=over) for c, p in zip(ctx, pairs, strict=True)]
                assert total.tolist() == [o.total_s for o in ones]
                assert flops.tolist() == [o.flops for o in ones]
                assert nbytes.tolist() == [o.bytes for o in ones]


@pytest.mark.parametrize("spec", [_DRAFT, {"method": "eagle", "num_speculative_tokens": 5},
                                  {**_DRAFT, "draft_model": "qwen2.5-0.5b"}])
def test_speculative_step_costs_of_a_run_are_the_ordinary_steps_bit_for_bit(make_scenario, spec) -> None:
    """A fused speculative run prices its steps with `StepPricer.spec_cost_many` (numpy over many steps, scalars
    over a few) and its first with `StepPricer.spec_step`: each is the ordinary step's `StepPricer.spec_cost`, to the last bit."""
    import simpy

    from sim.engine import Replica
    from sim.pricing import SPEC_SCALAR_STEPS
    from sim.tables import Requests, StepLog

    model = {"model": "qwen2.5-7b", "tensor_parallel": 1} if spec.get("draft_model") == "qwen2.5-0.5b" else {}
    sc = make_scenario(speculative=spec, deployment=model, rack={"gpu": "h100-sxm", "num_gpus": 4 if not model else 1})
    rt = build_runtime(sc)
    one = np.zeros(1)
    rep = Replica(simpy.Environment(), 0, rt, Requests(one, one.astype(np.int64) + 1, one.astype(np.int64) + 1, one),
                  np.random.default_rng(0), StepLog())
    rng = np.random.default_rng(3)
    for speculating in (True, False):
        rep.price.speculating = speculating
        for n in (1, 2, 7, 64):
            for k in (0, 1, 4):
                for steps in (1, 5, SPEC_SCALAR_STEPS, SPEC_SCALAR_STEPS + 9):
                    ctx = np.sort(rng.integers(n, 3000 * n, steps)).astype(np.float64)
                    many = rep.price.spec_cost_many(n, ctx, k)
                    ones = [rep.price.spec_cost(n, c, k, 0, 0.0, 0.0, 0.0) for c in ctx.tolist()]
                    for col in range(6):
                        got = np.broadcast_to(np.asarray(many[col], dtype=np.float64), ctx.shape).tolist()
                        assert got == [o[col] for o in ones], (n, k, steps, col)
                    assert [rep.price.spec_step(n, c, k) for c in ctx.tolist()] == ones


def _segment_columns(seg: Any) -> dict[str, Any]:
    """A speculative segment's figures over its own steps (arrays may run past them)."""
    st = seg.steps.to_pandas()
    out: dict[str, Any] = {}
    for f in seg._fields:
        v = getattr(seg, f)
        if f == "starts":
            v = np.asarray(v)[:st + 1].tolist()
        elif f in ("total", "target", "over", "flops", "nbytes", "per_step"):
            v = np.asarray(v)[:st].tolist()
        elif f == "draft":
            v = [v] * st if np.ndim(v) == 0 else np.asarray(v)[:st].tolist()
        elif isinstance(v, np.ndarray):
            v = v.tolist()
        out[f] = v
    return out


@pytest.mark.parametrize("name", ["draft-fixed", "ngram-spread", "draft-disable-above-batch", "2-replicas-rr", "closed"])
def test_array_planned_speculative_runs_are_the_unfused_engine(make_scenario, monkeypatch, spec_run_counter,
                                                              name: str) -> None:
    """Large batches of a plain chain are planned by numpy's arrays (`sim.fusion.spec_run`,
    `sim.fusion.plan_spec_segment`) instead of step by step: forced on every batch, still the unfused engine."""
    from sim import fusion

    monkeypatch.setattr(fusion, "SPEC_STEP_SEQS", 0)  # (`fused_steps` chooses between the two planners)
    on, off = _both(make_scenario(**_SPEC_MATRIX[name]))
    assert spec_run_counter["steps"] >= 2 * spec_run_counter["runs"] > 0
    _same_requests(off.requests, on.requests)
    _same_steps(off.steps, on.steps)
    _same_kv(off.steps, on.steps)


_STAT_SEEDS = 20


@pytest.mark.parametrize("spec", [_DRAFT, {"method": "eagle", "num_speculative_tokens": 5, "policy": "adaptive"}],
                         ids=["draft-fixed", "eagle-adaptive"])
def test_speculative_fusion_agrees_statistically(make_scenario, spec: dict[str, Any]) -> None:
    """Independent of the exact agreement above: fused runs over 20 seeds against unfused runs over
    20 other seeds. Per-seed means of TTFT, TPOT, ITL, E2E and throughput agree within their
    two-sample CI (|difference| < 3.5 standard errors), and so do the per-seed ITL p50, p90 and p99
    (ITL gaps are not independent draws: every sequence of a step shares its gap, successive steps
    are correlated, so a KS test over pooled gaps rejects two sets of unfused seeds too); two-sample
    KS on the pooled per-request TTFT, TPOT and E2E (p > 0.001); and draft tokens accepted per verification
    + 1 match the closed form (1 - a^(k+1)) / (1 - a) within the CI over seeds (fixed k: the
    per-token acceptance a = 0.8 of every request)."""
    from scipy import stats

    from models.speculative import expected_tokens
    from sim.metrics import request_latencies

    # small runs, many seeds (the adaptive policy's unfused steps are the slowest: shorter runs)
    duration = 20.0 if spec.get("policy", "fixed") == "fixed" else 12.0
    sc = make_scenario(speculative=spec, workload={"rate_rps": 2.0, "duration_s": duration, "warmup_s": 2.0})
    keys = ("ttft_s", "tpot_s", "itl_s", "e2e_s")
    per: dict[bool, dict[str, list[float]]] = {}
    pooled: dict[bool, dict[str, list[np.ndarray]]] = {}
    for fuse, first in ((True, 1), (False, 101)):
        s = sc.with_overrides({"sim.fuse_steps": fuse})
        per[fuse] = {k: [] for k in (*keys, "throughput_tok_s", "tokens_per_verify", "itl_p50", "itl_p90", "itl_p99")}
        pooled[fuse] = {k: [] for k in ("ttft_s", "tpot_s", "e2e_s")}
        for seed in range(first, first + _STAT_SEEDS):
            res = simulate(s, seed)
            for k in keys:
                per[fuse][k].append(res.summary[k]["mean"])
            per[fuse]["throughput_tok_s"].append(res.summary["throughput_tok_s"])
            for p in (50, 90, 99):
                per[fuse][f"itl_p{p}"].append(res.summary["itl_s"][f"p{p}"])
            r = res.requests
            per[fuse]["tokens_per_verify"].append(1.0 + r.draft_accepted.sum() / r.verify_steps.sum())
            lat = request_latencies(r).to_pandas()
            for k in ("ttft_s", "tpot_s", "e2e_s"):
                pooled[fuse][k].append(lat[k].dropna().to_numpy())
    for k in per[True]:
        a, b = np.asarray(per[True][k]), np.asarray(per[False][k])
        se = np.sqrt(a.var(ddof=1) / a.size + b.var(ddof=1) / b.size)
        assert abs(a.mean() - b.mean()) < 3.5 * se, (k, a.mean(), b.mean(), se)
    for k in pooled[True]:
        x, y = np.concatenate(pooled[True][k]), np.concatenate(pooled[False][k])
        assert stats.ks_2samp(x, y).pvalue > 1e-3, k
    if spec.get("policy", "fixed") == "fixed":
        closed = float(expected_tokens(0.8, spec["num_speculative_tokens"]))
        for fuse in (True, False):
            t = np.asarray(per[fuse]["tokens_per_verify"])
            assert abs(t.mean() - closed) < 3.5 * t.std(ddof=1) / np.sqrt(t.size), (fuse, t.mean(), closed)


def test_run_steps_full_expands_the_runs(tmp_path, example_path) -> None:
    from experiments.cli import main

    short = ["--set", "workload.duration_s=40", "--set", "workload.warmup_s=5", "--set", "workload.utilisation=0.3"]
    assert main(["run", str(example_path), "--out", str(tmp_path / "runs"), *short]) == 0
    assert main(["run", str(example_path), "--out", str(tmp_path / "full"), "--steps", "full", *short]) == 0
    runs = pd.read_parquet(tmp_path / "runs" / "steps.parquet")
    full = pd.read_parquet(tmp_path / "full" / "steps.parquet")
    assert runs["count"].max() > 1 and (full["count"] == 1).all()
    assert len(full) == int(runs["count"].sum())
    assert full.emitted_tokens.sum() == runs.emitted_tokens.sum()
    assert full.duration_s.sum() == pytest.approx(runs.duration_s.sum(), rel=1e-12)


def test_run_length_metrics_match_their_expansion() -> None:
    """Random run-length tables: the closed-form queue-growth slope and the expanded ITL gaps
    agree with the same figures computed over one row per step."""
    from sim.metrics import _run_slope, dist, queue_growth_rps, step_gaps, step_starts

    rng = np.random.default_rng(1)
    for _ in range(200):
        k = int(rng.integers(1, 30))
        cnt = rng.integers(1, 40, k) * (rng.random(k) < 0.6) + 1
        d0 = rng.uniform(0.01, 0.05, k)
        slope = rng.uniform(0, 1e-6, k) * (cnt > 1)
        total = cnt * d0 + slope * cnt * (cnt - 1) / 2
        start = 100 + np.concatenate([[0], np.cumsum(total)[:-1]]) + rng.uniform(0, 0.1, k)
        g = pd.DataFrame({"start_s": start, "chunk_gap_s": d0, "gap_step_s": slope, "count": cnt,
                          "waiting": rng.integers(0, 9, k), "replica": 0, "decode_seqs": rng.integers(1, 50, k)})
        rows, x = step_starts(g)
        if x.size >= 3:
            y = g.waiting.to_numpy(np.float64)[rows]
            dx = x - x.mean()
            ref = (dx * (y - y.mean())).sum() / (dx * dx).sum()
            cols = {c: g[c].to_numpy(np.float64) for c in ("start_s", "waiting", "count", "chunk_gap_s", "gap_step_s")}
            assert _run_slope(cols) == pytest.approx(ref, rel=1e-9, abs=1e-9)
            assert queue_growth_rps(g) == pytest.approx(_run_slope(cols), rel=1e-12, abs=1e-15)  # one replica: its slope
        gaps, w = step_gaps(g)
        j = np.concatenate([np.arange(c) for c in cnt])
        np.testing.assert_allclose(gaps, np.repeat(d0, cnt) + j * np.repeat(slope, cnt), rtol=1e-14)
        assert dist(gaps, w)["p90"] == dist(np.repeat(d0, cnt) + j * np.repeat(slope, cnt), np.repeat(g.decode_seqs, cnt))["p90"]


def test_interval_itl_from_run_length_rows_matches_the_expansion(make_scenario) -> None:
    """The intervals table's ITL, from each interval's run-length rows (`gap_dist`), is the
    weighted distribution of the expanded steps starting in it: the same percentiles, exactly."""
    from sim.metrics import dist, step_gaps

    sc = make_scenario(workload={"rate_rps": 2.0, "duration_s": 60.0}, sim={"interval_s": 15.0})
    res = simulate(sc, 1)
    assert (res.steps["count"] > 1).any()
    gaps, w = step_gaps(res.steps)
    start = np.repeat(res.steps.start_s.to_numpy(), res.steps["count"].to_numpy())
    assert len(res.intervals) >= 4
    for row in res.intervals.itertuples():
        inside = (start >= row.start_s) & (start < row.end_s)
        ref = dist(gaps[inside], w[inside])
        for p in ("p50", "p90", "p99"):
            assert getattr(row, f"itl_s_{p}") == ref[p]
        assert row.itl_s_mean == pytest.approx(ref["mean"], rel=1e-12)


def test_itl_percentiles_from_run_length_rows_without_expanding() -> None:
    """`gap_dist` / `gap_moments` (what the summary and the benchmark figures use) pick exactly the
    percentiles the expanded gaps give, with ties, flat runs, one-step rows and clustered values;
    mean and standard deviation to rounding."""
    from sim.metrics import _stats, dist, gap_dist, gap_moments, step_gaps

    rng = np.random.default_rng(4)
    for _ in range(120):
        k = int(rng.integers(1, 60))
        cnt = rng.integers(1, 40, k) * (rng.random(k) < 0.6) + 1
        d0 = rng.choice(rng.uniform(0.01, 0.05, 4), k) + (rng.random(k) < 0.5) * rng.uniform(0, 1e-4, k)
        slope = rng.choice([0.0, 1e-9, 1e-7, 3e-6], k) * (cnt > 1)
        g = pd.DataFrame({"chunk_gap_s": d0, "gap_step_s": slope, "count": cnt, "decode_seqs": rng.integers(1, 50, k)})
        ref, got = dist(*step_gaps(g)), gap_dist(g)
        assert got["mean"] == pytest.approx(ref["mean"], rel=1e-12)
        assert {p: v for p, v in got.items() if p != "mean"} == {p: v for p, v in ref.items() if p != "mean"}
        st = _stats("itl", *step_gaps(g))
        mean, std, (p50, p90, p99) = gap_moments(g, (0.5, 0.9, 0.99))
        assert mean * 1e3 == pytest.approx(st["mean_itl_ms"], rel=1e-12)
        assert (st["median_itl_ms"], st["p90_itl_ms"], st["p99_itl_ms"]) == (p50 * 1e3, p90 * 1e3, p99 * 1e3)
        assert std * 1e3 == pytest.approx(st["std_itl_ms"], rel=1e-9, abs=1e-12)


def test_bench_fusion_quick_reports_both_engines() -> None:
    """`specrack bench --fusion ab --quick` (tiny here): both engines timed on each workload, with
    the ratios, steps/s and peak memory, on the same steps and results."""
    from experiments.bench import fusion_bench

    out = fusion_bench("ab", quick=True, quick_requests=120)
    for name in "ab":
        p = out[name]
        assert p["measured_requests"] == 120 and p["speedup"] > 0 and p["speedup_cpu"] > 0
        assert p["side_by_side"] == ((os.cpu_count() or 1) >= 2) and len(p["fused_runs_cpu_s"]) >= 1
        assert p["fused"]["cpu_s"] in p["fused_runs_cpu_s"]
        assert p["fused"]["steps"] == p["unfused"]["steps"] and p["e2e_mean_rel_diff"] < 1e-9
        assert p["fused"]["steps_per_s"] > 0 and p["fused"]["peak_rss_mib"] > 0
        assert p["fused"]["steps_per_request"] == p["unfused"]["steps_per_request"] > 1
        assert p["fused"]["cpu_us_per_request"] > 0 and p["fused"]["step_rows_per_request"] >= 1
    assert out["a"]["steps_per_row"] > 1 and out["b"]["steps_per_row"] == 1  # speculative runs keep a row per step


# ----------------------------------------------------------------------------- speculation meets the rest


def test_speculative_fusion_with_prefix_caching_is_exact(make_scenario, spec_run_counter) -> None:
    """Fused speculative runs only take blocks from `free_blocks` (free + evictable cached ones), so
    with a prefix cache in the pool (multi-turn conversations) they are still the unfused engine."""
    conv = {"turns": 3, "turn_gap_s": {"dist": "fixed", "value": 20.0},
            "growth_tokens": {"dist": "fixed", "value": 64}}
    sc = make_scenario(speculative=_DRAFT, workload={"rate_rps": 3.0, "duration_s": 40.0, "warmup_s": 3.0,
                                                      "conversations": conv})
    on, off = _both(sc)
    assert on.summary["cache_hit_rate"] > 0.2 and spec_run_counter["steps"] > 0
    _same_requests(off.requests, on.requests)
    _same_steps(off.steps, on.steps)
    _same_kv(off.steps, on.steps)


def test_follow_load_speculation_fuses_exactly(spec_run_counter) -> None:
    """speculative.policy = "follow_load": its switches happen at ticks that are fusion cuts, and a
    run priced while switched off has no machinery overhead, as the ordinary step."""
    from test_day import _day

    data = _day(12.0, 0.5, workload={"duration_s": 240.0, "rate_profile": {"shape": "diurnal", "peak_rps": 12.0,
                                                                          "trough_rps": 0.5, "day_s": 240.0}},
                speculative={**_DRAFT, "policy": "follow_load", "load_off_above": 0.45, "load_on_below": 0.35,
                             "load_interval_s": 20.0},
                sim={"interval_s": 30.0})
    on = simulate(scenario_from_dict(data), 1)
    off = simulate(scenario_from_dict({**data, "sim": {**data["sim"], "fuse_steps": False}}), 1)
    switches = on.run.follow_load or on.summary.get("speculation_switches")
    assert spec_run_counter["steps"] > 0
    _same_requests(off.requests, on.requests)
    _same_steps(off.steps, on.steps)
    assert (on.steps.k == 0).any() and (on.steps.k > 0).any(), switches  # it did switch off and on


@pytest.mark.parametrize("gpus", [4, 8])
def test_follow_load_switches_every_second_under_least_outstanding_fuse_exactly(make_scenario, gpus: int) -> None:
    """Ticks every second, switching often: a speculative run going on through completions under
    least outstanding recomputes its bound from a segment's end, which may lie past a tick (the
    segment's last step started before it); the run must still stop at the tick (found by review:
    without the clamp, steps after a switch kept the old k)."""
    sc = make_scenario(rack={"gpu": "h100-sxm", "num_gpus": gpus},
                       speculative={**_DRAFT, "policy": "follow_load", "load_interval_s": 1.0,
                                    "load_off_above": 0.1, "load_on_below": 0.08},
                       workload={"rate_rps": 2.5 * gpus / 4, "duration_s": 30.0})
    on = simulate(sc.with_overrides({"sim.fuse_steps": True}), 1)
    off = simulate(sc.with_overrides({"sim.fuse_steps": False}), 1)
    assert (off.steps.k == 0).any() and (off.steps.k > 0).any()  # it switched off and on
    _same_requests(off.requests, on.requests)
    _same_steps(off.steps, on.steps)
    _same_kv(off.steps, on.steps)


@pytest.mark.parametrize("spec", [
    {"method": "self_spec", "num_speculative_tokens": 3},
    {"method": "tree", "num_speculative_tokens": 3, "tree_branching": [2, 2, 1], "policy": "adaptive"},
], ids=["self_spec", "tree-adaptive"])
def test_general_speculation_methods_are_not_fused(make_scenario, spec_run_counter, spec) -> None:
    """A windowed self-draft's cost is not affine in the context, and the adaptive policy over a
    tree chooses k over arrays: they run step by step (still exact, trivially)."""
    sc = make_scenario(speculative=spec, workload={"rate_rps": 1.0, "duration_s": 15.0})
    res = simulate(sc, 1)
    assert spec_run_counter["runs"] == 0 and (res.steps["count"] == 1).all()


def test_fused_equals_unfused_at_a_backlog_stop_while_another_replica_preempts(make_scenario) -> None:
    """Round robin over two replicas, one with short requests (its runs admit them), the other
    with long ones under a ~4k-token KV cache (it preempts, putting requests back in its queue),
    stopped by the backlog limit: the stop comes at the same arrival as unfused. Found by review:
    the requests a run had admitted were still counted as waiting until the run ended, and the
    end bound left out the queue growth that preemptions elsewhere cause (now bounded by what the
    other replicas have outstanding)."""
    from models.catalog import get_gpu

    plan = build_runtime(make_scenario()).plan
    need = plan.weight_bytes + plan.activation_bytes + plan.runtime_bytes + plan.extra_bytes
    util = (need + 4096 * plan.kv_bytes_per_token) / get_gpu("h100-sxm").hbm_bytes
    sc = make_scenario(rack={"gpu": "h100-sxm", "num_gpus": 8},
                       deployment={"router": "round_robin", "gpu_memory_utilization": round(util, 6)},
                       sim={"drain_s": 300.0})
    rng = np.random.default_rng(0)
    n = 200
    idx = np.arange(n)
    table = pd.DataFrame({"id": idx, "arrival_s": np.sort(rng.uniform(0, 40, n)),
                          "prompt_tokens": np.where(idx % 2 == 0, rng.integers(20, 200, n), rng.integers(1200, 2000, n)),
                          "output_tokens": np.where(idx % 2 == 0, rng.integers(1, 300, n), rng.integers(300, 800, n)),
                          "cls": np.zeros(n, dtype=np.int64), "accept_q": np.full(n, 0.5)})
    res = {}
    for fuse in (True, False):
        s = sc.with_overrides({"sim.fuse_steps": fuse})
        res[fuse] = run_table(s, build_runtime(s), table, 1, backlog_limit=8)
    assert res[False].truncated and res[True].truncated  # both stopped by the backlog
    assert int(res[False].requests.to_pandas().preemptions.sum()) > 0
    _same_requests(res[False].requests.to_pandas(), res[True].requests.to_pandas())
    _same_steps(res[False].steps.to_pandas(), res[True].steps.to_pandas())


@pytest.mark.parametrize("spec", [None, _DRAFT], ids=["plain", "draft"])
@pytest.mark.parametrize("engine", ["vllm-v1", "trtllm"])
def test_closed_loop_capacity_is_the_unfused_engines(make_scenario, engine: str, spec: dict[str, Any] | None) -> None:
    """Capacity's closed loops (one replica, each completion sends the next request: runs plan the
    sends, with the frontend's latency on vLLM V1 and none on TensorRT-LLM) measure what the
    unfused engine measures: throughput, tokens and mean batch to 1e-9, below and above the slots."""
    from sim.capacity import closed_loop_throughput

    sc = make_scenario(deployment={"engine": engine, "max_num_seqs": 24}, speculative=spec)
    for n in (3, 20, 30):
        got = [closed_loop_throughput(sc.with_overrides({"sim.fuse_steps": fuse}), n, 2, completions=300)
               for fuse in (True, False)]
        assert got[0] == pytest.approx(got[1], rel=1e-9), (n, got)


def test_the_router_checks_the_joint_plans_routing(make_scenario, monkeypatch) -> None:
    """The arrival process routes every request itself and checks it against where the joint plan
    sent it: a router that disagrees with the plan fails loudly instead of running on a wrong
    plan (here the router is made to send every request to the other replica)."""
    from sim import run

    route = run._route

    def contrary(replicas, router, rr, rid):
        r = route(replicas, router, rr, rid)
        return replicas[1 - r.idx]

    sc = make_scenario(rack={"gpu": "h100-sxm", "num_gpus": 8}, workload={"rate_rps": 5.0, "duration_s": 20.0})
    simulate(sc, 1)  # (agrees with itself)
    monkeypatch.setattr(run, "_route", contrary)
    with pytest.raises(AssertionError, match="the joint plan routed it to replica"):
        simulate(sc, 1)


def test_a_replica_is_not_planned_up_to_arrivals_that_cannot_change_its_count(make_scenario, monkeypatch) -> None:
    """The joint plan routes each arrival on every replica's count at it. Once a replica's next
    steps are plain decode that cannot end a sequence (or run short of KV blocks) before the
    arrival, they are left for later and planned in one segment with the steps after it, instead
    of stopping at every arrival routed elsewhere. The same requests, exactly, as planning up to
    every arrival (switched back on here) and as the unfused engine; fewer step rows."""
    from sim import joint

    sc = make_scenario(rack={"gpu": "h100-sxm", "num_gpus": 16},
                       workload={"rate_rps": 12.0, "duration_s": 60.0,
                                 "prompt_tokens": {"dist": "lognormal", "median": 600, "p90": 1500},
                                 "output_tokens": {"dist": "lognormal", "median": 150, "p90": 400}})
    on, off = _both(sc)
    advance = joint.Cursor.advance
    monkeypatch.setattr(joint.Cursor, "advance",
                        lambda self, a, end_bound, fb, lazy=False: advance(self, a, end_bound, fb))
    eager = simulate(sc, 1)
    _same_requests(off.requests, on.requests)
    _same_requests(eager.requests, on.requests)
    _same_steps(off.steps, on.steps)
    assert len(on.steps) < 0.93 * len(eager.steps)  # (0.84 when written)


def _kv_fraction(sc, tokens: int) -> float:
    """The gpu_memory_utilization that leaves the scenario's deployment (on H100s) a paged KV of
    about `tokens` tokens."""
    from models.catalog import get_gpu

    plan = build_runtime(sc).plan
    need = plan.weight_bytes + plan.activation_bytes + plan.runtime_bytes + plan.extra_bytes
    return round((need + tokens * plan.kv_bytes_per_token) / get_gpu("h100-sxm").hbm_bytes, 6)


def _count_loop_pieces(monkeypatch) -> dict[str, int]:
    """Counts of the closed loops' pieces (`sim.joint.loop_piece`), their steps and preemptions."""
    from sim import fusion, joint

    planned = {"pieces": 0, "steps": 0, "preempted": 0}
    inner = joint.loop_piece

    def counted(rep):
        got = inner(rep)
        if got is not None:
            planned["pieces"] += 1
            planned["steps"] += got[0].steps
            planned["preempted"] += len(got[0].preempted)
        return got

    monkeypatch.setattr(fusion, "loop_piece", counted)  # (where the engine's closed-loop runs call it)
    return planned


_LONG_PROMPTS = {"dist": "lognormal", "median": 1500, "p90": 4000}  # most longer than the budget: chunked


@pytest.mark.parametrize(("engine", "spec", "kv_tokens"), [
    ("vllm-v1", None, None), ("trtllm", None, None), ("vllm-v1", _DRAFT, None),
    ("trtllm", {"method": "eagle", "num_speculative_tokens": 3, "policy": "adaptive"}, None),
    ("vllm-v1", {"method": "eagle", "num_speculative_tokens": 3}, 24_000),
])
def test_closed_loop_chunked_prefills_are_planned_by_a_cursor(make_scenario, monkeypatch, engine: str,
                                                             spec: dict[str, Any] | None, kv_tokens: int | None) -> None:
    """A closed loop of one replica whose prompts are chunked (partial prefills in most steps: the
    capacity ladders' populations near the collapse) is planned by a cursor (`sim.joint.loop_piece`),
    its sends made at its completions, reaching the queue after the frontend's latency (vLLM) or
    at once (TensorRT-LLM), under KV pressure too: the request
    table, the summary and the step table are the unfused engine's, and the cursor planned most
    steps."""
    planned = _count_loop_pieces(monkeypatch)
    deployment: dict[str, Any] = {"engine": engine, "max_num_batched_tokens": 512}
    if kv_tokens:
        deployment["gpu_memory_utilization"] = _kv_fraction(make_scenario(), kv_tokens)
    sc = make_scenario(deployment=deployment, **({"speculative": spec} if spec else {}),
                       workload={"arrival": "closed", "concurrency": 24, "num_requests": 160, "rate_rps": None,
                                 "duration_s": 60.0, "warmup_s": 5.0, "prompt_tokens": _LONG_PROMPTS},
                       sim={"drain_s": 1e4})
    on, off = _both(sc)
    _same_requests(off.requests, on.requests)
    assert not _close({k: v for k, v in off.summary.items() if k != "scenario"},
                      {k: v for k, v in on.summary.items() if k != "scenario"})
    _same_steps(off.steps, on.steps)
    assert planned["steps"] >= 0.5 * len(off.steps), (planned, len(off.steps))
    if kv_tokens:
        assert off.summary["preemptions"] > 0
    if spec:
        _same_kv(off.steps, on.steps)
        assert on.requests.verify_steps.sum() > 0


_PREEMPTING = {
    "plain-chunked": ("vllm-v1", None, 8000, 512, True, _LONG_PROMPTS, 1),
    "plain-whole-prompts": ("trtllm", None, 12000, 2048, False, {"dist": "lognormal", "median": 600, "p90": 2000}, 3),
    "draft-k4": ("trtllm", {"method": "draft_model", "draft_model": "llama-3.2-1b", "num_speculative_tokens": 4},
                 6000, 2048, True, {"dist": "lognormal", "median": 600, "p90": 2000}, 5),
    "eagle-adaptive": ("vllm-v1", {"method": "eagle", "num_speculative_tokens": 3, "policy": "adaptive"},
                       10000, 1024, True, _LONG_PROMPTS, 6),
    "tree": ("vllm-v1", {"method": "tree", "tree_drafter": "eagle3", "num_speculative_tokens": 4,
                         "tree_branching": [2, 2, 1, 1]}, 10000, 1024, True, {"dist": "lognormal", "median": 600, "p90": 2000}, 8),
}


@pytest.mark.parametrize("name", list(_PREEMPTING))
def test_closed_loop_preemptions_are_planned_by_the_cursor(make_scenario, monkeypatch, name: str) -> None:
    """A closed loop of one replica whose KV cache holds a few sequences (the capacity ladders'
    full-load populations on KV-starved deployments) preempts at most steps. The cursor plans those
    steps as the ordinary step takes them (the youngest sequences out until the rest fit their
    reservation, back at the head of the queue with their output and draft counters, nothing
    admitted in that step; `Cursor._victims`, `Cursor._preempt`), so its pieces go on through
    preemptions: the request table (preemption counts included) and the step table are the unfused
    engine's, and pieces planned most steps."""
    engine, spec, kv_tokens, budget, chunked, prompts, seed = _PREEMPTING[name]
    planned = _count_loop_pieces(monkeypatch)
    util = _kv_fraction(make_scenario(), kv_tokens)
    sc = make_scenario(deployment={"engine": engine, "max_num_batched_tokens": budget, "chunked_prefill": chunked,
                                   "gpu_memory_utilization": util}, **({"speculative": spec} if spec else {}),
                       workload={"arrival": "closed", "concurrency": 32, "num_requests": 200, "rate_rps": None,
                                 "duration_s": 60.0, "warmup_s": 5.0, "prompt_tokens": prompts},
                       sim={"drain_s": 1e4})
    on, off = _both(sc, seed)
    _same_requests(off.requests, on.requests)
    assert not _close({k: v for k, v in off.summary.items() if k != "scenario"},
                      {k: v for k, v in on.summary.items() if k != "scenario"})
    _same_steps(off.steps, on.steps)
    assert int(off.requests.preemptions.sum()) > 20
    assert planned["preempted"] >= 0.8 * int(off.requests.preemptions.sum()), planned
    assert planned["steps"] >= 0.7 * len(off.steps), (planned, len(off.steps))


@pytest.mark.parametrize(("spec", "reps", "rate", "backlog"), [
    (None, 3, 6.0, None),
    ({"method": "draft_model", "draft_model": "llama-3.2-1b", "num_speculative_tokens": 2,
      "policy": "disable_above_batch", "disable_batch_size": 4}, 4, 8.0, 20),
])
def test_rack_preemptions_are_planned_by_the_joint_plan(make_scenario, monkeypatch, spec: dict[str, Any] | None,
                                                          reps: int, rate: float, backlog: int | None) -> None:
    """Least outstanding over replicas whose KV caches hold a few sequences: the joint plan's
    cursors plan the steps that preempt (`Cursor._victims`), and a replica's queue during a piece
    counts its victims from their step's start (`Replica.queued`, which the backlog stop reads:
    here after every arrival, against a limit the run reaches; and sampled every 37 ms). The
    request and step tables and the queues are the unfused engine's, and pieces planned most of
    the preemptions."""
    from sim import joint
    from sim import run as run_mod

    planned = {"preempted": 0}
    boundary = joint.RackPlanner.boundary

    def counted(self, rep):
        got = boundary(self, rep)
        if got is not None:
            planned["preempted"] += len(got.preempted)
        return got

    monkeypatch.setattr(joint.RackPlanner, "boundary", counted)
    inner = run_mod._arrivals
    probes: list[list[tuple[float, list[int]]]] = []

    def probed(env, *a, **k):
        # every replica's queue as `Replica.queued` shows it, every 37 ms (off the steps' grid)
        seen: list[tuple[float, list[int]]] = []
        probes.append(seen)

        def probe():
            while True:
                yield env.timeout(0.037)
                seen.append((env.now, [r.queued() for r in k["pool"]]))

        env.process(probe())
        return inner(env, *a, **{**k, "every": True})

    monkeypatch.setattr(run_mod, "_arrivals", probed)
    util = _kv_fraction(make_scenario(), 4000)
    sc = make_scenario(rack={"gpu": "h100-sxm", "num_gpus": 4 * reps},
                       deployment={"engine": "trtllm" if spec else "vllm-v1", "max_num_batched_tokens": 2048 if spec else 512,
                                   "gpu_memory_utilization": util},
                       **({"speculative": spec} if spec else {}),
                       workload={"rate_rps": rate, "duration_s": 120.0, "warmup_s": 5.0,
                                 "prompt_tokens": {"dist": "lognormal", "median": 600, "p90": 2000} if spec else _LONG_PROMPTS,
                                 "output_tokens": {"dist": "lognormal", "median": 200, "p90": 600}},
                       sim={"drain_s": 600.0, **({"backlog_limit": backlog} if backlog else {})})
    on, off = _both(sc, 32 if spec else 34)
    assert probes[0] == probes[1][:len(probes[0])] and len(probes[0]) > 1000
    _same_requests(off.requests, on.requests)
    assert not _close({k: v for k, v in off.summary.items() if k != "scenario"},
                      {k: v for k, v in on.summary.items() if k != "scenario"})
    _same_steps(off.steps, on.steps)
    total = int(off.requests.preemptions.sum())
    assert total > 50 and planned["preempted"] >= 0.5 * total, (planned, total)
    assert on.summary["truncated"] is bool(backlog)


def test_a_piece_lands_exactly_on_its_planned_end() -> None:
    """A planned piece ends at the very time its plan counted with, also where no single delay
    from its start lands there (an end over twice the start: found in a capacity ladder's closed
    loop, whose step after the piece then started an ulp early and changed the measured window)."""
    import simpy

    from sim.plans import exact_delay, land_at

    now, end = 207.76923486634578, 481.544920427719
    assert now + exact_delay(now, end) != end  # (one timeout cannot)
    rng = np.random.default_rng(5)
    pairs = [(now, end)] + [(float(a), float(a + b)) for a, b in zip(rng.uniform(0, 500, 300), rng.uniform(0, 5000, 300), strict=True)]
    for start, stop in pairs:
        env = simpy.Environment()

        def proc(env=env, start=start, stop=stop):
            yield env.timeout(start)
            yield from land_at(env, stop)

        env.run(env.process(proc()))
        assert env.now == stop, (start, stop, env.now)



def test_a_fused_runs_clock_is_the_unfused_engines_running_sum() -> None:
    """`CostModel.decode_clock` (a fused run's clock) gives the times
    the unfused engine's clock takes, each step's `decode_s` added in turn (as SimPy adds a
    timeout's delay), in scalars and by numpy, with memory-bound attention (decode's case),
    compute-bound (an attention peak cut 100x) and the two branches within rounding of each
    other (then both are evaluated); the closed form it replaced drifts off that clock (a fused
    run used to end tens of ulps off, which a trend statistic near zero amplified)."""
    import copy

    from models.cost import DECODE_CLOCK_SCALAR

    drift = 0
    seen: set[str] = set()
    for model, tp in (("llama-3.1-70b", 4), ("llama-3.1-8b", 1), ("qwen3-30b-a3b", 1)):
        base = CostModel(model, "h100-sxm", tp)
        tie = base.attn_flops_per_pair / (base.kv_bytes_per_token_gpu / base.bw) / (1 + 1e-13)
        for kind, peak in (("memory", base._peak_attn), ("compute", base._peak_attn / 100), ("tie", tie)):
            cm = copy.copy(base)
            cm._decode_parts, cm._peak_attn = {}, peak
            rng = np.random.default_rng(tp)
            for n in (1, 7, 96, 700):
                kv_w = cm._decode_parts_of(n)[1]
                for c0 in (float(n), float(rng.integers(n, 3000 * n))):
                    t = float(rng.uniform(10.0, 5000.0))
                    for m in (1, DECODE_CLOCK_SCALAR, DECODE_CLOCK_SCALAR + 1, 700, 4096):
                        d = [cm.decode_s(n, c0 + j * n) for j in range(m)]
                        clock = [t]
                        for x in d:
                            clock.append(clock[-1] + x)
                        assert list(cm.decode_clock(n, c0, t, m)) == clock, (model, kind, n, c0, m)
                        d0, slope = d[0], (d[-1] - d[0]) / (m - 1) if m > 1 else 0.0
                        drift += clock[-1] != t + (m * d0 + slope * (m * (m - 1) / 2.0))
                        # which branch of the attention roofline wins, at both ends
                        gaps = [cm.attn_flops_per_pair * (c + n) / peak - (cm.kv_bytes_per_token_gpu * c + kv_w) / cm.bw
                                for c in (c0, c0 + (m - 1) * n)]
                        seen.add("compute" if min(gaps) > 1e-9 * d0 else "memory" if max(gaps) < -1e-9 * d0 else "tie")
    assert drift > 0  # (the closed form would pass only if it never differed)
    assert seen == {"compute", "memory", "tie"}, seen
