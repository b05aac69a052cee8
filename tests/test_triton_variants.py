"""A bounded number of compiled Triton variants: the engine's launches, keyed as an sm_90 build keys them.

Under the CPU interpreter the engine runs a bench-like workload (prompts of many lengths, chunked prefill, decode
batches that shrink as requests finish) after the rank's warm-up, with every kernel launch recorded and bound by
Triton's own argument binder for an sm_90 target (tests/triton_launches.py). On a GPU each distinct key is a
compile of seconds; the test asserts that each kernel has at most a small fixed number of them, the same for a
workload twice as long, and that the warm-up already met every one (so no timed step compiles).
"""

from __future__ import annotations

import json

import pytest

from tests.requirements import TRITON_REQUIRED, require_module
from tests.triton_interpreter import interpreted_report

# Child processes, the Triton interpreter or offline GPU builds: left out of `make test-fast`.
pytestmark = pytest.mark.slow

require_module("triton", "needs Triton", required_in_ci=TRITON_REQUIRED)

# Variants per kernel, each fixed by the model rather than by a step: the decode kernel's split and single-pass
# forms; the norm over hidden states with and without the residual add, and over heads (Qwen3's q/k norm).
MAX_VARIANTS = {"_paged_decode_kernel": 2, "_rms_norm_kernel": 3}


def _workload(num_requests: int):
    """Prompt lengths 3..~60 and output lengths 2..9, cycling, so batch shapes vary from step to step."""
    prompts = [[(i * 31 + j * 7) % 200 + 3 for j in range(3 + (i * 11) % 58)] for i in range(num_requests)]
    max_tokens = [2 + (i * 5) % 8 for i in range(num_requests)]
    return prompts, max_tokens


def _device_path_inputs(runner):
    """The runner's input buffers rebuilt on the device path (staging copy, table writes by index), as on CUDA."""
    from pagerail.worker.input_buffers import InputBuffers

    old = runner.inputs
    return InputBuffers(
        old.block_size,
        old.device,
        max_num_tokens=64,
        max_num_seqs=16,
        max_blocks_per_seq=old.block_table.shape[1],
        in_place=False,
    )


def _report() -> None:
    """Entry point under the interpreter: the sm_90 keys of each kernel, after warm-up and after each workload."""
    import tempfile

    from pagerail import LLM, SamplingParams
    from tests.tiny_models import make_tiny_model
    from tests.triton_launches import LaunchRecorder, engine_kernels

    model_dir = make_tiny_model("qwen3", tempfile.mkdtemp() + "/qwen3")  # q/k norms: one more norm call site
    report = {"kernels": sorted(engine_kernels())}
    with LaunchRecorder(forward=True) as recorder:
        llm = LLM(
            str(model_dir),
            device="cpu",
            block_size=8,
            num_gpu_blocks=160,
            max_num_batched_tokens=40,
            max_num_seqs=16,
            max_model_len=256,
        )
        runner = llm.engine.executor.worker.runner
        runner.inputs = _device_path_inputs(runner)
        runner.warm_up(40, 256)
        report["warm_up"] = {name: sorted(keys) for name, keys in recorder.keys().items()}
        for label, count in (("short", 12), ("long", 24)):
            prompts, max_tokens = _workload(count)
            params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
            outputs = llm.generate(prompts, params)
            assert [len(o.outputs[0].token_ids) for o in outputs] == max_tokens
            report[label] = {name: sorted(keys) for name, keys in recorder.keys().items()}
            report[label + "_launches"] = len(recorder.launches)
    print(json.dumps(report))


def test_each_kernel_compiles_a_bounded_number_of_variants():
    report = interpreted_report("tests.test_triton_variants", timeout=600)
    short, long, warm = report["short"], report["long"], report["warm_up"]
    # The workload reached the attention kernels of both paths and the fused ops.
    assert {"_paged_decode_kernel", "_paged_mixed_kernel", "_rms_norm_kernel", "_rotary_kernel"} <= set(long)
    assert report["long_launches"] >= 2 * report["short_launches"]  # cumulative: the long run has twice the steps
    for name, keys in long.items():
        assert len(keys) <= MAX_VARIANTS.get(name, 1), f"{name}: {len(keys)} variants\n" + "\n".join(keys)
    # Twice the steps, no more variants: the keys do not follow the batch shapes.
    assert {name: len(keys) for name, keys in long.items()} == {name: len(keys) for name, keys in short.items()}
    # And the warm-up met every variant the workload needed: no compile inside a timed step.
    for name, keys in long.items():
        missed = sorted(set(keys) - set(warm.get(name, [])))
        assert not missed, f"{name}: variants first met after the warm-up:\n" + "\n".join(missed)
