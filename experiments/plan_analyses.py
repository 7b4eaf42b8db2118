"""The capacity-planning analyses as one runnable experiment script, each on its own:

    python experiments/plan_analyses.py curves      PLAN.toml [--quick] [--out DIR]
    python experiments/plan_analyses.py map         PLAN.toml [--quick] [--out DIR]
    python experiments/plan_analyses.py shift       PLAN.toml [--quick] [--out DIR]
    python experiments/plan_analyses.py retraining  PLAN.toml [--quick] [--out DIR]

curves: GPUs needed and cost per month vs traffic, per strategy. map: which strategy wins over
utilisation x acceptance (the seeds' "the rack decides"). shift: how much of the benchmark
speedup survives production traffic. retraining: monthly cost of distilled options vs the
teacher's update cadence. Each writes a CSV and an HTML chart into --out.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import plotly.io as pio

from experiments.plan import load_plan, run_plan
from experiments.plan_report import curves_chart, decision_map_chart, retraining_chart, shift_chart
from experiments.plan_studies import acceptance_shift, capacity_curves, decision_map, retraining_table, winners


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("analysis", choices=["curves", "map", "shift", "retraining"])
    p.add_argument("plan", help="plan file, e.g. experiments/plans/chat-70b.toml")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="results/plan-analyses")
    p.add_argument("--jobs", type=int, default=None)
    a = p.parse_args()
    spec = load_plan(a.plan, quick=a.quick)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.analysis == "curves":
        table = capacity_curves(spec, run_plan(spec, a.jobs), a.jobs)
        fig = curves_chart(table)
    elif a.analysis == "map":
        table = winners(decision_map(spec, a.jobs, answer=run_plan(spec, a.jobs)))
        fig = decision_map_chart(table)
    elif a.analysis == "shift":
        table = acceptance_shift(spec, a.jobs)
        fig = shift_chart(table)
    else:
        table = retraining_table(spec, run_plan(spec, a.jobs))
        fig = retraining_chart(table)
    table.to_csv(out / f"{a.analysis}.csv", index=False)
    pio.write_html(fig, out / f"{a.analysis}.html", include_plotlyjs=True)
    print(table.to_string(index=False))
    print(f"wrote {out / (a.analysis + '.csv')} and {out / (a.analysis + '.html')}")


if __name__ == "__main__":
    main()
