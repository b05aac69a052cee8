"""Mixture-of-experts computation grouped by expert in torch: the CPU path, and any device without Triton."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def grouped_experts(
    hidden: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """Sum over each token's k routed experts of weight * w2[e] @ (silu(gate) * up), gate/up = w13[e] @ x.

    hidden [T, H]; w13 [E, 2*I, H] (gate rows, then up rows); w2 [E, H, I]; topk_weights [T, k] float32;
    topk_ids [T, k] in [0, E), or -1 for an expert on another rank (adds nothing). Returns [T, H] in hidden's
    dtype. Same contract as `triton_fused_experts`.

    The T*k (token, slot) pairs are sorted by expert, and each expert with tokens runs one gate/up matmul and one
    down matmul over all of its tokens: E small GEMMs instead of T*k matrix-vector products. Experts are summed
    in ascending order into a float32 buffer, the order transformers' loop adds them, so fp32 results agree.
    """
    tokens, top_k = topk_ids.shape
    num_experts, inter = w13.shape[0], w2.shape[2]
    out = torch.zeros(tokens, hidden.shape[1], dtype=torch.float32, device=hidden.device)
    if tokens == 0:
        return out.to(hidden.dtype)
    flat_ids = topk_ids.reshape(-1).to(torch.int64)
    # Slots for other ranks' experts go to an extra bucket E after the local ones and are never computed.
    buckets = torch.where(flat_ids < 0, num_experts, flat_ids)
    # Stable: an expert's slots stay in token order.
    order = torch.argsort(buckets, stable=True)
    counts = torch.bincount(buckets, minlength=num_experts + 1)[:num_experts].tolist()
    flat_weights = topk_weights.reshape(-1)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        slots = order[start : start + count]
        start += count
        token_ids = torch.div(slots, top_k, rounding_mode="floor")
        gate_up = F.linear(hidden.index_select(0, token_ids), w13[expert])
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        expert_out = F.linear(act, w2[expert]) * flat_weights[slots, None]
        out.index_add_(0, token_ids, expert_out.to(torch.float32))
    return out.to(hidden.dtype)
