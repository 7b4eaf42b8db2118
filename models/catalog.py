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

from models.errors import ConfigError, unknown

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
    tdp_w: float = float("nan")  # board power (TDP) from the datasheet: what a busy GPU draws
    fp4_flops: float | None = None  # dense FP4 tensor-core peak (Blackwell); None: no FP4 tensor cores
    # host (CPU) memory per GPU, what a KV offload tier (deployment.host_kv_gib) may use at most: the
    # default is a DGX-class server's 2 TiB of system memory over its 8 GPUs (NVIDIA DGX A100 640GB,
    # DGX H100 and DGX H200 datasheets: "System memory 2TB"; 32 x 64 GB DIMMs in a DGX H100)
    host_mem_gib: float = 256.0
    # host link per GPU, one direction, achieved: PCIe Gen5 x16 is 64 GB/s per direction in theory
    # (NVIDIA's H100 datasheet prints 128 GB/s both ways); KV blocks copied between pinned host memory
    # and an H100 reach about 50 GB/s in one direction, by DMA or by a copy kernel (vLLM blog, "Inside
    # vLLM's New KV Offloading Connector", 2026-01-08, vllm-project.github.io _posts at 4fc67010;
    # 2 MB blocks; smaller blocks get less)
    host_link_bytes_s: float = 50e9

    @property
    def hbm_bytes(self) -> float:
        return self.hbm_gib * GIB


_HW = "shared/reference/hardware.csv (vendor datasheets; dense peaks; tdp_w)"

