"""Scenario files: TOML validated into typed, frozen objects; the same objects from Python.

Every validation error becomes one line naming the dotted field, the bad value and what is
allowed (`ConfigError`). `load_scenario(path, overrides)` applies `--set a.b=value` overrides
before validation. The sections' types and field-level checks are in `sim.schema` (re-exported
here); `Scenario` adds the cross-field checks that need the runtime (`sim.deployment`).
"""

from __future__ import annotations

import copy
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError, model_validator

from models.catalog import MODELS
from models.errors import ConfigError
from models.hf_config import find_user_model
from sim.deployment import check_scenario
from sim.schema import (
    DEFAULT_SLO,
    MAX_CLIENTS,
    MAX_REQUESTS,
    SLO,
    SLO_KEYS,
    SLO_METRICS,
    SLO_PERCENTILES,
    SPEC_METHODS,
    SPEC_OWNED_KEYS,
    WORKLOAD_ARRIVAL_KEYS,
    Autoscale,
    Conversations,
    CsvProfile,
    Deployment,
    Disaggregation,
    Distillation,
    DiurnalProfile,
    Empirical,
    ExponentialThink,
    Fixed,
    FixedThink,
    LengthDist,
    LogNormal,
    Rack,
    RateProfile,
    ScenarioSpec,
    SimSettings,
    Speculative,
    ThinkTime,
    TrafficClass,
    Workload,
    check_request_count,
    gpu_name,
    slo_key_hint,
    spec_key_unused,
    workload_key_unused,
)

__all__ = [  # the schema's names too: every scenario type is imported from here
    "DEFAULT_SLO",
    "MAX_CLIENTS",
    "MAX_REQUESTS",
    "SLO",
    "SLO_KEYS",
    "SLO_METRICS",
    "SLO_PERCENTILES",
    "SPEC_METHODS",
    "Autoscale",
    "Conversations",
    "CsvProfile",
    "Deployment",
    "Disaggregation",
    "Distillation",
    "DiurnalProfile",
    "Empirical",
    "ExponentialThink",
    "Fixed",
    "FixedThink",
    "LengthDist",
    "LogNormal",
    "Rack",
    "RateProfile",
    "Scenario",
    "ScenarioSpec",
    "SimSettings",
    "Speculative",
    "ThinkTime",
    "TrafficClass",
    "Workload",
    "apply_overrides",
    "check_request_count",
    "gpu_name",
    "load_scenario",
    "parse_set",
    "read_toml",
    "scenario_from_dict",
    "slo_key_hint",
]


class Scenario(ScenarioSpec):
    """One experiment, as a scenario TOML describes it: the rack, the deployment on it, optional
    speculative decoding, the workload, the SLO and simulator settings (validated, immutable;
    `with_overrides` gives a changed copy). Its sections are checked one by one (`sim.schema`),
    then across each other with the runtime (`sim.deployment.check_scenario`: the memory plan,
    tokenizers, lengths the deployment accepts)."""

    @model_validator(mode="after")
    def _cross(self) -> Scenario:
        check_scenario(self)
        return self

    def with_overrides(self, overrides: dict[str, Any]) -> Scenario:
        data = apply_overrides(self.model_dump(mode="json", exclude_none=True), overrides, copy_data=False)
        _resolve_paths(data, Path.cwd())
        _resolve_model_configs(data, Path.cwd())
        return scenario_from_dict(data)


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any], copy_data: bool = True) -> dict[str, Any]:
    """Set dotted keys (`workload.utilisation`) in a nested dict; a None value removes the key.
    `copy_data`: work on a deep copy (off for a dict made for the call: a plan sets thousands)."""
    if copy_data:
        data = copy.deepcopy(data)
    for dotted, value in overrides.items():
        parts = dotted.split(".")
        node = data
        for p in parts[:-1]:
            if not isinstance(node.get(p, {}), dict):
                raise ConfigError(f"--set {dotted}: '{p}' is not a table")
            node = node.setdefault(p, {})
        if value is None:
            node.pop(parts[-1], None)
        else:
            node[parts[-1]] = value
    # a model set by name replaces the config.json that defined the previous one, and a config.json
    # set replaces the name of the previous model (the new one is named after its config)
    for section, name_key, cfg_key in (("deployment", "model", "model_config"),
                                       ("speculative", "draft_model", "draft_model_config")):
        for key, other in ((name_key, cfg_key), (cfg_key, name_key)):
            if f"{section}.{key}" in overrides and f"{section}.{other}" not in overrides \
                    and isinstance(data.get(section), dict):
                data[section].pop(other, None)
    # utilisation and rate_rps are two ways to set one load: setting one replaces the other
    given = [f"workload.{k}={overrides[f'workload.{k}']}" for k in ("utilisation", "rate_rps")
             if overrides.get(f"workload.{k}") is not None]
    if len(given) == 2:
        raise ConfigError(f"{given[0]} and {given[1]} are both given; they are two ways to set one offered load: "
                          "keep one of them")
    for key, other in (("utilisation", "rate_rps"), ("rate_rps", "utilisation")):
        if overrides.get(f"workload.{key}") is not None and isinstance(data.get("workload"), dict):
            data["workload"].pop(other, None)
    _drop_switched_keys(data, overrides)
    return data


