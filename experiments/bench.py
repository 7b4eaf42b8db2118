"""`specrack bench`: engine speed as ratios measured in one process (no timed tests).

Reports engine steps per second next to a bare SimPy timeout loop's rate, their ratio, simulated
output tokens per wall-clock second, wall time and peak memory for two request counts (the
cost should grow linearly: compare the per-request wall time of the two); and step fusion
(`[sim] fuse_steps`) on against off on the workloads of issue 12, each run in a forked child so
its peak memory is its own (docs/PERFORMANCE.md); and whole processes as a user runs them
(`process_bench`: `specrack run` of the reference workload, `--help`, `import specrack`, the sweep
and the plan), side by side with another build's Python when given.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import resources
from typing import Any

import simpy

import models.speculative  # noqa: F401  (imports outside the timing)
from models import _native
from models.cost import CostModel
from sim.capacity import CapacityStore
from sim.scenario import load_scenario, scenario_from_dict
from sim.simulate import capacity_for, simulate


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


def bench_point(n_requests: int, utilisation: float = 0.7, store: CapacityStore | None = None) -> dict[str, Any]:
    sc = example_scenario().with_overrides({"workload.utilisation": utilisation, "workload.num_requests": n_requests,
                                            "workload.warmup_s": 0})
    cap = capacity_for(sc, store=store)  # measured outside the timing (once across points sharing `store`)
    t = time.perf_counter()
    res = simulate(sc, capacity=cap)
    wall = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    steps = int(res.step_table["count"].sum())  # engine steps (a fused run is one row of `count` steps)
    return {"requests": n_requests, "steps": steps, "wall_s": wall, "steps_per_s": steps / wall,
            "sim_output_tok_per_wall_s": float(res.step_table["emitted_tokens"].sum()) / wall,
            "wall_us_per_request": wall / n_requests * 1e6, "peak_rss_mib": peak / 2**20}


# issue 12's workloads: Llama-3.1-70B TP4 on H100s, Poisson 2 req/s per replica, 512 prompt and
# 256 output tokens; (b) with a 1B draft model, k = 4; (c) eight replicas (round robin)
FUSION_WORKLOADS: dict[str, dict[str, Any]] = {
    "a": {"replicas": 1, "requests": 20_000, "spec": False},
    "b": {"replicas": 1, "requests": 20_000, "spec": True},
    "c": {"replicas": 8, "requests": 1_000_000, "spec": False},
}


def fusion_scenario(replicas: int, requests: int, spec: bool, fuse: bool):
    d: dict[str, Any] = {
        "name": f"bench-{replicas}x{requests}{'-spec' if spec else ''}",
        "rack": {"gpu": "h100-sxm", "num_gpus": 4 * replicas},
        "deployment": {"model": "llama-3.1-70b", "tensor_parallel": 4, "router": "round_robin"},
        "workload": {"rate_rps": 2.0 * replicas, "num_requests": requests, "warmup_s": 0.0,
                     "prompt_tokens": {"dist": "fixed", "value": 512}, "output_tokens": {"dist": "fixed", "value": 256}},
        "sim": {"fuse_steps": fuse},
    }
    if spec:
        d["speculative"] = {"method": "draft_model", "draft_model": "llama-3.2-1b", "num_speculative_tokens": 4}
    return scenario_from_dict(d)


def _timed(args: tuple[int, int, bool, bool]) -> dict[str, Any]:
    """One run in this (forked) process: wall time, engine steps and step rows, peak RSS."""
    import scipy.stats  # noqa: F401

    sc = fusion_scenario(*args)
    t = time.perf_counter()
    cpu = time.process_time()
    res = simulate(sc)
    cpu = time.process_time() - cpu
    wall = time.perf_counter() - t
    steps = int(res.step_table["count"].sum())
    n = max(1, len(res.request_table))
    rows = len(res.step_table)
    return {"wall_s": wall, "cpu_s": cpu, "steps": steps, "step_rows": rows, "steps_per_s": steps / wall,
            "cpu_us_per_request": cpu / n * 1e6, "steps_per_request": steps / n, "step_rows_per_request": rows / n,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "throughput_tok_s": res.summary["throughput_tok_s"], "e2e_mean_s": res.summary["e2e_s"]["mean"],
            "itl_p99_s": res.summary["itl_s"]["p99"]}


def _in_child(args: tuple[int, int, bool, bool]) -> dict[str, Any]:
    with multiprocessing.get_context("fork").Pool(1, maxtasksperchild=1) as pool:
        return pool.apply(_timed, (args,))


def _fused_while(args: tuple[int, int, bool, bool], stop: Any, out: Any) -> None:
    """Fused runs one after the other, each in a forked child, until `stop` is set (at least one)."""
    runs = []
    while True:
        runs.append(_in_child(args))
        if stop.is_set():
            break
    out.put(runs)


def _side_by_side(fused: tuple[int, int, bool, bool],
                  unfused: tuple[int, int, bool, bool]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The unfused run, and fused runs repeated on the other core for as long as it lasts, when the
    machine has two cores or more: both engines then see the same load all along (on a shared
    machine whose speed swings by tens of percent from minute to minute, runs one after the other
    would not; one fused run beside the long unfused one would share the machine only for its
    first seconds). One core: one after the other. Returns (the fused runs, the unfused run)."""
    if (os.cpu_count() or 1) < 2:
        return [_in_child(fused)], _in_child(unfused)
    ctx = multiprocessing.get_context("fork")
    stop, out = ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_fused_while, args=(fused, stop, out))
    proc.start()
    try:
        off = _in_child(unfused)
    finally:
        stop.set()
    runs = out.get()
    proc.join()
    return runs, off


