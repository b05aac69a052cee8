"""Fused Triton kernels for RMSNorm (optionally with the residual add), neox rotary embedding and SiLU-and-mul.

Each kernel reproduces the rounding of the eager torch code it replaces (worker/layers/norm.py, rotary.py,
activation.py): every intermediate that torch materialises in the input dtype is rounded to that dtype here
too, so half-precision results agree bit for bit except where the arithmetic itself differs (the order of the
RMSNorm sum of squares, the exp inside SiLU), which moves a result by at most about one unit in the last place.

The modules call these kernels only for CUDA tensors (or any tensor while TRITON_INTERPRET=1, so the CPU
interpreter can test them); CPU tensors keep the torch code. Set PAGERAIL_FUSED_OPS=0 in the environment (read
once, at import) or assign `triton_fused.ENABLED = False` at run time to turn the kernels off everywhere, e.g. to
compare a forward pass against the plain torch path.
"""

from __future__ import annotations

import os

import torch

# One triton import guard, availability rule and dtype table for every kernel module: CPU-only installs have no
# triton, and the modules then keep their torch code.
from pagerail.worker.layers.triton_common import TL_DTYPES, tl, triton, triton_available

ENABLED = os.environ.get("PAGERAIL_FUSED_OPS", "1").strip().lower() not in ("0", "false", "off", "no")

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Rows wider than this would not fit one register tile; such norms stay on the torch path.
_MAX_NORM_WIDTH = 65536
# Elements one program of the row-wise kernels aims to hold, so narrow rows (per-head q/k norm) share programs.
_TILE_ELEMENTS = 4096


def fused_available(*tensors: torch.Tensor) -> bool:
    """True when the fused kernels should handle these tensors: enabled, triton present, CUDA (or interpreter)."""
    return ENABLED and all(t.dtype in _SUPPORTED_DTYPES and triton_available(t.device) for t in tensors)


def _num_warps(elements: int) -> int:
    return 4 if elements <= 2048 else 8 if elements <= 8192 else 16


