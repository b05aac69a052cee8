"""Fused mixture-of-experts Triton kernels: grouped gate/up GEMM with SiLU-and-mul, grouped down GEMM, weighted sum.

The routed (token, slot) pairs are sorted by expert and each expert's run is padded to a multiple of BLOCK_M, so
every row block of the grouped GEMMs belongs to exactly one expert (the layout of vLLM's and SGLang's fused_moe):

1. `moe_align` (torch ops on the device, no host sync): the sorted, padded slot list and one expert id per block.
2. `_gate_up_kernel`, one launch for all experts: x @ w13[e].T for the gate and the up half at once, SiLU(gate) * up
   (or gpt-oss's clamped SwiGLU, after its biases) in the epilogue, written as the [T*k, I] intermediate.
3. `_down_kernel`, one launch for all experts: intermediate @ w2[e].T (plus its bias) times the slot's routing
   weight, in fp32.
4. A torch sum over the k slots of each token, back in token order.

A slot whose expert id is -1 (the expert lives on another expert-parallel rank) contributes zeros. Expert ids are
not range-checked: that would need a host sync; the caller guarantees ids in [0, E) or -1.
"""

from __future__ import annotations

import torch

from pagerail.worker.layers.moe_activation import SILU, ExpertActivation
from pagerail.worker.layers.triton_common import dot_operands, tl, triton, triton_available

