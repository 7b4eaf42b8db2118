"""Why a speculative run's speedup differs from its speedup at light load (`specrack run --why`):
the run, its speculation-off reference at the same load, and both at a light load, their mean
TPOT split into what it was spent on (`sim.attribution.latency_parts`), and the change of the
speedup attributed to its causes (`sim.attribution.attribute`). When the speculative run
preempted or filled its KV pool, a fifth run gives the drafter's KV back (`[sim] draft_kv_free`)
to separate what the drafter's KV cost from the rest of the queueing."""

from __future__ import annotations

import math
from typing import Any

from sim.attribution import CAUSE_NAMES, CAUSES, attribute, main_cause
from sim.capacity import CapacityStore, baseline_of
from sim.scenario import Scenario
from sim.simulate import Result, capacity_for, simulate

LIGHT_UTILISATION = 0.1  # the light load a run's speedup is compared with, of the speculation-off capacity


def _at(sc: Scenario, utilisation: float) -> Scenario:
    return sc.with_overrides({"workload": {"utilisation": utilisation, "rate_rps": None}})


def why_speedup(sc: Scenario, res: Result, seed: int, light: float = LIGHT_UTILISATION,
                store: CapacityStore | None = None, metric: str = "tpot") -> dict[str, Any]:
    """The attribution of the run `res` (of scenario `sc`, with speculation) against `light`
    utilisation: `speedup_light`, `speedup`, `dln_speedup`, each cause's part (ln points),
    `main_cause`, `kv_separated` (whether the drafter's KV was measured apart)."""
    if sc.speculative is None:
        raise ValueError(f"{sc.name}: --why explains a speculative speedup; the scenario has no [speculative]")
    st = store if store is not None else CapacityStore()

    def run(s: Scenario) -> dict[str, float]:
        return simulate(s, seed, capacity=capacity_for(s, store=st)).summary["latency_parts"][metric]

    base = baseline_of(sc)
    spec1 = res.summary["latency_parts"][metric]
    base1 = run(base)
    base0, spec0 = run(_at(base, light)), run(_at(sc, light))
    s = res.summary
    kv_free = None
    pressured = s.get("preemptions", 0) > 0
    if pressured:
        kv_free = run(sc.with_overrides({"sim": {"draft_kv_free": True}}))
    a = attribute(base0, spec0, base1, spec1, kv_free1=kv_free)
    return {"speedup_light": sum(base0.values()) / sum(spec0.values()),
            "speedup": sum(base1.values()) / sum(spec1.values()), "light": light, **a,
            "main_cause": main_cause(a), "kv_separated": kv_free is not None}


def why_lines(w: dict[str, Any]) -> list[str]:
    """The attribution as the terminal prints it."""
    if not math.isfinite(w["dln_speedup"]):
        return ["  why: too few completed requests to split the speedup"]
    out = [f"  TPOT speedup {w['speedup']:.2f}x here, {w['speedup_light']:.2f}x at utilisation {w['light']:.2f}: "
           f"{100 * math.expm1(w['dln_speedup']):+.0f}%" + (f", mostly {w['main_cause']}" if w["main_cause"] else "")]
    parts = ", ".join(f"{CAUSE_NAMES[c]} {100 * w[c]:+.1f}" for c in CAUSES if c != "kv" or w["kv_separated"])
    out.append(f"    by cause (points of ln speedup): {parts}"
               + ("" if w["kv_separated"] else "; drafter KV: no preemption, nothing to separate"))
    return out
