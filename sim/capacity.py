"""Capacity: the maximum throughput a deployment sustains, measured by the simulator the way a
long open-loop run would see it (docs/METRICS.md, 'Capacity').

A closed loop of N clients (each sends its next request when the previous one completes) holds
the number of requests in the system at N; its steady-state completion rate X(N) is the
throughput the engine delivers at that load. With N above the rack's batch slots the batch is
pinned at `max_num_seqs` and X is the **full-batch throughput**. Without speculation, and while
the paged KV holds the batch, X rises with N up to the full batch (more sequences share each
weight read), so the full-batch figure is the capacity: an open-loop run below it drains its
queue, above it the queue grows.

Two things can make X(N) *fall* past a moderate population, the **collapse**:
- **The paged KV runs out.** When the KV cache holds fewer sequences of the mix's mean length than
  the engine has slots (a 70B model on two H100s holds ~18), the batch the scheduler admits at
  full load outgrows the cache: sequences are preempted and recomputed every few steps, and X
  at full load is far below X at the population the cache holds (1.02 vs 1.51 req/s there). The
  ladder of populations is therefore taken over the sequences the cache holds, not the slots,
  when those are fewer: a ladder over the slots alone would only ever see the thrash.
- **Speculation's overhead grows with the batch**: the machinery's overhead is a fraction of the
  target pass that itself grows with the running sequences (vLLM #49548: +6.6% at 2, +21.6% at
  189), so its cost is quadratic in the batch, on top of k+1 verified tokens per sequence. (At
  the measured overhead slope the fall is small, about 1% for the default 1B draft at k = 4; it
  grows with the slope and with k.)
Offered load between the full-load throughput and the peak then has two regimes, a healthy one at
moderate batch and a collapsed one at full load, and the collapsed one is absorbing: there the
rack serves less than is offered, so the queue that a burst built only grows. A long run meets
that burst sooner or later (70B TP2 with a 1B draft: a 1200 s open-loop run stayed stable at
1.41 req/s, inside the band, and 3000 s runs at 0.97x that rate were overloaded on both seeds), so the capacity reported is the **peak** when the fall is within
noise (COLLAPSE_TOL) and the **full-load throughput** when it is not: the highest rate a
deployment sustains whatever the bursts. That is conservative where the band is wide (the rate
must fluctuate up to where the falling curve meets it before the rack tips; 70B TP2 x 2 on
A100-80GB ran stable for 3000 s at 1.07x its full-load figure, half its peak).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import platform
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import numpy as np
import simpy

from models.memory import BLOCK_SIZE
from sim.deployment import ReplicaRuntime, build_runtime, check_fits, gpus_per_replica, prefill_pool
from sim.deployment import fits as request_fits
from sim.frame import Frame, column
from sim.run import run_table
from sim.scenario import Scenario
from sim.workload import LengthSampler, generate

# closed-loop populations, as fractions of the batch a replica holds (its slots, max_num_seqs, or
# the sequences of the mean length its paged KV holds where those are fewer)
LADDER = (0.125, 0.25, 0.375, 0.5, 0.625, 0.75, 0.875, 1.0)
LADDER_PLAIN = (0.5, 0.75, 1.0)  # without speculation X(N) rises while the KV holds the batch: fewer points
FULL_LOAD = 1.25  # and last, 1.25x the slots: the batch pinned at max_num_seqs (or at what the KV holds)
MEASURED_COMPLETIONS = 2500  # completions in each closed-loop measurement window
COLLAPSE_TOL = 0.03  # a peak more than 3% above the full-load throughput is a collapse
COLLAPSE_WINDOW = 4  # a collapsed deployment's full-load throughput: 4x the completions
METHOD_VERSION = 2  # in capacity_key: capacities kept by an earlier method (OUT/points) are measured anew
CURVE_COLUMNS = ("concurrency", "rps", "tok_s", "mean_batch")


@dataclass(frozen=True)
class Capacity:
    """What a deployment sustains. `rps`/`tok_s`: the capacity (peak sustainable rate);
    `full_batch_*`: throughput with the batch pinned at max_num_seqs; `peak_*`: the highest
    closed-loop throughput and the population (concurrency) where it occurs; `curve`: rows of
    (concurrency, req/s, output tok/s, mean batch per replica)."""

    rps: float
    tok_s: float
    full_batch_rps: float = float("nan")
    full_batch_tok_s: float = float("nan")
    peak_rps: float = float("nan")
    peak_concurrency: int = 0
    collapse: bool = False
    method: str = "closed-loop"
    curve: tuple[tuple[float, float, float, float], ...] = field(default=())
    kv_sequences: int = 0  # sequences of the mix's mean length the rack's paged KV holds (all replicas)
    slots: int = 0  # the rack's batch slots (replicas x max_num_seqs)

    @property
    def upper_bound(self) -> bool:
        """A ladder whose collapse is not refined yet: `rps` is the peak, above the capacity."""
        return self.collapse and self.rps > self.full_batch_rps

    def as_dict(self, prefix: str = "", *, curve: bool = True) -> dict[str, object]:
        """Flat figures for summary.json and tables (`capacity_rps`, `full_batch_rps`, ...), each
        name prefixed; with `curve`, also `capacity_curve` as rows of named figures."""
        d: dict[str, object] = {
            f"{prefix}capacity_rps": self.rps, f"{prefix}capacity_tok_s": self.tok_s,
            f"{prefix}full_batch_rps": self.full_batch_rps, f"{prefix}full_batch_tok_s": self.full_batch_tok_s,
            f"{prefix}peak_rps": self.peak_rps, f"{prefix}peak_concurrency": self.peak_concurrency,
            f"{prefix}collapse": self.collapse, f"{prefix}capacity_method": self.method,
            f"{prefix}kv_sequences": self.kv_sequences, f"{prefix}batch_slots": self.slots,
        }
        if curve:
            d[f"{prefix}capacity_curve"] = [dict(zip(CURVE_COLUMNS, r, strict=True)) for r in self.curve]
        return d


# A disaggregated rack's own capacity: not measured (its figures NaN; its runs are judged from
# their own data, and utilisation is relative to the aggregated rack on its GPUs: `baseline_of`)
UNMEASURED = Capacity(rps=float("nan"), tok_s=float("nan"), method="not measured (disaggregated)")


def baseline_of(sc: Scenario) -> Scenario:
    """The same deployment with speculation off, on as many replicas: what `utilisation` is
    relative to (a disaggregated rack's: the aggregated rack on its GPUs). A dedicated draft's GPUs are left out of the rack (each replica keeps its
    tensor-parallel GPUs), so any whole number of (TP + draft GPUs) replicas has its reference."""
    spec = sc.speculative
    if sc.disaggregation is not None:
        # the aggregated rack on as many GPUs (of the decode pool's type, at its tensor parallelism),
        # speculation off: what aggregated and disaggregated racks of one GPU budget are offered
        tp = sc.deployment.tensor_parallel
        total = sc.rack.num_gpus + prefill_pool(sc).rack.num_gpus
        return sc.with_overrides({"disaggregation": None, "speculative": None, "rack.num_gpus": total // tp * tp,
                                  "rack.allow_idle_gpus": False})
    if spec is None:
        return sc
    over: dict[str, object] = {"speculative": None}
    if spec.placement == "dedicated":
        over["rack.num_gpus"] = sc.rack.num_gpus // gpus_per_replica(sc) * sc.deployment.tensor_parallel
    return sc.with_overrides(over)


def closed_loop_throughput(sc: Scenario, concurrency: int, seed: int, completions: int | None = None,
                           rt: ReplicaRuntime | None = None) -> tuple[float, float, float]:
    """(req/s, output tok/s, mean batch per replica) of `concurrency` closed-loop clients with the
    scenario's length mix, in steady state: the window starts after the first max(2N, n/5)
    completions (the start-up burst of N prefills has passed) and ends at the last send (after
    it the population shrinks)."""
    rt = rt or build_runtime(sc)
    if completions is None:  # small populations step many times per completion: fewer suffice there
        completions = int(np.clip(15 * concurrency, 800, MEASURED_COMPLETIONS))
    n = int(1.25 * (completions + 2 * concurrency))
    trace = sc.workload.replays_trace
    table, clipped = _lengths(sc, seed, n, rt)
    out = run_table(sc, rt, table, seed, concurrency=concurrency, backlog_limit=10**12)
    req, steps = out.requests, out.steps
    done = np.sort(column(req, "completion_s", np.float64))
    k0 = min(n - 2, max(2 * concurrency, n // 5))
    t_a = float(done[k0])
    t_b = float(np.nanmax(column(req, "arrival_s", np.float64)))
    if not t_b > t_a:
        raise ValueError(f"closed loop of {concurrency} clients too short to measure ({n} requests)")
    st = steps.rows((steps["start_s"] >= t_a) & (steps["start_s"] < t_b))
    tok_s = float(st["emitted_tokens"].sum()) / (t_b - t_a)
    # requests/s from the token rate and the length distribution's own mean (renewal reward): far
    # less noisy than counting completions, whose count swings with the long outputs in the window
    mean_out = (float(table["output_tokens"].mean()) if trace or clipped
                else LengthSampler(sc.workload.output_tokens, "output_tokens").mean())
    dur = column(st, "duration_s")
    batch = float((column(st, "batch_size") * dur).sum() / dur.sum()) if dur.sum() > 0 else 0.0
    return tok_s / mean_out, tok_s, batch


def _lengths(sc: Scenario, seed: int, n: int, rt: ReplicaRuntime) -> tuple[Frame, bool]:
    """n requests of the scenario's length mix (a trace's own lengths: arrival 'trace', or 'closed'
    with a trace; a short trace or window resampled with replacement), arrivals irrelevant, and
    whether requests the deployment rejects (longer than max_model_len) were left out: those
    never enter capacity (they are refused, not served), so the mix is the one that is served."""
    trace = sc.workload.replays_trace
    wl = sc.workload.model_copy(update={"num_requests": n, "utilisation": None, "rate_rps": 1.0, "rate_profile": None,
                                        "arrival": "trace" if trace else "poisson"})
    table = generate(wl, seed, None if trace else 1.0)
    check_fits(sc, rt, column(table, "prompt_tokens"), column(table, "output_tokens"))  # none fits: an error
    ok = request_fits(rt, column(table, "prompt_tokens"), column(table, "output_tokens"))
    clipped = not bool(ok.all())
    if clipped:
        table = table.rows(ok)
        table["id"] = np.arange(len(table), dtype=np.int64)
    if len(table) < n:
        pick = np.random.default_rng(seed).integers(0, len(table), n)
        table = table.rows(pick)
        table["id"] = np.arange(n, dtype=np.int64)
    return table, clipped


def kv_sequences(sc: Scenario, rt: ReplicaRuntime, seed: int) -> int:
    """Sequences of the mix's mean final length (prompt + output) one replica's paged KV holds."""
    if sc.workload.replays_trace:
        t, _ = _lengths(sc, seed, 2000, rt)
        mean_len = float(t["prompt_tokens"].mean() + t["output_tokens"].mean())
    else:
        mean_len = (LengthSampler(sc.workload.prompt_tokens, "prompt_tokens").mean()
                    + LengthSampler(sc.workload.output_tokens, "output_tokens").mean())
    return max(1, int(rt.plan.num_blocks * BLOCK_SIZE // max(mean_len, 1.0)))


def one_replica(sc: Scenario) -> tuple[Scenario, int]:
    """The scenario on a rack of one replica, and the scenario's replica count."""
    per = gpus_per_replica(sc)
    # capacity is a steady-state figure of the deployment: no autoscaler, no rate profile
    over: dict[str, object] = {"rack.num_gpus": per, "autoscale": None}
    if sc.workload.rate_profile is not None:
        over.update({"workload.rate_profile": None, "workload.utilisation": 0.5})
    return sc.with_overrides(over), sc.rack.num_gpus // per


