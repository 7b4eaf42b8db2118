"""Speculation under load against a published curve, as a check of the mechanisms (never a fit).

`shared/reference/README.md` keeps one published speculative-decoding load curve to find which of an
engine's speculation costs are missing: vLLM 0.6 with a Qwama-0.5B draft for Llama-3-70B on 4x H100
(the vLLM blog, 2024-10-17). The rule it comes with: set acceptance so the lightest load matches, and
let the rest of the shape come from the engine's costs; fit no coefficient to the shape. So:

1. `calibrate_acceptance` finds the per-token acceptance at which the simulated speedup at the
   lightest load equals the published one (bisection; the only input set from the curve);
2. `simulate_curve` simulates the benchmark at every published rate, with and without speculation,
   on the profile's committed factors, and returns the speedup, its attribution to causes
   (`sim.attribution`) and the published figure beside it;
3. `crossover_rps` interpolates where each curve crosses 1.0; `capacity_rps` is the reference
   deployment's capacity, to state the gap in points of utilisation.

`python -m experiments.spec_anchors` prints the table (docs/CALIBRATION.md, 'Speculation under
load.); tests/test_spec_load.py checks its shape on the committed factors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from experiments.calibrate import LoadPoint, lengths_from, simulate_tables
from experiments.engine_anchors import sharegpt_like
from sim.attribution import attribute, latency_parts
from sim.capacity import capacity
from sim.metrics import bench_metrics
from sim.scenario import Scenario, scenario_from_dict


@dataclass(frozen=True)
class SpecCurve:
    """A published speculative-decoding load curve: speedup of a latency metric against request rate."""

    name: str
    profile: str
    model: str
    gpu: str
    tp: int
    draft: str  # catalogue name of the draft model
    k: int
    draft_tp: int
    base: dict[str, Any]  # the reference deployment's engine settings (overrides of the profile)
    spec: dict[str, Any]  # the speculative deployment's
    mean_in: float
    mean_out: float
    points: tuple[tuple[float, float], ...]  # (request rate, published speedup)
    metric: str  # vLLM benchmark figure the speedup is of
    prompts: int
    source: str
    note: str = ""


_BLOG = ("vLLM blog, 'How Speculative Decoding Boosts vLLM Performance by up to 2.8x', 2024-10-17 "
         "(vllm-project.github.io _posts/2024-10-17-spec-decode.md); charts read by eye: shared/reference/README.md")

CURVES: tuple[SpecCurve, ...] = (
    SpecCurve(
        "vllm06-qwama-70b", "vllm-0.6", "llama-3.1-70b", "h100-sxm", 4, "qwama-0.5b", 4, 1,
        # the post names neither k, the draft's TP nor the reference's flags. k = 4 and draft TP 1 are
        # vLLM's own nightly configuration of this pair (0.6.3); TP 1 is also the only TP that divides
        # Qwama's 14 heads. The reference runs as vLLM's benchmark harness ran vLLM 0.6 (the v0.6.0
        # post: --num-scheduler-steps 10), which speculation refuses (vllm/engine/arg_utils.py)
        {"max_num_batched_tokens": 8192, "scheduler_steps": 10},
        {"max_num_batched_tokens": 8192},
        202, 179,
        ((1.0, 1.55), (2.0, 1.49), (4.0, 1.30), (8.0, 1.03), (10.0, 0.71)),
        "mean_e2el_ms", 500, _BLOG,
        "Llama-3-70B (Llama-3.1-70B's architecture), ShareGPT with the v0.6.0 post's mean lengths (202 in / 179 out)"),
)


def curve(name: str) -> SpecCurve:
    for c in CURVES:
        if c.name == name:
            return c
    raise KeyError(f"no speculation curve '{name}' (have: {', '.join(c.name for c in CURVES)})")


def scenarios(c: SpecCurve, acceptance: float) -> tuple[Scenario, Scenario]:
    """The reference and the speculative scenario of the curve's deployment (one replica)."""
    def one(spec: bool) -> Scenario:
        d: dict[str, Any] = {
            "rack": {"gpu": c.gpu, "num_gpus": c.tp},
            "deployment": {"model": c.model, "tensor_parallel": c.tp, "engine": c.profile, **(c.spec if spec else c.base)},
            "workload": {"rate_rps": 1.0, "duration_s": 600.0, "warmup_s": 60.0,
                         "prompt_tokens": sharegpt_like("prompt_tokens", c.mean_in).model_dump(),
                         "output_tokens": sharegpt_like("output_tokens", c.mean_out).model_dump(),
                         "classes": [{"name": "sharegpt", "share": 1.0, "acceptance": acceptance}]},
        }
        if spec:
            d["speculative"] = {"method": "draft_model", "draft_model": c.draft, "num_speculative_tokens": c.k,
                                "draft_tensor_parallel": c.draft_tp}
        return scenario_from_dict(d)
    return one(False), one(True)


