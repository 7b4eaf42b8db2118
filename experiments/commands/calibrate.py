"""`specrack calibrate`: fit an engine profile's software factors to benchmark files (experiments.calibrate_report)."""

from __future__ import annotations

from typing import Any

from experiments.calibrate_report import main_calibrate


def add_parser(sub: Any, name: str, summary: str) -> None:
    ca = sub.add_parser(name, help=summary)
    ca.add_argument("bench", nargs="+", metavar="BENCH", help="benchmark files, one load point each (JSON with "
                    "--append-result: one per line)")
    ca.add_argument("--scenario", default=None, help="take the deployment (model, GPU, TP, engine, settings) from a scenario")
    ca.add_argument("--model", default=None, help="catalogue model (default: the scenario's, or guessed from model_id)")
    ca.add_argument("--gpu", default=None, help="GPU the benchmark ran on (default: the scenario's)")
    ca.add_argument("--tp", type=int, default=None, help="tensor-parallel size (default: the scenario's, else 1)")
    ca.add_argument("--engine", default=None, help="engine profile to fit (default: the scenario's, else vllm-v1)")
    ca.add_argument("--set", action="append", metavar="KEY=VALUE",
                    help="override a deployment setting, e.g. deployment.max_num_seqs=256")
    ca.add_argument("--fit", default="step_overhead_s,seq_overhead_s,frontend_s",
                    help="software factors to fit, comma-separated (step_overhead_s, layer_overhead_s, seq_overhead_s, "
                         "frontend_s, draft_pass_overhead_s; docs/CALIBRATION.md)")
    ca.add_argument("--seeds", default=None, help="simulation seeds averaged per load point, e.g. 1,2 (default 1,2; --quick 1)")
    ca.add_argument("--request-rate", default=None, help="load of CSV files: requests/s or inf")
    ca.add_argument("--max-concurrency", type=int, default=None, help="load of CSV files: concurrent clients")
    ca.add_argument("--burstiness", type=float, default=None, help="load of CSV files: gamma shape of the send times (1: Poisson)")
    ca.add_argument("--out", default="results/calibrate")
    ca.add_argument("--quick", action="store_true", help="one seed and fewer fit iterations")
    ca.set_defaults(fn=main_calibrate)
