"""Total cost of ownership of a planned rack: renting GPUs by the hour, or buying them.

Plain functions of a rack's size and its measured busy fraction (no SimPy), so a row's cost can
be checked by hand.

- **rent**: `serving = billed GPUs x usd_per_gpu_hour x 720 h`; power is in the rent (0).
- **buy**: `serving = billed GPUs x capex_usd_per_gpu / (12 x amortisation_years)
  + nodes x (capex_usd_per_node / (12 x amortisation_years) + hosting_usd_per_node_month)`;
  `power = TDP x draw x PUE x 720 h x usd_per_kwh`, where a serving GPU draws
  `idle_power_fraction + (1 - idle_power_fraction) x gpu_busy_fraction` of its TDP (the busy
  fraction the run measured) and a GPU a node holds but no replica uses draws the idle fraction.

Assumptions, stated rather than measured: PUE 1.3 and $0.10/kWh are typical figures for a
colocation data centre and an industrial tariff (override them); a GPU that is not computing
still draws 30% of its TDP (HBM refresh, clocks, fans: H100s idle around 60-100 W of 700 W,
and a loaded server between steps sits well above idle); capex is amortised straight-line over 4
years with no residual value; the host's CPUs, network and storage power are not counted (put
them in hosting_usd_per_node_month). TDP comes from the GPU catalogue (vendor datasheets).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from models.catalog import get_gpu
from models.errors import ConfigError

HOURS_PER_MONTH = 720.0
MODES = ("rent", "buy")
BUY_KEYS = ("capex_usd_per_gpu", "capex_usd_per_node", "amortisation_years", "usd_per_kwh", "pue",
            "hosting_usd_per_node_month", "idle_power_fraction")
COST_KEYS = ("mode", *BUY_KEYS)
DEFAULTS = {"capex_usd_per_node": 0.0, "amortisation_years": 4.0, "usd_per_kwh": 0.10, "pue": 1.3,
            "hosting_usd_per_node_month": 0.0, "idle_power_fraction": 0.3}


@dataclass(frozen=True)
class CostSpec:
    """How a plan prices a rack. `capex_usd_per_gpu` by GPU type (buy mode only)."""

    mode: str = "rent"
    capex_usd_per_gpu: dict[str, float] = field(default_factory=dict)
    capex_usd_per_node: float = 0.0
    amortisation_years: float = 4.0
    usd_per_kwh: float = 0.10
    pue: float = 1.3
    hosting_usd_per_node_month: float = 0.0
    idle_power_fraction: float = 0.3

    def describe(self, gpus: tuple[str, ...]) -> str:
        if self.mode == "rent":
            return "rent (usd_per_gpu_hour x 720 h/month; power is in the rent)"
        capex = ", ".join(f"{g} ${self.capex_usd_per_gpu[g]:,.0f}" for g in gpus)
        return (f"buy: capex per GPU {capex}, per node ${self.capex_usd_per_node:,.0f}, amortised over "
                f"{self.amortisation_years:g} years; hosting ${self.hosting_usd_per_node_month:,.0f}/node/month; power "
                f"TDP x ({self.idle_power_fraction:g} + {1 - self.idle_power_fraction:g} x busy fraction) x PUE "
                f"{self.pue:g} x ${self.usd_per_kwh:g}/kWh")


def rack_nodes(replicas: int, gpus_per_replica: int, gpus_per_node: int | None) -> tuple[int, int]:
    """(nodes, billed GPUs): whole nodes when GPUs come in nodes, a replica never straddling
    two (so a node holds gpus_per_node // gpus_per_replica replicas); else one GPU at a time."""
    used = replicas * gpus_per_replica
    if gpus_per_node is None:
        return 0, used
    if gpus_per_replica > gpus_per_node:
        raise ConfigError(f"a replica of {gpus_per_replica} GPUs does not fit in a node of {gpus_per_node}")
    nodes = math.ceil(replicas / (gpus_per_node // gpus_per_replica))
    return nodes, nodes * gpus_per_node


def monthly_cost(cost: CostSpec, gpu: str, usd_per_gpu_hour: float, replicas: int, gpus_per_replica: int,
                 gpus_per_node: int | None, busy_fraction: float) -> dict[str, float | int | str]:
    """The monthly cost split of a rack of `replicas` (retraining is added by the caller)."""
    nodes, billed = rack_nodes(replicas, gpus_per_replica, gpus_per_node)
    used = replicas * gpus_per_replica
    out: dict[str, float | int | str] = {"cost_mode": cost.mode, "nodes": nodes, "billed_gpus": billed}
    if cost.mode == "rent":
        out.update(serving_usd_per_month=billed * usd_per_gpu_hour * HOURS_PER_MONTH, power_usd_per_month=0.0)
        return out
    months = 12.0 * cost.amortisation_years
    serving = (billed * cost.capex_usd_per_gpu[gpu] / months
               + nodes * (cost.capex_usd_per_node / months + cost.hosting_usd_per_node_month))
    idle = cost.idle_power_fraction
    busy = min(max(busy_fraction if busy_fraction == busy_fraction else 1.0, 0.0), 1.0)
    draw = used * (idle + (1.0 - idle) * busy) + (billed - used) * idle  # in TDPs
    kwh = get_gpu(gpu).tdp_w * draw * cost.pue * HOURS_PER_MONTH / 1000.0
    out.update(serving_usd_per_month=serving, power_usd_per_month=kwh * cost.usd_per_kwh)
    return out


def parse_cost(t: dict[str, Any], gpus: tuple[str, ...], gpus_per_node: int | None) -> CostSpec:
    """Validate the plan's [cost] table (keys already checked against COST_KEYS)."""
    mode = t.get("mode", "rent")
    if mode not in MODES:
        raise ConfigError(f"cost.mode: must be 'rent' or 'buy', got {mode!r}")
    if mode == "rent":
        extra = [k for k in BUY_KEYS if k in t]
        if extra:
            raise ConfigError(f"cost.{extra[0]}: only used with cost.mode = 'buy' (rent prices GPUs by the hour: "
                              "search.usd_per_gpu_hour); set mode = 'buy' or remove it")
        return CostSpec()
    vals: dict[str, float] = {}
    for k, default in DEFAULTS.items():
        v = t.get(k, default)
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0
        if ok and k in ("amortisation_years", "pue"):
            ok = v >= (1.0 if k == "pue" else 0.0) and v > 0
        if ok and k == "idle_power_fraction":
            ok = v <= 1
        if not ok:
            rule = {"pue": ">= 1", "amortisation_years": "> 0", "idle_power_fraction": "in [0, 1]"}.get(k, ">= 0")
            raise ConfigError(f"cost.{k}: must be a number {rule}, got {v!r}")
        vals[k] = float(v)
    if "capex_usd_per_gpu" not in t:
        raise ConfigError("cost.capex_usd_per_gpu: missing (buy mode needs the purchase price per GPU, a number or "
                          f"a table by GPU such as {{ {gpus[0]} = 30000 }})")
    raw = t["capex_usd_per_gpu"]
    table = raw if isinstance(raw, dict) else dict.fromkeys(gpus, raw)
    capex: dict[str, float] = {}
    for g, v in table.items():
        if g.lower() not in gpus:
            raise ConfigError(f"cost.capex_usd_per_gpu.{g}: prices a GPU not in search.gpus ({', '.join(gpus)})")
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not (math.isfinite(v) and v > 0):
            raise ConfigError(f"cost.capex_usd_per_gpu: must be a positive number (or a table of them), got {v!r}")
        capex[g.lower()] = float(v)
    missing = [g for g in gpus if g not in capex]
    if missing:
        raise ConfigError(f"cost.capex_usd_per_gpu: no price for {', '.join(missing)} (every GPU in search.gpus needs one)")
    if gpus_per_node is None and (vals["capex_usd_per_node"] or vals["hosting_usd_per_node_month"]):
        raise ConfigError("cost: capex_usd_per_node and hosting_usd_per_node_month price whole nodes; set "
                          "search.gpus_per_node (e.g. 8)")
    return CostSpec("buy", capex, **vals)
