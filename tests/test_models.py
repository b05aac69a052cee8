"""Model parity with transformers, tensor-parallel shard math and model construction errors."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagerail.worker.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagerail.worker.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagerail.worker.model_loader import load_hf_config, load_model
from pagerail.worker.models.llama import LlamaForCausalLM
from pagerail.worker.parallel_state import SINGLE_RANK, TensorParallelGroup
from tests.model_harness import prefill_logits, run_ranks
from tests.tiny_models import TINY_KINDS, make_tiny_model, tiny_config

PROMPT_LEN = 24


def tp_group(rank: int, size: int) -> TensorParallelGroup:
    return TensorParallelGroup(rank=rank, size=size, process_group=None)


class LocalPart(TensorParallelGroup):
    """One rank of a simulated group whose collectives return this rank's own part, for the test to combine."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return x

    def gather(self, x: torch.Tensor, dim: int = -1, dst: int = 0) -> torch.Tensor:
        return x


def hf_logits(model_dir, input_ids: torch.Tensor) -> torch.Tensor:
    reference = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with torch.inference_mode():
        return reference(input_ids[None]).logits[0].float()


def random_ids(vocab_size: int, length: int = PROMPT_LEN, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("tiny")
    return {kind: make_tiny_model(kind, root / kind) for kind in TINY_KINDS}


# --- (a) parity with transformers on tiny models -------------------------------------------------


@pytest.mark.parametrize("kind", TINY_KINDS)
def test_tiny_model_logits_match_transformers(tiny_dirs, kind):
    model_dir = tiny_dirs[kind]
    model = load_model(model_dir, SINGLE_RANK, torch.float32, "cpu")
    ids = random_ids(model.config.vocab_size)
    ours = prefill_logits(model, ids)
    expected = hf_logits(model_dir, ids)
    assert ours.dtype == torch.float32
    assert ours.shape == (PROMPT_LEN, model.config.vocab_size)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)


def test_tiny_configs_cover_the_intended_paths(tiny_dirs):
    configs = {kind: load_hf_config(path) for kind, path in tiny_dirs.items()}
    assert configs["llama"].rope_parameters["rope_type"] == "llama3"
    assert configs["qwen2"].rope_parameters["rope_type"] == "linear"
    assert configs["llama_tied"].tie_word_embeddings and configs["qwen2"].tie_word_embeddings
    assert not configs["llama"].tie_word_embeddings
    with safe_open(str(tiny_dirs["qwen2"] / "model.safetensors"), "pt") as handle:
        names = set(handle.keys())
    assert "model.layers.0.self_attn.q_proj.bias" in names and "lm_head.weight" not in names
    with safe_open(str(tiny_dirs["qwen3"] / "model.safetensors"), "pt") as handle:
        assert "model.layers.0.self_attn.q_norm.weight" in set(handle.keys())


def test_tied_head_shares_the_embedding(tiny_dirs):
    tied = load_model(tiny_dirs["llama_tied"])
    untied = load_model(tiny_dirs["llama"])
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert untied.lm_head.weight is not untied.model.embed_tokens.weight
    assert not torch.equal(untied.lm_head.weight, untied.model.embed_tokens.weight)


def test_model_exposes_cache_geometry(tiny_dirs):
    model = load_model(tiny_dirs["mistral"])
    assert model.num_layers == 2
    assert model.head_dim == 32  # from config.head_dim, not hidden_size / heads
    assert model.num_kv_heads_per_rank == 2
    assert len(model.attention_layers()) == 2


# --- (b) the embedded default model ---------------------------------------------------------------


def test_default_model_converts_and_matches_transformers(smollm2_dir):
    assert (smollm2_dir / "config.json").is_file()
    config = load_hf_config(smollm2_dir)
    assert getattr(config, "quantization_config", None) is None
    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    ids = torch.tensor(tokenizer("The capital of France is Paris. The capital of Germany is").input_ids)
    model = load_model(smollm2_dir, SINGLE_RANK, torch.float32, "cpu")
    ours = prefill_logits(model, ids)
    expected = hf_logits(smollm2_dir, ids)
    torch.testing.assert_close(ours, expected, atol=1e-4, rtol=1e-4)
    assert tokenizer.decode(ours[-1].argmax()).strip() == "Berlin"


