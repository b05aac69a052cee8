"""The quantized-weight GEMM kernels (fp8 block-scaled W8A8, int4 w4a16) built offline for sm_90 (H100/H200) at
Llama-3-8B's shapes by this environment's Triton and the GPU image's, as tests/test_hopper_builds.py builds the
engine's kernels: every variant compiles, fits shared memory and does not spill at bf16."""

from __future__ import annotations

import json

import pytest
import torch

from tests.hopper_reports import build_launches, checked_report, hopper_reports_of, recording_kernels

# Child processes, the Triton interpreter or offline GPU builds: left out of `make test-fast`.
pytestmark = pytest.mark.slow


# (name, N, K) of Llama-3-8B's projections: q/o (and k/v's multiples of 16), gate/up, down. Block 128 x 128 for
# fp8, group 128 for int4; rows for each tile configuration: decode, a short prefill, a long one.
HOPPER_SHAPES = [("llama-3-8b-o", 4096, 4096), ("llama-3-8b-up", 14336, 4096), ("llama-3-8b-down", 4096, 14336)]
HOPPER_ROWS = (1, 64, 512)


def _hopper_launches() -> None:
    """Both GEMMs at each shape and row count in bf16 (with a bias at decode), recorded rather than run."""
    from pagerail.worker.layers.quantization.triton_fp8_gemm import fp8_block_gemm
    from pagerail.worker.layers.quantization.triton_int4_gemm import int4_gemm

    bf16, fp8 = torch.bfloat16, torch.float8_e4m3fn
    for _, out_features, in_features in HOPPER_SHAPES:
        weight = torch.empty((out_features, in_features), dtype=fp8)
        weight_scale = torch.empty((out_features // 128, in_features // 128))
        qweight = torch.empty((in_features // 8, out_features), dtype=torch.int32)
        scales = torch.empty((in_features // 128, out_features), dtype=bf16)
        zeros = torch.empty(scales.shape, dtype=torch.uint8)
        g_idx = torch.zeros(in_features, dtype=torch.int32)
        for rows in HOPPER_ROWS:
            biases = (None, torch.empty(out_features, dtype=bf16)) if rows == 1 else (None,)
            for bias in biases:
                x_fp8, x_scale = torch.empty((rows, in_features), dtype=fp8), torch.empty((rows, in_features // 128))
                fp8_block_gemm(x_fp8, x_scale, weight, weight_scale, (128, 128), bf16, bias)
                int4_gemm(torch.empty((rows, in_features), dtype=bf16), qweight, scales, zeros, g_idx, bias)


def _hopper_report() -> None:
    """Entry point of the child process: each distinct launch of the two kernels built for sm_90, as JSON."""
    import time

    import triton

    from pagerail.worker.layers.quantization import triton_fp8_gemm, triton_int4_gemm
    from tests.triton_launches import LaunchRecorder

    started = time.perf_counter()
    recorder = LaunchRecorder(forward=False)
    # No GPU here: the wrappers would take their torch paths on these CPU tensors.
    always = {"fp8_block_gemm_available": lambda x: True}
    with recording_kernels(recorder, triton_fp8_gemm, "_fp8_block_gemm_kernel", stand_ins=always):
        with recording_kernels(
            recorder, triton_int4_gemm, "_int4_gemm_kernel", stand_ins={"int4_gemm_available": lambda x: True}
        ):
            _hopper_launches()
    builds, failures = [], []
    build_launches(recorder, set(), builds, failures)
    seconds = round(time.perf_counter() - started, 1)
    print(json.dumps({"triton": triton.__version__, "builds": builds, "failures": failures, "seconds": seconds}))


@pytest.fixture(scope="module")
def hopper_reports() -> dict[str, dict]:
    """The builds with this Triton and with the GPU image's, by two child processes at once (one core each)."""
    return hopper_reports_of("tests.test_quant_gemm_hopper_builds")


@pytest.mark.parametrize("which", ["this", "image"])
def test_kernels_build_for_sm90(which: str, hopper_reports: dict[str, dict]) -> None:
    """Every variant compiles for H100/H200 (offline, no GPU), fits shared memory and does not spill."""
    report = checked_report(which, hopper_reports, {"_fp8_block_gemm_kernel", "_int4_gemm_kernel"})
    # Three tile configurations, each with and without a bias: the row count itself never makes a variant.
    assert len(report["builds"]) == 2 * 4
    for build in report["builds"]:
        where = f"{build['kernel']} {build['constexprs']}"
        assert build["spill_stores"] == build["spill_loads"] == 0, f"{where}: spills, {build['registers']} regs"
