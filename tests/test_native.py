"""The compiled engine (mypyc, models/_native.py) is the source's engine: the same tables bit for bit;
and an edited source is never shadowed by its old compiled build."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from models import _native

ROOT = Path(__file__).resolve().parents[1]
RUNS = Path(__file__).with_name("native_runs.py")


def _env(pure: bool) -> dict[str, str]:
    return {**os.environ, _native.PURE_ENV: "1" if pure else "0"}


def _built() -> bool:
    """Whether this checkout's install compiled the engine (else the comparison is skipped: a
    machine without a C compiler installs pure Python)."""
    probe = (f"import importlib; [importlib.import_module(n) for n in {_native.COMPILED!r}]; "
             "from models import _native; print(_native.compiled_modules())")
    out = subprocess.run([sys.executable, "-c", probe], env=_env(pure=False), capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    return out.returncode == 0 and len(ast.literal_eval(out.stdout.strip() or "()")) == len(_native.COMPILED)


def _runs(pure: bool) -> dict[str, object]:
    out = subprocess.run([sys.executable, str(RUNS)], env=_env(pure), capture_output=True, text=True, cwd=ROOT,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


def test_the_tests_import_the_engine_as_source() -> None:
    import sim.engine
    import sim.joint

    assert _native.pure_requested()
    assert _native.compiled_modules() == ()
    assert sim.engine.__file__.endswith(".py") and sim.joint.__file__.endswith(".py")
    assert _native.build_label().startswith("pure Python")


def test_the_compiled_engine_gives_the_sources_tables_bit_for_bit() -> None:
    if not _built():
        pytest.skip("the engine is not compiled in this install (no C compiler at install, or sources edited since)")
    pure, compiled = _runs(pure=True), _runs(pure=False)
    assert pure.pop("build", "").startswith("pure Python")
    assert compiled.pop("build", "").startswith("compiled (mypyc)")
    assert pure.keys() == compiled.keys() and len(pure) >= 10
    for name, got in compiled.items():
        assert got == pure[name], name


def test_a_compiled_build_is_used_only_for_the_sources_it_was_built_from(tmp_path: Path, monkeypatch) -> None:
    rec = tmp_path / "record.json"
    monkeypatch.setattr(_native, "BUILD_RECORD", rec)
    monkeypatch.setattr(_native, "_extension", lambda name: tmp_path / f"{name}.so")  # as if built
    now = {n: _native.digest(_native.source_of(n)) for n in _native.COMPILED}
    monkeypatch.setenv(_native.PURE_ENV, "0")
    rec.write_text(json.dumps({"cache_tag": sys.implementation.cache_tag, "sources": now}))
    assert _native.compiled_ok()
    edited = {**now, "sim.joint": "0" * 64}  # one source edited since the build: none compiled
    rec.write_text(json.dumps({"cache_tag": sys.implementation.cache_tag, "sources": edited}))
    assert not _native.compiled_ok()
    rec.write_text(json.dumps({"cache_tag": "cpython-00", "sources": now}))  # built for another Python
    assert not _native.compiled_ok()
    rec.write_text("{half a reco")
    assert not _native.compiled_ok()
    rec.write_text(json.dumps({"cache_tag": sys.implementation.cache_tag, "sources": now}))
    monkeypatch.setenv(_native.PURE_ENV, "1")  # asked for the sources
    assert not _native.compiled_ok()
    monkeypatch.setenv(_native.PURE_ENV, "0")
    monkeypatch.setattr(_native, "_extension", lambda name: None)  # not built
    assert not _native.compiled_ok()


def test_an_edited_source_is_imported_as_source(tmp_path: Path) -> None:
    """In a copy of the package whose record names other sources, Python imports the .py files
    (whether or not extension modules sit beside them)."""
    for pkg in ("models", "sim"):
        (tmp_path / pkg).mkdir()
        for f in (ROOT / pkg).iterdir():
            if f.is_file() and (f.suffix in (".py", ".so", ".json") or ".cpython" in f.name):
                (tmp_path / pkg / f.name).write_bytes(f.read_bytes())
    src = tmp_path / "sim" / "joint.py"
    src.write_text(src.read_text() + "\nEDITED = True\n")
    probe = ("import sim.joint, sim.engine; from models import _native; "
             "print(sim.joint.EDITED, sim.joint.__file__.endswith('.py'), _native.compiled_modules())")
    out = subprocess.run([sys.executable, "-c", probe], env={**_env(pure=False), "PYTHONPATH": str(tmp_path)},
                         capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["True", "True", "()"]