def load_point(c: SpecCurve, rate: float, i: int) -> LoadPoint:
    p = lengths_from(sharegpt_like("prompt_tokens", c.mean_in), c.prompts, 2 * i, "prompt_tokens")
    o = lengths_from(sharegpt_like("output_tokens", c.mean_out), c.prompts, 2 * i + 1, "output_tokens")
    return LoadPoint(f"{c.name}@{rate:g}", p, o, rate)


def _speedup(c: SpecCurve, base: Scenario, spec: Scenario, rate: float, i: int, seed: int) -> dict[str, Any]:
    pt = load_point(c, rate, i)
    tb, ts = simulate_tables(base, pt, seed), simulate_tables(spec, pt, seed)
    mb, ms = bench_metrics(*tb), bench_metrics(*ts)
    kind = "tpot" if "tpot" in c.metric else "e2e"
    return {"rate": rate, "speedup": mb[c.metric] / ms[c.metric], "base": mb[c.metric], "spec": ms[c.metric],
            "parts_base": latency_parts(*tb, metric=kind), "parts_spec": latency_parts(*ts, metric=kind)}


def calibrate_acceptance(c: SpecCurve, seed: int = 1, lo: float = 0.3, hi: float = 0.95, iters: int = 14) -> float:
    """The per-token acceptance at which the simulated speedup at the lightest published rate equals
    the published one (bisection: the speedup rises with acceptance)."""
    rate, target = c.points[0]
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        base, spec = scenarios(c, mid)
        if _speedup(c, base, spec, rate, 0, seed)["speedup"] < target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def simulate_curve(c: SpecCurve, acceptance: float, seed: int = 1) -> list[dict[str, Any]]:
    """Per published rate: simulated and published speedup, and the attribution of the change of the
    simulated speedup from the lightest rate (`sim.attribution.attribute`, ln points)."""
    base, spec = scenarios(c, acceptance)
    rows = [_speedup(c, base, spec, rate, i, seed) for i, (rate, _) in enumerate(c.points)]
    first = rows[0]
    out = []
    for r, (_, pub) in zip(rows, c.points, strict=True):
        attr = attribute(first["parts_base"], first["parts_spec"], r["parts_base"], r["parts_spec"])
        out.append({"rate": r["rate"], "published": pub, "simulated": r["speedup"],
                    **{f"why_{k}": v for k, v in attr.items()}})
    return out


def crossover_rps(rates: list[float], speedups: list[float]) -> float:
    """The lowest rate where the speedup falls below 1.0, interpolated linearly (NaN if never)."""
    for i, s in enumerate(speedups):
        if s < 1.0:
            if i == 0:
                return rates[0]
            return rates[i - 1] + (1.0 - speedups[i - 1]) * (rates[i] - rates[i - 1]) / (s - speedups[i - 1])
    return math.nan


def capacity_rps(c: SpecCurve) -> float:
    """The reference deployment's capacity on the curve's lengths (requests/s)."""
    base, _ = scenarios(c, 0.5)
    return capacity(base).rps


def report(c: SpecCurve, seed: int = 1) -> dict[str, Any]:
    """Acceptance calibrated at the lightest rate, the simulated curve, both crossovers and their
    gap in points of the reference's utilisation."""
    a = calibrate_acceptance(c, seed)
    rows = simulate_curve(c, a, seed)
    rates = [r["rate"] for r in rows]
    sim_x = crossover_rps(rates, [r["simulated"] for r in rows])
    pub_x = crossover_rps(rates, [r["published"] for r in rows])
    cap = capacity_rps(c)
    return {"curve": c.name, "acceptance": a, "rows": rows, "crossover_sim_rps": sim_x, "crossover_pub_rps": pub_x,
            "capacity_rps": cap, "gap_points": 100.0 * (sim_x - pub_x) / cap}


def _main() -> None:
    for c in CURVES:
        rep = report(c)
        print(f"## {c.name} ({c.profile}; {c.note})")
        print(f"acceptance calibrated at {c.points[0][0]:g} req/s: {rep['acceptance']:.3f}; reference capacity "
              f"{rep['capacity_rps']:.2f} req/s")
        print("| req/s | published | simulated | change from lightest (ln) | verification | drafter | host | queueing |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rep["rows"]:
            print(f"| {r['rate']:g} | {r['published']:.2f} | {r['simulated']:.2f} | {r['why_dln_speedup']:+.3f} | "
                  f"{r['why_verify']:+.3f} | {r['why_draft']:+.3f} | {r['why_host']:+.3f} | {r['why_queue']:+.3f} |")
        print(f"crossover: simulated {rep['crossover_sim_rps']:.2f} req/s, published {rep['crossover_pub_rps']:.2f} "
              f"req/s ({rep['gap_points']:+.1f} points of utilisation)")


if __name__ == "__main__":
    _main()
