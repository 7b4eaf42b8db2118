"""The toolchain the project promises: ruff over everything, mypy over models/ and sim/."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _tool(name: str) -> str:
    exe = Path(sys.executable).parent / name
    found = str(exe) if exe.exists() else shutil.which(name)
    if not found:
        pytest.skip(f"{name} is not installed (pip install -e '.[test]')")
    return found


def test_ruff_is_clean() -> None:
    out = subprocess.run([_tool("ruff"), "check", "."], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:]


def test_mypy_is_clean_on_models_and_sim() -> None:
    out = subprocess.run([_tool("mypy")], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-3000:]
