"""Catalogues as data: GPUs, model architectures and numeric formats, each figure with its source.

Architecture is kept apart from precision: a quantized model is the same `LLM` with another
`WeightFormat`, and a distilled model is another `LLM`. Derived quantities (bytes per token of KV,
matmul parameters) are pure functions of these records.

Units: bytes, bytes/s, FLOP/s, seconds. HBM capacities are given by vendors in binary GB
(an "80 GB" H100 reports 81,559 MiB), so `hbm_bytes = hbm_gib * 2**30`; bandwidths and peaks are
decimal (TB/s = 1e12 B/s, TFLOP/s = 1e12 FLOP/s).
"""

from __future__ import annotations

from dataclasses import dataclass

from models.errors import unknown

GIB = 2**30


@dataclass(frozen=True)
class GPU:
    """One accelerator. Peaks are dense (vendor pages print 2x 'with sparsity')."""

    name: str
    family: str
    hbm_gib: float
    mem_bw_bytes_s: float
    bf16_flops: float
    fp8_flops: float | None
    int8_ops: float
    interconnect_bytes_s: float  # per GPU, one direction of the all-reduce fabric
    usd_per_gpu_hour: float  # documented default; always a user input in scenarios
    source: str
    tdp_w: float | None = None  # board power (TDP), watts, from the datasheet

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gib * GIB


_HW = "shared/reference/hardware.csv (vendor datasheets; dense peaks)"

GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        GPU("a100-80gb", "ampere", 80, 2.039e12, 312e12, None, 624e12, 600e9, 1.99,
            f"{_HW}; price: mid of 1.49-2.49 on-demand (pricegpu.pages.dev, early 2026)", tdp_w=400),
        GPU("h100-sxm", "hopper", 80, 3.35e12, 989.4e12, 1978.9e12, 1978.9e12, 900e9, 2.69,
            f"{_HW}; price: RunPod 2.69 (deploybase.ai, 2026)", tdp_w=700),
        GPU("h200", "hopper", 141, 4.8e12, 989.4e12, 1978.9e12, 1978.9e12, 900e9, 3.59,
            f"{_HW}; INT8 inferred equal to H100 (same die); price: RunPod 3.59 (deploybase.ai)", tdp_w=700),
        GPU("b200", "blackwell", 180, 8.0e12, 2250e12, 4500e12, 4500e12, 1800e9, 5.98,
            f"{_HW}; HGX B200 at 1000 W; price: RunPod 5.98 (deploybase.ai)", tdp_w=1000),
        GPU("l40s", "ada", 48, 0.864e12, 362.05e12, 733e12, 733e12, 32e9, 1.10,
            f"{_HW}; PCIe Gen4 x16, 64 GB/s bidirectional = 32 GB/s each way; price: 0.95-1.20 (yobitel.com, 2026)", tdp_w=350),
        GPU("mi300x", "cdna3", 192, 5.3e12, 1307.4e12, 2614.9e12, 2614.9e12, 896e9, 1.85,
            f"{_HW}; AMD ROCm docs dense peaks; price: Vultr 1.85 (gpu.blog)", tdp_w=750),
    )
}


