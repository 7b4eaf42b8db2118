"""Memory planner: what is left of each GPU's HBM for the KV cache, and how many sequences fit.

    usable      = hbm_bytes x gpu_memory_utilization               (vLLM default 0.9)
    kv_pool     = usable - weights/GPU - activation reserve - runtime reserve - extra (a draft)
    kv_tokens   = floor(kv_pool / (KV bytes per token per GPU)), rounded down to whole blocks

The activation reserve is the peak of one forward pass over `max_num_batched_tokens` tokens
(hidden states, the widest MLP intermediate, fp32 logits for `max_num_seqs` rows), which is what
vLLM's profiling run measures; the runtime reserve (CUDA context, NCCL and CUDA-graph buffers) is
taken as 1.5 GiB per GPU, the order vLLM logs as "non-torch memory" on Hopper. Sliding-window
layers (gpt-oss) keep at most their window of each sequence: their KV is reserved as
max_num_seqs x window tokens (in `extra_bytes`), and the paged blocks hold the full layers' KV.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from models.catalog import GIB
from models.cost import CostModel
from models.errors import ConfigError

BLOCK_SIZE: Final = 16  # tokens per paged KV block, vLLM's default
RUNTIME_RESERVE_BYTES = 1.5 * GIB


@dataclass(frozen=True)
class MemoryPlan:
    usable_bytes: float
    weight_bytes: float
    activation_bytes: float
    runtime_bytes: float
    extra_bytes: float
    kv_pool_bytes: float
    kv_bytes_per_token: float  # per GPU, target plus any draft stored alongside
    kv_capacity_tokens: int
    num_blocks: int

    def max_num_seqs_at_context(self, context_tokens: int) -> int:
        """Sequences of this length (prompt + output) that fit at once."""
        blocks_per_seq = -(-max(1, int(context_tokens)) // BLOCK_SIZE)
        return self.num_blocks // blocks_per_seq

    def as_dict(self) -> dict[str, float]:
        return dict(self.__dict__)


def plan_memory(
    cost: CostModel,
    *,
    gpu_memory_utilization: float = 0.9,
    max_num_batched_tokens: int = 8192,
    max_num_seqs: int = 256,
    extra_bytes: float = 0.0,
    extra_kv_bytes_per_token: float = 0.0,
) -> MemoryPlan:
    """Plan one replica's memory (per GPU). `extra_*` carry a colocated draft's weights and KV."""
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    m, tp = cost.model, cost.tp
    usable = cost.gpu.hbm_bytes * gpu_memory_utilization
    act = max_num_batched_tokens * (4 * m.hidden_size + 2 * m.intermediate_size / tp) * 2.0
    act += max_num_seqs * m.vocab_size / tp * 4.0
    kv_tok = cost.kv_bytes_per_token_gpu + extra_kv_bytes_per_token
    # sliding-window layers hold at most their window per running sequence: reserved apart
    extra_bytes = extra_bytes + cost.window_kv_bytes(max_num_seqs)
    pool = usable - cost.weight_bytes_per_gpu - act - RUNTIME_RESERVE_BYTES - extra_bytes
    if pool < kv_tok * BLOCK_SIZE:
        need = cost.weight_bytes_per_gpu + act + RUNTIME_RESERVE_BYTES + extra_bytes + kv_tok * BLOCK_SIZE
        raise ConfigError(
            f"{m.name} ({cost.weights.name}) does not fit on {cost.gpu.name} at tensor_parallel={tp}: "
            f"needs {need / GIB:.1f} GiB per GPU, {usable / GIB:.1f} GiB usable "
            f"(short by {(need - usable) / GIB:.1f} GiB); raise tensor_parallel or use smaller weights"
        )
    blocks = int(pool // (kv_tok * BLOCK_SIZE))
    return MemoryPlan(usable, cost.weight_bytes_per_gpu, act, RUNTIME_RESERVE_BYTES, extra_bytes,
                      pool, kv_tok, blocks * BLOCK_SIZE, blocks)
