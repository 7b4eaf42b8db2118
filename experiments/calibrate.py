"""Calibration by simulation: simulate a serving benchmark the way it was measured (the same
request lengths, the same request rate or concurrency), compare the simulated figures with the
measured ones, and fit an engine profile's software factors so they agree.

A `LoadPoint` is one measured benchmark run, as `vllm bench serve` runs it: `num_prompts`
requests whose lengths are given (or drawn from a length distribution), sent all at once
(`request_rate = inf`), as a gamma process of that rate and `burstiness` (1 = Poisson), and/or
through at most `max_concurrency` clients. Its `measured` figures use the names of vLLM's result
JSON (`mean_tpot_ms`, `median_ttft_ms`, `p99_itl_ms`, `request_throughput`,
`output_throughput`, ...). `simulate_point` returns the same names from the simulator, computed
as vLLM's benchmark computes them (TTFT from the send, TPOT per request over its output after
the first token, ITL pooled over every streamed-chunk gap, throughput over the benchmark's
duration from the first send to the last completion).

`fit_software` fits an engine profile's software factors (per-step, per-layer and per-sequence
fixed costs, models.engines) by scipy least squares on log(simulated / measured) over the load
points, with the hardware factors held at their step-level calibration. The published
whole-system anchors of each profile are in `ANCHOR_POINTS`; `python -m experiments.calibrate
--profiles` refits them and prints the table of docs/CALIBRATION.md (in-sample and
leave-one-out).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from models.engines import SOFTWARE_FIELDS, get_profile
from models.errors import ConfigError
from sim.deployment import build_runtime
from sim.frame import Frame
from sim.metrics import bench_metrics
from sim.run import run_table
from sim.scenario import LogNormal, Scenario, scenario_from_dict
from sim.workload import LengthSampler, streams

# the figures a fit compares (vLLM result names); others are reported, not fitted
FIT_METRICS = ("mean_tpot_ms", "median_tpot_ms", "mean_itl_ms", "median_itl_ms", "mean_ttft_ms", "median_ttft_ms",
               "request_throughput", "output_throughput")
# bounds and scales of the software factors in a fit
SOFTWARE_LO = {"step_overhead_s": 0.0, "layer_overhead_s": 0.0, "seq_overhead_s": 0.0, "frontend_s": 0.0, "draft_pass_overhead_s": 0.0,
               "sched_step_s": 0.0, "sched_seq_s": 0.0, "output_seq_s": 0.0}
SOFTWARE_HI = {"step_overhead_s": 0.03, "layer_overhead_s": 3e-4, "seq_overhead_s": 5e-4, "frontend_s": 1.0, "draft_pass_overhead_s": 0.01,
               "sched_step_s": 0.03, "sched_seq_s": 5e-4, "output_seq_s": 5e-4}
SOFTWARE_SCALE = {"step_overhead_s": 1e-3, "layer_overhead_s": 1e-5, "seq_overhead_s": 1e-5, "frontend_s": 1e-2, "draft_pass_overhead_s": 1e-3,
                  "sched_step_s": 1e-3, "sched_seq_s": 1e-5, "output_seq_s": 1e-5}


@dataclass(frozen=True)
class LoadPoint:
    """One measured benchmark run (see the module docstring)."""

    name: str
    prompt_tokens: tuple[int, ...]  # per request, in sending order
    output_tokens: tuple[int, ...]
    request_rate: float = math.inf  # requests/s; inf: all at once
    max_concurrency: int | None = None
    burstiness: float = 1.0  # gamma shape of the inter-arrival times (1: Poisson)
    measured: dict[str, float] = field(default_factory=dict)
    source: str = ""

    @property
    def num_prompts(self) -> int:
        return len(self.prompt_tokens)

    def describe(self) -> str:
        load = "all at once" if math.isinf(self.request_rate) else f"{self.request_rate:g} req/s"
        if self.max_concurrency:
            load += f", max concurrency {self.max_concurrency}"
        return f"{self.num_prompts} requests, {load}"


def lengths_from(dist: LogNormal, n: int, seed: int, column: str) -> tuple[int, ...]:
    """n lengths drawn from a length distribution (for anchors published as distributions)."""
    rng = np.random.default_rng(seed)
    return tuple(int(x) for x in LengthSampler(dist, column).sample(rng, n))


def _table(point: LoadPoint, seed: int) -> pd.DataFrame:
    n = point.num_prompts
    st = streams(seed)
    if math.isinf(point.request_rate):
        arrival = np.zeros(n)
    else:  # vLLM's benchmark: gamma inter-arrival times of shape `burstiness`, mean 1 / rate
        theta = 1.0 / (point.request_rate * point.burstiness)
        arrival = np.cumsum(st["arrivals"].gamma(point.burstiness, theta, n))
        arrival -= arrival[0]  # the first request is sent at once
    return pd.DataFrame({
        "id": np.arange(n, dtype=np.int64), "arrival_s": arrival,
        "prompt_tokens": np.asarray(point.prompt_tokens, dtype=np.int64),
        "output_tokens": np.asarray(point.output_tokens, dtype=np.int64),
        "cls": np.zeros(n, dtype=np.int64), "accept_q": st["acceptance"].random(n),
    })


def simulate_point(sc: Scenario, point: LoadPoint, seed: int = 1) -> dict[str, float]:
    """The benchmark `point` simulated on the scenario's deployment (its workload is ignored:
    the point's requests, rate and concurrency are used)."""
    return bench_metrics(*simulate_tables(sc, point, seed))


