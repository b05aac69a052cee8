"""CUDA-only checks of LoRA serving: the batched shrink/expand kernels against a per-row loop at real shapes, and
the engine with adapters in bf16 (kernels) against the grouped torch path on the same GPU."""

from __future__ import annotations

import pytest
import torch

from tests.requirements import TRITON_REQUIRED, require_module

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def kernels():
    require_module("triton", "needs Triton", required_in_ci=TRITON_REQUIRED)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    ("rows", "in_features", "out_features", "slots", "width"), [(256, 4096, 6144, 4, 48), (7, 576, 3072, 8, 128)]
)
def test_kernels_match_a_per_row_loop_at_model_shapes(dtype, rows, in_features, out_features, slots, width):
    from pagerail.worker.layers.triton_lora import lora_delta

    generator = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(rows, in_features, device="cuda", generator=generator).to(dtype)
    a_t = (torch.randn(slots, in_features, width, device="cuda", generator=generator) * 0.02).to(dtype)
    b = (torch.randn(slots, width, out_features, device="cuda", generator=generator) * 0.02).to(dtype)
    slot_of_row = torch.randint(-1, slots, (rows,), device="cuda", generator=generator, dtype=torch.int32)
    out = torch.randn(rows, out_features, device="cuda", generator=generator).to(dtype)
    want = out.float().clone()
    for row, slot in enumerate(slot_of_row.tolist()):
        if slot >= 0:
            want[row] += (x[row].float() @ a_t[slot].float()) @ b[slot].float()
    lora_delta(x, out, a_t, b, slot_of_row)
    error = ((out.float() - want).abs().max() / want.abs().max()).item()
    assert error <= {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]


def test_the_engine_gives_the_same_tokens_with_the_kernels_as_with_the_torch_path(tmp_path):
    from pagerail import LLM, LoRARequest, SamplingParams
    from pagerail.cluster.bench.tiny_lora import ATTENTION, MLP, write_adapter
    from tests.tiny_models import make_tiny_model

    model_dir = make_tiny_model("llama", tmp_path / "llama")  # no tokenizer: the GPU image has no gguf to make one
    every = write_adapter(tmp_path / "every", model_dir, 8, ATTENTION + MLP, seed=21)
    qv = write_adapter(tmp_path / "qv", model_dir, 4, ("q_proj", "v_proj"), seed=22)
    loras = [None, LoRARequest("every", 1, str(every)), LoRARequest("qv", 2, str(qv))]
    prompts = [[5, 17, 42, 99, 7], [9, 8, 7, 6, 5, 4, 3], [200, 100]]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    runs = {}
    with LLM(str(model_dir), device="cuda", dtype="float32", enable_lora=True, max_loras=2) as llm:
        slots = llm.engine.executor.worker.lora
        assert slots.kernels
        for label, use_kernels in (("kernels", True), ("torch", False)):
            slots.kernels = use_kernels
            outputs = llm.generate([p for p in prompts for _ in loras], params, lora_request=loras * len(prompts))
            runs[label] = [o.outputs[0].token_ids for o in outputs]
    assert runs["kernels"] == runs["torch"]
    assert runs["kernels"][1] != runs["kernels"][0]
