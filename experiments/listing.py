"""`specrack list gpus|models|strategies|profiles`: the catalogues as rows (for the terminal
table and `--json`), read from models/ and the built-in sweep, never copied."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from experiments.planfile import builtin_strategies
from experiments.sweep import load_sweep
from models.catalog import GPUS, LINKS, LLM, MODELS
from models.engines import ALIASES, DEFAULT_PROFILE, PROFILES
from models.errors import unknown
from models.hf_config import USER_CATALOG, load_config, read_user_catalog


def gpu_rows() -> list[dict[str, Any]]:
    return [{"name": g.name, "family": g.family, "hbm_gib": g.hbm_gib, "mem_bw_tb_s": g.mem_bw_bytes_s / 1e12,
             "bf16_tflops": g.bf16_flops / 1e12, "fp8_tflops": None if g.fp8_flops is None else g.fp8_flops / 1e12,
             "fp4_tflops": None if g.fp4_flops is None else g.fp4_flops / 1e12,
             "interconnect_gb_s": g.interconnect_bytes_s / 1e9, "tdp_w": g.tdp_w, "usd_per_gpu_hour": g.usd_per_gpu_hour, "source": g.source} for g in GPUS.values()]


def link_rows() -> list[dict[str, Any]]:
    """The KV fabrics between prefill and decode replicas (disaggregated serving)."""
    return [{"name": lk.name, "gb_s_per_gpu": lk.bytes_s_per_gpu / 1e9, "latency_us": lk.latency_s * 1e6,
             "source": lk.source} for lk in LINKS.values()]


def model_rows() -> list[dict[str, Any]]:
    """The built-in catalogue, then the user catalogue of the working directory (./models.toml)."""
    from pathlib import Path

    def row(m: LLM, where: str) -> dict[str, Any]:
        return {"name": m.name, "hf_id": m.hf_id, "params_b": m.params_total / 1e9, "active_params_b": m.params_active / 1e9,
                "layers": m.num_layers, "hidden_size": m.hidden_size, "heads": m.num_heads, "kv_heads": m.num_kv_heads,
                "experts": m.num_experts, "experts_per_token": m.experts_per_token, "shared_experts": m.num_shared_experts,
                "attention": "mla" if m.mla else ("gqa+sliding" if m.num_sliding_layers else "gqa"),
                "sliding_window": m.sliding_window or None, "mtp_layers": m.mtp_layers,
                "native_weights": m.native_weights, "tokenizer": m.tokenizer_family, "catalogue": where,
                "source": m.source}

    out = [row(m, "built-in") for m in MODELS.values()]
    user = Path(USER_CATALOG)
    if user.is_file():
        out += [row(load_config(path, name), str(user)) for name, path in read_user_catalog(user).items()]
    return out


def strategy_rows() -> list[dict[str, Any]]:
    """Every built-in strategy, with whether `specrack sweep` runs it (the default sweep's variants)."""
    swept = {v.name for v in load_sweep(None, quick=True).variants}
    return [{"name": s.name, "set": s.overrides, "changes": _overrides_text(s.overrides) or "(the base scenario)",
             "default_sweep": s.name in swept}
            for s in builtin_strategies().values()]


def profile_rows() -> list[dict[str, Any]]:
    rows = []
    for p in PROFILES.values():
        sch = p.scheduling
        rows.append({"name": p.name, "default": p.name == DEFAULT_PROFILE,
                     "aliases": [a for a, t in ALIASES.items() if t == p.name], "engine": p.engine,
                     "prefill": sch.prefill, "chunked_prefill": sch.chunked_prefill,
                     "max_num_batched_tokens": sch.max_num_batched_tokens, "max_num_seqs": sch.max_num_seqs,
                     "scheduler_steps": sch.scheduler_steps, "software": dict(p.software), "fitted_to": p.fitted_to})
    return rows


def _overrides_text(over: dict[str, Any], prefix: str = "") -> str:
    parts = []
    for k, v in over.items():
        if isinstance(v, dict):
            parts.append(_overrides_text(v, f"{prefix}{k}."))
        else:
            parts.append(f"{prefix}{k}={v}")
    return ", ".join(parts)


def _num(v: Any, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


# per catalogue: its rows, then the terminal columns (heading, how to show a row)
_TEXT: dict[str, tuple[Callable[[], list[dict[str, Any]]], list[tuple[str, Callable[[dict[str, Any]], str]]]]] = {
    "gpus": (gpu_rows, [
        ("gpu", lambda r: r["name"]), ("family", lambda r: r["family"]), ("HBM GiB", lambda r: f"{r['hbm_gib']:g}"),
        ("HBM TB/s", lambda r: f"{r['mem_bw_tb_s']:.2f}"), ("BF16 TFLOP/s", lambda r: f"{r['bf16_tflops']:.0f}"),
        ("FP8 TFLOP/s", lambda r: _num(r["fp8_tflops"], ".0f")), ("FP4 TFLOP/s", lambda r: _num(r["fp4_tflops"], ".0f")),
        ("link GB/s", lambda r: f"{r['interconnect_gb_s']:.0f}"), ("TDP W", lambda r: _num(r["tdp_w"], ".0f")),
        ("$/GPU-h", lambda r: f"{r['usd_per_gpu_hour']:.2f}"), ("source", lambda r: r["source"])]),
    "links": (link_rows, [
        ("link", lambda r: r["name"]), ("GB/s per GPU, one way", lambda r: f"{r['gb_s_per_gpu']:.1f}"),
        ("latency us", lambda r: f"{r['latency_us']:g}"), ("source", lambda r: r["source"])]),
    "models": (model_rows, [
        ("model", lambda r: r["name"]), ("params B", lambda r: f"{r['params_b']:.1f}"),
        ("active B", lambda r: f"{r['active_params_b']:.1f}"), ("layers", lambda r: str(r["layers"])),
        ("hidden", lambda r: str(r["hidden_size"])), ("heads/kv", lambda r: f"{r['heads']}/{r['kv_heads']}"),
        ("experts", lambda r: f"{r['experts']}/{r['experts_per_token']}" if r["experts"] else "-"),
        ("attention", lambda r: r["attention"]), ("weights", lambda r: r["native_weights"]),
        ("tokenizer", lambda r: r["tokenizer"]),
        ("Hugging Face id", lambda r: r["hf_id"] + ("" if r["catalogue"] == "built-in" else f" ({r['catalogue']})"))]),
    "strategies": (strategy_rows, [("strategy", lambda r: r["name"]), ("swept", lambda r: "yes" if r["default_sweep"] else "-"),
                                   ("changes to the base scenario", lambda r: r["changes"])]),
    "profiles": (profile_rows, [
        ("profile", lambda r: r["name"] + (" (default)" if r["default"] else "")),
        ("aliases", lambda r: ", ".join(r["aliases"]) or "-"), ("prefill", lambda r: r["prefill"]),
        ("chunked", lambda r: "yes" if r["chunked_prefill"] else "no"),
        ("tokens/step", lambda r: str(r["max_num_batched_tokens"])), ("max seqs", lambda r: str(r["max_num_seqs"])),
        ("engine", lambda r: r["engine"])]),
}
KINDS = tuple(_TEXT)


def rows(kind: str) -> list[dict[str, Any]]:
    """One catalogue as a list of records (what `--json` prints)."""
    if kind not in _TEXT:
        raise unknown("catalogue", kind, KINDS)
    return _TEXT[kind][0]()


def text_table(kind: str) -> str:
    """One catalogue as an aligned terminal table (the last column is left unpadded)."""
    cols = _TEXT[kind][1] if kind in _TEXT else []
    recs = rows(kind)
    cells = [[show(r) for _, show in cols] for r in recs]
    heads = [h for h, _ in cols]
    widths = [max(len(h), *(len(c[i]) for c in cells)) for i, h in enumerate(heads)]

    def line(vals: list[str]) -> str:
        return "  ".join(v.ljust(w) if i < len(vals) - 1 else v for i, (v, w) in enumerate(zip(vals, widths, strict=True)))

    return "\n".join([line(heads), line(["-" * w for w in widths]), *(line(c) for c in cells)])