@dataclass(frozen=True)
class LLM:
    """A transformer's architecture, transcribed from its config.json. No precision here."""

    name: str
    hf_id: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    params_total: int
    params_active: int  # per token; differs from total for mixture-of-experts
    tokenizer_family: str
    num_experts: int = 0
    experts_per_token: int = 0
    source: str = "shared/reference/models.json (config.json of the Hugging Face repository)"

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def matmul_params_active(self) -> int:
        """Parameters multiplied per token: all active weights except the input-embedding lookup
        (a tied embedding is still used once, as the LM head)."""
        if self.tie_word_embeddings:
            return self.params_active
        return self.params_active - self.embedding_params

    @property
    def expert_params(self) -> int:
        """Parameters of all routed experts together (0 for dense models)."""
        if not self.num_experts:
            return 0
        return self.num_layers * self.num_experts * 3 * self.hidden_size * self.intermediate_size

    def kv_elements_per_token(self) -> int:
        """K and V elements stored per token over all layers (GQA-aware)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


_LLAMA3 = "llama3"  # one tokenizer for Llama-3.x (3.2-1B/3B can draft for 3.1-8B/70B/405B)
_QWEN25 = "qwen2.5"  # shared tokenizer (vocabulary padded differently in small vs large models)
_MISTRAL = "mistral-v0.1"  # Mistral-7B-v0.1 and Mixtral-8x7B-v0.1 share vocab 32000

MODELS: dict[str, LLM] = {
    m.name: m
    for m in (
        LLM("llama-3.1-8b", "meta-llama/Llama-3.1-8B", 32, 4096, 32, 8, 128, 14336, 128256, False,
            8030261248, 8030261248, _LLAMA3),
        LLM("llama-3.1-70b", "meta-llama/Llama-3.1-70B", 80, 8192, 64, 8, 128, 28672, 128256, False,
            70553706496, 70553706496, _LLAMA3),
        LLM("llama-3.1-405b", "meta-llama/Llama-3.1-405B", 126, 16384, 128, 8, 128, 53248, 128256, False,
            405853388800, 405853388800, _LLAMA3),
        LLM("llama-3.2-1b", "meta-llama/Llama-3.2-1B", 16, 2048, 32, 8, 64, 8192, 128256, True,
            1235814400, 1235814400, _LLAMA3),
        LLM("llama-3.2-3b", "meta-llama/Llama-3.2-3B", 28, 3072, 24, 8, 128, 8192, 128256, True,
            3212749824, 3212749824, _LLAMA3),
        LLM("qwen2.5-0.5b", "Qwen/Qwen2.5-0.5B", 24, 896, 14, 2, 64, 4864, 151936, True,
            494032768, 494032768, _QWEN25),
        LLM("qwen2.5-1.5b", "Qwen/Qwen2.5-1.5B", 28, 1536, 12, 2, 128, 8960, 151936, True,
            1543714304, 1543714304, _QWEN25),
        LLM("qwen2.5-7b", "Qwen/Qwen2.5-7B", 28, 3584, 28, 4, 128, 18944, 152064, False,
            7615616512, 7615616512, _QWEN25),
        LLM("qwen2.5-72b", "Qwen/Qwen2.5-72B", 80, 8192, 64, 8, 128, 29568, 152064, False,
            72706203648, 72706203648, _QWEN25),
        LLM("mistral-7b", "mistralai/Mistral-7B-v0.1", 32, 4096, 32, 8, 128, 14336, 32000, False,
            7241732096, 7241732096, _MISTRAL),
        LLM("mixtral-8x7b", "mistralai/Mixtral-8x7B-v0.1", 32, 4096, 32, 8, 128, 14336, 32000, False,
            46702792704, 12879925248, _MISTRAL, num_experts=8, experts_per_token=2),
        # Used only by the MLPerf calibration anchors. Same shape as Llama-3.1-70B with vocab 32000;
        # parameter count computed from that shape (80 x (4 x 8192^2 x 1.25 ... ) + embeddings).
        LLM("llama-2-70b", "meta-llama/Llama-2-70b-hf", 80, 8192, 64, 8, 128, 28672, 32000, False,
            68976648192, 68976648192, "llama2",
            source="config.json of meta-llama/Llama-2-70b-hf (80 layers, 8192 hidden, 8 KV heads, "
                   "28672 FFN, vocab 32000); params computed from the shape"),
    )
}


@dataclass(frozen=True)
class WeightFormat:
    """How weights are stored and which tensor-core peak their matmuls run at."""

    name: str
    bytes_per_param: float  # including quantisation scales
    compute: str  # "bf16" | "fp8" | "int8": which GPU peak applies to the matmuls
    dequant_flops_factor: float  # extra compute for dequantisation (W4A16 dequantises in the kernel)
    source: str


WEIGHT_FORMATS: dict[str, WeightFormat] = {
    f.name: f
    for f in (
        WeightFormat("bf16", 2.0, "bf16", 1.0, "IEEE bfloat16: 2 bytes"),
        WeightFormat("fp8", 1.0, "fp8", 1.0,
                     "W8A8-FP8 (e4m3) with per-channel scales (negligible bytes); FP8 tensor cores "
                     "(vLLM FP8 docs)"),
        WeightFormat("int8", 1.0, "int8", 1.0,
                     "W8A8-INT8 SmoothQuant: INT8 tensor cores (SmoothQuant README)"),
        WeightFormat("int4", 0.5 + 2.0 / 128, "bf16", 1.1,
                     "W4A16 GPTQ/AWQ: 4-bit weights plus one bf16 scale per group of 128 "
                     "(0.5156 B/param); BF16 tensor cores after in-kernel dequantisation, "
                     "taken as +10% matmul work (Marlin kernels)"),
    )
}


@dataclass(frozen=True)
class KVFormat:
    name: str
    bytes_per_element: float
    source: str


KV_FORMATS: dict[str, KVFormat] = {
    "bf16": KVFormat("bf16", 2.0, "bfloat16 KV cache"),
    "fp8": KVFormat("fp8", 1.0, "FP8 e4m3 KV cache with per-tensor scale (vLLM kv_cache_dtype=fp8)"),
}


def get_gpu(name: str) -> GPU:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise unknown("gpu", name, tuple(GPUS)) from None


def get_model(name: str) -> LLM:
    try:
        return MODELS[name.lower()]
    except KeyError:
        raise unknown("model", name, tuple(MODELS)) from None


def get_weight_format(name: str) -> WeightFormat:
    try:
        return WEIGHT_FORMATS[name.lower()]
    except KeyError:
        raise unknown("weights format", name, tuple(WEIGHT_FORMATS)) from None


def get_kv_format(name: str) -> KVFormat:
    try:
        return KV_FORMATS[name.lower()]
    except KeyError:
        raise unknown("kv_cache format", name, tuple(KV_FORMATS)) from None


def kv_bytes_per_token(model: LLM, kv: KVFormat) -> float:
    """KV-cache bytes per token for the whole model (all layers, K and V, all KV heads)."""
    return model.kv_elements_per_token() * kv.bytes_per_element


def weight_bytes(model: LLM, weights: WeightFormat) -> float:
    """Bytes of all weights (embeddings and LM head kept in bf16, as quantisers do)."""
    emb = model.embedding_params * (1 if model.tie_word_embeddings else 2)
    return (model.params_total - emb) * weights.bytes_per_param + emb * 2.0


def peak_flops(gpu: GPU, weights: WeightFormat) -> float:
    """Dense tensor-core peak that the matmuls of this weight format run at on this GPU."""
    if weights.compute == "fp8":
        if gpu.fp8_flops is None:
            from models.errors import ConfigError

            raise ConfigError(f"weights 'fp8' need FP8 tensor cores, which {gpu.name} lacks; use weights = 'int8' or 'int4'")
        return gpu.fp8_flops
    if weights.compute == "int8":
        return gpu.int8_ops
    return gpu.bf16_flops
