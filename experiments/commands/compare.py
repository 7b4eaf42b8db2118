"""`specrack compare`: sweep or plan output folders side by side (experiments.compare)."""

from __future__ import annotations

from typing import Any

from experiments.commands.common import image_flags
from experiments.compare import main_compare


def add_parser(sub: Any, name: str, summary: str) -> None:
    co = sub.add_parser(name, help=summary)
    co.add_argument("runs", nargs="+", metavar="RUN", help="sweep output folders (results.parquet) or plan output folders (plan.csv)")
    co.add_argument("--out", default="results/compare")
    image_flags(co)
    co.set_defaults(fn=main_compare)
