"""The engine's per-request helpers written as loops of C ints (what the compiled build runs fast)
against the plain formulas they replace, on random inputs: the same answers exactly."""

from __future__ import annotations

import bisect
import itertools
import struct
from types import SimpleNamespace

import numpy as np
import pytest

from models.memory import BLOCK_SIZE
from sim.joint import HEAP_ENTRY, HEAP_SHIFT, drop_entries
from sim.state import ReplicaState
from sim.step import new_blocks_first, prefill_sums
from sim.tables import ROW, STEP_COLUMNS, Requests, StepLog, row_waiting, with_waiting


def test_new_blocks_first_is_the_reversed_histogram_summed() -> None:
    rng = np.random.default_rng(1)
    for _ in range(300):
        hist = rng.integers(0, 50, BLOCK_SIZE).tolist()
        S = int(rng.integers(0, 10_000))
        s0 = (-S) % BLOCK_SIZE
        cnt = hist[s0::-1] + hist[:s0:-1]  # cnt[r] = hist[(-S - r) % B]
        assert new_blocks_first(hist, S) == list(itertools.accumulate(cnt, initial=0))


def test_prefill_sums_are_the_integer_sums() -> None:
    rng = np.random.default_rng(2)
    for n in [0, 2, 3, 7, 40] * 20:
        chunks = rng.integers(1, 9000, n).tolist()
        ctxs = rng.integers(0, 130_000, n).tolist()
        pairs = float(sum(c * x for c, x in zip(chunks, ctxs, strict=True))) + 0.5 * float(sum(c * (c + 1) for c in chunks))
        assert prefill_sums(chunks, ctxs) == (float(sum(chunks)), float(sum(ctxs)), pairs)
    with pytest.raises(ValueError, match="2 prefill chunks, 3 contexts"):
        prefill_sums([1, 2], [0, 0, 0])


def test_drop_entries_keeps_the_order_of_the_others() -> None:
    rng = np.random.default_rng(3)
    for _ in range(300):
        act = rng.permutation(500)[: int(rng.integers(1, 200))].tolist()
        gone = rng.permutation(act)[: int(rng.integers(0, min(9, len(act)) + 1))].tolist()
        want = [e for e in act if e not in set(gone)]
        drop_entries(act, gone)
        assert act == want


def test_completion_heap_keys_order_as_the_tuples() -> None:
    rng = np.random.default_rng(4)
    pairs = [(int(f), int(e)) for f, e in zip(rng.integers(0, 2**30, 2000), rng.integers(0, 2**31, 2000), strict=True)]
    keys = [(f << HEAP_SHIFT) | e for f, e in pairs]
    assert [(k >> HEAP_SHIFT, k & HEAP_ENTRY) for k in sorted(keys)] == sorted(pairs)


def test_outstanding_steps_on_as_bisection_would_find() -> None:
    """A piece's completions before now, counted by a cursor that only moves forward as the clock
    does, at times that repeat and land on completion times: `bisect_left`'s count every time."""
    rng = np.random.default_rng(5)
    for _ in range(50):
        gone_t = np.sort(rng.choice(np.arange(0.0, 50.0, 0.5), int(rng.integers(1, 60)))).tolist()
        counts = rng.integers(1, 4, len(gone_t)).tolist()
        rep = SimpleNamespace(n_running=100, waiting=[1, 2, 3], gone=list(zip(gone_t, counts, strict=True)),
                              gone_t=gone_t, gone_n=list(itertools.accumulate(counts, initial=0)), gone_i=0,
                              env=SimpleNamespace(_now=0.0))
        for now in np.sort(np.concatenate([rng.uniform(0, 60, 40), rng.choice(gone_t, 10)])).tolist():
            rep.env._now = now
            want = 103 - rep.gone_n[bisect.bisect_left(gone_t, now)]
            assert ReplicaState.outstanding(rep) == want  # type: ignore[arg-type]


