"""`specrack validate`: check a scenario file as a run would before its first step."""

from __future__ import annotations

import argparse
from typing import Any

from experiments.commands.common import load, scenario_parser
from sim.deployment import build_runtime, check_fits
from sim.simulate import capacity_for, closed_pool, offered_rate, replica_warmup_s
from sim.workload import generate


def add_parser(sub: Any, name: str, summary: str) -> None:
    scenario_parser(sub, name, summary).set_defaults(fn=run)


def run(a: argparse.Namespace) -> int:
    sc = load(a)
    rt = build_runtime(sc)
    # the checks a run makes before its first step: the offered rate, the request table, lengths
    wl = sc.workload
    pool = closed_pool(sc, rt) if wl.closed and wl.num_requests is None else None
    table = generate(wl, sc.seed, offered_rate(sc, capacity_for(sc)), pool=pool)
    check_fits(sc, rt, table.prompt_tokens.to_numpy(), table.output_tokens.to_numpy())
    print(f"{a.scenario}: ok ({sc.name}: {rt.num_replicas} replica(s) of {sc.deployment.model} TP{sc.deployment.tensor_parallel}"
          f" on {sc.rack.gpu}, KV {rt.plan.kv_capacity_tokens} tokens per replica)")
    if wl.rate_profile is not None:
        print(f"  rate profile: {wl.rate_profile.model_dump(mode='json')} -> {len(table)} requests over {wl.duration_s:g} s")
    if sc.autoscale is not None:
        print(f"  autoscale: {sc.autoscale.model_dump(mode='json', exclude_none=True)}, replicas "
              f"{sc.autoscale.min_replicas}-{sc.autoscale.max_replicas or rt.num_replicas}, warm-up {replica_warmup_s(sc):.0f} s")
    return 0