def _drop_switched_keys(data: dict[str, Any], overrides: dict[str, Any]) -> None:
    """An arrival, method, policy, self_spec mode or tree drafter set by key
    (`workload.arrival=poisson`, `speculative.method=eagle`) replaces the previous one with its own
    keys: the keys that belonged only to the previous one (WORKLOAD_ARRIVAL_KEYS: trace, cv;
    SPEC_OWNED_KEYS: draft_model, tree_branching, disable_batch_size, ...) go with it, unless they
    are set by key too (then the validator names the conflict)."""
    wl = data.get("workload")
    if isinstance(wl, dict) and "workload.arrival" in overrides and isinstance(wl.get("arrival"), str):
        for key in WORKLOAD_ARRIVAL_KEYS:
            if key in wl and f"workload.{key}" not in overrides and workload_key_unused(key, wl["arrival"]):
                del wl[key]
    spec = data.get("speculative")
    switches = ("method", "policy", "self_spec_mode", "tree_drafter")
    if not isinstance(spec, dict) or not any(f"speculative.{k}" in overrides for k in switches):
        return
    for key in SPEC_OWNED_KEYS:
        if key in spec and f"speculative.{key}" not in overrides and spec_key_unused(key, spec):
            del spec[key]


def parse_set(items: list[str]) -> dict[str, Any]:
    """`key=value` strings (value parsed as TOML, else kept as a string) to a dict."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set '{item}': expected key=value, e.g. workload.utilisation=0.7")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not all(part.strip() for part in key.split(".")):
            raise ConfigError(f"--set '{item}': malformed key '{key}'; expected section.key=value, e.g. "
                              "workload.utilisation=0.7 (or a top-level key such as seed=2)")
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        out[key] = value
    return out


def format_validation_error(err: ValidationError) -> str:
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"] if not str(p).startswith("function-"))
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "extra_forbidden":
        return f"{loc}: unknown field (remove it or check its spelling)"
    if e["type"] == "missing":
        return f"{loc}: missing required field"
    bad = e.get("input")
    shown = "" if isinstance(bad, dict) or repr(bad) in msg or f"'{bad}'" in msg else f" (got {bad!r})"
    # model-level validators already start with the field they are about
    return f"{loc}: {msg}{shown}" if loc else f"{msg}{shown}"


def scenario_from_dict(data: dict[str, Any]) -> Scenario:
    try:
        return Scenario.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err)) from None


def read_toml(path: str | Path, kind: str) -> dict[str, Any]:
    """A TOML file as a dict, or a one-line ConfigError (missing file, syntax error)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{kind} file not found: {p}")
    try:  # utf-8-sig: a byte-order mark (Windows editors write one) is not TOML
        return tomllib.loads(p.read_text(encoding="utf-8-sig"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{p}: invalid TOML: {err}") from None


def _resolve_paths(data: dict[str, Any], folder: Path) -> None:
    """Relative file paths (traces, rate profile, efficiency file, config.json files) made
    absolute against `folder`; absolute ones are kept."""
    def fix(table: Any, key: str) -> None:
        if isinstance(table, dict) and isinstance(table.get(key), str) and not Path(table[key]).is_absolute():
            table[key] = str((folder / table[key]).resolve())

    dep, spec, wl = (data.get(k) for k in ("deployment", "speculative", "workload"))
    fix(dep, "efficiency_file")
    fix(dep, "model_config")
    fix(spec, "draft_model_config")
    if isinstance(wl, dict):
        fix(wl, "trace")
        fix(wl.get("rate_profile"), "file")
        for key in ("prompt_tokens", "output_tokens"):
            fix(wl.get(key), "trace")
        conv = wl.get("conversations")
        if isinstance(conv, dict):
            fix(conv.get("growth_tokens"), "trace")


def _resolve_model_configs(data: dict[str, Any], folder: Path) -> None:
    """A model or draft named in a user catalogue (models.toml next to the scenario, else in the
    working directory; `specrack models add`) gets its config.json from there."""
    for section, cfg_key, name_key in (("deployment", "model_config", "model"),
                                       ("speculative", "draft_model_config", "draft_model")):
        sec = data.get(section)
        if not isinstance(sec, dict):
            continue
        name = sec.get(name_key)
        if sec.get(cfg_key) is None and isinstance(name, str) and name.lower() not in MODELS:
            found = find_user_model(name, (folder, Path.cwd()))
            if found is not None:
                sec[cfg_key] = str(found)


def load_scenario(path: str | Path, overrides: dict[str, Any] | None = None) -> Scenario:
    """Read and validate a TOML scenario. Relative paths in the file resolve against its folder;
    relative paths in `overrides` (typed with --set) against the working directory."""
    p = Path(path)
    data = read_toml(p, "scenario")
    _resolve_paths(data, p.parent)
    if overrides:
        data = apply_overrides(data, overrides)
        _resolve_paths(data, Path.cwd())  # (only the overrides' paths are still relative)
    _resolve_model_configs(data, p.parent)
    try:
        return scenario_from_dict(data)
    except ConfigError as err:
        raise ConfigError(f"{p.name}: {err}") from None
