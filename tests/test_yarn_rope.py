"""YaRN rotary scaling against transformers' own `_compute_yarn_parameters`: frequencies, the factor on cos and
sin, and the cos/sin tables gpt-oss's rotary embedding produces."""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig
from transformers.modeling_rope_utils import _compute_yarn_parameters

from pagerail.worker.layers.rotary import RotaryEmbedding, attention_scaling, inverse_frequencies, rope_parameters

HEAD_DIM = 64
MAX_POSITION = 131072
# gpt-oss's own settings, then each branch of the computation: truncation (transformers' default), beta
# defaults, an explicit attention factor, DeepSeek's mscale pair, a factor below 1 and a ramp of one pair.
YARN = {
    "gpt-oss": dict(factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False, original_max_position_embeddings=4096),
    "truncated": dict(factor=8.0, beta_fast=32.0, beta_slow=1.0, original_max_position_embeddings=4096),
    "default-betas": dict(factor=4.0, original_max_position_embeddings=32768),
    "attention-factor": dict(factor=16.0, attention_factor=1.25, original_max_position_embeddings=8192),
    "mscale": dict(factor=40.0, mscale=1.0, mscale_all_dim=0.707, original_max_position_embeddings=4096),
    "narrow-ramp": dict(
        factor=2.0, beta_fast=4.0, beta_slow=4.0, truncate=False, original_max_position_embeddings=4096
    ),
}


def _config(params: dict, theta: float = 150000.0) -> GptOssConfig:
    rope = {"rope_type": "yarn", "rope_theta": theta, **params}
    return GptOssConfig(
        num_hidden_layers=2, head_dim=HEAD_DIM, max_position_embeddings=MAX_POSITION, rope_parameters=rope
    )


@pytest.mark.parametrize("name", YARN)
def test_frequencies_and_attention_factor_equal_transformers(name):
    config = _config(YARN[name])
    want_freqs, want_factor = _compute_yarn_parameters(config)
    params = rope_parameters(config)
    assert params["rope_type"] == "yarn"
    got = inverse_frequencies(HEAD_DIM, params, max_position=MAX_POSITION)
    assert got.dtype == torch.float32 and torch.equal(got, want_freqs)
    assert attention_scaling(params, MAX_POSITION) == want_factor


def test_cos_sin_tables_equal_gpt_oss_rotary_embedding():
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding

    config = _config(YARN["gpt-oss"])
    positions = torch.tensor([0, 1, 17, 4095, 4096, 50000, MAX_POSITION - 1])
    want_cos, want_sin = GptOssRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions[None])
    rotary = RotaryEmbedding(HEAD_DIM, MAX_POSITION, rope_parameters(config))
    cos, sin = rotary.tables(positions)
    assert torch.equal(cos.squeeze(1), want_cos[0]) and torch.equal(sin.squeeze(1), want_sin[0])
    # The attention factor multiplies both tables: 0.1 * ln(32) + 1.
    assert rotary.cos_cache[0, 0].item() == pytest.approx(0.1 * torch.log(torch.tensor(32.0)).item() + 1)


def test_missing_fields_are_named():
    with pytest.raises(ValueError, match=r"rope_parameters.original_max_position_embeddings is required"):
        inverse_frequencies(HEAD_DIM, {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0})
    with pytest.raises(ValueError, match=r"rope_parameters.factor is required"):
        inverse_frequencies(HEAD_DIM, {"rope_type": "yarn", "rope_theta": 1e4, "original_max_position_embeddings": 64})
