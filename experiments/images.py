"""Static images of the reports' figures (`--png` / `--svg` on sweep, plan and compare), through
plotly's `fig.write_image`, which needs Kaleido: the optional `images` extra."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from models.errors import ConfigError

IMAGES_HINT = "pip install -e '.[images]'"
FORMATS = ("png", "svg")


def image_formats(a: Any) -> list[str]:
    """The formats asked for on the command line (`--png`, `--svg`), Kaleido checked when any is
    (`check_images`: call this before any work)."""
    formats = [f for f in FORMATS if getattr(a, f, False)]
    if formats:
        check_images()
    return formats


def check_images() -> None:
    """A one-line error naming the extra when Kaleido is missing (call it before any work)."""
    try:
        import kaleido  # noqa: F401
    except ImportError:
        raise ConfigError(f"--png/--svg need Kaleido to export static images: {IMAGES_HINT}") from None


def write_images(figs: list[tuple[str, Any]], out: Path, formats: list[str], stem: str) -> list[Path]:
    """Write each (name, figure) as OUT/<stem>-<name>.<format>; the paths written."""
    if not formats:
        return []
    check_images()
    paths = []
    for fmt in formats:
        for name, fig in figs:
            p = out / f"{stem}-{name}.{fmt}"
            try:
                fig.write_image(str(p), format=fmt)
            except Exception as err:  # Kaleido present but unable to run (too old for plotly, no Chrome, ...)
                text = (str(err).strip().splitlines() or [""])[0]
                raise ConfigError(f"--{fmt}: Kaleido failed to export {p.name} ({type(err).__name__}: {text[:160]}); "
                                  f"check the Kaleido install ({IMAGES_HINT}; Kaleido 1.x also needs Chrome or "
                                  "Chromium)") from None
            paths.append(p)
    return paths


def static_png(fig: Any, width: int = 1000, height: int | None = None) -> bytes | None:
    """The figure as PNG bytes through Kaleido, or None when Kaleido is missing or cannot run
    (no Chrome for Kaleido 1.x, say): callers then show the interactive figure only."""
    try:
        import kaleido  # noqa: F401
    except ImportError:
        return None
    try:
        return bytes(fig.to_image(format="png", width=width, height=height or fig.layout.height or 500))
    except Exception:  # Kaleido present but unable to export: degrade, never fail a notebook
        return None


def show(fig: Any, width: int = 1000) -> None:
    """Show a figure in a notebook twice: interactive (plotly's mimetype: JupyterLab, VS Code) and
    as a static PNG beside it, so the notebook also renders on GitHub and nbviewer. Without Kaleido
    (the `images` extra) only the interactive figure is shown."""
    from IPython.display import Image, display

    fig.show(renderer="plotly_mimetype")
    png = static_png(fig, width)
    if png is not None:
        display(Image(data=png, format="png", width=width))
