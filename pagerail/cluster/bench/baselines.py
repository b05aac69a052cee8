"""transformers baselines on the same requests: `generate` with static batches, and its continuous batching."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from pagerail.cluster.bench.workload import BenchRequest, throughput

_PAD = 0


def load_hf_model(model_dir: str | Path, dtype: torch.dtype, device: torch.device, attn: str = "sdpa"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, attn_implementation=attn)
    return model.to(device).eval()


@torch.inference_mode()
def run_static_batching(model, requests: list[BenchRequest], batch_size: int) -> dict:
    """Left-padded batches in workload order; each runs until its longest request has its output length.

    Shorter requests in a batch keep computing (their extra tokens are not counted), which is exactly the
    waste static batching pays.
    """
    device = model.device
    model.generate(torch.tensor([[5, 6, 7]], device=device), max_new_tokens=2, do_sample=False, pad_token_id=_PAD)
    produced = 0
    started = time.perf_counter()
    for start in range(0, len(requests), batch_size):
        batch = requests[start : start + batch_size]
        width = max(r.prompt_len for r in batch)
        ids = torch.tensor([[_PAD] * (width - r.prompt_len) + r.prompt_token_ids for r in batch], device=device)
        mask = torch.tensor([[0] * (width - r.prompt_len) + [1] * r.prompt_len for r in batch], device=device)
        longest = max(r.output_len for r in batch)
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=longest,
            min_new_tokens=longest,
            pad_token_id=_PAD,
        )
        if out.shape[1] - width != longest:
            raise RuntimeError(f"generate returned {out.shape[1] - width} new tokens, expected {longest}")
        produced += sum(r.output_len for r in batch)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - started
    return {"batch_size": batch_size, **throughput(requests, seconds, produced, "transformers generate")}


@torch.inference_mode()
def run_continuous_batching(
    model, requests: list[BenchRequest], *, kv_slots: int, max_batch_tokens: int, max_requests: int
) -> dict:
    """transformers' continuous batching manager (paged KV cache), every request queued at once.

    It gets the same KV capacity, token budget and request limit as the engine it is compared with (sized
    from free memory it would claim most of the host); each request carries its own output length and no
    EOS, so lengths are exact.
    """
    from transformers import ContinuousBatchingConfig, GenerationConfig

    config = GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=_PAD, max_new_tokens=1)
    page_size = 256
    batching = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=max(1, kv_slots // page_size),
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_requests,
    )
    # The manager logs every request at INFO; keep the benchmark's own output readable.
    logging.getLogger("transformers").setLevel(logging.WARNING)
    produced = 0
    started = None
    # No warm-up: it captures CUDA graphs, which a CPU run has none of.
    cm = model.continuous_batching_context_manager(
        generation_config=config, continuous_batching_config=batching, block=True, timeout=60, warmup=False
    )
    with cm as manager:
        started = time.perf_counter()
        ids = [
            manager.add_request(r.prompt_token_ids, f"bench-{i}", max_new_tokens=r.output_len, eos_token_id=-1)
            for i, r in enumerate(requests)
        ]
        pending = set(ids)
        while pending:
            result = manager.get_result(timeout=600)
            if result is None:
                raise RuntimeError(f"continuous batching stopped with {len(pending)} requests unfinished")
            if result.is_finished() and result.request_id in pending:
                pending.discard(result.request_id)
                produced += len(result.generated_tokens)
        seconds = time.perf_counter() - started
    return throughput(requests, seconds, produced, "transformers continuous batching")
