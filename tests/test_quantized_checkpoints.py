"""Quantized checkpoints (fp8 per-tensor, per-channel, block-wise; AWQ; GPTQ with and without act-order) of tiny
Llama, Qwen3 and Qwen3-MoE models load and compute what their dequantized fp32 twins compute: every linear layer's
output, the logits at tensor-parallel sizes 1 and 2 (and with expert parallelism), and greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster import LLM
from tests.model_harness import prefill_logits, run_ranks
from tests.parity import engine_greedy
from tests.quant_checkpoints import FORMATS, write_quantized
from tests.tiny_models import make_tiny_model
from worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from worker.model_loader import load_model

KINDS = ("llama", "qwen3", "qwen3_moe")
PROMPT = torch.randint(3, 250, (24,), generator=torch.Generator().manual_seed(7))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory):
    """(kind, format) → (quantized dir, dequantized reference dir), written on first use."""
    root = tmp_path_factory.mktemp("quantized")
    made: dict[tuple[str, str], tuple[Path, Path]] = {}

    def get(kind: str, fmt: str) -> tuple[Path, Path]:
        if (kind, fmt) not in made:
            source = root / kind
            if not source.exists():
                make_tiny_model(kind, source)
            quantized, reference = root / f"{kind}-{fmt}", root / f"{kind}-{fmt}-ref"
            write_quantized(source, quantized, reference, fmt)
            made[kind, fmt] = quantized, reference
        return made[kind, fmt]

    return get


def _layer_outputs(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    outputs: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
            module.register_forward_hook(lambda _m, _i, out, name=name: outputs.__setitem__(name, out.detach()))
    prefill_logits(model, PROMPT)
    return outputs


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_layer_matches_the_dequantized_model(checkpoints, kind: str, fmt: str) -> None:
    quantized_dir, reference_dir = checkpoints(kind, fmt)
    quantized = load_model(quantized_dir)
    layers = [m for m in quantized.modules() if getattr(m, "quant_method", None) is not None]
    # Every attention and MLP projection holds quantized weights; routers stay in full precision.
    assert len(layers) == (2 if kind == "qwen3_moe" else 4) * quantized.config.num_hidden_layers
    ours, theirs = _layer_outputs(quantized), _layer_outputs(load_model(reference_dir))
    assert ours.keys() == theirs.keys() and len(ours) >= len(layers)
    for name, out in ours.items():
        scale = theirs[name].abs().max().item()
        # fp32 rounding only: the same weights, multiplied in another order (scales after the matmul).
        assert (out - theirs[name]).abs().max().item() <= 1e-5 * max(scale, 1.0), name


@pytest.mark.slow
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kind", ("llama", "qwen3_moe"))
def test_tensor_parallel_ranks_load_their_slices(checkpoints, kind: str, fmt: str) -> None:
    quantized_dir, reference_dir = checkpoints(kind, fmt)
    reference = prefill_logits(load_model(reference_dir), PROMPT)
    assert torch.allclose(run_ranks(quantized_dir, 2, PROMPT)[0], reference, atol=2e-5)
    if kind == "qwen3_moe":
        expert_parallel = run_ranks(quantized_dir, 2, PROMPT, enable_expert_parallel=True)[0]
        assert torch.allclose(expert_parallel, reference, atol=2e-5)
    if fmt == "gptq_act":
        # Act-order group indices point across the whole input, so their scales stay whole on every rank.
        assert torch.allclose(run_ranks(quantized_dir, 4, PROMPT)[0], reference, atol=2e-5)


def _greedy(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(str(model_dir), block_size=4, num_gpu_blocks=256, max_num_batched_tokens=64)
    try:
        return [tokens for tokens, _ in engine_greedy(llm, prompts, 32)]
    finally:
        llm.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_tokens_equal_the_dequantized_model(checkpoints, kind: str) -> None:
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 250, (n,), generator=generator).tolist() for n in (3, 9, 17, 30, 5, 12, 41, 22)]
    for fmt in FORMATS:
        quantized_dir, reference_dir = checkpoints(kind, fmt)
        assert _greedy(quantized_dir, prompts) == _greedy(reference_dir, prompts), fmt
