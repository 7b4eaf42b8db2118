"""KV offload to host memory (issue 40, part 3): the host tier behind a replica's prefix cache, by
hand (the cache's two LRU lists, the engine's load and its price), against the hash arithmetic of a
synthetic trace, its errors, and the Mooncake trace replayed with and without a tier."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from models.catalog import GIB, get_gpu
from models.memory import BLOCK_SIZE
from sim.deployment import build_runtime, check_scenario
from sim.prefix_cache import PrefixCache
from sim.run import run_table
from sim.workload import generate
from specrack import simulate

ROOT = Path(__file__).resolve().parents[1]
MOONCAKE = ROOT.parent / "shared" / "data" / "traces" / "mooncake" / "conversation_trace.jsonl"
needs_mooncake = pytest.mark.skipif(not MOONCAKE.is_file(), reason="the Mooncake trace is not in ../shared/data/traces")

# llama-3.1-70b (80 layers, 8 KV heads of 128) in bf16 over TP4: K and V of 2 heads per GPU per layer
KV_BYTES_PER_TOKEN_GPU = 80 * 2 * (8 // 4) * 128 * 2
BLOCK_BYTES_GPU = KV_BYTES_PER_TOKEN_GPU * BLOCK_SIZE  # 1,310,720
H100_HOST_LINK = 50e9  # PCIe Gen5 x16, one direction, achieved (models/catalog.py)


def _table(rows: list[tuple[float, int, int, list[int]]]) -> pd.DataFrame:
    """A request table whose requests carry one-block units: (arrival_s, prompt, output, keys)."""
    n = len(rows)
    return pd.DataFrame({
        "id": np.arange(n), "arrival_s": [r[0] for r in rows], "prompt_tokens": [r[1] for r in rows],
        "output_tokens": [r[2] for r in rows], "cls": np.zeros(n, dtype=np.int64), "accept_q": np.full(n, 0.5),
        "unit_keys": pd.Series([np.asarray(r[3], dtype=np.int64) for r in rows], dtype=object),
        "unit_blocks": pd.Series([np.ones(len(r[3]), dtype=np.int64) for r in rows], dtype=object)})


def _sized(rt, blocks: int, host_blocks: int | None = None):
    """The runtime with a KV pool of `blocks` (and a host tier of `host_blocks`, when given)."""
    rt = dataclasses.replace(rt, plan=dataclasses.replace(rt.plan, num_blocks=blocks),
                             max_model_len=min(rt.max_model_len, blocks * BLOCK_SIZE))
    return rt if host_blocks is None else dataclasses.replace(rt, host_kv_blocks=host_blocks)


# ----------------------------------------------------------------------------- the runtime and the cache


def test_runtime_sizes_the_tier_and_its_load_by_hand(make_scenario) -> None:
    """1 GiB on a 70B TP4 replica: 2^30 / (4 x 1,310,720 bytes a block) = 204 blocks; a block loads
    in 1,310,720 / 50e9 s (each GPU its share over its own PCIe Gen5 x16 link)."""
    rt = build_runtime(make_scenario(deployment={"host_kv_gib": 1.0}))
    assert rt.plan.kv_bytes_per_token == KV_BYTES_PER_TOKEN_GPU
    assert rt.host_kv_blocks == GIB // (4 * BLOCK_BYTES_GPU) == 204
    assert rt.host_load_s_per_block == BLOCK_BYTES_GPU / H100_HOST_LINK
    none = build_runtime(make_scenario())
    assert none.host_kv_blocks == 0 and none.host_load_s_per_block == 0.0


def test_host_tier_keeps_what_hbm_evicts_in_its_own_lru() -> None:
    c = PrefixCache(host_blocks=3)
    a = np.array([1, 2, 3])
    c.insert(a, np.array([1, 1, 1]))
    c.release(a)  # LRU, tail first: 3, 2, 1
    c.reclaim(free_blocks=1)  # two blocks taken beyond the truly free ones: 3 then 2 go to the host tier
    assert list(c.lru) == [1] and list(c.host) == [3, 2] and c.host_used == 2
    assert c.match(np.array([1, 2, 3])) == 1 and c.match_host(np.array([2, 3, 9])) == 2
    c.store(7, 2)  # a 2-block unit: the tier's least recent (3) goes to make room
    assert list(c.host) == [2, 7] and c.host_evicted_units == 1 and c.host_evicted_blocks == 1
    c.store(8, 4)  # larger than the whole tier: never stored, nothing dropped
    assert 8 not in c.host and c.host_evicted_units == 1
    assert c.load(np.array([2])) == 1  # back in HBM, referenced; its host copy stays, now the most recent
    assert c.ref[2] == 1 and c.nb[2] == 1 and list(c.host) == [7, 2]
    c.release(np.array([2]))
    c.reclaim(free_blocks=0)  # 1 then 2 evicted (LRU order): 1 drops 7 to fit; 2 is already there (only touched)
    assert list(c.host) == [1, 2] and c.host_used == 2 and c.host_evicted_blocks == 3


# ----------------------------------------------------------------------------- the engine by hand


def _evicting_trace() -> pd.DataFrame:
    """A (70 tokens: 4 full blocks + 1 partial) then C (300 tokens: 18 full + 1 partial) then D,
    A's prompt again, one at a time (each finishes at its prefill). In a 20-block pool C needs 19
    blocks of the 16 truly free, so A's three tail units go (a4, a3, a2: to the host tier, if any)."""
    a = [11, 12, 13, 14]
    return _table([(0.0, 70, 1, a), (1.0, 300, 1, list(range(31, 49))), (2.0, 70, 1, a)])


