"""Compares pagerail's greedy tokens with transformers' generate under the top-5 divergence rule."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM

from pagerail import LLM, SamplingParams

TOP = 5


@dataclass
class ParityReport:
    identical: int
    total: int
    divergences: list[str]


def reference_greedy(model_dir, prompts: list[list[int]], max_new_tokens: int) -> list[tuple[list[int], list]]:
    """transformers' greedy continuation of each prompt, with the top-5 ids at every step."""
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    # Run to exactly max_new_tokens without masking EOS (min_new_tokens would change the distribution),
    # matching the engine's ignore_eos.
    model.generation_config.eos_token_id = None
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            tokens = out.sequences[0, len(prompt) :].tolist()
            tops = [set(score[0].topk(TOP).indices.tolist()) for score in out.scores]
            results.append((tokens, tops))
    return results


def engine_greedy(llm: LLM, prompts: list[list[int]], max_new_tokens: int) -> list[tuple[list[int], list]]:
    """pagerail's greedy continuation, all prompts submitted at once, with top-5 logprobs."""
    params = SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True, logprobs=TOP)
    outputs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, [set(lp) for lp in o.outputs[0].logprobs]) for o in outputs]


def compare(ours: list[tuple[list[int], list]], theirs: list[tuple[list[int], list]]) -> ParityReport:
    """Identical, or at the first divergence each side's token is in the other's top-5."""
    identical, divergences = 0, []
    for index, ((our_tokens, our_tops), (ref_tokens, ref_tops)) in enumerate(zip(ours, theirs, strict=True)):
        if our_tokens == ref_tokens:
            identical += 1
            continue
        step = next(i for i, (a, b) in enumerate(zip(our_tokens, ref_tokens, strict=True)) if a != b)
        ok = our_tokens[step] in ref_tops[step] and ref_tokens[step] in our_tops[step]
        divergences.append(f"prompt {index} diverges at step {step}: within top-{TOP}={ok}")
        if not ok:
            raise AssertionError(divergences[-1])
    return ParityReport(identical, len(ours), divergences)
