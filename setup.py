"""specrack's build: the package, with the engine's hot modules compiled by mypyc when it can.

The compiled modules (`models._native.COMPILED`) are the same source run as C: the same results
bit for bit, about half the CPU seconds per run (docs/PERFORMANCE.md, "Compiled engine").
Compiling needs a C compiler and Python's headers; without them (or with SPECRACK_PURE=1) the
package installs as pure Python (`specrack sweep`, `plan` and `bench` name the build they run).
An editable install builds them in place and records the sources they were built from, so an
edited source is imported as source until the next install (`models._native`).
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path
from typing import Any

from setuptools import setup

ROOT = Path(__file__).resolve().parent
# models/_native.py (standard library only, run without importing the package): what to compile,
# where the record goes, and the check the import finder makes
_NATIVE = runpy.run_path(str(ROOT / "models" / "_native.py"))
COMPILED: tuple[str, ...] = _NATIVE["COMPILED"]
SHARED: str = _NATIVE["SHARED"]
RECORD: Path = _NATIVE["BUILD_RECORD"]
source_of, digest, extension, compiled_ok = (_NATIVE[k] for k in ("source_of", "digest", "_extension", "compiled_ok"))
PACKAGES = ("models", "sim", "experiments", "specrack")
BUILDS = ("build_ext", "editable_wheel", "bdist_wheel", "build", "develop", "install")


def ext_modules() -> list[Any]:
    if not any(cmd in sys.argv for cmd in BUILDS):
        return []  # (metadata only)
    if os.environ.get("SPECRACK_PURE", "") not in ("", "0"):
        print("specrack: SPECRACK_PURE is set: the engine runs as pure Python")
        return []
    if "editable_wheel" in sys.argv and compiled_ok():
        return []  # built in place from these very sources
    for name in (*COMPILED, SHARED):  # an old build never outlives a failed one
        while (p := extension(name)) is not None:
            p.unlink()
    RECORD.unlink(missing_ok=True)
    try:
        from mypyc.build import mypycify

        # (the build's own environment has no numpy, pandas or their stubs: their types are Any
        # there, so the checks that depend on them are off; the sources are mypy-clean with them)
        flags = ["--ignore-missing-imports", "--no-warn-unused-ignores", "--follow-imports=silent"]
        exts = mypycify([*flags, *(str(source_of(n).relative_to(ROOT)) for n in COMPILED)],
                        opt_level="1", group_name=SHARED.removesuffix("__mypyc"))
    except (Exception, SystemExit) as err:  # no mypyc, or it cannot compile these sources
        print(f"specrack: not compiling the engine ({err!r}): it runs as pure Python")
        return []
    for e in exts:
        e.optional = True  # no C compiler or headers: a warning, and pure Python
    RECORD.write_text(json.dumps({"cache_tag": sys.implementation.cache_tag,
                                  "sources": {n: digest(source_of(n)) for n in COMPILED}}, indent=1))
    return exts


def byte_compile() -> None:
    """Byte-compile the sources of an editable install, as pip does for a regular one: a process
    that may not write bytecode (PYTHONDONTWRITEBYTECODE) would otherwise compile every module
    it imports, every time (about 0.08 s of `specrack run` on 2 cores). An edited source is
    compiled again on import, as always."""
    import compileall

    for pkg in PACKAGES:
        compileall.compile_dir(str(ROOT / pkg), quiet=1)


setup(ext_modules=ext_modules())
if "editable_wheel" in sys.argv or "develop" in sys.argv:
    byte_compile()
