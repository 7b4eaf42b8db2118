"""`specrack capacity`: the saturation capacity of a scenario's deployment."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from experiments.commands.common import load, scenario_parser
from sim.capacity import CACHE_ENV, CapacityStore, default_cache_dir
from sim.simulate import capacity_summary


def add_parser(sub: Any, name: str, summary: str) -> None:
    s = scenario_parser(sub, name, summary)
    s.add_argument("--json", action="store_true")
    s.add_argument("--no-cache", action="store_true",
                   help="measure anew, neither reading nor writing the capacity cache "
                        "($SPECRACK_CAPACITY_CACHE; default ~/.cache/specrack/capacity)")
    s.set_defaults(fn=run)


def run(a: argparse.Namespace) -> int:
    sc = load(a)
    store = CapacityStore(None if a.no_cache else default_cache_dir())
    out = {"scenario": sc.name, **capacity_summary(sc, store)}
    if store.write_error is not None:
        print(f"specrack: note: capacity not cached ({store.write_error}); set {CACHE_ENV} to a writable folder, "
              "or to off", file=sys.stderr)
    if a.json:
        print(json.dumps(out, indent=2))
        return 0
    if sc.disaggregation is not None:
        print(f"{sc.name}: a disaggregated rack's own capacity is not measured (a closed-loop ladder runs one "
              "aggregated engine); the aggregated rack on its GPUs, the reference for its utilisation:")
    print(f"{sc.name}: capacity {out['capacity_rps']:.3f} req/s, {out['capacity_tok_s']:.0f} output tok/s "
          f"(speculation off; the reference for utilisation)")
    if out["kv_sequences"] < out["batch_slots"]:
        print(f"  the paged KV holds about {out['kv_sequences']} sequences of the mean length, fewer than the "
              f"{out['batch_slots']} batch slots")
    if out["collapse"]:
        print(f"  COLLAPSE: throughput peaks at {out['peak_rps']:.3f} req/s ({out['peak_concurrency']} requests in "
              f"system) and falls {1 - out['full_batch_rps'] / out['peak_rps']:.0%} at full load"
              + (" (preemption: the KV runs out)" if out["kv_sequences"] < out["batch_slots"] else "")
              + "; load between the two is metastable, so the capacity is the full-load figure")
    if "speculative_capacity_rps" in out and out["speculative_capacity_rps"] == out["speculative_capacity_rps"]:
        print(f"  with speculation: sustainable {out['speculative_capacity_rps']:.3f} req/s "
              f"({out['speculative_capacity_tok_s']:.0f} tok/s; closed-loop peak {out['speculative_peak_rps']:.3f} req/s "
              f"at {out['speculative_peak_concurrency']} requests in system); at full batch "
              f"{out['speculative_full_batch_rps']:.3f} req/s")
        if out["speculative_collapse"]:
            print(f"  COLLAPSE: throughput falls {1 - out['speculative_full_batch_rps'] / out['speculative_peak_rps']:.0%} "
                  f"from the peak to the full batch; offered load between {out['speculative_full_batch_rps']:.2f} and "
                  f"{out['speculative_peak_rps']:.2f} req/s is metastable (a burst tips it into overload), so the "
                  "capacity is the full-load figure")
    return 0