def measure_ladder(sc: Scenario, seed: int) -> Capacity:
    """The closed-loop curve of the scenario's deployment as given, and what it says before a
    collapse's full-load figure is measured over the longer window: without a collapse that is
    the capacity (`refine` returns it as it is); with one, `rps` is the peak, an upper bound on
    the capacity (a planner prunes with it: `ladder`).

    Measured on one replica and multiplied by the replica count: at saturation the router keeps
    every replica's batch full, and below it least-outstanding routing splits the population
    evenly (round-robin nearly so), so the rack's X(N) is R x one replica's X(N/R)."""
    if sc.disaggregation is not None:
        raise ValueError(f"{sc.name}: the capacity of a disaggregated rack is not measured (a closed-loop ladder runs "
                         "one aggregated engine); offer it a rate (workload.rate_rps) or a utilisation of the "
                         "aggregated rack on its GPUs (workload.utilisation), and drop --capacity")
    one, reps = one_replica(sc)
    rt = build_runtime(one)
    ladder = LADDER if sc.speculative is not None else LADDER_PLAIN
    kv = kv_sequences(one, rt, seed)
    base = min(rt.max_num_seqs, kv)  # the batch the rack can hold: its slots, or fewer where the KV runs out
    pops = sorted({max(1, round(f * base)) for f in ladder} | {round(FULL_LOAD * rt.max_num_seqs)})
    curve = []
    for n in pops:
        rps, tok_s, batch = closed_loop_throughput(one, n, seed, rt=rt)
        curve.append((float(n * reps), rps * reps, tok_s * reps, batch))
    full = curve[-1]
    peak = max(curve, key=lambda r: r[1])
    collapse = peak[1] > full[1] * (1.0 + COLLAPSE_TOL)
    method = ("closed-loop peak: an upper bound (the collapse's full-load figure not measured yet)" if collapse
              else "closed-loop full batch" if peak is full else "closed-loop peak")
    return Capacity(rps=peak[1], tok_s=peak[2], full_batch_rps=full[1], full_batch_tok_s=full[2], peak_rps=peak[1],
                    peak_concurrency=int(peak[0]), collapse=collapse, method=method, curve=tuple(curve),
                    kv_sequences=kv * reps, slots=rt.max_num_seqs * reps)


