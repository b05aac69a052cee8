"""pagerail next to vLLM offline on a mixture-of-experts model: output tokens/s of `LLM.generate` on one tiny random
Qwen3-MoE (default: 8 layers, 32 experts, top-8, hidden 512), the same token-id prompts, ignore_eos, greedy.

Both engines load the same checkpoint directory and run fp32 on the CPU. vLLM runs from its own interpreter
(--vllm-python or $VLLM_PYTHON), in a child process, and is never imported here. Each engine first runs a short
warm-up batch, untimed; the timed runs alternate pagerail, vLLM, pagerail, vLLM.

Usage:
  VLLM_PYTHON=/path/to/vllm-venv/bin/python .venv/bin/python bench/compare_vllm_moe.py
  .venv/bin/python bench/compare_vllm_moe.py --engines pagerail --num-prompts 8
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ENGINES = ("pagerail", "vllm")

# Marks the vLLM child's result lines among its logs.
_RESULT = "@@result "
# The vLLM side, run by the other interpreter: one JSON line per timed round.
_VLLM_SCRIPT = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

RESULT = "@@result "  # vLLM logs to stdout too: results are the lines that start with this


def main():
    spec = json.loads(sys.argv[1])
    llm = LLM(spec["model"], dtype="float32", max_model_len=spec["max_model_len"], seed=0,
              max_num_batched_tokens=spec["token_budget"], max_num_seqs=spec["max_num_seqs"])
    params = SamplingParams(temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in spec["prompts"]]
    llm.generate(prompts[:4], params, use_tqdm=False)
    for _ in range(spec["rounds"]):
        sys.stdin.readline()  # the parent says when this round may start
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
        tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
        print(RESULT + json.dumps({"seconds": elapsed, "tokens": tokens}), flush=True)

if __name__ == "__main__":
    main()
"""


def write_qwen3_moe(path: Path, args: argparse.Namespace) -> Path:
    """A seeded random Qwen3-MoE checkpoint with the embedded SmolLM2 tokenizer cut to its vocabulary."""
    from transformers import Qwen3MoeConfig

    from pagerail.cluster.bench.random_checkpoints import save_random_weights
    from pagerail.cluster.bench.tiny_llama import trim_tokenizer
    from pagerail.common.model_source import resolve_model_dir

    if (path / "config.json").exists():
        return path
    config = Qwen3MoeConfig(
        vocab_size=1024,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=args.hidden_size // 8,
        intermediate_size=args.hidden_size * 2,
        moe_intermediate_size=args.moe_intermediate_size,
        num_experts=args.num_experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    )
    save_random_weights(config, path, seed=0, scale=0.02)
    trim_tokenizer(resolve_model_dir(None), path, config.vocab_size)
    return path


def workload(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(300, 1024) for _ in range(rng.randint(*args.prompt_len))] for _ in range(args.num_prompts)]


def pagerail_rounds(model: Path, prompts: list[list[int]], args: argparse.Namespace):
    """Yields (seconds, output tokens) for each timed round of pagerail's offline `LLM.generate`."""
    from pagerail import LLM, SamplingParams

    llm = LLM(
        str(model),
        dtype="float32",
        device="cpu",
        max_model_len=args.max_model_len,
        max_num_batched_tokens=args.token_budget,
        max_num_seqs=args.max_num_seqs,
    )
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:4], params)
    try:
        while True:
            started = time.perf_counter()
            outputs = llm.generate(prompts, params)
            elapsed = time.perf_counter() - started
            yield elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)
    finally:
        llm.shutdown()


def vllm_rounds(model: Path, prompts: list[list[int]], args: argparse.Namespace):
    spec = {
        "model": str(model),
        "prompts": prompts,
        "output_len": args.output_len,
        "max_model_len": args.max_model_len,
        "token_budget": args.token_budget,
        "max_num_seqs": args.max_num_seqs,
        "rounds": args.rounds,
    }
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "4")}
    child = subprocess.Popen(
        [args.vllm_python, "-c", _VLLM_SCRIPT, json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        for _ in range(args.rounds):
            child.stdin.write("go\n")
            child.stdin.flush()
            line = ""
            while not line.startswith(_RESULT):
                line = child.stdout.readline()
                if not line:
                    raise RuntimeError(f"vLLM exited with {child.wait()}")
            result = json.loads(line[len(_RESULT) :])
            yield result["seconds"], result["tokens"]
    finally:
        child.stdin.close()
        child.wait(timeout=120)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"))
    parser.add_argument("--out", type=Path, default=Path("/tmp/pagerail-moe-bench"))
    parser.add_argument("--num-layers", type=int, default=8)
    parser.add_argument("--num-experts", type=int, default=32)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=512)
    parser.add_argument("--moe-intermediate-size", type=int, default=256)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, nargs=2, default=(64, 256))
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--token-budget", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    args = parser.parse_args(argv)
    if "vllm" in args.engines and not args.vllm_python:
        parser.error("vllm needs --vllm-python or $VLLM_PYTHON (a separate environment with vllm-cpu)")
    model = write_qwen3_moe(args.out / "qwen3-moe", args)
    prompts = workload(args)
    # Both engines are started before the first timed round; their rounds then alternate.
    runs = {}
    if "vllm" in args.engines:
        runs["vllm"] = vllm_rounds(model, prompts, args)
    if "pagerail" in args.engines:
        runs["pagerail"] = pagerail_rounds(model, prompts, args)
    results: dict[str, list[float]] = {engine: [] for engine in runs}
    for round_index in range(args.rounds):
        for engine in ("pagerail", "vllm"):
            if engine in runs:
                seconds, tokens = next(runs[engine])
                results[engine].append(tokens / seconds)
                print(f"round {round_index + 1} {engine}: {tokens} output tokens in {seconds:.2f} s = "
                      f"{tokens / seconds:.1f} tok/s", flush=True)  # fmt: skip
    for run in runs.values():
        run.close()
    summary = {engine: max(values) for engine, values in results.items()}
    if len(summary) == 2:
        summary["ratio_pagerail_over_vllm"] = summary["pagerail"] / summary["vllm"]
    print(json.dumps({"best_output_tok_per_s": summary, "rounds": results}))


if __name__ == "__main__":
    sys.exit(main())
