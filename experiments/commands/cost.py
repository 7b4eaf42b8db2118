"""`specrack cost`: the what-if step cost of one batch."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from models.catalog import MODELS, get_model
from models.cost import CostModel
from models.engines import DEFAULT_PROFILE, PROFILE_NAMES, get_profile
from models.errors import ConfigError
from models.hf_config import find_user_model, load_config
from models.memory import plan_memory


def add_parser(sub: Any, name: str, summary: str) -> None:
    c = sub.add_parser(name, help=summary)
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
    c.set_defaults(fn=run)


def model_arg(name: str) -> Any:
    """A catalogue name, a user-catalogue name (./models.toml) or a path to a config.json."""
    if name.endswith(".json"):
        return load_config(name)
    if name.lower() not in MODELS:
        found = find_user_model(name, (Path.cwd(),))
        if found is not None:
            return load_config(found, name.lower())
    return get_model(name)


def run(a: argparse.Namespace) -> int:
    for name in ("batch", "context", "new_tokens"):
        v = getattr(a, name)
        if (name == "context" and v < 0) or (name != "context" and v < 1):
            flag = "--" + name.replace("_", "-")
            raise ConfigError(f"{flag} must be {'>= 0' if name == 'context' else '>= 1'}, got {v}")
    profile = get_profile(a.engine)
    cost = CostModel(model_arg(a.model), a.gpu, a.tp, a.weights, a.kv_cache, engine=profile.name,
                     moe_routing_skew=a.moe_routing_skew, expert_parallel=a.expert_parallel)
    if a.draft:
        draft = model_arg(a.draft)
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
