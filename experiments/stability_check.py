"""Measure the stability verdict's false "overloaded" and false "stable" rates (docs/METRICS.md).

For a scenario, runs open-loop at multiples of the deployment's own measured capacity, for
several run lengths and seeds, each judged as `specrack run`, sweeps and plans judge it (given
that capacity: `sim.metrics.against_capacity`), against a run 4x longer (same seed, warm-up and
window 4x) judged from its own data only (no capacity: the trend tests and the work left
unfinished), which stands for the truth. Prints, per run length and load: the share of short
runs called overloaded where the long run is stable (false overloaded), called stable where the
long run is overloaded (false stable), and called insufficient (too short to tell: honest).

`python -m experiments.stability_check [SCENARIO] [--seeds N] [--jobs J]`
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools

import pandas as pd

from sim.capacity import Capacity, RunCapacity
from sim.scenario import load_scenario
from sim.simulate import capacity, simulate

MULTIPLES = (0.8, 0.85, 0.9, 0.95, 1.05, 1.1, 1.15, 1.2)
LENGTHS_S = (120.0, 600.0, 2400.0)
LONGER = 4.0  # the reference run is this many times longer
WARMUP_SHARE = 1 / 6  # warm-up as a share of the run (20 s of a 120 s run, as the quick sweep)


def _verdict(path: str, mult: float, duration: float, seed: int, cap: Capacity | None, own: float,
             speculative: bool) -> str:
    sc = load_scenario(path, {"workload.rate_rps": mult * own, "workload.duration_s": duration,
                              "workload.warmup_s": duration * WARMUP_SHARE})
    given = None if cap is None else RunCapacity(cap, cap if speculative else None)
    return str(simulate(sc, seed, capacity=given).summary["verdict"])


def _point(path: str, mult: float, duration: float, seed: int, cap: Capacity, speculative: bool) -> dict[str, object]:
    short = _verdict(path, mult, duration, seed, cap, cap.rps, speculative)
    long = _verdict(path, mult, LONGER * duration, seed, None, cap.rps, speculative)
    return {"multiple": mult, "duration_s": duration, "seed": seed, "verdict": short, "long_verdict": long}


def false_rates(df: pd.DataFrame) -> pd.DataFrame:
    """Per run length and load: the shares of false overloaded, false stable and insufficient."""
    df = df.assign(false_overloaded=(df.verdict == "overloaded") & (df.long_verdict == "stable"),
                   false_stable=(df.verdict == "stable") & (df.long_verdict == "overloaded"),
                   insufficient=df.verdict == "insufficient")
    return df.groupby(["duration_s", "multiple"])[["false_overloaded", "false_stable", "insufficient"]].mean()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenario", nargs="?", default="experiments/scenarios/default-mix.toml")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=None)
    a = ap.parse_args()
    base = load_scenario(a.scenario)
    spec = base.speculative is not None
    cap = capacity(base, speculative=spec)
    tasks = list(itertools.product([a.scenario], MULTIPLES, LENGTHS_S, range(1, a.seeds + 1), [cap], [spec]))
    with cf.ProcessPoolExecutor(a.jobs) as ex:
        rows = list(ex.map(_point, *zip(*tasks, strict=True)))
    df = pd.DataFrame(rows)
    print(f"{base.name}: own capacity {cap.rps:.3f} req/s; {a.seeds} seeds per cell; each run against one "
          f"{LONGER:g}x longer judged from its own data")
    print(false_rates(df).unstack("multiple").round(2).to_string())
    print(pd.crosstab([df.duration_s, df.verdict], df.long_verdict).to_string())


if __name__ == "__main__":
    main()