def refine(sc: Scenario, seed: int, lad: Capacity) -> Capacity:
    """The capacity from the deployment's ladder (`measure_ladder`): the ladder itself without a
    collapse; with one, the full-load throughput measured over COLLAPSE_WINDOW x the completions
    (preemption thrash is noisy, and its first thousands of completions run a little fast):
    above it a burst tips the rack into a regime it never leaves."""
    if not lad.collapse:
        return lad
    one, reps = one_replica(sc)
    rt = build_runtime(one)
    n_full = round(FULL_LOAD * rt.max_num_seqs)
    rps, tok_s, batch = closed_loop_throughput(one, n_full, seed, COLLAPSE_WINDOW * MEASURED_COMPLETIONS, rt=rt)
    full = (float(n_full * reps), rps * reps, tok_s * reps, batch)
    curve = (*lad.curve[:-1], full)
    peak = max(curve, key=lambda r: r[1])
    return dataclasses.replace(lad, rps=full[1], tok_s=full[2], full_batch_rps=full[1], full_batch_tok_s=full[2],
                               peak_rps=peak[1], peak_concurrency=int(peak[0]), curve=curve,
                               method="closed-loop full load (collapse: the peak is metastable)")


def measure_capacity(sc: Scenario, seed: int) -> Capacity:
    """The capacity of the scenario's deployment as given (see the module docstring)."""
    return refine(sc, seed, measure_ladder(sc, seed))


