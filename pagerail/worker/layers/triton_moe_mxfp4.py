"""Fused mixture-of-experts Triton kernels whose expert weights are MXFP4, decoded inside the grouped GEMMs."""

from __future__ import annotations

import torch

from pagerail.worker.layers.moe_activation import SILU, ExpertActivation
from pagerail.worker.layers.quantization.mxfp4 import BYTES_PER_BLOCK, check_mxfp4
from pagerail.worker.layers.triton_common import dot_operands, tl, triton
from pagerail.worker.layers.triton_moe import (
    _NUM_STAGES,
    _SUPPORTED_DTYPES,
    _check_biases,
    _launch_config,
    gate_up_epilogue,
    moe_align,
)

# The layout and the steps are triton_moe's (expert-sorted, BLOCK_M-padded slots from `moe_align`; a gate/up
# kernel with the biased SwiGLU epilogue writing the [T*k, I] intermediate; a down kernel writing each slot's
# weighted fp32 output; a torch sum over the k slots), with the weights read as packed bytes: row n of an expert
# is K/2 bytes, byte j holding the e2m1 codes of columns 2j (low nibble) and 2j + 1 (high nibble), and one e8m0
# scale per 32 columns. Each K step loads BLOCK_K/2 bytes per weight row and runs two dots: the even activation
# columns against the low nibbles, the odd ones against the high nibbles, so no interleaving happens in registers.
# A decoded weight (an e2m1 value times a power of two) is exact in bf16 and fp16 within their range, so the GEMMs
# see the weights `dequantize_mxfp4` gives.

