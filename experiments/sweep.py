"""Sweeps as data: a base scenario, variants (overrides), load points and seeds.

Every point is a pure run `(scenario, seed) -> summary row`. The load axis is either
`utilisation` (open loop) or `concurrency` (closed loop), exactly one of them per sweep file.
Utilisation is anchored to the reference variant's deployment (speculation off): `utilisation = u`
offers u x that capacity to every variant, so all variants at a point see the same request sample
(common random numbers). `concurrency = N` runs every variant as N closed-loop clients
(`arrival = "closed"`, as `vllm bench serve --max-concurrency N`) over the same request sequence;
such a sweep measures no capacity (its own rows are the throughput-vs-clients curve).
Each finished point is written atomically to `out/points/` as it completes, keyed by its scenario
content and seed: an interrupted sweep loses only the points in flight, and a re-run skips them.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import json
import math
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from experiments.pool import Progress, die_with_parent, write_atomic
from models.errors import ConfigError
from sim.capacity import Capacity, CapacityStore, baseline_of, capacity_key
from sim.metrics import against_capacity, relaxation_s
from sim.scenario import Scenario, load_scenario, read_toml
from sim.simulate import capacity, capacity_for, flatten, simulate
from sim.summary import TIME_VARYING_NOTE

KEY_PARAMS = {
    "model": ("deployment", "model"), "weights": ("deployment", "weights"), "kv_cache": ("deployment", "kv_cache"),
    "tensor_parallel": ("deployment", "tensor_parallel"), "gpu": ("rack", "gpu"), "num_gpus": ("rack", "num_gpus"),
    "distilled_from": ("deployment", "distilled_from"),
}


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: dict[str, Any]


@dataclass(frozen=True)
class SweepSpec:
    name: str
    base: Scenario
    utilisation: tuple[float, ...]  # empty in a concurrency sweep
    seeds: tuple[int, ...]
    variants: tuple[Variant, ...]
    reference: str
    concurrency: tuple[int, ...] = ()  # closed-loop clients per point (a concurrency sweep)
    # (variant, its own reference): extra paired speedups in the report, e.g. a drafted model
    # against the same model undrafted when the sweep holds several models (experiments.pairs)
    pairs: tuple[tuple[str, str], ...] = ()

    @property
    def axis(self) -> str:
        """The load axis: "utilisation" or "concurrency" (the column of rows and speedups)."""
        return "concurrency" if self.concurrency else "utilisation"

    @property
    def points(self) -> tuple[float, ...] | tuple[int, ...]:
        return self.concurrency or self.utilisation


def closed_overrides(n: int) -> dict[str, Any]:
    """A scenario's workload as `n` closed-loop clients (its lengths, trace and think time kept)."""
    return {"workload.arrival": "closed", "workload.concurrency": n, "workload.utilisation": None,
            "workload.rate_rps": None, "workload.max_concurrency": None}


def default_sweep_path() -> Path:
    return Path(str(resources.files("experiments") / "sweeps" / "default.toml"))


def _numbers(p: Path, field: str, value: Any, *, integer: bool) -> tuple[Any, ...]:
    """A non-empty list of distinct numbers (integers >= 0 for seeds, 0 < u <= 5 for utilisation)."""
    kind = "non-negative integers, e.g. [1, 2, 3]" if integer else "numbers in (0, 5], e.g. [0.3, 0.6, 0.9]"
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{p.name}: {field} must be a non-empty list of {kind}, got {value!r}")
    for x in value:
        ok = not isinstance(x, bool) and (
            (isinstance(x, int) and x >= 0) if integer else
            (isinstance(x, int | float) and math.isfinite(x) and 0 < x <= 5))
        if not ok:
            raise ConfigError(f"{p.name}: {field} must be a list of {kind}; {x!r} is not")
    dups = sorted({x for x in value if value.count(x) > 1})
    if dups:
        raise ConfigError(f"{p.name}: {field} lists {', '.join(map(str, dups))} more than once; duplicate points "
                          "would count twice in every mean and confidence interval, remove them")
    return tuple(int(x) if integer else float(x) for x in value)


