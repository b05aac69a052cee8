"""Triton paged-attention decode kernel: one query token per sequence, reading K/V through the block table."""

from __future__ import annotations

import functools
import math

import torch

from pagerail.worker.layers.triton_common import (
    INTERPRETED,
    LOG2E,
    check_sinks,
    kv_operands,
    softcapped,
    tl,
    triton,
    triton_available,
)

# Imported from here by tests and the attention layer.
__all__ = ["INTERPRETED", "paged_decode_attention", "triton_available"]

# Context tokens one split program covers before its partial result is merged by the reduce kernel.
_DEFAULT_PARTITION_SIZE = 512
# More partitions than this would make the reduce kernel hold too large a [partitions, head_dim] tile.
_MAX_PARTITIONS = 64

# Plain int arguments that change from step to step are not specialised: Triton would otherwise compile a variant
# per "== 1" / "divisible by 16" pattern of them (a step with one partition, a table 16 blocks wide, ...), each
# costing seconds on the first step that meets it. Strides of the cache and head counts stay specialised: they
# are fixed for a model.
_DECODE_DYNAMIC = ("partition_size", "window", "num_partitions", "stride_table_seq")

if triton is not None:

    @triton.jit(do_not_specialize=_DECODE_DYNAMIC)
    def _paged_decode_kernel(
        out_ptr,
        q_ptr,
        key_cache_ptr,
        value_cache_ptr,
        block_tables_ptr,
        context_lens_ptr,
        part_max_ptr,
        part_sum_ptr,
        part_acc_ptr,
        sinks_ptr,
        qk_scale,
        softcap,
        partition_size,
        window,
        num_heads,
        num_partitions,
        stride_q_seq,
        stride_q_head,
        stride_out_seq,
        stride_out_head,
        stride_k_slot,
        stride_k_head,
        stride_v_slot,
        stride_v_head,
        stride_table_seq,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        GROUP: tl.constexpr,
        GROUP_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE: tl.constexpr,
        SPLIT: tl.constexpr,
        SOFTCAP: tl.constexpr,
        HAS_SINKS: tl.constexpr,
        KV_FP8: tl.constexpr,
        DOT_DTYPE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        k_scale_ptr,  # last: kv_operands passes them by name, with the constexprs
        v_scale_ptr,
    ):
        # One program per (sequence, KV head, context partition). All GROUP query heads that share the
        # KV head are handled together, so each K/V tile is read from memory once for the whole group.
        seq = tl.program_id(0)
        kv_head = tl.program_id(1)
        part = tl.program_id(2)

        context_len = tl.load(context_lens_ptr + seq)
        if SPLIT:
            start = part * partition_size
            end = tl.minimum(start + partition_size, context_len)
        else:
            start = 0
            end = context_len
        # A sliding-window layer (window > 0): keys before the last `window` positions are never read. A partition
        # wholly before them runs no tile and leaves a -inf max, which the reduce kernel weighs as zero. Taken
        # without a branch: a runtime `if` may not change `start` from a constant to a tensor.
        start = tl.maximum(start, tl.where(window > 0, context_len - window, 0))

        group = tl.arange(0, GROUP_PAD)
        dims = tl.arange(0, HEAD_DIM_PAD)
        group_mask = group < GROUP
        dim_mask = dims < HEAD_DIM
        heads = kv_head * GROUP + group
        q_mask = group_mask[:, None] & dim_mask[None, :]
        q = tl.load(q_ptr + seq * stride_q_seq + heads[:, None] * stride_q_head + dims[None, :], mask=q_mask, other=0.0)
        # tl.dot wants both operands in one dtype: the cache dtype, so K/V are fed to it as stored (fp8 K/V are
        # converted, exactly, to the queries' dtype).
        q = q.to(DOT_DTYPE)
        if KV_FP8:  # K holds k / k_scale: the scale joins the score scale instead of multiplying every key
            qk_scale = qk_scale * tl.load(k_scale_ptr)

        # Online softmax state in the exp2 domain (qk_scale already carries log2(e)).
        row_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        row_sum = tl.zeros([GROUP_PAD], tl.float32)
        if HAS_SINKS and not SPLIT:
            # The sink is a score with no value: it starts the online softmax as its first term, exp2(0) = 1 at
            # its own max. Split partials leave it to the reduce kernel, which counts it once.
            row_max = tl.load(sinks_ptr + heads, mask=group_mask, other=0.0).to(tl.float32) * LOG2E
            row_sum = tl.full([GROUP_PAD], 1.0, tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], tl.float32)

        # A KV head's offset in a cache of more than 2**31 elements overflows int32.
        key_head_offset = kv_head.to(tl.int64) * stride_k_head
        value_head_offset = kv_head.to(tl.int64) * stride_v_head
        offsets = tl.arange(0, TILE)
        for tile_start in range(start, end, TILE):
            positions = tile_start + offsets
            valid = positions < end
            # Each token finds its slot through the block table, so a tile may span several physical blocks
            # and the tile size does not depend on block_size. int64 keeps slot * stride from overflowing.
            block_ids = tl.load(
                block_tables_ptr + seq * stride_table_seq + positions // BLOCK_SIZE, mask=valid, other=0
            ).to(tl.int64)
            slots = block_ids * BLOCK_SIZE + positions % BLOCK_SIZE
            kv_mask = valid[:, None] & dim_mask[None, :]

            k = tl.load(
                key_cache_ptr + slots[:, None] * stride_k_slot + key_head_offset + dims[None, :],
                mask=kv_mask,
                other=0.0,
            ).to(DOT_DTYPE)
            scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            if SOFTCAP:
                scores = softcapped(scores, softcap)
            scores = tl.where(valid[None, :], scores, float("-inf"))

            # The first tile always holds a real token, so new_max is finite from then on.
            new_max = tl.maximum(row_max, tl.max(scores, axis=1))
            rescale = tl.exp2(row_max - new_max)
            probs = tl.exp2(scores - new_max[:, None])
            row_sum = row_sum * rescale + tl.sum(probs, axis=1)

            v = tl.load(
                value_cache_ptr + slots[:, None] * stride_v_slot + value_head_offset + dims[None, :],
                mask=kv_mask,
                other=0.0,
            ).to(DOT_DTYPE)
            acc = acc * rescale[:, None] + tl.dot(probs.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
            row_max = new_max

        if KV_FP8:  # V holds v / v_scale: one multiply of the weighted sums (split partials included)
            acc = acc * tl.load(v_scale_ptr)
        if SPLIT:
            # Unnormalised partials; the reduce kernel rescales them against the global max.
            part_index = (seq * num_heads + heads) * num_partitions + part
            tl.store(part_max_ptr + part_index, row_max, mask=group_mask)
            tl.store(part_sum_ptr + part_index, row_sum, mask=group_mask)
            tl.store(part_acc_ptr + part_index[:, None] * HEAD_DIM + dims[None, :], acc, mask=q_mask)
        else:
            # An empty context yields zeros instead of 0/0.
            out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
            tl.store(
                out_ptr + seq * stride_out_seq + heads[:, None] * stride_out_head + dims[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=q_mask,
            )

    @triton.jit(do_not_specialize=("partition_size", "num_partitions"))
    def _reduce_partitions_kernel(
        out_ptr,
        part_max_ptr,
        part_sum_ptr,
        part_acc_ptr,
        context_lens_ptr,
        sinks_ptr,
        partition_size,
        num_heads,
        num_partitions,
        stride_out_seq,
        stride_out_head,
        HEAD_DIM: tl.constexpr,
        HEAD_DIM_PAD: tl.constexpr,
        PARTITIONS_PAD: tl.constexpr,
        PARTITION_CHUNK: tl.constexpr,
        HAS_SINKS: tl.constexpr,
    ):
        # One program per (sequence, query head): merge the partial softmax results of its partitions.
        seq = tl.program_id(0)
        head = tl.program_id(1)

        # Partitions past the context were never written; they are masked, not read.
        used = tl.cdiv(tl.load(context_lens_ptr + seq), partition_size)
        parts = tl.arange(0, PARTITIONS_PAD)
        part_mask = parts < used
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_mask = dims < HEAD_DIM

        part_index = (seq * num_heads + head) * num_partitions + parts
        part_max = tl.load(part_max_ptr + part_index, mask=part_mask, other=float("-inf"))
        part_sum = tl.load(part_sum_ptr + part_index, mask=part_mask, other=0.0)
        top = tl.max(part_max, axis=0)
        if HAS_SINKS:
            # The head's sink joins the merge as one more partial: its max, a sum of 1, no output.
            sink = tl.load(sinks_ptr + head).to(tl.float32) * LOG2E
            top = tl.maximum(top, sink)
        total = tl.sum(part_sum * tl.where(part_mask, tl.exp2(part_max - top), 0.0), axis=0)
        if HAS_SINKS:
            total += tl.exp2(sink - top)

        # The partial outputs are summed a chunk of partitions at a time: all 64 rows of a wide head at once
        # would not fit the registers of four warps.
        acc = tl.zeros([HEAD_DIM_PAD], dtype=tl.float32)
        for chunk in range(0, used, PARTITION_CHUNK):
            rows = chunk + tl.arange(0, PARTITION_CHUNK)
            row_mask = rows < used
            row_index = (seq * num_heads + head) * num_partitions + rows
            row_max = tl.load(part_max_ptr + row_index, mask=row_mask, other=float("-inf"))
            row_weights = tl.where(row_mask, tl.exp2(row_max - top), 0.0)
            rows_acc = tl.load(
                part_acc_ptr + row_index[:, None] * HEAD_DIM + dims[None, :],
                mask=row_mask[:, None] & dim_mask[None, :],
                other=0.0,
            )
            acc += tl.sum(rows_acc * row_weights[:, None], axis=0)
        out = acc / tl.where(total > 0, total, 1.0)
        tl.store(
            out_ptr + seq * stride_out_seq + head * stride_out_head + dims,
            out.to(out_ptr.dtype.element_ty),
            mask=dim_mask,
        )


@functools.lru_cache(maxsize=8)
def _sm_count(device_index: int) -> int:
    """Streaming multiprocessors of one CUDA device; queried once per device."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _pick_partition_size(q: torch.Tensor, num_kv_heads: int, max_context: int, tile: int) -> int | None:
    """Split the context only when (sequence, KV head) programs alone would leave most of the GPU idle."""
    if q.device.type != "cuda" or max_context <= 2 * _DEFAULT_PARTITION_SIZE:
        return None
    device_index = torch.cuda.current_device() if q.device.index is None else q.device.index
    if q.shape[0] * num_kv_heads >= _sm_count(device_index):
        return None
    needed = -(-max_context // _MAX_PARTITIONS)
    return max(_DEFAULT_PARTITION_SIZE, -(-needed // tile) * tile)


def paged_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    *,
    partition_size: int | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [n, H, D] attends over its paged context (its last `sliding_window` positions when > 0) → [n, H, D].

    `sinks` [H] (any float dtype) adds exp(sinks[h]) to head h's softmax denominator: a logit with no value.

    key_cache/value_cache are [num_slots, KVH, D] with slot = block_id * block_size + offset. block_tables
    [n, max_blocks] and context_lens [n] are int32 (int64 is accepted too); context_lens counts the token
    being decoded, and table entries past a sequence's context are never read. Query head h reads KV head
    h // (H // KVH). `partition_size` forces a split-context pass (None: chosen per launch). An fp8 cache holds
    value / scale, with `k_scale`/`v_scale` float32 scalars on q's device.
    """
    if triton is None:
        raise RuntimeError("paged_decode_attention needs triton")
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[1]
    if key_cache.shape != value_cache.shape or key_cache.shape[2] != head_dim:
        raise ValueError(f"cache shapes {tuple(key_cache.shape)}/{tuple(value_cache.shape)} do not fit q {q.shape}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads")
    if block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    index_dtypes = (torch.int32, torch.int64)
    if block_tables.dtype not in index_dtypes or context_lens.dtype not in index_dtypes:
        raise ValueError("block_tables and context_lens must be int32 or int64")
    if block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise ValueError("block_tables and context_lens need one row per sequence")

    operands = kv_operands(q, key_cache, value_cache, k_scale, v_scale)
    # The kernels index the last dimension with unit stride.
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("key/value cache must be contiguous in head_dim")
    check_sinks(sinks, num_heads, q.device)

    out = torch.empty((num_seqs, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_seqs == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    context_lens = context_lens.contiguous()

    group = num_heads // num_kv_heads
    # tl.dot needs every dimension to be at least 16.
    group_pad = max(16, triton.next_power_of_2(group))
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    tile = 64 if head_dim_pad <= 128 else 32
    # The table width bounds every context without reading context_lens back from the device.
    max_context = block_tables.shape[1] * block_size
    if partition_size is None:
        partition_size = _pick_partition_size(q, num_kv_heads, max_context, tile)
    elif partition_size <= 0 or partition_size % tile:
        raise ValueError(f"partition_size must be a positive multiple of {tile}, got {partition_size}")
    num_partitions = 1 if partition_size is None else max(1, -(-max_context // partition_size))
    if num_partitions > _MAX_PARTITIONS:
        raise ValueError(
            f"partition_size {partition_size} splits a {max_context}-token table into {num_partitions} partitions; "
            f"at most {_MAX_PARTITIONS} are supported"
        )
    split = num_partitions > 1
    if split:
        part_max = torch.empty((num_seqs, num_heads, num_partitions), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
        part_acc = torch.empty((num_seqs, num_heads, num_partitions, head_dim), dtype=torch.float32, device=q.device)
    else:
        part_max = part_sum = part_acc = out  # never touched when not splitting

    _paged_decode_kernel[(num_seqs, num_kv_heads, num_partitions)](
        out,
        q,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        part_max,
        part_sum,
        part_acc,
        out if sinks is None else sinks.contiguous(),  # never read without sinks
        scale * math.log2(math.e),
        softcap * math.log2(math.e),
        partition_size or 0,
        sliding_window,
        num_heads,
        num_partitions,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        value_cache.stride(0),
        value_cache.stride(1),
        block_tables.stride(0),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_SIZE=block_size,
        TILE=tile,
        SPLIT=split,
        SOFTCAP=softcap > 0,
        HAS_SINKS=sinks is not None,
        **operands,
    )
    if split:
        _reduce_partitions_kernel[(num_seqs, num_heads)](
            out,
            part_max,
            part_sum,
            part_acc,
            context_lens,
            out if sinks is None else sinks.contiguous(),
            partition_size,
            num_heads,
            num_partitions,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            # One width for every split, so the split count never selects another compiled variant.
            PARTITIONS_PAD=_MAX_PARTITIONS,
            PARTITION_CHUNK=16,
            HAS_SINKS=sinks is not None,
        )
    return out
