"""`specrack list`: the catalogues (GPUs, KV links, models, built-in strategies, engine profiles)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from experiments.listing import rows, text_table


def add_parser(sub: Any, name: str, summary: str) -> None:
    li = sub.add_parser(name, help=summary)
    li.add_argument("catalogue", choices=["gpus", "links", "models", "strategies", "profiles"])
    li.add_argument("--json", action="store_true", help="records as JSON instead of a table")
    li.set_defaults(fn=run)


def run(a: argparse.Namespace) -> int:
    print(json.dumps(rows(a.catalogue), indent=2) if a.json else text_table(a.catalogue))
    return 0