def _clients(p: Path, field: str, value: Any) -> tuple[int, ...]:
    """A non-empty list of distinct client counts (integers >= 1)."""
    kind = "integers >= 1 (closed-loop clients), e.g. [1, 4, 16, 64]"
    if not isinstance(value, list) or not value:
        raise ConfigError(f"{p.name}: {field} must be a non-empty list of {kind}, got {value!r}")
    for x in value:
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ConfigError(f"{p.name}: {field} must be a list of {kind}; {x!r} is not")
    _numbers(p, field, value, integer=True)  # duplicates
    return tuple(int(x) for x in value)


def _table(p: Path, field: str, value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{p.name}: {field} must be a table of overrides such as "
                          f'{{ "deployment.weights" = "fp8" }}, got {value!r}')
    return dict(value)


def parse_variant(item: Any, where: str) -> Variant:
    """One `{name = ..., set = {...}}` table as a Variant (sweep variants and plan strategies alike),
    with a one-line ConfigError naming `where` (e.g. `variants[2]`) for any other shape."""
    import difflib

    if not isinstance(item, dict) or "name" not in item:
        raise ConfigError(f"{where}: needs a name (a table with name and optionally set = {{...}}), got {item!r}")
    for key in item:
        if key not in ("name", "set"):
            near = difflib.get_close_matches(str(key), ("name", "set"), n=1, cutoff=0.6)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            raise ConfigError(f"{where}: unknown field '{key}'{hint} (allowed: name, set)")
    name = item["name"]
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{where}.name: must be a non-empty string, got {name!r}")
    over = item.get("set", {})
    if not isinstance(over, dict):
        raise ConfigError(f"{where}.set: must be a table of dotted overrides, e.g. "
                          f'set = {{ "deployment.weights" = "fp8" }}, got {over!r}')
    return Variant(name, dict(over))


def check_distinct(variants: list[Variant], what: str) -> None:
    names = [v.name for v in variants]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"{what}: the name(s) {dup} appear twice; names must be distinct")


def parse_variants(p: Path, items: Any, what: str = "variants") -> list[Variant]:
    """`[[variants]]` tables (name, set) as Variants, with one-line errors for any other shape."""
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{p.name}: {what} must be a non-empty list of [[{what}]] tables with a name "
                          "(and optionally set = {...}), got " + repr(items))
    try:
        out = [parse_variant(v, f"{what}[{i}]") for i, v in enumerate(items)]
        check_distinct(out, what)
    except ConfigError as err:
        raise ConfigError(f"{p.name}: {err}") from None
    return out


