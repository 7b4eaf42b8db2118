"""Helpers shared by the test files (importable: pytest puts this folder on sys.path)."""

from __future__ import annotations

import re
from typing import Any

import sim.engine
import sim.fusion
from sim.capacity import Capacity, CapacityStore
from sim.scenario import Scenario


def one_line_error(err: str, ignore: re.Pattern[str] | None = None) -> str:
    """The CLI's stderr holds exactly one `specrack: error: ...` line and no traceback (lines
    matching `ignore`, e.g. a progress header printed before the error, are skipped)."""
    lines = [ln for ln in err.strip().splitlines() if not (ignore and ignore.match(ln))]
    assert len(lines) == 1, f"expected one error line, got:\n{err}"
    assert lines[0].startswith("specrack: error: "), err
    assert "Traceback" not in err
    return lines[0]


def patch_fusion(monkeypatch: Any, name: str, fn: Any) -> None:
    """Replace the fused-run function `sim.fusion.<name>` wherever it is called from: the fusion
    module itself and the engine process, which imports it by name."""
    for mod in (sim.fusion, sim.engine):
        if hasattr(mod, name):
            monkeypatch.setattr(mod, name, fn)


# the tests' capacities: each deployment measured once per test process (a run takes its capacity
# as an input; a test that needs one asks here)
CAPACITIES = CapacityStore()


def capacity(sc: Scenario, *, speculative: bool = False) -> Capacity:
    """`CapacityStore.capacity` in the tests' store."""
    return CAPACITIES.capacity(sc, speculative=speculative)


def ladder(sc: Scenario, *, speculative: bool = False) -> Capacity:
    """`CapacityStore.ladder` in the tests' store."""
    return CAPACITIES.ladder(sc, speculative=speculative)
