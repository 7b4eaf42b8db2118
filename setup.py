"""specrack's build: the package, with the engine's hot modules compiled by mypyc when it can.

The compiled modules (`models._native.COMPILED`) are the same source run as C: the same results
bit for bit, several times fewer CPU seconds per engine step (docs/PERFORMANCE.md). Compiling needs
a C compiler and Python's headers; without them (or with SPECRACK_PURE=1) the package installs as
pure Python and says so. An editable install builds them in place and records the sources they were
built from, so an edited source is imported as source until the next install (`models._native`).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any

from setuptools import setup

ROOT = Path(__file__).resolve().parent
_NATIVE = runpy.run_path(str(ROOT / "models" / "_native.py"))
COMPILED: tuple[str, ...] = _NATIVE["COMPILED"]
SHARED: str = _NATIVE["SHARED"]
RECORD = ROOT / "models" / "_native_build.json"
BUILDS = ("build_ext", "editable_wheel", "bdist_wheel", "build", "develop", "install")


def _source(name: str) -> Path:
    return ROOT / (name.replace(".", "/") + ".py")


def _digests() -> dict[str, str]:
    return {n: hashlib.sha256(_source(n).read_bytes()).hexdigest() for n in COMPILED}


def _built(name: str) -> list[Path]:
    base = _source(name).with_suffix("")
    return [p for s in importlib.machinery.EXTENSION_SUFFIXES if (p := base.with_name(base.name + s)).is_file()]


def _up_to_date() -> bool:
    try:
        rec = json.loads(RECORD.read_text())
    except (OSError, ValueError):
        return False
    return (rec.get("cache_tag") == sys.implementation.cache_tag and rec.get("sources") == _digests()
            and all(_built(n) for n in (*COMPILED, SHARED)))


def ext_modules() -> list[Any]:
    if not any(cmd in sys.argv for cmd in BUILDS):
        return []  # (metadata only)
    if os.environ.get("SPECRACK_PURE", "") not in ("", "0"):
        print("specrack: SPECRACK_PURE is set: the engine runs as pure Python")
        return []
    if "editable_wheel" in sys.argv and _up_to_date():
        return []  # built in place from these very sources
    for name in (*COMPILED, SHARED):  # an old build never outlives a failed one
        for p in _built(name):
            p.unlink()
    RECORD.unlink(missing_ok=True)
    try:
        from mypyc.build import mypycify

        # (the build's own environment has no numpy, pandas or their stubs: their types are Any
        # there, so the checks that depend on them are off; the sources are mypy-clean with them)
        flags = ["--ignore-missing-imports", "--no-warn-unused-ignores", "--follow-imports=silent"]
        exts = mypycify([*flags, *(str(_source(n).relative_to(ROOT)) for n in COMPILED)],
                        opt_level="1", group_name=SHARED.removesuffix("__mypyc"))
    except (Exception, SystemExit) as err:  # no mypyc, or it cannot compile these sources
        print(f"specrack: not compiling the engine ({err!r}): it runs as pure Python")
        return []
    for e in exts:
        e.optional = True  # no C compiler or headers: a warning, and pure Python
    RECORD.write_text(json.dumps({"cache_tag": sys.implementation.cache_tag, "sources": _digests()}, indent=1))
    return exts


setup(ext_modules=ext_modules())
