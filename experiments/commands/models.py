"""`specrack models add`: register a Hugging Face config.json in the user model catalogue."""

from __future__ import annotations

import argparse
from typing import Any

from models.hf_config import add_user_model


def add_parser(sub: Any, name: str, summary: str) -> None:
    mo = sub.add_parser(name, help=summary)
    mo_sub = mo.add_subparsers(dest="models_cmd", required=True)
    ma = mo_sub.add_parser("add", help="register a config.json on disk under a name (no download)")
    ma.add_argument("path", help="a Hugging Face config.json")
    ma.add_argument("--name", default=None, help="the name scenarios use (default: the config's folder name)")
    ma.add_argument("--catalog", default="models.toml",
                    help="the catalogue file to write (default ./models.toml; scenarios look next to their file, "
                         "then in the working directory)")
    ma.set_defaults(fn=add)


def add(a: argparse.Namespace) -> int:
    m, cat = add_user_model(a.path, a.name, a.catalog)
    moe = f", {m.num_experts} experts ({m.experts_per_token} per token)" if m.num_experts else ""
    attn = " MLA" if m.mla else (f", {m.num_sliding_layers} sliding-window layers ({m.sliding_window})"
                                 if m.num_sliding_layers else "")
    print(f"added '{m.name}' to {cat}: {m.params_total / 1e9:.2f}B parameters ({m.params_active / 1e9:.2f}B active), "
          f"{m.num_layers} layers{moe}{attn}, tokenizer {m.tokenizer_family}, weights {m.native_weights}")
    print(f"use it: deployment.model = \"{m.name}\" in a scenario next to {cat.name} or run from {cat.parent}")
    return 0