def test_evicted_prefix_loads_back_and_its_step_waits_for_it(make_scenario) -> None:
    """D finds a1 in HBM and a2-a4 in the host tier: it loads 3 blocks and computes its last 6
    tokens. Its step costs the 6-token prefill over the 64 cached ones, plus 3 blocks over PCIe;
    without a tier D computes 54 tokens."""
    sc = make_scenario(sim={"drain_s": 100.0}, deployment={"host_kv_gib": 1.0})
    rt = _sized(build_runtime(sc), 20)
    out = run_table(sc, rt, _evicting_trace(), 1)
    req, steps = out.requests.to_pandas(), out.steps.to_pandas()
    assert req.cached_tokens.tolist() == [0, 0, 64] and req.host_cached_tokens.tolist() == [0, 0, 48]
    assert req.prefill_computed_tokens.tolist() == [70, 300, 6]
    load_s = 3 * BLOCK_BYTES_GPU / H100_HOST_LINK  # 61.44 us
    pairs = 6 * 64 + 6 * 7 / 2.0
    assert steps.prefill_tokens.tolist() == [70.0, 300.0, 6.0]
    assert steps.duration_s.iloc[2] == rt.cost.step_sums(1, 6.0, 64.0, pairs).total_s + load_s
    # D's TTFT: the frontend, then that one step (the replica is idle when D arrives)
    frontend = rt.cost.eff.frontend_s
    assert steps.start_s.iloc[2] == 2.0 + frontend
    assert req.first_token_s.iloc[2] - req.arrival_s.iloc[2] == pytest.approx(
        frontend + rt.cost.step_sums(1, 6.0, 64.0, pairs).total_s + load_s, rel=1e-12)
    assert out.host_evicted_blocks == 0
    # without a tier: a1 only, 54 tokens computed, no load
    base = make_scenario(sim={"drain_s": 100.0})
    off = run_table(base, _sized(build_runtime(base), 20), _evicting_trace(), 1)
    assert off.requests.to_pandas().cached_tokens.tolist() == [0, 0, 16] and "host_cached_tokens" not in off.requests.to_pandas()
    assert off.steps.to_pandas().prefill_tokens.tolist() == [70.0, 300.0, 54.0] and off.host_evicted_blocks is None


def test_a_small_tier_drops_its_least_recent_units(make_scenario) -> None:
    """The same trace with a 2-block tier: a4 goes in first and is dropped for a2, so D loads a2
    and a3 and computes a4's block and the partial one (22 tokens)."""
    sc = make_scenario(sim={"drain_s": 100.0}, deployment={"host_kv_gib": 1.0})
    out = run_table(sc, _sized(build_runtime(sc), 20, host_blocks=2), _evicting_trace(), 1)
    assert out.requests.to_pandas().host_cached_tokens.tolist() == [0, 0, 32]
    assert out.requests.to_pandas().prefill_computed_tokens.tolist() == [70, 300, 22]
    # a4 dropped while C ran (1); D then takes 5 blocks (a1's, 2 loaded, 2 for its 22 tokens) of the
    # 20 free, 18 of them C's cached units: 3 go, tail first (c18, c17, c16), each into the full
    # tier, which drops a2, a3 (loaded, still its least recent) and then c18: 4 blocks in all
    assert out.host_evicted_blocks == 4 and list(out.requests.to_pandas().prefill_tokens) == [70, 300, 70]


