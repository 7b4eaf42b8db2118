"""Step fusion on random scenarios: a fused run's request table is the unfused engine's bit for
bit, its summary agrees within 1e-9 relative and its step table, expanded, is the unfused one,
over random combinations of model, parallelism, precision, token budget, slots, KV pressure,
engine profile, router, speculation method and policy, arrival process (Poisson, gamma, closed
loop with think times, max_concurrency, Azure and Mooncake trace windows, conversations, diurnal
profiles, autoscaling) and lengths.

The suite runs a fixed handful (drawn once and kept because they fuse and cover different
paths); `python tests/test_fusion_random.py FIRST LAST` runs a campaign over draws FIRST..LAST-1
on every core and prints one line per draw (`ok`, `skip` for a configuration refused with its
one-line error, or what differed)."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path
from typing import Any

import pytest

if __name__ == "__main__":  # (a campaign from the command line: the tests' helpers by path)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from test_fusion import _close, _same_requests, _same_steps

from models.errors import ConfigError
from sim.scenario import load_scenario
from specrack import simulate

ROOT = Path(__file__).resolve().parents[1]
TRACES = ROOT.parent / "shared" / "data" / "traces"
BASE = ROOT / "experiments" / "scenarios" / "default-mix.toml"


def draw(i: int) -> tuple[dict[str, Any], int, str]:
    """Draw i: scenario overrides of the default mix, a seed, and the arrival kind."""
    rng = random.Random(i)
    o: dict[str, Any] = {}
    model = rng.choice(["llama-3.1-70b", "llama-3.1-70b", "llama-3.1-8b", "mixtral-8x7b", "qwen3-30b-a3b"])
    tp = rng.choice([2, 4, 8]) if model == "llama-3.1-70b" else rng.choice([1, 2])
    o.update({"deployment.model": model, "deployment.tensor_parallel": tp, "rack.num_gpus": tp * rng.choice([1, 1, 2, 3, 4])})
    if rng.random() < 0.3:
        o.update({"deployment.weights": "fp8", "deployment.kv_cache": "fp8"})
    o["deployment.max_num_batched_tokens"] = rng.choice([256, 512, 2048, 8192])
    if rng.random() < 0.3:
        o["deployment.max_num_seqs"] = rng.choice([4, 16, 64, 256])
    if rng.random() < 0.2:
        o["deployment.chunked_prefill"] = False
    if rng.random() < 0.3:
        o["deployment.gpu_memory_utilization"] = rng.choice([0.5, 0.6, 0.75])  # KV pressure
    if rng.random() < 0.15:
        o["deployment.scheduler_steps"] = rng.choice([2, 8])
    o["deployment.engine"] = rng.choice(["vllm-v1", "vllm-0.6", "sglang", "trtllm"])
    o["deployment.router"] = rng.choice(["round_robin", "least_outstanding", "least_outstanding", "prefix_affinity"])
    o["speculative"] = None
    if rng.random() < 0.5:
        method = rng.choice(["draft_model", "eagle", "eagle3", "ngram", "tree", "mtp", "suffix"])
        k = 1 if method == "mtp" else rng.choice([1, 2, 4, 6])
        sp: dict[str, Any] = {"method": method, "num_speculative_tokens": k,
                              "policy": rng.choice(["fixed", "fixed", "adaptive", "disable_above_batch", "follow_load"])}
        if method == "draft_model":
            sp["draft_model"] = "llama-3.2-1b"
        if method == "tree":
            sp["tree_branching"] = ([2, 2] + [1] * k)[:k]
            if sp["policy"] == "adaptive":
                sp["policy"] = "fixed"
        if sp["policy"] == "follow_load":
            sp["load_interval_s"] = rng.choice([10.0, 30.0])
        o["speculative"] = sp
    if rng.random() < 0.25:
        o["workload.output_tokens"] = {"dist": "fixed", "value": rng.choice([1, 2, 3, 17, 64])}
    if rng.random() < 0.15:
        o["workload.prompt_tokens"] = {"dist": "lognormal", "median": 6000, "p90": 14000}
    o["workload.warmup_s"] = 0.0
    kind = rng.choice(["poisson", "gamma", "closed", "maxconc", "azure", "mooncake", "conversations", "diurnal",
                       "autoscale"])
    if kind in ("poisson", "gamma", "maxconc"):
        o.update({"workload.arrival": "poisson" if kind == "maxconc" else kind,
                  "workload.utilisation": rng.choice([0.2, 0.5, 0.8, 0.95, 1.1]), "workload.num_requests": rng.choice([300, 800])})
        if kind == "maxconc":
            o["workload.max_concurrency"] = rng.choice([8, 32])
    elif kind == "closed":
        o.update({"workload.arrival": "closed", "workload.utilisation": None, "workload.concurrency": rng.choice([1, 4, 32, 128]),
                  "workload.num_requests": rng.choice([300, 800])})
        if rng.random() < 0.5:
            o["workload.think_time_s"] = rng.choice([{"dist": "fixed", "value": 0.5}, {"dist": "exponential", "mean": 2.0}])
    elif kind in ("azure", "mooncake"):
        trace = (TRACES / "azure2023" / f"AzureLLMInferenceTrace_{rng.choice(['conv', 'code'])}.csv" if kind == "azure"
                 else TRACES / "mooncake" / "conversation_trace.jsonl")
        start = rng.choice([0.0, 300.0, 600.0])
        span = rng.choice([60.0, 150.0])
        o.update({"workload.arrival": "trace", "workload.trace": str(trace), "workload.utilisation": None,
                  "workload.trace_start_s": start, "workload.trace_end_s": start + span, "workload.duration_s": span})
    elif kind == "conversations":
        o.update({"workload.arrival": rng.choice(["poisson", "gamma"]), "workload.utilisation": None,
                  "workload.rate_rps": rng.choice([1.0, 4.0, 10.0]), "workload.duration_s": 150.0,
                  "workload.conversations": {"turns": rng.choice([2, 5]), "turn_gap_s": {"dist": "exponential", "mean": 20.0}}})
    else:
        peak = rng.choice([4.0, 10.0, 25.0])
        o.update({"workload.arrival": "poisson", "workload.utilisation": None, "workload.duration_s": 300.0,
                  "workload.rate_profile": {"shape": "diurnal", "peak_rps": peak, "trough_rps": peak / 5, "day_s": 300.0},
                  "sim.interval_s": 60.0})
        if kind == "autoscale":
            o["rack.num_gpus"] = tp * rng.choice([3, 4])
            o["autoscale"] = rng.choice([
                {"policy": "target_utilisation", "target": 0.7, "interval_s": 20.0, "replica_warmup_s": 15.0,
                 "scale_down_window_s": 40.0},
                {"policy": "queue", "target": 8, "interval_s": 15.0, "replica_warmup_s": 10.0, "initial_replicas": 2,
                 "scale_down_window_s": 0.0}])
    return o, rng.randint(1, 1000), kind


def check(i: int) -> str:
    """Draw i fused and unfused: 'ok', 'skip: ...' (refused configuration or absent trace), or raises."""
    o, seed, kind = draw(i)
    if kind in ("azure", "mooncake") and not Path(o["workload.trace"]).is_file():
        return "skip: the trace is not in ../shared/data/traces"
    try:
        sc = load_scenario(BASE, o)
        on = simulate(sc.with_overrides({"sim.fuse_steps": True}), seed)
    except ConfigError as err:
        return f"skip: {err}"
    off = simulate(sc.with_overrides({"sim.fuse_steps": False}), seed)
    _same_requests(off.requests, on.requests)
    diff = _close({k: v for k, v in off.summary.items() if k != "scenario"},
                  {k: v for k, v in on.summary.items() if k != "scenario"})
    assert not diff, diff
    _same_steps(off.steps, on.steps)
    return f"ok: {kind}, {len(off.requests)} requests, {len(off.steps)} steps in {len(on.steps)} rows"


# drawn once and kept: each runs (none is refused), fuses, and together they cover plain and
# speculative runs, one and several replicas under each router, closed loops, traces and profiles
KEPT = [2, 4, 11, 13, 14, 17, 22, 34, 41, 89]


@pytest.mark.parametrize("i", KEPT)
def test_random_scenario_fuses_exactly(i: int) -> None:
    got = check(i)
    if got.startswith("skip: the trace"):
        pytest.skip(got)
    assert got.startswith("ok"), got


def _one(i: int) -> str:
    """`check`, any failure reported as a line (a campaign reports every draw)."""
    import traceback

    try:
        return check(i)
    except AssertionError as err:
        return "DIFFERS: " + (str(err).splitlines() or [""])[0][:300]
    except Exception:
        return "ERROR: " + traceback.format_exc(limit=3).replace("\n", " | ")[-600:]


def _campaign(first: int, last: int) -> None:
    import multiprocessing as mp

    with mp.Pool() as pool:
        for i, got in zip(range(first, last), pool.imap(_one, range(first, last)), strict=True):
            print(json.dumps({"draw": i, "result": got, "overrides": draw(i)[0]}, default=str), flush=True)


if __name__ == "__main__":
    _campaign(int(sys.argv[1]), int(sys.argv[2]))
