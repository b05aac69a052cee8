"""CUDA-only: a worker whose KV cache was sized by the profiling forward runs its worst steps within the budget."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

from pagerail.common.engine_args import engine_config  # noqa: E402
from pagerail.proto import step_pb2  # noqa: E402
from pagerail.worker.config import WorkerConfig  # noqa: E402
from pagerail.worker.worker import Worker  # noqa: E402

MiB = 1 << 20
UTILIZATION = 0.6
TOKENS = 16384  # max_num_batched_tokens, and the longest request
SEQS = 1024  # max_num_seqs: 1024 sampled rows of a 128k vocabulary make the sampler's copies weigh gigabytes
BLOCK_SIZE = 16
# Allocations after sizing that no term covers exactly: input buffers, request states, allocator rounding.
TOLERANCE = 64 * MiB
# A Llama-3-like vocabulary and MLP on few layers: activations of a few GiB, more than the memory held outside
# torch, so a cache that ignored them (the budget before profiling) would push the peak past the budget.
CONFIG = dict(
    vocab_size=128256,
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=TOKENS,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("profiled") / "llama"
    LlamaConfig(**CONFIG).save_pretrained(path)  # dummy weights: the config is all the worker reads
    return path


def new_request(handle: int, tokens: int, blocks: list[int], sampling: step_pb2.SamplingParams) -> step_pb2.NewRequest:
    return step_pb2.NewRequest(
        handle=handle,
        request_id=f"req-{handle}",
        token_ids=[(handle * 31 + i) % 1000 + 3 for i in range(tokens)],
        num_prompt_tokens=tokens,
        sampling=sampling,
        block_ids=blocks,
        num_scheduled_tokens=tokens,
    )


def worst_steps() -> list[step_pb2.StepBatch]:
    """A whole-budget prefill of one request; the budget split over max_num_seqs sampled requests with the
    sampler's heaviest settings; one decode for each of them (more rows than the largest graph: eager); then a
    decode for a quarter of them (a graph replay unless eager)."""
    greedy = step_pb2.SamplingParams(temperature=0.0)
    heavy = step_pb2.SamplingParams(
        temperature=0.7, top_p=0.9, top_k=50, min_p=0.05, num_logprobs=5, min_tokens=1, stop_token_ids=[2]
    )
    long_blocks = list(range(TOKENS // BLOCK_SIZE))
    per_request = TOKENS // SEQS
    first = len(long_blocks)
    split = [new_request(1 + i, per_request, [first + i], heavy) for i in range(SEQS)]
    decodes = [
        step_pb2.CachedRequest(handle=1 + i, num_scheduled_tokens=1, new_block_ids=[first + SEQS + i])
        for i in range(SEQS)
    ]
    return [
        step_pb2.StepBatch(step_id=1, new_requests=[new_request(0, TOKENS, long_blocks, greedy)]),
        step_pb2.StepBatch(step_id=2, new_requests=split, finished=[0]),
        step_pb2.StepBatch(step_id=3, cached_requests=decodes),
        step_pb2.StepBatch(
            step_id=4,
            cached_requests=[step_pb2.CachedRequest(handle=1 + i, num_scheduled_tokens=1) for i in range(SEQS // 4)],
        ),
    ]


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "graphs"])
def test_profiled_cache_leaves_room_for_the_worst_steps(model_dir, enforce_eager):
    gc.collect()
    torch.cuda.empty_cache()
    engine = engine_config(
        device="cuda",
        dtype="bfloat16",
        load_format="dummy",
        block_size=BLOCK_SIZE,
        gpu_memory_utilization=UTILIZATION,
        max_num_batched_tokens=TOKENS,
        max_num_seqs=SEQS,
        max_model_len=TOKENS,
        enforce_eager=enforce_eager,
    )
    config = WorkerConfig(str(model_dir), engine)
    worker = Worker(config)
    try:
        profile = worker.kv_profile
        assert profile is not None and profile.num_blocks == worker.num_blocks
        assert (profile.graph_reserve == 0) == enforce_eager
        # The cache took nearly all of the budget: the check below is about headroom, not an idle card.
        _, total = torch.cuda.mem_get_info()
        budget = total * UTILIZATION
        assert worker.num_blocks * profile.bytes_per_block > budget / 2
        torch.cuda.synchronize()
        before_steps = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        for batch in worst_steps():
            result = worker.execute_step(batch)
            assert len(result.token_ids) == len(batch.new_requests) + len(batch.cached_requests)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        assert peak <= budget + TOLERANCE, f"peak {peak} over {UTILIZATION} of {total}: {profile.summary()}"
        # The profiled step was the worst one: no real step needed more activation memory than it measured.
        assert peak - before_steps <= profile.activation_peak + TOLERANCE, profile.summary()
    finally:
        del worker
        gc.collect()
        torch.cuda.empty_cache()
