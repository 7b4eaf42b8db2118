"""A strategy on a rack: the scenario of a strategy on so many replicas of a GPU type at an
offered rate, and a configuration (tp, max_num_batched_tokens, max_num_seqs, k) applied to a
strategy, read from a scenario or from a plan.csv row."""

from __future__ import annotations

from typing import Any

from experiments.planfile import Strategy, Traffic
from sim.deployment import gpus_per_replica
from sim.scenario import Scenario


def at_rate(traffic: Traffic | None, rate: float) -> dict[str, Any]:
    """Workload overrides offering `rate` req/s: the plan's traffic (a trace window, time-scaled)
    or, without one, a plain rate."""
    return traffic.overrides(rate) if traffic is not None else {"workload.rate_rps": rate}


def scenario_for(base: Scenario, s: Strategy, gpu: str, prices: dict[str, float], replicas: int, rate: float | None,
              teacher_updates: float | None = None, *, traffic: Traffic | None = None) -> Scenario:
    """The strategy on `replicas` replicas of this GPU type, offered `rate` requests/s (a trace
    plan's window replayed at that rate when `traffic` is a trace; None keeps the base's)."""
    # any rack large enough for one replica while the strategy is applied; sized below
    sc = base.with_overrides({**s.overrides, "rack.gpu": gpu, "rack.num_gpus": 4096, "rack.allow_idle_gpus": True})
    over: dict[str, Any] = {"rack.num_gpus": replicas * gpus_per_replica(sc), "rack.allow_idle_gpus": base.rack.allow_idle_gpus}
    if rate is not None:
        over.update(at_rate(traffic, rate))
    if gpu in prices:
        over["rack.usd_per_gpu_hour"] = prices[gpu]
    elif base.rack.usd_per_gpu_hour is not None and gpu == base.rack.gpu:
        over["rack.usd_per_gpu_hour"] = base.rack.usd_per_gpu_hour
    else:
        over["rack.usd_per_gpu_hour"] = None
    if teacher_updates is not None and sc.deployment.distilled_from:
        over["deployment.distillation.teacher_updates_per_month"] = teacher_updates
    return sc.with_overrides(over)


def on_base_rack(base: Scenario, s: Strategy) -> Scenario:
    """The strategy on the base scenario's rack: its GPUs, or with a dedicated draft the replicas
    the base rack's GPUs hold at the strategy's tensor parallelism, each with its draft GPUs added
    (speculation off, `sim.capacity.baseline_of`, is the base rack again)."""
    sc = base.with_overrides({**s.overrides, "rack.num_gpus": 4096, "rack.allow_idle_gpus": True})
    if sc.speculative is None or sc.speculative.placement != "dedicated":
        return base.with_overrides(s.overrides)
    replicas = base.rack.num_gpus // sc.deployment.tensor_parallel
    return sc.with_overrides({"rack.num_gpus": replicas * gpus_per_replica(sc),
                              "rack.allow_idle_gpus": base.rack.allow_idle_gpus})


def configured(s: Strategy, base: Scenario, cfg: dict[str, int | None]) -> Strategy:
    """The strategy with a configuration applied: tp, max_num_batched_tokens, max_num_seqs, k
    (None keeps the strategy's own)."""
    over = dict(s.overrides)
    for key, field in (("tp", "deployment.tensor_parallel"), ("max_num_batched_tokens", "deployment.max_num_batched_tokens"),
                       ("max_num_seqs", "deployment.max_num_seqs")):
        if cfg.get(key) is not None:
            over[field] = cfg[key]
    k = cfg.get("k")
    if k is not None:
        spec = over.get("speculative")
        if isinstance(spec, dict):
            over["speculative"] = {**spec, "num_speculative_tokens": k}
        elif base.speculative is not None and "speculative" not in over:
            over["speculative"] = {**base.speculative.model_dump(mode="json"), "num_speculative_tokens": k}
    return Strategy(s.name, over)


def config_of(sc: Scenario) -> dict[str, int | None]:
    """The configuration a scenario resolves to (plan.csv's tp, max_num_batched_tokens, ... columns)."""
    sched = sc.deployment.scheduling()
    return {"tp": sc.deployment.tensor_parallel, "max_num_batched_tokens": sched.max_num_batched_tokens,
            "max_num_seqs": sched.max_num_seqs, "k": sc.speculative.num_speculative_tokens if sc.speculative else None}


def row_config(r: Any) -> dict[str, int | None]:
    """The configuration of a plan.csv row (tp, max_num_batched_tokens, max_num_seqs, k)."""
    out: dict[str, int | None] = {}
    for k in ("tp", "max_num_batched_tokens", "max_num_seqs", "k"):
        v = r.get(k) if hasattr(r, "get") else None
        out[k] = int(v) if v is not None and v == v else None
    return out
