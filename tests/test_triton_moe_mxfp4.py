"""The MXFP4 fused-experts Triton kernels under the CPU interpreter against float64, and built offline for sm_90."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest
import torch

from tests.hopper_reports import build_launches, checked_report, hopper_reports_of, recording_kernels
from tests.test_triton_moe import TOLERANCE, Case, _poisoned_empty, _routing, _row_error, fused_experts_reference
from tests.triton_interpreter import interpreted_report

# Child processes, the Triton interpreter or offline GPU builds: left out of `make test-fast`.
pytestmark = pytest.mark.slow

# Sizes are multiples of 32 (MXFP4 blocks); the K loops step 32 (fp32) or 64 (16-bit) columns, so 160 and 96
# end on a partial step.
CASES = [
    Case("t1_top1_e8_fp32", 1, 8, 1, 64, 32, "float32"),
    Case("t9_top2_e8_remote_silu_bf16", 9, 8, 2, 96, 64, "bfloat16", ids="int32", remote_experts=8),
    Case("t24_top4_e16_skewed_swiglu_bias_bf16", 24, 16, 4, 64, 96, "bfloat16", routing="skewed", bias=True,
         activation="swiglu_clamped"),
    Case("t17_top4_e16_remote_swiglu_bias_bf16", 17, 16, 4, 160, 96, "bfloat16", remote_experts=16, bias=True,
         activation="swiglu_clamped", strided_hidden=True),
    Case("t33_top4_e8_swiglu_bias_fp16", 33, 8, 4, 160, 64, "float16", bias=True, activation="swiglu_clamped"),
    Case("t97_top4_e4_swiglu_bias_fp32", 97, 4, 4, 64, 64, "float32", bias=True, activation="swiglu_clamped"),
]  # fmt: skip


def _mxfp4_weights(shape: tuple[int, ...], std: float, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """Random weights as MXFP4 (blocks, scales), with a few groups at extreme small and large scales."""
    from tests.mxfp4_checkpoints import quantize_mxfp4

    blocks, scales = quantize_mxfp4(torch.randn(shape, generator=generator) * std)
    scales[0, 0, 0] -= 20  # a group far below the rest: its products must not vanish by mistake
    scales[-1, -1, -1] += 3
    return blocks, scales


def _run_case(case: Case, seed: int = 0) -> dict[str, object]:
    """One case through the MXFP4 kernels; needs TRITON_INTERPRET=1 set before triton was imported."""
    from pagerail.worker.layers.moe_activation import ExpertActivation
    from pagerail.worker.layers.quantization.mxfp4 import dequantize_mxfp4
    from pagerail.worker.layers.triton_moe import _launch_config, triton_fused_experts
    from pagerail.worker.layers.triton_moe_mxfp4 import triton_mxfp4_experts

    generator = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, case.dtype)
    hidden = torch.randn((case.tokens, case.hidden + 8), generator=generator).to(dtype)
    hidden = hidden[:, : case.hidden] if case.strided_hidden else hidden[:, 8:].contiguous()
    spread = 4.0 if case.activation == "swiglu_clamped" else 1.0
    w13 = _mxfp4_weights((case.experts, 2 * case.inter, case.hidden), spread * case.hidden**-0.5, generator)
    w2 = _mxfp4_weights((case.experts, case.hidden, case.inter), case.inter**-0.5, generator)
    biases = (None, None)
    if case.bias:
        shapes = ((case.experts, 2 * case.inter), (case.experts, case.hidden))
        biases = tuple(torch.randn(shape, generator=generator).to(dtype) for shape in shapes)
    topk_ids, topk_weights = _routing(case, generator)
    activation = ExpertActivation(case.activation)
    with _poisoned_empty():
        got = triton_mxfp4_experts(hidden, *w13, *w2, topk_weights, topk_ids, *biases, activation)
    assert got.dtype == dtype and got.shape == hidden.shape
    dense13, dense2 = dequantize_mxfp4(*w13, torch.float64), dequantize_mxfp4(*w2, torch.float64)
    want = fused_experts_reference(hidden, dense13, dense2, topk_weights, topk_ids, *biases, case.activation)
    # The dense kernel on the same weights in the activation dtype (exact there): the same sums, bit for bit or
    # nearly (fp32 additions in another order: even columns, then odd ones).
    dense = triton_fused_experts(
        hidden, dense13.to(dtype), dense2.to(dtype), topk_weights, topk_ids, *biases, activation
    )
    counts = torch.bincount(topk_ids[topk_ids >= 0].long(), minlength=case.experts)
    remote_rows = (topk_ids < 0).all(dim=1)
    return {
        "error": _row_error(got, want),
        "dense_kernel_error": _row_error(dense, want),
        "vs_dense_kernel": (got.double() - dense.double()).abs().max().item(),
        "remote_rows_max": got[remote_rows].abs().max().item() if remote_rows.any() else 0.0,
        "block_m": _launch_config(topk_ids.numel(), case.experts, dtype)["BLOCK_M"],
        "expert_counts": counts.tolist(),
        "remote_slots": int((topk_ids < 0).sum()),
    }


def _layer_case() -> dict[str, float]:
    """Mxfp4FusedMoE's packed path (as on CUDA) against the same layer dequantized (as on the CPU), split over two
    tensor-parallel ranks: the loaders' layout is the one the kernels read."""
    from pagerail.worker.layers.moe_activation import ExpertActivation
    from pagerail.worker.layers.moe_mxfp4 import Mxfp4FusedMoE
    from pagerail.worker.parallel_state import TensorParallelGroup
    from tests.mxfp4_checkpoints import quantize_mxfp4

    generator = torch.Generator().manual_seed(3)
    experts, hidden_size, inter, top_k = 8, 64, 64, 2
    gate_up = quantize_mxfp4(torch.randn(experts, 2 * inter, hidden_size, generator=generator) * 0.5)
    down = quantize_mxfp4(torch.randn(experts, hidden_size, inter, generator=generator) * 0.2)
    tensors = {
        "w13_blocks": gate_up[0], "w13_scales": gate_up[1], "w2_blocks": down[0], "w2_scales": down[1],
        "w13_bias": torch.randn(experts, 2 * inter, generator=generator), "w2_bias": torch.randn(experts, hidden_size),
    }  # fmt: skip
    hidden = torch.randn(11, hidden_size, generator=generator)
    logits = torch.randn(11, experts, generator=generator)
    parts = {}
    for packed in (True, False):
        Mxfp4FusedMoE.keeps_packed = staticmethod(lambda device, packed=packed: packed)
        parts[packed] = []
        for rank in range(2):
            moe = Mxfp4FusedMoE(experts, top_k, hidden_size, inter, TensorParallelGroup(rank, 2), torch.float32,
                                False, False, False, True, ExpertActivation("swiglu_clamped"), True)  # fmt: skip
            for name, tensor in tensors.items():
                getattr(moe, name).weight_loader(
                    getattr(moe, name), tensor, "interleaved" if name == "w13_bias" else None
                )
            moe.after_loading()
            assert moe.packed == packed
            parts[packed].append(moe(hidden, logits))
    got, want = sum(parts[True]), sum(parts[False])
    return {"error": _row_error(got, want.double()), "scale": want.abs().max().item()}


