"""The one error type users see: a one-line message naming the field and the fix."""

from __future__ import annotations

import difflib


class ConfigError(ValueError):
    """Bad input (config, trace, command line). Its message is one line, meant for a human."""


UNKNOWN_LISTED = 20  # names an unknown-name error lists


def unknown(kind: str, name: str, choices: list[str] | tuple[str, ...]) -> ConfigError:
    """An error for an unknown catalogue name, suggesting the nearest known one."""
    low = str(name).lower()
    near = [c for c in choices if c.lower().startswith(low)] if low else []
    near = near or difflib.get_close_matches(low, [c.lower() for c in choices], n=1, cutoff=0.4)
    hint = f"; did you mean '{near[0]}'?" if near else ""
    listed = ", ".join(choices)
    if len(choices) > UNKNOWN_LISTED:  # a one-line error stays short: the rest are a command away
        listed = ", ".join(choices[:UNKNOWN_LISTED]) + f", and {len(choices) - UNKNOWN_LISTED} more: `specrack list`"
    return ConfigError(f"unknown {kind} '{name}'{hint} (known: {listed})")
