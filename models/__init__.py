"""Pure analytic models of LLM serving: catalogues, step cost, memory, speculation, quality.

Nothing here imports SimPy; every function is importable and testable on its own. The names
below are loaded on first use (PEP 562), so `import models` (every command, `specrack --help`)
does not import numpy.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from models import _native  # noqa: F401  (first: the compiled modules are imported only when built from these sources)

if TYPE_CHECKING:
    from models.catalog import GPUS as GPUS
    from models.catalog import KV_FORMATS as KV_FORMATS
    from models.catalog import MODELS as MODELS
    from models.catalog import WEIGHT_FORMATS as WEIGHT_FORMATS
    from models.catalog import get_gpu as get_gpu
    from models.catalog import get_kv_format as get_kv_format
    from models.catalog import get_model as get_model
    from models.catalog import get_weight_format as get_weight_format
    from models.cost import CostModel as CostModel
    from models.cost import Efficiency as Efficiency
    from models.cost import StepCost as StepCost
    from models.cost import efficiency_for as efficiency_for
    from models.errors import ConfigError as ConfigError
    from models.memory import MemoryPlan as MemoryPlan
    from models.memory import plan_memory as plan_memory

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

# name -> the module it is re-exported from, imported on first access
_LAZY = {
    **dict.fromkeys(("GPUS", "KV_FORMATS", "MODELS", "WEIGHT_FORMATS", "get_gpu", "get_kv_format", "get_model",
                     "get_weight_format"), "models.catalog"),
    **dict.fromkeys(("CostModel", "Efficiency", "StepCost", "efficiency_for"), "models.cost"),
    "ConfigError": "models.errors",
    **dict.fromkeys(("MemoryPlan", "plan_memory"), "models.memory"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # once loaded, a plain attribute
        return value
    raise AttributeError(f"module 'models' has no attribute '{name}'")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