def _report() -> None:
    """Entry point of the interpreter subprocess: one JSON line of {case name: results}."""
    print(json.dumps({"layer": _layer_case(), **{case.name: _run_case(case) for case in CASES}}))


@pytest.fixture(scope="module")
def interpreted() -> dict[str, dict]:
    return interpreted_report("tests.test_triton_moe_mxfp4")


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_kernel_matches_reference(case: Case, interpreted: dict[str, dict]) -> None:
    result = interpreted[case.name]
    assert result["error"] <= TOLERANCE[case.dtype], f"{asdict(case)}: relative row error {result['error']:.3g}"
    # No worse than the dense kernel on the dequantized weights (NaN from an unwritten row fails both checks).
    assert result["error"] <= 2 * result["dense_kernel_error"] + TOLERANCE[case.dtype] / 4
    assert result["remote_rows_max"] == 0.0


def test_packed_layer_matches_the_dequantized_layer(interpreted: dict[str, dict]) -> None:
    assert interpreted["layer"]["error"] <= TOLERANCE["float32"] and interpreted["layer"]["scale"] > 1


def test_cases_cover_the_routing_shapes(interpreted: dict[str, dict]) -> None:
    interpreted = {name: result for name, result in interpreted.items() if name != "layer"}
    counts = [count for result in interpreted.values() for count in result["expert_counts"]]
    assert 0 in counts and 1 in counts, "experts with 0 and 1 tokens"
    assert any(max(r["expert_counts"]) > r["block_m"] for r in interpreted.values()), "an expert over several blocks"
    assert {result["block_m"] for result in interpreted.values()} == {16, 32, 64}
    assert {c.top_k for c in CASES} >= {1, 2, 4} and {c.dtype for c in CASES} == set(TOLERANCE)
    assert any(c.tokens % 2 for c in CASES) and all(
        interpreted[c.name]["remote_slots"] for c in CASES if c.remote_experts
    )