def load_sweep(path: str | Path | None = None, quick: bool = False) -> SweepSpec:
    """Read a sweep file (the built-in default when None); `quick` applies its [quick] table."""
    p = Path(path) if path else default_sweep_path()
    d = read_toml(p, "sweep")
    for field in ("base", "variants"):
        if field not in d:
            raise ConfigError(f"{p.name}: missing '{field}' (see experiments/sweeps/default.toml)")
    extra = set(d) - {"name", "base", "utilisation", "concurrency", "seeds", "variants", "reference", "quick", "set",
                      "pairs"}
    if extra:
        raise ConfigError(f"{p.name}: unknown field(s) {sorted(extra)}")
    if ("utilisation" in d) == ("concurrency" in d):
        raise ConfigError(f"{p.name}: give exactly one load axis, utilisation = [...] (open loop) or concurrency = "
                          "[...] (closed-loop clients)" + (", not both" if "utilisation" in d else ""))
    axis = "concurrency" if "concurrency" in d else "utilisation"
    for field in ("name", "base", "reference"):
        if field in d and (not isinstance(d[field], str) or not d[field].strip()):
            raise ConfigError(f"{p.name}: {field} must be a non-empty string, got {d[field]!r}")
    loads = d[axis]
    seeds = d.get("seeds", [1])
    base_set = _table(p, "set", d.get("set", {}))
    q = d.get("quick", {})  # checked whether or not --quick applies it
    if not isinstance(q, dict):
        raise ConfigError(f"{p.name}: quick must be a table ({axis}, seeds, set), got {q!r}")
    extra_q = set(q) - {axis, "seeds", "set"}
    if extra_q:
        raise ConfigError(f"{p.name}: quick: unknown field(s) {sorted(extra_q)} (allowed: {axis}, seeds, set)")
    if quick:
        loads = q.get(axis, loads)
        seeds = q.get("seeds", seeds)
        base_set.update(_table(p, "quick.set", q.get("set", {})))
    utils_t = _numbers(p, "utilisation", loads, integer=False) if axis == "utilisation" else ()
    clients_t = _clients(p, "concurrency", loads) if axis == "concurrency" else ()
    seeds_t = _numbers(p, "seeds", seeds, integer=True)
    variants = parse_variants(p, d["variants"])
    names = [v.name for v in variants]
    ref = d.get("reference", names[0])
    if ref not in names:
        raise ConfigError(f"{p.name}: reference '{ref}' is not a variant (have: {', '.join(names)})")
    pairs = _pairs(p, d.get("pairs", []), names)
    load_keys = ("workload.utilisation", "workload.rate_rps", "workload.concurrency", "workload.arrival")
    how = ("utilisation list (relative to the reference variant's capacity)" if axis == "utilisation"
           else "concurrency list (closed-loop clients)")
    for where, over in (("set", base_set), *((f"variant '{v.name}': set", v.overrides) for v in variants)):
        wl_over = over.get("workload")
        given = [k for k in load_keys if k in over or (isinstance(wl_over, dict) and k.split(".")[1] in wl_over)]
        if given and (axis == "concurrency" or given[0] in load_keys[:2]):
            raise ConfigError(f"{p.name}: {where}: {given[0]} would be ignored, the sweep sets the load from its "
                              f"{how}; remove it")
    base_path = (p.parent / d["base"]).resolve()
    try:
        base = load_scenario(base_path, base_set or None)
    except ConfigError as err:
        if not base_set:
            raise
        try:  # the base alone: its own errors name it, the set table's name the sweep file
            load_scenario(base_path)
        except ConfigError:
            raise err from None
        where = "set" + (" (with quick.set)" if quick and q.get("set") else "")
        raise ConfigError(f"{p.name}: {where}: {str(err).removeprefix(base_path.name + ': ')}") from None
    for v in variants:  # validate every variant now: one-line errors before any run
        try:
            sc_v = base.with_overrides(v.overrides)
            if clients_t:
                sc_v.with_overrides(closed_overrides(clients_t[0]))
        except ConfigError as err:
            raise ConfigError(f"{p.name}: variant '{v.name}': {err}") from None
        if utils_t:  # each point offers rate_rps = utilisation x the reference's capacity
            if sc_v.workload.closed:
                raise ConfigError(f"{p.name}: variant '{v.name}' is a closed loop (arrival = 'closed'), which sets its "
                                  "own rate; a utilisation sweep offers rates: use concurrency = [...] (clients) "
                                  "instead, or an open-loop base")
            try:
                sc_v.with_overrides({"workload.rate_rps": 1.0})
            except ConfigError as err:
                raise ConfigError(f"{p.name}: variant '{v.name}': the utilisation axis offers each point a rate "
                                  f"(workload.rate_rps), which it refuses: {err}") from None
    return SweepSpec(d.get("name", p.stem), base, utils_t, seeds_t, tuple(variants), ref, clients_t, pairs)


def _pairs(p: Path, value: Any, names: list[str]) -> tuple[tuple[str, str], ...]:
    """`pairs = [["variant", "its reference"], ...]`: both names must be variants, and distinct."""
    if not isinstance(value, list):
        raise ConfigError(f'{p.name}: pairs must be a list of [variant, reference] pairs, e.g. [["moe+draft", "moe"]], '
                          f"got {value!r}")
    out = []
    for i, pair in enumerate(value):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)) or pair[0] == pair[1]:
            raise ConfigError(f"{p.name}: pairs[{i}] must be [variant, reference] (two different variant names), got {pair!r}")
        for x in pair:
            if x not in names:
                raise ConfigError(f"{p.name}: pairs[{i}]: '{x}' is not a variant (have: {', '.join(names)})")
        out.append((pair[0], pair[1]))
    return tuple(out)


def curve_rows(cap: dict[str, Any]) -> list[Any]:
    """The capacity curve rows of a variant's capacity figures (none for concurrency sweeps)."""
    curve = cap.get("curve", [])
    return list(curve) if isinstance(curve, (list, tuple)) else []