def capacity_key(sc: Scenario, *, speculative: bool = False) -> str:
    """What a capacity depends on: rack, deployment, speculation (unless off), the request mix
    (lengths, trace, classes, conversations), the seed, and `[sim] draft_kv_free`. (What the
    measurement sets itself, the rate, the number of requests and the arrival process of a
    closed loop, is left out; conversations and draft_kv_free only when set, so the keys of
    capacities kept before they were added stay the same.)"""
    base = sc if speculative else baseline_of(sc)
    dump = base.model_dump(mode="json")
    wl = base.workload.model_dump(mode="json", include={"prompt_tokens", "output_tokens", "arrival", "trace", "trace_format",
                                                        "trace_start_s", "trace_end_s", "classes", "conversations"})
    if wl["conversations"] is None:
        del wl["conversations"]
    extra = {"draft_kv_free": True} if base.sim.draft_kv_free else {}
    return json.dumps({**{k: dump[k] for k in ("rack", "deployment", "speculative", "seed")}, "workload": wl,
                       "method": METHOD_VERSION, **extra}, sort_keys=True)


CACHE_ENV = "SPECRACK_CAPACITY_CACHE"  # a folder for the capacity cache, or "off"
CACHE_OFF = ("off", "0", "false", "no", "none")


def default_cache_dir() -> Path | None:
    """Where `specrack run`, `capacity` and `sweep` keep measured capacities between runs:
    $SPECRACK_CAPACITY_CACHE (`off` for none), else $XDG_CACHE_HOME/specrack/capacity, else
    ~/.cache/specrack/capacity."""
    env = os.environ.get(CACHE_ENV, "").strip()
    if env.lower() in CACHE_OFF:
        return None
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME", "").strip()
    return (Path(base) if base else Path.home() / ".cache") / "specrack" / "capacity"