# --- (c) refusing tensor-parallel sizes the model cannot split --------------------------------------


def test_head_count_not_divisible_by_tp_size_is_refused():
    config = tiny_config("llama")  # 4 attention heads
    with pytest.raises(ValueError, match=r"num_attention_heads=4 .*tensor_parallel_size=3"):
        LlamaForCausalLM(config, tp_group(0, 3), torch.float32)


def test_kv_heads_neither_split_nor_replicable_are_refused():
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        QKVParallelLinear(64, 8, num_heads=6, num_kv_heads=2, tp=tp_group(0, 3))


# --- (d) shard math: each rank's weight_loader slice --------------------------------------------------


def load_shards(make_layer, size: int, loads) -> list:
    """Build the layer on every rank of a simulated group and feed it the same full tensors."""
    layers = []
    for rank in range(size):
        layer = make_layer(LocalPart(rank=rank, size=size))
        for param_name, full, shard_id in loads:
            param = getattr(layer, param_name)
            param.weight_loader(param, full, shard_id)
        layers.append(layer)
    return layers


def test_column_and_row_parallel_shards_concatenate_to_full():
    weight, bias = torch.randn(12, 8), torch.randn(12)
    cols = load_shards(
        lambda tp: ColumnParallelLinear(8, 12, True, tp), 2, [("weight", weight, None), ("bias", bias, None)]
    )
    assert torch.equal(torch.cat([layer.weight for layer in cols]), weight)
    assert torch.equal(torch.cat([layer.bias for layer in cols]), bias)

    weight, bias = torch.randn(8, 12), torch.randn(8)
    rows = load_shards(
        lambda tp: RowParallelLinear(12, 8, True, tp), 2, [("weight", weight, None), ("bias", bias, None)]
    )
    assert torch.equal(torch.cat([layer.weight for layer in rows], dim=1), weight)
    assert all(torch.equal(layer.bias, bias) for layer in rows)  # replicated, added once after the reduce
    x = torch.randn(3, 12)
    # With the reduce left out, each rank returns partial + bias; a real reduce sums partials, then adds bias once.
    partials = [rows[r](x[:, r * 6 : (r + 1) * 6]) - bias for r in range(2)]
    torch.testing.assert_close(sum(partials) + bias, torch.nn.functional.linear(x, weight, bias))


def test_merged_column_parallel_keeps_parts_separate():
    gate, up = torch.randn(16, 8), torch.randn(16, 8)
    layers = load_shards(
        lambda tp: MergedColumnParallelLinear(8, [16, 16], False, tp), 2, [("weight", gate, 0), ("weight", up, 1)]
    )
    gates = [layer.weight[:8] for layer in layers]
    ups = [layer.weight[8:] for layer in layers]
    assert torch.equal(torch.cat(gates), gate) and torch.equal(torch.cat(ups), up)
    fused = load_shards(
        lambda tp: MergedColumnParallelLinear(8, [16, 16], False, tp), 2, [("weight", torch.cat([gate, up]), None)]
    )
    assert all(torch.equal(a.weight, b.weight) for a, b in zip(layers, fused, strict=True))


