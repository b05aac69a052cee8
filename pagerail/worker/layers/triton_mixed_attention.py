"""Triton paged attention for mixed batches: prefill chunks, prefix hits and decodes of one step in one launch."""

from __future__ import annotations

import math

import torch

from pagerail.worker.layers.kv_quant import is_fp8
from pagerail.worker.layers.triton_common import (
    LOG2E,
    TL_DTYPES,
    check_sinks,
    kv_operands,
    softcapped,
    triton,
    triton_available,
)

if triton is not None:
    import triton.language as tl

__all__ = ["paged_mixed_attention", "triton_available"]


if triton is not None:

    @triton.jit
    def _attend_tile(
        q,
        acc,
        row_max,
        row_sum,
        tile_start,
        kv_end,
        query_pos,
        window,
        seq,
        key_base,
        value_base,
        block_tables_ptr,
        qk_scale,
        softcap,
        stride_k_slot,
        stride_v_slot,
        stride_table_seq,
        dims,
        dim_mask,
        BLOCK_SIZE: tl.constexpr,
        TILE_N: tl.constexpr,
        MASKED: tl.constexpr,
        WINDOWED: tl.constexpr,
        SOFTCAP: tl.constexpr,
        DOT_DTYPE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        # One K/V tile folded into the online softmax of every query row of the program.
        positions = tile_start + tl.arange(0, TILE_N)
        # Each key finds its slot through the block table, so a tile may span several blocks and its size does
        # not depend on block_size. int64 keeps slot * stride from overflowing on large caches.
        table_row = block_tables_ptr + seq * stride_table_seq
        if MASKED:
            valid = positions < kv_end
            block_ids = tl.load(table_row + positions // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            kv_mask = valid[:, None] & dim_mask[None, :]
        else:
            # Every key of an unmasked tile is in the context: only the head_dim padding is masked.
            block_ids = tl.load(table_row + positions // BLOCK_SIZE).to(tl.int64)
            kv_mask = dim_mask[None, :]
        slots = block_ids * BLOCK_SIZE + positions % BLOCK_SIZE
        k = tl.load(
            key_base + slots[:, None] * stride_k_slot + dims[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(DOT_DTYPE)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if SOFTCAP:
            scores = softcapped(scores, softcap)
        if MASKED:
            # Causal within the chunk: the query at position p sees keys 0..p (and never past the context).
            visible = (positions[None, :] <= query_pos[:, None]) & valid[None, :]
            if WINDOWED:
                # A sliding-window layer: the query at p sees keys p - window + 1 .. p only.
                visible = visible & (positions[None, :] > query_pos[:, None] - window)
            scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        # A row that has seen no key yet keeps -inf; subtracting 0 instead avoids inf - inf = nan.
        shift = tl.where(new_max == float("-inf"), 0.0, new_max)
        rescale = tl.exp2(row_max - shift)
        probs = tl.exp2(scores - shift[:, None])
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        v = tl.load(
            value_base + slots[:, None] * stride_v_slot + dims[None, :],
            mask=kv_mask,
            other=0.0,
        ).to(DOT_DTYPE)
        acc = acc * rescale[:, None] + tl.dot(probs.to(DOT_DTYPE), v, input_precision=DOT_PRECISION)
        return acc, new_max, row_sum

    # The sequence count and the table view's width change every step: not specialised (see triton_attention).
    @triton.jit(do_not_specialize=("num_seqs", "window", "stride_table_seq"))
    def _paged_mixed_kernel(
        out_ptr,
        q_ptr,
        key_cache_ptr,
        value_cache_ptr,
        block_tables_ptr,
        query_starts_ptr,
        context_lens_ptr,
        sinks_ptr,
        qk_scale,
        softcap,
        num_seqs,
        window,
        stride_q_tok,
        stride_q_head,
        stride_out_tok,
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
        BLOCK_Q: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE_N: tl.constexpr,
        WINDOWED: tl.constexpr,
        SOFTCAP: tl.constexpr,
        HAS_SINKS: tl.constexpr,
        KV_FP8: tl.constexpr,
        DOT_DTYPE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
        k_scale_ptr,  # last: kv_operands passes them by name, with the constexprs
        v_scale_ptr,
    ):
        # Programs are (query tile, KV head). Query tiles of all sequences are numbered back to back, sequence s
        # owning tiles from first(s) = query_starts[s] // BLOCK_Q + s on; first() grows by at least the tile count
        # of each sequence, so the ranges never overlap and T // BLOCK_Q + S programs cover them all. A program
        # finds its sequence by binary search over first(), on the device, with no host-built map and no sync.
        tile_id = tl.program_id(0)
        kv_head = tl.program_id(1)
        lo = tl.zeros([], dtype=tl.int32)
        hi = lo + num_seqs
        while hi - lo > 1:  # invariant: first(lo) <= tile_id < first(hi)
            mid = (lo + hi) // 2
            take = tl.load(query_starts_ptr + mid) // BLOCK_Q + mid <= tile_id
            lo = tl.where(take, mid, lo)
            hi = tl.where(take, hi, mid)
        seq = lo
        q_start = tl.load(query_starts_ptr + seq)
        q_len = tl.load(query_starts_ptr + seq + 1) - q_start
        tile = tile_id - (q_start // BLOCK_Q + seq)
        if tile * BLOCK_Q >= q_len:
            return  # a gap between two sequences' tiles

        context_len = tl.load(context_lens_ptr + seq)
        # Rows are (query token, head of the group) pairs: every query head reading this KV head shares each
        # K/V tile the program loads.
        rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
        query = tile * BLOCK_Q + rows // GROUP_PAD
        member = rows % GROUP_PAD
        row_valid = (query < q_len) & (member < GROUP)
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_mask = dims < HEAD_DIM
        tokens = (q_start + query).to(tl.int64)
        heads = kv_head * GROUP + member
        io_mask = row_valid[:, None] & dim_mask[None, :]
        q = tl.load(
            q_ptr + tokens[:, None] * stride_q_tok + heads[:, None] * stride_q_head + dims[None, :],
            mask=io_mask,
            other=0.0,
        ).to(DOT_DTYPE)
        if KV_FP8:  # K holds k / k_scale (converted exactly to DOT_DTYPE): the scale joins the score scale
            qk_scale = qk_scale * tl.load(k_scale_ptr)

        # This step's queries are the last q_len positions of the context.
        query_pos = context_len - q_len + query
        first_pos = context_len - q_len + tile * BLOCK_Q
        kv_end = tl.minimum(first_pos + BLOCK_Q, context_len)
        # Keys below the first query's position are visible to every row: those whole tiles skip the masks.
        full_end = (first_pos + 1) // TILE_N * TILE_N

        # In int64: kv_head * stride of a head-major cache passes 2**31 elements on large caches.
        key_base = key_cache_ptr + kv_head.to(tl.int64) * stride_k_head
        value_base = value_cache_ptr + kv_head.to(tl.int64) * stride_v_head
        row_max = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
        row_sum = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
        if HAS_SINKS:
            # Each row's head sink is a score with no value: the online softmax starts from it, exp2(0) = 1.
            row_max = tl.load(sinks_ptr + heads, mask=member < GROUP, other=0.0).to(tl.float32) * LOG2E
            row_sum = tl.full([BLOCK_Q * GROUP_PAD], 1.0, tl.float32)
        acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_PAD], tl.float32)
        if WINDOWED:
            # Every tile from the first query's window start on is masked per row: the window's lower edge moves
            # with the query, so no tile is visible to all rows in general.
            window_start = tl.maximum(first_pos - window + 1, 0) // TILE_N * TILE_N
            for tile_start in range(window_start, kv_end, TILE_N):
                acc, row_max, row_sum = _attend_tile(
                    q, acc, row_max, row_sum, tile_start, kv_end, query_pos, window, seq, key_base, value_base,
                    block_tables_ptr, qk_scale, softcap, stride_k_slot, stride_v_slot, stride_table_seq,
                    dims, dim_mask, BLOCK_SIZE, TILE_N, True, True, SOFTCAP, DOT_DTYPE, DOT_PRECISION,
                )  # fmt: skip
        else:
            for tile_start in range(0, full_end, TILE_N):
                acc, row_max, row_sum = _attend_tile(
                    q, acc, row_max, row_sum, tile_start, kv_end, query_pos, window, seq, key_base, value_base,
                    block_tables_ptr, qk_scale, softcap, stride_k_slot, stride_v_slot, stride_table_seq,
                    dims, dim_mask, BLOCK_SIZE, TILE_N, False, False, SOFTCAP, DOT_DTYPE, DOT_PRECISION,
                )  # fmt: skip
            for tile_start in range(full_end, kv_end, TILE_N):
                acc, row_max, row_sum = _attend_tile(
                    q, acc, row_max, row_sum, tile_start, kv_end, query_pos, window, seq, key_base, value_base,
                    block_tables_ptr, qk_scale, softcap, stride_k_slot, stride_v_slot, stride_table_seq,
                    dims, dim_mask, BLOCK_SIZE, TILE_N, True, False, SOFTCAP, DOT_DTYPE, DOT_PRECISION,
                )  # fmt: skip

        if KV_FP8:  # V holds v / v_scale: one multiply of the weighted sums instead of one per value
            acc = acc * tl.load(v_scale_ptr)
        out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
        tl.store(
            out_ptr + tokens[:, None] * stride_out_tok + heads[:, None] * stride_out_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=io_mask,
        )


def _check_inputs(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
) -> None:
    """Shapes, dtypes and devices always; the index values too when they are on the host (no device sync)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, heads, head_dim], got shape {tuple(q.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    if key_cache.dim() != 3 or key_cache.shape != value_cache.shape or key_cache.shape[2] != head_dim:
        raise ValueError(
            f"key/value cache must both be [slots, kv_heads, {head_dim}], "
            f"got {tuple(key_cache.shape)}/{tuple(value_cache.shape)}"
        )
    num_kv_heads = key_cache.shape[1]
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads")
    if block_size <= 0 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two, got {block_size}")
    same = value_cache.dtype == key_cache.dtype and (key_cache.dtype == q.dtype or is_fp8(key_cache.dtype))
    if q.dtype not in TL_DTYPES or not same:
        dtypes = f"{q.dtype}/{key_cache.dtype}/{value_cache.dtype}"
        raise ValueError(f"q and the caches must share one dtype of fp32/fp16/bf16 (or the caches fp8), got {dtypes}")
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("key/value cache must be contiguous in head_dim")
    index_dtypes = (torch.int32, torch.int64)
    indices = {"block_tables": block_tables, "query_starts": query_starts, "context_lens": context_lens}
    for name, tensor in indices.items():
        if tensor.dtype not in index_dtypes:
            raise ValueError(f"{name} must be int32 or int64, got {tensor.dtype}")
    for name, tensor in {"key_cache": key_cache, "value_cache": value_cache, **indices}.items():
        if tensor.device != q.device:
            raise ValueError(f"{name} is on {tensor.device}, q on {q.device}: all inputs must share one device")
    num_seqs = context_lens.shape[0] if context_lens.dim() == 1 else -1
    if num_seqs < 0 or query_starts.shape != (num_seqs + 1,):
        shapes = f"{tuple(context_lens.shape)} and {tuple(query_starts.shape)}"
        raise ValueError(f"context_lens must be [S] and query_starts [S + 1], got {shapes}")
    if block_tables.dim() != 2 or block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables must be [{num_seqs}, max_blocks], got {tuple(block_tables.shape)}")
    if q.device.type != "cpu" or num_seqs == 0:
        return
    starts, lens = query_starts.tolist(), context_lens.tolist()
    if starts[0] != 0 or starts[-1] != num_tokens:
        raise ValueError(
            f"query_starts must run from 0 to the {num_tokens} query tokens, got {starts[0]}..{starts[-1]}"
        )
    query_lens = [b - a for a, b in zip(starts, starts[1:], strict=False)]
    for seq, (query_len, context_len) in enumerate(zip(query_lens, lens, strict=True)):
        if query_len < 0 or context_len < query_len:
            raise ValueError(
                f"sequence {seq}: query_starts must not decrease and context_lens ({context_len}) must cover "
                f"its {query_len} queries"
            )
    capacity = block_tables.shape[1] * block_size
    if max(lens) > capacity:
        raise ValueError(f"a context of {max(lens)} tokens exceeds the block table's {capacity} slots per sequence")


def _tile_shape(dtype: torch.dtype, head_dim_pad: int, group_pad: int) -> tuple[int, int, int]:
    """(query tokens per program, keys per K/V tile, warps), from register budgets on sm_90.

    A program holds rows = query tokens x group_pad query heads: 64 rows and 64 keys keep a 128-wide fp16/bf16
    head in the registers of four warps. A 256-wide head gets 32 rows and eight warps: at four warps every tile
    shape that keeps 64 keys spills (ptxas, see tests/test_hopper_builds.py). fp32 runs its dots as exact FMAs,
    which need far more registers: it gets the smallest tiles (16 rows, 32 keys). The interpreter runs the same
    shapes as a GPU.
    """
    rows, keys, warps = (64, 64, 4) if head_dim_pad <= 128 else (32, 64, 8)
    if dtype == torch.float32:
        rows, keys = 16, 32
    # tl.dot needs at least 16 rows; a group wider than that gets one query token per program.
    return max(1, rows // group_pad, 16 // group_pad), keys, warps


def paged_mixed_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, D] of every sequence of a step attends causally over its paged context → [T, H, D]; with
    `sliding_window` > 0 the query at position p sees only keys p - sliding_window + 1 .. p; with `softcap` > 0
    scores pass through softcap * tanh(score / softcap); `sinks` [H] adds exp(sinks[h]) to head h's softmax
    denominator (a logit with no value).

    Sequence s owns query rows query_starts[s]:query_starts[s + 1]; they are the last positions of its
    context_lens[s] tokens, whose K/V (this step's included) are already in the cache. key_cache/value_cache
    are [num_slots, KVH, D] (any strides but a unit last one) with slot = block_id * block_size + offset;
    block_tables [S, max_blocks] may be wider than any context, entries past a context are never read. Query
    head h reads KV head h // (H // KVH). Index tensors are int32 or int64. An fp8 cache holds value / scale, with
    `k_scale`/`v_scale` float32 scalars on q's device.
    """
    if triton is None:
        raise RuntimeError("paged_mixed_attention needs triton")
    _check_inputs(q, key_cache, value_cache, block_tables, query_starts, context_lens, block_size)
    check_sinks(sinks, q.shape[1], q.device)
    operands = kv_operands(q, key_cache, value_cache, k_scale, v_scale)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = key_cache.shape[1]
    num_seqs = context_lens.shape[0]
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    query_starts = query_starts.contiguous()
    context_lens = context_lens.contiguous()

    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    block_q, tile_n, num_warps = _tile_shape(q.dtype, head_dim_pad, group_pad)
    # (query tile, KV head) programs, tiles numbered across all sequences (see the kernel). A (sequence, tile,
    # head) grid would be sized by the longest chunk, so one long prefill beside hundreds of decodes would launch
    # hundreds of idle programs per tile; a host-built tile map would tie the input buffers to this kernel's tile
    # size. This grid needs only T and S, known on the host: no device read, and at most S idle programs.
    grid = (num_tokens // block_q + num_seqs, num_kv_heads)
    _paged_mixed_kernel[grid](
        out,
        q,
        key_cache,
        value_cache,
        block_tables,
        query_starts,
        context_lens,
        out if sinks is None else sinks.contiguous(),  # never read without sinks
        scale * math.log2(math.e),
        softcap * math.log2(math.e),
        num_seqs,
        sliding_window,
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
        BLOCK_Q=block_q,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        WINDOWED=sliding_window > 0,
        SOFTCAP=softcap > 0,
        HAS_SINKS=sinks is not None,
        **operands,
        num_warps=num_warps,
        # Double-buffered K/V tiles fit shared memory for every dtype and head size up to 256.
        num_stages=2,
    )
    return out