@functools.cache
def _code_digest() -> str:
    """SHA-256 of the simulator's sources (models/ and sim/): any change to the engine, a cost
    model, a catalogue or an engine profile is a new digest."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    for folder in ("models", "sim"):
        for f in sorted((root / folder).glob("*.py")):
            h.update(f"{folder}/{f.name}\0".encode())
            h.update(f.read_bytes())
    return h.hexdigest()


def package_versions() -> dict[str, str]:
    """The versions a measurement's numbers may depend on (random streams, special functions),
    by package (python, numpy, pandas, simpy, scipy; what a run's summary reports too)."""
    return dict(_versions())


@functools.cache
def _versions() -> dict[str, str]:
    # read once per process: a package's metadata takes milliseconds to read, and a plan reads it
    # for every cache key (pandas and scipy from their metadata: a run imports neither)
    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "?"

    return {"python": platform.python_version(), "numpy": np.__version__, "pandas": version("pandas"),
            "simpy": simpy.__version__, "scipy": version("scipy")}


def _file_digests(value: object, out: dict[str, str]) -> None:
    """The SHA-256 of every existing file a scenario's values name (a trace, a model's
    config.json, an efficiency file), into `out` by path: a capacity depends on their content."""
    if isinstance(value, dict):
        for v in value.values():
            _file_digests(v, out)
    elif isinstance(value, list):
        for v in value:
            _file_digests(v, out)
    elif isinstance(value, str) and value not in out and len(value) < 4096:
        p = Path(value)
        try:
            if p.is_file():
                out[value] = hashlib.sha256(p.read_bytes()).hexdigest()
        except OSError:  # (not a path this system can name)
            pass


def cache_digest(key: str) -> str:
    """The capacity cache's name for `capacity_key`'s key: a hash of the key (the scenario content a
    capacity depends on), the content of the files it names, the simulator's sources and the
    versions of Python and the numeric libraries, so an entry is never read by a run it would
    not be measured the same for."""
    files: dict[str, str] = {}
    _file_digests(json.loads(key), files)
    blob = json.dumps({"key": key, "files": files, "code": _code_digest(), "versions": _versions()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def capacity_to_json(cap: Capacity) -> dict[str, object]:
    return {f.name: getattr(cap, f.name) for f in dataclasses.fields(cap)}


def capacity_from_json(d: dict[str, object]) -> Capacity:
    curve = d.get("curve", ())
    assert isinstance(curve, list | tuple)
    return Capacity(**{**d, "curve": tuple(tuple(r) for r in curve)})  # type: ignore[arg-type]


class CapacityStore:
    """Capacities measured so far, by `capacity_key`: refined capacities, and ladders whose
    collapse is not refined yet (their peak, an upper bound). A measurement is a pure function
    of its key, so a store only saves time; whoever runs many scenarios (a sweep, a plan) owns
    one and passes it where capacities are needed (`capacity_for`).

    With `folder` the refined capacities are also kept on disk, one JSON file per `cache_digest`
    (what `specrack run` and `specrack capacity` do: `default_cache_dir`), and so are ladders
    whose collapse is not refined yet (`<digest>.ladder.json`, a planner prunes with them, until
    the refined capacity is kept), so the next process reuses them. A file that cannot be read
    is measured anew; `write_error` says why a file could not be written (the run goes on)."""

    def __init__(self, folder: str | Path | None = None) -> None:
        self.capacities: dict[str, Capacity] = {}
        self.ladders: dict[str, Capacity] = {}
        self.folder = None if folder is None else Path(folder)
        self.write_error: str | None = None
        self.disk_hits = 0  # capacities read from the folder
        self._digests: dict[str, str] = {}

    def _path(self, key: str, ladder: bool = False) -> Path:
        assert self.folder is not None
        if key not in self._digests:
            self._digests[key] = cache_digest(key)
        return self.folder / f"{self._digests[key]}{'.ladder' if ladder else ''}.json"

    def _from_disk(self, key: str, ladder: bool = False) -> Capacity | None:
        """The refined capacity kept on disk (or, `ladder`, the ladder whose collapse is not
        refined yet), kept in this store too; None when absent or unreadable (measured anew)."""
        if self.folder is None:
            return None
        path = self._path(key, ladder)
        try:
            entry = json.loads(path.read_text())
            if entry.get("key") != key:
                return None
            cap = capacity_from_json(entry["capacity"])
        except (OSError, ValueError, TypeError, KeyError, AssertionError):  # absent or unreadable: measured anew
            return None
        (self.ladders if ladder else self.capacities)[key] = cap
        self.disk_hits += 1
        return cap

    def _to_disk(self, key: str, cap: Capacity, ladder: bool = False) -> bool:
        """Keep it on disk (whole or not at all); whether it was written."""
        if self.folder is None:
            return False
        path = self._path(key, ladder)
        tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp")
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp.write_text(json.dumps({"key": key, "capacity": capacity_to_json(cap)}))
            os.replace(tmp, path)  # (atomic: a reader sees the whole file or none)
        except OSError as err:
            self.write_error = f"{err.strerror or err}: {err.filename or self.folder}"
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            return False
        return True

    def ladder(self, sc: Scenario, *, speculative: bool = False) -> Capacity:
        """`measure_ladder` of the deployment (speculation off unless `speculative`): the capacity
        where the throughput does not collapse, else an upper bound on it (the peak)."""
        if speculative and sc.disaggregation is not None:
            return UNMEASURED
        key = capacity_key(sc, speculative=speculative)
        if key in self.capacities:
            return self.capacities[key]
        if key not in self.ladders:
            cap = self._from_disk(key) or self._from_disk(key, ladder=True)
            if cap is not None:
                return cap
            base = sc if speculative else baseline_of(sc)
            lad = measure_ladder(base, base.seed)
            if lad.collapse:  # (kept on disk apart: the refined capacity is read first)
                self.ladders[key] = lad
                self._to_disk(key, lad, ladder=True)
            else:  # no collapse: the ladder is the capacity (`refine` keeps it as it is)
                self.capacities[key] = lad
                self._to_disk(key, lad)
                return lad
        return self.ladders[key]

    def capacity(self, sc: Scenario, *, speculative: bool = False) -> Capacity:
        """Capacity of the scenario's deployment with speculation off (the reference that
        `utilisation` is relative to), or as given with `speculative=True` (its ladder kept too)."""
        if speculative and sc.disaggregation is not None:
            return UNMEASURED  # (a closed-loop ladder runs one aggregated engine: `measure_ladder`)
        key = capacity_key(sc, speculative=speculative)
        if key not in self.capacities and self._from_disk(key) is None:
            base = sc if speculative else baseline_of(sc)
            self.capacities[key] = refine(base, base.seed, self.ladder(sc, speculative=speculative))
            if self._to_disk(key, self.capacities[key]):  # (the ladder kept on disk is superseded)
                with contextlib.suppress(OSError):
                    self._path(key, ladder=True).unlink(missing_ok=True)
        return self.capacities[key]

    def remember(self, key: str, cap: Capacity, *, is_ladder: bool = False) -> None:
        """Keep a capacity (or, `is_ladder`, a ladder whose collapse is not yet refined) measured
        elsewhere (a worker process, a plan's points folder)."""
        if is_ladder and cap.upper_bound:
            self.ladders[key] = cap
        else:
            self.capacities[key] = cap


def capacity(sc: Scenario, *, speculative: bool = False, store: CapacityStore | None = None) -> Capacity:
    """The capacity of the scenario's deployment with speculation off (the reference that
    `utilisation` is relative to), or as given with `speculative=True`: found in `store`, else
    measured now (and kept there; without a store, kept nowhere)."""
    return (CapacityStore() if store is None else store).capacity(sc, speculative=speculative)


@dataclass(frozen=True)
class RunCapacity:
    """The capacities a run takes as input, measured before it (`capacity_for`): the
    deployment's with speculation off (`baseline`: what `utilisation`, a target-utilisation
    autoscaler and a follow-load policy are relative to) and, for the summary's capacity figures,
    with speculation as configured (`speculative`; None without [speculative] or when not asked)."""

    baseline: Capacity
    speculative: Capacity | None = None

    def as_dict(self) -> dict[str, object]:
        """The summary's capacity section (`capacity_rps`, ..., `speculative_capacity_rps`, ...)."""
        out = self.baseline.as_dict()
        if self.speculative is not None:
            out.update(self.speculative.as_dict("speculative_"))
        return out


def needs_capacity(sc: Scenario) -> str | None:
    """Why a run of the scenario needs its deployment's capacity, or None: a load set as
    utilisation, a target-utilisation autoscaler or a follow-load speculation policy."""
    wl, spec = sc.workload, sc.speculative
    if wl.rate_rps is None and wl.utilisation is not None:
        return f"workload.utilisation = {wl.utilisation:g}"
    if sc.autoscale is not None and sc.autoscale.policy == "target_utilisation":
        return "autoscale.policy = 'target_utilisation'"
    if spec is not None and spec.policy == "follow_load":
        return "speculative.policy = 'follow_load'"
    return None


def capacity_for(sc: Scenario, *, with_capacity: bool = False, store: CapacityStore | None = None) -> RunCapacity | None:
    """What `sim.simulate.simulate(sc, ...)` takes as `capacity`: None when the run needs none,
    else found in `store` or measured now (and kept there; without a store, kept nowhere).
    `with_capacity`: also the figures for the summary's capacity section (speculation as
    configured too)."""
    if not with_capacity and needs_capacity(sc) is None:
        return None
    st = CapacityStore() if store is None else store
    spec = st.capacity(sc, speculative=True) if with_capacity and sc.speculative is not None else None
    return RunCapacity(st.capacity(sc), spec)