def simulate_tables(sc: Scenario, point: LoadPoint, seed: int = 1) -> tuple[Frame, Frame]:
    """The request and step tables of the benchmark `point` simulated (as simulate_point)."""
    rt = build_runtime(sc)
    table = _table(point, seed)
    if point.max_concurrency:
        out = run_table(sc, rt, table, seed, concurrency=point.max_concurrency, backlog_limit=10**12,
                        gate_arrivals=not math.isinf(point.request_rate))
    else:
        out = run_table(sc, rt, table, seed, backlog_limit=10**12, horizon_s=1e12)
    return out.requests, out.steps


def with_factors(sc: Scenario, factors: dict[str, float]) -> Scenario:
    """The scenario with these efficiency factors overriding its engine profile's."""
    data = sc.model_dump(mode="json", exclude_none=True)
    dep = data.setdefault("deployment", {})
    dep["efficiency"] = {**(dep.get("efficiency") or {}), **{k: float(v) for k, v in factors.items()}}
    return scenario_from_dict(data)


@dataclass(frozen=True)
class Fit:
    factors: dict[str, float]  # fitted software factors
    rows: tuple[dict[str, Any], ...]  # per (point, metric): measured, simulated, error_pct
    mape_pct: float  # mean absolute percentage error over the fitted figures

    def table(self) -> pd.DataFrame:
        return pd.DataFrame(list(self.rows))


def compare(sc: Scenario, points: Sequence[LoadPoint], seeds: Sequence[int] = (1,),
            metrics: Sequence[str] = FIT_METRICS) -> list[dict[str, Any]]:
    """Measured vs simulated for each point and each measured figure (simulated: mean over seeds)."""
    rows = []
    for p in points:
        sims = [simulate_point(sc, p, s) for s in seeds]
        for m in metrics:
            if m not in p.measured:
                continue
            sim = float(np.mean([x.get(m, float("nan")) for x in sims]))
            meas = float(p.measured[m])
            rows.append(dict(point=p.name, load=p.describe(), metric=m, measured=meas, simulated=sim,
                             error_pct=100.0 * (sim / meas - 1.0)))
    return rows


def fit_software(sc: Scenario, points: Sequence[LoadPoint], fields: Sequence[str] = ("step_overhead_s", "seq_overhead_s"),
                 seeds: Sequence[int] = (1,), metrics: Sequence[str] = FIT_METRICS,
                 start: dict[str, float] | None = None, max_nfev: int = 60, diff_step: float = 0.05,
                 tol: float = 1e-8) -> Fit:
    """Least squares on log(simulated / measured) over the points' measured figures, varying the
    software factors `fields` of the scenario's engine profile (the rest held). `diff_step` is
    the relative step of the finite-difference Jacobian and `tol` scipy's ftol and xtol: a
    simulated figure moves in small jumps as events reorder, so a wider step (0.2) and a looser
    tolerance (1e-3) follow the trend rather than the jumps."""
    from scipy.optimize import least_squares

    bad = [f for f in fields if f not in SOFTWARE_FIELDS]
    if bad:
        raise ConfigError(f"cannot fit {bad}: the fitted factors are the software ones ({', '.join(SOFTWARE_FIELDS)})")
    if not any(m in p.measured for p in points for m in metrics):
        raise ConfigError(f"no measured figure to fit: each load point needs one of {', '.join(metrics)}")
    prof = get_profile(sc.deployment.engine).software
    x0 = np.array([(start or {}).get(f, prof[f]) for f in fields], dtype=np.float64)
    lo = np.array([SOFTWARE_LO[f] for f in fields])
    hi = np.array([SOFTWARE_HI[f] for f in fields])

    def resid(x: np.ndarray) -> np.ndarray:
        trial = with_factors(sc, dict(zip(fields, map(float, x), strict=True)))
        rows = compare(trial, points, seeds, metrics)
        return np.array([math.log(max(r["simulated"], 1e-12) / r["measured"]) for r in rows])

    res = least_squares(resid, np.clip(x0, lo, hi), bounds=(lo, hi), x_scale=[SOFTWARE_SCALE[f] for f in fields],
                        diff_step=diff_step, ftol=tol, xtol=tol, max_nfev=max_nfev)
    factors = dict(zip(fields, map(float, res.x), strict=True))
    rows = compare(with_factors(sc, factors), points, seeds, metrics)
    mape = float(np.mean([abs(r["error_pct"]) for r in rows]))
    return Fit(factors, tuple(rows), mape)


def scenario_for(engine: str, model: str, gpu: str, tp: int, **deployment: Any) -> Scenario:
    """A one-replica scenario of this deployment (for simulating benchmarks)."""
    return scenario_from_dict({
        "rack": {"gpu": gpu, "num_gpus": tp},
        "deployment": {"model": model, "tensor_parallel": tp, "engine": engine, **deployment},
        "workload": {"rate_rps": 1.0, "duration_s": 60.0, "warmup_s": 0.0},
    })


__all__ = ["FIT_METRICS", "Fit", "LoadPoint", "compare", "fit_software", "lengths_from", "scenario_for",
           "simulate_point", "simulate_tables", "with_factors"]
