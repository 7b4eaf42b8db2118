"""The `specrack` command line. Bad input prints one line on stderr and exits 2, never a traceback.

Each subcommand lives in its own module of experiments/commands (its options and the function
that runs it); COMMANDS lists them in the order `specrack --help` shows them."""

from __future__ import annotations

import argparse
import os
import sys

from experiments.commands import (
    acceptance,
    bench,
    calibrate,
    capacity,
    compare,
    cost,
    models,
    plan,
    run,
    sweep,
    validate,
)
from experiments.commands import list as list_
from models.errors import ConfigError

COMMANDS = (cost, run, validate, capacity, bench, sweep, plan, acceptance, calibrate, list_, models, compare)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specrack", description="Discrete-event simulator of LLM serving: speculative decoding vs distillation vs quantization")
    sub = p.add_subparsers(dest="cmd", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        return int(a.fn(a) or 0)
    except ConfigError as err:
        print(f"specrack: error: {err}", file=sys.stderr)
        return 2
    except FileNotFoundError as err:
        print(f"specrack: error: file not found: {err.filename}", file=sys.stderr)
        return 2
    except OSError as err:  # a folder where a file is due, no permission, disk full...
        where = f": {err.filename}" if err.filename else ""
        print(f"specrack: error: {err.strerror or err}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specrack: interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        print("specrack: error: out of memory; shorten the run (duration_s, rate_rps) or the sweep", file=sys.stderr)
        return 2
    except Exception as err:  # last resort: never a traceback (SPECRACK_DEBUG=1 shows it)
        if os.environ.get("SPECRACK_DEBUG"):
            raise
        text = (str(err).splitlines() or [""])[0]
        print(f"specrack: internal error: {type(err).__name__}: {text} (please report it; SPECRACK_DEBUG=1 shows "
              "the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
