"""specrack: a discrete-event simulator of LLM serving, for capacity planners. One front door.

    import specrack

    sc = specrack.load_scenario("experiments/scenarios/llama70b-h100x8.toml", {"workload.duration_s": 120})
    res = specrack.simulate(sc, seed=1)       # a Result: requests, steps, summary; nothing written
    res.table()                               # the summary as one flat row (the sweep's column names)
    res.requests[["ttft_s", "tpot_s", "e2e_s"]]  # per-request latencies (docs/METRICS.md)
    specrack.capacity(sc).rps                 # requests/s the deployment sustains, speculation off
    df = specrack.sweep(quick=True)           # the built-in sweep: one row per variant x load x seed
    ranked = specrack.plan("experiments/plans/chat-70b.toml", quick=True)

Runs and analyses:
    load_scenario(path, overrides) -> Scenario   read a scenario TOML, with dotted-key overrides
    simulate(scenario, seed) -> Result           one run, a pure function (Result.write(folder) writes it);
                                                 the capacity it needs is measured first (or passed in)
    capacity(scenario, speculative=False, store=None) -> Capacity   the sustainable rate and its curve
    sweep(path_or_spec, out=None, ...) -> DataFrame     a sweep file's results table
    plan(path_or_spec, ...) -> DataFrame         the ranked capacity plan (strategy x GPU)
    calibrate(benchmarks, scenario, ...) -> Calibration  fit an engine profile's software factors
    fit_acceptance(files, ...) -> (fits, notes)  fit acceptance to vLLM metrics, bench JSON, logs or CSV

Types: Result, Scenario, Capacity, CapacityStore (capacities kept for the next runs: pass store=), ConfigError
(every bad input, with a one-line message).
Catalogues (dicts by name): GPUS, MODELS, PROFILES (engine profiles).
Helpers: builtin_strategies() (the default sweep's variants by name, usable in plan files) and
flatten(summary) (a summary dict to the one flat row of a results table).

Importing specrack is cheap: every name is loaded from models/, sim/ or experiments/ on first use.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import concurrent.futures as cf

    import pandas as pd

    from experiments.calibrate_report import calibrate as calibrate
    from experiments.plan_spec import PlanSpec
    from experiments.planfile import builtin_strategies as builtin_strategies
    from experiments.sweep import SweepSpec
    from models.acceptance_fit import AcceptanceFit
    from models.catalog import GPUS as GPUS
    from models.catalog import MODELS as MODELS
    from models.engines import PROFILES as PROFILES
    from models.errors import ConfigError as ConfigError
    from sim.capacity import Capacity as Capacity
    from sim.capacity import CapacityStore as CapacityStore
    from sim.capacity import RunCapacity
    from sim.capacity import capacity as capacity
    from sim.scenario import Scenario as Scenario
    from sim.scenario import load_scenario as load_scenario
    from sim.simulate import Result as Result
    from sim.simulate import flatten as flatten

__version__ = "0.1.0"

__all__ = [
    "GPUS",
    "MODELS",
    "PROFILES",
    "Capacity",
    "CapacityStore",
    "ConfigError",
    "Result",
    "Scenario",
    "builtin_strategies",
    "calibrate",
    "capacity",
    "fit_acceptance",
    "flatten",
    "load_scenario",
    "plan",
    "simulate",
    "sweep",
]

# name -> module it is re-exported from, imported on first access (PEP 562)
_LAZY = {
    "GPUS": "models.catalog", "MODELS": "models.catalog", "PROFILES": "models.engines",
    "ConfigError": "models.errors", "Capacity": "sim.capacity", "CapacityStore": "sim.capacity",
    "capacity": "sim.capacity",
    "Scenario": "sim.scenario", "load_scenario": "sim.scenario", "Result": "sim.simulate",
    "flatten": "sim.simulate", "calibrate": "experiments.calibrate_report",
    "builtin_strategies": "experiments.planfile",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # once loaded, a plain attribute
        return value
    raise AttributeError(f"module 'specrack' has no attribute '{name}'")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def simulate(scenario: Scenario, seed: int | None = None, *, capacity: RunCapacity | None = None,
             store: CapacityStore | None = None, progress: bool = False, with_capacity: bool = False) -> Result:
    """Run one scenario with one seed (default: the scenario's) and return its Result: requests,
    steps, summary, intervals; nothing written. The capacity the run needs (a load set as
    `utilisation`, a target-utilisation autoscaler, a follow-load policy; with `with_capacity`
    the summary's capacity figures) is measured first, here, unless passed as `capacity`
    (`sim.capacity.capacity_for`); `store` (a `sim.capacity.CapacityStore`) keeps measurements
    for the next call. Wraps sim.capacity.capacity_for and sim.simulate.simulate."""
    from sim.capacity import capacity_for
    from sim.simulate import simulate as run

    if capacity is None:
        capacity = capacity_for(scenario, with_capacity=with_capacity, store=store)
    return run(scenario, seed, capacity=capacity, progress=progress, with_capacity=with_capacity)


def sweep(spec: str | Path | SweepSpec | None = None, out: str | Path | None = None, *, quick: bool = False,
          jobs: int | None = None, executor: str | cf.Executor = "process", progress: bool = False) -> pd.DataFrame:
    """Run a sweep and return its results table: one row per variant x load point x seed, with
    the flat summary columns (`tpot_s_mean`, `ttft_s_p99`, `throughput_tok_s`, `slo_*`, ...), the
    deployment's key parameters, each variant's capacity and `error` ("" for a point that ran).

    `spec`: a sweep TOML path, a loaded `SweepSpec`, or None for the built-in default sweep;
    `quick` applies the file's [quick] section. With `out`, finished points are kept in
    `out/points` (a rerun resumes) and results.parquet / results.csv are written there; without,
    the points go to a temporary folder. `jobs`: parallel processes (default: all cores);
    `executor`: "process" (a local process pool, the default), "serial", or any
    concurrent.futures.Executor (a Dask client's `get_executor()`, say). `progress`: a progress
    bar on stderr. Wraps experiments.sweep.load_sweep and run_sweep."""
    import tempfile

    from experiments.sweep import SweepSpec, load_sweep, run_sweep, write_tables

    loaded = spec if isinstance(spec, SweepSpec) else load_sweep(spec, quick=quick)
    if out is None:
        with tempfile.TemporaryDirectory(prefix="specrack-sweep-") as tmp:
            df, _ = run_sweep(loaded, tmp, jobs=jobs, executor=executor, progress=progress)
        return df
    df, _ = run_sweep(loaded, out, jobs=jobs, executor=executor, progress=progress)
    write_tables(df, Path(out))
    return df


def plan(spec: str | Path | PlanSpec, *, quick: bool = False, jobs: int | None = None) -> pd.DataFrame:
    """Load a plan file (or take a loaded `PlanSpec`) and return the ranked planning table: one
    row per strategy x GPU type with the smallest rack meeting the SLO (`gpus`, `replicas`),
    its cost (`total_usd_per_month`), the SLO checks by name and the `binding_slo`, quality and
    `feasible` (with a `reason` when not). Cheapest feasible option first. The analyses of
    `specrack plan` (curves, decision map, shift) are not run. Wraps experiments.plan.load_plan
    and run_plan."""
    from experiments.plan import load_plan, run_plan
    from experiments.plan_spec import PlanSpec

    loaded = spec if isinstance(spec, PlanSpec) else load_plan(spec, quick=quick)
    return run_plan(loaded, jobs)


def fit_acceptance(files: str | Path | list[str | Path], *, name: str | None = None, k: int | None = None,
                   model: str | None = None, decay: float | None = None,
                   min_drafts: int | None = None) -> tuple[list[AcceptanceFit], list[str]]:
    """Fit speculative-decoding acceptance (mean, spread, per-position decay) per traffic class
    to one source: 1-2 Prometheus scrapes of vLLM's /metrics, vllm bench serve JSON, vLLM
    'SpecDecoding metrics:' logs, or CSVs of accepted lengths. Returns (fits per class, notes
    about the data). `name`: the class name where the data have none (default: the first file's
    stem). Wraps experiments.acceptance.fit_source."""
    from experiments.acceptance import fit_source
    from models.acceptance_fit import MIN_DRAFTS

    paths = [str(files)] if isinstance(files, (str, Path)) else [str(f) for f in files]
    return fit_source(paths, name=name or Path(paths[0]).stem, k=k, model=model, decay=decay,
                      min_drafts=MIN_DRAFTS if min_drafts is None else min_drafts)
