"""What makes a plan resumable: every simulation a plan runs (a rack at a rate, one seed) and every
capacity it measures is written, whole or not at all, into OUT/points/ as it finishes, keyed by
the scenario's content hash (`Scenario.key()`, which covers the files it reads) and the seed.
A rerun of the same plan reads them back instead of simulating: an interrupted `specrack plan`
loses only the runs in flight, and a rerun gives the same answer with fewer simulations (a run
is a pure function of its scenario and seed, and a JSON float round-trips exactly).

With no folder (`points=None`, the Python API's default) nothing is read or written."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from experiments.pool import write_atomic
from sim.capacity import Capacity, CapacityStore, capacity_for
from sim.capacity import capacity_key as _capacity_key
from sim.scenario import Scenario
from sim.simulate import simulate

SUMMARY_PREFIX = "run-"
CAPACITY_PREFIX = "capacity-"
LADDER_PREFIX = "ladder-"  # a capacity ladder whose collapse is not refined yet (an upper bound)
# The planner's capacities in this process, each measured once (`capacity_of`, `ladder_of`): the
# parent's measurements before a pool forks are its workers' too; with a points folder they are
# also kept on disk across runs. Every run the planner simulates takes its capacity from here.
STORE = CapacityStore()


def use_cache(folder: str | Path | None) -> None:
    """Keep the planner's capacities in the on-disk capacity cache too (`sim.capacity.default_cache_dir`;
    None: none), so another plan over the same deployments measures none of them."""
    STORE.folder = None if folder is None else Path(folder)


def _read(path: Path) -> dict[str, Any] | None:
    """A finished point, or None when absent or unreadable (a half-written or foreign file: rerun)."""
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


def summary(sc: Scenario, seed: int, points: str | None) -> dict[str, Any]:
    """The run's summary (`simulate(sc, seed).summary`), from OUT/points when an earlier run of the
    plan finished it, else simulated and kept there."""
    if points is None:
        return simulate(sc, seed, capacity=capacity_for(sc, store=STORE)).summary
    path = Path(points) / f"{SUMMARY_PREFIX}{sc.key()}-{seed}.json"
    d = _read(path)
    if d is not None and "summary" in d:
        return dict(d["summary"])
    sm = simulate(sc, seed, capacity=capacity_for(sc, store=STORE)).summary
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"seed": seed, "summary": sm}, default=float))
    return json.loads(json.dumps(sm, default=float))  # the same values a resumed run reads back


def _kept(path: Path, key: str) -> Capacity | None:
    d = _read(path)
    if d is None or d.get("key") != key:
        return None
    try:
        return Capacity(**{**d["capacity"], "curve": tuple(tuple(r) for r in d["capacity"]["curve"])})
    except (KeyError, TypeError):
        return None


def _keep(path: Path, key: str, cap: Capacity) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps({"key": key, "capacity": dataclasses.asdict(cap)}, default=float))


def _path(points: str, prefix: str, key: str) -> Path:
    return Path(points) / f"{prefix}{hashlib.sha256(key.encode()).hexdigest()[:32]}.json"


def ladder_of(sc: Scenario, points: str | None, *, speculative: bool = False) -> Capacity:
    """`CapacityStore.ladder` in `STORE` (the capacity, or where the throughput collapses an upper bound on
    it), kept in OUT/points across runs of the plan (a measured capacity is used when kept)."""
    if points is None:
        return STORE.ladder(sc, speculative=speculative)
    key = _capacity_key(sc, speculative=speculative)
    for prefix, is_ladder in ((CAPACITY_PREFIX, False), (LADDER_PREFIX, True)):
        cap = _kept(_path(points, prefix, key), key)
        if cap is not None:
            STORE.remember(key, cap, is_ladder=is_ladder)
            return cap
    lad = STORE.ladder(sc, speculative=speculative)
    _keep(_path(points, LADDER_PREFIX if lad.upper_bound else CAPACITY_PREFIX, key), key, lad)
    return lad


def capacity_of(sc: Scenario, points: str | None, *, speculative: bool = False) -> Capacity:
    """`CapacityStore.capacity` in `STORE`, kept in OUT/points across runs of the plan."""
    if points is None:
        return STORE.capacity(sc, speculative=speculative)
    key = _capacity_key(sc, speculative=speculative)
    path = _path(points, CAPACITY_PREFIX, key)
    cap = _kept(path, key)
    if cap is not None:
        STORE.remember(key, cap)
        return cap
    ladder_of(sc, points, speculative=speculative)  # its ladder from OUT/points, when kept
    cap = STORE.capacity(sc, speculative=speculative)
    _keep(path, key, cap)
    return cap


def count(points: str | None) -> int:
    """Finished simulations and capacity measurements kept in OUT/points."""
    if points is None or not Path(points).is_dir():
        return 0
    return sum(1 for p in Path(points).glob("*.json") if p.name.startswith((SUMMARY_PREFIX, CAPACITY_PREFIX, LADDER_PREFIX)))


def clean(points: str | None) -> None:
    """Remove the half-written files of a killed run."""
    if points is not None and Path(points).is_dir():
        for stale in Path(points).glob("*.json.tmp*"):
            stale.unlink(missing_ok=True)
