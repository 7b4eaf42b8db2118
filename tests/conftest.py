"""Shared fixtures for the simulator tests: the example scenario, small scenarios built from dicts,
and a wall-clock guard so that a scheduling livelock fails a test instead of hanging the suite."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

# the engine's modules as source, also where they are compiled (models/_native.py): tests patch
# their methods, which compiled classes do not allow; tests/test_native.py runs both builds
os.environ["SPECRACK_PURE"] = "1"
# no capacity cache on disk (sim.capacity.default_cache_dir): tests patch the engine, and a capacity
# measured under a patch must not be read by another run; a test that checks the cache names a folder
os.environ["SPECRACK_CAPACITY_CACHE"] = "off"

from sim.scenario import Scenario, load_scenario, scenario_from_dict

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "experiments" / "scenarios" / "llama70b-h100x8.toml"


@pytest.fixture(scope="session")
def example_path() -> Path:
    return EXAMPLE


@pytest.fixture(scope="session")
def example_short() -> Scenario:
    """The example scenario, shortened to a 120 s run with 10 s of warm-up."""
    return load_scenario(EXAMPLE, {"workload.duration_s": 120, "workload.warmup_s": 10})


@pytest.fixture(scope="session")
def make_scenario() -> Callable[..., Scenario]:
    """A scenario from a nested dict, merged over a small one-replica base (llama-3.1-70b, TP4 on
    four H100s), so a test only writes the fields it cares about."""

    def make(**sections: dict[str, Any]) -> Scenario:
        data: dict[str, Any] = {
            "rack": {"gpu": "h100-sxm", "num_gpus": 4},
            "deployment": {"model": "llama-3.1-70b", "tensor_parallel": 4},
            "workload": {"rate_rps": 1.0, "duration_s": 60.0, "warmup_s": 0.0},
        }
        for key, value in sections.items():
            if isinstance(value, dict) and isinstance(data.get(key), dict):
                data[key] = {**data[key], **value}
            else:
                data[key] = value
        return scenario_from_dict(data)

    return make


@contextlib.contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Fail (instead of hanging) when the body runs longer than `seconds` of wall-clock time."""
    if not hasattr(signal, "SIGALRM"):  # pragma: no cover - not on POSIX
        yield
        return

    def _raise(signum: int, frame: Any) -> None:
        raise TimeoutError(f"did not finish within {seconds:g} s (livelock?)")

    old = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


@pytest.fixture
def time_limit() -> Callable[[float], contextlib.AbstractContextManager[None]]:
    return _time_limit
