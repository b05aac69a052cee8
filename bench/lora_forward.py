"""LoRA against the base model in one process (`LLM.generate`, no server in between): the forward pass's cost of
serving adapters, which a served benchmark hides behind its frontend. The same requests (request i for adapter
i mod N) alternate with the base model's for --rounds rounds; the table gives each kind's median tokens/s and the
per-round ratios. PAGERAIL_CPU_LORA=torch runs the grouped torch path instead of the native kernel.

    .venv/bin/python bench/lora_forward.py --rounds 12
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from pagerail import LLM, LoRARequest, SamplingParams
from pagerail.cluster.bench.tiny_llama import write_tiny_llama
from pagerail.cluster.bench.tiny_lora import write_adapter


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--out", type=Path, default=Path("bench-results/lora-forward"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = write_tiny_llama(args.out / "tiny-llama")
    adapters = [
        write_adapter(args.out / f"adapter-{i}", model, args.rank, seed=i + 1) for i in range(args.num_adapters)
    ]
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 1000) for _ in range(args.prompt_tokens)] for _ in range(args.num_requests)]
    loras = [LoRARequest(f"adapter-{i % len(adapters)}", i % len(adapters) + 1, str(adapters[i % len(adapters)]))
             for i in range(args.num_requests)]  # fmt: skip
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rates: dict[str, list[float]] = {"base": [], "lora": []}
    with LLM(str(model), enable_lora=True, max_loras=len(adapters), max_lora_rank=args.rank, dtype="float32") as llm:
        llm.generate(prompts, params, lora_request=loras)  # warm-up: every adapter read and in its slot
        llm.generate(prompts, params)
        for _ in range(args.rounds):
            for kind, lora in (("base", None), ("lora", loras)):
                started = time.perf_counter()
                outputs = llm.generate(prompts, params, lora_request=lora)
                tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
                rates[kind].append(tokens / (time.perf_counter() - started))
    base, lora = statistics.median(rates["base"]), statistics.median(rates["lora"])
    ratios = [f"{a / b:.2f}" for a, b in zip(rates["lora"], rates["base"], strict=True)]
    print(f"base {base:,.0f} tok/s, LoRA {lora:,.0f} tok/s (medians of {args.rounds} rounds)")
    print(f"LoRA / base {lora / base:.3f}")
    print("per round:", " ".join(ratios))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
