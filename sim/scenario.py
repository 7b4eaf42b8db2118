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
    Autoscale,
    Conversations,
    CsvProfile,
    Deployment,
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
        data = apply_overrides(self.model_dump(mode="json", exclude_none=True), overrides)
        _resolve_model_configs(data, Path.cwd())
        return scenario_from_dict(data)


def apply_overrides(data: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """Set dotted keys (`workload.utilisation`) in a nested dict; a None value removes the key."""
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
    # a model set by name replaces the config.json that defined the previous one
    for section, name_key, cfg_key in (("deployment", "model", "model_config"),
                                       ("speculative", "draft_model", "draft_model_config")):
        if f"{section}.{name_key}" in overrides and f"{section}.{cfg_key}" not in overrides \
                and isinstance(data.get(section), dict):
            data[section].pop(cfg_key, None)
    # utilisation and rate_rps are two ways to set one load: setting one replaces the other
    for key, other in (("utilisation", "rate_rps"), ("rate_rps", "utilisation")):
        if overrides.get(f"workload.{key}") is not None and isinstance(data.get("workload"), dict):
            data["workload"].pop(other, None)
    return data


def parse_set(items: list[str]) -> dict[str, Any]:
    """`key=value` strings (value parsed as TOML, else kept as a string) to a dict."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"--set '{item}': expected key=value, e.g. workload.utilisation=0.7")
        key, raw = item.split("=", 1)
        try:
            value = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            value = raw
        out[key.strip()] = value
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
    try:
        return tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{p}: invalid TOML: {err}") from None


def _resolve_model_configs(data: dict[str, Any], folder: Path) -> None:
    """Config.json paths relative to the scenario's folder; a model or draft named in a user
    catalogue (models.toml next to the scenario, else in the working directory; `specrack models
    add`) gets its config.json from there."""
    for section, cfg_key, name_key in (("deployment", "model_config", "model"),
                                       ("speculative", "draft_model_config", "draft_model")):
        sec = data.get(section)
        if not isinstance(sec, dict):
            continue
        cfg = sec.get(cfg_key)
        if isinstance(cfg, str) and not Path(cfg).is_absolute():
            sec[cfg_key] = str((folder / cfg).resolve())
        name = sec.get(name_key)
        if cfg is None and isinstance(name, str) and name.lower() not in MODELS:
            found = find_user_model(name, (folder, Path.cwd()))
            if found is not None:
                sec[cfg_key] = str(found)


def load_scenario(path: str | Path, overrides: dict[str, Any] | None = None) -> Scenario:
    """Read and validate a TOML scenario; relative trace paths resolve against its folder."""
    p = Path(path)
    data = read_toml(p, "scenario")
    dep = data.get("deployment", {})
    if isinstance(dep, dict) and isinstance(dep.get("efficiency_file"), str) and not Path(dep["efficiency_file"]).is_absolute():
        dep["efficiency_file"] = str((p.parent / dep["efficiency_file"]).resolve())
    _resolve_model_configs(data, p.parent)
    wl = data.get("workload", {})
    if isinstance(wl, dict):
        for key in ("trace",):
            if isinstance(wl.get(key), str) and not Path(wl[key]).is_absolute():
                wl[key] = str((p.parent / wl[key]).resolve())
        prof = wl.get("rate_profile")
        if isinstance(prof, dict) and isinstance(prof.get("file"), str) and not Path(prof["file"]).is_absolute():
            prof["file"] = str((p.parent / prof["file"]).resolve())
        for key in ("prompt_tokens", "output_tokens"):
            d = wl.get(key)
            if isinstance(d, dict) and isinstance(d.get("trace"), str) and not Path(d["trace"]).is_absolute():
                d["trace"] = str((p.parent / d["trace"]).resolve())
    if overrides:
        data = apply_overrides(data, overrides)
        _resolve_model_configs(data, p.parent)
    try:
        return scenario_from_dict(data)
    except ConfigError as err:
        raise ConfigError(f"{p.name}: {err}") from None
