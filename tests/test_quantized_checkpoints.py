"""Quantized checkpoints (fp8 per-tensor, per-channel, block-wise; AWQ; GPTQ with and without act-order) of tiny
Llama, Qwen3 and Qwen3-MoE models load and compute what their dequantized fp32 twins compute: every linear layer's
output, the logits at tensor-parallel sizes 1 and 2 (and with expert parallelism), and greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pagerail import LLM
from pagerail.worker.layers.linear import ColumnParallelLinear, RowParallelLinear
from pagerail.worker.model_loader import load_model
from tests.model_harness import prefill_logits, run_ranks
from tests.parity import engine_greedy
from tests.quant_checkpoints import FORMATS, write_quantized
from tests.tiny_models import make_tiny_model

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


def _edit_config(model_dir: Path, **changes) -> None:
    import json

    path = model_dir / "config.json"
    config = json.loads(path.read_text())
    config["quantization_config"].update(changes)
    path.write_text(json.dumps(config))


def _copy(source: Path, target: Path) -> Path:
    import shutil

    shutil.copytree(source, target)
    return target


def _drop_tensors(model_dir: Path, suffix: str) -> None:
    from safetensors.torch import load_file, save_file

    path = model_dir / "model.safetensors"
    tensors = {k: v for k, v in load_file(str(path)).items() if not k.endswith(suffix)}
    save_file(tensors, str(path))


def test_missing_scales_are_refused_naming_the_tensor(checkpoints, tmp_path: Path) -> None:
    for kind in ("llama", "qwen3_moe"):  # a linear layer's scale, and an expert's
        broken = _copy(checkpoints(kind, "fp8_block")[0], tmp_path / kind)
        module = "layers.1.mlp." + ("experts.3.down_proj" if "moe" in kind else "down_proj")
        _drop_tensors(broken, module + ".weight_scale_inv")
        with pytest.raises(ValueError, match=rf"{module}' lacks .weight_scale_inv or .weight_scale") as error:
            load_model(broken)
        assert "supported weight formats" in str(error.value)


def test_bad_quantization_configs_are_refused(checkpoints, tmp_path: Path) -> None:
    cases = [
        ("awq", {"quant_method": "squeezellm"}, r"quant_method='squeezellm' is not supported"),
        ("gptq", {"bits": 8}, r"bits=8"),
        ("gptq", {"group_size": 100}, r"group_size=100"),
        ("awq", {"version": "gemv"}, r"version='gemv'"),
        ("fp8_block", {"weight_block_size": [16]}, r"weight_block_size"),
    ]
    for index, (fmt, changes, message) in enumerate(cases):
        broken = _copy(checkpoints("llama", fmt)[0], tmp_path / str(index))
        _edit_config(broken, **changes)
        with pytest.raises(ValueError, match=message) as error:
            load_model(broken)
        assert "supported weight formats: fp8" in str(error.value)


def test_group_and_block_sizes_must_divide_each_ranks_slice(checkpoints) -> None:
    with pytest.raises(ValueError, match=r"group_size=32 does not divide the 16 input features per rank"):
        run_ranks(checkpoints("llama", "gptq")[0], 4, PROMPT)
    with pytest.raises(ValueError, match=r"weight_block_size \[16, 32\] does not divide the 16 input features"):
        run_ranks(checkpoints("llama", "fp8_block")[0], 4, PROMPT)


def test_act_order_parts_of_a_fused_layer_must_agree(checkpoints, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    broken = _copy(checkpoints("llama", "gptq_act")[0], tmp_path / "act")
    path = broken / "model.safetensors"
    tensors = load_file(str(path))
    name = "model.layers.0.self_attn.k_proj.g_idx"
    tensors[name] = tensors[name].flip(0).contiguous()
    save_file(tensors, str(path))
    with pytest.raises(ValueError, match="different g_idx"):
        load_model(broken)


def test_requested_format_must_match_the_checkpoint(checkpoints) -> None:
    with pytest.raises(ValueError, match=r"quantization='gptq', but the checkpoint's quantization_config says 'awq'"):
        load_model(checkpoints("llama", "awq")[0], quantization="gptq")
    source = checkpoints("llama", "awq")[0].parent / "llama"
    with pytest.raises(ValueError, match=r"quantization='awq' needs a checkpoint quantized in that format"):
        load_model(source, quantization="awq")
    with pytest.raises(ValueError, match=r"load_format='dummy' cannot fill awq"):
        load_model(checkpoints("llama", "awq")[0], load_format="dummy")


def test_fp8_on_load_quantizes_each_row_of_every_projection(checkpoints) -> None:
    source = checkpoints("llama", "awq")[0].parent / "llama"
    full, fp8 = load_model(source), load_model(source, quantization="fp8")
    assert fp8.quant_config.describe == "fp8 channel (quantized on load)"
    weights = dict(full.named_parameters())
    for name, module in fp8.named_modules():
        if getattr(module, "quant_method", None) is None:
            continue
        assert module.weight.dtype == torch.float8_e4m3fn
        reference = weights[name + ".weight"]
        rebuilt = module.weight.float() * module.weight_scale[:, None]
        # e4m3 keeps 3 mantissa bits: each entry within 1/16 of its row's largest (relative rounding ≤ 2^-4).
        assert ((rebuilt - reference).abs() <= reference.abs().amax(dim=1, keepdim=True) / 16).all(), name
    # Random weights from the dummy format quantize the same way.
    dummy = load_model(source, quantization="fp8", load_format="dummy")
    assert all(m.weight.dtype == torch.float8_e4m3fn for m in dummy.modules() if getattr(m, "quant_method", None))


def test_metrics_show_the_weight_format_bytes_and_kv_dtype(checkpoints) -> None:
    from pagerail.worker.layers.quantization.summary import weight_bytes

    llm = LLM(str(checkpoints("llama", "fp8_block")[0]), num_gpu_blocks=32, block_size=4, kv_cache_dtype="fp8")
    try:
        text = llm.engine.metrics_text().decode()
        held = weight_bytes(llm.engine.executor.worker.model)
    finally:
        llm.shutdown()
    line = next(line for line in text.splitlines() if line.startswith("pagerail_model_weight_bytes{"))
    assert 'weight_format="fp8 block 16x32"' in line and 'kv_cache_dtype="float8_e4m3fn"' in line
    assert float(line.rsplit(" ", 1)[1]) == held
    # fp8 projections take a quarter of their fp32 bytes: the whole model well under its fp32 size.
    full = load_model(checkpoints("llama", "fp8_block")[1])
    assert held < 0.75 * weight_bytes(full)


@pytest.mark.parametrize("dtype", (torch.float8_e4m3fn, torch.float8_e5m2))
def test_fp8_bit_conversion_equals_torchs_for_every_code(dtype: torch.dtype) -> None:
    from pagerail.worker.layers.quantization.fp8_convert import fp8_to_float32

    codes = torch.arange(256, dtype=torch.uint8).view(dtype).reshape(16, 16)
    ours, theirs = fp8_to_float32(codes), codes.to(torch.float32)
    finite = theirs.isfinite()
    assert torch.equal(ours[finite], theirs[finite]) and ours.dtype == torch.float32
    assert torch.equal(torch.signbit(ours[finite]), torch.signbit(theirs[finite]))  # -0 stays -0


@pytest.mark.parametrize("fmt", ("fp8_tensor", "fp8_channel", "fp8_block"))
def test_the_gpu_w8a8_product_matches_the_dequantized_weight(checkpoints, fmt: str) -> None:
    """The GPU's W8A8 path (torch._scaled_mm, or the block GEMM's torch fallback) runs on CPU tensors too:
    activations quantized per token cost e4m3's precision, no more."""
    from pagerail.worker.layers.quantization.fp8_linear import apply_w8a8, dequantize_fp8

    model = load_model(checkpoints("llama", fmt)[0], dtype=torch.bfloat16)
    layers = [m for m in model.modules() if getattr(m, "quant_method", None) is not None]
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for layer in layers:
        if layer.in_features != x.shape[1]:
            continue
        ours = apply_w8a8(layer, x).float()
        reference = x.float() @ dequantize_fp8(layer, torch.float32).t()
        assert (ours - reference).norm() <= 0.05 * reference.norm()
