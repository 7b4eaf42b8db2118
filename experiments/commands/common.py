"""What several subcommands share: a scenario argument with --set/--seed, and the image flags."""

from __future__ import annotations

import argparse
from typing import Any

from sim.scenario import Scenario, load_scenario, parse_set


def scenario_parser(sub: Any, name: str, help: str) -> argparse.ArgumentParser:
    """A subcommand taking a scenario file, --set overrides and --seed."""
    s: argparse.ArgumentParser = sub.add_parser(name, help=help)
    s.add_argument("scenario")
    s.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a dotted key, e.g. workload.utilisation=0.7")
    s.add_argument("--seed", type=int, default=None)
    return s


def load(a: argparse.Namespace) -> Scenario:
    """The scenario named on the command line, with its --set overrides and --seed."""
    overrides = parse_set(a.set or [])
    if getattr(a, "seed", None) is not None:
        overrides["seed"] = a.seed
    return load_scenario(a.scenario, overrides)


def image_flags(p: argparse.ArgumentParser) -> None:
    for fmt in ("png", "svg"):
        p.add_argument(f"--{fmt}", action="store_true",
                       help=f"also export the figures as {fmt.upper()} (needs Kaleido: pip install -e '.[images]')")
