"""Settings that did nothing, and errors that named the wrong cause (issue 38, items 6 and 7):
each case as a user types it, with its one-line message. A key of another speculation method,
policy or self_spec mode, or of another arrival, is an error naming the key, what it needs and the
fix; a method or arrival switched with --set takes the old one's keys with it; prefix-affinity
routing over requests without block hashes is an error; the load given twice, malformed --set
keys, a bad key in a sweep's `set`, a model folder, a comments-only Prometheus file and a UTF-8
byte-order mark each get the message of their real cause."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import one_line_error

from experiments.cli import main
from sim.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT / "experiments" / "scenarios"
EXAMPLE = SCENARIOS / "llama70b-h100x8.toml"
EAGLE = SCENARIOS / "llama70b-eagle.toml"
DRAFT = SCENARIOS / "llama70b-draft1b.toml"
CONFIGS = ROOT / "tests" / "fixtures" / "hf_configs"
BOM = b"\xef\xbb\xbf"


def _fails(argv: list[str], capsys: pytest.CaptureFixture[str], *needles: str) -> str:
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    line = one_line_error(err)
    for n in needles:
        assert n in line, line
    return line


def _ok(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    rc = main(argv)
    out, err = capsys.readouterr()
    assert rc == 0, err
    return out


def _sets(*items: str) -> list[str]:
    return [a for s in items for a in ("--set", s)]


# ------------------------------------------------------------- keys of another method or policy

def test_draft_model_under_eagle_in_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sc = tmp_path / "eagle.toml"
    sc.write_text(EAGLE.read_text() + 'draft_model = "llama-3.2-1b"\n')
    _fails(["validate", str(sc)], capsys, "eagle.toml: speculative: draft_model only applies to method 'draft_model'",
           "method is 'eagle'", "remove draft_model, or set method = 'draft_model'")


# key = value set under a method (and policy) that does not use it
FOREIGN = [
    ("eagle", "draft_model='llama-3.2-1b'", "draft_model only applies to method 'draft_model'"),
    ("eagle3", "draft_model='llama-3.2-1b'", "method is 'eagle3'"),
    ("ngram", "draft_model='llama-3.2-1b'", "method is 'ngram'"),
    ("mtp", "draft_model='llama-3.2-1b'", "method is 'mtp'"),
    ("self_spec", "draft_model='llama-3.2-1b'", "method is 'self_spec'"),
    ("suffix", "draft_model='llama-3.2-1b'", "method is 'suffix'"),
    ("tree", "draft_model='llama-3.2-1b'", "method is 'tree' with tree_drafter 'eagle3'"),
    ("eagle", "mtp_depth=2", "mtp_depth only applies to method 'mtp' (method is 'eagle'); remove it, or set method = 'mtp'"),
    ("draft_model", "tree_branching=[2, 1, 1, 1]", "tree_branching only applies to method 'tree'"),
    ("eagle", "tree_drafter='eagle'", "tree_drafter only applies to method 'tree'"),
    ("eagle", "tree_rank_decay=0.3", "tree_rank_decay only applies to method 'tree'"),
    ("eagle", "self_spec_mode='layer_skip'", "self_spec_mode only applies to method 'self_spec'"),
    ("eagle", "self_spec_window=256", "self_spec_window only applies to method 'self_spec'"),
    ("self_spec", "self_spec_layer_fraction=0.3",
     "self_spec_layer_fraction only applies to self spec mode 'layer_skip' (self_spec_mode is 'window'); remove it, "
     "or set self_spec_mode = 'layer_skip'"),
    ("eagle", "suffix_host_s=0.001", "suffix_host_s only applies to method 'suffix'"),
    ("eagle", "disable_batch_size=8",
     "disable_batch_size only applies to policy 'disable_above_batch' (policy is 'fixed'); remove it, or set "
     "policy = 'disable_above_batch'"),
    ("eagle", "load_off_above=0.8", "load_off_above only applies to policy 'follow_load'"),
    ("eagle", "load_on_below=0.3", "load_on_below only applies to policy 'follow_load'"),
    ("eagle", "load_interval_s=10", "load_interval_s only applies to policy 'follow_load'"),
]


@pytest.mark.parametrize(("method", "setting", "needle"), FOREIGN, ids=[f"{m}-{s}" for m, s, _ in FOREIGN])
def test_a_key_of_another_method_or_policy_is_an_error(method: str, setting: str, needle: str,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    table = f"speculative={{method='{method}', num_speculative_tokens=1, {setting}"
    table += ", tree_branching=[2]}" if method == "tree" and "tree_branching" not in setting else "}"
    _fails(["validate", str(EAGLE), "--set", table], capsys, needle)


def test_the_keys_where_they_belong_validate(capsys: pytest.CaptureFixture[str]) -> None:
    for table in ("{method='tree', tree_drafter='draft_model', draft_model='llama-3.2-1b', tree_branching=[2, 1], "
                  "num_speculative_tokens=2}",
                  "{method='draft_model', draft_model='llama-3.2-1b', policy='disable_above_batch', disable_batch_size=8}",
                  "{method='eagle', policy='follow_load', load_off_above=0.8, load_on_below=0.3, load_interval_s=10}",
                  "{method='self_spec', self_spec_mode='layer_skip', self_spec_layer_fraction=0.3}"):
        _ok(["validate", str(SCENARIOS / "default-mix.toml"), "--set", f"speculative={table}"], capsys)


def test_a_method_switched_with_set_takes_its_keys_along(capsys: pytest.CaptureFixture[str]) -> None:
    """`--set speculative.method=eagle` on a draft-model scenario replaces the method, its
    draft_model with it; naming the draft too is the conflict, and an error."""
    _ok(["validate", str(DRAFT), *_sets("speculative.method='eagle'")], capsys)
    assert load_scenario(DRAFT, {"speculative.method": "eagle"}).speculative.draft_model is None  # type: ignore[union-attr]
    _fails(["validate", str(DRAFT), *_sets("speculative.method='eagle'", "speculative.draft_model='llama-3.2-1b'")],
           capsys, "draft_model only applies to method 'draft_model'")
    sc = load_scenario(EAGLE, {"speculative.policy": "disable_above_batch", "speculative.disable_batch_size": 8})
    assert load_scenario(EAGLE, {"speculative.policy": "disable_above_batch", "speculative.disable_batch_size": 8,
                                 }).speculative.disable_batch_size == 8  # type: ignore[union-attr]
    assert sc.with_overrides({"speculative.policy": "fixed"}).speculative.disable_batch_size == 32  # type: ignore[union-attr]


@pytest.mark.parametrize("policy", ["disable_above_batch", "fixed", "follow_load"])
def test_k0_is_refused_under_every_policy_but_adaptive(policy: str, capsys: pytest.CaptureFixture[str]) -> None:
    _fails(["validate", str(EAGLE), *_sets("speculative.num_speculative_tokens=0", f"speculative.policy='{policy}'")],
           capsys, f"num_speculative_tokens must be >= 1 with policy '{policy}'", "never drafts",
           "set num_speculative_tokens >= 1", "remove [speculative]")
    _ok(["validate", str(EAGLE), *_sets("speculative.num_speculative_tokens=0", "speculative.policy='adaptive'")], capsys)


# ------------------------------------------------------------------- arrival keys that did nothing

def test_a_trace_with_poisson_arrivals_is_an_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,100,10\n1,200,20\n")
    _fails(["validate", str(EXAMPLE), "--set", f"workload.trace='{trace}'"], capsys,
           "workload: trace: a trace is replayed only with arrival = 'trace'", "arrival is 'poisson'",
           "set arrival = 'trace', or remove trace", 'dist = "empirical"')
    _fails(["validate", str(EXAMPLE), "--set", "workload.trace_format='azure'"], capsys,
           "trace_format: a trace is replayed only with arrival = 'trace'")


def test_cv_needs_gamma_arrivals(capsys: pytest.CaptureFixture[str]) -> None:
    _fails(["validate", str(EXAMPLE), "--set", "workload.cv=3"], capsys,
           "workload: cv: the coefficient of variation of gamma inter-arrival times needs arrival = 'gamma'",
           "arrival is 'poisson'", "remove cv, or set arrival = 'gamma'")
    gamma = load_scenario(EXAMPLE, {"workload.arrival": "gamma", "workload.cv": 3.0})
    assert gamma.with_overrides({"workload.arrival": "poisson"}).workload.cv == 2.0  # switched: cv goes with gamma


# ------------------------------------------------------------------------------ prefix affinity

def test_prefix_affinity_on_a_trace_without_hash_ids(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "plain.csv"
    trace.write_text("arrival_s,prompt_tokens,output_tokens\n0,100,10\n1,200,20\n2,300,30\n")
    _fails(["validate", str(EXAMPLE), *_sets("deployment.router='prefix_affinity'", "workload.arrival='trace'",
                                             f"workload.trace='{trace}'", "workload.utilisation=0.5")],
           capsys, "deployment.router 'prefix_affinity' routes by cached prefixes", "the trace plain.csv has no hash_ids",
           "replay a trace with hash_ids", "deployment.router = 'least_outstanding'")


def test_prefix_affinity_on_synthetic_single_turn_requests(capsys: pytest.CaptureFixture[str]) -> None:
    _fails(["validate", str(EXAMPLE), "--set", "deployment.router='prefix_affinity'"], capsys,
           "prefix_affinity", "carry no block hashes", "[workload] conversations")


def test_prefix_affinity_where_requests_carry_hashes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "mooncake.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": 600, "output_length": 20,
                                         "hash_ids": [0, i + 1]}) + "\n" for i in range(4)))
    _ok(["validate", str(EXAMPLE), *_sets("deployment.router='prefix_affinity'", "workload.arrival='trace'",
                                          f"workload.trace='{trace}'", "workload.utilisation=0.5")], capsys)
    _ok(["validate", str(SCENARIOS / "chat-conversations.toml")], capsys)


# ---------------------------------------------------------------------------------- --set itself

@pytest.mark.parametrize("item", ["=0.5", "workload..x=1", "workload.=1", ".utilisation=1", " =1"])
def test_malformed_set_keys(item: str, capsys: pytest.CaptureFixture[str]) -> None:
    line = _fails(["validate", str(EXAMPLE), "--set", item], capsys, f"--set '{item}': malformed key",
                  "expected section.key=value")
    assert "llama70b-h100x8.toml" not in line  # the scenario file is not to blame


def test_utilisation_and_rate_both_set(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _fails(["validate", str(EXAMPLE), *_sets("workload.utilisation=0.5", "workload.rate_rps=3")], capsys,
           "workload.utilisation=0.5 and workload.rate_rps=3 are both given", "keep one of them")
    sc = tmp_path / "both.toml"
    sc.write_text(EXAMPLE.read_text().replace("[workload]\n", "[workload]\nrate_rps = 3.0\n", 1))
    _fails(["validate", str(sc)], capsys, "workload: utilisation = 0.5 and rate_rps = 3 are both set", "keep one of them")
    _ok(["validate", str(sc), "--set", "workload.rate_rps=2"], capsys)  # one given by --set replaces both


def test_set_paths_are_relative_to_the_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """A relative path typed with --set means the working directory (as in the shell), one in a
    scenario file its folder; the not-found message names the path looked at and says so."""
    monkeypatch.chdir(tmp_path)
    Path("here.csv").write_text("arrival_s,prompt_tokens,output_tokens\n0,100,10\n1,200,20\n")
    (tmp_path / "Qwen3-1.7B").mkdir()
    (tmp_path / "Qwen3-1.7B" / "config.json").write_text((CONFIGS / "qwen3-1.7b.json").read_text())
    trace = _sets("workload.arrival='trace'", "workload.trace='here.csv'", "workload.utilisation=0.5")
    _ok(["validate", str(EXAMPLE), *trace], capsys)
    out = _ok(["validate", str(EXAMPLE), *_sets("deployment.model_config='Qwen3-1.7B/config.json'",
                                                "deployment.tensor_parallel=1")], capsys)
    assert "of qwen3-1.7b TP1" in out, out  # named after the config, not the file's catalogue model
    _fails(["validate", str(EXAMPLE), *_sets("workload.arrival='trace'", "workload.trace='gone.csv'",
                                             "workload.utilisation=0.5")],
           capsys, f"trace file not found: '{tmp_path.resolve() / 'gone.csv'}'", "one given with --set",
           "to the working directory")
    # a scenario file's own relative paths: its folder, wherever it is run from
    sub = tmp_path / "sub"
    sub.mkdir()
    Path("sub/t.csv").write_text("arrival_s,prompt_tokens,output_tokens\n0,100,10\n1,200,20\n")
    (sub / "s.toml").write_text(EXAMPLE.read_text().replace("[workload]\n", "[workload]\narrival = \"trace\"\n"
                                                             "trace = \"t.csv\"\n", 1).replace('arrival = "poisson"', ""))
    _ok(["validate", str(sub / "s.toml")], capsys)


# ------------------------------------------------------------------------------ files and folders

def test_bad_key_in_a_sweep_set_blames_the_sweep(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sw = tmp_path / "sw.toml"
    sw.write_text(f'name = "t"\nbase = "{SCENARIOS / "default-mix.toml"}"\nutilisation = [0.3]\n'
                  'set = { "workload.duratoin_s" = 120 }\n[[variants]]\nname = "baseline"\n')
    line = _fails(["sweep", str(sw), "--out", str(tmp_path / "out")], capsys,
                  "sw.toml: set: workload.duratoin_s: unknown field")
    assert "default-mix.toml" not in line


def test_a_utilisation_sweep_over_a_closed_loop(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Refused at load, naming the closed loop (not 'remove rate_rps', a key the user never set)."""
    (tmp_path / "closed.toml").write_text('[rack]\nnum_gpus = 4\n[deployment]\ntensor_parallel = 4\n[workload]\n'
                                          'arrival = "closed"\nconcurrency = 8\nnum_requests = 100\n')
    sw = tmp_path / "sw.toml"
    sw.write_text('name = "t"\nbase = "closed.toml"\nutilisation = [0.3]\n[[variants]]\nname = "baseline"\n')
    line = _fails(["sweep", str(sw), "--out", str(tmp_path / "out")], capsys,
                  "sw.toml: variant 'baseline' is a closed loop", "use concurrency = [...]")
    assert "remove rate_rps" not in line


