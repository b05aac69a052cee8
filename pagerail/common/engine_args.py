"""The engine's arguments in one table: it makes `pagerail serve`'s flags, `LLM`'s keyword arguments and the
EngineConfig both build, so a setting has one name, one default, one help text and one validation."""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from pagerail.common.engine_config import (
    DEVICES,
    DTYPES,
    FAIRNESS_POLICIES,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ObservabilityConfig,
    SchedulerConfig,
)
from pagerail.common.pooling_config import CONVERSIONS, RUNNERS

# The sub-configurations of EngineConfig by field name; an argument's `section` names one, or "" for the top level.
_SECTIONS = {
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "observability": ObservabilityConfig,
    "lora": LoRAConfig,
}


@dataclass(frozen=True)
class EngineArg:
    """One setting: `LLM(name=...)`, `--flag`, and the EngineConfig field it fills (`section`.`name`)."""

    name: str
    section: str
    type: Callable[[str], Any]
    help: str
    choices: tuple[str, ...] | None = None
    flag_name: str | None = None  # when the flag is not --<name with dashes>

    @property
    def flag(self) -> str:
        return "--" + (self.flag_name or self.name).replace("_", "-")

    @property
    def default(self) -> Any:
        """The EngineConfig default: declared once, on the dataclass."""
        owner = _SECTIONS[self.section] if self.section else EngineConfig
        return next(f for f in fields(owner) if f.name == self.name).default


ENGINE_ARGS: tuple[EngineArg, ...] = (
    EngineArg("model", "", str, "local dir, .gguf file or hub id (default: the embedded SmolLM2-135M-Instruct)"),
    EngineArg("served_model_name", "", str, "the model name clients send and metrics carry (default: derived)"),
    EngineArg("tokenizer", "", str, "tokenizer dir or hub id (default: the model's)"),
    EngineArg("dtype", "", str, "weights and activations; auto: bf16 on GPUs, fp32 on CPUs", DTYPES),
    EngineArg("device", "", str, "where the ranks compute; auto: CUDA when there is a GPU", DEVICES),
    EngineArg("load_format", "", str, "dummy: random weights of the model's shape", LOAD_FORMATS),
    EngineArg(
        "quantization",
        "",
        str,
        "weight format; default: the checkpoint's quantization_config; fp8 also quantizes a bf16/fp32 checkpoint "
        "on load",
        QUANTIZATIONS,
    ),
    EngineArg("seed", "", int, "seed of the ranks' random state (unseeded sampling, dummy weights)"),
    EngineArg("tensor_parallel_size", "", int, "ranks that share each layer of one replica"),
    EngineArg(
        "enable_expert_parallel",
        "",
        bool,
        "MoE models: each tensor-parallel rank holds whole experts instead of a slice of every expert",
    ),
    EngineArg(
        "speculative_config",
        "",
        str,
        'speculative decoding as a JSON object, e.g. {"method": "ngram", "num_speculative_tokens": 4}; methods: '
        "ngram, draft_model, eagle, eagle3 (default: off)",
    ),
    EngineArg("runner", "", str, "pooling: embeddings, classification and scores only (auto: by the model)", RUNNERS),
    EngineArg("convert", "", str, "embed: a causal LM as an embedder; classify: its classification head", CONVERSIONS),
    EngineArg(
        "pooler_config",
        "",
        str,
        'the default pooling as JSON, e.g. {"pooling_type": "MEAN", "normalize": true} (default: the checkpoint\'s)',
    ),
    EngineArg("enforce_eager", "", bool, "run every step eagerly: no CUDA graphs for decode steps on GPU ranks"),
    EngineArg("block_size", "cache", int, "tokens per KV-cache block (a power of two <= 128)"),
    EngineArg("kv_cache_memory_bytes", "cache", int, "bytes of KV cache per rank (default: from free memory on GPUs)"),
    EngineArg("gpu_memory_utilization", "cache", float, "share of a GPU's memory the rank may use, in (0, 1]"),
    EngineArg("num_gpu_blocks", "cache", int, "a fixed KV-cache size in blocks, overriding the memory budget"),
    EngineArg(
        "kv_cache_dtype",
        "cache",
        str,
        "KV cache element type; fp8 (e4m3) or fp8_e5m2 store K and V in one byte with a per-layer scale",
        KV_CACHE_DTYPES,
    ),
    EngineArg("enable_prefix_caching", "cache", bool, "reuse KV blocks of prompts that share a prefix"),
    EngineArg(
        "kv_offload_bytes",
        "cache",
        int,
        "bytes of host memory per rank for a second KV tier: prefix blocks evicted from the device cache are "
        "copied there and loaded back on a hit (default: off)",
    ),
    EngineArg("max_num_batched_tokens", "scheduler", int, "token budget of one step"),
    EngineArg("max_num_seqs", "scheduler", int, "sequences in one step"),
    EngineArg("max_model_len", "scheduler", int, "longest context a request may reach (default: the model's)"),
    EngineArg(
        "enable_chunked_prefill", "scheduler", bool, "split long prompts across steps so running decodes keep pace"
    ),
    EngineArg("max_waiting_requests", "scheduler", int, "waiting requests before new ones are refused (429)"),
    EngineArg(
        "session_idle_timeout_s",
        "scheduler",
        float,
        "seconds a streaming-input session may wait for its next chunk before it is closed",
        flag_name="session_idle_timeout",
    ),
    EngineArg("max_sessions", "scheduler", int, "open streaming-input sessions at once (default: max-num-seqs)"),
    EngineArg(
        "async_scheduling",
        "scheduler",
        bool,
        "schedule and send step N+1 while step N runs on the ranks (off: strictly serial steps); default: on where "
        "the ranks run on GPUs or in processes of their own",
    ),
    EngineArg(
        "scheduling_policy",
        "scheduler",
        str,
        "fcfs: arrival order; priority: each request's priority (lower first, ties by arrival), the lowest "
        "preempted first, and an arrival that outranks running work preempts it when the batch is full",
        choices=SCHEDULING_POLICIES,
    ),
    EngineArg(
        "fairness",
        "scheduler",
        str,
        "vtc: among waiting requests of equal priority, admit from the tenant (--tenants) given the fewest weighted "
        "tokens so far; none: queue order",
        choices=FAIRNESS_POLICIES,
    ),
    EngineArg(
        "flex_priority_threshold",
        "scheduler",
        int,
        "requests of this priority or above are flex work, like service_tier flex (default: none)",
    ),
    EngineArg(
        "flex_tokens_per_step",
        "scheduler",
        int,
        "most tokens flex work takes of a step that carries interactive work (default 16)",
    ),
    EngineArg(
        "otlp_traces_endpoint",
        "observability",
        str,
        "OTLP collector for traces, e.g. http://localhost:4317 (gRPC; HTTP/protobuf when "
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf); default: tracing off",
    ),
    EngineArg("trace_sampling_ratio", "observability", float, "share of traces kept, in [0, 1]"),
    EngineArg("enable_lora", "lora", bool, "serve LoRA adapters (PEFT checkpoints) beside the base model"),
    EngineArg("max_loras", "lora", int, "distinct LoRA adapters in one step (device slots per adapted layer)"),
    EngineArg("max_lora_rank", "lora", int, "largest LoRA rank served"),
    EngineArg("max_cpu_loras", "lora", int, "LoRA adapters kept parsed in host memory (default: max-loras)"),
)
ENGINE_ARG_NAMES = frozenset(arg.name for arg in ENGINE_ARGS)


