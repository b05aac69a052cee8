"""A worker: one tensor-parallel rank holding a model shard and its KV cache shard."""

from __future__ import annotations

import gc
import logging
import os
from pathlib import Path

import torch

from pagerail.common.model_source import resolve_model_dir
from pagerail.proto import step_pb2
from pagerail.worker.config import WorkerConfig
from pagerail.worker.host_memory import keep_freed_memory
from pagerail.worker.kv_cache import allocate_kv_caches, bytes_per_block, memory_budget, resolve_kv_cache_dtype
from pagerail.worker.kv_offload import HostKvPool, available_host_memory, host_slots_for
from pagerail.worker.kv_transfer import kv_heads_of_rank, read_blocks
from pagerail.worker.layers.quantization.summary import weight_bytes, weight_format
from pagerail.worker.lora import LoRASlots
from pagerail.worker.memory_profile import KvCacheProfile, memory_probe, profile_kv_cache
from pagerail.worker.model_loader import load_model
from pagerail.worker.model_runner import ModelRunner
from pagerail.worker.parallel_state import SINGLE_RANK, TensorParallelGroup
from pagerail.worker.spec_decode.proposer import make_proposer

logger = logging.getLogger(__name__)

# Cache blocks past those the head hands out: padded rows of a captured decode batch write their K/V there.
SCRATCH_BLOCKS = 1

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' was asked for but no CUDA device is available")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """fp32 on CPU (bf16 matmuls are far slower there); bf16 on GPUs that have it, else fp16."""
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    return torch.float32


def limit_threads(num_threads: int | None) -> None:
    """Use the cores this process owns, not the machine's total (containers, Ray CPU bundles)."""
    count = num_threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(max(1, count))