def run_point(task: dict[str, Any]) -> dict[str, Any]:
    """One point, in a worker: never raises; a failure comes back as a row with `error`."""
    row = {"variant": task["variant"], "utilisation": task.get("utilisation"), "concurrency": task.get("concurrency"),
           "seed": task["seed"], "point_key": task["key"]}
    try:
        sc = Scenario.model_validate(task["scenario"])
        res = simulate(sc, task["seed"], capacity=task.get("capacity"))
        row.update(flatten(res.summary))
        for col, (sec, field) in KEY_PARAMS.items():
            row[col] = getattr(getattr(sc, sec), field)
        row["speculative_method"] = sc.speculative.method if sc.speculative else "none"
        row["speculative_policy"] = sc.speculative.policy if sc.speculative else "none"
        row["num_speculative_tokens"] = sc.speculative.num_speculative_tokens if sc.speculative else 0
        row["run_warmup_s"] = sc.workload.warmup_s
        row["run_window_s"] = sc.workload.duration_s - sc.workload.warmup_s
        row["error"] = ""
    except Exception as err:  # a failed point is reported, never fatal to the sweep
        row["error"] = f"{type(err).__name__}: {err}"
    return row


def _own_capacity(sc: Scenario, cache: str | None = None) -> Capacity:
    """The deployment's own capacity (speculation as configured), read from or kept in the on-disk
    capacity cache `cache` (`sim.capacity.CapacityStore`) when given."""
    return capacity(sc, speculative=True, store=CapacityStore(cache) if cache else None)


def plan_points(spec: SweepSpec, jobs: int | None = 1, pool: cf.Executor | None = None,
                cache: str | Path | None = None) -> tuple[list[dict[str, Any]], dict[str, dict[str, Any]]]:
    """All (variant, utilisation, seed) tasks, and each variant's own capacity (peak sustainable
    rate, full-batch throughput, peak and the closed-loop curve behind them). Each distinct
    deployment is measured once (the reference and the baseline variant are one), in parallel
    processes when `jobs` allows, or in `pool` (then the capacities other than the reference's,
    which the tasks' rates need, come back as futures in caps["_pending"], measured while the
    tasks run: `finish_caps`). A concurrency sweep measures no capacity (empty figures). `cache`: a
    capacity cache folder (`sim.capacity.default_cache_dir`), so a sweep run again measures none."""
    folder = None if cache is None else str(cache)
    if spec.concurrency:
        scs = [spec.base.with_overrides(v.overrides) for v in spec.variants]
        tasks: list[Any] = []
        store = CapacityStore()  # (a follow-load policy's reference, measured once per deployment)
        for v, sc_v in zip(spec.variants, scs, strict=True):
            for n in spec.concurrency:
                sc = sc_v.with_overrides(closed_overrides(n))
                run_cap = capacity_for(sc, store=store)
                tasks.extend({"variant": v.name, "utilisation": None, "concurrency": n, "seed": seed,
                              "key": f"{sc.key()}-{seed}", "scenario": sc.model_dump(mode="json"), "capacity": run_cap}
                             for seed in spec.seeds)
        return tasks, {}
    by_name = {v.name: v for v in spec.variants}
    ref_sc = spec.base.with_overrides(by_name[spec.reference].overrides)
    scs = [spec.base.with_overrides(v.overrides) for v in spec.variants]
    ref_key = capacity_key(ref_sc)
    keys = [capacity_key(sc, speculative=True) for sc in scs]
    todo = {ref_key: baseline_of(ref_sc)}  # the reference first: the tasks' rates need it
    for k, sc in zip(keys, scs, strict=True):
        todo.setdefault(k, sc)
    if pool is not None:
        futs = {k: pool.submit(_own_capacity, sc, folder) for k, sc in todo.items()}
        ref_cap = futs[ref_key].result()
        return _tasks(spec, scs, ref_key, {ref_key: ref_cap}), {"_pending": {"futures": futs, "keys": keys, "ref": ref_cap}}
    workers = min(jobs or os.cpu_count() or 1, len(todo))
    if workers > 1:
        with cf.ProcessPoolExecutor(max_workers=workers, initializer=die_with_parent, initargs=(os.getpid(),)) as ex:
            measured = dict(zip(todo, ex.map(_own_capacity, todo.values(), [folder] * len(todo)), strict=True))
    else:
        measured = {k: _own_capacity(sc, folder) for k, sc in todo.items()}
    return _tasks(spec, scs, ref_key, measured), _caps(spec, keys, measured, measured[ref_key])


