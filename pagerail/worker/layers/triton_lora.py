"""Triton kernels for batched LoRA (Punica's BGMV shape): every row of a step reads its own adapter slot, so one
shrink and one expand launch serve every adapter of the step, base-model rows (slot -1) included at no cost.

shrink: y[r] = x[r] @ A_t[slot[r]]    (A_t: [slots, in, width]; y: [rows, width] in fp32)
expand: out[r] += y[r] @ B[slot[r]]    (B: [slots, width, out]; out in the layer's dtype, added in fp32)

Both accumulate in fp32. A row whose slot is -1 is skipped: its y is left unwritten and its output untouched.
The worker (worker/lora.py) calls them for CUDA tensors, or any tensor while TRITON_INTERPRET=1 (the CPU tests).
"""

from __future__ import annotations

import torch

from pagerail.worker.layers.triton_common import TL_DTYPES, tl, triton, triton_available

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def lora_kernels_available(x: torch.Tensor) -> bool:
    """True when the kernels should run the delta for inputs like `x`: triton present, CUDA (or interpreter)."""
    return x.dtype in _SUPPORTED_DTYPES and triton_available(x.device)


if triton is not None:
    # Row counts change every step: not specialised, or each new count compiles anew.
    @triton.jit(do_not_specialize=("num_rows",))
    def _shrink_kernel(
        y_ptr,
        x_ptr,
        a_ptr,
        slot_ptr,
        num_rows,
        in_features,
        width,
        x_stride,
        a_slot_stride,
        a_in_stride,
        BLOCK_K: tl.constexpr,
        BLOCK_W: tl.constexpr,
    ):
        row = tl.program_id(0)
        slot = tl.load(slot_ptr + row)
        if slot < 0:
            return
        columns = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
        column_ok = columns < width
        acc = tl.zeros((BLOCK_W,), dtype=tl.float32)
        for k0 in range(0, in_features, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < in_features
            x = tl.load(x_ptr + row * x_stride + ks, mask=k_ok, other=0.0).to(tl.float32)
            a_offsets = slot.to(tl.int64) * a_slot_stride + ks[:, None] * a_in_stride + columns[None, :]
            a = tl.load(a_ptr + a_offsets, mask=k_ok[:, None] & column_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(x[:, None] * a, axis=0)
        tl.store(y_ptr + row * width + columns, acc, mask=column_ok)

    @triton.jit(do_not_specialize=("num_rows",))
    def _expand_kernel(
        out_ptr,
        y_ptr,
        b_ptr,
        slot_ptr,
        num_rows,
        width,
        out_features,
        out_stride,
        b_slot_stride,
        b_width_stride,
        OUT_DTYPE: tl.constexpr,
        BLOCK_W: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        row = tl.program_id(0)
        slot = tl.load(slot_ptr + row)
        if slot < 0:
            return
        columns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        column_ok = columns < out_features
        acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for w0 in range(0, width, BLOCK_W):
            ws = w0 + tl.arange(0, BLOCK_W)
            w_ok = ws < width
            y = tl.load(y_ptr + row * width + ws, mask=w_ok, other=0.0)
            b_offsets = slot.to(tl.int64) * b_slot_stride + ws[:, None] * b_width_stride + columns[None, :]
            b = tl.load(b_ptr + b_offsets, mask=w_ok[:, None] & column_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(y[:, None] * b, axis=0)
        pointers = out_ptr + row * out_stride + columns
        current = tl.load(pointers, mask=column_ok, other=0.0).to(tl.float32)
        tl.store(pointers, (current + acc).to(OUT_DTYPE), mask=column_ok)


def _block(size: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(size)))


def lora_delta(x: torch.Tensor, out: torch.Tensor, a_t: torch.Tensor, b: torch.Tensor, slots: torch.Tensor) -> None:
    """out[r] += x[r] @ a_t[slots[r]] @ b[slots[r]] for every row r whose slot is not -1, in place.

    x: [rows, in] (rows contiguous); out: [rows, out] (rows contiguous, any row stride); a_t: [slots, in, width]
    and b: [slots, width, out], contiguous; slots: [rows] integers.
    """
    rows, in_features = x.shape
    width, out_features = b.shape[1], b.shape[2]
    if a_t.shape[1] != in_features or a_t.shape[2] != width or out.shape != (rows, out_features):
        raise ValueError(
            f"shapes do not agree: x {tuple(x.shape)}, out {tuple(out.shape)}, A {tuple(a_t.shape)}, B {tuple(b.shape)}"
        )
    if slots.shape != (rows,):
        raise ValueError(f"slots must hold one slot per row ({rows}), got shape {tuple(slots.shape)}")
    if x.stride(1) != 1 or out.stride(1) != 1 or not a_t.is_contiguous() or not b.is_contiguous():
        raise ValueError("x and out need contiguous rows, A and B must be contiguous")
    if rows == 0:
        return
    y = torch.empty(rows, width, dtype=torch.float32, device=x.device)
    block_w = _block(width, 64)
    block_k = _block(in_features, 64)
    _shrink_kernel[(rows, triton.cdiv(width, block_w))](
        y, x, a_t, slots, rows, in_features, width, x.stride(0), a_t.stride(0), a_t.stride(1),
        BLOCK_K=block_k, BLOCK_W=block_w,
    )  # fmt: skip
    block_n = _block(out_features, 128)
    _expand_kernel[(rows, triton.cdiv(out_features, block_n))](
        out, y, b, slots, rows, width, out_features, out.stride(0), b.stride(0), b.stride(1),
        OUT_DTYPE=TL_DTYPES[out.dtype], BLOCK_W=block_w, BLOCK_N=block_n,
    )  # fmt: skip