class Worker:
    """Loads the model shard, sizes and allocates the KV cache, then executes steps."""

    def __init__(self, config: WorkerConfig, tp: TensorParallelGroup = SINGLE_RANK) -> None:
        self.config = config
        self.tp = tp
        self.device = resolve_device(config.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device.index or 0)
        self.dtype = resolve_dtype(config.engine.dtype, self.device)
        # What K and V are stored in: the compute dtype, or fp8 (refused here, before loading, where unreadable).
        self.kv_dtype = resolve_kv_cache_dtype(config.engine.cache.kv_cache_dtype, self.dtype, self.device)
        if self.device.type == "cpu":
            limit_threads(config.num_threads)
            keep_freed_memory()
        model_dir = Path(config.model_dir)
        if not model_dir.is_dir():
            # Another node resolved the model; fetch or convert it on this one the same way.
            model_dir = resolve_model_dir(config.engine.model)
        self.model = load_model(
            model_dir,
            tp,
            self.dtype,
            self.device,
            load_format=config.engine.load_format,
            seed=config.engine.seed,
            enable_expert_parallel=config.engine.enable_expert_parallel,
            quantization=config.engine.quantization,
        )
        self.weights = {
            "weight_format": weight_format(self.model),
            "weight_bytes": weight_bytes(self.model),
            "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
        }
        logger.info(
            "rank %d: %s weights, %.1f MiB on %s; KV cache in %s",
            tp.rank,
            self.weights["weight_format"],
            self.weights["weight_bytes"] / 2**20,
            self.device,
            self.weights["kv_cache_dtype"],
        )
        engine = config.engine
        cache, scheduler = engine.cache, engine.scheduler
        # Speculative decoding's proposer; a draft model is loaded now, before the cache is sized around it.
        self.proposer = make_proposer(
            engine.speculative_config,
            tp=tp,
            device=self.device,
            dtype=self.dtype,
            block_size=cache.block_size,
            target=self.model,
            target_dir=model_dir,
        )
        # LoRA adapters' device slots, allocated before the cache is sized around them.
        lora = engine.lora
        self.lora = (
            LoRASlots(self.model, lora.max_loras, lora.max_lora_rank, lora.host_cache_size)
            if lora.enable_lora
            else None
        )
        max_model_len = scheduler.context_limit(self.model.config.max_position_embeddings)
        # Every number behind the cache size when a profiling forward chose it.
        self.kv_profile: KvCacheProfile | None = None
        # The blocks the head may hand out; the cache holds SCRATCH_BLOCKS more, numbered from num_blocks.
        self.num_blocks = self._size_cache(max_model_len)
        caches = allocate_kv_caches(
            self.model.num_layers,
            self.num_blocks + SCRATCH_BLOCKS,
            cache.block_size,
            self.model.num_kv_heads_per_rank,
            self.model.head_dim,
            self.kv_dtype,
            self.device,
        )
        for layer, layer_cache in zip(self.model.attention_layers(), caches, strict=True):
            layer.kv_cache = layer_cache
        # The host KV tier's slots on this rank (none without kv_offload_bytes).
        self.host_kv: HostKvPool | None = None
        self.num_host_blocks = 0
        if cache.kv_offload_bytes:
            per_block = bytes_per_block(
                self.model.num_layers,
                self.model.num_kv_heads_per_rank,
                self.model.head_dim,
                cache.block_size,
                self.kv_dtype,
            )
            self.num_host_blocks = host_slots_for(cache.kv_offload_bytes, per_block, available_host_memory())
            self.host_kv = HostKvPool(caches, self.num_host_blocks, cache.block_size)
            logger.info(
                "rank %d: host KV tier of %d blocks (%d bytes)",
                tp.rank,
                self.num_host_blocks,
                self.num_host_blocks * per_block,
            )
        if self.proposer is not None:
            self.proposer.allocate(self.num_blocks + SCRATCH_BLOCKS)
        self.runner = ModelRunner(
            self.model,
            cache.block_size,
            self.device,
            tp,
            max_num_tokens=scheduler.max_num_batched_tokens,
            max_num_seqs=scheduler.max_num_seqs,
            max_blocks_per_seq=-(-max_model_len // cache.block_size),
            tokenizer_dir=str(model_dir),
            enforce_eager=engine.enforce_eager,
            scratch_block=self.num_blocks,
            proposer=self.proposer,
            host_kv=self.host_kv,
            lora=self.lora,
        )
        torch.manual_seed(engine.seed)

    def _size_cache(self, max_model_len: int) -> int:
        """Blocks for the head: a fixed num_gpu_blocks, else an explicit byte budget, else a profiling forward on a
        GPU, else the CPU default budget."""
        engine = self.config.engine
        cache, scheduler = engine.cache, engine.scheduler
        if cache.num_gpu_blocks is not None:
            return cache.num_gpu_blocks
        model = self.model
        per_block = bytes_per_block(
            model.num_layers, model.num_kv_heads_per_rank, model.head_dim, cache.block_size, self.kv_dtype
        )
        if self.proposer is not None:
            per_block += self.proposer.bytes_per_block()  # a draft model's KV shares the blocks
        probe = memory_probe(self.device) if cache.kv_cache_memory_bytes is None else None
        if probe is not None:
            self.kv_profile = profile = profile_kv_cache(
                self.model,
                probe,
                block_size=cache.block_size,
                dtype=self.kv_dtype,
                device=self.device,
                max_num_batched_tokens=scheduler.max_num_batched_tokens,
                max_num_seqs=scheduler.max_num_seqs,
                max_model_len=max_model_len,
                gpu_memory_utilization=cache.gpu_memory_utilization,
                enforce_eager=engine.enforce_eager,
                scratch_blocks=SCRATCH_BLOCKS,
                extra_bytes_per_block=self.proposer.bytes_per_block() if self.proposer is not None else 0,
            )
            logger.info("rank %d: KV cache sized by a profiling forward: %s", self.tp.rank, profile.summary())
            return profile.num_blocks
        budget = memory_budget(self.device, cache.kv_cache_memory_bytes)
        if budget is None:
            raise ValueError(f"device {self.device} has no memory probe; set kv_cache_memory_bytes or num_gpu_blocks")
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"KV cache budget of {budget} bytes is below one block ({per_block} bytes)")
        logger.info(
            "rank %d: KV cache of %d blocks in %s (%d bytes each)", self.tp.rank, num_blocks, self.kv_dtype, per_block
        )
        return int(num_blocks)

    @property
    def kv_layout(self) -> dict:
        """What a block of this replica's KV is: moved blocks must match it exactly."""
        config = self.model.config
        return {
            "block_size": self.config.engine.cache.block_size,
            "num_layers": self.model.num_layers,
            "num_kv_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            "head_dim": self.model.head_dim,
            "dtype": str(self.kv_dtype).removeprefix("torch."),
        }

    def export_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """This rank's heads of `block_ids`' KV, [n, layers, 2, heads, block_size, head_dim] on the CPU."""
        caches = [layer.kv_cache for layer in self.model.attention_layers()]
        return read_blocks(caches, block_ids, self.config.engine.cache.block_size)

    def import_host(self, slots: list[int], data: torch.Tensor) -> None:
        """Blocks of every KV head from another replica into this rank's host slots (its own heads of them)."""
        if self.host_kv is None:
            raise ValueError("this replica has no host KV tier to receive blocks into (kv_offload_bytes)")
        heads = kv_heads_of_rank(self.kv_layout["num_kv_heads"], self.tp.size, self.tp.rank)
        self.host_kv.write(slots, data[:, :, :, heads])

    def execute_step(self, batch: step_pb2.StepBatch) -> step_pb2.StepResult:
        return self.runner.execute(batch)

    def close(self) -> None:
        """Free the model, the KV cache and the captured graphs now, not when the last reference happens to go:
        another rank started in this process profiles the device's free memory and must not count them."""
        if self.model is not None:
            for layer in self.model.attention_layers():
                layer.kv_cache = None
        if self.runner is not None:
            self.runner.close()
        self.model = self.runner = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
