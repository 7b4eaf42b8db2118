"""Runs a matrix of scenarios and prints one digest per run (request and step tables bit for bit,
and the summary), with the engine compiled or as source as the environment says
(SPECRACK_PURE; models/_native.py): tests/test_native.py compares the two builds' digests."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from models import _native  # noqa: E402
from sim.capacity import closed_loop_throughput  # noqa: E402
from sim.scenario import load_scenario  # noqa: E402
from specrack import simulate  # noqa: E402

MIX = ROOT / "experiments" / "scenarios" / "default-mix.toml"
SHORT = {"workload.duration_s": 40, "workload.warmup_s": 5}
DRAFT = {"method": "draft_model", "draft_model": "llama-3.2-1b", "num_speculative_tokens": 4}
CASES: dict[str, dict[str, object]] = {
    # two TP4 replicas under least outstanding (the joint plan), near capacity
    "baseline": {"workload.utilisation": 0.85},
    "draft-1b": {"workload.utilisation": 0.7, "speculative": {**DRAFT, "policy": "fixed"}},
    "draft-1b-adaptive": {"workload.utilisation": 0.7, "speculative": {**DRAFT, "policy": "adaptive"}},
    "eagle3-tree": {"workload.utilisation": 0.6, "speculative": {
        "method": "tree", "tree_drafter": "eagle3", "num_speculative_tokens": 4, "tree_branching": [2, 2, 1, 1]}},
    # eight TP1 replicas of the distilled 8B with a draft; KV-starved FP8 replicas, round robin
    "distilled-8b+draft-1b": {"workload.utilisation": 0.8, "deployment.model": "llama-3.1-8b",
                              "deployment.tensor_parallel": 1, "deployment.distilled_from": "llama-3.1-70b",
                              "speculative": DRAFT},
    "fp8-tp2-round-robin": {"workload.utilisation": 0.9, "deployment.weights": "fp8", "deployment.tensor_parallel": 2,
                            "deployment.router": "round_robin", "deployment.max_num_batched_tokens": 2048},
    # the unfused engine (the oracle's own code path)
    "baseline-unfused": {"workload.utilisation": 0.85, "sim.fuse_steps": False},
}


def digest(df: pd.DataFrame) -> str:
    h = hashlib.sha256(",".join(df.columns).encode())
    h.update(pd.util.hash_pandas_object(df, index=False).to_numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    out: dict[str, object] = {"build": _native.build_label()}
    for name, over in CASES.items():
        sc = load_scenario(MIX, {**SHORT, **over})
        res = simulate(sc, 3)
        out[name] = [digest(res.requests), digest(res.steps), json.dumps(res.summary, sort_keys=True, default=repr)]
    # a compressed autoscaled day (fleet, rate profile, intervals), and conversations under prefix caching
    day = load_scenario(ROOT / "experiments" / "scenarios" / "day-diurnal.toml", {
        "workload.rate_profile.day_s": 900, "workload.duration_s": 900, "sim.interval_s": 300})
    chat = load_scenario(ROOT / "experiments" / "scenarios" / "chat-conversations.toml", {"workload.duration_s": 240, "workload.warmup_s": 30})
    for name, sc in (("day", day), ("conversations", chat)):
        res = simulate(sc, 2)
        out[name] = [digest(res.requests), digest(res.steps), json.dumps(res.summary, sort_keys=True, default=repr)]
    # a closed loop of one KV-starved replica with chunked prefill (a capacity ladder's point: cursors plan
    # its preemptions and partial prefills)
    one = load_scenario(MIX, {"rack.num_gpus": 1, "deployment.tensor_parallel": 1, "deployment.weights": "fp8",
                              "deployment.kv_cache": "fp8", "deployment.max_num_batched_tokens": 2048,
                              "speculative": DRAFT})
    out["closed-loop"] = repr(closed_loop_throughput(one, 40, 1, completions=400))
    # the adaptive policy over batches of more than ADAPTIVE_SCALAR_SEQS sequences (numpy's sums, or
    # the compiled build's scalars for them), at k = 4 and at k = 2 (numpy sums one column otherwise)
    for k in (4, 2):
        big = load_scenario(MIX, {"rack.num_gpus": 4, "speculative": {**DRAFT, "num_speculative_tokens": k,
                                                                       "policy": "adaptive"}})
        out[f"closed-loop-adaptive-k{k}"] = repr(closed_loop_throughput(big, 96, 1, completions=300))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
