"""Models from a Hugging Face config.json (models/hf_config.py): parameter counts against the
published totals, KV layouts, the catalogue records against their configs, errors, the user
catalogue (`specrack models add`) and a scenario whose model is a config.json end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from models.catalog import KV_FORMATS, MODELS, kv_bytes_per_token
from models.errors import ConfigError
from models.hf_config import add_user_model, llm_from_config, load_config
from sim.scenario import load_scenario

CONFIGS = Path(__file__).parent / "fixtures" / "hf_configs"


def _cfg(name: str) -> dict:
    return json.loads((CONFIGS / f"{name}.json").read_text())


# published totals (model cards): total and active parameters, in billions
PUBLISHED = {
    "llama-3.1-8b": (8.03, None),  # Llama 3.1 model card
    "qwen3-8b": (8.2, None),  # Qwen3-8B model card: 8.2B
    "qwen3-30b-a3b": (30.5, 3.3),  # Qwen3-30B-A3B model card: 30.5B total, 3.3B activated
    "qwen3-235b-a22b": (235.0, 22.0),  # model card: 235B total, 22B activated
    "deepseek-v3": (671.0, 37.0),  # DeepSeek-V3 report: 671B total, 37B activated (MTP module not counted)
    "gpt-oss-120b": (116.8, 5.13),  # gpt-oss model card: 116.83B total, 5.13B active (without the embedding lookup)
    "gpt-oss-20b": (20.9, 3.61),
    "mixtral-8x7b": (46.7, 12.9),  # Mixtral paper: 46.7B total, 12.9B active
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_parameter_counts_match_the_published_totals(name: str) -> None:
    m = load_config(CONFIGS / f"{name}.json")
    total, active = PUBLISHED[name]
    assert m.params_total / 1e9 == pytest.approx(total, rel=0.02)
    if active is not None:
        # OpenAI counts active parameters without the input-embedding lookup (matmul_params_active);
        # Qwen, DeepSeek and Mistral count it (params_active)
        got = m.matmul_params_active if name.startswith("gpt-oss") else m.params_active
        assert got / 1e9 == pytest.approx(active, rel=0.02)


def test_llama_and_mixtral_match_the_reference_counts_exactly() -> None:
    """shared/reference/models.json counted these two from their configs (copied in the catalogue)."""
    for name in ("llama-3.1-8b", "mixtral-8x7b"):
        m, ref = load_config(CONFIGS / f"{name}.json"), MODELS[name]
        assert (m.params_total, m.params_active) == (ref.params_total, ref.params_active)
        assert m.kv_elements_per_token() == ref.kv_elements_per_token()
        assert m.expert_params == ref.expert_params


@pytest.mark.parametrize("name", ["llama-3.3-70b", "qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-32b",
                                  "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "gpt-oss-20b", "gpt-oss-120b"])
def test_catalogue_records_are_their_configs(name: str) -> None:
    """Every new catalogue record is what models.hf_config reads from the model's config.json."""
    parsed, rec = load_config(CONFIGS / f"{name}.json"), MODELS[name]
    for field in ("num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim", "intermediate_size",
                  "vocab_size", "tie_word_embeddings", "params_total", "params_active", "tokenizer_family",
                  "num_experts", "experts_per_token", "moe_intermediate_size", "num_dense_layers",
                  "num_shared_experts", "expert_params_each", "kv_lora_rank", "qk_rope_head_dim", "sliding_window",
                  "num_sliding_layers", "mtp_layers", "native_weights"):
        assert getattr(parsed, field) == getattr(rec, field), field
    assert rec.source.startswith("https://huggingface.co/") and rec.hf_id in rec.source


def test_deepseek_v3_mla_mtp_and_fp8() -> None:
    m = load_config(CONFIGS / "deepseek-v3.json")
    # compressed KV: (kv_lora_rank + qk_rope_head_dim) x bytes per layer = 576 x 2 x 61 layers
    assert kv_bytes_per_token(m, KV_FORMATS["bf16"]) == 61 * (512 + 64) * 2 == 70272
    assert (m.moe_layers, m.num_dense_layers, m.num_shared_experts, m.mtp_layers) == (58, 3, 1, 1)
    assert m.native_weights == "fp8" and m.tokenizer_family == "deepseek-v3"


