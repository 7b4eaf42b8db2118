"""`specrack validate`: check a scenario file as a run would before its first step."""

from __future__ import annotations

import argparse
from typing import Any

import numpy as np

from experiments.commands.common import load, rejected_line, scenario_parser
from sim.deployment import build_runtime, check_fits, fits, rejection_reason
from sim.scenario import Scenario
from sim.simulate import capacity_for, closed_pool, lines_text, offered_rate, replica_warmup_s
from sim.workload import LengthSampler, generate


def add_parser(sub: Any, name: str, summary: str) -> None:
    scenario_parser(sub, name, summary).set_defaults(fn=run)


def run(a: argparse.Namespace) -> int:
    sc = load(a)
    rt = build_runtime(sc)
    # the checks a run makes before its first step: the offered rate, the request table, lengths
    wl = sc.workload
    pool = closed_pool(sc, rt) if wl.closed and wl.num_requests is None else None
    table = generate(wl, sc.seed, offered_rate(sc, capacity_for(sc)), pool=pool)
    prompt, output = table["prompt_tokens"], table["output_tokens"]
    check_fits(sc, rt, prompt, output)
    ok = fits(rt, prompt, output)
    lines = lines_text(tuple(int(x) for x in table["trace_line"][~ok])) if "trace_line" in table else ""
    warn = rejected_line(int((~ok).sum()), float((~ok).mean()), rejection_reason(rt), lines)
    print(f"{a.scenario}: ok ({sc.name}: {rt.num_replicas} replica(s) of {sc.deployment.model} TP{sc.deployment.tensor_parallel}"
          f" on {sc.rack.gpu}, KV {rt.plan.kv_capacity_tokens} tokens per replica)")
    if warn:
        print(warn.replace("rejected,", "would be rejected,", 1))
    elif (share := rejected_share(sc, rt.max_model_len)) > 0:
        print(f"  warning: about {share:.2%} of this scenario's requests can be longer than the deployment accepts "
              f"({rejection_reason(rt)}); they are rejected at run time and counted on the run's line")
    if wl.rate_profile is not None:
        print(f"  rate profile: {wl.rate_profile.model_dump(mode='json')} -> {len(table)} requests over {wl.duration_s:g} s")
    if sc.autoscale is not None:
        print(f"  autoscale: {sc.autoscale.model_dump(mode='json', exclude_none=True)}, replicas "
              f"{sc.autoscale.min_replicas}-{sc.autoscale.max_replicas or rt.num_replicas}, warm-up {replica_warmup_s(sc):.0f} s")
    return 0



def rejected_share(sc: Scenario, max_model_len: int, n: int = 200_000) -> float:
    """The share of requests the scenario's length distributions draw longer than max_model_len,
    from n draws (a longer run than the validated table's; 0 for a trace, whose rows are all in
    the table)."""
    wl = sc.workload
    if wl.replays_trace:
        return 0.0
    rng = np.random.default_rng(sc.seed)
    total = (LengthSampler(wl.prompt_tokens, "prompt_tokens").sample(rng, n)
             + LengthSampler(wl.output_tokens, "output_tokens").sample(rng, n))
    return float((total > max_model_len).mean())
