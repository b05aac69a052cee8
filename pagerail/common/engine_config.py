"""The engine's frozen configuration tree, validated when built; derived values are properties. Both sides import it:
the head builds it, and each rank receives it whole inside its WorkerConfig."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagerail.common.pooling_config import pooler_overrides
from pagerail.common.sampling_params import check_int
from pagerail.common.speculative_config import SpeculativeConfig, speculative_config_from

DTYPES = ("auto", "float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
LOAD_FORMATS = ("auto", "dummy")
# Weight formats: detected from the checkpoint's quantization_config, or forced (fp8 also quantizes a 16/32-bit
# checkpoint on load).
QUANTIZATIONS = ("fp8", "awq", "gptq", "mxfp4")
# auto: the model's dtype; fp8 means fp8_e4m3.
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class CacheConfig:
    """KV cache geometry and memory budget."""

    block_size: int = 16
    # Bytes for the KV cache on each rank; None: a fraction of free device memory on CUDA, 2 GiB on CPU.
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    # Fixed block count, overriding the memory budget (tests, reproducible benchmarks).
    num_gpu_blocks: int | None = None
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    # Bytes of host memory per rank for the second KV tier (evicted prefix blocks); None: no host tier.
    kv_offload_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.block_size not in (1, 2, 4, 8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be a power of two <= 128, got {self.block_size}")
        if not (self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0):
            raise ValueError(f"kv_cache_memory_bytes must be > 0, got {self.kv_cache_memory_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not (self.kv_offload_bytes is None or self.kv_offload_bytes > 0):
            raise ValueError(f"kv_offload_bytes must be > 0, got {self.kv_offload_bytes}")
        if not (self.num_gpu_blocks is None or self.num_gpu_blocks >= 1):
            raise ValueError(f"num_gpu_blocks must be >= 1, got {self.num_gpu_blocks}")


SCHEDULING_POLICIES = ("fcfs", "priority")
FAIRNESS_POLICIES = ("none", "vtc")


@dataclass(frozen=True)
class SchedulerConfig:
    """Token budget per step and limits on concurrency and context length."""

    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 256
    # None: the model's own limit (max_position_embeddings).
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    # New requests are refused (QueueFullError) while this many wait; None: no limit.
    max_waiting_requests: int | None = None
    # A streaming-input session that sends no chunk for this long is closed with an error.
    session_idle_timeout_s: float = 300.0
    # Open streaming-input sessions at once; more are refused (QueueFullError). None: max_num_seqs.
    max_sessions: int | None = None
    # Schedule and submit step N+1 while step N runs on the ranks (tokens still being sampled are placeholders).
    # Off: each step waits for the previous one's tokens; outputs are identical either way. None: on when the
    # ranks compute on GPUs or run in processes of their own (Ray worker actors, CPU included); off for a CPU
    # rank in the engine's own process, whose forward needs the engine's thread and every core.
    async_scheduling: bool | None = None
    # "fcfs": waiting requests are admitted in arrival order, and a preemption takes the most recently admitted.
    # "priority": by each request's priority (lower first; ties by arrival), a preemption takes the lowest priority,
    # and an arrival that outranks running work preempts it when the batch is full.
    scheduling_policy: str = "fcfs"
    # "vtc": among waiting requests of equal priority, admit from the tenant given the fewest weighted tokens so far
    # (the Virtual Token Counter); "none": by queue order alone.
    fairness: str = "none"
    # Flex work (service_tier "flex", or a priority at or above flex_priority_threshold) only fills spare capacity:
    # it waits behind interactive requests, is preempted first (and by interactive arrivals when the batch is full),
    # and takes at most flex_tokens_per_step of a step that carries interactive work. None: priority alone never
    # makes a request flex.
    flex_priority_threshold: int | None = None
    flex_tokens_per_step: int = 16

    @property
    def session_limit(self) -> int:
        return self.max_sessions if self.max_sessions is not None else self.max_num_seqs

    def context_limit(self, max_position_embeddings: int) -> int:
        """The context a model is served with, before the KV cache caps it: max_model_len as asked for (None: all
        the model has), never beyond the model's positions. The head and every rank size by this one number."""
        if self.max_model_len is None:
            return max_position_embeddings
        return min(self.max_model_len, max_position_embeddings)

    def __post_init__(self) -> None:
        if not (self.max_waiting_requests is None or self.max_waiting_requests >= 1):
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if not self.max_num_batched_tokens >= 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if not self.max_num_seqs >= 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if not self.session_idle_timeout_s > 0:
            raise ValueError(f"session_idle_timeout_s must be > 0, got {self.session_idle_timeout_s}")
        if not (self.max_sessions is None or self.max_sessions >= 1):
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")
        if not (self.max_model_len is None or self.max_model_len >= 1):
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.fairness not in FAIRNESS_POLICIES:
            raise ValueError(f"fairness must be one of {FAIRNESS_POLICIES}, got {self.fairness!r}")
        if not self.flex_tokens_per_step >= 1:
            raise ValueError(f"flex_tokens_per_step must be >= 1, got {self.flex_tokens_per_step}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {SCHEDULING_POLICIES}, got {self.scheduling_policy!r}")


