"""Running many tasks: a map over a process pool with a progress bar, the workers' tie to their
parent, and whole-or-absent file writes (what the sweep and the planner share)."""

from __future__ import annotations

import concurrent.futures as cf
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any


def write_atomic(path: Path, text: str) -> None:
    """Write to a temporary file, flush it to disk, then rename: a point file is whole or absent."""
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


class Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.done, self.label, self.t0 = total, 0, label, time.perf_counter()
        self.enabled = total > 0

    def step(self, n: int = 1) -> None:
        self.done += n
        if not self.enabled:
            return
        frac = self.done / self.total
        el = time.perf_counter() - self.t0
        eta = el / frac - el if frac > 0 else 0.0
        bar = "#" * int(30 * frac)
        sys.stderr.write(f"\r{self.label} [{bar:<30}] {self.done}/{self.total} {el:5.0f}s elapsed, ~{eta:4.0f}s left")
        sys.stderr.flush()
        if self.done == self.total:
            sys.stderr.write("\n")


def die_with_parent(parent_pid: int, poll_s: float = 0.25) -> None:
    """Process-pool initializer: end this worker as soon as the sweep's main process is gone
    (killed with SIGKILL it cannot tell its workers; they would otherwise run on, orphaned)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="die-with-parent", daemon=True).start()


def pmap(fn: Any, tasks: list[tuple[Any, ...]], jobs: int | None, label: str = "") -> list[Any]:
    """fn over the tasks (in processes when jobs allow), in order; with a label, a progress bar
    with elapsed time and ETA on stderr. Workers end with the plan's process (killed or not)."""
    bar = Progress(len(tasks) if label else 0, label)
    if (jobs or os.cpu_count() or 1) <= 1 or len(tasks) <= 1:
        out = []
        for t in tasks:
            out.append(fn(*t))
            bar.step()
        return out
    results: dict[int, Any] = {}
    with cf.ProcessPoolExecutor(max_workers=jobs or os.cpu_count(), initializer=die_with_parent,
                                initargs=(os.getpid(),)) as ex:
        futs = {ex.submit(fn, *t): i for i, t in enumerate(tasks)}
        try:
            for fut in cf.as_completed(futs):
                results[futs[fut]] = fut.result()
                bar.step()
        except KeyboardInterrupt:
            for f in futs:
                f.cancel()
            raise
    return [results[i] for i in range(len(tasks))]


def call(fn: Any, args: tuple[Any, ...]) -> Any:
    """fn(*args), in a worker: one pool maps different functions (`experiments.plan.run_tables`)."""
    return fn(*args)