def fusion_bench(names: str = "abc", quick: bool = False, unfused_max_requests: int = 50_000,
                 quick_requests: int = 2_000) -> dict[str, Any]:
    """Fusion on vs off for each named workload: wall and CPU time (the CPU ratio is the steadier
    one on a shared machine), steps/s, peak RSS and their ratios. The unfused run is capped at
    `unfused_max_requests` (c's million would take a quarter of an hour): above it, the ratio is
    measured at that size and the fused run is also timed whole (alone). With two cores the fused
    run is repeated beside the unfused one for as long as it lasts and the median repeat is
    reported (`_side_by_side`; all repeats' CPU times in `fused_runs_cpu_s`). `quick`:
    `quick_requests` each."""
    out: dict[str, Any] = {}
    for name in names:
        w = FUSION_WORKLOADS[name]
        n = min(w["requests"], quick_requests if quick else w["requests"])
        m = min(n, unfused_max_requests)
        ons, off = _side_by_side((w["replicas"], m, w["spec"], True), (w["replicas"], m, w["spec"], False))
        on = sorted(ons, key=lambda r: r["cpu_s"])[len(ons) // 2]  # the median fused run
        p: dict[str, Any] = {**w, "measured_requests": m, "fused": on, "unfused": off,
                             "speedup": off["wall_s"] / on["wall_s"], "speedup_cpu": off["cpu_s"] / on["cpu_s"],
                             "steps_per_row": on["steps"] / on["step_rows"],
                             "e2e_mean_rel_diff": abs(on["e2e_mean_s"] / off["e2e_mean_s"] - 1.0),
                             "side_by_side": (os.cpu_count() or 1) >= 2,
                             "fused_runs_cpu_s": [r["cpu_s"] for r in ons]}
        if n > m:
            p["fused_full"] = _in_child((w["replicas"], n, w["spec"], True))
        out[name] = p
    return out


REFERENCE = "reference-70b.toml"  # Llama-3.1-70B TP4 on 4x H100, Poisson 2 req/s, 512/256 tokens, 20,000 requests


def _process(cmd: list[str], cwd: str, env: dict[str, str]) -> tuple[float, float]:
    """(wall s, CPU s of the process and its children) of one command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    p = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {(p.stderr.strip().splitlines() or [''])[-1]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def process_bench(against: str | None = None, repeat: int = 5, long: bool = False) -> dict[str, Any]:
    """Whole processes as a user runs them, each the median of `repeat` (the sweep and the plan,
    with `long`, of 2), wall and CPU seconds: `specrack run` of the reference workload (no capacity
    asked; with `--capacity`, measured anew and read from the capacity cache), `specrack --help`,
    `python -c "import specrack"`, and with `long` the default sweep and the bundled chat plan
    (each into a fresh folder). With `against` (another build's Python, e.g. an older checkout's
    .venv/bin/python) each command is also run there, alternating with this one, and the ratio
    (theirs / ours) reported. Run from a temporary folder, so each Python imports its own build."""
    scenario = str(resources.files("experiments") / "scenarios" / REFERENCE)
    plan = str(resources.files("experiments") / "plans" / "chat-70b.toml")
    pythons = {"this": sys.executable, **({"against": against} if against else {})}
    out: dict[str, Any] = {"build": _native.build_label(), "repeat": repeat, "pythons": pythons, "commands": {}}
    with tempfile.TemporaryDirectory(prefix="specrack-bench-") as tmp:
        env = {**os.environ, "SPECRACK_CAPACITY_CACHE": os.path.join(tmp, "cache")}
        env.pop("SPECRACK_PURE", None)  # (the build each Python has)
        cli = ["-m", "experiments.cli"]
        cases: list[tuple[str, list[str], int, dict[str, str]]] = [
            ("run", [*cli, "run", scenario, "--out", os.path.join(tmp, "run")], repeat, env),
            ("run --capacity (measured)", [*cli, "run", scenario, "--out", os.path.join(tmp, "run"), "--capacity"],
             repeat, {**env, "SPECRACK_CAPACITY_CACHE": "off"}),
            ("run --capacity (cached)", [*cli, "run", scenario, "--out", os.path.join(tmp, "run"), "--capacity"],
             repeat, env),
            ("--help", [*cli, "--help"], repeat, env),
            ("import specrack", ["-c", "import specrack"], repeat, env),
        ]
        if long:
            cases += [("sweep", [*cli, "sweep", "--out", os.path.join(tmp, "sweep")], 2, env),
                      ("plan chat-70b", [*cli, "plan", plan, "--out", os.path.join(tmp, "plan")], 2, env)]
        for name, args, n, case_env in cases:
            runs: dict[str, list[tuple[float, float]]] = {k: [] for k in pythons}
            failed: dict[str, str] = {}
            for _ in range(n):
                for who, py in pythons.items():  # alternated: both see the same load
                    if who in failed:
                        continue
                    for folder in ("sweep", "plan"):  # (a fresh folder each time: no resuming)
                        shutil.rmtree(os.path.join(tmp, folder), ignore_errors=True)
                    try:
                        if name == "run --capacity (cached)" and not runs[who]:  # (the cache filled first)
                            _process([py, *args], tmp, case_env)
                        runs[who].append(_process([py, *args], tmp, case_env))
                    except RuntimeError as err:  # (an older build without this option)
                        failed[who] = str(err)
            row: dict[str, Any] = {who: {"error": why} for who, why in failed.items()}
            for who, rs in runs.items():
                if who not in failed:
                    row[who] = {"wall_s": statistics.median(r[0] for r in rs),
                                "cpu_s": statistics.median(r[1] for r in rs), "walls_s": [round(r[0], 3) for r in rs]}
            if against and not failed:
                row["ratio_wall"] = row["against"]["wall_s"] / row["this"]["wall_s"]
                row["ratio_cpu"] = row["against"]["cpu_s"] / row["this"]["cpu_s"]
            out["commands"][name] = row
    return out


def run_bench(quick: bool = False, fusion: str = "", process: bool = False, against: str | None = None,
              long: bool = False) -> dict[str, Any]:
    if process:
        return process_bench(against, repeat=3 if quick else 5, long=long)
    if fusion:
        return {"build": _native.build_label(), "fusion": fusion_bench(fusion, quick)}
    sizes = (1_000, 10_000) if quick else (10_000, 100_000)
    bare = bare_simpy_rate()
    store = CapacityStore()  # (the points share one deployment: its capacity is measured once)
    points = [bench_point(n, store=store) for n in sizes]
    for p in points:
        p["ratio_to_bare_simpy"] = p["steps_per_s"] / bare
    return {"build": _native.build_label(), "bare_simpy_timeouts_per_s": bare, "cost_model": cost_model_us(), "points": points,
            "growth_per_request": points[1]["wall_us_per_request"] / points[0]["wall_us_per_request"],
            "note": "peak_rss_mib is the process peak so far (ru_maxrss); growth_per_request ~1 means linear"}
