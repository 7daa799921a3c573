"""One validated dataclass per component. Field docstrings double as CLI help (see engine/args.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.cpu_placement import parse_cores

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "half": "float16", "fp16": "float16", "bf16": "bfloat16"}
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "int8")
QUANTIZATION_METHODS = ("fp8", "awq", "gptq", "compressed-tensors")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")  # engine/model.py runs these
# The linears engine/model.py fuses (fuse_projections), by their names inside a decoder layer: fused -> shards in order.
FUSED_LINEARS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def parse_dtype(name: str) -> torch.dtype:
    name = DTYPE_ALIASES.get(name, name)
    if name not in _DTYPES:
        raise ValueError(f"dtype={name!r}: must be one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[name]


def resolve_dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    """The weights' dtype for --dtype `name`, a model of `hf_config` on `device`: as named; 'auto' is float32 off
    CUDA (--device cpu on a GPU host too) and on CUDA the checkpoint's 16-bit type, bfloat16 where the checkpoint is
    float32 or names none (vLLM's rule)."""
    if name != "auto":
        return parse_dtype(name)
    if device.type != "cuda":
        return torch.float32
    d = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
    if isinstance(d, str):
        d = _DTYPES.get(DTYPE_ALIASES.get(d, d))
    return d if d in (torch.float16, torch.bfloat16) else torch.bfloat16


@dataclass
class ModelConfig:
    model: str
    """Model: a HuggingFace directory, a .gguf file, 'smollm2', or 'random:<preset>'."""
    served_model_name: str | None = None
    """Name clients use in the API (default: the model's own name)."""
    dtype: str = "auto"
    """Weight and activation dtype: auto (float32 on CPU, the checkpoint's 16-bit type on CUDA), float32, float16, bfloat16."""
    max_model_len: int | None = None
    """Context length (prompt + output); default: the model's max_position_embeddings."""
    seed: int = 0
    """Seed for random weights and for unseeded sampling."""
    enforce_eager: bool = False
    """Never replay steps as CUDA graphs (vLLM's flag)."""
    max_prefill_cudagraph_tokens: int = 1024
    """Steps with prompt tokens, up to this many tokens in all, replay as CUDA graphs padded to a captured size (0: eagerly). A short prompt's prefill is bound by the host's kernel launches, not the GPU."""
    tokenizer: str | None = None
    """Tokenizer directory (tokenizer.json + tokenizer_config.json) used instead of the model's own (vLLM's flag); its vocabulary must fit the model's vocab_size. A random: model then decodes real BPE tokens rather than the synthetic tokenizer's. Default: the model's."""
    quantization: str | None = None
    """Quantize the layers' linear weights at load (vLLM's flag): fp8 (e4m3, a scale per output channel; activations quantized per token; fp8 GEMMs need sm >= 89); awq, gptq, compressed-tensors name a checkpoint's own format (4-bit weights load as they are). Default: none; a quantized checkpoint (config.json's quantization_config) is detected and needs no flag."""

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len={self.max_model_len}: must be >= 1")
        if self.max_prefill_cudagraph_tokens < 0:
            raise ValueError(f"max_prefill_cudagraph_tokens={self.max_prefill_cudagraph_tokens}: must be >= 0")
        if self.dtype != "auto":
            parse_dtype(self.dtype)
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"quantization={self.quantization!r}: must be one of None, "
                             f"{', '.join(QUANTIZATION_METHODS)}")


@dataclass
class CacheConfig:
    block_size: int = 16
    """Tokens per KV block."""
    kv_cache_memory: float | None = None
    """KV cache size in GiB (CPU default 1 GiB; on CUDA the default comes from gpu_memory_utilization)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of GPU memory the engine may use for weights, activations and the KV cache."""
    kv_cache_dtype: str = "auto"
    """KV cache dtype: auto (the model dtype), fp8 (e4m3 with per-layer scales) or int8 (a scale per token and KV head, computed as it is written)."""
    enable_prefix_caching: bool = True
    """Reuse KV blocks of identical prompt prefixes (automatic prefix caching)."""
    num_gpu_blocks_override: int | None = None
    """Exact number of KV blocks (for tests and experiments); overrides the memory budget."""
    swap_space: float = 0.0
    """GiB of host memory per engine (per rank with tensor parallelism, as vLLM's per GPU) for a second KV tier (vLLM's swap_space; pinned on CUDA): preempted requests' blocks wait there instead of being recomputed (see --preemption-mode), and blocks evicted from the prefix cache are kept there for later prefix hits. 0: off."""

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size={self.block_size}: must be in [1, 1024]")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization}: must be in (0, 1]")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory={self.kv_cache_memory}: must be > 0 (GiB)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r}: must be one of {', '.join(KV_CACHE_DTYPES)}")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ValueError(f"num_gpu_blocks_override={self.num_gpu_blocks_override}: must be >= 1")
        if not 0.0 <= self.swap_space <= 1024.0:
            raise ValueError(f"swap_space={self.swap_space}: must be in [0, 1024] (GiB)")


