"""EAGLE and EAGLE-3 heads through the engine on tiny models: outputs identical to decoding without speculation,
heads built to reproduce the target keep every draft, the drafts equal a dense reference computation of the head
over the target's hidden states, and heads that cannot read the target are refused naming the field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagerail import LLM
from pagerail.cluster.bench.random_eagle_heads import make_eagle_head, make_transparent
from pagerail.common.sampling_params import SamplingParams
from pagerail.worker.spec_decode.eagle import EagleProposer
from tests.tiny_models import make_tiny_model

METHODS = ("eagle", "eagle3")


def _spec(method: str, head: Path, k: int = 3) -> dict:
    # A batch-size threshold far above these batches keeps the back-off out of the way.
    return {"method": method, "model": str(head), "num_speculative_tokens": k, "disable_by_batch_size": 1000}


def _prompts(count: int) -> list[list[int]]:
    return [[3 + (i * 7 + j * 11) % 240 for j in range(3 + (i * 13) % 60)] for i in range(count)]


def _generate(model_dir: Path, spec: dict | None, prompts, params, **engine):
    llm = LLM(str(model_dir), speculative_config=spec, **engine)
    outputs = [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in llm.generate(prompts, params)]
    return outputs, llm


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Four layers: EAGLE-3 reads the inputs of layers 2, 2 and 1.
    return make_tiny_model("llama", tmp_path_factory.mktemp("eagle") / "target", num_layers=4)


@pytest.mark.parametrize("method", METHODS)
def test_a_head_that_reproduces_the_target_has_every_draft_kept(method: str, tmp_path: Path) -> None:
    """On a transparent target the constructed head drafts the target's own tokens: a wrong token shift, chaining
    or draft bookkeeping would show as a rejected draft. Chunked prefill and preemption on the way."""
    target = make_tiny_model("llama", tmp_path / "target", num_layers=4)
    make_transparent(target)
    head = make_eagle_head(target, tmp_path / "head", method == "eagle3", exact=True)
    prompts = _prompts(16)
    params = [SamplingParams(temperature=0.0, max_tokens=16 + i % 24, ignore_eos=True) for i in range(16)]
    tight = dict(block_size=4, num_gpu_blocks=36, max_num_batched_tokens=32)
    plain, base = _generate(target, None, prompts, params, **tight)
    base.shutdown()
    speculated, llm = _generate(target, _spec(method, head), prompts, params, **tight)
    policy, stats = llm.engine.speculation, llm.engine.scheduler.stats
    llm.shutdown()
    assert speculated == plain
    assert policy.num_draft_tokens > 100 and policy.num_accepted_tokens == policy.num_draft_tokens
    assert stats.num_preemptions > 0 and stats.num_mixed_steps > 0


RANDOM_HEAD_PROMPTS = _prompts(32)
RANDOM_HEAD_PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=1 + (i * 7) % 30, ignore_eos=True)
    if i % 2
    else SamplingParams(temperature=0.8, seed=i, max_tokens=12, logprobs=2, ignore_eos=True)
    for i in range(32)
]
RANDOM_HEAD_ENGINE = dict(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=24)


@pytest.fixture(scope="module")
def plain_outputs(target_dir: Path) -> list:
    """The run without speculation that both methods compare with: the same model and inputs, so decoded once."""
    plain, base = _generate(target_dir, None, RANDOM_HEAD_PROMPTS, RANDOM_HEAD_PARAMS, **RANDOM_HEAD_ENGINE)
    base.shutdown()
    return plain


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_random_heads_keep_greedy_and_seeded_outputs_exact(
    method: str, target_dir: Path, plain_outputs: list, tmp_path: Path
) -> None:
    """32 prompts, greedy and seeded sampling with logprobs, a tight cache: identical to decoding without
    speculation. The EAGLE-3 head drafts over a smaller vocabulary, mapped to target ids."""
    head = make_eagle_head(target_dir, tmp_path / "head", method == "eagle3", seed=3, draft_vocab_size=200)
    prompts, params, tight, plain = RANDOM_HEAD_PROMPTS, RANDOM_HEAD_PARAMS, RANDOM_HEAD_ENGINE, plain_outputs
    speculated, llm = _generate(target_dir, _spec(method, head), prompts, params, **tight)
    drafted, preempted = llm.engine.speculation.num_draft_tokens, llm.engine.scheduler.stats.num_preemptions
    llm.shutdown()
    assert drafted > 50 and preempted > 0
    for (ours, our_logprobs), (theirs, their_logprobs) in zip(speculated, plain, strict=True):
        assert ours == theirs
        # Logprobs of a verified row agree with the plain decode's to rounding (the rows are batched differently).
        for mine, other in zip(our_logprobs or (), their_logprobs or (), strict=True):
            assert mine.keys() == other.keys() and all(abs(mine[t] - other[t]) < 1e-4 for t in mine)


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _dense_head(t: dict, config: dict, eagle3: bool, embed, lm_head, ids, features):
    """The head over a whole sequence with plain causal attention: (LM-head input, chained feature) per row."""
    eps, heads, dim = config["rms_norm_eps"], config["num_attention_heads"], config["head_dim"]
    layer = "midlayer" if eagle3 else "layers.0"
    e = embed[ids]
    if eagle3:
        residual = features
        x = torch.cat(
            [_rms(e, t[f"{layer}.input_layernorm.weight"], eps), _rms(features, t[f"{layer}.hidden_norm.weight"], eps)],
            -1,
        )
    else:
        x = residual = torch.cat([e, features], -1) @ t["fc.weight"].T
    n = x.shape[0]
    q, k, v = (
        (x @ t[f"{layer}.self_attn.{p}_proj.weight"].T).view(n, heads, dim).transpose(0, 1) for p in ("q", "k", "v")
    )
    inv = 1.0 / (config["rope_theta"] ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.arange(n).float()[:, None] * inv[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()

    def rope(x):
        half = torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], -1)
        return x * cos + half * sin

    scores = rope(q) @ rope(k).transpose(1, 2) * dim**-0.5
    scores = scores.masked_fill(torch.triu(torch.ones(n, n, dtype=torch.bool), 1), float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, heads * dim) @ t[f"{layer}.self_attn.o_proj.weight"].T
    r = attn + residual
    h = _rms(r, t[f"{layer}.post_attention_layernorm.weight"], eps)
    gate, up = h @ t[f"{layer}.mlp.gate_proj.weight"].T, h @ t[f"{layer}.mlp.up_proj.weight"].T
    r2 = (torch.nn.functional.silu(gate) * up) @ t[f"{layer}.mlp.down_proj.weight"].T + r
    if eagle3:
        return _rms(r2, t["norm.weight"], eps) @ t["lm_head.weight"].T, r2
    return r2 @ lm_head.T, r2


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
def test_drafts_equal_a_dense_reference_of_the_head(
    method: str, target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every draft list the engine proposed (batched, chunked prefill, runs kept in part) equals the head computed
    densely over the whole context from transformers' hidden states of the target: the head's paged KV, its
    catch-up over kept positions and the features it reads are those of the published design."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    eagle3 = method == "eagle3"
    head = make_eagle_head(target_dir, tmp_path / "head", eagle3, seed=5)
    logged = []
    propose = EagleProposer.propose

    def spy(self, scheduled):
        contexts = {id(s): list(s.token_ids[: s.num_computed_tokens + 1]) for s in scheduled if s.num_lookahead}
        drafted = propose(self, scheduled)
        logged.extend((contexts[id(s)], list(s.drafts)) for s in drafted)
        return drafted

    monkeypatch.setattr(EagleProposer, "propose", spy)
    prompts = _prompts(12)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    _, llm = _generate(target_dir, _spec(method, head, k=3), prompts, params, max_num_batched_tokens=40)
    llm.shutdown()

    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    t = load_file(str(head / "model.safetensors"))
    config = json.loads((head / "config.json").read_text())
    embed, lm_head = target.model.embed_tokens.weight, target.lm_head.weight
    assert len(logged) > 40
    agree = 0
    with torch.no_grad():
        for context, drafts in logged:
            states = target(torch.tensor([context]), output_hidden_states=True).hidden_states
            if eagle3:
                features = torch.cat([states[2][0], states[2][0], states[1][0]], -1) @ t["fc.weight"].T
            else:
                features = states[-1][0]
            ids, features, reference = list(context[1:]), features[:-1], []
            for _ in drafts:
                logits, chained = _dense_head(t, config, eagle3, embed, lm_head, torch.tensor(ids), features)
                token = int(logits[-1].argmax())
                token = token + int(t["d2t"][token]) if eagle3 else token
                reference.append(token)
                ids.append(token)
                features = torch.cat([features, chained[-1:]], 0)
            agree += reference == drafts
    # Random weights leave a rare near-tie to rounding; a misplaced position or feature breaks nearly every list.
    assert agree >= 0.95 * len(logged), (agree, len(logged))


def test_heads_that_cannot_read_the_target_are_refused(target_dir: Path, tmp_path: Path) -> None:
    from pagerail.worker.model_loader import load_hf_config
    from pagerail.worker.spec_decode.eagle_head import check_head_config

    head = make_eagle_head(target_dir, tmp_path / "eagle", eagle3=False)
    with pytest.raises(ValueError, match="is an EAGLE head.*use method 'eagle'"):
        LLM(str(target_dir), speculative_config=_spec("eagle3", head))
    small_vocab = make_tiny_model("llama", tmp_path / "vocab", num_layers=4, vocab_size=200)
    with pytest.raises(ValueError, match="vocab_size=250, the target model 200"):
        LLM(str(small_vocab), speculative_config=_spec("eagle", head))
    eagle3 = make_eagle_head(target_dir, tmp_path / "eagle3", eagle3=True)
    with pytest.raises(ValueError, match="three target layers, got \\[2, 1, -1\\] for a target of 2 layers"):
        LLM(str(make_tiny_model("llama", tmp_path / "short")), speculative_config=_spec("eagle3", eagle3))
    # A target of another width: the head reads hidden states of the wrong size.
    wide = load_hf_config(target_dir)
    wide.hidden_size = 96
    with pytest.raises(ValueError, match="hidden_size=64, the target model hidden_size=96"):
        check_head_config(load_hf_config(head), wide, False, {"fc.weight"})
    with pytest.raises(ValueError, match="target_hidden_size=64, the target model hidden_size=96"):
        check_head_config(load_hf_config(eagle3), wide, True, {"layers.0.hidden_norm.weight"})
