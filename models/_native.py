"""Which build of the engine's hot modules Python imports: compiled (mypyc) or the source.

`pip install -e .` compiles `COMPILED` with mypyc when it can (setup.py: a C compiler and
Python's headers; otherwise it installs pure Python). The compiled modules are the
same source, so they give the same results bit for bit (tests/test_native.py) at a fraction of the
per-step cost (docs/PERFORMANCE.md). Python prefers an extension module to a source file of the
same name, so an edited source would silently run its old compiled build: the finder below imports
a compiled module only when the source it was built from (its SHA-256, recorded by setup.py in
`BUILD_RECORD`) is the source on disk, and the source otherwise. `SPECRACK_PURE=1` imports the
sources whatever is built (the tests do: they patch methods, which compiled classes do not allow).

No import here beyond the standard library: importing it installs the finder (`models` imports
it first).
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
COMPILED = ("models.cost", "sim.tables", "sim.pricing", "sim.state", "sim.policies", "sim.step", "sim.plans", "sim.joint",
            "sim.fusion", "sim.engine", "sim.fleet", "sim.run", "sim.prefix_cache")  # (a compiled class's subclasses are compiled too)
SHARED = "models._specrack__mypyc"  # mypyc's library of all of them (setup.py's group name)
BUILD_RECORD = ROOT / "models" / "_native_build.json"
PURE_ENV = "SPECRACK_PURE"


def source_of(name: str) -> Path:
    return ROOT / (name.replace(".", "/") + ".py")


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def pure_requested() -> bool:
    return os.environ.get(PURE_ENV, "") not in ("", "0")


def _extension(name: str) -> Path | None:
    base = source_of(name).with_suffix("")
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        p = base.with_name(base.name + suffix)
        if p.is_file():
            return p
    return None


def _record() -> dict[str, Any]:
    try:
        d = json.loads(BUILD_RECORD.read_text())
    except (OSError, ValueError):
        return {}
    return d if isinstance(d, dict) else {}


def compiled_ok() -> bool:
    """Whether the modules of COMPILED may be imported compiled: not asked for the sources, and
    every one of them (and mypyc's library of them) built for this Python from the source now on
    disk. All or none: a compiled module reads the others' compiled classes natively."""
    if pure_requested() or _extension(SHARED) is None or any(_extension(n) is None for n in COMPILED):
        return False
    rec = _record()
    if rec.get("cache_tag") != sys.implementation.cache_tag:
        return False
    try:
        return bool(rec.get("sources") == {n: digest(source_of(n)) for n in COMPILED})
    except OSError:
        return False


class _Finder(importlib.abc.MetaPathFinder):
    """Imports a module of COMPILED from its source unless `compiled_ok` (then the default
    finders load the extension; checked once)."""

    ok: bool | None = None

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in COMPILED:
            return None
        if _Finder.ok is None:
            _Finder.ok = compiled_ok()
        if _Finder.ok:
            return None
        return importlib.util.spec_from_file_location(fullname, source_of(fullname))


def install() -> None:
    """Put the finder first on sys.meta_path (once)."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


def compiled_modules() -> tuple[str, ...]:
    """The modules of COMPILED imported compiled so far (an extension module's file is not .py)."""
    return tuple(n for n in COMPILED if n in sys.modules and not str(getattr(sys.modules[n], "__file__", "")).endswith(".py"))


def build_label() -> str:
    """'compiled (mypyc)' or 'pure Python' (with why), for benchmarks and reports."""
    got = compiled_modules()
    if got and len(got) == sum(n in sys.modules for n in COMPILED):
        return "compiled (mypyc)"
    if not any(n in sys.modules for n in COMPILED) and compiled_ok():  # (none imported yet: those that would be)
        return "compiled (mypyc)"
    if pure_requested():
        return f"pure Python ({PURE_ENV} set)"
    if _extension(SHARED) is None:
        return "pure Python (not compiled at install)"
    return "pure Python (the sources changed since they were compiled: reinstall to rebuild)"


if __name__ == "models._native":  # (setup.py reads COMPILED without installing it)
    install()
