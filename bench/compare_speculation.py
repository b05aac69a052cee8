"""Speculative decoding on against off, in one process: offline output tokens/s of `LLM.generate` on a copy-heavy
chat workload (the model repeats or edits a text it was given), at batch 1 and at many concurrent requests, with
the acceptance figures (the embedded SmolLM2-135M-Instruct by default, fp32 on the CPU).

The engines run alternately (off, on, off, on, ...) on the same prompts, greedy, after an untimed warm-up each,
and their outputs are compared token by token.

Usage:
  .venv/bin/python bench/compare_speculation.py                       # n-gram, k=5, batches 1 and 32
  .venv/bin/python bench/compare_speculation.py --k 4 --batches 1 8 32 --rounds 3 --json
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

TEXTS = (
    "The committee met on Tuesday to review the budget for the new library. After a long discussion, the members "
    "agreed to fund the children's reading room, extend the opening hours on weekends, and replace the old "
    "computers in the study hall. The chair thanked the volunteers for their work.",
    "To reset the router, unplug it for thirty seconds, plug it back in, and wait until the power light turns "
    "green. Then open the settings page, choose the wireless tab, and enter the network name and password "
    "printed on the label under the device.",
    "Our team shipped the new search feature last week. Queries now return results twice as fast, typos are "
    "corrected automatically, and users can filter by date and author. Next month we will add saved searches "
    "and email alerts for new matches.",
)
TASKS = ("Copy this text exactly, word for word:", "Repeat the following text, changing nothing:")
# Open questions: little of the answer repeats the prompt, so lookups find little (the back-off's case).
QUESTIONS = (
    "Why do cats purr?", "How do airplanes stay in the air?", "What makes a good breakfast?",
    "Describe a rainy day in the city.", "What is the history of the bicycle?", "How do plants grow?",
)  # fmt: skip
WORKLOAD = {"workload": "copy"}


def prompts(llm: LLM, count: int) -> list[str]:
    """Copy-heavy chat prompts: each asks for one of TEXTS back, as editing and summarising often do (or, with
    --workload questions, open questions)."""
    out = []
    for i in range(count):
        if WORKLOAD["workload"] == "questions":
            message = QUESTIONS[i % len(QUESTIONS)]
        else:
            message = f"{TASKS[i % len(TASKS)]}\n\n{TEXTS[i % len(TEXTS)]}"
        chat = [{"role": "user", "content": message}]
        out.append(llm.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    return out


def _totals(policy) -> tuple[int, int, int]:
    return policy.num_drafts, policy.num_draft_tokens, policy.num_accepted_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model dir (default: the embedded model)")
    parser.add_argument("--k", type=int, default=5, help="num_speculative_tokens")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workload", choices=("copy", "questions"), default="copy")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    WORKLOAD["workload"] = args.workload

    speculative = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4}
    engines = {
        "off": LLM(args.model, num_gpu_blocks=4096, max_num_seqs=64),
        "ngram": LLM(args.model, num_gpu_blocks=4096, max_num_seqs=64, speculative_config=speculative),
    }
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    report: dict = {"speculative_config": speculative, "workload": args.workload, "batches": {}}
    for llm in engines.values():
        llm.generate(prompts(llm, 2), SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
    for batch in args.batches:
        row: dict = {name: {"tok_per_s": []} for name in engines}
        outputs = {}
        for _ in range(args.rounds):
            for name, llm in engines.items():
                policy = llm.engine.speculation
                before = _totals(policy)
                started = time.perf_counter()
                results = llm.generate(prompts(llm, batch), params)
                seconds = time.perf_counter() - started
                outputs[name] = [list(r.outputs[0].token_ids) for r in results]
                row[name]["tok_per_s"].append(round(sum(map(len, outputs[name])) / seconds, 1))
                if policy.enabled:
                    drafts, draft_tokens, kept = (now - then for now, then in zip(_totals(policy), before, strict=True))
                    row[name]["acceptance_rate"] = round(kept / draft_tokens, 3) if draft_tokens else 0.0
                    row[name]["mean_acceptance_length"] = round(1 + kept / drafts, 2) if drafts else 0.0
                    row[name]["backoff_steps"] = policy.num_backoff_steps
        row["speedup"] = round(max(row["ngram"]["tok_per_s"]) / max(row["off"]["tok_per_s"]), 2)
        row["identical"] = sum(a == b for a, b in zip(outputs["ngram"], outputs["off"], strict=True))
        row["requests"] = batch
        report["batches"][str(batch)] = row
    for llm in engines.values():
        llm.shutdown()
    if args.json:
        print(json.dumps(report))
        return
    for batch, row in report["batches"].items():
        ngram = row["ngram"]
        print(
            f"batch {batch:>3}: off {row['off']['tok_per_s']} tok/s, ngram {ngram['tok_per_s']} tok/s, "
            f"{row['speedup']}x; acceptance {ngram.get('acceptance_rate')}, mean acceptance length "
            f"{ngram.get('mean_acceptance_length')}, identical {row['identical']}/{row['requests']}"
        )


if __name__ == "__main__":
    main()
