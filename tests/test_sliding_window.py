"""Sliding-window attention: every CPU attention path against a reference, greedy parity with transformers for
contexts longer than the window, and the blocks a sliding-only sequence holds as it grows."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import MistralConfig

from pagerail import LLM
from pagerail.cluster.bench.random_checkpoints import save_random_weights
from pagerail.cluster.core.engine import EngineCore
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.common.attention_windows import layer_sliding_windows, uniform_sliding_window
from pagerail.common.engine_config import CacheConfig, EngineConfig, SchedulerConfig
from pagerail.common.sampling_params import SamplingParams
from pagerail.worker.layers import cpu_paged_attention
from tests.fake_workers import FakeKVWorkers
from tests.parity import compare, engine_greedy, reference_greedy
from tests.tiny_models import _COMMON

WINDOW = 12  # not a multiple of the block sizes below, so windows start mid-block
PROMPTS = [
    [5, 6, 7, 8, 9],
    [3, 17, 29, 41] * 10,
    list(range(20, 90)),
    [100 + (i * 7) % 120 for i in range(23)],
    list(range(30, 60)),
    [7] * 3,
    list(range(100, 140)),
    [9, 8, 7, 6, 5, 4, 3, 2, 1] * 4,
]
NEW_TOKENS = 32


def test_layer_windows_follow_each_config_convention():
    from transformers import Gemma2Config, Qwen2Config

    assert layer_sliding_windows(MistralConfig(num_hidden_layers=3, sliding_window=7)) == [7, 7, 7]
    assert layer_sliding_windows(MistralConfig(num_hidden_layers=2, sliding_window=None)) == [None, None]
    assert layer_sliding_windows(Gemma2Config(num_hidden_layers=4, sliding_window=5)) == [5, None, 5, None]
    assert layer_sliding_windows(Qwen2Config(num_hidden_layers=2, sliding_window=9)) == [None, None]
    assert uniform_sliding_window({"num_hidden_layers": 2, "sliding_window": 9}) == 9
    assert uniform_sliding_window(Gemma2Config(num_hidden_layers=4, sliding_window=5)) is None
    with pytest.raises(ValueError, match="layer_types has 1 entries"):
        layer_sliding_windows({"num_hidden_layers": 2, "sliding_window": 4, "layer_types": ["sliding_attention"]})


@pytest.mark.parametrize(
    ("block_size", "window", "softcap"), [(16, 21, 0.0), (4, 1, 0.0), (16, 300, 0.0), (8, 16, 0.0), (16, 21, 1.5)]
)
def test_native_kernel_attends_over_the_window_only(block_size, window, softcap):
    kernel = cpu_paged_attention.native_kernel()
    if kernel is None:
        pytest.skip("no native CPU attention kernel on this machine")
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim, lens = 8, 2, 64, [1, 5, 23, 100, 130]
    blocks = [-(-n // block_size) for n in lens]
    num_blocks = sum(blocks) + 2
    pool = torch.randperm(num_blocks, generator=generator)
    table = torch.full((len(lens), max(blocks)), int(pool[-1]), dtype=torch.int64)
    taken = 0
    for row, count in enumerate(blocks):
        table[row, :count] = pool[taken : taken + count]
        taken += count
    key_cache = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=generator)
    value_cache = torch.randn(kv_heads, num_blocks * block_size, head_dim, generator=generator)
    q = torch.randn(len(lens), heads, head_dim, generator=generator)
    scale = head_dim**-0.5
    got = kernel.decode(q, key_cache, value_cache, table, torch.tensor(lens), block_size, scale, window, softcap)
    for row, length in enumerate(lens):
        positions = torch.arange(max(0, length - window), length)
        slots = table[row][positions // block_size] * block_size + positions % block_size
        keys = key_cache[:, slots].repeat_interleave(heads // kv_heads, 0)  # [heads, ctx, d]
        values = value_cache[:, slots].repeat_interleave(heads // kv_heads, 0)
        scores = torch.einsum("hd,htd->ht", q[row], keys) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        weights = scores.softmax(-1)
        want = torch.einsum("ht,htd->hd", weights, values)
        torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def mistral_window(tmp_path_factory):
    """A tiny Mistral whose every layer slides over WINDOW positions, and the reference continuations with and
    without the window (the prompts are long enough that it changes them)."""
    root = tmp_path_factory.mktemp("mistral_window")
    config = MistralConfig(**_COMMON, tie_word_embeddings=False, sliding_window=WINDOW, head_dim=32)
    model_dir = save_random_weights(config, root / "window", 0, scale=0.08)
    full = root / "full"
    full.mkdir()
    shutil.copy(model_dir / "model.safetensors", full)
    raw = json.loads((model_dir / "config.json").read_text())
    (full / "config.json").write_text(json.dumps({**raw, "sliding_window": None}))
    return model_dir, reference_greedy(model_dir, PROMPTS, NEW_TOKENS), reference_greedy(full, PROMPTS, NEW_TOKENS)


@pytest.mark.parametrize("attention", ["native", "torch"])
@pytest.mark.parametrize(
    "engine_args",
    [
        # Chunked prefill of 16 tokens in blocks of 4, prefix hits between the repeated prompts.
        dict(block_size=4, num_gpu_blocks=64, max_num_batched_tokens=16),
        # A cache too small for all eight at once: preemption, and blocks released mid-sequence reused.
        dict(block_size=4, num_gpu_blocks=27, max_num_batched_tokens=16),
        # Blocks of 16 and the default step budget: every prompt prefilled whole (64 blocks hold them all).
        dict(block_size=16, num_gpu_blocks=64),
    ],
    ids=["chunked", "preempting", "block16"],
)
def test_greedy_matches_transformers_past_the_window(mistral_window, attention, engine_args, monkeypatch):
    model_dir, reference, reference_without_window = mistral_window
    assert sum(a[0] != b[0] for a, b in zip(reference, reference_without_window, strict=True)) >= 6
    monkeypatch.setenv("PAGERAIL_CPU_ATTENTION", attention)
    cpu_paged_attention.native_kernel.cache_clear()
    try:
        llm = LLM(str(model_dir), **engine_args)
        report = compare(engine_greedy(llm, PROMPTS, NEW_TOKENS), reference)
        assert report.identical == report.total, report.divergences
        assert llm.engine.sliding_window == WINDOW
        assert llm.engine.block_table.num_free_blocks == llm.engine.block_table.num_blocks
    finally:
        monkeypatch.delenv("PAGERAIL_CPU_ATTENTION")
        cpu_paged_attention.native_kernel.cache_clear()


def _engine(num_blocks: int, window: int | None, block_size: int = 4, budget: int = 16) -> EngineCore:
    config = EngineConfig(
        cache=CacheConfig(block_size=block_size),
        scheduler=SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=64),
    )
    workers = FakeKVWorkers(num_blocks, block_size, 50, sliding_window=window)
    engine = EngineCore(config, workers, 4096, 50, eos_token_ids=[], sliding_window=window)
    engine.workers = workers
    return engine


def _request(request_id: str, prompt_len: int, max_tokens: int, seed: int = 0) -> EngineRequest:
    # Distinct prompts: identical sequences would share their blocks through the prefix cache.
    prompt = [(seed * 13 + i * 7) % 49 for i in range(prompt_len)]
    return EngineRequest(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def test_blocks_held_stay_bounded_while_a_sequence_grows_to_eight_windows():
    window, block_size = 20, 4
    held = {}
    for name, engine_window in (("window", window), ("full", None)):
        engine = _engine(400, engine_window, block_size)
        engine.add_request(_request("r", window, 7 * window))
        most = 0
        while engine.has_unfinished():
            engine.step()
            most = max(most, engine.block_table.num_blocks_held("r"))
        assert not engine.workers.corrupt_reads
        assert engine.block_table.num_free_blocks == engine.block_table.num_blocks
        held[name] = most
    # The window's blocks, one partly outside it, and the budget's tokens in flight.
    assert held["window"] <= -(-window // block_size) + 1 + -(-16 // block_size)
    assert held["full"] == 8 * window // block_size


def concurrent_long_sequences(window: int | None, num_blocks: int = 120, length: int = 160) -> tuple[int, int]:
    """(the most sequences past half of `length` tokens at once, preemptions) for 32 such sequences in a cache of
    num_blocks blocks of 4."""
    engine = _engine(num_blocks, window, budget=64)
    for i in range(32):
        engine.add_request(_request(f"r{i}", 16, length - 16, seed=i))
    most = 0
    while engine.has_unfinished():
        engine.step()
        long = [r for r in engine.scheduler.running if r.num_computed_tokens >= length // 2]
        most = max(most, len(long))
    assert not engine.workers.corrupt_reads
    return most, engine.scheduler.stats.num_preemptions


def test_more_long_sequences_fit_when_blocks_leave_the_window():
    (with_window, preempted_with), (without, preempted_without) = (
        concurrent_long_sequences(16),
        concurrent_long_sequences(None),
    )
    # 80+ tokens hold 20+ of the 120 blocks without the window; with it, about 16 / 4 + 2.
    assert without <= 6 and preempted_without > 0
    assert with_window >= 3 * without and preempted_with == 0, (with_window, without)
