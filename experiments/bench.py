"""`specrack bench`: engine speed as ratios measured in one process (no timed tests).

Reports engine steps per second next to a bare SimPy timeout loop's rate, their ratio, simulated
output tokens per wall-clock second, wall time and peak memory for two request counts (the
cost should grow linearly: compare the per-request wall time of the two).
"""

from __future__ import annotations

import resource
import time
from importlib import resources
from typing import Any

import simpy

from sim.scenario import load_scenario
from sim.simulate import simulate


def bare_simpy_rate(n: int = 200_000) -> float:
    """Timeouts per second of a bare SimPy loop (one process, one timeout per iteration)."""
    env = simpy.Environment()

    def loop():
        for _ in range(n):
            yield env.timeout(0.01)

    env.process(loop())
    t = time.perf_counter()
    env.run()
    return n / (time.perf_counter() - t)


def cost_model_us(batch: int = 256, calls: int = 20_000) -> dict[str, float]:
    """Microseconds per step-cost call for a mixed batch of `batch` sequences: the array form
    (`CostModel.step`, sums computed from per-sequence arrays) and the sums form the engine uses."""
    import numpy as np

    from models.cost import CostModel

    cm = CostModel("llama-3.1-70b", "h100-sxm", 4)
    rng = np.random.default_rng(0)
    new = rng.integers(1, 6, batch)
    ctx = rng.integers(100, 4000, batch)
    t = time.perf_counter()
    for _ in range(calls):
        cm.step(new, ctx)
    arr = (time.perf_counter() - t) / calls * 1e6
    n, tok, c, pairs = batch, float(new.sum()), float(ctx.sum()), float((new * ctx).sum())
    t = time.perf_counter()
    for _ in range(calls):
        cm.step_sums(n, tok, c, pairs)
    sums = (time.perf_counter() - t) / calls * 1e6
    return {"batch": batch, "step_us": arr, "step_sums_us": sums}


def example_scenario():
    path = resources.files("experiments") / "scenarios" / "llama70b-h100x8.toml"
    return load_scenario(str(path))


def bench_point(n_requests: int, utilisation: float = 0.7) -> dict[str, Any]:
    sc = example_scenario().with_overrides({"workload.utilisation": utilisation, "workload.num_requests": n_requests,
                                            "workload.warmup_s": 0})
    from sim.simulate import capacity

    capacity(sc)  # measured once, outside the timing
    t = time.perf_counter()
    res = simulate(sc)
    wall = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    steps = len(res.steps)
    return {"requests": n_requests, "steps": steps, "wall_s": wall, "steps_per_s": steps / wall,
            "sim_output_tok_per_wall_s": float(res.steps.emitted_tokens.sum()) / wall,
            "wall_us_per_request": wall / n_requests * 1e6, "peak_rss_mib": peak / 2**20}


def run_bench(quick: bool = False) -> dict[str, Any]:
    sizes = (1_000, 10_000) if quick else (10_000, 100_000)
    bare = bare_simpy_rate()
    points = [bench_point(n) for n in sizes]
    for p in points:
        p["ratio_to_bare_simpy"] = p["steps_per_s"] / bare
    return {"bare_simpy_timeouts_per_s": bare, "cost_model": cost_model_us(), "points": points,
            "growth_per_request": points[1]["wall_us_per_request"] / points[0]["wall_us_per_request"],
            "note": "peak_rss_mib is the process peak so far (ru_maxrss); growth_per_request ~1 means linear"}