def test_a_model_folder_stands_for_its_config_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "Qwen3-1.7B"
    folder.mkdir()
    (folder / "config.json").write_text((CONFIGS / "qwen3-1.7b.json").read_text())
    out = _ok(["validate", str(EXAMPLE), *_sets(f"deployment.model_config='{folder}'", "deployment.tensor_parallel=1")],
              capsys)
    assert "of qwen3-1.7b TP1" in out, out
    sc = load_scenario(EXAMPLE, {"deployment.model_config": str(folder), "deployment.tensor_parallel": 1})
    assert sc.deployment.config_json == str(folder / "config.json")
    cat = tmp_path / "models.toml"
    assert main(["models", "add", str(folder), "--name", "my-qwen", "--catalog", str(cat)]) == 0
    assert str(folder / "config.json") in cat.read_text()
    empty = tmp_path / "empty"
    empty.mkdir()
    _fails(["validate", str(EXAMPLE), "--set", f"deployment.model_config='{empty}'"], capsys,
           "deployment.model_config:", "is a folder without a config.json", "give the path of the model's config.json")


def test_a_prometheus_file_of_comments_only(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prom = tmp_path / "only.prom"
    prom.write_text("# HELP vllm:spec_decode_num_drafts drafts\n# TYPE vllm:spec_decode_num_drafts counter\n\n")
    line = _fails(["acceptance", str(prom), "--out", str(tmp_path / "out")], capsys,
                  "only.prom: a Prometheus file with no samples (only comments or blank lines)", "curl -s")
    assert "0 of 0" not in line


def test_a_byte_order_mark_is_not_content(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Scenario, sweep and user-catalogue TOML, config.json and efficiency JSON written with a
    UTF-8 BOM (Windows editors) read as without."""
    sc = tmp_path / "bom.toml"
    sc.write_bytes(BOM + EXAMPLE.read_bytes())
    _ok(["validate", str(sc)], capsys)
    cfg = tmp_path / "qwen.json"
    cfg.write_bytes(BOM + (CONFIGS / "qwen3-1.7b.json").read_bytes())
    eff = tmp_path / "eff.json"
    eff.write_bytes(BOM + b'{"bw_eff": 0.8}')
    _ok(["validate", str(sc), *_sets(f"deployment.model_config='{cfg}'", "deployment.tensor_parallel=1",
                                     f"deployment.efficiency_file='{eff}'")], capsys)
    cat = tmp_path / "models.toml"
    cat.write_bytes(BOM + f'[models]\n"my-qwen" = "{cfg}"\n'.encode())
    sc.with_name("s2.toml").write_bytes(BOM + EXAMPLE.read_bytes().replace(b'model = "llama-3.1-70b"', b'model = "my-qwen"')
                                        .replace(b"tensor_parallel = 4", b"tensor_parallel = 1"))
    assert "of my-qwen TP1" in _ok(["validate", str(tmp_path / "s2.toml")], capsys)
    sw = tmp_path / "sw.toml"
    sw.write_bytes(BOM + f'name = "t"\nbase = "{sc}"\nutilisation = [0.3]\n[[variants]]\nname = "b"\n'.encode())
    from experiments.sweep import load_sweep

    assert load_sweep(sw).name == "t"
