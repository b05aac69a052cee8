"""Gemma 2, Gemma 3, Phi-3 and Mistral on tiny random checkpoints: greedy parity with transformers through the
engine for contexts longer than their windows, tensor-parallel ranks equal to one, and the configs they refuse."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from pagerail import LLM
from pagerail.cluster.bench.random_checkpoints import save_random_weights
from pagerail.worker.model_loader import load_model
from pagerail.worker.models.registry import model_class, supported_architectures
from tests.model_harness import prefill_logits, run_ranks
from tests.parity import compare, engine_greedy, reference_greedy

_COMMON = dict(
    vocab_size=250,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
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


def family_config(kind: str):
    """The transformers config of one tiny family member; each turns on what sets its family apart."""
    from transformers import Gemma2Config, Gemma3TextConfig, MistralConfig, Phi3Config

    gemma = dict(_COMMON, head_dim=16, query_pre_attn_scalar=16, sliding_window=WINDOW)
    if kind == "gemma2":
        # Softcaps small enough to bind on these logits: alternating sliding and global layers.
        return Gemma2Config(**gemma, attn_logit_softcapping=3.0, final_logit_softcapping=5.0)
    if kind == "gemma3":
        rope = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 4.0},
        }
        kinds = ["sliding_attention"] * 3 + ["full_attention"]
        return Gemma3TextConfig(**gemma, layer_types=kinds, rope_parameters=rope)
    if kind == "mistral":
        return MistralConfig(**dict(_COMMON, num_hidden_layers=2), head_dim=32, sliding_window=WINDOW)
    if kind == "phi3":
        # LongRoPE whose short factors apply below 64 positions, a window on every layer.
        rope = dict(
            rope_type="longrope",
            rope_theta=10000.0,
            short_factor=[1.0 + 0.1 * i for i in range(8)],
            long_factor=[2.0 + 0.3 * i for i in range(8)],
            original_max_position_embeddings=64,
        )
        return Phi3Config(**dict(_COMMON, num_hidden_layers=2), rope_parameters=rope, sliding_window=20)
    raise ValueError(kind)


KINDS = ("gemma2", "gemma3", "phi3", "mistral")
# Phi-4-mini's RoPE over a fraction of each head, which the rotary layer does not do.
PHI3_PARTIAL_ROPE = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5)


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {kind: save_random_weights(family_config(kind), root / kind, 0, scale=0.08) for kind in KINDS}


def _variant(model_dir: Path, root: Path, **overrides) -> Path:
    """The same weights under a config with `overrides`: a reference that lacks one feature."""
    root.mkdir()
    shutil.copy(model_dir / "model.safetensors", root)
    config = json.loads((model_dir / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**config, **overrides}))
    return root


@pytest.mark.parametrize(
    "engine_args",
    [
        dict(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=16),
        # Overlapped steps, and a cache that holds less than the eight sequences: preemption.
        dict(block_size=4, num_gpu_blocks=24, max_num_batched_tokens=16, async_scheduling=True),
    ],
    ids=["chunked", "overlapped-preempting"],
)
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_transformers_past_the_window(family_dirs, kind, engine_args, tmp_path):
    model_dir = family_dirs[kind]
    reference = reference_greedy(model_dir, PROMPTS, NEW_TOKENS)
    # The window decides tokens here: with one wider than any context transformers continues most differently.
    unwindowed = reference_greedy(_variant(model_dir, tmp_path / "full", sliding_window=4096), PROMPTS, NEW_TOKENS)
    assert sum(a[0] != b[0] for a, b in zip(reference, unwindowed, strict=True)) >= 4
    llm = LLM(str(model_dir), **engine_args)
    report = compare(engine_greedy(llm, PROMPTS, NEW_TOKENS), reference)
    assert report.identical == report.total, report.divergences
    assert llm.stats.num_mixed_steps > 0
    if engine_args.get("async_scheduling"):
        assert llm.engine.num_overlapped_steps > 0 and llm.stats.num_preemptions > 0


def test_gemma2_softcaps_change_the_answer(family_dirs, tmp_path):
    model_dir = family_dirs["gemma2"]
    uncapped = _variant(model_dir, tmp_path / "uncapped", attn_logit_softcapping=None, final_logit_softcapping=None)
    ids = torch.arange(3, 40)
    capped_logits = prefill_logits(load_model(model_dir), ids)
    assert capped_logits.abs().max() <= 5.0  # the final cap
    assert not torch.allclose(capped_logits, prefill_logits(load_model(uncapped), ids), atol=1e-2)


@pytest.mark.parametrize("kind", KINDS)
def test_tensor_parallel_ranks_match_one(family_dirs, kind):
    ids = torch.arange(5, 45)
    single = prefill_logits(load_model(family_dirs[kind]), ids)
    logits = run_ranks(family_dirs[kind], 2, ids)
    torch.testing.assert_close(logits[0], single, atol=1e-4, rtol=1e-4)


def test_registry_lists_the_new_families():
    names = set(supported_architectures())
    assert {"Gemma2ForCausalLM", "Gemma3ForCausalLM", "Phi3ForCausalLM", "MistralForCausalLM"} <= names
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration.*supported: .*Gemma3ForCausalLM"):
        model_class(type("C", (), {"architectures": ["Gemma3ForConditionalGeneration"]})())


@pytest.mark.parametrize(
    ("kind", "overrides", "message"),
    [
        ("phi3", {"rope_parameters": PHI3_PARTIAL_ROPE}, "partial_rotary_factor=0.5 is not supported"),
        ("gemma3", {"use_bidirectional_attention": True}, "use_bidirectional_attention=True"),
        ("gemma2", {"hidden_activation": "relu"}, "hidden_activation='relu' is not supported"),
    ],
)
def test_unsupported_configs_are_refused_naming_the_field(family_dirs, tmp_path, kind, overrides, message):
    with pytest.raises(ValueError, match=message):
        load_model(_variant(family_dirs[kind], tmp_path / "bad", **overrides))


def test_longrope_factor_count_is_checked(family_dirs, tmp_path):
    from pagerail.worker.layers.rotary import RotaryEmbedding

    params = dict(rope_type="longrope", rope_theta=1e4, short_factor=[1.0] * 8, long_factor=[1.0] * 3)
    with pytest.raises(ValueError, match=r"rope_parameters.long_factor must hold head_dim / 2 = 8 values, got 3"):
        RotaryEmbedding(16, 256, {**params, "original_max_position_embeddings": 64})
    config = json.loads((family_dirs["phi3"] / "config.json").read_text())
    rope = {**config["rope_parameters"], "long_factor": [1.0] * 3}
    with pytest.raises(Exception, match=r"long_factor.* 8.*got 3"):  # transformers' own check (its error type)
        load_model(_variant(family_dirs["phi3"], tmp_path / "bad", rope_parameters=rope))
