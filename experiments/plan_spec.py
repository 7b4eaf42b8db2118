"""A validated plan: what `experiments.plan.load_plan` returns and every later stage reads."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from experiments.plan_cost import CostSpec
from experiments.plan_day import DaySpec
from experiments.planfile import SearchSpec, Strategy, Traffic
from models.catalog import get_gpu
from models.engines import get_profile
from sim.scenario import Scenario


@dataclass(frozen=True)
class PlanSpec:
    """A checked plan file: the base scenario with the plan's SLO and traffic applied, the
    strategies and GPU types to search, the rack rules, prices and cost, the analyses' axes and
    where finished simulations are kept (`points`)."""

    name: str
    base: Scenario
    rate_rps: float
    strategies: tuple[Strategy, ...]
    gpus: tuple[str, ...]
    prices: dict[str, float]
    max_gpus: int
    seeds: tuple[int, ...]
    quality_floor_tail: float
    teacher_updates_per_month: float
    curve_multipliers: tuple[float, ...]
    map_utilisation: tuple[float, ...]
    map_acceptance: tuple[float, ...]
    shift_tail_shares: tuple[float, ...]
    shift_utilisation: float
    traffic: Traffic | None = None
    not_applicable: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)  # (strategy, gpu) -> why
    expected_requests: int = 0  # requests arriving in the measured window of one run at the plan's rate
    day: DaySpec | None = None  # [day]: the day replayed on an autoscaled fleet (experiments/plan_day.py)
    warnings: tuple[str, ...] = ()
    search: SearchSpec = dataclasses.field(default_factory=lambda: SearchSpec(configurations=False))
    cost: CostSpec = dataclasses.field(default_factory=CostSpec)
    points: str | None = None  # OUT/points: finished simulations kept for a resumed run (experiments.plan_store)
    progress: bool = False  # progress bars with an ETA on stderr (`specrack plan`; off in the API and notebooks)

    def inputs(self) -> dict[str, str]:
        """The effective inputs, for the terminal header and the report."""
        b = self.base
        dep, dist, wl = b.deployment, b.deployment.distillation, b.workload
        sched = dep.scheduling()
        prices = ", ".join(f"{g} ${self.prices[g]:g}/h" if g in self.prices else f"{g} (catalogue ${get_gpu(g).usd_per_gpu_hour:g}/h)"
                           for g in self.gpus)
        train_price = dist.training_usd_per_gpu_hour
        train_price = get_gpu(dist.training_gpu).usd_per_gpu_hour if train_price is None else train_price
        traffic = self.traffic.describe() if self.traffic else f"{self.rate_rps:.2f} req/s"
        return {
            "model": f"{dep.model}, TP{dep.tensor_parallel}, weights {dep.weights}, KV cache {dep.kv_cache} (precision)",
            "engine": f"{dep.engine} ({get_profile(dep.engine).engine}): {sched.prefill} prefill"
                      f"{', chunked' if sched.chunked_prefill else ', whole prompts'}, max_num_batched_tokens "
                      f"{sched.max_num_batched_tokens}, max_num_seqs {sched.max_num_seqs}",
            "base rack": f"{b.rack.num_gpus}x {b.rack.gpu} (the search sizes racks of {', '.join(self.gpus)} up to {self.max_gpus} GPUs)",
            "routing and prefix caching": f"router {dep.router}, prefix caching {'on' if dep.prefix_caching else 'off'}"
                                          + (f"; conversations of {wl.conversations.turns} turns" if wl.conversations
                                             else ""),
            "strategies": ", ".join(s.name for s in self.strategies),
            "SLO": f"{b.slo.describe()}, judged on a stable run (every seed)",
            "tail-quality floor": f"{self.quality_floor_tail:g}",
            "configuration search": self.search.describe(),
            "rack rules": self.search.rules(),
            "cost": self.cost.describe(self.gpus),
            "prices": prices if self.cost.mode == "rent" else f"{prices} (rent prices; unused in buy mode)",
            "retraining": f"{self.teacher_updates_per_month:g} teacher updates/month, trained on {dist.training_gpu} at ${train_price:g}/h",
            "traffic": traffic + (" (the peak of [day])" if self.day else ""),
            **({"day": self.day.describe()} if self.day else {}),
            "simulated": f"{wl.duration_s:.0f} s per run after {wl.warmup_s:.0f} s warm-up included; "
                         f"~{self.expected_requests} measured requests per run; seeds {list(self.seeds)}",
        }
