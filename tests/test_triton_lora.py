"""The batched LoRA Triton kernels (shrink and expand, each row its own adapter slot): run by triton's CPU
interpreter against a per-row torch loop and inside the engine against the grouped torch path, and built offline
for sm_90 (H100/H200)."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch

from tests.hopper_reports import build_launches, checked_report, hopper_reports_of, recording_kernels
from tests.triton_interpreter import interpreted_report

# Child processes, the Triton interpreter or offline GPU builds: left out of `make test-fast`.
pytestmark = pytest.mark.slow


@dataclass(frozen=True)
class Case:
    name: str
    rows: int
    in_features: int
    out_features: int
    slots: int
    width: int
    dtype: str
    base_rows: bool = True  # some rows have slot -1 (the base model)
    strided_out: bool = False  # out is a column slice of a wider buffer


CASES = [
    Case("r1_fp32", 1, 64, 96, 2, 16, "float32", base_rows=False),
    Case("r9_base_fp32", 9, 72, 40, 3, 48, "float32"),
    Case("r17_bf16", 17, 128, 256, 4, 32, "bfloat16"),
    Case("r12_strided_fp16", 12, 200, 150, 2, 24, "float16", strided_out=True),
    Case("r33_wide_fp32", 33, 96, 300, 8, 80, "float32"),  # several column blocks and width blocks
]
# Largest |got - want| relative to the row's largest |want|: fp32 accumulation, the result rounded to the dtype.
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 2e-2}


def _inputs(case: Case):
    generator = torch.Generator().manual_seed(case.rows)
    dtype = getattr(torch, case.dtype)
    x = torch.randn(case.rows, case.in_features, generator=generator).to(dtype)
    a_t = (torch.randn(case.slots, case.in_features, case.width, generator=generator) * 0.1).to(dtype)
    b = (torch.randn(case.slots, case.width, case.out_features, generator=generator) * 0.1).to(dtype)
    low = -1 if case.base_rows else 0
    slots = torch.randint(low, case.slots, (case.rows,), generator=generator, dtype=torch.int32)
    wide = torch.randn(case.rows, case.out_features + (40 if case.strided_out else 0), generator=generator)
    out = wide.to(dtype)[:, : case.out_features]
    return x, a_t, b, slots, out


def _kernel_errors() -> dict[str, float]:
    from pagerail.worker.layers.triton_lora import lora_delta

    errors = {}
    for case in CASES:
        x, a_t, b, slots, out = _inputs(case)
        want = out.float().clone()
        for row, slot in enumerate(slots.tolist()):
            if slot >= 0:
                want[row] += (x[row].float() @ a_t[slot].float()) @ b[slot].float()
        lora_delta(x, out, a_t, b, slots)
        got = out.float()
        base = [row for row, slot in enumerate(slots.tolist()) if slot < 0]
        errors[case.name] = ((got - want).abs().max() / want.abs().max()).item()
        # A base-model row is left exactly as it was.
        errors[f"{case.name}/base_rows_changed"] = float(bool(base) and not torch.equal(got[base], want[base]))
    return errors


def _engine_tokens() -> dict:
    """Greedy tokens of the engine (this process runs under the interpreter, so every Triton kernel of the forward
    runs) for the base model and two adapters batched together: with the LoRA kernels, and with the grouped torch
    path on the same engine. Only the LoRA deltas differ between the two runs."""
    import tempfile
    from pathlib import Path

    from pagerail import LLM, LoRARequest, SamplingParams
    from pagerail.cluster.bench.tiny_llama import write_tiny_llama
    from pagerail.cluster.bench.tiny_lora import ATTENTION, MLP, write_adapter

    root = Path(tempfile.mkdtemp())
    model_dir = write_tiny_llama(root / "llama")
    adapters = {
        "every": write_adapter(root / "every", model_dir, 8, ATTENTION + MLP, seed=21),
        "qv": write_adapter(root / "qv", model_dir, 4, ("q_proj", "v_proj"), seed=22, use_rslora=True),
    }
    prompts = [[5, 17, 42, 99, 7], [9, 8, 7, 6, 5, 4, 3]]  # few rows and steps: the interpreter is slow
    loras = [None, LoRARequest("every", 1, str(adapters["every"])), LoRARequest("qv", 2, str(adapters["qv"]))]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    batch = [p for p in prompts for _ in loras]
    runs = {}
    with LLM(str(model_dir), device="cpu", enable_lora=True, max_loras=2, num_gpu_blocks=64, block_size=4) as llm:
        slots = llm.engine.executor.worker.lora
        for label, kernels in (("kernels", True), ("torch", False)):
            slots.kernels = kernels
            outputs = llm.generate(batch, params, lora_request=loras * len(prompts))
            runs[label] = [o.outputs[0].token_ids for o in outputs]
    return runs


def _report() -> None:
    """Entry point of the interpreter subprocess: one JSON line."""
    from pagerail.worker.layers.triton_lora import lora_kernels_available

    assert lora_kernels_available(torch.zeros(1)), "the interpreter must be on for CPU tensors"
    print(json.dumps({"kernels": _kernel_errors(), "engine": _engine_tokens()}))


@pytest.fixture(scope="module")
def interpreted() -> dict:
    return interpreted_report("tests.test_triton_lora", timeout=600)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_kernels_match_a_per_row_loop(case: Case, interpreted: dict) -> None:
    errors = interpreted["kernels"]
    assert errors[case.name] <= TOLERANCE[case.dtype], errors[case.name]
    assert errors[f"{case.name}/base_rows_changed"] == 0.0


def test_the_engine_gives_the_same_tokens_with_the_kernels_as_with_the_torch_path(interpreted: dict) -> None:
    """The torch path is held to transformers with each adapter merged by tests/test_lora.py."""
    runs = interpreted["engine"]
    assert runs["kernels"] == runs["torch"]
    for number in range(0, len(runs["kernels"]), 3):
        base, every, qv = runs["kernels"][number : number + 3]
        assert every != base and qv != base, "the adapters must change the tokens"


def test_shapes_are_checked() -> None:
    from pagerail.worker.layers.triton_lora import lora_delta

    x, a_t, b = torch.zeros(3, 8), torch.zeros(2, 8, 4), torch.zeros(2, 4, 6)
    with pytest.raises(ValueError, match="shapes"):
        lora_delta(x, torch.zeros(3, 5), a_t, b, torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="one slot per row"):
        lora_delta(x, torch.zeros(3, 6), a_t, b, torch.zeros(2, dtype=torch.int32))


# (name, in, out, slots, width, dtypes): Llama-3.1-8B's q/k/v (3 parts of rank 16) and down projection with 4 slots,
# SmolLM2-135M's gate/up with rank 64, and odd sizes.
HOPPER_SHAPES = [
    ("llama-3.1-8b-qkv-r16", 4096, 6144, 4, 48, ("bfloat16", "float16", "float32")),
    ("llama-3.1-8b-down-r16", 14336, 4096, 4, 16, ("bfloat16",)),
    ("smollm2-gate-up-r64", 576, 3072, 8, 128, ("bfloat16",)),
    ("odd", 72, 40, 2, 24, ("bfloat16",)),
]


def _hopper_report() -> None:
    """Entry point of the child process: each distinct launch of the two kernels built for sm_90, as JSON."""
    import triton

    from pagerail.worker.layers import triton_lora
    from tests.triton_launches import LaunchRecorder

    builds, failures, built = [], [], set()
    for shape, in_features, out_features, slots, width, dtypes in HOPPER_SHAPES:
        recorder = LaunchRecorder(forward=False)
        with recording_kernels(recorder, triton_lora, "_shrink_kernel", "_expand_kernel"):
            for dtype in (getattr(torch, name) for name in dtypes):
                a_t = torch.empty((slots, in_features, width), dtype=dtype)
                b = torch.empty((slots, width, out_features), dtype=dtype)
                for rows in (1, 64, 256):
                    x = torch.empty((rows, in_features), dtype=dtype)
                    out = torch.empty((rows, out_features), dtype=dtype)
                    triton_lora.lora_delta(x, out, a_t, b, torch.zeros(rows, dtype=torch.int32))
        build_launches(recorder, built, builds, failures, shape=shape)
    print(json.dumps({"triton": triton.__version__, "builds": builds, "failures": failures}))


@pytest.fixture(scope="module")
def hopper_reports() -> dict[str, dict]:
    return hopper_reports_of("tests.test_triton_lora")


@pytest.mark.parametrize("which", ["this", "image"])
def test_kernels_build_for_sm90(which: str, hopper_reports: dict[str, dict]) -> None:
    """Every launch variant compiles for H100/H200 (offline, no GPU), fits shared memory, and does not spill."""
    report = checked_report(which, hopper_reports, {"_shrink_kernel", "_expand_kernel"})
    for build in report["builds"]:
        assert build["spill_stores"] == build["spill_loads"] == 0, f"{build['kernel']} for {build['shape']}"