# Entries of the per-block expert table that are not expert ids.
NON_LOCAL_BLOCK = -1  # slots routed to another rank: the down kernel writes their zeros
UNUSED_BLOCK = -2  # past the last filled block: both kernels exit at once

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def fused_moe_available(*tensors: torch.Tensor) -> bool:
    """True when triton_fused_experts can run on these tensors: triton present, CUDA (or interpreter), float dtype."""
    return all(t.dtype in _SUPPORTED_DTYPES and triton_available(t.device) for t in tensors)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort the T*k routed slots by expert and pad each expert's run to a multiple of `block_m`.

    Returns (sorted_slots [num_blocks * block_m] int32, block_experts [num_blocks] int32). Slot s is token
    s // k's (s % k)-th choice; padding entries are -1. Each block holds the slots of one expert (its id in
    block_experts); the slots with id -1 form one more run after the experts' (NON_LOCAL_BLOCK); the blocks
    after the last filled one are UNUSED_BLOCK. An expert without slots gets no block at all.

    num_blocks is an upper bound known from the shapes alone, so nothing here waits for the device: at most
    min(E + 1, T*k) runs are non-empty and each wastes at most block_m - 1 padding entries.
    """
    device = topk_ids.device
    num_slots = topk_ids.numel()
    slot_experts = topk_ids.reshape(-1).to(torch.int64)
    # Non-local slots share an extra bucket E, sorted after every local expert.
    buckets = torch.where(slot_experts < 0, num_experts, slot_experts)
    # scatter_add rather than bincount: CUDA bincount reads the largest value back to the host to size its output.
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, buckets, torch.ones_like(buckets))
    blocks_per_bucket = (counts + block_m - 1) // block_m
    block_ends = torch.cumsum(blocks_per_bucket, 0)
    padded_starts = (block_ends - blocks_per_bucket) * block_m
    unpadded_starts = torch.cumsum(counts, 0) - counts

    # Stable, so an expert's slots stay in token order and its rows are read front to back.
    sorted_buckets, order = torch.sort(buckets, stable=True)
    rank_in_bucket = torch.arange(num_slots, device=device) - unpadded_starts[sorted_buckets]

    num_blocks = (num_slots + min(num_experts + 1, num_slots) * (block_m - 1)) // block_m
    sorted_slots = torch.full((num_blocks * block_m,), -1, dtype=torch.int32, device=device)
    sorted_slots[padded_starts[sorted_buckets] + rank_in_bucket] = order.to(torch.int32)

    # Block b belongs to the first bucket whose cumulative block count exceeds b; past them all is bucket E + 1.
    block_buckets = torch.searchsorted(block_ends, torch.arange(num_blocks, device=device), right=True)
    bucket_to_expert = torch.arange(num_experts + 2, dtype=torch.int32, device=device)
    bucket_to_expert[num_experts] = NON_LOCAL_BLOCK
    bucket_to_expert[num_experts + 1] = UNUSED_BLOCK
    return sorted_slots, bucket_to_expert[block_buckets]


def _launch_config(num_slots: int, num_experts: int, dtype: torch.dtype) -> dict[str, int]:
    """Block sizes from the average number of slots per expert, known on the host from the shapes alone.

    Decode batches put a handful of rows on each expert, so the row block is the smallest tl.dot allows and the
    programs spread over the weight columns instead; long prefills fill 64-row blocks. The gate/up kernel holds
    two accumulators, so its column block stays at 64. Three variants at most per model and dtype.
    """
    per_expert = num_slots / max(num_experts, 1)
    block_k = 64 if dtype.itemsize <= 2 else 32  # the same bytes per K step for fp32
    if per_expert <= 16:
        return {"BLOCK_M": 16, "BLOCK_N_GATE_UP": 64, "BLOCK_N_DOWN": 64, "BLOCK_K": block_k, "num_warps": 4}
    if per_expert <= 64:
        return {"BLOCK_M": 32, "BLOCK_N_GATE_UP": 64, "BLOCK_N_DOWN": 64, "BLOCK_K": block_k, "num_warps": 4}
    return {"BLOCK_M": 64, "BLOCK_N_GATE_UP": 64, "BLOCK_N_DOWN": 128, "BLOCK_K": block_k, "num_warps": 8}


# Software pipelining depth of the K loops: three stages of the largest tiles stay well inside sm_90 shared memory.
_NUM_STAGES = 3

if triton is not None:

    @triton.jit
    def gate_up_epilogue(
        gate,
        up,
        bias_ptr,
        cols,
        col_ok,
        inter_size,
        alpha,
        limit,
        HAS_BIAS: tl.constexpr,
        CLAMPED_SWIGLU: tl.constexpr,
    ):
        """The experts' biases (gate at cols, up at inter_size + cols of the expert's row `bias_ptr`) and their
        activation on the fp32 accumulators; only its result is rounded, once, to the activation dtype."""
        if HAS_BIAS:
            gate += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
            up += tl.load(bias_ptr + inter_size + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        if CLAMPED_SWIGLU:
            # gpt-oss: (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = min(gate, limit).
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
            activated = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
        else:
            activated = gate / (1.0 + tl.exp(-gate)) * up
        return activated

    @triton.jit
    def _gate_up_kernel(
        out_ptr,
        x_ptr,
        w_ptr,
        bias_ptr,
        sorted_slots_ptr,
        block_experts_ptr,
        inter_size,
        hidden_size,
        alpha,
        limit,
        stride_x,
        stride_we,
        stride_wn,
        stride_wk,
        stride_be,
        stride_out,
        TOP_K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        CLAMPED_SWIGLU: tl.constexpr,
        DOT_DTYPE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        # Program (m, n): BLOCK_M sorted slots of one expert × BLOCK_N intermediate columns. Axis 0 runs fastest,
        # so the programs resident at once share the same weight columns and read them from L2.
        block = tl.program_id(0)
        expert = tl.load(block_experts_ptr + block)
        if expert < 0:  # unused padding blocks, and non-local slots: they need no intermediate
            return
        # An expert's offset in a weight of more than 2**31 elements overflows int32.
        w_expert = w_ptr + expert.to(tl.int64) * stride_we
        slots = tl.load(sorted_slots_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        slot_ok = slots >= 0
        tokens = tl.where(slot_ok, slots // TOP_K, 0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < inter_size
        ks = tl.arange(0, BLOCK_K)

        x_ptrs = x_ptr + tokens[:, None] * stride_x + ks[None, :]
        # [BLOCK_K, BLOCK_N] tiles of the gate rows [0, I) and the up rows [I, 2I): w13[e] read transposed.
        gate_ptrs = w_expert + cols[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk
        up_ptrs = gate_ptrs + inter_size * stride_wn
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k_start in range(0, hidden_size, BLOCK_K):
            k_ok = ks < hidden_size - k_start
            w_mask = k_ok[:, None] & col_ok[None, :]
            x = tl.load(x_ptrs, mask=slot_ok[:, None] & k_ok[None, :], other=0.0).to(DOT_DTYPE)
            w_gate = tl.load(gate_ptrs, mask=w_mask, other=0.0).to(DOT_DTYPE)
            w_up = tl.load(up_ptrs, mask=w_mask, other=0.0).to(DOT_DTYPE)
            gate = tl.dot(x, w_gate, acc=gate, input_precision=DOT_PRECISION)
            up = tl.dot(x, w_up, acc=up, input_precision=DOT_PRECISION)
            x_ptrs += BLOCK_K
            gate_ptrs += BLOCK_K * stride_wk
            up_ptrs += BLOCK_K * stride_wk

        activated = gate_up_epilogue(
            gate,
            up,
            bias_ptr + expert.to(tl.int64) * stride_be,
            cols,
            col_ok,
            inter_size,
            alpha,
            limit,
            HAS_BIAS,
            CLAMPED_SWIGLU,
        )
        out_ptrs = out_ptr + slots[:, None] * stride_out + cols[None, :]
        tl.store(out_ptrs, activated.to(out_ptr.dtype.element_ty), mask=slot_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _down_kernel(
        out_ptr,
        a_ptr,
        w_ptr,
        bias_ptr,
        topk_weights_ptr,
        sorted_slots_ptr,
        block_experts_ptr,
        hidden_size,
        inter_size,
        stride_a,
        stride_we,
        stride_wn,
        stride_wk,
        stride_be,
        stride_out,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        DOT_DTYPE: tl.constexpr,
        DOT_PRECISION: tl.constexpr,
    ):
        # Program (m, n): BLOCK_M sorted slots of one expert × BLOCK_N hidden columns, weighted, in fp32.
        block = tl.program_id(0)
        expert = tl.load(block_experts_ptr + block)
        if expert == -2:  # UNUSED_BLOCK (a plain literal: module constants are not constexpr here)
            return
        slots = tl.load(sorted_slots_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        slot_ok = slots >= 0
        rows = tl.where(slot_ok, slots, 0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < hidden_size
        out_ptrs = out_ptr + rows[:, None] * stride_out + cols[None, :]
        out_mask = slot_ok[:, None] & col_ok[None, :]
        if expert == -1:  # NON_LOCAL_BLOCK: every slot row is written, so the output needs no zeroing pass
            tl.store(out_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), mask=out_mask)
            return

        w_expert = w_ptr + expert.to(tl.int64) * stride_we
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows[:, None] * stride_a + ks[None, :]
        w_ptrs = w_expert + cols[None, :].to(tl.int64) * stride_wn + ks[:, None] * stride_wk
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k_start in range(0, inter_size, BLOCK_K):
            k_ok = ks < inter_size - k_start
            a = tl.load(a_ptrs, mask=slot_ok[:, None] & k_ok[None, :], other=0.0).to(DOT_DTYPE)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0).to(DOT_DTYPE)
            acc = tl.dot(a, w, acc=acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk

        if HAS_BIAS:
            # The bias belongs to the expert's output, before the routing weight scales it.
            bias = tl.load(bias_ptr + expert.to(tl.int64) * stride_be + cols, mask=col_ok, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        weights = tl.load(topk_weights_ptr + rows, mask=slot_ok, other=0.0)
        tl.store(out_ptrs, acc * weights[:, None], mask=out_mask)


def _check_biases(w13: torch.Tensor, w2: torch.Tensor, w13_bias, w2_bias) -> None:
    if (w13_bias is None) != (w2_bias is None):
        raise ValueError("w13_bias and w2_bias come together: give both or neither")
    if w13_bias is None:
        return
    if tuple(w13_bias.shape) != tuple(w13.shape[:2]) or tuple(w2_bias.shape) != tuple(w2.shape[:2]):
        shapes = f"{tuple(w13_bias.shape)} / {tuple(w2_bias.shape)}"
        raise ValueError(f"w13_bias / w2_bias {shapes} are not [E, 2*I] / [E, H] for w13 {tuple(w13.shape)}")
    if w13_bias.stride(-1) != 1 or w2_bias.stride(-1) != 1:
        raise ValueError("w13_bias and w2_bias must be contiguous in their last dimension")


def _check_shapes(hidden, w13, w2, topk_weights, topk_ids) -> None:
    tokens, hidden_size = hidden.shape
    num_experts, double_inter, w13_hidden = w13.shape
    inter_size = double_inter // 2
    if w13_hidden != hidden_size or double_inter % 2:
        raise ValueError(f"w13 {tuple(w13.shape)} is not [E, 2*I, {hidden_size}]")
    if tuple(w2.shape) != (num_experts, hidden_size, inter_size):
        raise ValueError(f"w2 {tuple(w2.shape)} is not [{num_experts}, {hidden_size}, {inter_size}]")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} / weights {tuple(topk_weights.shape)} are not [{tokens}, k]"
        )
    if w13.dtype != hidden.dtype or w2.dtype != hidden.dtype or hidden.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"hidden {hidden.dtype}, w13 {w13.dtype} and w2 {w2.dtype} must share a float dtype")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, not {topk_ids.dtype}")


def triton_fused_experts(
    hidden: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: ExpertActivation = SILU,
) -> torch.Tensor:
    """Sum over each token's k routed experts of weight * w2[e] @ (silu(gate) * up), gate/up = w13[e] @ x.

    hidden [T, H]; w13 [E, 2*I, H] (gate rows, then up rows); w2 [E, H, I]; topk_weights [T, k] (normalised
    by the caller); topk_ids [T, k] int32/int64 in [0, E), or -1 for an expert on another rank (adds nothing).
    gpt-oss: w13_bias [E, 2*I] and w2_bias [E, H] add to each projection, and `activation` may be its clamped
    SwiGLU instead of silu(gate) * up.
    GEMMs accumulate in fp32; the intermediate is stored in hidden's dtype, each slot's output and the sum
    over k in fp32. Returns [T, H] in hidden's dtype. Launches no host sync, so it can be captured in a graph.
    """
    _check_shapes(hidden, w13, w2, topk_weights, topk_ids)
    _check_biases(w13, w2, w13_bias, w2_bias)
    tokens, hidden_size = hidden.shape
    num_experts, inter_size = w13.shape[0], w13.shape[1] // 2
    top_k = topk_ids.shape[1]
    num_slots = tokens * top_k
    if num_slots == 0:
        return torch.zeros_like(hidden)
    # The kernels step through K with unit stride.
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()

    config = _launch_config(num_slots, num_experts, hidden.dtype)
    block_m, block_k = config["BLOCK_M"], config["BLOCK_K"]
    sorted_slots, block_experts = moe_align(topk_ids, num_experts, block_m)
    num_blocks = block_experts.shape[0]
    dot = dot_operands(hidden.dtype)
    common = {"BLOCK_M": block_m, "BLOCK_K": block_k, "num_warps": config["num_warps"], "num_stages": _NUM_STAGES}
    has_bias = w13_bias is not None
    # Without biases the weights stand in for the bias pointers: never read.
    b13, b2 = (w13_bias, w2_bias) if has_bias else (w13, w2)

    # Rows of non-local slots are never written nor read.
    intermediate = torch.empty((num_slots, inter_size), dtype=hidden.dtype, device=hidden.device)
    block_n = config["BLOCK_N_GATE_UP"]
    _gate_up_kernel[(num_blocks, triton.cdiv(inter_size, block_n))](
        intermediate,
        hidden,
        w13,
        b13,
        sorted_slots,
        block_experts,
        inter_size,
        hidden_size,
        activation.alpha,
        activation.limit,
        hidden.stride(0),
        w13.stride(0),
        w13.stride(1),
        w13.stride(2),
        b13.stride(0),
        intermediate.stride(0),
        TOP_K=top_k,
        BLOCK_N=block_n,
        HAS_BIAS=has_bias,
        CLAMPED_SWIGLU=activation.clamped,
        **dot,
        **common,
    )

    # fp32 per slot, so the sum over k adds unrounded terms; every row is written by one block of the down kernel.
    slot_out = torch.empty((num_slots, hidden_size), dtype=torch.float32, device=hidden.device)
    block_n = config["BLOCK_N_DOWN"]
    _down_kernel[(num_blocks, triton.cdiv(hidden_size, block_n))](
        slot_out,
        intermediate,
        w2,
        b2,
        weights,
        sorted_slots,
        block_experts,
        hidden_size,
        inter_size,
        intermediate.stride(0),
        w2.stride(0),
        w2.stride(1),
        w2.stride(2),
        b2.stride(0),
        slot_out.stride(0),
        BLOCK_N=block_n,
        HAS_BIAS=has_bias,
        **dot,
        **common,
    )
    return slot_out.view(tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)