def test_gpt_oss_sliding_window_layers_and_mxfp4() -> None:
    m = load_config(CONFIGS / "gpt-oss-120b.json")
    assert (m.sliding_window, m.num_sliding_layers) == (128, 18)
    assert m.native_weights == "mxfp4"
    assert m.kv_elements_per_token_layer() == 2 * 8 * 64  # GQA, 8 KV heads of 64


def test_tokenizer_family_inferred_or_declared() -> None:
    assert load_config(CONFIGS / "qwen3-8b.json").tokenizer_family == "qwen3"
    assert load_config(CONFIGS / "llama-3.3-70b.json").tokenizer_family == "llama3"
    c = _cfg("qwen3-8b")
    assert llm_from_config({**c, "vocab_size": 50000}, "x").tokenizer_family == "vocab-50000"
    assert llm_from_config({**c, "tokenizer_family": "mine"}, "x").tokenizer_family == "mine"


@pytest.mark.parametrize(("change", "field"), [
    ({"model_type": "gemma3"}, "model_type"),
    ({"hidden_size": None}, "hidden_size"),
    ({"num_key_value_heads": 5}, "num_key_value_heads"),
    ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
    ({"quantization_config": {"quant_method": "hqq"}}, "quantization_config.quant_method"),
    ({"torch_dtype": "int2"}, "torch_dtype"),
    ({"num_hidden_layers": "48"}, "num_hidden_layers"),
])
def test_bad_configs_give_one_line_naming_the_field(change: dict, field: str) -> None:
    base = _cfg("qwen3-30b-a3b")
    data = {k: v for k, v in {**base, **change}.items() if v is not None}
    with pytest.raises(ConfigError) as e:
        llm_from_config(data, "bad", "bad/config.json")
    msg = str(e.value)
    assert "\n" not in msg and f"'{field}'" in msg, msg


def test_missing_layer_types_length_and_window(tmp_path: Path) -> None:
    c = _cfg("gpt-oss-20b")
    with pytest.raises(ConfigError, match="'layer_types'"):
        llm_from_config({**c, "layer_types": c["layer_types"][:3]}, "x")
    with pytest.raises(ConfigError, match="'sliding_window'"):
        llm_from_config({k: v for k, v in c.items() if k != "sliding_window"}, "x")
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(bad)


def _scenario(tmp_path: Path, deployment: str, speculative: str = "") -> Path:
    p = tmp_path / "sc.toml"
    p.write_text(f"""
[rack]
gpu = "h200"
num_gpus = 1
[deployment]
tensor_parallel = 1
{deployment}
{speculative}
[workload]
rate_rps = 2.0
num_requests = 40
warmup_s = 0.0
prompt_tokens = {{ dist = "fixed", value = 300 }}
output_tokens = {{ dist = "fixed", value = 60 }}
""")
    return p


def test_a_config_not_in_the_catalogue_runs_end_to_end(tmp_path: Path) -> None:
    """A Qwen3-14B config.json (not in the catalogue) as target, relative to the scenario file,
    with a catalogue draft of its tokenizer family."""
    from specrack import simulate

    cfg = {**_cfg("qwen3-8b"), "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 40,
           "num_attention_heads": 40}  # Qwen/Qwen3-14B config.json
    (tmp_path / "Qwen3-14B").mkdir()
    (tmp_path / "Qwen3-14B" / "config.json").write_text(json.dumps(cfg))
    p = _scenario(tmp_path, 'model_config = "Qwen3-14B/config.json"',
                  '[speculative]\nmethod = "draft_model"\ndraft_model = "qwen3-0.6b"\nnum_speculative_tokens = 3')
    sc = load_scenario(p)
    assert sc.deployment.model == "qwen3-14b"
    res = simulate(sc, 1)
    assert len(res.requests) == 40 and res.requests.completion_s.notna().all()
    assert res.summary["acceptance_rate"] > 0  # the draft ran
    assert res.summary["scenario"]["deployment"]["model_config"].endswith("Qwen3-14B/config.json")
    assert load_config(tmp_path / "Qwen3-14B" / "config.json").params_total / 1e9 == pytest.approx(14.8, rel=0.02)


