"""Weight quantization on load against the unquantized model, in one process: bytes of weights, greedy agreement,
and offline output tokens/s of `LLM.generate` (the embedded SmolLM2-135M-Instruct by default, fp32 on the CPU).

The two engines run alternately (unquantized, quantized, unquantized, ...) on the same chat prompts, greedy,
after one untimed warm-up batch each.

Usage:
  .venv/bin/python bench/compare_quantization.py                       # --quantization fp8
  .venv/bin/python bench/compare_quantization.py --rounds 3 --max-tokens 64 --json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagerail import LLM  # noqa: E402
from pagerail.common.sampling_params import SamplingParams  # noqa: E402
from pagerail.worker.layers.quantization.summary import weight_bytes, weight_format  # noqa: E402

TOPICS = (
    "the water cycle",
    "how a bicycle gear works",
    "why the sky is blue",
    "the history of paper",
    "how vaccines train the immune system",
    "what a compiler does",
    "the rules of chess",
    "how bees make honey",
    "photosynthesis",
    "how a refrigerator keeps food cold",
    "the causes of tides",
    "what inflation means",
    "how airplanes stay in the air",
    "the life of a star",
    "how the internet routes a message",
    "why leaves fall",
)


def prompts(llm: LLM, count: int) -> list[str]:
    texts = [f"Explain {TOPICS[i % len(TOPICS)]} to a ten-year-old in a short paragraph." for i in range(count)]
    return [
        llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        for text in texts
    ]


def run(llm: LLM, batch: list[str], params: SamplingParams) -> tuple[list[list[int]], float, int]:
    started = time.perf_counter()
    outputs = llm.generate(batch, params)
    elapsed = time.perf_counter() - started
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    return tokens, elapsed, sum(map(len, tokens))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model dir (default: the embedded model)")
    parser.add_argument("--quantization", default="fp8")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", action="store_true", help="one JSON object instead of the table")
    args = parser.parse_args()

    engines = {
        "unquantized": LLM(args.model, num_gpu_blocks=1024),
        args.quantization: LLM(args.model, quantization=args.quantization, num_gpu_blocks=1024),
    }
    batch = prompts(engines["unquantized"], args.num_prompts)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    report: dict = {"quantization": args.quantization, "engines": {}}
    outputs = {}
    for name, llm in engines.items():
        model = llm.engine.executor.worker.model
        report["engines"][name] = {"weight_format": weight_format(model), "weight_bytes": weight_bytes(model)}
        run(llm, batch[:4], params)  # warm-up: CPU matmul choices, first-step allocations
    for _ in range(args.rounds):
        for name, llm in engines.items():
            tokens, seconds, count = run(llm, batch, params)
            outputs[name] = tokens
            report["engines"][name].setdefault("tok_per_s", []).append(round(count / seconds, 1))
    base, quantized = outputs["unquantized"], outputs[args.quantization]
    divergence = []
    for ours, theirs in zip(quantized, base, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=False)) if a != b), None)
        if first is None and len(ours) != len(theirs):
            first = min(len(ours), len(theirs))
        divergence.append(first)
    report["identical"] = sum(first is None for first in divergence)
    report["prompts"] = len(divergence)
    report["first_divergence"] = divergence
    for llm in engines.values():
        llm.shutdown()
    if args.json:
        print(json.dumps(report))
        return
    for name, row in report["engines"].items():
        print(f"{name:12s} {row['weight_format']:32s} {row['weight_bytes'] / 2**20:8.1f} MiB  tok/s {row['tok_per_s']}")
    print(
        f"greedy outputs identical on {report['identical']}/{report['prompts']} prompts; first divergence: {divergence}"
    )


if __name__ == "__main__":
    main()
