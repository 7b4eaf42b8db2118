"""`simulate(scenario, seed) -> Result`: a run is a pure function; writing is a separate step.
The engine run itself (`run_table`, open or closed loop) is in `sim.run`; capacity in
`sim.capacity`."""

from __future__ import annotations

import json
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import simpy

from models.catalog import peak_flops
from sim.capacity import Capacity, baseline_of, capacity
from sim.deployment import ReplicaRuntime, build_runtime
from sim.metrics import summarise
from sim.run import run_table
from sim.scenario import Scenario
from sim.workload import generate

__all__ = ["Capacity", "Result", "baseline_of", "capacity", "capacity_summary", "run_table", "simulate"]

VERSION = "0.1.0"


@dataclass
class Result:
    scenario: Scenario
    seed: int
    requests: pd.DataFrame
    steps: pd.DataFrame
    summary: dict[str, Any]

    def write(self, out: str | Path) -> Path:
        """Write requests.parquet, steps.parquet and summary.json into `out`."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        self.requests.to_parquet(out / "requests.parquet", index=False)
        self.steps.to_parquet(out / "steps.parquet", index=False)
        (out / "summary.json").write_text(json.dumps(self.summary, indent=2, default=_json_default))
        return out


def _json_default(o: Any) -> Any:
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    raise TypeError(type(o).__name__)


def versions() -> dict[str, str]:
    import pandas
    import scipy

    return {"specrack": VERSION, "python": platform.python_version(), "numpy": np.__version__,
            "simpy": simpy.__version__, "scipy": scipy.__version__, "pandas": pandas.__version__}


def offered_rate(sc: Scenario) -> float | None:
    """Requests/s to offer: rate_rps, or utilisation x the baseline deployment's capacity."""
    wl = sc.workload
    if wl.rate_rps is not None:
        return wl.rate_rps
    if wl.utilisation is not None:
        return wl.utilisation * capacity(sc).rps
    return None


def simulate(sc: Scenario, seed: int | None = None, *, progress: bool = False, with_capacity: bool = False) -> Result:
    """Run one scenario with one seed. Pure: no I/O (but an optional progress bar on stderr),
    same inputs give the same tables. `with_capacity` adds the deployment's capacity figures
    (`capacity_summary`) to the summary."""
    seed = sc.seed if seed is None else int(seed)
    rt = build_runtime(sc)
    rate = offered_rate(sc)
    table = generate(sc.workload, seed, rate)
    req, steps, truncated, t_end = run_table(sc, rt, table, seed, backlog_limit=sc.sim.backlog_limit, progress=progress)
    wl = sc.workload
    end_s = float(table.arrival_s.max()) if wl.num_requests else wl.duration_s
    warm = wl.warmup_s  # never clamped: a run whose arrivals all fall in warm-up is 'insufficient'
    peak = peak_flops(rt.cost.gpu, rt.cost.weights)
    s = summarise(req, steps, warmup_s=warm, end_s=end_s, replicas=rt.num_replicas,
                  gpus_per_replica=rt.gpus_per_replica, peak_flops=peak, mem_bw=rt.cost.gpu.mem_bw_bytes_s,
                  slo=sc.slo.targets(), truncated=truncated, horizon_s=t_end)
    s.update(_economics(sc, rt, req, s))
    s["rejected_requests"] = int(req.attrs.get("rejected", 0))
    s["engine_profile"] = rt.engine  # the engine profile the step costs and scheduling came from
    s["num_replicas"] = rt.num_replicas
    s["kv_capacity_tokens"] = rt.plan.kv_capacity_tokens
    s["kv_pool_gib"] = rt.plan.kv_pool_bytes / 2**30
    s["offered_rate_rps"] = rate if rate is not None else float("nan")
    if with_capacity:
        s.update(capacity_summary(sc))
    s["scenario"] = sc.model_dump(mode="json")
    s["seed"] = seed
    s["versions"] = versions()
    return Result(sc, seed, req, steps, s)


def _economics(sc: Scenario, rt: ReplicaRuntime, req: pd.DataFrame, s: dict[str, Any]) -> dict[str, Any]:
    """Quality per class and overall, and cost per million output tokens (with retraining)."""
    q_in, q_tail = rt.quality
    if rt.retraining is not None:
        q_in, q_tail = rt.retraining.effective_quality(q_in), rt.retraining.effective_quality(q_tail)
    out: dict[str, Any] = {"quality_in_distribution": q_in, "quality_tail": q_tail}
    per_class = {}
    counts = np.bincount(req.cls.to_numpy(), minlength=len(sc.workload.classes)) if len(req) else np.zeros(1)
    total = 0.0
    for i, c in enumerate(sc.workload.classes):
        q = q_tail if c.tail else q_in
        per_class[c.name] = q
        total += q * counts[i]
    out["quality_by_class"] = per_class
    out["quality_overall"] = total / max(1, counts.sum())
    rack_usd_s = sc.rack.num_gpus * rt.usd_per_gpu_hour / 3600.0
    tok_s = s["throughput_tok_s"]
    retrain_month = rt.retraining.usd_per_month if rt.retraining else 0.0
    out["retraining_usd_per_month"] = retrain_month
    out["usd_per_gpu_hour"] = rt.usd_per_gpu_hour
    out["serving_usd_per_month"] = rack_usd_s * 30 * 86400
    if tok_s > 0:
        serving = rack_usd_s / tok_s * 1e6
        retrain = retrain_month / (tok_s * 30 * 86400) * 1e6
    else:
        serving = retrain = float("nan")
    out["usd_per_mtok_serving"] = serving
    out["usd_per_mtok_retraining"] = retrain
    out["usd_per_mtok"] = serving + retrain
    return out


def capacity_summary(sc: Scenario) -> dict[str, Any]:
    """Capacity figures for summary.json and `specrack capacity --json`: `capacity_rps` and
    friends for the deployment with speculation off (the reference of `utilisation`), and with a
    [speculative] table also `speculative_capacity_rps` (peak sustainable rate),
    `speculative_full_batch_rps` (the collapse figure), `speculative_peak_rps`, ...; and the
    closed-loop curve behind each."""
    out: dict[str, Any] = capacity(sc).as_dict()
    if sc.speculative is not None:
        out.update(capacity(sc, speculative=True).as_dict("speculative_"))
    return out
