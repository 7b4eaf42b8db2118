"""What several subcommands share: a scenario argument with --set/--seed, and the image flags."""

from __future__ import annotations

import argparse
from typing import Any

from sim.deployment import rejection_fix
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


REJECT_WARN_SHARE = 0.01  # a run that rejects more than 1% of its requests says so as a warning


def rejected_line(rejected: int, share: float, reason: str, lines: str = "") -> str | None:
    """One line on the requests a run rejected (none: None): how many, their share, why, which
    trace lines, and the fix; 'WARNING' when more than REJECT_WARN_SHARE of the requests."""
    if not rejected:
        return None
    total = round(rejected / share) if share > 0 else rejected
    head = "WARNING: " if share > REJECT_WARN_SHARE else ""
    where = f"; trace lines {lines}" if lines else ""
    return (f"  {head}{rejected:,} of {total:,} requests ({share:.1%}) rejected, {reason}{where}: counted as offered, "
            f"never served, in no latency; to serve them, {rejection_fix(reason)}")