@dataclass(frozen=True)
class ObservabilityConfig:
    """Where traces go and how many of them are kept."""

    # OTLP collector for traces (gRPC, or HTTP/protobuf per OTEL_EXPORTER_OTLP_TRACES_PROTOCOL); None: tracing off.
    otlp_traces_endpoint: str | None = None
    trace_sampling_ratio: float = 1.0

    def __post_init__(self) -> None:
        endpoint, ratio = self.otlp_traces_endpoint, self.trace_sampling_ratio
        if endpoint is not None and not (isinstance(endpoint, str) and endpoint.strip()):
            raise ValueError(
                "otlp_traces_endpoint must be a collector address such as 'http://localhost:4317', or None"
            )
        if isinstance(ratio, bool) or not isinstance(ratio, int | float) or not 0.0 <= ratio <= 1.0:
            raise ValueError(f"trace_sampling_ratio must be in [0, 1], got {ratio!r}")


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (vLLM's flags): whether they are served, how many share a step, their largest rank, and how
    many the ranks keep parsed in host memory beyond the device slots."""

    enable_lora: bool = False
    max_loras: int = 1  # distinct adapters in one step: the device slots each adapted layer holds
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: as many as max_loras

    def __post_init__(self) -> None:
        check_int("max_loras", self.max_loras, low=1)
        check_int("max_lora_rank", self.max_lora_rank, low=1, high=512)
        if self.max_cpu_loras is not None:
            check_int("max_cpu_loras", self.max_cpu_loras, low=self.max_loras)

    @property
    def host_cache_size(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass(frozen=True)
class EngineConfig:
    """Everything one model replica needs: model, devices, cache and scheduler settings."""

    model: str | None = None
    # The name clients send and every metric carries; None: derived from `model`.
    served_model_name: str | None = None
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    load_format: str = "auto"
    # None: whatever the checkpoint's quantization_config says (unquantized when it has none).
    quantization: str | None = None
    seed: int = 0
    tensor_parallel_size: int = 1
    # Mixture-of-experts models: each tensor-parallel rank holds whole experts (a 1/size share of them) instead of
    # a 1/size slice of every expert.
    enable_expert_parallel: bool = False
    # Run every step eagerly; False lets CUDA ranks replay captured CUDA graphs for decode-only steps.
    enforce_eager: bool = False
    # Speculative decoding (given as a dict or a JSON object's text); None: off.
    speculative_config: SpeculativeConfig | None = None
    # vLLM's --runner and --convert: "pooling" serves embeddings, classification and scores only ("auto": what the
    # checkpoint is: an encoder pools, a causal LM generates and embeds); "embed" serves a causal LM as an
    # embedder, "classify" a checkpoint with a classification head as a classifier.
    runner: str = "auto"
    convert: str = "auto"
    # vLLM's --pooler-config: a JSON object {"pooling_type": "LAST" | "MEAN" | "CLS", "normalize": bool} that
    # overrides the checkpoint's default pooling for /v1/embeddings and the pooling routes; None: the checkpoint's.
    pooler_config: str | None = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    @property
    def model_name(self) -> str:
        """The name metrics and APIs use when none is given: the model's last path component."""
        if self.served_model_name:
            return self.served_model_name
        return (self.model or "SmolLM2-135M-Instruct").rstrip("/").split("/")[-1]

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        object.__setattr__(self, "speculative_config", speculative_config_from(self.speculative_config))
        pooler_overrides(self.pooler_config)  # a bad flag fails here, before anything starts
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or unset, got {self.quantization!r}")
        if not self.tensor_parallel_size >= 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