PREEMPTION_MODES = ("auto", "swap", "recompute")
# The step budget of a prefill worker on the CPU where --max-num-batched-tokens is not given (its WorkerRole in
# prefill_svc/server.py names it). A prefill request ends at its first token, and that token and the request's KV
# reach the decode worker only when the step that finishes the prompt ends. On the CPU a step's time grows with its
# tokens, so one step of SchedulerConfig's budget that holds a whole burst of prompts keeps every one of them, and
# the decode worker on its own cores, waiting for the last. Steps of a few prompts each finish the first ones early:
# decode works on them while prefill goes on with the rest. Much smaller steps would read the weights for too few
# tokens each; on a GPU a step's time grows far slower than its tokens and the larger budget stays.
PREFILL_CPU_MAX_NUM_BATCHED_TOKENS = 512


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    """Most requests in one step's batch."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step: prefill chunks and decodes together (chunked prefill splits longer prompts)."""
    async_scheduling: bool | None = None
    """Schedule and launch each step before reading the previous step's tokens, so host work overlaps the device's (default: on for CUDA)."""
    new_token_ratio: float = 0.7
    """Admission watermark (SGLang's new_token_ratio): a waiting request (or a decode reservation) is admitted only while the free KV blocks left after it cover this share of every admitted request's remaining max_tokens, so that admitted requests do not preempt each other. It starts here, decays to a seventh of it over 600 steps without preemption, and rises again on a preemption; 0 turns the watermark off (admit whenever the prompt fits, preempt when the pool is full)."""
    preemption_mode: str = "auto"
    """What a preempted request's KV becomes when --swap-space gives a host tier: swap (copied to host memory and back when it runs again), recompute (freed, recomputed from its tokens), or auto: swap when it has at least one full block of computed KV (copying a token's KV twice over the host link costs less than recomputing a row of the model), else recompute (a small chunk of a step that runs anyway). Without a host tier: always recompute."""

    def __post_init__(self) -> None:
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode={self.preemption_mode!r}: must be one of {', '.join(PREEMPTION_MODES)}")
        if not 0.0 <= self.new_token_ratio <= 1.0:
            raise ValueError(f"new_token_ratio={self.new_token_ratio}: must be in [0, 1]")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={self.max_num_seqs}: must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens}: must be >= 1")


@dataclass
class DeviceConfig:
    device: str = "auto"
    """Device: auto (cuda when available, else cpu), cpu, cuda, cuda:N."""
    cpu_threads: int | None = None
    """torch's compute threads in this process (torch.set_num_threads). Default: one per core of --cpu-cores, else torch's own (one per core). `tandem up` on the CPU gives each engine its share of the host's cores."""
    cpu_cores: str | None = None
    """Cores the thread that steps the engine (and the OpenMP threads it starts) is pinned to, e.g. 1 or 0-3,8 (vLLM's VLLM_CPU_OMP_THREADS_BIND); the process's other threads keep every core. Default: no pinning. `tandem up` on the CPU gives each engine cores of its own."""

    def __post_init__(self) -> None:
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValueError(f"device={self.device!r}: must be auto, cpu, cuda or cuda:N")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"cpu_threads={self.cpu_threads}: must be >= 1")
        if self.cpu_cores is not None:
            parse_cores(self.cpu_cores)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Ranks the model's layers are split across (Megatron tensor parallelism, vLLM's flag): the engine process is rank 0, the others are spawned processes; on CUDA rank r runs on cuda:(N + r) for --device cuda:N. Must divide the attention heads, the KV heads and the MLP width."""

    nnodes: int = 1
    """Hosts the tensor-parallel ranks span (torchrun's --nnodes; a Kubernetes LeaderWorkerSet's group size): each runs tensor_parallel_size / nnodes of them. Every host runs the same command with its own --node-rank; node 0 serves and holds rank 0, the others run only their ranks."""
    node_rank: int = 0
    """This host's place among the --nnodes hosts: 0 serves; node k runs ranks k * tensor_parallel_size / nnodes onwards."""
    master_addr: str = "127.0.0.1"
    """Node 0's address, where every rank meets (torch.distributed's TCP rendezvous; torchrun's --master-addr)."""
    master_port: int = 29500
    """The rendezvous port on --master-addr (torchrun's --master-port)."""

    def __post_init__(self) -> None:
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size}: must be >= 1")
        if self.nnodes < 1:
            raise ValueError(f"nnodes={self.nnodes}: must be >= 1")
        if self.node_rank < 0:
            raise ValueError(f"node_rank={self.node_rank}: must be >= 0")
        if not 0 < self.master_port < 65536:
            raise ValueError(f"master_port={self.master_port}: must be 1 to 65535")

    def check(self) -> None:
        """The fields' agreement with each other (ValueError naming them; each is checked alone at parse time)."""
        if self.node_rank >= self.nnodes:
            raise ValueError(f"node_rank={self.node_rank}: must be below nnodes={self.nnodes}")
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"nnodes={self.nnodes}: must divide tensor_parallel_size={self.tensor_parallel_size} "
                             "(every host runs as many ranks)")

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def init_method(self) -> str | None:
        """The rendezvous of ranks on several hosts (None: one host, which picks its own)."""
        return f"tcp://{self.master_addr}:{self.master_port}" if self.nnodes > 1 else None


@dataclass
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