def test_a_tier_never_written_changes_nothing(make_scenario) -> None:
    """A pool that never evicts: the run with a tier is the run without one, step for step."""
    rows = [(float(i), 70 + 16 * (i % 3), 5, [1, 2, 3, 4 + i % 2]) for i in range(8)]
    base = make_scenario(sim={"drain_s": 100.0})
    tier = make_scenario(sim={"drain_s": 100.0}, deployment={"host_kv_gib": 64.0})
    a = run_table(base, build_runtime(base), _table(rows), 1)
    b = run_table(tier, build_runtime(tier), _table(rows), 1)
    pd.testing.assert_frame_equal(a.steps.to_pandas(), b.steps.to_pandas(), check_exact=True)
    pd.testing.assert_frame_equal(a.requests.to_pandas(), b.requests.to_pandas().drop(columns="host_cached_tokens"), check_exact=True)
    assert (b.requests.to_pandas().host_cached_tokens == 0).all() and b.host_evicted_blocks == 0


def test_fused_runs_with_a_tier_are_the_unfused_engine(make_scenario) -> None:
    """Conversations in a small KV pool (gpu_memory_utilization 0.5: ~37k tokens), so HBM evicts
    into the tier and turns load back from it: the fused engine (which admits nothing while a cache
    is in use, so every load is the ordinary step's) gives the unfused engine's tables bit for bit,
    and the same seed the same run."""
    conv = {"turns": 4, "turn_gap_s": {"dist": "exponential", "mean": 20.0}}
    data = {"deployment": {"host_kv_gib": 64.0, "gpu_memory_utilization": 0.5},
            "workload": {"rate_rps": 4.0, "duration_s": 60.0, "warmup_s": 0.0, "conversations": conv}}
    fused = simulate(make_scenario(**data), 1)
    unfused = simulate(make_scenario(**data, sim={"fuse_steps": False}), 1)
    again = simulate(make_scenario(**data), 1)
    req = fused.requests
    assert req.host_cached_tokens.sum() > 0 and fused.summary["cache_host_hit_rate"] > 0
    pd.testing.assert_frame_equal(fused.requests, unfused.requests, check_exact=True)
    pd.testing.assert_frame_equal(fused.requests, again.requests, check_exact=True)
    pd.testing.assert_frame_equal(fused.steps, again.steps, check_exact=True)
    # the fused run's step rows may stand for several steps: compare the clock and the work
    for col in ("prefill_tokens", "emitted_tokens"):
        assert fused.steps[col].sum() == unfused.steps[col].sum()
    assert fused.steps.duration_s.sum() == pytest.approx(unfused.steps.duration_s.sum(), rel=1e-12)


# ----------------------------------------------------------------------------- against the hash arithmetic


def _chains(n: int, seed: int) -> list[tuple[float, int, int, list[int]]]:
    """n requests, 2 s apart (each finishes long before the next: no admission-order effects), whose
    units are chain hashes of a shared system prompt (4 blocks), one of 6 documents (8-24 blocks)
    and a private question (1-6 blocks); prompts end in a partial block (16 m + 5 tokens), so a hit
    is never capped by the last token."""
    rng = np.random.default_rng(seed)
    docs = [list(range(1000 * (d + 1), 1000 * (d + 1) + int(rng.integers(8, 25)))) for d in range(6)]
    rows = []
    for i in range(n):
        d = int(rng.zipf(1.5)) % 6
        keys = [1, 2, 3, 4] + docs[d] + [10**6 + 100 * i + q for q in range(int(rng.integers(1, 7)))]
        rows.append((2.0 * i, BLOCK_SIZE * len(keys) + 5, 1, keys))
    return rows


def _bound(rows: list[tuple[float, int, int, list[int]]]) -> np.ndarray:
    """Per request, the prompt tokens whose block hash appeared earlier in the trace (16 each)."""
    seen: set[int] = set()
    out = []
    for _, _, _, keys in rows:
        out.append(BLOCK_SIZE * sum(k in seen for k in keys))
        seen.update(keys)
    return np.asarray(out)


@pytest.mark.parametrize("host_blocks", [0, 40, 10**6])
def test_hits_never_exceed_the_hash_arithmetic_and_an_unlimited_tier_reaches_it(make_scenario, host_blocks) -> None:
    """HBM (a 40-block pool, about one long request) + host hits <= the arithmetic bound, request by
    request; with a tier that never fills, every block seen before is in one tier or the other, so
    the hit is the bound exactly (one request at a time: nothing is computed side by side)."""
    rows = _chains(60, 3)
    want = _bound(rows)
    sc = make_scenario(sim={"drain_s": 100.0}, deployment={"host_kv_gib": 1.0})
    out = run_table(sc, _sized(build_runtime(sc), 40, host_blocks), _table(rows), 1)
    req = out.requests.to_pandas()
    got = req.cached_tokens.to_numpy()
    host = req.host_cached_tokens.to_numpy() if host_blocks else np.zeros_like(got)  # (no tier: no column)
    assert (got <= want).all() and (host <= got).all()
    assert (req.cached_tokens + req.prefill_computed_tokens == req.prompt_tokens).all()
    if host_blocks == 0:  # no tier: HBM alone falls short of the bound
        assert got.sum() < 0.8 * want.sum() and host.sum() == 0
    if host_blocks == 40:  # a tier as large as HBM: some hits from it, still short of the bound
        assert host.sum() > 0 and got.sum() < want.sum()
    if host_blocks == 10**6:
        np.testing.assert_array_equal(got, want)
        assert host.sum() > 0.3 * got.sum() and out.host_evicted_blocks == 0