GPUS: dict[str, GPU] = {
    g.name: g
    for g in (
        GPU("a100-80gb", "ampere", 80, 2.039e12, 312e12, None, 624e12, 600e9, 1.99,
            f"{_HW}; price: mid of 1.49-2.49 on-demand (pricegpu.pages.dev, early 2026)", tdp_w=400,
            host_link_bytes_s=32e9),  # PCIe Gen4 x16: 64 GB/s both ways (NVIDIA A100 datasheet), 32 each way
        GPU("h100-sxm", "hopper", 80, 3.35e12, 989.4e12, 1978.9e12, 1978.9e12, 900e9, 2.69,
            f"{_HW}; price: RunPod 2.69 (deploybase.ai, 2026)", tdp_w=700),
        GPU("h200", "hopper", 141, 4.8e12, 989.4e12, 1978.9e12, 1978.9e12, 900e9, 3.59,
            f"{_HW}; INT8 inferred equal to H100 (same die); price: RunPod 3.59 (deploybase.ai)", tdp_w=700),
        GPU("b200", "blackwell", 180, 8.0e12, 2250e12, 4500e12, 4500e12, 1800e9, 5.98,
            f"{_HW}; HGX B200 at 1000 W, FP4 9000 dense (hardware.csv notes); price: RunPod 5.98 (deploybase.ai)",
            tdp_w=1000, fp4_flops=9000e12),  # host: DGX B200 datasheet, 2 TB (up to 4 TB) for 8 GPUs; PCIe Gen5
        GPU("l40s", "ada", 48, 0.864e12, 362.05e12, 733e12, 733e12, 32e9, 1.10,
            f"{_HW}; PCIe Gen4 x16, 64 GB/s bidirectional = 32 GB/s each way; price: 0.95-1.20 (yobitel.com, 2026)", tdp_w=350,
            host_link_bytes_s=32e9),  # (host memory: a PCIe server's; the DGX-class default is an assumption)
        GPU("mi300x", "cdna3", 192, 5.3e12, 1307.4e12, 2614.9e12, 2614.9e12, 896e9, 1.85,
            f"{_HW}; AMD ROCm docs dense peaks; price: Vultr 1.85 (gpu.blog)", tdp_w=750),
        # (MI300X / MI325X: PCIe Gen5 x16 host link per AMD's datasheets; host memory: the DGX-class default,
        # an assumption for an 8-GPU OEM server)
        # not in shared/reference: vendor spec sheets, dense peaks (sparse / 2); prices are placeholders
        # (always a user input: rack.usd_per_gpu_hour)
        GPU("h20", "hopper", 96, 4.0e12, 148e12, 296e12, 296e12, 900e9, 1.50,
            "NVIDIA HGX H20 spec sheet (96 GB HBM3, 4.0 TB/s, FP16/BF16 148 TFLOPS and FP8/INT8 296 dense, "
            "NVLink 900 GB/s, 400 W); price: assumption, below H100", tdp_w=400),
        GPU("gb200", "blackwell", 186, 8.0e12, 2500e12, 5000e12, 5000e12, 1800e9, 6.50,
            "NVIDIA GB200 NVL72 spec sheet per GPU (rack 13.4 TB HBM3e and 576 TB/s over 72 GPUs; "
            "BF16 5 / FP8 10 / FP4 20 PFLOPS sparse = 2.5 / 5 / 10 dense; NVLink 5 1.8 TB/s; 1200 W per "
            "GPU as the share of a 2700 W superchip); price: assumption", tdp_w=1200, fp4_flops=10000e12,
            # host: each Grace CPU has 480 GB LPDDR5X for its 2 GPUs, over NVLink-C2C at 900 GB/s both
            # ways (NVIDIA GB200 NVL72 spec sheet): 240 GB and 450 GB/s each way per GPU
            host_mem_gib=240e9 / GIB, host_link_bytes_s=450e9),
        GPU("mi325x", "cdna3", 256, 6.0e12, 1307.4e12, 2614.9e12, 2614.9e12, 896e9, 2.25,
            "AMD Instinct MI325X datasheet (256 GB HBM3E, 6.0 TB/s, BF16 1307.4 / FP8 2614.9 TFLOPS dense, "
            "Infinity Fabric as MI300X, 1000 W); price: assumption, MI300X + 20%", tdp_w=1000),
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
    num_experts: int = 0  # routed experts per MoE layer
    experts_per_token: int = 0
    source: str = "shared/reference/models.json (config.json of the Hugging Face repository)"
    # mixture of experts (models.hf_config reads these from config.json; docs/MODEL.md)
    moe_intermediate_size: int = 0  # one expert's FFN width (0: intermediate_size, as Mixtral)
    num_dense_layers: int = 0  # layers of a MoE model with a dense MLP instead (DeepSeek first_k_dense_replace)
    num_shared_experts: int = 0  # always-active experts per MoE layer (DeepSeek n_shared_experts)
    expert_params_each: int = 0  # parameters of one routed expert (0: 3 x hidden x moe width, no biases)
    # multi-head latent attention (DeepSeek): the KV cache holds kv_lora_rank + qk_rope_head_dim per token and layer
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    # sliding-window attention: num_sliding_layers of the layers keep only the last sliding_window tokens
    sliding_window: int = 0
    num_sliding_layers: int = 0
    mtp_layers: int = 0  # native multi-token-prediction modules (DeepSeek num_nextn_predict_layers), not in params
    native_weights: str = "bf16"  # the format its checkpoint ships in (config.json torch_dtype / quantization_config)

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
    def moe_layers(self) -> int:
        """Layers whose MLP is a routed mixture of experts (0 for dense models)."""
        return self.num_layers - self.num_dense_layers if self.num_experts else 0

    @property
    def expert_ff(self) -> int:
        """FFN width of one expert (routed or shared)."""
        return self.moe_intermediate_size or self.intermediate_size

    @property
    def params_per_expert(self) -> int:
        return self.expert_params_each or 3 * self.hidden_size * self.expert_ff

    @property
    def expert_params(self) -> int:
        """Parameters of all routed experts together (0 for dense models); shared experts are
        dense weights (every token reads them)."""
        return self.moe_layers * self.num_experts * self.params_per_expert

    @property
    def mla(self) -> bool:
        """Multi-head latent attention (DeepSeek-V2/V3): a compressed KV cache."""
        return self.kv_lora_rank > 0

    def kv_elements_per_token_layer(self) -> int:
        """KV elements one token stores in one layer: K and V of every KV head (GQA), or the
        compressed latent plus the decoupled RoPE key for MLA (shared by all heads)."""
        if self.mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    def kv_elements_per_token(self) -> int:
        """KV elements stored per token over all layers, as if every layer kept the whole context
        (a sliding-window layer keeps at most its window: models.cost bounds it)."""
        return self.num_layers * self.kv_elements_per_token_layer()


_LLAMA3 = "llama3"  # one tokenizer for Llama-3.x (3.2-1B/3B can draft for 3.1-8B/70B/405B)
_QWEN25 = "qwen2.5"  # shared tokenizer (vocabulary padded differently in small vs large models)
_MISTRAL = "mistral-v0.1"  # Mistral-7B-v0.1 and Mixtral-8x7B-v0.1 share vocab 32000


def _hf(repo: str) -> str:
    """Where a catalogue model's figures come from: its config.json (parameters counted from it by
    models.hf_config; they match the model card's totals within 0.5%)."""
    return f"https://huggingface.co/{repo}/blob/main/config.json"

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
        # Qwen2-0.5B-Instruct with the Llama-3 vocabulary swapped in (a draft for Llama-3-70B): Qwen2-0.5B's
        # figures with vocab 128256 (tied embeddings: 494,032,768 - (151,936 - 128,256) x 896 parameters)
        LLM("qwama-0.5b", "turboderp/Qwama-0.5B-Instruct", 24, 896, 14, 2, 64, 4864, 128256, True,
            472815488, 472815488, _LLAMA3, source=_hf("turboderp/Qwama-0.5B-Instruct")),
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
        # 2025-2026 models: figures from each repository's config.json (tests/fixtures/hf_configs hold
        # copies; tests/test_hf_config.py checks these records against models.hf_config of them)
        LLM("llama-3.3-70b", "meta-llama/Llama-3.3-70B-Instruct", 80, 8192, 64, 8, 128, 28672, 128256, False, 70553706496, 70553706496, 'llama3',
            source=_hf("meta-llama/Llama-3.3-70B-Instruct")),
        LLM("qwen3-0.6b", "Qwen/Qwen3-0.6B", 28, 1024, 16, 8, 128, 3072, 151936, True, 596049920, 596049920, 'qwen3',
            source=_hf("Qwen/Qwen3-0.6B")),
        LLM("qwen3-1.7b", "Qwen/Qwen3-1.7B", 28, 2048, 16, 8, 128, 6144, 151936, True, 1720574976, 1720574976, 'qwen3',
            source=_hf("Qwen/Qwen3-1.7B")),
        LLM("qwen3-4b", "Qwen/Qwen3-4B", 36, 2560, 32, 8, 128, 9728, 151936, True, 4022468096, 4022468096, 'qwen3',
            source=_hf("Qwen/Qwen3-4B")),
        LLM("qwen3-8b", "Qwen/Qwen3-8B", 36, 4096, 32, 8, 128, 12288, 151936, False, 8190735360, 8190735360, 'qwen3',
            source=_hf("Qwen/Qwen3-8B")),
        LLM("qwen3-32b", "Qwen/Qwen3-32B", 64, 5120, 64, 8, 128, 25600, 151936, False, 32762123264, 32762123264, 'qwen3',
            source=_hf("Qwen/Qwen3-32B")),
        LLM("qwen3-30b-a3b", "Qwen/Qwen3-30B-A3B", 48, 2048, 32, 4, 128, 6144, 151936, False, 30532122624, 3353032704, 'qwen3',
            source=_hf("Qwen/Qwen3-30B-A3B"), num_experts=128, experts_per_token=8, moe_intermediate_size=768, expert_params_each=4718592),
        LLM("qwen3-235b-a22b", "Qwen/Qwen3-235B-A22B", 94, 4096, 64, 4, 128, 12288, 151936, False, 235093634560, 22190763520, 'qwen3',
            source=_hf("Qwen/Qwen3-235B-A22B"), num_experts=128, experts_per_token=8, moe_intermediate_size=1536, expert_params_each=18874368),
        LLM("deepseek-v3", "deepseek-ai/DeepSeek-V3", 61, 7168, 128, 128, 192, 18432, 129280, False, 671026419200, 37552297472, 'deepseek-v3',
            source=_hf("deepseek-ai/DeepSeek-V3"), num_experts=256, experts_per_token=8, moe_intermediate_size=2048, num_dense_layers=3, num_shared_experts=1, expert_params_each=44040192, kv_lora_rank=512, qk_rope_head_dim=64, mtp_layers=1, native_weights='fp8'),
        LLM("deepseek-r1", "deepseek-ai/DeepSeek-R1", 61, 7168, 128, 128, 192, 18432, 129280, False, 671026419200, 37552297472, 'deepseek-v3',
            source=_hf("deepseek-ai/DeepSeek-R1") + " (the DeepSeek-V3 architecture)", num_experts=256, experts_per_token=8, moe_intermediate_size=2048, num_dense_layers=3, num_shared_experts=1, expert_params_each=44040192, kv_lora_rank=512, qk_rope_head_dim=64, mtp_layers=1, native_weights='fp8'),
        LLM("gpt-oss-20b", "openai/gpt-oss-20b", 24, 2880, 64, 8, 64, 2880, 201088, False, 20914757184, 4187440704, 'o200k_harmony',
            source=_hf("openai/gpt-oss-20b"), num_experts=32, experts_per_token=4, moe_intermediate_size=2880, expert_params_each=24891840, sliding_window=128, num_sliding_layers=12, native_weights='mxfp4'),
        LLM("gpt-oss-120b", "openai/gpt-oss-120b", 36, 2880, 64, 8, 64, 2880, 201088, False, 116829156672, 5711982912, 'o200k_harmony',
            source=_hf("openai/gpt-oss-120b"), num_experts=128, experts_per_token=4, moe_intermediate_size=2880, expert_params_each=24891840, sliding_window=128, num_sliding_layers=18, native_weights='mxfp4'),
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
    compute: str  # "bf16" | "fp8" | "int8" | "fp4": which GPU peak applies to the matmuls
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
        WeightFormat("mxfp4", 0.5 + 1.0 / 32, "fp4", 1.1,
                     "OCP MXFP4 (gpt-oss checkpoints): 4-bit e2m1 weights plus one 8-bit scale per block of "
                     "32 (0.53125 B/param); FP4 tensor cores where the GPU has them (Blackwell), else BF16 "
                     "after in-kernel dequantisation, +10% matmul work as int4"),
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
            raise ConfigError(f"weights 'fp8' need FP8 tensor cores, which {gpu.name} lacks; use weights = 'int8' or 'int4'")
        return gpu.fp8_flops
    if weights.compute == "int8":
        return gpu.int8_ops
    if weights.compute == "fp4" and gpu.fp4_flops is not None:
        return gpu.fp4_flops
    return gpu.bf16_flops


@dataclass(frozen=True)
class Link:
    """A fabric that carries KV from a prefill replica to a decode replica (disaggregated serving):
    bandwidth per GPU in one direction (each GPU of a tensor-parallel group sends its own KV shard
    over its own port) and the one-way latency of one transfer."""

    name: str
    bytes_s_per_gpu: float
    latency_s: float
    source: str


# Bandwidth: the port's line rate (a user override, disaggregation.link_gbps, takes an achieved
# figure: Mooncake's transfer engine measured 87 GB/s over 4 x 200 Gb/s and 190 GB/s over 8 x 400 Gb/s
# RoCE, kvcache-ai/Mooncake README). Latency: one RDMA write's one-way latency; ib_send_lat measures
# 0.8 us at 32 B to 4.6 us at 32 KB (RC transport). No published figure gives NIXL's per-transfer
# software overhead: set disaggregation.link_latency_us where it was measured.
_DGX_NIC = ("one single-port ConnectX-7 per GPU, up to 400 Gb/s InfiniBand or 400GbE (DGX H100/H200: "
            "docs.nvidia.com/dgx-basepod core components; DGX B200 user guide)")
LINKS: dict[str, Link] = {
    lk.name: lk
    for lk in (
        Link("nvlink-3", 300e9, 2e-6, "A100 SXM: NVLink 3, 600 GB/s per GPU both directions (shared/reference/hardware.csv); "
             "one direction 300 GB/s; within one node only; latency assumed as RDMA's (no published figure)"),
        Link("nvlink-4", 450e9, 2e-6, "H100/H200 SXM: NVLink 4, 900 GB/s per GPU both directions (shared/reference/hardware.csv); "
             "one direction 450 GB/s; within one node only; latency assumed as RDMA's (no published figure)"),
        Link("nvlink-5", 900e9, 2e-6, "B200: NVLink 5, 1.8 TB/s per GPU both directions (shared/reference/hardware.csv); "
             "one direction 900 GB/s; within one node only; latency assumed as RDMA's (no published figure)"),
        Link("infiniband-hdr", 25e9, 5e-6, "DGX A100: one ConnectX-6 HDR 200 Gb/s port per GPU (DGX A100 launch coverage); "
             "200 Gb/s = 25 GB/s one direction"),
        Link("infiniband-ndr", 50e9, 5e-6, f"InfiniBand NDR: {_DGX_NIC}; 400 Gb/s = 50 GB/s one direction"),
        Link("roce-400", 50e9, 10e-6, f"400GbE RoCE v2: {_DGX_NIC}; 50 GB/s one direction; Ethernet switching adds "
             "latency over InfiniBand"),
        Link("ethernet-100", 12.5e9, 20e-6, "one 100 GbE port per GPU: a modest cloud fabric; latency: kernel-to-kernel "
             "TCP is about 50 us (WWT), RoCE a few us: 20 us between"),
    )
}


def get_link(name: str) -> Link:
    try:
        return LINKS[name.lower()]
    except KeyError:
        raise unknown("link", name, tuple(LINKS)) from None
