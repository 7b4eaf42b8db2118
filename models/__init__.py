"""Pure analytic models of LLM serving: catalogues, step cost, memory, speculation, quality.

Nothing here imports SimPy; every function is importable and testable on its own.
"""

from models import _native  # noqa: F401  (first: the compiled modules are imported only when built from these sources)
from models.catalog import (
    GPUS,
    KV_FORMATS,
    MODELS,
    WEIGHT_FORMATS,
    get_gpu,
    get_kv_format,
    get_model,
    get_weight_format,
)
from models.cost import CostModel, Efficiency, StepCost, efficiency_for
from models.errors import ConfigError
from models.memory import MemoryPlan, plan_memory

__all__ = [
    "GPUS",
    "KV_FORMATS",
    "MODELS",
    "WEIGHT_FORMATS",
    "ConfigError",
    "CostModel",
    "Efficiency",
    "MemoryPlan",
    "StepCost",
    "efficiency_for",
    "get_gpu",
    "get_kv_format",
    "get_model",
    "get_weight_format",
    "plan_memory",
]