# ----------------------------------------------------------------------------- errors


def _check_error(make_scenario, **dep) -> str:
    with pytest.raises(ValueError) as err:
        check_scenario(make_scenario(deployment=dep))
    return str(err.value)


def test_a_tier_larger_than_the_replicas_host_memory_is_an_error(make_scenario) -> None:
    limit = get_gpu("h100-sxm").host_mem_gib * 4  # 256 GiB per H100 (DGX H100: 2 TiB for 8) x TP4
    assert limit == 1024
    msg = _check_error(make_scenario, host_kv_gib=limit + 1)
    assert "deployment.host_kv_gib=1025" in msg and "1024 GiB" in msg and "\n" not in msg
    check_scenario(make_scenario(deployment={"host_kv_gib": limit}))  # the whole share is allowed


def test_a_tier_without_prefix_caching_is_an_error(make_scenario) -> None:
    msg = _check_error(make_scenario, host_kv_gib=64.0, prefix_caching=False)
    assert "deployment.host_kv_gib" in msg and "prefix_caching = true" in msg


def test_a_tier_smaller_than_a_block_is_an_error(make_scenario) -> None:
    msg = _check_error(make_scenario, host_kv_gib=0.001)
    assert "deployment.host_kv_gib=0.001" in msg and "holds no KV block" in msg


def test_a_negative_tier_names_the_field(make_scenario) -> None:
    with pytest.raises(Exception) as err:
        make_scenario(deployment={"host_kv_gib": -1.0})
    assert "host_kv_gib" in str(err.value) and "greater than or equal to 0" in str(err.value)


# ----------------------------------------------------------------------------- the Mooncake trace


def _arithmetic(n: int) -> np.ndarray:
    """The trace's first n requests: prompt tokens whose 512-token hash block appeared earlier
    (the whole span's full 16-token blocks), leaving one token to compute (tests/test_prefix_cache.py)."""
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
            while tokens > (length - 1) // BLOCK_SIZE * BLOCK_SIZE:
                tokens -= spans.pop()
            out.append(tokens)
            seen.update(ids)
    return np.asarray(out)


@needs_mooncake
def test_mooncake_one_at_a_time_with_a_host_tier(make_scenario) -> None:
    """The trace's first 1000 requests one at a time on a 70B TP4 replica (HBM: ~480k tokens). HBM
    holds the same units with or without a tier (a unit enters it computed or loaded, in the same
    order), so each request's HBM hit is the tier-less run's, and the tier adds to it: more with a
    larger tier, all of the hash arithmetic with an unlimited one. Measured (seed 1): docs/MODEL.md,
    'Prefix caching'."""
    n = 1000
    want = _arithmetic(n)
    hits = {}
    for gib in (0.0, 256.0, 512.0, None):  # None: unlimited
        sc = make_scenario(workload={"arrival": "closed", "concurrency": 1, "trace": str(MOONCAKE), "num_requests": n,
                                     "rate_rps": None, "warmup_s": 0.0}, deployment={"host_kv_gib": 1.0 if gib is None else gib})
        rt = build_runtime(sc)
        if gib is None:
            rt = dataclasses.replace(rt, host_kv_blocks=10**9)
        req = run_table(sc, rt, generate(sc.workload, 1, None).to_pandas(), 1, concurrency=1).requests.to_pandas()
        got = req.cached_tokens.to_numpy()
        hits[gib] = (got, req.host_cached_tokens.to_numpy() if gib != 0.0 else np.zeros_like(got))
    for got, host in hits.values():
        assert (got <= want).all() and (host <= got).all()
        np.testing.assert_array_equal(got - host, hits[0.0][0])
    total = {gib: int(got.sum()) for gib, (got, _) in hits.items()}
    assert total[0.0] < total[256.0] < total[512.0] < total[None] and total[512.0] < 0.5 * want.sum()
    np.testing.assert_array_equal(hits[None][0], want)
