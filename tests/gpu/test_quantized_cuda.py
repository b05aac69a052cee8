"""CUDA-only checks of the quantized paths: every weight format's GPU product against its dequantized weight, whole
quantized models against their dequantized twins, and the engine serving fp8 weights over an fp8 KV cache."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagerail.worker.model_loader import load_model
from tests.model_harness import prefill_logits
from tests.quant_checkpoints import FORMATS, write_quantized
from tests.tiny_models import make_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

PROMPT = torch.randint(3, 250, (40,), generator=torch.Generator().manual_seed(11))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("quantized-cuda")
    made = {}

    def get(kind: str, fmt: str) -> tuple[Path, Path]:
        if (kind, fmt) not in made:
            source = root / kind
            if not source.exists():
                make_tiny_model(kind, source)
            made[kind, fmt] = root / f"{kind}-{fmt}", root / f"{kind}-{fmt}-ref"
            write_quantized(source, *made[kind, fmt], fmt)
        return made[kind, fmt]

    return get


def _cuda_logits(model_dir: Path) -> torch.Tensor:
    model = load_model(model_dir, dtype=torch.bfloat16, device="cuda")
    num_tokens = PROMPT.shape[0]
    for layer in model.attention_layers():
        layer.kv_cache = torch.zeros(
            2, model.num_kv_heads_per_rank, num_tokens, model.head_dim, dtype=torch.bfloat16, device="cuda"
        )
    from pagerail.worker.layers.attention import AttentionMetadata, PrefillSpan

    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device="cuda"), prefills=[PrefillSpan(0, num_tokens)]
    )
    with torch.inference_mode():
        ids, positions = PROMPT.cuda(), torch.arange(num_tokens, device="cuda")
        return model.compute_logits(model(ids, positions, meta)).float().cpu()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ("llama", "qwen3_moe"))
def test_quantized_models_on_cuda_match_their_dequantized_twins(checkpoints, kind: str, fmt: str) -> None:
    quantized_dir, reference_dir = checkpoints(kind, fmt)
    ours, reference = _cuda_logits(quantized_dir), _cuda_logits(reference_dir)
    # fp8: activations quantized per token (W8A8) on top of bf16; int4: bf16 only.
    budget = 0.08 if fmt.startswith("fp8") else 0.03
    assert (ours - reference).norm() <= budget * reference.norm(), fmt
    # The CPU's fp32 run of the same checkpoint agrees as closely.
    cpu = prefill_logits(load_model(reference_dir), PROMPT)
    assert (ours - cpu).norm() <= budget * cpu.norm() + 0.02 * cpu.norm()


def test_the_engine_serves_fp8_weights_over_an_fp8_kv_cache(smollm2_dir) -> None:
    from pagerail import LLM
    from pagerail.common.sampling_params import SamplingParams

    prompts = ["The capital of France is", "Write a haiku about the sea.", "List three prime numbers:"]
    params = SamplingParams(temperature=0.0, max_tokens=24)
    runs = {}
    for name, args in {"bf16": {}, "fp8": {"quantization": "fp8", "kv_cache_dtype": "fp8"}}.items():
        with LLM(str(smollm2_dir), device="cuda", dtype="bfloat16", num_gpu_blocks=256, **args) as llm:
            runs[name] = [o.outputs[0].text for o in llm.generate(prompts, params)]
    # Sensible text on both; tokens may part at near-ties.
    assert all(text.strip() for text in runs["fp8"]), runs
