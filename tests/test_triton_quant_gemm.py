"""The quantized-weight GEMMs (fp8 block-scaled W8A8, int4 w4a16): the kernels under Triton's CPU interpreter
against float64 references, their torch paths and the int4 layout in process."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import pytest
import torch

from tests.test_triton_moe import _poisoned_empty
from tests.triton_interpreter import interpreted_report


@dataclass(frozen=True)
class Fp8Case:
    name: str
    rows: int
    out_features: int
    in_features: int
    block: tuple[int, int]  # (bn, bk)
    dtype: str
    bias: bool = False


@dataclass(frozen=True)
class Int4Case:
    name: str
    rows: int
    out_features: int
    in_features: int
    group_size: int
    dtype: str
    act_order: bool = False
    bias: bool = False
    strided: bool = False  # x a column slice of a wider buffer, as a fused projection leaves it


# Odd N (column tiles past N, and past the last weight-scale block), K with a partial last block or group, tiles
# narrower than bn (16-row configs take 64 columns of a 128 block) and wider (64 columns over bn = 16 or 32), and
# each of the three row configurations (≤16, ≤64, more rows).
FP8_CASES = [
    Fp8Case("m1_n72_k320_b128_bf16", 1, 72, 320, (128, 128), "bfloat16"),
    Fp8Case("m7_n200_k256_b128_fp16_bias", 7, 200, 256, (128, 128), "float16", bias=True),
    Fp8Case("m33_n200_k200_b32_fp32", 33, 200, 200, (32, 32), "float32"),
    Fp8Case("m33_n72_k160_b16x64_bf16_bias", 33, 72, 160, (16, 64), "bfloat16", bias=True),
    Fp8Case("m70_n200_k96_b48x32_fp16", 70, 200, 96, (48, 32), "float16"),
]
INT4_CASES = [
    Int4Case("m1_n72_k128_g32_fp16", 1, 72, 128, 32, "float16"),
    Int4Case("m7_n200_k192_g128_act_bf16", 7, 200, 192, 128, "bfloat16", act_order=True),
    Int4Case("m33_n200_k320_g64_act_fp32_bias", 33, 200, 320, 64, "float32", act_order=True, bias=True),
    Int4Case("m33_n72_k256_g32_strided_bf16", 33, 72, 256, 32, "bfloat16", strided=True),
    Int4Case("m70_n72_k136_g64_act_fp16_bias", 70, 72, 136, 64, "float16", act_order=True, bias=True),
]
# Largest |got - want| over an output row relative to the row's largest |want|, against float64 references of
# the same quantized operands. The sums run in fp32 and the result is rounded once to the output dtype (about one
# unit in the last place: 4.9e-4 for fp16, 3.9e-3 for bf16, which the interpreter truncates); int4 also rounds
# the dequantized weight to the activation dtype before the dot.
TOLERANCE = {"float32": 2e-6, "float16": 2e-3, "bfloat16": 2e-2}
# fp8_block_linear against the unquantized product: e4m3 keeps 3 mantissa bits, ≤ 1/16 relative per activation.
LINEAR_TOLERANCE = 0.1
# The rows of x that are all zeros in every case with more than one row.
ZERO_ROW = 3


def _row_error(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest per-row error relative to the row's scale; a zero row must be exactly zero, NaN is infinite."""
    diff = (got.double() - want).abs().nan_to_num(float("inf")).amax(dim=1)
    scale = want.abs().amax(dim=1)
    relative = torch.where(scale > 0, diff / scale.clamp_min(1e-300), torch.where(diff == 0, 0.0, float("inf")))
    return relative.max().item()


def _activations(rows: int, in_features: int, dtype: torch.dtype, generator: torch.Generator) -> torch.Tensor:
    x = torch.randn((rows, in_features), generator=generator)
    if rows > ZERO_ROW:
        x[ZERO_ROW] = 0.0
    return x.to(dtype)