def _tasks(spec: SweepSpec, scs: list[Scenario], ref_key: str, known: dict[str, Capacity]) -> list[dict[str, Any]]:
    """Every (variant, utilisation, seed) point, each variant offered u x the reference capacity,
    with the capacity its run needs besides (`sim.capacity.capacity_for`: a follow-load policy's or
    a target-utilisation autoscaler's reference; measured here, once per deployment, unless `known`
    has it: the capacities measured so far, by key)."""
    ref_cap = known[ref_key]
    store = CapacityStore()
    for key, cap in known.items():
        store.remember(key, cap)
    tasks: list[dict[str, Any]] = []
    for v, sc_v in zip(spec.variants, scs, strict=True):
        run_cap = capacity_for(sc_v.with_overrides({"workload.rate_rps": ref_cap.rps}), store=store)
        for u in spec.utilisation:
            sc = sc_v.with_overrides({"workload.rate_rps": u * ref_cap.rps})
            tasks.extend({"variant": v.name, "utilisation": u, "concurrency": None, "seed": seed, "key": f"{sc.key()}-{seed}",
                          "scenario": sc.model_dump(mode="json"), "capacity": run_cap} for seed in spec.seeds)
    return tasks


def _caps(spec: SweepSpec, keys: list[str], measured: dict[str, Capacity], ref_cap: Capacity) -> dict[str, dict[str, Any]]:
    """Each variant's capacity figures (and the reference's rate)."""
    return {v.name: {**measured[key].as_dict(curve=False), "reference_capacity_rps": ref_cap.rps,
                     "curve": [list(r) for r in measured[key].curve]}
            for v, key in zip(spec.variants, keys, strict=True)}


def finish_caps(spec: SweepSpec, caps: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The capacities `plan_points` left measuring in its pool, once measured."""
    pending = caps.get("_pending")
    if pending is None:
        return caps
    measured = {k: f.result() for k, f in pending["futures"].items()}
    return _caps(spec, pending["keys"], measured, pending["ref"])


# a finished point's row holds at least these (anything less is a truncated or foreign file)
POINT_COLUMNS = ("point_key", "variant", "utilisation", "seed", "error", "speculative_method", "speculative_policy",
                 "num_speculative_tokens", *KEY_PARAMS, "completed_requests", "offered_requests", "throughput_tok_s",
                 "stable", "usd_per_mtok")


def _read_point(path: Path) -> dict[str, Any] | None:
    """A finished point, or None when absent, unreadable, incomplete or failed (then it is recomputed)."""
    try:
        row = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(row, dict) or any(c not in row for c in POINT_COLUMNS):
        return None
    if row["point_key"] != path.name.removesuffix(".json") or row["error"] != "":
        return None
    return row


def check_out_dir(out: Path, flag: str = "--out") -> None:
    """OUT and OUT/points must be folders (or not exist yet): a one-line error before any run."""
    for q in (out, out / "points"):
        if q.exists() and not q.is_dir():
            raise ConfigError(f"{flag} {out}: {q} exists and is not a folder; name a folder (it is created if missing)")


def run_sweep(spec: SweepSpec, out: str | Path, *, jobs: int | None = None, executor: str | cf.Executor = "process",
              progress: bool = True, cache: str | Path | None = None) -> tuple[pd.DataFrame, dict[str, dict[str, float]]]:
    """Run (or resume) a sweep into `out`; returns the tidy table and the variants' capacities.
    `cache`: a capacity cache folder to read and keep the variants' capacities in (None: none)."""
    out = Path(out)
    check_out_dir(out)
    pts = out / "points"
    pts.mkdir(parents=True, exist_ok=True)
    procs = jobs or os.cpu_count() or 1
    pool: cf.ProcessPoolExecutor | None = None
    if isinstance(executor, str) and executor == "process" and procs > 1 and not spec.concurrency:
        # one pool for the capacities and the points: the points start as soon as the reference's is known
        pool = cf.ProcessPoolExecutor(max_workers=procs, initializer=die_with_parent, initargs=(os.getpid(),))
    try:
        return _run_sweep(spec, out, jobs=jobs, executor=executor, progress=progress, pool=pool, cache=cache)
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)