def test_draft_from_a_config_and_tokenizer_mismatch(tmp_path: Path) -> None:
    draft = CONFIGS / "qwen3-0.6b.json"
    p = _scenario(tmp_path, 'model = "qwen3-8b"',
                  f'[speculative]\nmethod = "draft_model"\ndraft_model_config = "{draft}"')
    assert load_scenario(p).speculative.draft_model == "qwen3-0.6b"
    p = _scenario(tmp_path, 'model = "llama-3.1-8b"',
                  f'[speculative]\nmethod = "draft_model"\ndraft_model_config = "{draft}"')
    with pytest.raises(ConfigError, match="tokenizer") as e:
        load_scenario(p)
    assert "\n" not in str(e.value)


def test_missing_model_config_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        load_scenario(_scenario(tmp_path, 'model_config = "nowhere/config.json"'))
    assert "deployment.model_config" in str(e.value) and "not found" in str(e.value)


def test_user_catalogue_add_and_find(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = tmp_path / "ckpt" / "config.json"
    src.parent.mkdir()
    src.write_text((CONFIGS / "qwen3-30b-a3b.json").read_text())
    model, cat = add_user_model(src, "my-moe", tmp_path / "models.toml")
    assert model.name == "my-moe" and cat == (tmp_path / "models.toml").resolve()
    add_user_model(CONFIGS / "qwen3-4b.json", "my-dense", tmp_path / "models.toml")  # a second entry keeps the first
    sc = load_scenario(_scenario(tmp_path, 'model = "my-moe"'))
    assert sc.deployment.model == "my-moe" and sc.deployment.config_json == str(src.resolve())
    with pytest.raises(ConfigError, match="built-in"):
        add_user_model(src, "qwen3-8b", tmp_path / "models.toml")
    # --set of another catalogue name drops the config
    assert sc.with_overrides({"deployment.model": "qwen3-8b"}).deployment.config_json is None


def test_cli_models_add_and_list(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from experiments.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["models", "add", str(CONFIGS / "deepseek-v3.json"), "--name", "my-ds"]) == 0
    out = capsys.readouterr().out
    assert "my-ds" in out and "671.03B" in out and "MLA" in out
    assert (tmp_path / "models.toml").is_file()
    assert main(["list", "models", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    mine = [r for r in rows if r["name"] == "my-ds"]
    assert mine and mine[0]["catalogue"] == "models.toml" and mine[0]["attention"] == "mla"
    assert {"qwen3-30b-a3b", "deepseek-r1", "gpt-oss-120b", "llama-3.3-70b"} <= {r["name"] for r in rows}
    assert main(["list", "gpus", "--json"]) == 0
    gpus = {g["name"]: g for g in json.loads(capsys.readouterr().out)}
    assert gpus["b200"]["fp4_tflops"] == 9000 and {"h20", "mi325x", "gb200"} <= set(gpus)
    assert main(["models", "add", str(tmp_path / "missing.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not found" in err


EXAMPLE = Path(__file__).resolve().parents[1] / "experiments" / "scenarios" / "llama70b-h100x8.toml"


@pytest.mark.parametrize(("sets", "needles"), [
    (["deployment.model_config='nowhere/config.json'"], ["deployment.model_config", "not found"]),
    (["deployment.model_config=5"], ["deployment.model_config", "string"]),
    (["deployment.moe_routing_skew=-1"], ["deployment.moe_routing_skew"]),
    (["deployment.moe_routing_skew=true"], ["deployment.moe_routing_skew"]),
    (["deployment.expert_parallel=true"], ["deployment.expert_parallel", "dense model"]),
    (["deployment.expert_parallel=1"], ["deployment.expert_parallel"]),
    ([f'speculative={{method="eagle", draft_model_config="{CONFIGS / "qwen3-0.6b.json"}"}}'],
     ["draft_model_config", "method = 'draft_model'"]),
    (["deployment.model='my-unknown-model'"], ["unknown model 'my-unknown-model'"]),
    ([f"deployment.model_config='{CONFIGS / 'gpt-oss-120b.json'}'", "deployment.tensor_parallel=3"],
     ["tensor_parallel=3", "64 attention heads"]),
])
def test_bad_model_inputs_are_one_line_errors(sets: list[str], needles: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from experiments.cli import main

    argv = ["validate", str(EXAMPLE)]
    for s in sets:
        argv += ["--set", s]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    for n in needles:
        assert n in err, err