def engine_config(values: Mapping[str, Any] | None = None, /, **kwargs: Any) -> EngineConfig:
    """The EngineConfig of these engine arguments (the rest keep their defaults); an unknown name is refused with
    the closest known ones, a bad value with the field and its limit (EngineConfig validates)."""
    given = {**(values or {}), **kwargs}
    unknown = sorted(set(given) - ENGINE_ARG_NAMES)
    if unknown:
        said = []
        for name in unknown:
            close = difflib.get_close_matches(name, ENGINE_ARG_NAMES, n=1)
            said.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise TypeError(f"unknown engine argument {', '.join(said)}; see common/engine_args.py for the known ones")
    sections: dict[str, dict[str, Any]] = {section: {} for section in _SECTIONS}
    top: dict[str, Any] = {}
    for arg in ENGINE_ARGS:
        if arg.name in given:
            (sections[arg.section] if arg.section else top)[arg.name] = given[arg.name]
    return EngineConfig(**top, **{section: _SECTIONS[section](**values) for section, values in sections.items()})


def add_engine_arguments(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    exclude: tuple[str, ...] = (),
    only: tuple[str, ...] | None = None,
) -> None:
    """One flag per engine argument (or per one of `only`), with its EngineConfig default; `exclude` names those the
    command's own flags of the same spelling stand for (they then keep their defaults)."""
    for arg in ENGINE_ARGS:
        if arg.name in exclude or (only is not None and arg.name not in only):
            continue
        default = arg.default
        if arg.type is bool:
            if default is False:
                parser.add_argument(arg.flag, dest=arg.name, action="store_true", help=arg.help)
            else:  # on by default, or decided at start-up (None): --x and --no-x
                action = argparse.BooleanOptionalAction
                parser.add_argument(arg.flag, dest=arg.name, action=action, default=default, help=arg.help)
            continue
        shown = "" if default is None else f" (default: {default})"
        parser.add_argument(
            arg.flag, dest=arg.name, type=arg.type, default=default, choices=arg.choices, help=arg.help + shown
        )


def engine_arg_values(args: argparse.Namespace) -> dict[str, Any]:
    """The engine arguments of parsed `add_engine_arguments` flags, by name: `LLM(**engine_arg_values(args))`."""
    return {arg.name: getattr(args, arg.name) for arg in ENGINE_ARGS if hasattr(args, arg.name)}


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of parsed `add_engine_arguments` flags."""
    return engine_config(engine_arg_values(args))
