"""Scenario files: the example loads, overrides work, and every bad input is a one-line ConfigError
that names the offending field."""

from __future__ import annotations

from typing import Any

import pytest

from models.errors import ConfigError
from sim.scenario import Scenario, load_scenario, parse_set, scenario_from_dict

OK_WORKLOAD = {"utilisation": 0.5}
DRAFT_1B = {"method": "draft_model", "draft_model": "llama-3.2-1b"}

# (case, scenario dict, substrings the message must contain)
BAD: list[tuple[str, dict[str, Any], tuple[str, ...]]] = [
    ("unknown gpu", {"rack": {"gpu": "h1000"}}, ("rack.gpu", "h1000", "h100-sxm")),
    ("unknown model", {"deployment": {"model": "llama-9b"}}, ("deployment.model", "llama-9b", "llama-3.1-70b")),
    ("unknown draft model", {"speculative": {"method": "draft_model", "draft_model": "tiny"}},
     ("speculative.draft_model", "tiny")),
    ("tp does not divide heads", {"deployment": {"model": "llama-3.1-70b", "tensor_parallel": 3}},
     ("tensor_parallel=3", "64 attention heads")),
    ("tp zero", {"deployment": {"tensor_parallel": 0}}, ("deployment.tensor_parallel",)),
    ("negative duration", {"workload": {"utilisation": 0.5, "duration_s": -5}}, ("workload.duration_s", "-5")),
    ("warm-up longer than duration", {"workload": {"utilisation": 0.5, "duration_s": 50, "warmup_s": 60}},
     ("warmup_s", "duration_s")),
    ("both utilisation and rate", {"workload": {"utilisation": 0.5, "rate_rps": 3.0}}, ("utilisation", "rate_rps")),
    ("neither utilisation nor rate", {"workload": {"duration_s": 60}}, ("utilisation", "rate_rps")),
    ("shares do not sum to 1",
     {"workload": {"utilisation": 0.5, "classes": [{"name": "a", "share": 0.5}, {"name": "b", "share": 0.3}]}},
     ("workload", "shares", "0.8")),
    ("duplicate class names",
     {"workload": {"utilisation": 0.5, "classes": [{"name": "a", "share": 0.5}, {"name": "a", "share": 0.5}]}},
     ("workload", "distinct")),
    ("unknown field", {"workload": {"utilisation": 0.5, "utilization": 0.7}}, ("workload.utilization", "unknown field")),
    ("unknown top-level field", {"racks": {"num_gpus": 8}}, ("racks", "unknown field")),
    ("unknown arrival", {"workload": {"utilisation": 0.5, "arrival": "uniform"}}, ("workload.arrival", "uniform")),
    ("lognormal p90 below median",
     {"workload": {"utilisation": 0.5, "prompt_tokens": {"dist": "lognormal", "median": 100, "p90": 50}}},
     ("workload.prompt_tokens", "p90")),
    ("trace arrival without trace", {"workload": {"arrival": "trace"}}, ("workload", "trace")),
    ("draft from another tokenizer family", {"speculative": {"method": "draft_model", "draft_model": "qwen2.5-0.5b"}},
     ("speculative.draft_model", "qwen2.5-0.5b", "tokenizer")),
    ("draft larger than target", {"speculative": {"method": "draft_model", "draft_model": "llama-3.1-405b"}},
     ("speculative.draft_model", "llama-3.1-405b", "not smaller")),
    ("draft_model method without a draft", {"speculative": {"method": "draft_model"}},
     ("speculative", "draft_model")),
    ("k = 0 with policy fixed", {"speculative": {**DRAFT_1B, "num_speculative_tokens": 0}},
     ("speculative", "num_speculative_tokens", "fixed")),
    ("k above 16", {"speculative": {**DRAFT_1B, "num_speculative_tokens": 17}},
     ("speculative.num_speculative_tokens", "17")),
    ("dedicated draft with no GPU left",
     {"rack": {"num_gpus": 4}, "deployment": {"tensor_parallel": 4}, "speculative": {**DRAFT_1B, "placement": "dedicated"}},
     ("rack.num_gpus=4", "tensor_parallel=4", "dedicated")),
    ("dedicated ngram", {"speculative": {"method": "ngram", "placement": "dedicated"}}, ("speculative.placement", "ngram")),
    ("model does not fit",
     {"rack": {"num_gpus": 1}, "deployment": {"model": "llama-3.1-405b", "tensor_parallel": 1}},
     ("llama-3.1-405b", "does not fit", "tensor_parallel")),
    ("fp8 on a GPU without fp8", {"rack": {"gpu": "a100-80gb"}, "deployment": {"weights": "fp8"}},
     ("deployment.weights", "fp8")),
    ("unknown weights format", {"deployment": {"weights": "fp3"}}, ("deployment.weights", "fp3")),
    ("distilled from a smaller model", {"deployment": {"model": "llama-3.1-70b", "distilled_from": "llama-3.1-8b"}},
     ("deployment.distilled_from", "llama-3.1-8b")),
    ("gpu_memory_utilization above 1", {"deployment": {"gpu_memory_utilization": 1.2}},
     ("deployment.gpu_memory_utilization", "1.2")),
]


