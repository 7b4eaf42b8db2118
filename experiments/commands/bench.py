"""`specrack bench`: the engine's speed against a bare SimPy loop."""

from __future__ import annotations

import argparse
import json
from typing import Any

from experiments.bench import run_bench
from models.errors import ConfigError


def add_parser(sub: Any, name: str, summary: str) -> None:
    b = sub.add_parser(name, help=summary)
    b.add_argument("--json", action="store_true", help="(always JSON)")
    b.add_argument("--quick", action="store_true", help="1k and 10k requests instead of 10k and 100k")
    b.add_argument("--fusion", default="", metavar="WORKLOADS",
                   help="step fusion on vs off on issue 12's workloads instead (a, b, c; e.g. --fusion abc)")
    b.set_defaults(fn=run)


def run(a: argparse.Namespace) -> int:
    bad = sorted(set(a.fusion) - set("abc"))
    if bad:
        raise ConfigError(f"--fusion takes workload letters a, b and c run together (e.g. --fusion ab), got {a.fusion!r}")
    out = run_bench(quick=a.quick, fusion=a.fusion)
    print(json.dumps(out, indent=2))
    return 0