@pytest.mark.parametrize(("size", "kv_heads_of_rank"), [(1, [[0, 1]]), (2, [[0], [1]]), (4, [[0], [0], [1], [1]])])
def test_qkv_shards_split_or_replicate_kv_heads(size, kv_heads_of_rank):
    heads, kv_heads, head_dim, hidden = 4, 2, 3, 5
    q = torch.randn(heads * head_dim, hidden)
    k = torch.randn(kv_heads * head_dim, hidden)
    v = torch.randn(kv_heads * head_dim, hidden)
    qb, kb, vb = torch.randn(heads * head_dim), torch.randn(kv_heads * head_dim), torch.randn(kv_heads * head_dim)
    loads = [
        ("weight", q, "q"),
        ("weight", k, "k"),
        ("weight", v, "v"),
        ("bias", qb, "q"),
        ("bias", kb, "k"),
        ("bias", vb, "v"),
    ]
    layers = load_shards(lambda tp: QKVParallelLinear(hidden, head_dim, heads, kv_heads, True, tp), size, loads)
    for param_name, full_q, full_k, full_v in (("weight", q, k, v), ("bias", qb, kb, vb)):
        q_parts, k_parts, v_parts = [], [], []
        for rank, layer in enumerate(layers):
            local = getattr(layer, param_name)
            q_part, k_part, v_part = local.split([layer.q_size, layer.kv_size, layer.kv_size])
            q_parts.append(q_part)
            k_parts.append(k_part)
            v_parts.append(v_part)
            wanted = torch.cat([torch.arange(h * head_dim, (h + 1) * head_dim) for h in kv_heads_of_rank[rank]])
            assert torch.equal(k_part, full_k[wanted]) and torch.equal(v_part, full_v[wanted])
        assert torch.equal(torch.cat(q_parts), full_q)
        if size <= kv_heads:
            assert torch.equal(torch.cat(k_parts), full_k) and torch.equal(torch.cat(v_parts), full_v)


@pytest.mark.parametrize("size", [2, 4])
def test_vocab_parallel_shards_pad_and_concatenate(size):
    vocab, dim = 250, 6  # 250 rows: split evenly by 2, padded to 252 for 4 ranks
    table = torch.randn(vocab, dim)
    embeds = load_shards(lambda tp: VocabParallelEmbedding(vocab, dim, tp), size, [("weight", table, None)])
    stacked = torch.cat([layer.weight for layer in embeds])
    assert stacked.shape[0] == -(-vocab // size) * size
    assert torch.equal(stacked[:vocab], table) and not stacked[vocab:].any()
    ids = torch.tensor([0, 1, 62, 63, 124, 125, 126, 187, 188, 249])
    # Each id is found by exactly one rank; the others contribute zeros to the sum.
    assert torch.equal(sum(layer(ids) for layer in embeds), table[ids])
    heads = load_shards(lambda tp: ParallelLMHead(vocab, dim, tp), size, [("weight", table, None)])
    hidden = torch.randn(3, dim)
    gathered = torch.cat([layer.compute_logits(hidden) for layer in heads], dim=-1)
    torch.testing.assert_close(gathered[:, :vocab], hidden @ table.T)


# --- whole-model tensor parallelism, ranks simulated by threads -------------------------------------------


@pytest.mark.parametrize(("kind", "size"), [("llama", 2), ("qwen3", 2), ("llama_tied", 4), ("qwen2", 4)])
def test_tensor_parallel_logits_match_single_rank(tiny_dirs, kind, size):
    ids = random_ids(250)
    single = prefill_logits(load_model(tiny_dirs[kind]), ids)
    logits = run_ranks(tiny_dirs[kind], size, ids)
    # Only rank 0 samples, so only rank 0 receives the whole vocabulary's logits.
    torch.testing.assert_close(logits[0], single, atol=1e-4, rtol=1e-4)
    assert logits[1:] == [None] * (size - 1)


def test_dummy_weights_are_seeded_and_independent_of_tp_size(tiny_dirs):
    ids = random_ids(250)
    first = prefill_logits(load_model(tiny_dirs["qwen3"], load_format="dummy", seed=3), ids)
    again = prefill_logits(load_model(tiny_dirs["qwen3"], load_format="dummy", seed=3), ids)
    other = prefill_logits(load_model(tiny_dirs["qwen3"], load_format="dummy", seed=4), ids)
    assert torch.isfinite(first).all() and torch.equal(first, again) and not torch.equal(first, other)
    logits = run_ranks(tiny_dirs["qwen3"], 2, ids, load_format="dummy", seed=3)
    torch.testing.assert_close(logits[0], first, atol=1e-5, rtol=1e-5)