def _run_sweep(spec: SweepSpec, out: str | Path, *, jobs: int | None, executor: str | cf.Executor, progress: bool,
               pool: cf.ProcessPoolExecutor | None, cache: str | Path | None = None
               ) -> tuple[pd.DataFrame, dict[str, dict[str, float]]]:
    out = Path(out)
    pts = out / "points"
    tasks, caps = plan_points(spec, jobs if isinstance(executor, str) and executor == "process" else 1, pool, cache)
    # rows are kept per task; the cache file is per scenario content and seed, so two variants with
    # identical scenarios share one computation and a renamed variant reuses its points
    rows: dict[int, dict[str, Any]] = {}
    todo: list[int] = []
    for stale in pts.glob("*.json.tmp*"):  # half-written points of a killed run
        stale.unlink(missing_ok=True)
    for i, t in enumerate(tasks):
        f = pts / f"{t['key']}.json"
        row = _read_point(f)
        if row is not None:
            rows[i] = row
        elif any(tasks[j]["key"] == t["key"] for j in todo):
            continue  # computed once for the first task with this key
        else:
            todo.append(i)
    bar = Progress(len(todo), f"sweep {spec.name}") if progress else Progress(0, "")

    def record(i: int, row: dict[str, Any]) -> None:
        if row.get("error"):
            at = f"concurrency={row['concurrency']}" if row.get("concurrency") is not None else f"utilisation={row['utilisation']}"
            sys.stderr.write(f"\npoint failed: variant={row['variant']} {at} seed={row['seed']}: {row['error']}\n")
        else:
            write_atomic(pts / f"{row['point_key']}.json", json.dumps(row, default=float))
        rows[i] = row
        bar.step()

    if isinstance(executor, cf.Executor):
        futs = {executor.submit(run_point, tasks[i]): i for i in todo}
        for fut in cf.as_completed(futs):
            record(futs[fut], fut.result())
    elif executor == "serial" or jobs == 1 or len(todo) <= 1:
        for i in todo:
            record(i, run_point(tasks[i]))
    else:
        ex = pool if pool is not None else cf.ProcessPoolExecutor(
            max_workers=jobs or os.cpu_count() or 1, initializer=die_with_parent, initargs=(os.getpid(),))
        with contextlib.ExitStack() as stack:
            if pool is None:
                stack.enter_context(ex)
            futs = {ex.submit(run_point, tasks[i]): i for i in todo}
            try:
                for fut in cf.as_completed(futs):
                    record(futs[fut], fut.result())
            except KeyboardInterrupt:
                for pending in futs:
                    pending.cancel()
                raise
    caps = finish_caps(spec, caps)
    by_key = {r["point_key"]: r for r in rows.values() if not r.get("error")}
    table = []
    for i, t in enumerate(tasks):
        row = rows.get(i) or by_key.get(t["key"])
        if row is None:
            continue
        table.append({**row, "variant": t["variant"], "utilisation": t["utilisation"], "concurrency": t["concurrency"],
                      "seed": t["seed"]})
    df = pd.DataFrame(table)
    if spec.concurrency and len(df):
        df["concurrency"] = df.concurrency.astype(np.int64)
        df["utilisation"] = df.utilisation.astype(np.float64)  # NaN: a closed loop offers no rate
    for name, c in caps.items():
        for col, val in c.items():
            if col != "curve":  # the closed-loop curve goes to capacity.csv, not into every row
                df.loc[df.variant == name, col] = val
    if spec.utilisation and len(df) and {"capacity_rps", "offered_rps", "e2e_s_mean", "run_window_s"} <= set(df):
        df = judged_against_capacity(settledness(df))
    return df, caps


RAMP_SHARE_MAX = 0.05  # a point is 'settled' when the start-up transient may bias at most 5% of its window


