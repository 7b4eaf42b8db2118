"""`specrack bench`: the engine's speed against a bare SimPy loop."""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

from experiments.bench import run_bench
from models.errors import ConfigError


def add_parser(sub: Any, name: str, summary: str) -> None:
    b = sub.add_parser(name, help=summary)
    b.add_argument("--json", action="store_true", help="(always JSON)")
    b.add_argument("--quick", action="store_true", help="1k and 10k requests instead of 10k and 100k")
    b.add_argument("--fusion", default="", metavar="WORKLOADS",
                   help="step fusion on vs off on issue 12's workloads instead (a, b, c; e.g. --fusion abc)")
    b.add_argument("--process", action="store_true",
                   help="whole processes instead: `specrack run` of the reference workload, --help, import "
                        "specrack (median of 5; --quick: 3), wall and CPU seconds")
    b.add_argument("--against", default=None, metavar="PYTHON",
                   help="with --process: also time another build's Python (e.g. ../old/.venv/bin/python), "
                        "alternating, and report the ratios")
    b.add_argument("--long", action="store_true", help="with --process: also the default sweep and the chat plan (twice each)")
    b.set_defaults(fn=run)


def run(a: argparse.Namespace) -> int:
    bad = sorted(set(a.fusion) - set("abc"))
    if bad:
        raise ConfigError(f"--fusion takes workload letters a, b and c run together (e.g. --fusion ab), got {a.fusion!r}")
    if (a.against or a.long) and not a.process:
        raise ConfigError("--against and --long time whole processes: add --process")
    if a.against is not None and not os.access(a.against, os.X_OK):
        raise ConfigError(f"--against {a.against}: not an executable Python; name one, e.g. ../old/.venv/bin/python")
    out = run_bench(quick=a.quick, fusion=a.fusion, process=a.process, against=a.against, long=a.long)
    print(json.dumps(out, indent=2))
    return 0
