"""Measure the stability verdict's false positives and false negatives (docs/METRICS.md).

For a scenario, runs open-loop at multiples of its measured capacity (below 1: truly stable;
above 1: truly overloaded) over several seeds, run lengths and arrival processes, and counts
how often the verdict is wrong. `python experiments/stability_check.py [SCENARIO] [--seeds N]`.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import itertools

import pandas as pd

from sim.scenario import load_scenario
from sim.simulate import capacity, capacity_for, simulate

MULTIPLES = (0.5, 0.8, 0.9, 0.95, 1.05, 1.1, 1.2)


def _point(path: str, mult: float, duration: float, arrival: str, seed: int, cap: float) -> dict[str, object]:
    sc = load_scenario(path, {"workload.rate_rps": mult * cap, "workload.duration_s": duration,
                              "workload.arrival": arrival})
    s = simulate(sc, seed, capacity=capacity_for(sc)).summary
    return {"multiple": mult, "duration_s": duration, "arrival": arrival, "seed": seed, "verdict": s["verdict"],
            "throughput_over_offered": s["throughput_rps"] / s["offered_rps"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("scenario", nargs="?", default="experiments/scenarios/default-mix.toml")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--jobs", type=int, default=None)
    a = ap.parse_args()
    cap = capacity(load_scenario(a.scenario), speculative=True).rps
    tasks = list(itertools.product([a.scenario], MULTIPLES, (600.0, 2400.0), ("poisson", "gamma"),
                                   range(1, a.seeds + 1), [cap]))
    with cf.ProcessPoolExecutor(a.jobs) as ex:
        rows = list(ex.map(_point, *zip(*tasks, strict=True)))
    df = pd.DataFrame(rows)
    df["wrong"] = (df.multiple < 1) & (df.verdict != "stable") | (df.multiple > 1) & (df.verdict == "stable")
    print(f"capacity {cap:.3f} req/s")
    print(df.pivot_table(index=["arrival", "duration_s"], columns="multiple", values="wrong", aggfunc="mean").to_string())
    print(df.pivot_table(index=["arrival", "duration_s"], columns="multiple", values="throughput_over_offered",
                         aggfunc="mean").round(3).to_string())


if __name__ == "__main__":
    main()
