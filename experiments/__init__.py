"""Experiments: sweeps, analysis, charts, reports and the command line, composed from sim/ and models/."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from models.errors import unknown


def _bundled(folder: str, kind: str, name: str) -> Path:
    root = Path(str(resources.files("experiments") / folder))
    stem = name.removesuffix(".toml")
    path = root / f"{stem}.toml"
    if not path.is_file():
        raise unknown(kind, stem, tuple(sorted(p.stem for p in root.glob("*.toml"))))
    return path


def bundled_scenario(name: str) -> Path:
    """Path of a scenario shipped in experiments/scenarios (name with or without .toml)."""
    return _bundled("scenarios", "bundled scenario", name)


def bundled_plan(name: str) -> Path:
    """Path of a plan file shipped in experiments/plans (name with or without .toml)."""
    return _bundled("plans", "bundled plan", name)
