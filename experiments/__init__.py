"""Experiments: sweeps, analysis, charts, reports and the command line, composed from sim/ and models/."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def bundled_scenario(name: str) -> Path:
    """Path of a scenario shipped in experiments/scenarios (name with or without .toml)."""
    from models.errors import unknown

    folder = Path(str(resources.files("experiments") / "scenarios"))
    stem = name.removesuffix(".toml")
    path = folder / f"{stem}.toml"
    if not path.is_file():
        raise unknown("bundled scenario", stem, tuple(sorted(p.stem for p in folder.glob("*.toml"))))
    return path


def bundled_plan(name: str) -> Path:
    """Path of a plan file shipped in experiments/plans (name with or without .toml)."""
    from models.errors import unknown

    folder = Path(str(resources.files("experiments") / "plans"))
    stem = name.removesuffix(".toml")
    path = folder / f"{stem}.toml"
    if not path.is_file():
        raise unknown("bundled plan", stem, tuple(sorted(p.stem for p in folder.glob("*.toml"))))
    return path