@pytest.mark.parametrize(("case", "data", "expect"), BAD, ids=[c for c, _, _ in BAD])
def test_bad_input_is_one_line_naming_the_field(case, data, expect):
    data = {"workload": OK_WORKLOAD, **data}
    with pytest.raises(ConfigError) as info:
        scenario_from_dict(data)
    msg = str(info.value)
    assert "\n" not in msg, f"{case}: not one line: {msg!r}"
    assert len(msg) < 400, msg
    for part in expect:
        assert part in msg, f"{case}: {part!r} missing from {msg!r}"
    assert "Traceback" not in msg and "pydantic" not in msg.lower()


def test_good_variants_validate():
    """The bad-input cases' nearest good neighbours are accepted."""
    scenario_from_dict({"workload": OK_WORKLOAD, "speculative": DRAFT_1B})
    scenario_from_dict({"workload": OK_WORKLOAD, "speculative": {"method": "eagle", "num_speculative_tokens": 0,
                                                                 "policy": "adaptive"}})
    scenario_from_dict({"rack": {"num_gpus": 5}, "deployment": {"tensor_parallel": 4}, "workload": OK_WORKLOAD,
                        "speculative": {**DRAFT_1B, "placement": "dedicated"}})
    scenario_from_dict({"rack": {"num_gpus": 8}, "deployment": {"model": "llama-3.1-405b", "tensor_parallel": 8,
                                                                "weights": "fp8"}, "workload": OK_WORKLOAD})
    scenario_from_dict({"workload": {"rate_rps": 3.0, "classes": [{"name": "a", "share": 0.7},
                                                                 {"name": "b", "share": 0.3, "tail": True}]}})
    # names are case-insensitive and normalised
    sc = scenario_from_dict({"rack": {"gpu": "H100-SXM"}, "deployment": {"model": "Llama-3.1-70B"}, "workload": OK_WORKLOAD})
    assert sc.rack.gpu == "h100-sxm" and sc.deployment.model == "llama-3.1-70b"


def test_load_example(example_path):
    sc = load_scenario(example_path)
    assert isinstance(sc, Scenario)
    assert sc.name == "llama70b-h100x8"
    assert (sc.rack.gpu, sc.rack.num_gpus, sc.deployment.tensor_parallel) == ("h100-sxm", 8, 4)
    assert sc.workload.utilisation == 0.5 and sc.workload.rate_rps is None
    assert sc.speculative is None
    # frozen
    with pytest.raises(Exception):  # noqa: B017 - pydantic's frozen-instance error type
        sc.workload.duration_s = 1.0  # type: ignore[misc]


def test_set_overrides(example_path):
    assert parse_set(["workload.utilisation=0.7"]) == {"workload.utilisation": 0.7}
    parsed = parse_set(["deployment.max_num_seqs=64", "name=my run", "workload.classes=[{name='a', share=1.0}]",
                        "speculative.draft_model=llama-3.2-1b"])
    assert parsed["deployment.max_num_seqs"] == 64
    assert parsed["name"] == "my run"  # not TOML: kept as a string
    assert parsed["workload.classes"] == [{"name": "a", "share": 1.0}]
    assert parsed["speculative.draft_model"] == "llama-3.2-1b"

    sc = load_scenario(example_path, parse_set(["workload.utilisation=0.7"]))
    assert sc.workload.utilisation == 0.7
    # switching to rate_rps drops utilisation (and back)
    sc = load_scenario(example_path, parse_set(["workload.rate_rps=3"]))
    assert sc.workload.rate_rps == 3.0 and sc.workload.utilisation is None
    assert sc.with_overrides({"workload.utilisation": 0.9}).workload.rate_rps is None
    # a whole section from --set
    sc = load_scenario(example_path, parse_set(["speculative.method=draft_model", "speculative.draft_model=llama-3.2-1b"]))
    assert sc.speculative is not None and sc.speculative.draft_model == "llama-3.2-1b"
    assert sc.with_overrides({"speculative": None}).speculative is None
    # the Python form
    assert load_scenario(example_path).with_overrides({"workload.utilisation": 0.7}).workload.utilisation == 0.7


def test_bad_overrides_and_files(example_path, tmp_path):
    with pytest.raises(ConfigError, match="key=value"):
        parse_set(["workload.utilisation"])
    with pytest.raises(ConfigError, match=r"llama70b-h100x8\.toml: workload\.utilisation"):
        load_scenario(example_path, parse_set(["workload.utilisation=-1"]))
    with pytest.raises(ConfigError, match="not a table"):
        load_scenario(example_path, parse_set(["name.x=1"]))
    with pytest.raises(ConfigError, match="not found"):
        load_scenario(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[rack\nnum_gpus = 8\n")
    with pytest.raises(ConfigError, match="invalid TOML") as info:
        load_scenario(bad)
    assert "\n" not in str(info.value)


def test_key_is_a_content_hash(example_path):
    a, b = load_scenario(example_path), load_scenario(example_path)
    assert a.key() == b.key()
    assert a.with_overrides({"workload.utilisation": 0.7}).key() != a.key()
