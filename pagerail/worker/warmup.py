"""Warm-up steps: synthetic step batches with the shapes of a server's first steps, run before the first request.

On a GPU the first launch of each Triton kernel variant compiles it (seconds each), and cuBLAS picks and caches
its kernels per shape. A rank that runs these steps at start-up pays those costs before it serves: a step with
prefill chunks and decodes together (the mixed path), decode-only steps of several sequences, and, when the
model is long enough, a decode over a context long enough for the split-context attention pass. Every request
of the warm-up reads and writes only the scratch block, which the head never hands out; the steps end by
forgetting their requests, so no state of theirs survives.
"""

from __future__ import annotations

from pagerail.proto import step_pb2

# Handles far above any the head hands out (it counts up from 0 per replica).
WARMUP_HANDLE_BASE = 0xFFFFFF00
# A decode context beyond this many tokens may take the split-context pass (triton_attention's threshold).
SPLIT_CONTEXT = 1024 + 64


def _new(handle: int, length: int, computed: int, block_size: int, scratch_block: int, sampled: bool):
    """A request of `length` tokens with `computed` already in the cache, every block the scratch block."""
    blocks = -(-(length + 2) // block_size)  # room for the tokens the following warm-up steps append
    sampling = step_pb2.SamplingParams(temperature=0.0)
    if sampled:
        sampling = step_pb2.SamplingParams(temperature=0.8, top_p=0.9, top_k=50)
    return step_pb2.NewRequest(
        handle=handle,
        request_id=f"warmup-{handle - WARMUP_HANDLE_BASE}",
        token_ids=[(7 * i + 3) % 97 + 1 for i in range(length)],
        num_prompt_tokens=length,
        sampling=sampling,
        block_ids=[scratch_block] * blocks,
        num_computed_tokens=computed,
        num_scheduled_tokens=length - computed,
    )


def warmup_steps(block_size: int, scratch_block: int, max_num_tokens: int, max_context: int) -> list:
    """The warm-up's step batches, in order: mixed, decode-only, long-context decode (when it fits), forget all."""
    # Two prefill chunks (one ending mid-block, one after a cached prefix) beside two decodes.
    lengths = [(min(3 * block_size + 3, max_num_tokens // 2), 0), (block_size + 5, block_size), (40, 39), (9, 8)]
    lengths = [(length, computed) for length, computed in lengths if length + 2 <= max_context]
    budget = max_num_tokens
    mixed = []
    for index, (length, computed) in enumerate(lengths):
        if length - computed > budget:
            continue
        budget -= length - computed
        mixed.append(_new(WARMUP_HANDLE_BASE + index, length, computed, block_size, scratch_block, index == 1))
    steps = [step_pb2.StepBatch(step_id=0, new_requests=mixed)]
    # The same requests decode together: a decode-only step of several sequences.
    decodes = [step_pb2.CachedRequest(handle=new.handle, num_scheduled_tokens=1) for new in mixed]
    steps.append(step_pb2.StepBatch(step_id=0, cached_requests=decodes))
    handles = [new.handle for new in mixed]
    if max_context > SPLIT_CONTEXT + 2:
        long_handle = WARMUP_HANDLE_BASE + len(lengths)
        long = _new(long_handle, SPLIT_CONTEXT, SPLIT_CONTEXT - 1, block_size, scratch_block, False)
        steps.append(step_pb2.StepBatch(step_id=0, new_requests=[long]))
        handles.append(long_handle)
    steps.append(step_pb2.StepBatch(step_id=0, finished=handles))
    return steps