if triton is not None:

    @triton.jit
    def _round(x, DTYPE: tl.constexpr):
        # Round float32 `x` to DTYPE, nearest-even, like torch's own casts. bfloat16 is rounded on the bits
        # first: the CPU interpreter truncates float32 → bfloat16, so a plain cast would differ there.
        if DTYPE == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))  # NaN payloads must not carry
        return x.to(DTYPE)

    # The row count is the step's token count: not specialised, or each "== 1" / "divisible by 16" step compiles anew.
    @triton.jit(do_not_specialize=("num_rows",))
    def _rms_norm_kernel(
        out_ptr,
        x_ptr,
        residual_ptr,
        weight_ptr,
        num_rows,
        inner,
        n_cols,
        stride_x_outer,
        stride_x_inner,
        stride_residual,
        eps,
        BLOCK_ROWS: tl.constexpr,
        BLOCK_COLS: tl.constexpr,
        HAS_RESIDUAL: tl.constexpr,
        OUT_DTYPE: tl.constexpr,
    ):
        # Rows are indexed (outer, inner) so a [T, H, D] view of a fused qkv row needs no copy.
        rows = tl.program_id(0).to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        cols = tl.arange(0, BLOCK_COLS)
        row_ok = rows < num_rows
        mask = row_ok[:, None] & (cols < n_cols)[None, :]
        x_offsets = (rows // inner * stride_x_outer + rows % inner * stride_x_inner)[:, None] + cols[None, :]
        x = tl.load(x_ptr + x_offsets, mask=mask, other=0.0)
        in_dtype = x.dtype
        x = x.to(tl.float32)
        if HAS_RESIDUAL:
            residual_offsets = (rows * stride_residual)[:, None] + cols[None, :]
            residual = tl.load(residual_ptr + residual_offsets, mask=mask, other=0.0).to(tl.float32)
            # The sum is rounded to the input dtype, as torch's add is, before the norm reads it.
            summed = _round(x + residual, in_dtype)
            tl.store(residual_ptr + residual_offsets, summed, mask=mask)
            x = summed.to(tl.float32)
        mean_square = tl.sum(x * x, axis=1) / n_cols
        inv_rms = 1.0 / tl.sqrt_rn(mean_square + eps)
        # Cast back to the input dtype before the weight, the order norm.py (and transformers) uses.
        normed = _round(x * inv_rms[:, None], in_dtype).to(tl.float32)
        weight = tl.load(weight_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
        out = _round(normed * weight[None, :], OUT_DTYPE)
        tl.store(out_ptr + (rows * n_cols)[:, None] + cols[None, :], out, mask=mask)

    @triton.jit
    def _rotate_heads(
        dst_ptr, src_ptr, num_heads, cos, sin, HALF: tl.constexpr, HALF_PAD: tl.constexpr, HEADS: tl.constexpr
    ):
        # (x1, x2) → (x1*cos - x2*sin, x2*cos + x1*sin), every product and sum rounded as eager torch rounds it.
        dtype = dst_ptr.dtype.element_ty
        dims = tl.arange(0, HALF_PAD)
        for first in range(0, num_heads, HEADS):
            heads = first + tl.arange(0, HEADS)
            mask = (heads < num_heads)[:, None] & (dims < HALF)[None, :]
            offsets = (heads * (2 * HALF))[:, None] + dims[None, :]
            x1 = tl.load(src_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
            x2 = tl.load(src_ptr + offsets + HALF, mask=mask, other=0.0).to(tl.float32)
            x1_cos = _round(x1 * cos, dtype).to(tl.float32)
            x2_sin = _round(x2 * sin, dtype).to(tl.float32)
            x2_cos = _round(x2 * cos, dtype).to(tl.float32)
            x1_sin = _round(x1 * sin, dtype).to(tl.float32)
            tl.store(dst_ptr + offsets, _round(x1_cos - x2_sin, dtype), mask=mask)
            tl.store(dst_ptr + offsets + HALF, _round(x2_cos + x1_sin, dtype), mask=mask)

    @triton.jit
    def _rotary_kernel(
        q_out_ptr,
        k_out_ptr,
        q_ptr,
        k_ptr,
        cos_ptr,
        sin_ptr,
        positions_ptr,
        num_q_heads,
        num_k_heads,
        stride_q,
        stride_k,
        stride_table,
        HALF: tl.constexpr,
        HALF_PAD: tl.constexpr,
        HEADS: tl.constexpr,
        HAS_POSITIONS: tl.constexpr,
    ):
        # One program per token rotates all of its q and k heads with one read of its cos/sin row.
        token = tl.program_id(0).to(tl.int64)
        row = token
        if HAS_POSITIONS:
            row = tl.load(positions_ptr + token).to(tl.int64)
        dims = tl.arange(0, HALF_PAD)
        dtype = q_out_ptr.dtype.element_ty
        # The tables are float32; the torch code casts them to q's dtype before multiplying.
        cos = tl.load(cos_ptr + row * stride_table + dims, mask=dims < HALF, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + row * stride_table + dims, mask=dims < HALF, other=0.0).to(tl.float32)
        cos = _round(cos, dtype)
        sin = _round(sin, dtype)
        cos = cos.to(tl.float32)[None, :]
        sin = sin.to(tl.float32)[None, :]
        width = 2 * HALF
        q_out = q_out_ptr + token * num_q_heads * width
        k_out = k_out_ptr + token * num_k_heads * width
        _rotate_heads(q_out, q_ptr + token * stride_q, num_q_heads, cos, sin, HALF, HALF_PAD, HEADS)
        _rotate_heads(k_out, k_ptr + token * stride_k, num_k_heads, cos, sin, HALF, HALF_PAD, HEADS)

    @triton.jit
    def _silu_and_mul_kernel(out_ptr, x_ptr, d, stride_x, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < d
        gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
        dtype = gate.dtype
        gate = gate.to(tl.float32)
        up = tl.load(x_ptr + row * stride_x + d + cols, mask=mask, other=0.0).to(tl.float32)
        # silu(gate) is rounded to the input dtype first: eager torch stores it before the multiply.
        activated = _round(gate / (1.0 + tl.exp(-gate)), dtype).to(tl.float32)
        tl.store(out_ptr + row * d + cols, _round(activated * up, dtype), mask=mask)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dimension of x (any leading shape); with `residual`, first residual = x + residual.

    Returns the normed tensor, or (normed, residual) when a residual is given; the residual is updated in
    place (its last dimension must be contiguous and its rows evenly strided).
    """
    n_cols = x.shape[-1]
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    x = _last_dim_contiguous(x)
    if x.dim() == 1:
        x3 = x.view(1, 1, n_cols)
    elif x.dim() == 2:
        x3 = x.unsqueeze(1)
    else:
        x3 = x.reshape(-1, x.shape[-2], n_cols)  # a view for the layouts the model produces
    outer, inner = x3.shape[0], x3.shape[1]
    num_rows = outer * inner
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} does not match x {tuple(x.shape)}")
        residual_rows = residual.view(num_rows, n_cols)  # raises if the rows are not evenly strided
        stride_residual = residual_rows.stride(0)
    else:
        residual_rows, stride_residual = x3, 0  # never touched
    block_cols = triton.next_power_of_2(n_cols)
    # Rows per program from the width alone: sized by the row count too, every batch size would be a new variant.
    block_rows = max(1, _TILE_ELEMENTS // block_cols)
    if num_rows:
        _rms_norm_kernel[(triton.cdiv(num_rows, block_rows),)](
            out,
            x3,
            residual_rows,
            weight,
            num_rows,
            inner,
            n_cols,
            x3.stride(0),
            x3.stride(1),
            stride_residual,
            eps,
            BLOCK_ROWS=block_rows,
            BLOCK_COLS=block_cols,
            HAS_RESIDUAL=residual is not None,
            OUT_DTYPE=TL_DTYPES[out_dtype],
            num_warps=_num_warps(block_rows * block_cols),
        )
    return out if residual is None else (out, residual)


def norm_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """True when rms_norm handles this input; wider rows or other dtypes stay on the torch path."""
    return fused_available(x, weight) and x.dim() >= 1 and 0 < x.shape[-1] <= _MAX_NORM_WIDTH


def rotary_embedding(
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    head_dim: int,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Neox RoPE of q [T, ...] and k [T, ...] (heads of head_dim flattened behind T) into new tensors.

    cos and sin are float32 with D/2 values per row: with `positions` [T], rows of the whole cache
    [max_position, D/2]; without, one gathered row per token ([T, D/2] or [T, 1, D/2]).
    """
    tokens = q.shape[0]
    q2 = _last_dim_contiguous(q.reshape(tokens, -1))
    k2 = _last_dim_contiguous(k.reshape(tokens, -1))
    cos2 = cos.reshape(cos.shape[0], -1).contiguous()
    sin2 = sin.reshape(sin.shape[0], -1).contiguous()
    half = head_dim // 2
    if cos2.shape[1] != half or q2.shape[1] % head_dim or k2.shape[1] % head_dim:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and tables {tuple(cos.shape)} disagree on head_dim")
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if tokens == 0:
        return q_out, k_out
    half_pad = triton.next_power_of_2(half)
    most_heads = max(q2.shape[1], k2.shape[1]) // head_dim
    heads = max(1, min(_TILE_ELEMENTS // (2 * half_pad), triton.next_power_of_2(most_heads)))
    _rotary_kernel[(tokens,)](
        q_out,
        k_out,
        q2,
        k2,
        cos2,
        sin2,
        positions if positions is not None else cos2,
        q2.shape[1] // head_dim,
        k2.shape[1] // head_dim,
        q2.stride(0),
        k2.stride(0),
        cos2.stride(0),
        HALF=half,
        HALF_PAD=half_pad,
        HEADS=heads,
        HAS_POSITIONS=positions is not None,
        num_warps=_num_warps(heads * half_pad * 2),
    )
    return q_out, k_out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2*d] holding [gate | up] → silu(gate) * up of shape [..., d] in x's dtype."""
    d = x.shape[-1] // 2
    rows = _last_dim_contiguous(x).reshape(-1, 2 * d)
    out = torch.empty((*x.shape[:-1], d), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(max(d, 1)))
    if rows.shape[0] and d:
        _silu_and_mul_kernel[(rows.shape[0], triton.cdiv(d, block))](out, rows, d, rows.stride(0), BLOCK=block)
    return out