def test_request_views_follow_the_columns_and_refuse_other_types() -> None:
    n = 5
    reqs = Requests(np.arange(n, dtype=np.float64), np.arange(10, 10 + n, dtype=np.int64),
                    np.full(n, 7, dtype=np.int64), np.zeros(n))
    assert [reqs.prompt_v[i] for i in range(n)] == list(range(10, 15)) and type(reqs.output_v[2]) is int
    reqs.generated[3] = 4
    reqs.preemptions[1] = 2
    assert reqs.generated_v[3] == 4 and reqs.preemptions_v[1] == 2  # (views of the same memory)
    reqs.set_draws(b"\x01\x02", np.array([0, 1, 2, 2, 2, 2], dtype=np.int64))
    assert reqs.lead_off_v[2] == 2
    with pytest.raises(ValueError, match="flat int64"):
        Requests(np.zeros(2), np.array([1.0, 2.0]), np.ones(2, dtype=np.int64), np.zeros(2))


def test_step_log_refuses_a_row_of_the_wrong_length() -> None:
    log = StepLog(8)
    log.append(tuple(range(len(STEP_COLUMNS) + 1)))
    with pytest.raises(struct.error):
        log.table()


def test_a_packed_rows_waiting_count_is_replaced_alone() -> None:
    """`with_waiting` changes a packed step row's waiting column and nothing else (the planners
    add a closed loop's sends to the last row, or read the queue at a run's end, through it)."""
    rng = np.random.default_rng(3)
    w = STEP_COLUMNS.index("waiting")
    for _ in range(20):
        row = rng.uniform(-1e6, 1e6, len(STEP_COLUMNS)).tolist()
        packed = ROW.pack(*row)
        assert row_waiting(packed) == row[w]
        got = ROW.unpack(with_waiting(packed, 7))
        assert got[w] == 7.0 and got[:w] == tuple(row[:w]) and got[w + 1:] == tuple(row[w + 1:])


@pytest.mark.parametrize("spec", [
    {"method": "tree", "tree_drafter": "eagle3", "num_speculative_tokens": 4, "tree_branching": [2, 2, 1, 1]},
    {"method": "tree", "num_speculative_tokens": 3, "tree_branching": [3, 1, 1]},
    {"method": "draft_model", "draft_model": "llama-3.2-1b", "num_speculative_tokens": 4,
     "acceptance_profile": [1.0, 0.9, 0.7, 0.5]},  # (a depth profile: a chain priced by `shape_step`)
])
def test_a_shaped_steps_cached_terms_price_it_as_pass_by_pass(spec: dict[str, object]) -> None:
    """`StepPricer.shape_step` from its terms cached per batch and k (`ShapeParts`) gives the
    figures of pricing each pass with `CostModel.pass_sums` (`_shape_step`) bit for bit, with
    speculation on and off, at any context."""
    from sim.deployment import build_runtime
    from sim.pricing import StepPricer
    from sim.scenario import scenario_from_dict

    rt = build_runtime(scenario_from_dict({
        "rack": {"gpu": "h100-sxm", "num_gpus": 4}, "deployment": {"model": "llama-3.1-70b", "tensor_parallel": 4},
        "workload": {"rate_rps": 1.0, "duration_s": 60.0, "warmup_s": 0.0}, "speculative": spec}))
    assert rt.spec is not None and rt.spec.shape is not None
    rng = np.random.default_rng(4)
    for speculating in (True, False):
        price = StepPricer(rt, 0)
        price.speculating = speculating
        for _ in range(200):
            n, k = int(rng.integers(1, 257)), int(rng.integers(1, rt.spec.k + 1))
            ctx = float(rng.integers(n, 4000 * n))
            assert price.shape_step(n, ctx, k) == price._shape_step(n, ctx, k)
            assert price.shape_step(n, ctx, k) == price._shape_step(n, ctx, k)  # (the second from the cache)
