"""Mixture-of-experts computation grouped by expert in torch: the CPU path, and any device without Triton."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pagerail.worker.layers.cpu_matmul import CpuWeights, linear
from pagerail.worker.layers.moe_activation import SILU, ExpertActivation

# Per local expert, the faster-library copies of its w13 and w2 that the CPU matmul chooser attached (None: MKL).
ExpertCpuWeights = tuple[Sequence[CpuWeights | None], Sequence[CpuWeights | None]]


def grouped_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: ExpertActivation = SILU,
    cpu_weights: ExpertCpuWeights | None = None,
) -> torch.Tensor:
    """Sum over each token's k routed experts of weight * w2[e] @ (silu(gate) * up), gate/up = w13[e] @ x.

    hidden [T, H]; w13 [E, 2*I, H] (gate rows, then up rows); w2 [E, H, I]; topk_weights [T, k] float32;
    topk_ids [T, k] in [0, E), or -1 for an expert on another rank (adds nothing). Returns [T, H] in hidden's
    dtype. gpt-oss: w13_bias [E, 2*I] and w2_bias [E, H] add to each projection, and `activation` may be its
    clamped SwiGLU. Same contract as `triton_fused_experts`. `cpu_weights` runs each expert's matmuls through the
    library the CPU matmul chooser measured fastest for its shape (the packed kernel runs the few-row matmuls of
    experts two to three times faster than MKL).

    The T*k (token, slot) pairs are sorted by expert, and each expert with tokens runs one gate/up matmul and one
    down matmul over all of its tokens: E small GEMMs instead of T*k matrix-vector products. Each result row is
    copied to its own slot of a float32 [T, k, H] buffer (no two experts write the same row, so no scattered add,
    which on the CPU costs more than the matmuls), then each token's k slots are added one after another in
    ascending expert order: the order transformers' loop adds them, so fp32 results agree.
    """
    tokens, top_k = topk_ids.shape
    num_experts, inter, hidden_size = w13.shape[0], w2.shape[2], hidden.shape[1]
    if tokens == 0:
        return torch.zeros(0, hidden_size, dtype=hidden.dtype, device=hidden.device)
    # Slots for other ranks' experts go to an extra bucket E after the local ones and are never computed.
    ids = topk_ids.to(torch.int64)
    buckets = torch.where(ids < 0, num_experts, ids)
    # Each token's slots in ascending expert order, so the final per-token sum adds them in that order.
    buckets, by_expert = torch.sort(buckets, dim=1)
    flat_weights = topk_weights.gather(1, by_expert).reshape(-1)
    flat_buckets = buckets.reshape(-1)
    # Stable: an expert's slots stay in token order.
    order = torch.argsort(flat_buckets, stable=True)
    counts = torch.bincount(flat_buckets, minlength=num_experts + 1)[:num_experts].tolist()
    slots_out = torch.zeros(tokens * top_k, hidden_size, dtype=torch.float32, device=hidden.device)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        slots = order[start : start + count]
        start += count
        token_ids = torch.div(slots, top_k, rounding_mode="floor")
        w13_cpu, w2_cpu = (None, None) if cpu_weights is None else (cpu_weights[0][expert], cpu_weights[1][expert])
        gate_up = _linear(hidden.index_select(0, token_ids), w13[expert], _row(w13_bias, expert), w13_cpu)
        act = activation(gate_up[:, :inter], gate_up[:, inter:])
        expert_out = _linear(act, w2[expert], _row(w2_bias, expert), w2_cpu) * flat_weights[slots, None]
        slots_out.index_copy_(0, slots, expert_out.to(torch.float32))
    per_token = slots_out.view(tokens, top_k, hidden_size)
    out = per_token[:, 0].clone()
    for slot in range(1, top_k):
        out += per_token[:, slot]
    return out.to(hidden.dtype)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cpu: CpuWeights | None) -> torch.Tensor:
    if cpu is None:
        return F.linear(x, weight, bias)
    out = linear(x, weight, cpu)
    return out if bias is None else out.add_(bias)


def _row(bias: torch.Tensor | None, expert: int) -> torch.Tensor | None:
    return None if bias is None else bias[expert]