def test_packed_shapes_are_checked() -> None:
    from pagerail.worker.layers.triton_moe_mxfp4 import triton_mxfp4_experts

    hidden, ids, weights = torch.zeros(3, 64), torch.zeros(3, 2, dtype=torch.int64), torch.ones(3, 2)
    w13 = (torch.zeros(4, 64, 2, 16, dtype=torch.uint8), torch.zeros(4, 64, 2, dtype=torch.uint8))
    w2 = (torch.zeros(4, 64, 1, 16, dtype=torch.uint8), torch.zeros(4, 64, 1, dtype=torch.uint8))
    wide = (torch.zeros(4, 64, 2, 16, dtype=torch.uint8), torch.zeros(4, 64, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"w2_blocks \(4, 64, 2, 16\) are not \[4, 64, 32/32, 16\]"):
        triton_mxfp4_experts(hidden, *w13, *wide, weights, ids)  # w13 says I=32: one group per down row
    with pytest.raises(ValueError, match="scales must be uint8"):
        triton_mxfp4_experts(hidden, w13[0], w13[1].float(), *w2, weights, ids)
    with pytest.raises(ValueError, match=r"w13_blocks \(4, 64, 3, 16\) are not \[E, 2\*I, 64/32, 16\]"):
        triton_mxfp4_experts(hidden, torch.zeros(4, 64, 3, 16, dtype=torch.uint8), w13[1][..., :1].expand(4, 64, 3),
                             *w2, weights, ids)  # fmt: skip


# (name, experts, hidden, intermediate per rank, top_k): gpt-oss-20b on one GPU and split over two.
HOPPER_SHAPES = [("gpt-oss-20b", 32, 2880, 2880, 4), ("gpt-oss-20b-tp2", 32, 2880, 1440, 4)]


def _packed(experts: int, rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks and scales of E experts' [rows, cols] weights: one expert's bytes viewed E times (no memory)."""
    blocks = torch.empty((1, rows, cols // 32, 16), dtype=torch.uint8).expand(experts, -1, -1, -1)
    return blocks, torch.empty((1, rows, cols // 32), dtype=torch.uint8).expand(experts, -1, -1)


def _hopper_report() -> None:
    """Entry point of the child process: each distinct launch of the two kernels built for sm_90, as JSON."""
    import triton

    from pagerail.worker.layers import triton_moe_mxfp4 as module
    from pagerail.worker.layers.moe_activation import ExpertActivation
    from tests.triton_launches import LaunchRecorder

    builds, failures, built = [], [], set()
    for shape, experts, hidden, inter, top_k in HOPPER_SHAPES:
        recorder = LaunchRecorder(forward=False)
        with recording_kernels(recorder, module, "_mxfp4_gate_up_kernel", "_mxfp4_down_kernel"):
            # The launch keys of real [E, ...] weights: an expanded view specialises as any multiple of 16 does.
            weights = (*_packed(experts, 2 * inter, hidden), *_packed(experts, hidden, inter))
            biases = (
                torch.empty((experts, 2 * inter), dtype=torch.bfloat16),
                torch.empty((experts, hidden)).bfloat16(),
            )
            for tokens in (1, -(-32 * experts // top_k), -(-128 * experts // top_k)):
                ids = torch.arange(tokens * top_k).view(tokens, top_k) % experts
                x = torch.empty((tokens, hidden), dtype=torch.bfloat16)
                module.triton_mxfp4_experts(
                    x, *weights, torch.ones(tokens, top_k), ids, *biases, ExpertActivation("swiglu_clamped")
                )
        build_launches(recorder, built, builds, failures, shape=shape)
    print(json.dumps({"triton": triton.__version__, "builds": builds, "failures": failures}))


@pytest.fixture(scope="module")
def hopper_reports() -> dict[str, dict]:
    """The builds with this Triton and with the GPU image's, by two child processes at once (one core each)."""
    return hopper_reports_of("tests.test_triton_moe_mxfp4")


@pytest.mark.parametrize("which", ["this", "image"])
def test_kernels_build_for_sm90(which: str, hopper_reports: dict[str, dict]) -> None:
    """Every launch variant compiles for H100/H200 (offline, no GPU), fits shared memory, and does not spill."""
    report = checked_report(which, hopper_reports, {"_mxfp4_gate_up_kernel", "_mxfp4_down_kernel"})
    assert {build["constexprs"]["BLOCK_M"] for build in report["builds"]} == {"16", "32", "64"}
    for build in report["builds"]:
        where = f"{build['kernel']} for {build['shape']} {build['constexprs']}"
        assert build["spill_stores"] == build["spill_loads"] == 0, f"{where}: spills, {build['registers']} regs"
