"""gpt-oss on a tiny random checkpoint: logits and greedy parity with transformers past the sliding window, sinks
and the window that decide tokens, tensor- and expert-parallel ranks equal to one, dummy weights, and refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from pagerail import LLM
from pagerail.cluster.bench.random_checkpoints import save_random_weights
from pagerail.common.sampling_params import SamplingParams
from pagerail.worker.layers import cpu_paged_attention
from pagerail.worker.model_loader import load_model
from pagerail.worker.models.gpt_oss import GptOssForCausalLM
from pagerail.worker.models.registry import model_class, supported_architectures
from tests.model_harness import prefill_logits, run_ranks
from tests.parity import compare, engine_greedy, reference_greedy

WINDOW = 12
PROMPTS = [
    [5, 6, 7, 8, 9],
    [3, 17, 29, 41] * 7,
    list(range(20, 50)),
    [100 + (i * 7) % 120 for i in range(23)],
    list(range(30, 60)),
    [7] * 3,
    list(range(100, 125)),
    [9, 8, 7, 6, 5, 4, 3, 2, 1] * 3,
]
NEW_TOKENS = 32
EXPERTS_TENSOR = "model.layers.1.mlp.experts.gate_up_proj"


def gpt_oss_config():
    """Four layers alternating sliding (window 12) and full attention, 8 experts top-2, YaRN over 4x the context."""
    from transformers import GptOssConfig

    rope = dict(
        rope_type="yarn",
        rope_theta=150000.0,
        factor=4.0,
        beta_fast=32.0,
        beta_slow=1.0,
        truncate=False,
        original_max_position_embeddings=64,
    )
    return GptOssConfig(
        vocab_size=250,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        sliding_window=WINDOW,
        max_position_embeddings=256,
        rope_parameters=rope,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return save_random_weights(gpt_oss_config(), tmp_path_factory.mktemp("gpt_oss") / "tiny", 0, scale=0.08)


@pytest.fixture(scope="module")
def reference(model_dir) -> list:
    return reference_greedy(model_dir, PROMPTS, NEW_TOKENS)


def rewrite(model_dir: Path, root: Path, edit_tensors=None, **config_overrides) -> Path:
    """A copy of the checkpoint with its tensors passed through `edit_tensors` and its config overridden."""
    root.mkdir()
    config = json.loads((model_dir / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, **config_overrides}))
    if edit_tensors is None:
        shutil.copy(model_dir / "model.safetensors", root)
        return root
    with safe_open(str(model_dir / "model.safetensors"), "pt") as handle:
        tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    save_file(edit_tensors(tensors), str(root / "model.safetensors"), metadata={"format": "pt"})
    return root


def without_sinks(tensors: dict) -> dict:
    # A sink far below every score takes no share of any softmax: attention as if there were none.
    return {name: torch.full_like(t, -1e4) if name.endswith(".sinks") else t for name, t in tensors.items()}


def test_logits_match_transformers(model_dir):
    ids = torch.randint(0, 250, (40,), generator=torch.Generator().manual_seed(1))
    model = load_model(model_dir)
    assert type(model) is GptOssForCausalLM
    assert [layer.sliding_window for layer in model.attention_layers()] == [WINDOW, None, WINDOW, None]
    ours = prefill_logits(model, ids)
    expected = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.inference_mode():
        want = expected(ids[None]).logits[0]
    torch.testing.assert_close(ours, want, atol=1e-4, rtol=1e-4)


def test_sinks_and_the_window_decide_tokens(model_dir, reference, tmp_path):
    """Parity is not trivial: transformers itself continues differently without the window or without sinks."""
    unwindowed = reference_greedy(rewrite(model_dir, tmp_path / "full", sliding_window=4096), PROMPTS, NEW_TOKENS)
    sinkless_dir = rewrite(model_dir, tmp_path / "sinkless", without_sinks)
    sinkless = reference_greedy(sinkless_dir, PROMPTS, NEW_TOKENS)
    assert sum(a[0] != b[0] for a, b in zip(reference, unwindowed, strict=True)) >= 4
    assert sum(a[0] != b[0] for a, b in zip(reference, sinkless, strict=True)) >= 4
    # And the engine follows each variant: its sinks are the checkpoint's, not a constant.
    ids = torch.arange(3, 40)
    assert not torch.allclose(prefill_logits(load_model(model_dir), ids), prefill_logits(load_model(sinkless_dir), ids))


@pytest.mark.parametrize("attention", ["native", "torch"])
def test_greedy_matches_transformers_past_the_window(model_dir, reference, attention, monkeypatch):
    monkeypatch.setenv("PAGERAIL_CPU_ATTENTION", attention)
    cpu_paged_attention.native_kernel.cache_clear()
    try:
        # Chunked prefill of 16 tokens in blocks of 4: prefix hits, mixed steps, windows starting mid-block.
        llm = LLM(str(model_dir), block_size=4, num_gpu_blocks=64, max_num_batched_tokens=16)
        report = compare(engine_greedy(llm, PROMPTS, NEW_TOKENS), reference)
    finally:
        cpu_paged_attention.native_kernel.cache_clear()
    assert report.identical == report.total, report.divergences
    assert llm.stats.num_mixed_steps > 0
    assert max(len(p) for p in PROMPTS) + NEW_TOKENS > 4 * WINDOW


@pytest.mark.parametrize(("size", "ep"), [(2, False), (2, True), (4, True)])
def test_parallel_ranks_match_one(model_dir, size, ep):
    ids = torch.arange(5, 45)
    single = prefill_logits(load_model(model_dir), ids)
    logits = run_ranks(model_dir, size, ids, enable_expert_parallel=ep)
    torch.testing.assert_close(logits[0], single, atol=1e-4, rtol=1e-4)
    assert logits[1:] == [None] * (size - 1)


def test_dummy_weights_load_and_do_not_depend_on_the_split(model_dir):
    ids = torch.arange(3, 30)
    first = prefill_logits(load_model(model_dir, load_format="dummy", seed=3), ids)
    assert torch.isfinite(first).all()
    assert not torch.equal(first, prefill_logits(load_model(model_dir, load_format="dummy", seed=4), ids))
    for ep in (False, True):
        logits = run_ranks(model_dir, 2, ids, load_format="dummy", seed=3, enable_expert_parallel=ep)
        torch.testing.assert_close(logits[0], first, atol=1e-5, rtol=1e-5)


def test_dummy_weights_serve(model_dir):
    llm = LLM(str(model_dir), load_format="dummy", block_size=4, num_gpu_blocks=32)
    out = llm.generate([PROMPTS[2]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 8


def test_registered_under_its_architecture_and_model_type():
    assert "GptOssForCausalLM" in supported_architectures()
    assert model_class(type("C", (), {"architectures": ["GptOssForCausalLM"]})()) is GptOssForCausalLM
    assert model_class(type("C", (), {"model_type": "gpt_oss"})()) is GptOssForCausalLM


def test_quantized_checkpoints_are_refused_naming_the_method(model_dir, tmp_path):
    fp8 = rewrite(model_dir, tmp_path / "fp8", quantization_config={"quant_method": "fp8"})
    with pytest.raises(ValueError, match=r"quantization_config \(quant_method='fp8'\) is not supported for gpt-oss"):
        load_model(fp8)
    # MXFP4 experts load (tests/test_mxfp4.py); 16-bit experts under an mxfp4 config are named.
    mxfp4 = rewrite(model_dir, tmp_path / "mxfp4", quantization_config={"quant_method": "mxfp4"})
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts\.\w+' holds 16/32-bit experts, but"):
        load_model(mxfp4)


def test_wrong_expert_shape_names_the_tensor_and_both_shapes(model_dir, tmp_path):
    def shrink(tensors: dict) -> dict:
        tensors[EXPERTS_TENSOR] = tensors[EXPERTS_TENSOR][:, :, :126].contiguous()
        return tensors

    bad = rewrite(model_dir, tmp_path / "shape", shrink)
    pattern = (
        rf"'{EXPERTS_TENSOR}': stacked gate_up_proj of all experts has shape \(8, 64, 126\), expected \(8, 64, 128\)"
    )
    with pytest.raises(ValueError, match=pattern):
        load_model(bad)
