"""The utilisation experiment as a short script: copy it (and experiments/sweeps/default.toml with
its base scenario) to sweep your own hardware, model and traffic.

    python experiments/utilisation_sweep.py [SWEEP.toml] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from experiments.analysis import crossovers, speedups
from experiments.report import write_report
from experiments.sweep import load_sweep, run_sweep, write_tables


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("sweep", nargs="?", default=None, help="sweep file (default: the built-in experiment)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="results/utilisation")
    a = p.parse_args()

    spec = load_sweep(a.sweep, quick=a.quick)          # base scenario, variants, utilisation, seeds
    df, caps = run_sweep(spec, a.out)                   # one row per variant x utilisation x seed
    out = Path(a.out)
    write_tables(df, out)                               # results.parquet, results.csv
    sp = speedups(df[df.error == ""], spec.reference)   # paired speedups, 95% CI over seeds
    sp.to_csv(out / "speedups.csv", index=False)
    print(write_report(df[df.error == ""], sp, out, spec=spec, capacities=caps))
    for variant, u in crossovers(sp).items():
        print(f"{variant}: TPOT speedup < 1 from utilisation {u:.2f}" if u == u else f"{variant}: speedup >= 1 throughout")


if __name__ == "__main__":
    main()
