"""Step fusion (`[sim] fuse_steps`): runs of pure decode steps advanced in one event must give
what the unfused engine (the oracle) gives: the same request table (every timestamp within 1e-9
relative), the same summary, and, expanded, the same step table."""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
import pytest

from models.cost import CostModel
from sim.deployment import build_runtime
from sim.metrics import expand_steps
from sim.run import run_table
from sim.simulate import simulate

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
    assert list(a.columns) == list(b.columns) and len(a) == len(b)
    for c in a.columns:
        x, y = a[c].to_numpy(np.float64), b[c].to_numpy(np.float64)
        np.testing.assert_allclose(y, x, rtol=RTOL, atol=0, equal_nan=True, err_msg=c)


def _same_steps(unfused: pd.DataFrame, fused: pd.DataFrame) -> None:
    """The fused table, expanded, is the unfused one: every step's start, duration, batch, tokens
    and chunk gap; FLOPs and bytes in total (expansion spreads a run's total evenly)."""
    assert (unfused["count"] == 1).all()
    assert int(fused["count"].sum()) == len(unfused)
    e = expand_steps(fused)
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
    # overloaded: full slots (fused runs with requests waiting), stopped by the backlog limit
    "4-replicas-rr-backlog": dict(rack={"gpu": "h100-sxm", "num_gpus": 16},
                                  deployment={"router": "round_robin", "max_num_seqs": 16},
                                  workload={"rate_rps": 30.0, "duration_s": 40.0}, sim={"backlog_limit": 40}),
    "4-replicas-least-backlog": dict(rack={"gpu": "h100-sxm", "num_gpus": 16}, deployment={"max_num_seqs": 16},
                                     workload={"rate_rps": 30.0, "duration_s": 40.0}, sim={"backlog_limit": 40}),
    "closed": dict(workload={"arrival": "closed", "concurrency": 12, "num_requests": 300, "rate_rps": None,
                             "duration_s": 60.0, "warmup_s": 20.0}),
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
    # a closed loop over several replicas fuses little (a run ends at the next event anywhere)
    _check(sc, min_fused={"heavy": 1.5, "separate": 1.5, "closed-think-2-replicas": 1.0}.get(name, 2.0))


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
        _same_requests(res[False][0], res[True][0])
        _same_steps(res[False][1], res[True][1])
        assert res[False][3] == pytest.approx(res[True][3], rel=RTOL)


def test_sliding_window_models_do_not_fuse(make_scenario) -> None:
    """gpt-oss's windowed layers read min(context, window) per sequence: not affine, so no fusion."""
    sc = make_scenario(rack={"gpu": "h100-sxm", "num_gpus": 1},
                       deployment={"model": "gpt-oss-20b", "tensor_parallel": 1, "weights": "mxfp4"},
                       workload={"rate_rps": 1.0, "duration_s": 20.0})
    assert not build_runtime(sc).cost.affine_in_context
    res = simulate(sc, 1)
    assert (res.steps["count"] == 1).all() and res.summary["completed_requests"] > 0


def test_speculative_runs_do_not_fuse(make_scenario) -> None:
    sc = make_scenario(speculative={"method": "draft_model", "draft_model": "llama-3.2-1b",
                                    "num_speculative_tokens": 3},
                       workload={"rate_rps": 1.0, "duration_s": 30.0})
    assert (simulate(sc, 1).steps["count"] == 1).all()


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
    from sim.metrics import _run_slope, dist, step_gaps, step_starts

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
            assert _run_slope(g) == pytest.approx(ref, rel=1e-9, abs=1e-9)
        gaps, w = step_gaps(g)
        j = np.concatenate([np.arange(c) for c in cnt])
        np.testing.assert_allclose(gaps, np.repeat(d0, cnt) + j * np.repeat(slope, cnt), rtol=1e-14)
        assert dist(gaps, w)["p90"] == dist(np.repeat(d0, cnt) + j * np.repeat(slope, cnt), np.repeat(g.decode_seqs, cnt))["p90"]