def settledness(df: pd.DataFrame) -> pd.DataFrame:
    """Whether each open-loop point's run was long enough for its load to settle: the relaxation
    time of requests in system t = mean time in system / (1 - rho), rho = offered over the
    variant's own capacity (docs/METRICS.md, 'Planner run length'), and `ramp_share` =
    e^(-warm-up / t) x t / window, the share of the window the start-up deficit (a run starts
    empty) still biases; `settled` when it is at most RAMP_SHARE_MAX. An unsettled point's
    latencies are understated. (The planner, judging p99s against SLO targets, asks more: 3
    relaxation times of warm-up and 10 of window.)"""
    rho = df.offered_rps.astype(float) / df.capacity_rps.astype(float)
    relax = relaxation_s(df.e2e_s_mean.to_numpy(float), rho.to_numpy(float))
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        share = np.exp(-df.run_warmup_s.astype(float) / relax) * np.minimum(1.0, relax / df.run_window_s.astype(float))
    share = np.where(np.isfinite(relax), share, 1.0)
    return df.assign(own_utilisation=rho, relaxation_s=relax, ramp_share=share, settled=share <= RAMP_SHARE_MAX)


def judged_against_capacity(df: pd.DataFrame) -> pd.DataFrame:
    """Each open-loop stationary point's verdict judged again against its variant's own capacity,
    measured alongside the runs (`sim.metrics.against_capacity`, the rule a run given its
    capacity applies itself): never 'stable' at or above it, and an 'overloaded' that rests on a
    trend shorter than its load's relaxation time 'insufficient'. Rows the run judged already
    (`judged_utilisation` known), closed loops and rate profiles are left as they are."""
    need = {"verdict", "verdict_reason", "trend_only", "judged_utilisation", "loop", "settle_s", "window_end_s"}
    if not need <= set(df):
        return df
    out = df.copy()
    met_cols = [c for c in df.columns if c.startswith("slo_") and c.endswith("_met")]
    for i, row in df.iterrows():
        rho = float(row["own_utilisation"])
        if row["loop"] != "open" or row["judged_utilisation"] == row["judged_utilisation"] or rho != rho \
                or TIME_VARYING_NOTE in str(row["verdict_reason"]):
            continue
        reasons = [r for r in str(row["verdict_reason"]).split("; ") if r]
        verdict, reasons = against_capacity(str(row["verdict"]), reasons, trend_only=bool(row["trend_only"]), rho=rho,
                                            e2e_mean_s=float(row["e2e_s_mean"]),
                                            window_s=float(row["window_end_s"]) - float(row["settle_s"]))
        stable = verdict == "stable"
        out.at[i, "verdict"], out.at[i, "verdict_reason"], out.at[i, "stable"] = verdict, "; ".join(reasons), stable
        out.at[i, "judged_utilisation"] = rho
        out.at[i, "slo_met"] = bool(stable and all(bool(row[c]) for c in met_cols))
    return out


@contextlib.contextmanager
def executor_for(kind: str, *, jobs: int | None = None, scheduler: str | None = None,
                 timeout_s: float = 10.0) -> Iterator[str | cf.Executor]:
    """The executor a sweep runs on: "process" (local pool, the default), "serial", "dask-local"
    (a Dask LocalCluster of `jobs` worker processes) or "dask" (an existing Dask scheduler).
    Dask's client executor is a concurrent.futures.Executor, so points run the same everywhere."""
    if kind in ("process", "serial"):
        yield kind
        return
    try:
        from distributed import Client, LocalCluster
    except ImportError:
        raise ConfigError("Dask executors need the 'dask' extra: pip install -e '.[dask]'") from None
    if kind == "dask-local":
        try:
            cluster = LocalCluster(n_workers=jobs or os.cpu_count() or 1, threads_per_worker=1, processes=True,
                                   dashboard_address=None)
        except (RuntimeError, OSError) as err:
            raise ConfigError(f"--executor dask-local: the local Dask cluster failed to start ({err})") from None
        with cluster, Client(cluster) as client:
            yield client.get_executor()
    elif kind == "dask":
        try:
            client = Client(scheduler, timeout=timeout_s)
        except (OSError, TimeoutError) as err:
            raise ConfigError(f"--scheduler {scheduler}: cannot connect to a Dask scheduler within {timeout_s:g} s ({err})") from None
        with client:
            yield client.get_executor()
    else:
        raise ConfigError(f"unknown executor '{kind}' (process | serial | dask-local | dask)")


def write_tables(df: pd.DataFrame, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    df.to_parquet(out / "results.parquet", index=False)
    df.to_csv(out / "results.csv", index=False)
