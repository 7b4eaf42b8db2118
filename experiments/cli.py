"""The `specrack` command line. Bad input prints one line on stderr and exits 2, never a traceback."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from models.engines import DEFAULT_PROFILE, PROFILE_NAMES
from models.errors import ConfigError


def _model_arg(name: str) -> Any:
    """A catalogue name, a user-catalogue name (./models.toml) or a path to a config.json."""
    from pathlib import Path

    from models.catalog import MODELS, get_model
    from models.hf_config import find_user_model, load_config

    if name.endswith(".json"):
        return load_config(name)
    if name.lower() not in MODELS:
        found = find_user_model(name, (Path.cwd(),))
        if found is not None:
            return load_config(found, name.lower())
    return get_model(name)


def _cost(a: argparse.Namespace) -> int:
    from models.cost import CostModel
    from models.memory import plan_memory

    for name in ("batch", "context", "new_tokens"):
        v = getattr(a, name)
        if (name == "context" and v < 0) or (name != "context" and v < 1):
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} must be {'>= 0' if name == 'context' else '>= 1'}, got {v}")
    from models.engines import get_profile

    profile = get_profile(a.engine)
    cost = CostModel(_model_arg(a.model), a.gpu, a.tp, a.weights, a.kv_cache, engine=profile.name,
                     moe_routing_skew=a.moe_routing_skew, expert_parallel=a.expert_parallel)
    if a.draft:
        draft = _model_arg(a.draft)
        if draft.tokenizer_family != cost.model.tokenizer_family:
            raise ConfigError(f"--draft {draft.name} uses the {draft.tokenizer_family} tokenizer, "
                              f"{cost.model.name} the {cost.model.tokenizer_family} one; pick a draft of the same family")
    step = cost.uniform(a.batch, a.context, a.new_tokens)
    plan = plan_memory(cost, gpu_memory_utilization=a.gpu_memory_utilization)
    out: dict[str, Any] = step.as_dict()
    out.update(kv_capacity_tokens=plan.kv_capacity_tokens,
               max_num_seqs_at_context=plan.max_num_seqs_at_context(a.context + a.new_tokens),
               weight_bytes_per_gpu=cost.weight_bytes_per_gpu, kv_bytes_per_token_per_gpu=cost.kv_bytes_per_token_gpu,
               tokens_per_s=a.batch * a.new_tokens / step.total_s, model=cost.model.name, gpu=cost.gpu.name,
               tp=cost.tp, weights=cost.weights.name, kv_cache=cost.kv.name, engine=profile.name,
               seq_overhead_share=step.seq_overhead_s / step.total_s,
               efficiency_source=cost.eff.source)
    if cost.model.num_experts:  # expected distinct routed experts per MoE layer (models.cost.expected_experts)
        out["experts_touched"] = cost.touched_fraction(a.batch * a.new_tokens) * cost.model.num_experts
    if a.draft:
        d = CostModel(draft, a.gpu, a.tp, a.weights, a.kv_cache, engine=profile.name)
        ds = d.uniform(a.batch, a.context, 1, step_overhead=False)
        out["draft_pass_s"] = ds.total_s
        out["draft_cost_ratio"] = ds.total_s / cost.uniform(a.batch, a.context, 1).total_s
    if a.json:
        print(json.dumps(out, indent=2))
        return 0
    gib = 2**30
    print(f"{cost.model.name} on {a.tp}x {cost.gpu.name} ({cost.weights.name} weights, {cost.kv.name} KV, "
          f"engine profile {profile.name}: {profile.engine})")
    print(f"  batch {a.batch} x {a.new_tokens} new token(s) at context {a.context}")
    print(f"  step time      {step.total_s * 1e3:9.3f} ms   ({out['tokens_per_s']:.0f} tok/s)")
    print(f"    compute      {step.compute_s * 1e3:9.3f} ms   {step.flops / 1e12:.2f} TFLOP per GPU")
    print(f"    memory       {step.memory_s * 1e3:9.3f} ms   {step.bytes / 1e9:.2f} GB per GPU "
          f"(weights {step.weight_bytes / 1e9:.2f}, KV read {step.kv_read_bytes / 1e9:.2f}, "
          f"KV write {step.kv_write_bytes / 1e9:.3f}, activations {step.act_bytes / 1e9:.3f})")
    print(f"    comm         {step.comm_s * 1e3:9.3f} ms")
    print(f"    overhead     {step.overhead_s * 1e3:9.3f} ms   of which per-sequence host work "
          f"{step.seq_overhead_s * 1e3:.3f} ms ({out['seq_overhead_share']:.0%} of the step: "
          f"{cost.eff.seq_overhead_s * 1e6:.1f} us x {a.batch} sequences)")
    print(f"  memory: weights {cost.weight_bytes_per_gpu / gib:.1f} GiB/GPU, KV pool {plan.kv_pool_bytes / gib:.1f} GiB/GPU "
          f"= {plan.kv_capacity_tokens} tokens; {out['max_num_seqs_at_context']} sequences of "
          f"{a.context + a.new_tokens} tokens fit")
    if "experts_touched" in out:
        print(f"  MoE: {out['experts_touched']:.1f} of {cost.model.num_experts} routed experts touched per layer by "
              f"{a.batch * a.new_tokens} tokens ({cost.model.experts_per_token} per token)")
    if a.draft:
        print(f"  draft {a.draft}: {out['draft_pass_s'] * 1e3:.3f} ms per pass, cost ratio c = {out['draft_cost_ratio']:.3f}")
    return 0


def _load(a: argparse.Namespace):
    from sim.scenario import load_scenario, parse_set

    overrides = parse_set(a.set or [])
    if getattr(a, "seed", None) is not None:
        overrides["seed"] = a.seed
    return load_scenario(a.scenario, overrides)


def _validate(a: argparse.Namespace) -> int:
    from sim.deployment import build_runtime, check_fits
    from sim.simulate import capacity_for, closed_pool, offered_rate
    from sim.workload import generate

    sc = _load(a)
    rt = build_runtime(sc)
    # the checks a run makes before its first step: the offered rate, the request table, lengths
    wl = sc.workload
    pool = closed_pool(sc, rt) if wl.closed and wl.num_requests is None else None
    table = generate(wl, sc.seed, offered_rate(sc, capacity_for(sc)), pool=pool)
    check_fits(sc, rt, table.prompt_tokens.to_numpy(), table.output_tokens.to_numpy())
    print(f"{a.scenario}: ok ({sc.name}: {rt.num_replicas} replica(s) of {sc.deployment.model} TP{sc.deployment.tensor_parallel}"
          f" on {sc.rack.gpu}, KV {rt.plan.kv_capacity_tokens} tokens per replica)")
    if wl.rate_profile is not None:
        print(f"  rate profile: {wl.rate_profile.model_dump(mode='json')} -> {len(table)} requests over {wl.duration_s:g} s")
    if sc.autoscale is not None:
        from sim.simulate import replica_warmup_s

        print(f"  autoscale: {sc.autoscale.model_dump(mode='json', exclude_none=True)}, replicas "
              f"{sc.autoscale.min_replicas}-{sc.autoscale.max_replicas or rt.num_replicas}, warm-up {replica_warmup_s(sc):.0f} s")
    return 0


def _capacity(a: argparse.Namespace) -> int:
    from sim.simulate import capacity_summary

    sc = _load(a)
    out = {"scenario": sc.name, **capacity_summary(sc)}
    if a.json:
        print(json.dumps(out, indent=2))
        return 0
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
    if "speculative_capacity_rps" in out:
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


def _run(a: argparse.Namespace) -> int:
    from sim.simulate import capacity_for, simulate

    out_dir = Path(a.out)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out {out_dir}: exists and is not a folder; name a folder (it is created if missing)")
    sc = _load(a)
    res = simulate(sc, a.seed, capacity=capacity_for(sc, with_capacity=True), progress=True, with_capacity=True)
    if a.steps == "full":  # one row per engine step: fused runs of decode steps expanded
        from sim.metrics import expand_steps

        res = dataclasses.replace(res, steps=expand_steps(res.steps))
    out = res.write(a.out)
    s = res.summary
    verdict = {"stable": "stable", "overloaded": "OVERLOADED", "insufficient": "TOO FEW REQUESTS TO JUDGE",
               "unjudged": "STOPPED: SLO CERTAIN TO FAIL"}[s["verdict"]]
    print(f"{sc.name} seed {res.seed}: {s['completed_requests']}/{s['offered_requests']} requests, "
          f"{s['offered_rps']:.2f} req/s {'offered' if s['loop'] == 'open' else 'sent'}, {s['throughput_rps']:.2f} served, {s['throughput_tok_s']:.0f} tok/s; "
          f"{verdict}{' (' + s['verdict_reason'] + ')' if s['verdict_reason'] else ''} -> {out}")
    print(f"  capacity {s['capacity_rps']:.2f} req/s" + (f", with speculation {s['speculative_capacity_rps']:.2f}"
                                                        if "speculative_capacity_rps" in s else ""))
    if "cache_hit_rate" in s:  # prefix caching acted (requests carry block hashes)
        print(cache_line(s))
    if s["loop"] != "open":
        _print_benchmark(s)
    for name, c in s["slo"].items():
        metric, pct, _ = name.split("_")
        print(f"  SLO {name}: {pct} {metric.upper()} {c['value'] * 1e3:.1f} ms vs target {c['target'] * 1e3:.1f} ms "
              f"{'met' if c['met'] else 'MISSED'}")
    print(f"  SLO {'met' if s['slo_met'] else 'NOT met'}")
    iv = res.intervals
    if iv is not None and len(iv) > 1:  # the run over time: intervals.csv/.parquet and a time-series chart
        from experiments.report import timeseries_chart

        timeseries_chart(iv).write_html(out / "intervals.html", include_plotlyjs="inline")
        met = float(iv.slo_met.mean())
        print(f"  {len(iv)} intervals of {sc.sim.interval_s:g} s ({met:.0%} meet the SLO): replicas peak "
              f"{s['replicas_peak']}, mean {s['replicas_mean']:.2f}, {s['gpu_hours']:.1f} GPU-hours "
              f"({s['gpu_hours_per_day']:.0f} per day) -> {out / 'intervals.html'}")
    return 0


def cache_line(s: dict[str, Any]) -> str:
    """The prefix-cache figures of a summary, one line (docs/METRICS.md, 'Prefix caching')."""
    return (f"  prefix cache: {s['cache_hit_rate']:.1%} of prompt tokens cached ({s['cache_request_hit_rate']:.0%} of "
            f"requests hit), {s['prefill_tokens_saved']:,} prefill tokens saved, {s['prefill_tokens_computed']:,} "
            f"computed; TTFT mean {_ms(s['ttft_hit_s']['mean'])} on a hit, {_ms(s['ttft_miss_s']['mean'])} on a miss")


def _ms(x: float) -> str:
    """Seconds as '123 ms', or 'none' when no request had that (NaN)."""
    return f"{x * 1e3:.0f} ms" if x == x else "none"


def _print_benchmark(s: dict[str, Any]) -> None:
    """The headline figures of the summary's `benchmark` block, named and laid out as
    `vllm bench serve` prints them (whole run, no warm-up; docs/METRICS.md)."""
    b = s["benchmark"]
    if not b.get("completed"):
        print("  benchmark: no request completed")
        return
    clients = (f"{s['concurrency']} clients" if s["loop"] == "closed"
               else f"request rate {b['request_rate']:.2f}/s, max concurrency {s['concurrency']}")
    print(f"  as vllm bench serve reports it ({clients}; whole run, {b['completed']:.0f} requests, "
          f"{b['duration']:.1f} s):")
    print(f"    Request throughput (req/s):        {b['request_throughput']:10.2f}")
    print(f"    Output token throughput (tok/s):   {b['output_throughput']:10.2f}")
    print(f"    Total token throughput (tok/s):    {b['total_token_throughput']:10.2f}")
    for name, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL")):
        print(f"    {label:<4} mean / median / p99 (ms): {b[f'mean_{name}_ms']:10.2f} {b[f'median_{name}_ms']:10.2f} "
              f"{b[f'p99_{name}_ms']:10.2f}")


def _bench(a: argparse.Namespace) -> int:
    from experiments.bench import run_bench

    bad = sorted(set(a.fusion) - set("abc"))
    if bad:
        raise ConfigError(f"--fusion takes workload letters a, b and c run together (e.g. --fusion ab), got {a.fusion!r}")
    out = run_bench(quick=a.quick, fusion=a.fusion)
    print(json.dumps(out, indent=2))
    return 0


def _sweep(a: argparse.Namespace) -> int:
    from experiments.sweep import main_sweep

    return main_sweep(a)


def _plan(a: argparse.Namespace) -> int:
    from experiments.images import check_images, image_formats, plan_images
    from experiments.plan import main_plan

    formats = image_formats(a)
    if formats:
        check_images()  # before any run
    code = main_plan(a)
    images = plan_images(Path(a.out), formats) if code == 0 else []
    if formats:
        print("wrote " + ", ".join(map(str, images)) if images else "no figures to export (--no-analyses)")
    return code


def _image_flags(p: argparse.ArgumentParser) -> None:
    for fmt in ("png", "svg"):
        p.add_argument(f"--{fmt}", action="store_true",
                       help=f"also export the figures as {fmt.upper()} (needs Kaleido: pip install -e '.[images]')")


def _acceptance(a: argparse.Namespace) -> int:
    from experiments.acceptance import main_acceptance

    return main_acceptance(a)


def _calibrate(a: argparse.Namespace) -> int:
    from experiments.calibrate_report import main_calibrate

    return main_calibrate(a)


def _list(a: argparse.Namespace) -> int:
    from experiments.listing import rows, text_table

    print(json.dumps(rows(a.catalogue), indent=2) if a.json else text_table(a.catalogue))
    return 0


def _models_add(a: argparse.Namespace) -> int:
    from models.hf_config import add_user_model

    m, cat = add_user_model(a.path, a.name, a.catalog)
    moe = f", {m.num_experts} experts ({m.experts_per_token} per token)" if m.num_experts else ""
    attn = " MLA" if m.mla else (f", {m.num_sliding_layers} sliding-window layers ({m.sliding_window})"
                                 if m.num_sliding_layers else "")
    print(f"added '{m.name}' to {cat}: {m.params_total / 1e9:.2f}B parameters ({m.params_active / 1e9:.2f}B active), "
          f"{m.num_layers} layers{moe}{attn}, tokenizer {m.tokenizer_family}, weights {m.native_weights}")
    print(f"use it: deployment.model = \"{m.name}\" in a scenario next to {cat.name} or run from {cat.parent}")
    return 0


def _compare(a: argparse.Namespace) -> int:
    from experiments.compare import main_compare

    return main_compare(a)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specrack", description="Discrete-event simulator of LLM serving: speculative decoding vs distillation vs quantization")
    sub = p.add_subparsers(dest="cmd", required=True)

    c = sub.add_parser("cost", help="what-if step cost of one batch")
    c.add_argument("--model", default="llama-3.1-70b", help="a catalogue or ./models.toml name, or a config.json path")
    c.add_argument("--gpu", default="h100-sxm")
    c.add_argument("--tp", type=int, default=4)
    c.add_argument("--weights", default="bf16")
    c.add_argument("--kv-cache", default="bf16")
    c.add_argument("--engine", default=DEFAULT_PROFILE, help=f"engine profile: {', '.join(PROFILE_NAMES)} (default {DEFAULT_PROFILE})")
    c.add_argument("--batch", type=int, default=1)
    c.add_argument("--context", type=int, default=2048)
    c.add_argument("--new-tokens", type=int, default=1)
    c.add_argument("--draft", default=None, help="a draft model to price (checks the tokenizer family)")
    c.add_argument("--moe-routing-skew", type=float, default=0.0, help="MoE: Zipf exponent of expert popularity")
    c.add_argument("--expert-parallel", action="store_true", help="MoE: whole experts per GPU, all-to-all")
    c.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    c.add_argument("--json", action="store_true")
    c.set_defaults(fn=_cost)

    for name, fn, hlp in (("run", _run, "simulate one scenario"), ("validate", _validate, "check a scenario file"),
                          ("capacity", _capacity, "saturation capacity of a scenario's deployment")):
        s = sub.add_parser(name, help=hlp)
        s.add_argument("scenario")
        s.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a dotted key, e.g. workload.utilisation=0.7")
        s.add_argument("--seed", type=int, default=None)
        if name == "run":
            s.add_argument("--out", default="results/run")
            s.add_argument("--steps", choices=("runs", "full"), default="runs",
                           help="steps.parquet: fused decode runs as one run-length row each (default), or one row per step")
        if name == "capacity":
            s.add_argument("--json", action="store_true")
        s.set_defaults(fn=fn)

    b = sub.add_parser("bench", help="engine speed against a bare SimPy loop")
    b.add_argument("--json", action="store_true", help="(always JSON)")
    b.add_argument("--quick", action="store_true", help="1k and 10k requests instead of 10k and 100k")
    b.add_argument("--fusion", default="", metavar="WORKLOADS",
                   help="step fusion on vs off on issue 12's workloads instead (a, b, c; e.g. --fusion abc)")
    b.set_defaults(fn=_bench)

    w = sub.add_parser("sweep", help="utilisation sweep over strategies, with report (default: built-in experiment)")
    w.add_argument("sweep_file", nargs="?", default=None)
    w.add_argument("--out", default="results")
    w.add_argument("--quick", action="store_true", help="a small version that finishes in well under a minute")
    w.add_argument("--jobs", type=int, default=None, help="parallel processes (default: all cores)")
    w.add_argument("--executor", default="process", choices=["process", "serial", "dask-local", "dask"],
                   help="process: local process pool (default); dask-local: a Dask LocalCluster; dask: --scheduler")
    w.add_argument("--scheduler", default=None, help="Dask scheduler address for --executor dask, e.g. tcp://10.0.0.5:8786")
    w.add_argument("--scheduler-timeout", type=float, default=10.0, help="seconds to wait for the Dask scheduler")
    _image_flags(w)
    w.set_defaults(fn=_sweep)

    pl = sub.add_parser("plan", help="capacity plan: smallest rack per strategy meeting the SLO, with cost and quality")
    pl.add_argument("plan_file")
    pl.add_argument("--out", default="results/plan")
    pl.add_argument("--quick", action="store_true", help="shorter runs and coarser analyses")
    pl.add_argument("--jobs", type=int, default=None)
    pl.add_argument("--no-analyses", action="store_true", help="only the ranked plan (no curves, map, shift)")
    _image_flags(pl)
    pl.set_defaults(fn=_plan)

    ac = sub.add_parser("acceptance", help="fit acceptance (mean, spread, decay) to vLLM metrics, bench JSON, logs or CSV",
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
    ac.set_defaults(fn=_acceptance)

    ca = sub.add_parser("calibrate", help="fit an engine profile's software factors to measured benchmark files "
                        "(vLLM `bench serve --save-result --save-detailed` JSON or a per-request CSV)")
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
    ca.set_defaults(fn=_calibrate)

    li = sub.add_parser("list", help="the catalogues: GPUs, models, the sweep's built-in strategies, engine profiles")
    li.add_argument("catalogue", choices=["gpus", "models", "strategies", "profiles"])
    li.add_argument("--json", action="store_true", help="records as JSON instead of a table")
    li.set_defaults(fn=_list)

    mo = sub.add_parser("models", help="the user model catalogue (models.toml): add a Hugging Face config.json")
    mo_sub = mo.add_subparsers(dest="models_cmd", required=True)
    ma = mo_sub.add_parser("add", help="register a config.json on disk under a name (no download)")
    ma.add_argument("path", help="a Hugging Face config.json")
    ma.add_argument("--name", default=None, help="the name scenarios use (default: the config's folder name)")
    ma.add_argument("--catalog", default="models.toml",
                    help="the catalogue file to write (default ./models.toml; scenarios look next to their file, "
                         "then in the working directory)")
    ma.set_defaults(fn=_models_add)

    co = sub.add_parser("compare", help="two or more sweep or plan output folders side by side (compare.csv, compare.html)")
    co.add_argument("runs", nargs="+", metavar="RUN", help="sweep output folders (results.parquet) or plan output folders (plan.csv)")
    co.add_argument("--out", default="results/compare")
    _image_flags(co)
    co.set_defaults(fn=_compare)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)
    try:
        return int(a.fn(a) or 0)
    except ConfigError as err:
        print(f"specrack: error: {err}", file=sys.stderr)
        return 2
    except FileNotFoundError as err:
        print(f"specrack: error: file not found: {err.filename}", file=sys.stderr)
        return 2
    except OSError as err:  # a folder where a file is due, no permission, disk full...
        where = f": {err.filename}" if err.filename else ""
        print(f"specrack: error: {err.strerror or err}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specrack: interrupted", file=sys.stderr)
        return 130
    except MemoryError:
        print("specrack: error: out of memory; shorten the run (duration_s, rate_rps) or the sweep", file=sys.stderr)
        return 2
    except Exception as err:  # last resort: never a traceback (SPECRACK_DEBUG=1 shows it)
        if os.environ.get("SPECRACK_DEBUG"):
            raise
        text = (str(err).splitlines() or [""])[0]
        print(f"specrack: internal error: {type(err).__name__}: {text} (please report it; SPECRACK_DEBUG=1 shows "
              "the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