def fp8_weight_float64(weight: torch.Tensor, weight_scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Each weight element times its (n // bn, k // bk) block's scale, in float64."""
    scales = weight_scale.double().repeat_interleave(block[0], dim=0)[: weight.shape[0]]
    return weight.double() * scales.repeat_interleave(block[1], dim=1)[:, : weight.shape[1]]


def fp8_reference(x_fp8, x_scale, weight, weight_scale, block, bias=None) -> torch.Tensor:
    """Both operands dequantized in float64 (each element times its group's or block's scale), then multiplied."""
    x = x_fp8.double() * x_scale.double().repeat_interleave(block[1], dim=1)[:, : x_fp8.shape[1]]
    out = x @ fp8_weight_float64(weight, weight_scale, block).T
    return out if bias is None else out + bias.double()


def _fp8_weight(case: Fp8Case, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A random fp8 weight and block scales that differ block to block (so a wrong scale index shows)."""
    block_n, block_k = case.block
    weight = (torch.randn((case.out_features, case.in_features), generator=generator) * 100).to(torch.float8_e4m3fn)
    scale_shape = (-(-case.out_features // block_n), -(-case.in_features // block_k))
    scale = (torch.rand(scale_shape, generator=generator) + 0.25) * 1e-2 / case.in_features**0.5
    return weight, scale


def _run_fp8(case: Fp8Case, seed: int = 0) -> dict[str, float]:
    from pagerail.worker.layers.quantization.triton_fp8_gemm import (
        fp8_block_gemm,
        fp8_block_linear,
        quantize_activations_per_group,
    )

    generator = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    x = _activations(case.rows, case.in_features, dtype, generator)
    weight, weight_scale = _fp8_weight(case, generator)
    bias = torch.randn(case.out_features, generator=generator).to(dtype) if case.bias else None
    x_fp8, x_scale = quantize_activations_per_group(x, case.block[1])
    with _poisoned_empty():
        got = fp8_block_gemm(x_fp8, x_scale, weight, weight_scale, case.block, dtype, bias)
        linear = fp8_block_linear(x.view(1, *x.shape), weight, weight_scale, case.block, bias)
    assert got.dtype == dtype and got.shape == (case.rows, case.out_features)
    assert linear.shape == (1, *got.shape)
    # The linear against the unquantized activations: what the activation quantization costs.
    exact = x.double() @ fp8_weight_float64(weight, weight_scale, case.block).T
    exact = exact + (bias.double() if case.bias else 0.0)
    return {
        "error": _row_error(got, fp8_reference(x_fp8, x_scale, weight, weight_scale, case.block, bias)),
        "linear_error": _row_error(linear[0], exact),
    }


def int4_weight(case: Int4Case, dtype: torch.dtype, generator: torch.Generator):
    """(values [K, N] 0..15, scales, zeros, g_idx) with zero points 0 and 15 both present."""
    groups = -(-case.in_features // case.group_size)
    values = torch.randint(0, 16, (case.in_features, case.out_features), generator=generator)
    scales = ((torch.rand((groups, case.out_features), generator=generator) + 0.5) * 0.02).to(dtype)
    zeros = torch.randint(0, 16, (groups, case.out_features), generator=generator).to(torch.uint8)
    zeros[0, ::2], zeros[-1, 1::2] = 0, 15
    g_idx = torch.arange(case.in_features) // case.group_size
    if case.act_order:
        # Act-order: rows sorted by activation magnitude at calibration, so each group's rows scatter over K.
        g_idx = g_idx[torch.randperm(case.in_features, generator=generator)]
    return values, scales, zeros, g_idx.to(torch.int32)


def int4_reference(x, values, scales, zeros, g_idx, bias=None) -> torch.Tensor:
    """x @ W in float64, W[k, n] = (values[k, n] - zeros[g_idx[k], n]) * scales[g_idx[k], n] from unpacked values."""
    groups = g_idx.long()
    w = (values.double() - zeros[groups].double()) * scales[groups].double()
    out = x.double() @ w
    return out if bias is None else out + bias.double()


def _run_int4(case: Int4Case, seed: int = 0) -> dict[str, float]:
    from pagerail.worker.layers.quantization.int4_layout import pack_int4
    from pagerail.worker.layers.quantization.triton_int4_gemm import int4_gemm, int4_gemm_available

    generator = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    x = _activations(case.rows, case.in_features, dtype, generator)
    if case.strided:
        x = torch.cat([torch.ones(case.rows, 8, dtype=dtype), x], dim=1)[:, 8:]
    values, scales, zeros, g_idx = int4_weight(case, dtype, generator)
    bias = torch.randn(case.out_features, generator=generator).to(dtype) if case.bias else None
    assert int4_gemm_available(x), "the interpreter must be on for CPU tensors"
    with _poisoned_empty():
        got = int4_gemm(x, pack_int4(values), scales, zeros, g_idx, bias)
    assert got.dtype == dtype and got.shape == (case.rows, case.out_features)
    return {"error": _row_error(got, int4_reference(x, values, scales, zeros, g_idx, bias))}


def _report() -> None:
    """Entry point of the interpreter subprocess: one JSON line of {case name: results}."""
    import time

    started = time.perf_counter()
    report = {case.name: _run_fp8(case) for case in FP8_CASES}
    report.update({case.name: _run_int4(case) for case in INT4_CASES})
    report["seconds"] = round(time.perf_counter() - started, 2)
    print(json.dumps(report))


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    return interpreted_report("tests.test_triton_quant_gemm")


@pytest.mark.slow
@pytest.mark.parametrize("case", FP8_CASES + INT4_CASES, ids=lambda case: case.name)
def test_kernel_matches_float64_reference(case: Fp8Case | Int4Case, interpreted: dict[str, dict]) -> None:
    result = interpreted[case.name]
    assert result["error"] <= TOLERANCE[case.dtype], f"{asdict(case)}: relative row error {result['error']:.3g}"
    if isinstance(case, Fp8Case):
        assert result["linear_error"] <= LINEAR_TOLERANCE, f"{asdict(case)}: linear error {result['linear_error']}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("in_features", "group"), [(256, 128), (200, 32), (96, 64)])
def test_activation_quantization_is_per_token_group(dtype: torch.dtype, in_features: int, group: int) -> None:
    from pagerail.worker.layers.quantization.triton_fp8_gemm import FP8_MAX, quantize_activations_per_group

    x = _activations(7, in_features, dtype, torch.Generator().manual_seed(in_features))
    x[1, :group] *= 1e-4  # a quiet group beside loud ones gets a scale of its own
    x_fp8, x_scale = quantize_activations_per_group(x, group)
    groups = -(-in_features // group)
    assert x_fp8.dtype == torch.float8_e4m3fn and x_fp8.shape == x.shape and x_fp8.is_contiguous()
    assert x_scale.dtype == torch.float32 and x_scale.shape == (7, groups)
    padded = torch.nn.functional.pad(x.double(), (0, groups * group - in_features)).view(7, groups, group)
    amax = padded.abs().amax(dim=-1)
    torch.testing.assert_close(x_scale.double(), amax.clamp_min(1e-10) / FP8_MAX, rtol=1e-6, atol=0)
    # Round to nearest: half a unit of e4m3's 3-bit mantissa (1/16 relative), or of its subnormal step 2**-9.
    per_column_scale = x_scale.double().repeat_interleave(group, dim=1)[:, :in_features]
    dequantized = x_fp8.double() * per_column_scale
    bound = torch.maximum(x.double().abs() / 16, per_column_scale / 2**10)
    assert ((dequantized - x.double()).abs() <= bound * (1 + 1e-6)).all()
    assert x_fp8.float().abs().amax() == FP8_MAX, "each group's amax maps to the largest fp8"
    assert (x_fp8[ZERO_ROW].float() == 0).all() and (x_scale[ZERO_ROW] > 0).all(), "zero rows: codes 0, scale > 0"


def test_int4_packing_puts_row_8i_plus_j_in_nibble_j() -> None:
    from pagerail.worker.layers.quantization.int4_layout import pack_int4, unpack_int4

    values = torch.randint(0, 16, (64, 24), generator=torch.Generator().manual_seed(0))
    values[7::8, 0] = 15  # a set top nibble: the word is negative as int32
    qweight = pack_int4(values)
    assert qweight.dtype == torch.int32 and qweight.shape == (8, 24) and (qweight < 0).any()
    for i, j, n in ((0, 0, 0), (3, 5, 7), (7, 7, 0), (5, 2, 23)):
        assert (int(qweight[i, n]) >> (4 * j)) & 0xF == values[8 * i + j, n]
    assert torch.equal(unpack_int4(qweight), values.to(torch.int32))


@pytest.mark.parametrize("case", INT4_CASES, ids=lambda case: case.name)
def test_int4_torch_path_matches_reference(case: Int4Case) -> None:
    """On CPU without the interpreter int4_gemm multiplies by dequantize_int4's weight (the reference's formula)."""
    from pagerail.worker.layers.quantization.int4_layout import dequantize_int4, pack_int4
    from pagerail.worker.layers.quantization.triton_int4_gemm import int4_gemm

    generator = torch.Generator().manual_seed(1)
    dtype = getattr(torch, case.dtype)
    values, scales, zeros, g_idx = int4_weight(case, dtype, generator)
    weight = dequantize_int4(pack_int4(values), scales, zeros, g_idx)
    want = int4_reference(torch.eye(case.in_features), values, scales, zeros, g_idx)
    assert weight.dtype == dtype and torch.equal(weight, want.to(dtype)), "one rounding of the exact weight"
    x = _activations(case.rows, case.in_features, dtype, generator).view(1, case.rows, -1)
    got = int4_gemm(x, pack_int4(values), scales, zeros, g_idx)
    assert got.shape == (1, case.rows, case.out_features)
    assert _row_error(got[0], x[0].double() @ weight.double()) <= TOLERANCE[case.dtype]


@pytest.mark.parametrize("case", FP8_CASES, ids=lambda case: case.name)
def test_fp8_torch_path_matches_reference(case: Fp8Case) -> None:
    from pagerail.worker.layers.quantization.triton_fp8_gemm import fp8_block_linear, quantize_activations_per_group

    generator = torch.Generator().manual_seed(2)
    dtype = getattr(torch, case.dtype)
    x = _activations(case.rows, case.in_features, dtype, generator)
    weight, weight_scale = _fp8_weight(case, generator)
    got = fp8_block_linear(x, weight, weight_scale, case.block)
    want = fp8_reference(*quantize_activations_per_group(x, case.block[1]), weight, weight_scale, case.block)
    assert got.dtype == dtype and _row_error(got, want) <= TOLERANCE[case.dtype]


def test_shapes_are_checked() -> None:
    from pagerail.worker.layers.quantization.triton_fp8_gemm import fp8_block_gemm
    from pagerail.worker.layers.quantization.triton_int4_gemm import int4_gemm

    scales, zeros = torch.ones(1, 16), torch.zeros(1, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"K=12 of x \(2, 12\) is not a multiple of 8"):
        int4_gemm(torch.zeros(2, 12), torch.zeros(1, 16, dtype=torch.int32), scales, zeros, torch.zeros(12))
    qweight, g_idx = torch.zeros(2, 16, dtype=torch.int32), torch.zeros(16, dtype=torch.int32)
    with pytest.raises(ValueError, match="zeros must be uint8"):
        int4_gemm(torch.zeros(2, 16), qweight, scales, zeros.int(), g_idx)
    with pytest.raises(ValueError, match="share one of"):
        int4_gemm(torch.zeros(2, 16).half(), qweight, scales, zeros, g_idx)
    fp8 = torch.zeros(4, 64, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"weight_scale .* is not fp32 \[1, 2\]"):
        fp8_block_gemm(fp8, torch.ones(4, 2), fp8, torch.ones(1, 1), (128, 32), torch.bfloat16)
    with pytest.raises(ValueError, match="power of two"):
        fp8_block_gemm(fp8, torch.ones(4, 2), fp8, torch.ones(1, 2), (128, 48), torch.bfloat16)