if triton is not None:

    @triton.jit
    def _decode(codes, scale_bytes):
        """uint8 codes (low 4 bits used) and e8m0 scale bytes of the same shape → float32 weights, exactly."""
        code = codes.to(tl.int32) & 15
        magnitude = code & 7
        exponent = magnitude >> 1
        mantissa = magnitude & 1
        # float32 bits of the e2m1 magnitude: 0 and 0.5 for exponent 0, else (1 + mantissa / 2) * 2**(exponent - 1).
        bits = tl.where(exponent == 0, mantissa * (126 << 23), ((exponent + 126) << 23) | (mantissa << 22))
        value = bits.to(tl.float32, bitcast=True)
        value = tl.where((code & 8) != 0, -value, value)
        # 2**(s - 127) as float32 bits; s = 0 is the subnormal 2**-127 (exponent field 0, top mantissa bit).
        scale = scale_bytes.to(tl.int32)
        scale = tl.where(scale == 0, 1 << 22, scale << 23).to(tl.float32, bitcast=True)
        return value * scale

    @triton.jit
    def _mxfp4_dot(acc, a_even, a_odd, w_ptrs, s_ptrs, w_mask, DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr):
        """acc + a[:, even] @ W_low + a[:, odd] @ W_high for one [BLOCK_K/2 bytes, BLOCK_N] tile of packed weights."""
        packed = tl.load(w_ptrs, mask=w_mask, other=0)
        scales = tl.load(s_ptrs, mask=w_mask, other=127)
        low = _decode(packed, scales).to(DOT_DTYPE)
        high = _decode(packed >> 4, scales).to(DOT_DTYPE)
        acc = tl.dot(a_even, low, acc=acc, input_precision=DOT_PRECISION)
        return tl.dot(a_odd, high, acc=acc, input_precision=DOT_PRECISION)

    @triton.jit
    def _mxfp4_gate_up_kernel(
        out_ptr,
        x_ptr,
        w_ptr,
        s_ptr,
        bias_ptr,
        sorted_slots_ptr,
        block_experts_ptr,
        inter_size,
        hidden_bytes,
        alpha,
        limit,
        stride_x,
        stride_we,
        stride_wn,
        stride_se,
        stride_sn,
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
        # Program (m, n): BLOCK_M sorted slots of one expert × BLOCK_N intermediate columns (gate and up rows).
        block = tl.program_id(0)
        expert = tl.load(block_experts_ptr + block)
        if expert < 0:  # unused padding blocks, and non-local slots: they need no intermediate
            return
        slots = tl.load(sorted_slots_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        slot_ok = slots >= 0
        tokens = tl.where(slot_ok, slots // TOP_K, 0)
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < inter_size
        HALF_K: tl.constexpr = BLOCK_K // 2
        kb = tl.arange(0, HALF_K)

        x_ptrs = x_ptr + tokens[:, None] * stride_x + 2 * kb[None, :]
        # [HALF_K bytes, BLOCK_N] tiles of the gate rows [0, I) and up rows [I, 2I), read transposed; a byte's
        # scale is that of its 16-byte group.
        gate_w = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn + kb[:, None]
        gate_s = s_ptr + expert.to(tl.int64) * stride_se + cols[None, :].to(tl.int64) * stride_sn
        up_w = gate_w + inter_size * stride_wn
        up_s = gate_s + inter_size * stride_sn
        gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for byte_start in range(0, hidden_bytes, HALF_K):
            k_ok = kb < hidden_bytes - byte_start
            x_mask = slot_ok[:, None] & k_ok[None, :]
            x_even = tl.load(x_ptrs, mask=x_mask, other=0.0).to(DOT_DTYPE)
            x_odd = tl.load(x_ptrs + 1, mask=x_mask, other=0.0).to(DOT_DTYPE)
            w_mask = k_ok[:, None] & col_ok[None, :]
            group = (byte_start + kb[:, None]) // 16
            gate = _mxfp4_dot(gate, x_even, x_odd, gate_w, gate_s + group, w_mask, DOT_DTYPE, DOT_PRECISION)
            up = _mxfp4_dot(up, x_even, x_odd, up_w, up_s + group, w_mask, DOT_DTYPE, DOT_PRECISION)
            x_ptrs += BLOCK_K
            gate_w += HALF_K
            up_w += HALF_K

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
    def _mxfp4_down_kernel(
        out_ptr,
        a_ptr,
        w_ptr,
        s_ptr,
        bias_ptr,
        topk_weights_ptr,
        sorted_slots_ptr,
        block_experts_ptr,
        hidden_size,
        inter_bytes,
        stride_a,
        stride_we,
        stride_wn,
        stride_se,
        stride_sn,
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
        if expert == -2:  # UNUSED_BLOCK
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

        HALF_K: tl.constexpr = BLOCK_K // 2
        kb = tl.arange(0, HALF_K)
        a_ptrs = a_ptr + rows[:, None] * stride_a + 2 * kb[None, :]
        w_ptrs = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :].to(tl.int64) * stride_wn + kb[:, None]
        s_ptrs = s_ptr + expert.to(tl.int64) * stride_se + cols[None, :].to(tl.int64) * stride_sn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for byte_start in range(0, inter_bytes, HALF_K):
            k_ok = kb < inter_bytes - byte_start
            a_mask = slot_ok[:, None] & k_ok[None, :]
            a_even = tl.load(a_ptrs, mask=a_mask, other=0.0).to(DOT_DTYPE)
            a_odd = tl.load(a_ptrs + 1, mask=a_mask, other=0.0).to(DOT_DTYPE)
            group = (byte_start + kb[:, None]) // 16
            w_mask = k_ok[:, None] & col_ok[None, :]
            acc = _mxfp4_dot(acc, a_even, a_odd, w_ptrs, s_ptrs + group, w_mask, DOT_DTYPE, DOT_PRECISION)
            a_ptrs += BLOCK_K
            w_ptrs += HALF_K

        if HAS_BIAS:
            # The bias belongs to the expert's output, before the routing weight scales it.
            bias = tl.load(bias_ptr + expert.to(tl.int64) * stride_be + cols, mask=col_ok, other=0.0)
            acc += bias.to(tl.float32)[None, :]
        weights = tl.load(topk_weights_ptr + rows, mask=slot_ok, other=0.0)
        tl.store(out_ptrs, acc * weights[:, None], mask=out_mask)


def _rows(blocks: torch.Tensor) -> torch.Tensor:
    """[E, N, G, 16] → [E, N, G*16] bytes; the kernels step through a row's bytes with unit stride."""
    if blocks.stride(-1) != 1 or blocks.stride(-2) != BYTES_PER_BLOCK:
        blocks = blocks.contiguous()
    return blocks.flatten(-2)


def _check_packed(hidden, w13_blocks, w13_scales, w2_blocks, w2_scales, topk_weights, topk_ids) -> tuple[int, int]:
    if w13_blocks.dim() != 4 or w2_blocks.dim() != 4:
        raise ValueError(f"w13_blocks {tuple(w13_blocks.shape)} and w2_blocks {tuple(w2_blocks.shape)} must be 4-D")
    check_mxfp4(w13_blocks, w13_scales)
    check_mxfp4(w2_blocks, w2_scales)
    tokens, hidden_size = hidden.shape
    num_experts, double_inter, hidden_groups, _ = w13_blocks.shape
    inter_size = double_inter // 2
    if hidden_groups * 32 != hidden_size or double_inter % 2:
        raise ValueError(f"w13_blocks {tuple(w13_blocks.shape)} are not [E, 2*I, {hidden_size}/32, 16]")
    if tuple(w2_blocks.shape) != (num_experts, hidden_size, inter_size // 32, BYTES_PER_BLOCK) or inter_size % 32:
        raise ValueError(
            f"w2_blocks {tuple(w2_blocks.shape)} are not [{num_experts}, {hidden_size}, {inter_size}/32, 16]"
        )
    if topk_ids.dim() != 2 or topk_ids.shape[0] != tokens or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"topk_ids {tuple(topk_ids.shape)} / weights {tuple(topk_weights.shape)} are not [{tokens}, k]"
        )
    if hidden.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"hidden must be float32, float16 or bfloat16, not {hidden.dtype}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, not {topk_ids.dtype}")
    return num_experts, inter_size


def triton_mxfp4_experts(
    hidden: torch.Tensor,
    w13_blocks: torch.Tensor,
    w13_scales: torch.Tensor,
    w2_blocks: torch.Tensor,
    w2_scales: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    activation: ExpertActivation = SILU,
) -> torch.Tensor:
    """triton_fused_experts with MXFP4 weights: w13_blocks uint8 [E, 2*I, H/32, 16] (gate rows, then up rows),
    w13_scales uint8 [E, 2*I, H/32], w2_blocks [E, H, I/32, 16], w2_scales [E, H, I/32]; the rest as there.

    Equal, up to fp32 summation order, to triton_fused_experts on the `dequantize_mxfp4` weights in hidden's dtype.
    """
    num_experts, inter_size = _check_packed(
        hidden, w13_blocks, w13_scales, w2_blocks, w2_scales, topk_weights, topk_ids
    )
    _check_biases(w13_blocks, w2_blocks, w13_bias, w2_bias)
    tokens, hidden_size = hidden.shape
    top_k = topk_ids.shape[1]
    num_slots = tokens * top_k
    if num_slots == 0:
        return torch.zeros_like(hidden)
    hidden = hidden if hidden.stride(1) == 1 else hidden.contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    w13, w2 = _rows(w13_blocks), _rows(w2_blocks)
    s13, s2 = (s if s.stride(-1) == 1 else s.contiguous() for s in (w13_scales, w2_scales))

    config = _launch_config(num_slots, num_experts, hidden.dtype)
    block_m = config["BLOCK_M"]
    sorted_slots, block_experts = moe_align(topk_ids, num_experts, block_m)
    num_blocks = block_experts.shape[0]
    # BLOCK_K columns are BLOCK_K/2 bytes per step; a dot needs K >= 16, so at least 32 columns.
    block_k = max(config["BLOCK_K"], 32)
    common = {"BLOCK_M": block_m, "BLOCK_K": block_k, "num_warps": config["num_warps"], "num_stages": _NUM_STAGES}
    common.update(dot_operands(hidden.dtype))
    has_bias = w13_bias is not None
    b13, b2 = (w13_bias, w2_bias) if has_bias else (s13, s2)  # stand-ins for absent biases: never read

    intermediate = torch.empty((num_slots, inter_size), dtype=hidden.dtype, device=hidden.device)
    block_n = config["BLOCK_N_GATE_UP"]
    _mxfp4_gate_up_kernel[(num_blocks, triton.cdiv(inter_size, block_n))](
        intermediate,
        hidden,
        w13,
        s13,
        b13,
        sorted_slots,
        block_experts,
        inter_size,
        hidden_size // 2,
        activation.alpha,
        activation.limit,
        hidden.stride(0),
        w13.stride(0),
        w13.stride(1),
        s13.stride(0),
        s13.stride(1),
        b13.stride(0),
        intermediate.stride(0),
        TOP_K=top_k,
        BLOCK_N=block_n,
        HAS_BIAS=has_bias,
        CLAMPED_SWIGLU=activation.clamped,
        **common,
    )

    slot_out = torch.empty((num_slots, hidden_size), dtype=torch.float32, device=hidden.device)
    block_n = config["BLOCK_N_DOWN"]
    _mxfp4_down_kernel[(num_blocks, triton.cdiv(hidden_size, block_n))](
        slot_out,
        intermediate,
        w2,
        s2,
        b2,
        weights,
        sorted_slots,
        block_experts,
        hidden_size,
        inter_size // 2,
        intermediate.stride(0),
        w2.stride(0),
        w2.stride(1),
        s2.stride(0),
        s2.stride(1),
        b2.stride(0),
        slot_out.stride(0),
        BLOCK_N=block_n,
        HAS_BIAS=has_bias,
        **common,
    )
    return slot_out.view(tokens, top_k, hidden_size).sum(dim=1).to(hidden.dtype)
