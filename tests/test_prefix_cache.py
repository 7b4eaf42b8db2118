"""Prefix caching (issue 15, item 1): the block cache by hand, the engine's accounting under KV
pressure and preemption, multi-turn conversations, the prefix-affinity router, and the Mooncake
trace replayed against the arithmetic of its own hash ids."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from models.errors import ConfigError
from models.memory import BLOCK_SIZE
from sim.deployment import build_runtime
from sim.engine import Replica
from sim.prefix_cache import PrefixCache
from sim.pricing import StepPricer
from sim.run import _route, run_table
from sim.workload import generate
from specrack import simulate

ROOT = Path(__file__).resolve().parents[1]
MOONCAKE = ROOT.parent / "shared" / "data" / "traces" / "mooncake" / "conversation_trace.jsonl"
needs_mooncake = pytest.mark.skipif(not MOONCAKE.is_file(), reason="the Mooncake trace is not in ../shared/data/traces")

CONV = {"turns": 4, "turn_gap_s": {"dist": "exponential", "mean": 20.0}}


def _table(rows: list[tuple[float, int, int, list[int]]]) -> pd.DataFrame:
    """A request table whose requests carry one-block units: (arrival_s, prompt, output, keys)."""
    n = len(rows)
    return pd.DataFrame({
        "id": np.arange(n), "arrival_s": [r[0] for r in rows], "prompt_tokens": [r[1] for r in rows],
        "output_tokens": [r[2] for r in rows], "cls": np.zeros(n, dtype=np.int64), "accept_q": np.full(n, 0.5),
        "unit_keys": pd.Series([np.asarray(r[3], dtype=np.int64) for r in rows], dtype=object),
        "unit_blocks": pd.Series([np.ones(len(r[3]), dtype=np.int64) for r in rows], dtype=object)})


def _with_pool(rt, blocks: int):
    return dataclasses.replace(rt, plan=dataclasses.replace(rt.plan, num_blocks=blocks),
                               max_model_len=min(rt.max_model_len, blocks * BLOCK_SIZE))


# ----------------------------------------------------------------------------- the cache by hand


def test_cache_lru_tail_first_and_referenced_units_stay() -> None:
    c = PrefixCache()
    a, b = np.array([1, 2, 3]), np.array([7, 8])
    assert c.insert(a, np.array([1, 1, 2])) == 0 and c.insert(b, np.array([1, 1])) == 0
    assert c.release(a) == 4 and c.evictable == 4  # a's units unreferenced, tail first: 3, 2, 1
    assert c.match(np.array([1, 2, 3, 9])) == 3 and c.match(np.array([2])) == 1 and c.match(np.array([9, 1])) == 0
    c.reclaim(free_blocks=4)
    assert c.evicted_units == 0  # nothing taken beyond the truly free blocks yet
    c.reclaim(free_blocks=2)  # the engine took 2 blocks more than were truly free: unit 3 (2 blocks) goes
    assert list(c.lru) == [2, 1] and 3 not in c.ref and c.evictable == 2
    assert c.acquire(np.array([1])) == 1  # a hit on an unreferenced unit takes its block from the free capacity
    c.reclaim(free_blocks=0)  # everything unreferenced goes, the referenced ones (1, 7, 8) stay
    assert set(c.ref) == {1, 7, 8} and c.evictable == 0 and c.evicted_units == 2
    # a unit computed meanwhile by another sequence is shared: that sequence's own copy is freed
    assert c.insert(np.array([1, 5]), np.array([1, 1])) == 1 and c.ref[1] == 2 and c.ref[5] == 1
    assert c.release(np.array([1, 5])) == 1 and c.ref[1] == 1  # 5 unreferenced, 1 still held


# ----------------------------------------------------------------------------- the engine by hand


def test_second_request_computes_only_what_is_not_cached(make_scenario) -> None:
    """A (100 tokens, 6 full blocks) leaves its blocks cached; B (80 tokens) shares 3 of them: its
    prefill is the 32 tokens after them, its attention over the 48 cached ones."""
    sc = make_scenario(sim={"drain_s": 100.0})
    rt = build_runtime(sc)
    table = _table([(0.0, 100, 1, [1, 2, 3, 4, 5, 6]), (1.0, 80, 1, [1, 2, 3, 7, 8])])
    out = run_table(sc, rt, table, 1)
    req, steps = out.requests.to_pandas(), out.steps.to_pandas()
    assert req.cached_tokens.tolist() == [0, 48] and req.prefill_computed_tokens.tolist() == [100, 32]
    assert steps.prefill_tokens.tolist() == [100.0, 32.0]
    pairs = 32 * 48 + 32 * 33 / 2.0  # new tokens x cached context + the causal triangle of the new ones
    assert steps.duration_s.iloc[1] == rt.cost.step_sums(1, 32.0, 48.0, pairs).total_s
    # without caching B computes all 80
    off = sc.with_overrides({"deployment.prefix_caching": False})
    steps_off = run_table(off, build_runtime(off), table, 1).steps.to_pandas()
    assert steps_off.prefill_tokens.tolist() == [100.0, 80.0]


def test_a_fully_cached_prompt_still_computes_its_last_block(make_scenario) -> None:
    sc = make_scenario(sim={"drain_s": 100.0})
    req = run_table(sc, build_runtime(sc), _table([(0.0, 64, 1, [1, 2, 3, 4]), (1.0, 64, 1, [1, 2, 3, 4])]), 1).requests.to_pandas()
    assert req.cached_tokens.tolist() == [0, 48] and req.prefill_computed_tokens.tolist() == [64, 16]


def test_eviction_is_lru_tail_first(make_scenario) -> None:
    """A 20-block pool, one request at a time (each finishes at its prefill). A and B (70 tokens: 4
    full blocks + 1 partial) leave 8 cached blocks; C needs 14 blocks of the 12 truly free, so A's
    two tail blocks go (a4, a3). D (A's prompt) hits a1 a2 and takes 3 blocks, which evicts the
    next least recent: b4, b3. E (B's prompt) then hits b1 b2 only."""
    sc = make_scenario(sim={"drain_s": 100.0})
    rt = _with_pool(build_runtime(sc), 20)
    a, b = [11, 12, 13, 14], [21, 22, 23, 24]
    table = _table([(0.0, 70, 1, a), (1.0, 70, 1, b), (2.0, 220, 1, list(range(31, 44))), (3.0, 70, 1, a),
                    (4.0, 70, 1, b)])
    req = run_table(sc, rt, table, 1).requests.to_pandas()
    assert req.cached_tokens.tolist() == [0, 0, 0, 32, 32]
    assert (req.cached_tokens + req.prefill_computed_tokens == req.prompt_tokens).all()


# ----------------------------------------------------------------------------- invariants


class _Audit:
    """Checks the paged-KV pool of every replica at every event: private + referenced + free =
    the pool, free >= 0, and each cached unit's references are exactly the running sequences
    that hold it (so a referenced unit was never evicted)."""

    def __init__(self, monkeypatch) -> None:
        self.checks = 0
        self.max_evictable = 0
        audit = self
        owners: dict[int, Replica] = {}  # each replica's step pricer -> the replica
        init, orig = Replica.__init__, StepPricer.spec_cost

        def made(rep, *args, **kw):
            init(rep, *args, **kw)
            owners[id(rep.price)] = rep

        def spy(price, *args):  # every step priced, on any path: the pool adds up at that moment
            audit.check(owners[id(price)])
            return orig(price, *args)

        monkeypatch.setattr(Replica, "__init__", made)
        monkeypatch.setattr(StepPricer, "spec_cost", spy)

    def check(self, rep: Replica) -> None:
        acc = rep.kv_accounting()
        assert acc["private"] >= 0 and acc["free"] >= 0
        assert acc["private"] + acc["referenced"] + acc["free"] == acc["pool"], acc
        cache = rep.cache
        if cache is None:
            return
        held: Counter[int] = Counter()
        for i in range(rep.n_running):
            held.update(rep.units(int(rep.rid[i]))[0][: int(rep.n_units[i])].tolist())
        assert held == Counter({k: r for k, r in cache.ref.items() if r > 0})
        assert cache.evictable == sum(cache.nb[k] for k in cache.lru)
        self.max_evictable = max(self.max_evictable, cache.evictable)
        self.checks += 1


_SPECS = {"draft": {"method": "draft_model", "draft_model": "llama-3.2-1b", "num_speculative_tokens": 3},
          "tree": {"method": "tree", "num_speculative_tokens": 3, "tree_branching": [3, 2, 1]}}


@pytest.mark.parametrize("engine", ["vllm-v1", "trtllm", "vllm-0.6", "vllm-v1+draft", "vllm-v1+tree"])
def test_accounting_and_token_invariant_under_kv_pressure(make_scenario, monkeypatch, engine: str) -> None:
    """Conversations on a 4000-token KV cache: preemptions and evictions happen, the pool always adds
    up, and for every request cached + computed prefill tokens = its prompt, or, once preempted,
    what its admissions prefilled (what it got to before each preemption, then prompt + output so
    far again)."""
    audit = _Audit(monkeypatch)
    name, _, method = engine.partition("+")
    spec = {"speculative": _SPECS[method]} if method else {}
    sc = make_scenario(deployment={"engine": name, "max_num_seqs": 16}, **spec,
                       workload={"rate_rps": 5.0, "duration_s": 40.0, "conversations": CONV,
                                 "prompt_tokens": {"dist": "lognormal", "median": 300, "p90": 900, "max": 2000},
                                 "output_tokens": {"dist": "lognormal", "median": 100, "p90": 300, "max": 600}},
                       sim={"drain_s": 1e4})
    rt = _with_pool(build_runtime(sc), 250)
    table = generate(sc.workload, 1, 5.0).to_pandas()
    req = run_table(sc, rt, table, 1).requests.to_pandas()
    assert req.completion_s.notna().all()
    assert req.preemptions.sum() > 0 and audit.checks > 100 and audit.max_evictable > 0
    assert (req.prefill_cached_tokens + req.prefill_computed_tokens == req.prefill_tokens).all()
    calm = req.preemptions == 0
    assert (req.prefill_tokens[calm] == req.prompt_tokens[calm]).all()
    assert (req.cached_tokens[calm] == req.prefill_cached_tokens[calm]).all()
    assert (req.prefill_tokens[~calm] >= req.prompt_tokens[~calm]).all()
    assert (req.prefill_tokens[~calm] > req.prompt_tokens[~calm]).mean() > 0.5
    assert (req.prefill_cached_tokens % BLOCK_SIZE == 0).all() and req.prefill_cached_tokens.gt(0).mean() > 0.1


def test_no_hashes_or_caching_off_is_todays_engine(make_scenario) -> None:
    """Units on the table with prefix_caching = false: the same tables as without units."""
    sc = make_scenario(deployment={"prefix_caching": False}, workload={"rate_rps": 3.0, "duration_s": 30.0,
                                                                         "conversations": CONV})
    table = generate(sc.workload, 1, 3.0).to_pandas()
    rt = build_runtime(sc)
    with_units = run_table(sc, rt, table, 1)
    without = run_table(sc, rt, table.drop(columns=["unit_keys", "unit_blocks"]), 1)
    pd.testing.assert_frame_equal(with_units.requests.to_pandas(), without.requests.to_pandas())
    pd.testing.assert_frame_equal(with_units.steps.to_pandas(), without.steps.to_pandas())
    assert "cached_tokens" not in with_units.requests.to_pandas() and "cache_hit_rate" not in simulate(sc, 1).summary


# ----------------------------------------------------------------------------- conversations


def test_conversations_turns_grow_and_hit_the_previous_turn(make_scenario) -> None:
    """Turns far apart (a fixed 300 s gap) on an ample cache: turn t + 1's prompt is turn t's prompt
    + output + growth, and its hit is every full block turn t computed (its prompt and output but
    the last token), capped to leave a token to compute."""
    conv = {"turns": 3, "turn_gap_s": {"dist": "fixed", "value": 300.0}, "growth_tokens": {"dist": "fixed", "value": 37}}
    sc = make_scenario(workload={"rate_rps": 0.3, "duration_s": 900.0, "conversations": conv}, sim={"drain_s": 1e4})
    res = simulate(sc, 2)
    r = res.requests.sort_values(["conversation", "turn"])
    assert set(np.bincount(r.conversation)) <= {1, 2, 3}
    for _, g in r.groupby("conversation"):
        p, o, c = g.prompt_tokens.to_numpy(), g.output_tokens.to_numpy(), g.cached_tokens.to_numpy()
        assert np.array_equal(p[1:], p[:-1] + o[:-1] + 37)
        assert c[0] == 0
        want = np.minimum((p[:-1] + o[:-1] - 1) // BLOCK_SIZE, (p[1:] - 1) // BLOCK_SIZE) * BLOCK_SIZE
        assert np.array_equal(c[1:], want)
    s = res.summary
    assert s["cache_hit_rate"] == pytest.approx(r.cached_tokens.sum() / r.prompt_tokens.sum())
    assert s["ttft_hit_s"]["mean"] < s["ttft_miss_s"]["mean"]


def test_conversation_rate_counts_every_turn(make_scenario) -> None:
    sc = make_scenario(workload={"rate_rps": 4.0, "duration_s": 2000.0, "conversations": CONV})
    t = generate(sc.workload, 1, 4.0).to_pandas()
    assert np.all(np.diff(t.arrival_s) >= 0) and (t.arrival_s < 2000.0).all()
    assert len(t) / 2000.0 == pytest.approx(4.0, rel=0.06)  # turns past the end are cut: a little under
    assert "think" not in t and t.turn.max() == 4
    # sized by num_requests: the first that many turns by arrival of the first ceil(n / turns)
    # conversations, which are the longer run's first conversations (draws per conversation)
    n = generate(make_scenario(workload={"rate_rps": 4.0, "num_requests": 50, "conversations": CONV}).workload, 1, 4.0).to_pandas()
    assert len(n) == 50 and np.all(np.diff(n.arrival_s) >= 0) and n.conversation.max() == 12
    assert set(n.arrival_s) <= set(t.arrival_s) and set(n.prompt_tokens) <= set(t.prompt_tokens)


@pytest.mark.parametrize(("bad", "field"), [
    ({"workload": {"utilisation": 0.5, "rate_rps": None, "conversations": CONV}}, "rate_rps"),
    ({"workload": {"arrival": "closed", "concurrency": 4, "rate_rps": None, "conversations": CONV}}, "conversations"),
    ({"workload": {"conversations": {"turns": 0, "turn_gap_s": {"dist": "fixed", "value": 1.0}}}}, "turns"),
    ({"workload": {"conversations": {"turns": 2, "turn_gap_s": 5}}}, "turn_gap_s"),
    ({"workload": {"conversations": {"turns": 2}}}, "turn_gap_s"),
    ({"deployment": {"router": "prefix_affinity", "prefix_caching": False}}, "prefix_caching"),
    ({"deployment": {"router": "prefix_affinty"}}, "router"),
])
def test_bad_inputs_are_one_line_errors(make_scenario, bad: dict, field: str) -> None:
    with pytest.raises(ConfigError) as err:
        make_scenario(**bad)
    msg = str(err.value)
    assert "\n" not in msg and field in msg, msg


# ----------------------------------------------------------------------------- routing


class _Stub:
    def __init__(self, idx: int, out: int, match: int, reqs) -> None:
        self.idx, self._out, self._match, self.reqs = idx, out, match, reqs

    def outstanding(self) -> int:
        return self._out

    def prefix_match_tokens(self, rid: int) -> int:
        return self._match


def test_prefix_affinity_rule() -> None:
    """Longest cached prefix wins while it holds >= 30% of the prompt and the replicas are balanced
    (max - min outstanding <= 64 or max <= 1.5 x min); otherwise least outstanding."""
    reqs = type("R", (), {"prompt": np.array([1000])})()

    def route(*reps: tuple[int, int]) -> int:
        stubs = [_Stub(i, o, m, reqs) for i, (o, m) in enumerate(reps)]
        return _route(stubs, "prefix_affinity", 0, 0).idx  # type: ignore[arg-type]

    assert route((3, 0), (5, 320)) == 1  # affinity beats load
    assert route((3, 0), (5, 288)) == 0  # under 30% of the prompt: least outstanding
    assert route((5, 640), (3, 640)) == 1  # equal matches: fewer outstanding
    assert route((10, 0), (70, 900)) == 1  # 60 apart: still balanced
    assert route((10, 0), (80, 900)) == 0  # 70 apart and 8x: least outstanding
    assert route((200, 0), (280, 900)) == 1  # 80 apart but only 1.4x: balanced


def test_prefix_affinity_raises_the_hit_rate_over_two_replicas(make_scenario) -> None:
    rates = {}
    for router in ("least_outstanding", "round_robin", "prefix_affinity"):
        sc = make_scenario(rack={"gpu": "h100-sxm", "num_gpus": 8}, deployment={"router": router},
                           workload={"rate_rps": 3.0, "duration_s": 120.0, "conversations": CONV})
        rates[router] = simulate(sc, 1).summary["cache_hit_rate"]
    assert rates["prefix_affinity"] > max(rates["least_outstanding"], rates["round_robin"]) + 0.1, rates


# ----------------------------------------------------------------------------- step fusion


@pytest.mark.parametrize("name", ["one", "affinity", "pressure"])
def test_fused_equals_unfused_with_caching(make_scenario, name: str) -> None:
    from test_fusion import _check

    wl = {"rate_rps": 3.0, "duration_s": 60.0, "warmup_s": 5.0, "conversations": CONV}
    if name == "one":
        sc = make_scenario(workload=wl)
    elif name == "affinity":
        sc = make_scenario(rack={"gpu": "h100-sxm", "num_gpus": 8}, deployment={"router": "prefix_affinity"},
                           workload={**wl, "rate_rps": 5.0})
    else:  # a ~6k-token KV cache: evictions and preemptions (gpu_memory_utilization sized for it)
        from models.catalog import get_gpu

        plan = build_runtime(make_scenario()).plan
        need = plan.weight_bytes + plan.activation_bytes + plan.runtime_bytes + plan.extra_bytes
        util = (need + 6144 * plan.kv_bytes_per_token) / get_gpu("h100-sxm").hbm_bytes
        sc = make_scenario(deployment={"gpu_memory_utilization": round(util, 6)},
                           workload={**wl, "prompt_tokens": {"dist": "lognormal", "median": 500, "p90": 1500,
                                                             "max": 3000}}, sim={"drain_s": 1e4})
    _check(sc, min_fused=1.0 if name == "pressure" else 1.5)  # under KV pressure runs are short


# ----------------------------------------------------------------------------- the Mooncake trace


def _arithmetic(n: int) -> np.ndarray:
    """Per request of the trace's first n (in its order), the prompt tokens an unbounded cache
    holds by the hash arithmetic alone: the longest prefix of its hash ids seen in earlier
    requests, in whole 16-token blocks of each 512-token span, leaving one token to compute."""
    seen: set[int] = set()
    out = []
    with MOONCAKE.open() as fh:
        for line, _ in zip(fh, range(n), strict=False):
            r = json.loads(line)
            ids, length = r["hash_ids"], r["input_length"]
            k = 0
            while k < len(ids) and ids[k] in seen:
                k += 1
            spans = [min(512, length - 512 * p) // BLOCK_SIZE * BLOCK_SIZE for p in range(k)]
            tokens = sum(spans)
            while tokens > (length - 1) // BLOCK_SIZE * BLOCK_SIZE:  # a whole-prompt hit keeps a span back
                tokens -= spans.pop()
            out.append(tokens)
            seen.update(ids)
    return np.asarray(out)


@needs_mooncake
def test_mooncake_hits_equal_the_hash_arithmetic(make_scenario) -> None:
    """One request at a time (a closed loop of one client over the trace, in order): with a cache
    that never evicts, every request's hit is what its hash ids give; with the real pool (a 70B
    replica on 4 H100s holds ~480k tokens) evictions make it lower."""
    n = 400
    sc = make_scenario(workload={"arrival": "closed", "concurrency": 1, "trace": str(MOONCAKE), "num_requests": n,
                                 "rate_rps": None, "warmup_s": 0.0})
    rt = build_runtime(sc)
    table = generate(sc.workload, 1, None).to_pandas()
    unbounded = dataclasses.replace(rt, plan=dataclasses.replace(rt.plan, num_blocks=10**9))
    req = run_table(sc, unbounded, table, 1, concurrency=1).requests.to_pandas()
    want = _arithmetic(n)
    assert want.sum() > 0.05 * req.prompt_tokens.sum()
    np.testing.assert_array_equal(req.cached_tokens.to_numpy(), want)
    bounded = run_table(sc, rt, table, 1, concurrency=1).requests.to_pandas()
    assert bounded.cached_tokens.sum() < 0.9 * want.sum()
    assert (bounded.prefill_cached_tokens + bounded.prefill_computed_tokens == bounded.prefill_tokens).all()


@needs_mooncake
def test_mooncake_open_loop_replay_against_the_arithmetic(make_scenario) -> None:
    """The trace's first 300 s (918 requests) open loop on one 8B replica, time stretched to 1 req/s,
    with a cache that never evicts: no request finds more than its hash ids allow, and in all
    almost exactly that (requests that share a prefix and arrive in one ~3 s timestamp step, or
    before the first one's prefill ended, compute it side by side, as in vLLM)."""
    sc = make_scenario(deployment={"model": "llama-3.1-8b", "tensor_parallel": 1}, rack={"num_gpus": 1},
                       workload={"arrival": "trace", "trace": str(MOONCAKE), "trace_end_s": 300.0, "rate_rps": 1.0,
                                 "duration_s": 1000.0})
    rt = build_runtime(sc)
    table = generate(sc.workload, 1, 1.0).to_pandas()
    unbounded = dataclasses.replace(rt, plan=dataclasses.replace(rt.plan, num_blocks=10**9))
    req = run_table(sc, unbounded, table, 1).requests.to_pandas()
    want = _arithmetic(len(req))
    got = req.cached_tokens.to_numpy()
    assert (got <= want).all() and got.sum() == pytest.approx(want.sum(), rel=0.01) and got.sum() < want.sum()


@needs_mooncake
def test_mooncake_replay_with_and_without_caching(make_scenario) -> None:
    """The trace's first 600 s at its own timing on four 8B replicas (each caches ~445k tokens in
    HBM): caching lowers TTFT; prefix-affinity routing finds more than least outstanding; both
    far less than the hash arithmetic allows (a cache that never evicts), because the trace's
    working set is many times the replicas' HBM."""  # measured: docs/MODEL.md, 'Prefix caching'

    base = {"rack": {"gpu": "h100-sxm", "num_gpus": 4}, "deployment": {"model": "llama-3.1-8b", "tensor_parallel": 1},
            "workload": {"arrival": "trace", "trace": str(MOONCAKE), "trace_end_s": 600.0, "rate_rps": None,
                         "duration_s": 600.0, "warmup_s": 0.0}}
    res = {}
    for name, dep in (("affinity", {"router": "prefix_affinity"}), ("least", {}), ("off", {"prefix_caching": False})):
        res[name] = simulate(make_scenario(**{**base, "deployment": {**base["deployment"], **dep}}), 1)
    s = {k: r.summary for k, r in res.items()}
    req = res["affinity"].requests
    bound = _arithmetic(len(req)).sum() / req.prompt_tokens.sum()
    assert all(s[k]["stable"] for k in s)
    assert 0 < s["least"]["cache_hit_rate"] < s["affinity"]["cache_hit_rate"] < 0.5 * bound
    # (affinity trades some balance for hits: its TTFT is not always below least outstanding's)
    assert max(s["affinity"]["ttft_s"]["mean"], s["least"]["ttft_s"]["mean"]) < s["off"]["ttft_s"]["mean"]
    assert s["affinity"]["prefill_tokens_saved"] + s["affinity"]["prefill_tokens_computed"] == req.prefill_tokens.sum()
    assert "cache_hit_rate" not in s["off"]


# ----------------------------------------------------------------------------- the bundled scenario

MOONCAKE_SCENARIO = ROOT / "experiments" / "scenarios" / "traces" / "mooncake-prefix-cache.toml"


@needs_mooncake
def test_bundled_mooncake_scenario_validates() -> None:
    from sim.scenario import load_scenario

    sc = load_scenario(MOONCAKE_SCENARIO, {"workload.trace_end_s": 60.0, "workload.duration_s": 60.0,
                                           "workload.warmup_s": 0.0})
    assert sc.deployment.prefix_caching and sc.deployment.router == "prefix_affinity"
    assert "unit_keys" in generate(sc.workload, 1, None).to_pandas()


def test_bundled_mooncake_scenario_without_the_trace_is_one_line(tmp_path, capsys) -> None:
    """Away from ../shared (a copy elsewhere: its relative trace path leads nowhere), one line, exit 2."""
    from helpers import one_line_error

    from experiments.cli import main

    copy = tmp_path / "mooncake-prefix-cache.toml"
    copy.write_text(MOONCAKE_SCENARIO.read_text())
    assert main(["validate", str(copy)]) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "trace file not found" in line and "conversation_trace.jsonl" in line


def test_readme_prefix_caching_example_validates(make_scenario) -> None:
    import re
    import tomllib

    text = (ROOT / "README.md").read_text()
    block = re.search(r"### Prefix caching and multi-turn conversations\n\n```toml\n(.*?)```", text, re.S)
    assert block is not None
    data = tomllib.loads(block.group(1))
    sc = make_scenario(rack={"num_gpus": 8}, **data)
    assert sc.workload.conversations is not None and sc.deployment.router == "prefix_affinity"


@pytest.mark.parametrize(("hashes", "ok"), [("[0, 1, 2]", True), ('["a", 1]', False), ("[0, true]", False),
                                             ("[1.5]", False), ('"0 1"', False)])
def test_mooncake_hash_ids_must_be_integers(tmp_path, hashes: str, ok: bool) -> None:
    from sim.traces import load_trace

    p = tmp_path / "t.jsonl"
    p.write_text('{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1, 2]}\n'
                 f'{{"timestamp": 10, "input_length": 1100, "output_length": 5, "hash_ids": {hashes}}}\n')
    if ok:
        assert load_trace(p).hash_ids.tolist() == ["0 1 2", "0 1 2"]
        return
    with pytest.raises(ConfigError, match=r"line 2: hash_ids=.* must be a list of integers") as err:
        load_trace(p)
    assert "\n" not in str(err.value)


def test_mooncake_units_from_hash_ids() -> None:
    """Spans of 512 tokens = 32 blocks; the partial last span keeps its full blocks; ids past the
    prompt are ignored; a prompt under one block has none; keys are chained (same id after a
    different parent: another key)."""
    from sim.traces import hash_units

    keys, blocks = hash_units(["7 8 9", "7 8 9 10", "7 8", "5 8", "3"], np.array([1100, 1030, 600, 1024, 10]), 16)
    assert [b.tolist() for b in blocks] == [[32, 32, 4], [32, 32, 0][:2], [32, 5], [32, 32], []]
    assert keys[0][:2].tolist() == keys[1].tolist() and keys[2][0] == keys[0][0] and keys[2][1] != keys[0][1]
    assert keys[3][1] != keys[0][1]  # id 8 after another parent


def test_run_prints_the_cache_figures(make_scenario) -> None:
    from experiments.commands.run import cache_line

    s = simulate(make_scenario(workload={"rate_rps": 2.0, "duration_s": 60.0, "conversations": CONV}), 1).summary
    line = cache_line(s)
    assert f"{s['cache_hit_rate']:.1%} of prompt tokens cached" in line and f"{s['prefill_tokens_saved']:,}" in line
    assert "none on a miss" in cache_line({**s, "ttft_miss_s": {"mean": float("nan")}})
