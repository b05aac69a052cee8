"""Paged attention: write new K/V into the cache through the slot mapping, attend over the whole context."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from pagerail.worker.layers import cpu_fused
from pagerail.worker.layers.cpu_paged_attention import native_kernel
from pagerail.worker.layers.kv_quant import dequantize, is_fp8, write_fp8
from pagerail.worker.layers.triton_attention import paged_decode_attention, triton_available
from pagerail.worker.layers.triton_mixed_attention import paged_mixed_attention


@dataclass
class PrefillSpan:
    """One request's prefill (or prefill chunk) inside the flat token batch.

    Token rows `start:end` are this chunk's queries. `context_blocks` lists the cache blocks of the
    whole context (cached prefix + this chunk, `context_len` tokens), and `mask` is the [q, ctx]
    causal mask; both are None when nothing was cached before this chunk, so plain causal attention
    over the fresh K/V applies.
    """

    start: int
    end: int
    context_blocks: torch.Tensor | None = None
    context_len: int = 0
    mask: torch.Tensor | None = None


@dataclass
class AttentionMetadata:
    """Per-step index tensors shared by every attention layer.

    Rows of the flat batch are ordered decodes first, then prefill chunks:

        rows  0 .. num_decodes-1 | prefill span 0 | prefill span 1 | ...
              one token each     | start:end      | start:end      |
    """

    slot_mapping: torch.Tensor  # [T] cache slot for each new token's K/V
    block_size: int = 16
    num_decodes: int = 0
    decode_block_table: torch.Tensor | None = None  # [num_decodes, max_blocks] padded with block 0
    decode_context_lens: torch.Tensor | None = None  # [num_decodes]
    # [num_decodes, 1, 1, max_blocks * block_size] True where a key is real. Only the torch decode path reads it;
    # left None it is derived there from decode_context_lens.
    decode_mask: torch.Tensor | None = None
    # Reused gather targets [kv_heads, num_decodes * max_blocks, block_size, head_dim] for K and V: a fresh
    # tensor of this size per layer costs more in page faults than the copy itself.
    decode_key_buffer: torch.Tensor | None = None
    decode_value_buffer: torch.Tensor | None = None
    prefills: list[PrefillSpan] = field(default_factory=list)
    # The mixed-batch kernel's view of a step with prefill rows on the Triton path: every sequence in row order
    # (decodes, then prefill chunks), one launch per layer. Set, they replace the decode fields and the spans'
    # context_blocks/mask, which are then not built. Sequence s owns rows mixed_query_starts[s]:[s + 1], the
    # last positions of its mixed_context_lens[s] tokens.
    mixed_query_starts: torch.Tensor | None = None  # [S + 1]
    mixed_context_lens: torch.Tensor | None = None  # [S]
    mixed_block_table: torch.Tensor | None = None  # [S, max_blocks], rows of the persistent table
    # The native CPU kernel's view of a step whose prefill chunks are short (see paged_prefill_max_context): every
    # row, decode or prefill, is one query over its own sequence's blocks, its context its position + 1. Set, the
    # attention layers use them instead of the decode fields and the spans (which stay built, for any other path).
    paged_block_table: torch.Tensor | None = None  # [T, max_blocks]: each row's sequence's table row
    paged_context_lens: torch.Tensor | None = None  # [T]
    # Masks of the torch paths for layers with a sliding window, built by the first such layer of the step:
    # ("decode", window) for the decodes, (span start, window) for a prefill span.
    window_masks: dict = field(default_factory=dict)


class Attention(nn.Module):
    """Multi-head (grouped-query) attention over a paged KV cache shard.

    `kv_cache` is bound by the worker after it sizes the cache: a tensor of shape
    [2, num_kv_heads, num_slots, head_dim] where slot = block_id * block_size + offset. Head-major
    layout makes every gathered context a contiguous [tokens, head_dim] slab per head, which is the
    layout the CPU attention kernel runs fastest on. The cache may be fp8 (kv_cache_dtype): K and V are then stored
    as value / k_scale and value / v_scale, and every path reads them back times those scales.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int | None = None,
        logit_softcap: float | None = None,
    ) -> None:
        super().__init__()
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        if logit_softcap is not None and logit_softcap <= 0:
            raise ValueError(f"logit_softcap must be > 0 or None, got {logit_softcap}")
        # Gemma 2: scores become cap * tanh(scores / cap) before the softmax. 0.0 in the kernels' spelling.
        self.logit_softcap = logit_softcap
        self._softcap = logit_softcap or 0.0
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # A query at position p sees keys p - sliding_window + 1 .. p (transformers' convention); None: all.
        self.sliding_window = sliding_window
        # The kernels' spelling of the same: 0 for no window.
        self._window = sliding_window or 0
        self.kv_cache: torch.Tensor | None = None
        # Per-tensor scales of an fp8 cache, 1.0 unless the checkpoint has them. Device tensors rather than floats:
        # the kernels read them in place, so a captured CUDA graph sees loaded values and no step syncs the host.
        self.register_buffer("k_scale", torch.ones((), dtype=torch.float32), persistent=False)
        self.register_buffer("v_scale", torch.ones((), dtype=torch.float32), persistent=False)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q: [T, heads*head_dim], k/v: [T, kv_heads*head_dim] → [T, heads*head_dim].

        `sinks` [heads] float32 (gpt-oss): a learned logit per head that joins each query's softmax denominator
        and carries no value, so a head can attend to nothing. This rank's heads only.
        """
        num_tokens = q.shape[0]
        key_cache, value_cache = self.kv_cache[0], self.kv_cache[1]
        kernels = cpu_fused.fused_kernels() if key_cache.device.type == "cpu" else None
        written = kernels is not None and cpu_fused.fits(k, v) and key_cache.dtype == torch.float32
        if written:
            kernels.write_kv(k, v, meta.slot_mapping, key_cache, value_cache)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        scales = {}
        if is_fp8(key_cache.dtype):
            scales = {"k_scale": self.k_scale, "v_scale": self.v_scale}
            k, v = write_fp8(k, v, meta.slot_mapping, key_cache, value_cache, self.k_scale, self.v_scale)
        elif not written:
            key_cache.index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
            value_cache.index_copy_(1, meta.slot_mapping, v.transpose(0, 1))

        if meta.mixed_query_starts is not None:
            # Decodes and prefill chunks alike read their context in place through the block table.
            out = paged_mixed_attention(
                q,
                key_cache.transpose(0, 1),  # the kernel takes [slots, kv_heads, head_dim] through strides
                value_cache.transpose(0, 1),
                meta.mixed_block_table,
                meta.mixed_query_starts,
                meta.mixed_context_lens,
                meta.block_size,
                self.scale,
                self._window,
                self._softcap,
                sinks,
                **scales,
            )
            return out.view(num_tokens, self.num_heads * self.head_dim)

        if meta.paged_block_table is not None:
            kernel = native_kernel()
            if kernel is not None:
                # Decodes and short prefill chunks alike in one call: each row reads its context in place.
                out = kernel.decode(
                    q,
                    key_cache,
                    value_cache,
                    meta.paged_block_table,
                    meta.paged_context_lens,
                    meta.block_size,
                    self.scale,
                    self._window,
                    self._softcap,
                    sinks,
                    **scales,
                )
                return out.reshape(num_tokens, self.num_heads * self.head_dim)
        n = meta.num_decodes
        if n == num_tokens:
            # A decode-only step: the kernel's output is the whole answer, no copy into a larger one.
            out = self._decode(q, key_cache, value_cache, meta, sinks)
            return out.reshape(num_tokens, self.num_heads * self.head_dim)
        out = torch.empty_like(q)
        if n:
            out[:n] = self._decode(q[:n], key_cache, value_cache, meta, sinks)
        for span in meta.prefills:
            queries = q[span.start : span.end].transpose(0, 1).unsqueeze(0)
            if span.context_blocks is None:
                keys = k[span.start : span.end].transpose(0, 1)
                values = v[span.start : span.end].transpose(0, 1)
            else:
                keys = self._gather(key_cache, span.context_blocks, meta.block_size)[:, : span.context_len]
                values = self._gather(value_cache, span.context_blocks, meta.block_size)[:, : span.context_len]
            keys, values = dequantize(keys, self.k_scale, q.dtype), dequantize(values, self.v_scale, q.dtype)
            mask = span.mask if self.sliding_window is None else self._windowed_span_mask(span, meta)
            if self.logit_softcap is not None or sinks is not None:
                if mask is None:
                    mask = torch.ones(keys.shape[1], keys.shape[1], dtype=torch.bool, device=keys.device).tril()
                group = self.num_heads // self.num_kv_heads
                attended = explicit_attention(
                    queries,
                    keys.repeat_interleave(group, 0).unsqueeze(0),
                    values.repeat_interleave(group, 0).unsqueeze(0),
                    mask,
                    self.scale,
                    self.logit_softcap,
                    None if sinks is None else sinks.view(1, self.num_heads, 1, 1),
                )
            else:
                attended = F.scaled_dot_product_attention(
                    queries,
                    keys.unsqueeze(0),
                    values.unsqueeze(0),
                    attn_mask=mask,
                    is_causal=mask is None,
                    scale=self.scale,
                    enable_gqa=True,
                )
            out[span.start : span.end] = attended.squeeze(0).transpose(0, 1)
        return out.view(num_tokens, self.num_heads * self.head_dim)

    def _windowed_span_mask(self, span: PrefillSpan, meta: AttentionMetadata) -> torch.Tensor:
        """The span's causal mask narrowed to this layer's window, made once per step for each window size."""
        key = (span.start, self.sliding_window)
        mask = meta.window_masks.get(key)
        if mask is None:
            num_queries = span.end - span.start
            num_keys = span.context_len if span.context_blocks is not None else num_queries
            device = meta.slot_mapping.device
            queries = torch.arange(num_keys - num_queries, num_keys, device=device)[:, None]
            keys = torch.arange(num_keys, device=device)[None, :]
            mask = meta.window_masks[key] = (keys <= queries) & (keys > queries - self.sliding_window)
        return mask

    def _gather(
        self, cache: torch.Tensor, blocks: torch.Tensor, block_size: int, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Whole blocks of one head-major cache → [kv_heads, len(blocks) * block_size, head_dim].

        Copying block-sized runs with index_select is several times faster than per-slot indexing.
        """
        paged = cache.view(self.num_kv_heads, -1, block_size, self.head_dim)
        if out is None or out.dtype != cache.dtype:  # the workspace holds the compute dtype, an fp8 cache bytes
            gathered = paged.index_select(1, blocks.flatten())
        else:
            gathered = torch.index_select(paged, 1, blocks.flatten(), out=out)
        return gathered.view(self.num_kv_heads, -1, self.head_dim)

    def _decode(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One query token per sequence, batched over every decode in the step."""
        path = decode_path(q.device, self.num_heads, self.num_kv_heads, self.head_dim, q.dtype)
        scales = {"k_scale": self.k_scale, "v_scale": self.v_scale} if is_fp8(key_cache.dtype) else {}
        if path == "triton":
            # Reads K/V through the block table in place instead of gathering a padded copy of every context.
            return paged_decode_attention(
                q,
                key_cache.transpose(0, 1),  # the kernel takes [slots, kv_heads, head_dim] through strides
                value_cache.transpose(0, 1),
                meta.decode_block_table,
                meta.decode_context_lens,
                meta.block_size,
                self.scale,
                self._window,
                self._softcap,
                sinks,
                **scales,
            )
        if path == "native":
            return native_kernel().decode(
                q,
                key_cache,
                value_cache,
                meta.decode_block_table,
                meta.decode_context_lens,
                meta.block_size,
                self.scale,
                self._window,
                self._softcap,
                sinks,
                **scales,
            )
        n = q.shape[0]
        group = self.num_heads // self.num_kv_heads
        keys = self._gather(key_cache, meta.decode_block_table, meta.block_size, meta.decode_key_buffer)
        values = self._gather(value_cache, meta.decode_block_table, meta.block_size, meta.decode_value_buffer)
        keys, values = dequantize(keys, self.k_scale, q.dtype), dequantize(values, self.v_scale, q.dtype)
        # [kv_heads, n * ctx, d] → [n, kv_heads, ctx, d]; the query heads sharing a KV head become that
        # head's query rows, so no K/V is repeated and no causal mask is needed for a single position.
        keys = keys.view(self.num_kv_heads, n, -1, self.head_dim).transpose(0, 1)
        values = values.view(self.num_kv_heads, n, -1, self.head_dim).transpose(0, 1)
        queries = q.view(n, self.num_kv_heads, group, self.head_dim)
        if self.sliding_window is not None:
            mask = meta.window_masks.get(("decode", self.sliding_window))
            if mask is None:
                mask = decode_key_mask(meta.decode_context_lens, keys.shape[2], self.sliding_window)
                meta.window_masks["decode", self.sliding_window] = mask
        else:
            if meta.decode_mask is None:
                # Built once per step, by the first layer that needs it, from the context lengths on the device.
                meta.decode_mask = decode_key_mask(meta.decode_context_lens, keys.shape[2])
            mask = meta.decode_mask
        if self.logit_softcap is not None or sinks is not None:
            # Scores are [n, kv_heads, group, ctx]: query head h is (h // group, h % group).
            head_sinks = None if sinks is None else sinks.view(1, self.num_kv_heads, -1, 1)
            attended = explicit_attention(queries, keys, values, mask, self.scale, self.logit_softcap, head_sinks)
        else:
            attended = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=self.scale)
        return attended.reshape(n, self.num_heads, self.head_dim)


def explicit_attention(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    cap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(cap * tanh(q k^T * scale / cap), masked) v, in the order transformers' eager Gemma 2 computes it;
    with `sinks`, each row's softmax runs over its scores and its head's sink, whose weight is then dropped
    (transformers' eager gpt-oss).

    q [..., q_len, d], k/v [..., k_len, d] broadcastable to q's leading dimensions, mask [..., q_len, k_len] True
    where a key is visible, sinks broadcastable to [..., q_len, 1]. SDPA has neither softcap nor sinks, so this is
    the torch paths' attention for such layers.
    """
    scores = torch.matmul(queries, keys.transpose(-1, -2)) * scale
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        weights = torch.softmax(scores, dim=-1, dtype=torch.float32)
    else:
        column = sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)
        weights = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1, dtype=torch.float32)[..., :-1]
    return torch.matmul(weights.to(values.dtype), values)


