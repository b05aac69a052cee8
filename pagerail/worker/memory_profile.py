"""Sizes the KV cache on a GPU from a profiling forward pass at the worst step the scheduler can send."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from pagerail.worker.cuda_graphs import DEFAULT_MAX_CAPTURE_SIZE, capture_sizes
from pagerail.worker.kv_cache import allocate_kv_caches, bytes_per_block
from pagerail.worker.layers.attention import AttentionMetadata, PrefillSpan, decode_path
from pagerail.worker.sampler import Sampler, SamplingRow

# Kept free on top of the profiled decode peak when CUDA graphs will be captured: the graphs' executable objects
# and kernel parameters live in driver memory the profile never sees, and the input buffers, penalty state and
# allocator fragmentation that come after sizing need a little room too. vLLM's captures take a few hundred MiB.
GRAPH_FIXED_RESERVE = 256 << 20


class MemoryProbe(Protocol):
    """The device memory queries the profile needs; a fake one lets tests drive the numbers."""

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) bytes of the whole device, whoever holds them."""
        ...

    def reset_peak(self) -> None: ...

    def peak_allocated(self) -> int:
        """Most bytes held by live tensors since the last reset_peak."""
        ...

    def allocated(self) -> int:
        """Bytes held by live tensors now."""
        ...

    def reserved(self) -> int:
        """Bytes the caching allocator holds from the driver (live tensors and its cache)."""
        ...

    def empty_cache(self) -> None: ...

    def synchronize(self) -> None: ...


