"""The `specrack` command line. Bad input prints one line on stderr and exits 2, never a traceback.

Each subcommand lives in its own module of experiments/commands (its options and the function
that runs it); COMMANDS lists them in the order `specrack --help` shows them, and only the module
of the command given is imported."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from models.errors import ConfigError

# the subcommands in the order `specrack --help` shows them, with the line it shows for each; each
# lives in experiments/commands/<name>.py (its options: `add_parser`; what it runs: the `fn` it sets)
COMMANDS: tuple[tuple[str, str], ...] = (
    ('cost', 'what-if step cost of one batch'),
    ('run', 'simulate one scenario'),
    ('validate', 'check a scenario file'),
    ('capacity', "saturation capacity of a scenario's deployment"),
    ('bench', 'engine speed against a bare SimPy loop'),
    ('sweep', 'utilisation sweep over strategies, with report (default: built-in experiment)'),
    ('plan', 'capacity plan: smallest rack per strategy meeting the SLO, with cost and quality'),
    ('acceptance', 'fit acceptance (mean, spread, decay) to vLLM metrics, bench JSON, logs or CSV'),
    ('calibrate', "fit an engine profile's software factors to measured benchmark files (vLLM `bench serve --save-result --save-detailed` JSON or a per-request CSV)"),
    ('list', "the catalogues: GPUs, models, the sweep's built-in strategies, engine profiles"),
    ('models', 'the user model catalogue (models.toml): add a Hugging Face config.json'),
    ('compare', 'two or more sweep or plan output folders side by side (compare.csv, compare.html)'),
)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The command line's parser. Only the command named in `argv` (the first word that is not an
    option) gets its options, so only its module is imported: `specrack --help` and every command
    start without loading the others (the simulator, pandas, scipy, plotly)."""
    p = argparse.ArgumentParser(prog="specrack", description="Discrete-event simulator of LLM serving: speculative decoding vs distillation vs quantization")
    sub = p.add_subparsers(dest="cmd", required=True)
    words = sys.argv[1:] if argv is None else argv
    chosen = next((w for w in words if not w.startswith("-")), None)
    for name, summary in COMMANDS:
        if name == chosen:
            importlib.import_module(f"experiments.commands.{name}").add_parser(sub, name, summary)
        else:
            sub.add_parser(name, help=summary)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(argv)
    a = parser.parse_args(argv)
    try:
        return int(a.fn(a) or 0)
    except ConfigError as err:
        print(f"specrack: error: {err}", file=sys.stderr)
        return 2
    except FileNotFoundError as err:
        print(f"specrack: error: file not found: {err.filename}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader left (`specrack run ... | head`): no error, as a shell tool ends on SIGPIPE
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # (what is left unflushed goes nowhere)
        return 141  # 128 + SIGPIPE, as the shell reports a tool killed by it
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


def entry() -> None:
    """The `specrack` command: `main`, then out at once. Everything a command writes is closed by
    then (files, process pools, Dask clients are context-managed), so the interpreter's teardown,
    which frees every object one by one (about 0.09 s after a plain run), only costs time: the
    streams are flushed and the process ends (`os._exit`)."""
    rc = main()
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except OSError:  # (a closed pipe: `specrack list | head`)
        rc = rc or 141
    os._exit(rc)


if __name__ == "__main__":
    entry()