def decode_path(device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> str:
    """Which decode attention runs: "triton" or "native" read the cache in place; "torch" gathers, masked."""
    if triton_available(device):
        return "triton"
    if device.type == "cpu":
        kernel = native_kernel()
        if kernel is not None and kernel.supports(num_heads, num_kv_heads, head_dim, dtype):
            return "native"
    return "torch"


# Context (K and V of one KV head, float32) up to which a prefill chunk's rows run as single queries through the
# native kernel, each re-reading its context from cache, rather than through SDPA over the chunk: 128 KiB stays in
# L2 between rows. Measured on 13 chunks of 160 tokens (4 query / 2 KV heads of 32): 1.7x faster; at 2048 tokens
# SDPA's reuse of K and V across query rows wins by 1.4x.
PAGED_PREFILL_CONTEXT_BYTES = 128 << 10


def paged_prefill_max_context(
    device: torch.device, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    """The longest prefill context whose rows the native kernel attends as single queries; 0 off that kernel."""
    if decode_path(device, num_heads, num_kv_heads, head_dim, dtype) != "native":
        return 0
    return PAGED_PREFILL_CONTEXT_BYTES // (2 * 4 * head_dim)


def decode_key_mask(context_lens: torch.Tensor, num_keys: int, sliding_window: int | None = None) -> torch.Tensor:
    """[n, 1, 1, num_keys] True where key position < the row's context length (and, with a window, within the
    last `sliding_window` of them): the torch decode path's mask."""
    keys = torch.arange(num_keys, device=context_lens.device)[None, :]
    visible = keys < context_lens[:, None]
    if sliding_window is not None:
        visible &= keys >= context_lens[:, None] - sliding_window
    return visible[:, None, None, :]