class CudaProbe:
    """MemoryProbe over torch.cuda for one device."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def mem_get_info(self) -> tuple[int, int]:
        return torch.cuda.mem_get_info(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


def memory_probe(device: torch.device) -> MemoryProbe | None:
    """The probe that profiles `device`; None where the cache is sized without profiling (the CPU)."""
    if device.type == "cuda":
        return CudaProbe(device)
    return None


@dataclass(frozen=True)
class KvCacheProfile:
    """Every number that went into the KV cache size, in bytes unless named otherwise."""

    total: int
    gpu_memory_utilization: float
    num_tokens: int  # the profiled step's tokens and sampled rows
    num_seqs: int
    weights: int  # torch memory the model holds (weights, rotary tables, workspaces the forward kept)
    prefill_peak: int  # activations of the max_num_batched_tokens step, sampling included
    decode_peak: int  # activations of the largest captured decode batch (0 when eager)
    activation_peak: int
    non_torch: int  # device memory outside torch's allocator: CUDA context, cuBLAS/NCCL, other processes
    graph_reserve: int
    graph_reserve_kind: str
    kv_cache_bytes: int  # usable bytes for the whole cache, the scratch block included
    bytes_per_block: int
    num_blocks: int  # blocks the head may hand out (the scratch blocks excluded)
    kv_dtype: str = ""  # what K and V are stored in (torch's name): the block size depends on it

    def summary(self) -> str:
        """Every number on one line, for the log and for errors."""
        budget = int(self.total * self.gpu_memory_utilization)
        return (
            f"total={self.total} x gpu_memory_utilization={self.gpu_memory_utilization} = {budget}, "
            f"weights={self.weights}, activation_peak={self.activation_peak} (prefill {self.prefill_peak} at "
            f"{self.num_tokens} tokens and {self.num_seqs} sampled rows, decode {self.decode_peak}), "
            f"non_torch={self.non_torch}, graph_reserve={self.graph_reserve} ({self.graph_reserve_kind}), "
            f"kv_cache={self.kv_cache_bytes} -> {self.num_blocks} blocks of {self.bytes_per_block} bytes "
            f"in {self.kv_dtype}"
        )


def _bind(layers: list[torch.nn.Module], caches: list[torch.Tensor | None]) -> None:
    for layer, cache in zip(layers, caches, strict=True):
        layer.kv_cache = cache


def _measure(probe: MemoryProbe, run: Callable[[], None]) -> int:
    """Peak bytes `run` allocated above what was live when it started (the temporary cache and inputs excluded)."""
    probe.synchronize()
    base = probe.allocated()
    probe.reset_peak()
    run()
    probe.synchronize()
    return max(0, probe.peak_allocated() - base)


def _prefill_step(
    model: torch.nn.Module, device: torch.device, block_size: int, num_tokens: int, num_seqs: int, max_model_len: int
) -> Callable[[], None]:
    """The step whose activations are largest: `num_tokens` fresh prefill tokens, then logits and sampling for
    `num_seqs` rows.

    Linear and MLP activations grow with the token count alone, however the tokens are split into requests, so
    the whole budget is scheduled. Attention working memory grows with each span's length (quadratically where
    SDPA falls back to its math kernel), so the tokens go into spans as long as a request may be: max_model_len.
    The logits ([rows, vocab] float32) and the sampler's copies of them grow with the sampled rows, and a step
    samples at most one row per request: min(max_num_seqs, tokens). Chunks that attend over a cached prefix
    (their context gathered on the SDPA path) are not profiled.
    """
    # Positions index the rotary tables, which stop at max_position_embeddings.
    span = max(1, min(num_tokens, max_model_len))  # max_model_len: the served context (context_limit)
    starts = range(0, num_tokens, span)
    positions = torch.cat([torch.arange(min(span, num_tokens - s), device=device) for s in starts])
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=device),
        block_size=block_size,
        prefills=[PrefillSpan(s, min(s + span, num_tokens)) for s in starts],
    )
    dtype = next(model.parameters()).dtype
    if decode_path(device, model.num_heads_per_rank, model.num_kv_heads_per_rank, model.head_dim, dtype) == "triton":
        # Real prefill steps on this path go through the mixed-batch kernel, whose working memory is far below
        # SDPA's; profiling SDPA would hold back KV memory that no step uses.
        _add_mixed_layout(meta, list(starts), span, num_tokens, block_size, device)
    input_ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    sample_rows = torch.arange(num_tokens - num_seqs, num_tokens, device=device)
    vocab_size = model.config.vocab_size
    # Banned tokens, temperature, min-p, top-k with top-p and logprobs: the sampler path that copies the logits most.
    row = SamplingRow(
        temperature=0.7, top_p=0.9, top_k=min(50, vocab_size - 1), min_p=0.05, num_logprobs=5, banned_token_ids=(0,)
    )

    def run() -> None:
        hidden = model(input_ids, positions, meta)
        logits = model.compute_logits(hidden[sample_rows])
        if logits is not None:  # only the sampling rank receives logits
            Sampler()(logits, [row] * num_seqs)

    return run


def _add_mixed_layout(
    meta: AttentionMetadata, starts: list[int], span: int, num_tokens: int, block_size: int, device: torch.device
) -> None:
    """The mixed-batch kernel's view of the profile's spans: each a fresh prefill over slots it wrote itself."""
    lengths = [min(span, num_tokens - s) for s in starts]
    num_blocks = -(-num_tokens // block_size)  # the temporary cache holds exactly these
    width = -(-span // block_size) + 1
    table = torch.tensor(
        [[min(s // block_size + j, num_blocks - 1) for j in range(width)] for s in starts], dtype=torch.long
    )
    meta.mixed_block_table = table.to(device)
    meta.mixed_context_lens = torch.tensor(lengths, dtype=torch.long, device=device)
    meta.mixed_query_starts = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.long, device=device)


def _decode_step(
    model: torch.nn.Module, device: torch.device, block_size: int, num_seqs: int, max_blocks_per_seq: int
) -> Callable[[], None]:
    """The forward of the largest decode batch a CUDA graph captures: one token for each of `num_seqs` requests.

    Decode i writes slot i and attends over the slots before it in its block. The Triton kernel's partial results
    grow with the block table's width, which a captured batch pads to a whole request's blocks; the torch path
    gathers that width for every row, which no real step at these context lengths does, so it gets one block.
    """
    dtype = next(model.parameters()).dtype
    kernel = decode_path(device, model.num_heads_per_rank, model.num_kv_heads_per_rank, model.head_dim, dtype)
    width = max_blocks_per_seq if kernel == "triton" else 1
    slots = torch.arange(num_seqs, device=device)
    table = torch.zeros(num_seqs, width, dtype=torch.long, device=device)
    table[:, 0] = slots // block_size
    meta = AttentionMetadata(
        slot_mapping=slots,
        block_size=block_size,
        num_decodes=num_seqs,
        decode_block_table=table,
        decode_context_lens=slots % block_size + 1,
    )
    input_ids = torch.zeros(num_seqs, dtype=torch.long, device=device)
    positions = slots % block_size

    def run() -> None:
        model(input_ids, positions, meta)

    return run


def _profile_steps(
    model: torch.nn.Module,
    probe: MemoryProbe,
    device: torch.device,
    block_size: int,
    num_tokens: int,
    num_seqs: int,
    max_model_len: int,
    with_decode: bool,
) -> tuple[int, int]:
    """(prefill peak, decode peak) of the profiled steps; their inputs are freed when this returns."""
    prefill_peak = _measure(probe, _prefill_step(model, device, block_size, num_tokens, num_seqs, max_model_len))
    decode_peak = 0
    if with_decode:
        max_blocks_per_seq = -(-max_model_len // block_size)
        size = largest_capture(num_seqs)
        decode_peak = _measure(probe, _decode_step(model, device, block_size, size, max_blocks_per_seq))
    return prefill_peak, decode_peak


def largest_capture(num_seqs: int) -> int:
    """The largest decode batch the model runner captures a graph for (see cuda_graphs)."""
    return capture_sizes(num_seqs, DEFAULT_MAX_CAPTURE_SIZE)[-1]


@torch.inference_mode()
def profile_kv_cache(
    model: torch.nn.Module,
    probe: MemoryProbe,
    *,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    max_num_batched_tokens: int,
    max_num_seqs: int,
    max_model_len: int,
    gpu_memory_utilization: float,
    enforce_eager: bool,
    scratch_blocks: int = 1,
    extra_bytes_per_block: int = 0,
) -> KvCacheProfile:
    """Run the worst steps against a temporary cache and size the real one from what is left. `dtype` is the KV
    cache's (the compute dtype, or fp8): both the temporary cache and the block size use it.

    usable = total * gpu_memory_utilization - (weights + activation peak + non-torch + graph reserve), and the
    cache gets usable // bytes_per_block blocks, `scratch_blocks` of which the head never hands out. Must run
    before the real cache is allocated: the layers' caches are swapped for the temporary one meanwhile.
    """
    num_tokens = max(1, max_num_batched_tokens)
    # The scheduler never runs more requests in a step than it has tokens for.
    num_seqs = max(1, min(max_num_seqs, num_tokens))
    layers = model.attention_layers()
    num_layers, kv_heads, head_dim = model.num_layers, model.num_kv_heads_per_rank, model.head_dim
    # A draft model's KV shares the blocks (extra_bytes_per_block).
    per_block = bytes_per_block(num_layers, kv_heads, head_dim, block_size, dtype) + extra_bytes_per_block

    probe.synchronize()
    probe.empty_cache()
    previous = [layer.kv_cache for layer in layers]
    # One slot per profiled token, no more: the decodes write into the first num_seqs slots.
    num_temp_blocks = -(-num_tokens // block_size)
    _bind(layers, allocate_kv_caches(num_layers, num_temp_blocks, block_size, kv_heads, head_dim, dtype, device))
    try:
        # Graphs are captured only when not eager: only then does the decode batch's pool outlive its step.
        prefill_peak, decode_peak = _profile_steps(
            model, probe, device, block_size, num_tokens, num_seqs, max_model_len, not enforce_eager
        )
    finally:
        _bind(layers, previous)
    probe.synchronize()
    probe.empty_cache()

    # Measured after the profile so persistent workspaces its kernels created (cuBLAS, Triton) are counted.
    weights = probe.allocated()
    free, total = probe.mem_get_info()
    # Includes other processes on the device: the budget is a share of the card, whoever uses the rest.
    non_torch = max(0, total - free - probe.reserved())
    if enforce_eager:
        graph_reserve, kind = 0, "none: enforce_eager"
    else:
        # The captures share one private pool that keeps the largest capture's activations for good.
        graph_reserve = decode_peak + GRAPH_FIXED_RESERVE
        kind = f"decode peak at {largest_capture(num_seqs)} seqs + {GRAPH_FIXED_RESERVE} fixed"
    activation_peak = max(prefill_peak, decode_peak)
    usable = int(total * gpu_memory_utilization) - (weights + activation_peak + non_torch + graph_reserve)
    profile = KvCacheProfile(
        total=total,
        gpu_memory_utilization=gpu_memory_utilization,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        weights=weights,
        prefill_peak=prefill_peak,
        decode_peak=decode_peak,
        activation_peak=activation_peak,
        non_torch=non_torch,
        graph_reserve=graph_reserve,
        graph_reserve_kind=kind,
        kv_cache_bytes=usable,
        bytes_per_block=per_block,
        num_blocks=max(0, usable) // per_block - scratch_blocks,
        kv_dtype=str(dtype).removeprefix("torch."),
    )
    if profile.num_blocks < 1:
        raise ValueError(
            f"no room for the KV cache at gpu_memory_utilization={gpu_memory_utilization}: {profile.summary()}; "
            f"it needs at least {(scratch_blocks + 1) * per_block} bytes ({scratch_blocks} scratch block and one "
            "for requests). Raise gpu_memory_utilization, lower max_num_batched_tokens or max_num_seqs, set "
            "enforce_eager, or shard the model over more tensor-parallel ranks"
        )
    return profile
