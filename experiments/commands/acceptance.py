"""`specrack acceptance`: fit acceptance to vLLM metrics, bench JSON, logs or CSV (experiments.acceptance)."""

from __future__ import annotations

from typing import Any

from experiments.acceptance import main_acceptance


def add_parser(sub: Any, name: str, summary: str) -> None:
    ac = sub.add_parser(name, help=summary,
                        description="Reads a Prometheus scrape of vLLM's /metrics (two scrapes are differenced), vllm bench "
                        "serve result JSON, vLLM 'SpecDecoding metrics:' log lines, or a CSV of accepted lengths per step "
                        "(request_id,class,step,k,accepted) or per request (request_id,class,num_drafts,num_draft_tokens,"
                        "num_accepted_tokens); fits each class and writes a [[workload.classes]] TOML fragment. With "
                        "--against, a second source is fitted and the scenario swept at both acceptances.")
    ac.add_argument("files", nargs="+", help="one source: 1-2 scrapes, bench JSON or log files, or CSVs")
    ac.add_argument("--against", nargs="+", metavar="FILE", help="a second source to compare (e.g. production)")
    ac.add_argument("--label", default=None, help="name of the first source (default: its first file's name)")
    ac.add_argument("--against-label", default=None, help="name of the second source")
    ac.add_argument("--class", dest="class_name", default=None, help="class name for sources without a class column")
    ac.add_argument("--k", type=int, default=None, help="drafted tokens per step, where the data do not say")
    ac.add_argument("--decay", type=float, default=None, help="hold the per-position decay at this value")
    ac.add_argument("--model", default=None, help="the model_name label to read from a multi-model scrape")
    ac.add_argument("--min-drafts", type=int, default=100, help="fewest verification steps per class to fit")
    ac.add_argument("--scenario", default=None, help="scenario to sweep with --against (default: the bundled default-mix)")
    ac.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a dotted key of the scenario")
    ac.add_argument("--out", default="results/acceptance")
    ac.add_argument("--quick", action="store_true", help="a short sweep (3 utilisations, 1 seed, 120 s runs)")
    ac.add_argument("--jobs", type=int, default=None)
    ac.set_defaults(fn=main_acceptance)
