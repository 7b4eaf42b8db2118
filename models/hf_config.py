"""A model from a Hugging Face `config.json` on disk (no downloads): architecture, parameter
counts, KV layout and native weight format, as the `LLM` record models/cost.py prices.

Read fields (docs/MODEL.md, "Models from config.json"): the shape (`hidden_size`,
`num_hidden_layers`, `num_attention_heads`, `num_key_value_heads`, `head_dim`,
`intermediate_size`, `vocab_size`, `tie_word_embeddings`, `attention_bias`), mixture of experts
(Mixtral/gpt-oss `num_local_experts`, Qwen3-MoE `num_experts` + `moe_intermediate_size` +
`decoder_sparse_step`/`mlp_only_layers`, DeepSeek `n_routed_experts` + `n_shared_experts` +
`first_k_dense_replace` + `moe_layer_freq`; `num_experts_per_tok`), multi-head latent attention
(`kv_lora_rank`, `qk_rope_head_dim`, `q_lora_rank`, `qk_nope_head_dim`, `v_head_dim`),
sliding windows (`sliding_window` with `layer_types`, `sliding_window_pattern` or
`use_sliding_window`/`max_window_layers`), `num_nextn_predict_layers`, `torch_dtype`/`dtype` and
`quantization_config`. Parameters are counted from the shapes, module by module, the way the
checkpoint stores them; an unsupported architecture or a missing field is a one-line
`ConfigError` naming the field and the fix.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from models.catalog import LLM, MODELS
from models.errors import ConfigError

# model_type -> family of the block structure it uses
ARCHITECTURES = {
    "llama": "dense", "mistral": "dense", "qwen2": "dense", "qwen3": "dense",
    "mixtral": "mixtral", "qwen3_moe": "qwen3_moe", "deepseek_v3": "deepseek", "deepseek_v2": "deepseek",
    "gpt_oss": "gpt_oss",
}
# vocabulary size (and model_type prefix) -> tokenizer family: models of one family can draft for each other
_VOCAB_FAMILY = {128256: "llama3", 129280: "deepseek-v3", 201088: "o200k_harmony", 32768: "mistral-v3"}


class _Cfg:
    """The config dict with field access that fails with one line naming the field."""

    def __init__(self, data: dict[str, Any], where: str) -> None:
        self.d, self.where = data, where

    def has(self, key: str) -> bool:
        return self.d.get(key) is not None

    def int(self, key: str, default: int | None = None, *, minimum: int = 1) -> int:
        v = self.d.get(key)
        if v is None:
            if default is None:
                raise ConfigError(f"{self.where}: missing field '{key}' (a positive integer); add it to the config.json "
                                  "or define the model in the catalogue")
            return default
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ConfigError(f"{self.where}: field '{key}' must be an integer >= {minimum}, got {v!r}")
        return v

    def get(self, key: str, default: Any = None) -> Any:
        v = self.d.get(key)
        return default if v is None else v


def tokenizer_family(model_type: str, vocab_size: int, declared: str | None = None) -> str:
    """The tokenizer family: declared (`tokenizer_family` in the config.json), else from the
    vocabulary size (Qwen2.5 and Qwen3 share the size 151936 but not their special tokens, so
    the model_type decides); an unknown vocabulary is a family of its own, `vocab-<size>`."""
    if declared:
        return str(declared)
    if vocab_size in (151936, 152064):
        return "qwen3" if model_type.startswith("qwen3") else "qwen2.5"
    if vocab_size == 32000:
        return "mistral-v0.1" if model_type in ("mistral", "mixtral") else "llama2"
    return _VOCAB_FAMILY.get(vocab_size, f"vocab-{vocab_size}")


def native_weights(c: _Cfg) -> str:
    """The format the checkpoint ships in: `quantization_config` when present, else bf16 (fp16 and
    fp32 checkpoints are served at 2 bytes a weight too)."""
    q = c.get("quantization_config")
    if q is None:
        dtype = str(c.get("torch_dtype", c.get("dtype", "bfloat16")))
        if dtype not in ("bfloat16", "float16", "float32"):
            raise ConfigError(f"{c.where}: field 'torch_dtype' = {dtype!r} is not a dtype specrack knows "
                              "(bfloat16, float16, float32); fix it or add a quantization_config")
        return "bf16"
    if not isinstance(q, dict):
        raise ConfigError(f"{c.where}: field 'quantization_config' must be a table, got {q!r}")
    method = str(q.get("quant_method", "")).lower()
    bits = q.get("bits", q.get("w_bit"))
    if method == "fp8" or (method == "compressed-tensors" and "fp8" in json.dumps(q).lower()):
        return "fp8"
    if method == "mxfp4":
        return "mxfp4"
    if method in ("gptq", "awq", "bitsandbytes", "compressed-tensors") and bits in (4, 8):
        return "int4" if bits == 4 else "int8"
    raise ConfigError(f"{c.where}: field 'quantization_config.quant_method' = {method!r} (bits {bits!r}) is not "
                      "supported (fp8, mxfp4, gptq/awq with bits 4 or 8); remove the quantization_config to "
                      "price the model in bf16, or set deployment.weights yourself")


def _sliding_layers(c: _Cfg, num_layers: int) -> tuple[int, int]:
    """(window, layers that use it)."""
    window = c.get("sliding_window")
    types = c.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != num_layers:
            raise ConfigError(f"{c.where}: field 'layer_types' must list one type per layer ({num_layers}), got "
                              f"{len(types) if isinstance(types, list) else types!r}")
        n = sum(1 for t in types if t == "sliding_attention")
        bad = {t for t in types if t not in ("sliding_attention", "full_attention")}
        if bad:
            raise ConfigError(f"{c.where}: field 'layer_types' has {sorted(bad)}; only 'sliding_attention' and "
                              "'full_attention' are supported")
    elif c.has("sliding_window_pattern"):  # every pattern-th layer is global (Gemma-style)
        pat = c.int("sliding_window_pattern")
        n = num_layers - num_layers // pat
    elif window is not None and c.get("use_sliding_window", True):
        # Qwen2/Qwen3: layers from max_window_layers on; Mistral v0.1: every layer
        n = num_layers - min(num_layers, c.int("max_window_layers", 0, minimum=0))
    else:
        n = 0
    if n == 0:
        return 0, 0
    if window is None:
        raise ConfigError(f"{c.where}: {n} layers are sliding-window layers but field 'sliding_window' is missing; "
                          "add sliding_window = <tokens>")
    return c.int("sliding_window"), n


def llm_from_config(data: dict[str, Any], name: str, source: str = "") -> LLM:
    """The `LLM` record of one config.json (already parsed into a dict)."""
    where = source or name
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: a config.json must hold one JSON object")
    c = _Cfg(data, where)
    mt = str(c.get("model_type", "")).lower()
    if mt not in ARCHITECTURES:
        arch = c.get("architectures", [])
        raise ConfigError(f"{where}: field 'model_type' = {mt or None!r} (architectures {arch}) is not supported; "
                          f"supported: {', '.join(ARCHITECTURES)} (define other models in models/catalog.py)")
    kind = ARCHITECTURES[mt]
    d, n_layers, heads, vocab = c.int("hidden_size"), c.int("num_hidden_layers"), c.int("num_attention_heads"), c.int("vocab_size")
    kv_heads = c.int("num_key_value_heads", heads)
    tied = bool(c.get("tie_word_embeddings", False))
    ff = c.int("intermediate_size")
    attn_bias = bool(c.get("attention_bias", False))

    # ---- attention, per layer
    kv_lora = c.int("kv_lora_rank", 0, minimum=0) if kind == "deepseek" else 0
    rope = 0
    if kv_lora:
        rope, nope, v_dim = c.int("qk_rope_head_dim"), c.int("qk_nope_head_dim"), c.int("v_head_dim")
        q_lora = c.int("q_lora_rank", 0, minimum=0)
        qk = nope + rope
        q = d * q_lora + q_lora + q_lora * heads * qk if q_lora else d * heads * qk
        attn = q + d * (kv_lora + rope) + kv_lora + kv_lora * heads * (nope + v_dim) + heads * v_dim * d
        head_dim = qk
        kv_heads = heads  # every head reads the one latent; kept for tensor-parallel head checks
    else:
        if kind == "deepseek":
            raise ConfigError(f"{where}: DeepSeek without 'kv_lora_rank' (plain multi-head attention) is not supported; "
                              "add kv_lora_rank")
        if heads % kv_heads:
            raise ConfigError(f"{where}: field 'num_key_value_heads' = {kv_heads} must divide num_attention_heads = {heads}")
        if not c.has("head_dim") and d % heads:
            raise ConfigError(f"{where}: hidden_size {d} is not a multiple of num_attention_heads {heads}; add field 'head_dim'")
        head_dim = c.int("head_dim", d // heads)
        q_dim, kv_dim = heads * head_dim, kv_heads * head_dim
        attn = d * q_dim + 2 * d * kv_dim + q_dim * d
        if attn_bias:
            attn += q_dim + 2 * kv_dim + d  # q, k, v and o biases (Llama/gpt-oss attention_bias)
        elif mt == "qwen2":
            attn += q_dim + 2 * kv_dim  # Qwen2 always has q, k, v biases
        if mt.startswith("qwen3"):
            attn += 2 * head_dim  # q_norm, k_norm
        if mt == "gpt_oss":
            attn += heads  # attention sinks
    norms = 2 * d

    # ---- MLP: which layers are MoE, what one expert holds
    experts = k = shared = 0
    moe_ff = 0
    per_expert = 0
    router = 0
    moe_layer_ids: list[int] = []
    if kind == "mixtral" or kind == "gpt_oss":
        experts = c.int("num_local_experts")
        k = c.int("num_experts_per_tok", c.int("experts_per_token", 0, minimum=0) or None)
        moe_ff = ff
        moe_layer_ids = list(range(n_layers))
        per_expert = 3 * d * moe_ff + (2 * moe_ff + d if kind == "gpt_oss" else 0)  # gpt-oss experts have biases
        router = d * experts + (experts if kind == "gpt_oss" else 0)
    elif kind == "qwen3_moe":
        experts, k, moe_ff = c.int("num_experts"), c.int("num_experts_per_tok"), c.int("moe_intermediate_size")
        step = c.int("decoder_sparse_step", 1)
        dense_only = set(c.get("mlp_only_layers", []))
        moe_layer_ids = [i for i in range(n_layers) if i not in dense_only and (i + 1) % step == 0]
        per_expert, router = 3 * d * moe_ff, d * experts
    elif kind == "deepseek":
        experts, k, moe_ff = c.int("n_routed_experts"), c.int("num_experts_per_tok"), c.int("moe_intermediate_size")
        shared = c.int("n_shared_experts", 0, minimum=0)
        first, freq = c.int("first_k_dense_replace", 0, minimum=0), c.int("moe_layer_freq", 1)
        moe_layer_ids = [i for i in range(n_layers) if i >= first and i % freq == 0]
        per_expert, router = 3 * d * moe_ff, d * experts + experts  # + the routing-correction bias (V3)
    if experts and not 1 <= k <= experts:
        raise ConfigError(f"{where}: field 'num_experts_per_tok' = {k} must be between 1 and the {experts} experts")
    n_moe = len(moe_layer_ids)
    dense_mlp = 3 * d * ff + (2 * ff + d if bool(c.get("mlp_bias", False)) else 0)
    moe_mlp = router + experts * per_expert + shared * 3 * d * moe_ff
    layers_total = n_layers * (attn + norms) + (n_layers - n_moe) * dense_mlp + n_moe * moe_mlp
    emb = vocab * d
    total = layers_total + emb * (1 if tied else 2) + d  # + the final norm
    active = total - n_moe * (experts - k) * per_expert
    window, n_sliding = _sliding_layers(c, n_layers)
    return LLM(
        name=name, hf_id=str(c.get("_name_or_path", "")), num_layers=n_layers, hidden_size=d, num_heads=heads,
        num_kv_heads=kv_heads, head_dim=head_dim, intermediate_size=ff, vocab_size=vocab, tie_word_embeddings=tied,
        params_total=total, params_active=active,
        tokenizer_family=tokenizer_family(mt, vocab, c.get("tokenizer_family")),
        num_experts=experts if n_moe else 0, experts_per_token=k if n_moe else 0,
        source=f"config.json: {source}" if source else "config.json",
        moe_intermediate_size=moe_ff if n_moe else 0, num_dense_layers=n_layers - n_moe if n_moe else 0,
        num_shared_experts=shared if n_moe else 0, expert_params_each=per_expert if n_moe else 0,
        kv_lora_rank=kv_lora, qk_rope_head_dim=rope, sliding_window=window, num_sliding_layers=n_sliding,
        mtp_layers=c.int("num_nextn_predict_layers", 0, minimum=0), native_weights=native_weights(c),
    )


def default_name(path: str | Path) -> str:
    """`.../Qwen3-8B/config.json` or the folder `.../Qwen3-8B` -> `qwen3-8b`; `qwen3-8b.json` -> `qwen3-8b`."""
    p = Path(path)
    if p.is_dir():
        return p.name.lower()
    return (p.parent.name if p.name == "config.json" and p.parent.name else p.stem).lower()


def config_file(path: str | Path) -> Path:
    """The config.json a path names: the file itself, or `config.json` in a model folder (a
    Hugging Face checkpoint as downloaded); a one-line ConfigError when there is none."""
    p = Path(path)
    if p.is_dir():
        if (p / "config.json").is_file():
            return p / "config.json"
        raise ConfigError(f"'{p}' is a folder without a config.json; give the path of the model's config.json "
                          "(or of the folder holding it)")
    if not p.is_file():
        raise ConfigError(f"config.json not found: '{p.resolve()}'; give the path of a Hugging Face config.json "
                          "(or of the folder holding it)")
    return p


def load_config(path: str | Path, name: str | None = None) -> LLM:
    """The model of a config.json file, or of the one in a model folder (cached per file version)."""
    given = Path(path)
    p = config_file(given)
    st = p.stat()
    return _load(str(p.resolve()), st.st_mtime_ns, st.st_size, name or default_name(given))


@functools.lru_cache(maxsize=64)
def _load(path: str, mtime_ns: int, size: int, name: str) -> LLM:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8-sig"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{path}: not valid JSON ({err}); give the path of a Hugging Face config.json") from None
    return llm_from_config(data, name, path)


# ---------------------------------------------------------------- the user catalogue
USER_CATALOG = "models.toml"


def read_user_catalog(path: str | Path) -> dict[str, Path]:
    """A user catalogue: `[models]` name = "path/to/config.json" (relative to the catalogue file)."""
    import tomllib

    p = Path(path)
    try:
        data = tomllib.loads(p.read_text(encoding="utf-8-sig"))
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as err:
        raise ConfigError(f"{p}: not a readable models.toml ({err}); fix or remove it") from None
    table = data.get("models", {})
    if not isinstance(table, dict) or not all(isinstance(v, str) for v in table.values()):
        raise ConfigError(f"{p}: [models] must map names to config.json paths, e.g. \"my-model\" = \"my-model/config.json\"")
    return {str(k).lower(): (p.parent / v).resolve() for k, v in table.items()}


def find_user_model(name: str, folders: tuple[Path, ...] | list[Path]) -> Path | None:
    """The config.json a user catalogue (models.toml in the first of `folders` that has one naming
    the model) gives for `name`, or None."""
    for folder in folders:
        cat = Path(folder) / USER_CATALOG
        if cat.is_file():
            hit = read_user_catalog(cat).get(name.lower())
            if hit is not None:
                return hit
    return None


def add_user_model(config_path: str | Path, name: str | None = None, catalog: str | Path = USER_CATALOG) -> tuple[LLM, Path]:
    """Register a config.json in a user catalogue (created if missing): checks it parses first.
    Returns the model and the catalogue's path."""
    cfg = config_file(Path(config_path).resolve())
    model = load_config(cfg, name or default_name(Path(config_path).resolve()))
    if model.name in MODELS:
        raise ConfigError(f"'{model.name}' is a built-in catalogue model; choose another --name")
    cat = Path(catalog)
    entries = {k: str(v) for k, v in read_user_catalog(cat).items()} if cat.is_file() else {}
    entries[model.name] = str(cfg)
    lines = ["# specrack user model catalogue (`specrack models add PATH [--name NAME]`): name = config.json path.",
             "# Scenarios find it next to their file, else in the working directory: deployment.model = \"<name>\".",
             "[models]", *(f"{json.dumps(k)} = {json.dumps(v)}" for k, v in sorted(entries.items()))]
    cat.write_text("\n".join(lines) + "\n")
    return model, cat.resolve()
