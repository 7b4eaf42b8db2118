"""Every notebook runs top to bottom, headless, in quick mode (SPECRACK_QUICK=1), with or without
Kaleido (without it a figure is shown interactive-only, never an error). The notebooks are
committed with their outputs, so they read on GitHub and nbviewer: each interactive figure has a
static PNG beside it, the files stay small, and 03 ends with a recommendation."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
PLOTLY = "application/vnd.plotly.v1+json"
MAX_BYTES = 1_500_000


def test_notebooks_exist() -> None:
    names = {p.name for p in NOTEBOOKS}
    assert {"01_quickstart.ipynb", "02_utilisation.ipynb", "03_capacity_planning.ipynb", "04_calibration.ipynb",
            "05_day.ipynb"} <= names


def _outputs(nb: object) -> list[tuple[int, dict]]:
    return [(i, o) for i, c in enumerate(nb.cells) if c.cell_type == "code" for o in c.get("outputs", [])]  # type: ignore[attr-defined]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_outputs_render_statically(path: Path) -> None:
    """Committed with outputs: every cell with an interactive figure carries as many PNGs, no
    error output, and the file is small."""
    assert path.stat().st_size < MAX_BYTES, f"{path.name}: {path.stat().st_size} bytes"
    nb = nbformat.read(path, as_version=4)
    outs = _outputs(nb)
    assert outs, f"{path.name}: committed without outputs (run it headless and commit the result)"
    assert not [o for _, o in outs if o.get("output_type") == "error"]
    figures = sum(1 for _, o in outs if PLOTLY in o.get("data", {}))
    assert figures >= 1
    for i, c in enumerate(nb.cells):
        if c.cell_type != "code":
            continue
        n_fig = sum(1 for o in c.get("outputs", []) if PLOTLY in o.get("data", {}))
        n_png = sum(1 for o in c.get("outputs", []) if "image/png" in o.get("data", {}))
        assert n_png >= n_fig, f"{path.name} cell {i}: {n_fig} interactive figures, {n_png} static images"
    text = json.dumps([o for _, o in outs])
    assert "nan, " not in text.lower() and "{'" not in text  # no unexplained dicts (of NaNs) printed


def test_the_planning_notebook_ends_with_a_recommendation() -> None:
    nb = nbformat.read(next(p for p in NOTEBOOKS if p.stem == "03_capacity_planning"), as_version=4)
    last = nb.cells[-1]
    md = "".join(o.get("data", {}).get("text/markdown", "") for o in last.get("outputs", []))
    assert "**Buy " in md and "/month" in md and "headroom" in md


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nb = nbformat.read(path, as_version=4)
    for c in nb.cells:  # run from scratch, as a reader would
        if c.cell_type == "code":
            c.outputs, c.execution_count = [], None
    monkeypatch.setenv("SPECRACK_QUICK", "1")
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError on any failing cell
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors


def test_show_degrades_to_interactive_without_kaleido(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("IPython")
    import plotly.graph_objects as go

    from experiments.images import show, static_png

    monkeypatch.setitem(sys.modules, "kaleido", None)  # `import kaleido` now raises ImportError
    fig = go.Figure(go.Scatter(x=[1, 2], y=[3, 4]))
    assert static_png(fig) is None
    show(fig)  # the interactive figure only, no error
