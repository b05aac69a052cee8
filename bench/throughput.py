"""Offline throughput of pagerail next to transformers' generate on the same requests, in one run.

Reports output tokens/s for both, the ratio, bytes of the step message per decode step per request,
and KV slot utilisation (live tokens / allocated slots) at the step holding the most blocks.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from cluster import LLM, SamplingParams


def make_workload(num_requests: int, prompt_range, output_range, vocab_size: int, seed: int):
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        prompt = [rng.randrange(100, vocab_size - 100) for _ in range(rng.randint(*prompt_range))]
        requests.append((prompt, rng.randint(*output_range)))
    return requests


def run_pagerail(llm: LLM, requests) -> dict:
    engine = llm.engine
    for i, (prompt, max_tokens) in enumerate(requests):
        engine.add_request(
            f"bench-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        )
    decode_bytes_per_request = []
    execute = engine.executor.execute

    def measured_execute(batch):
        # A pure decode step: every request already known to the workers, one new token each.
        decodes = batch.cached_requests
        if decodes and not batch.new_requests and all(d.num_scheduled_tokens == 1 for d in decodes):
            decode_bytes_per_request.append(batch.ByteSize() / len(decodes))
        return execute(batch)

    engine.executor.execute = measured_execute
    started = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    elapsed = time.perf_counter() - started
    output_tokens = sum(max_tokens for _, max_tokens in requests)
    stats = llm.stats
    return {
        "seconds": elapsed,
        "output_tokens_per_s": output_tokens / elapsed,
        "decode_step_bytes_per_request": statistics.median(decode_bytes_per_request),
        "peak_slot_utilisation": stats.peak_utilisation,
        "peak_used_slots": stats.peak_used_slots,
        "preemptions": stats.num_preemptions,
        "steps": stats.num_steps,
    }


def run_transformers(model_dir, requests, batch_size: int) -> dict:
    """Static batching: left-padded batches, each run to its longest requested output."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    started = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(requests), batch_size):
            batch = requests[start : start + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch])
            longest = max(m for _, m in batch)
            model.generate(
                ids,
                attention_mask=mask,
                do_sample=False,
                max_new_tokens=longest,
                min_new_tokens=longest,
                pad_token_id=0,
            )
    elapsed = time.perf_counter() - started
    output_tokens = sum(max_tokens for _, max_tokens in requests)
    return {"seconds": elapsed, "output_tokens_per_s": output_tokens / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(32, 256))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 128))
    parser.add_argument("--hf-batch-sizes", type=int, nargs="+", default=(8, 64), help="static batch sizes to try")
    parser.add_argument("--max-num-batched-tokens", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()

    llm = LLM(args.model, max_num_batched_tokens=args.max_num_batched_tokens)
    requests = make_workload(args.num_requests, args.prompt_len, args.output_len, llm.engine.vocab_size, args.seed)
    llm.generate([requests[0][0]], SamplingParams(max_tokens=4))  # warm-up
    ours = run_pagerail(llm, requests)
    baselines = {size: run_transformers(llm.model_dir, requests, size) for size in args.hf_batch_sizes}
    best = max(baselines.values(), key=lambda r: r["output_tokens_per_s"])
    report = {
        "workload": vars(args),
        "pagerail": ours,
        "transformers_generate": {f"batch_{size}": result for size, result in baselines.items()},
        # Against the fastest static batch size, so the ratio is not flattered by a poor baseline choice.
        "throughput_ratio": ours["output_tokens_per_s"] / best["output_tokens_per_s"],
    }
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print(f"requests: {args.num_requests}, prompts {args.prompt_len}, outputs {args.output_len}")
    print(f"{'pagerail':<20} {ours['output_tokens_per_s']:9.1f} output tok/s  ({ours['seconds']:.1f} s)")
    for size, result in baselines.items():
        label = f"transformers b={size}"
        print(f"{label:<20} {result['output_tokens_per_s']:9.1f} output tok/s  ({result['seconds']:.1f} s)")
    print(f"ratio vs best transformers {report['throughput_ratio']:9.2f}x")
    print(f"step message         {ours['decode_step_bytes_per_request']:9.1f} bytes per decode step per request")
    print(f"KV slots             {100 * ours['peak_slot_utilisation']:9.1f}% used by live tokens at peak")


if __name__ == "__main__":
    main()
