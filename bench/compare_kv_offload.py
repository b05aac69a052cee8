"""The host KV tier on against off, in one process: a multi-turn chat workload whose working set is several times
the device KV cache. Each turn sends every conversation's whole history (the previous prompt, the model's answer
and a new user message) at once; between a conversation's turns the others push its blocks out of the device
cache. Reported per engine: prompt tokens served from cache (device and host tier), time to first token (p50 and
p90 over every turn's requests), output tokens/s, the tier's copies, and whether the greedy outputs are identical.

Models: `small`, a random Llama of 4 layers (hidden 256, vocab 4096, 4096 positions); `embedded`, the embedded
SmolLM2-135M-Instruct (fp32 on the CPU). Token ids are random, so no tokenizer is involved.

Usage:
  .venv/bin/python bench/compare_kv_offload.py                    # both models, 32 conversations x 6 turns
  .venv/bin/python bench/compare_kv_offload.py --model small --conversations 16 --turns 4 --json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagerail import LLM  # noqa: E402
from pagerail.common.sampling_params import SamplingParams  # noqa: E402


def small_llama(root: Path) -> Path:
    from transformers import LlamaConfig

    from pagerail.cluster.bench.random_checkpoints import save_random_weights

    config = LlamaConfig(
        vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=4, max_position_embeddings=4096, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2,
    )  # fmt: skip
    return save_random_weights(config, root / "small-llama", 0, scale=0.05)


def kv_bytes_per_token(model_dir: Path) -> int:
    from pagerail.worker.model_loader import load_hf_config

    config = load_hf_config(model_dir)
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return config.num_hidden_layers * 2 * heads * head_dim * 4  # fp32


class _Recorder:
    """Stands in for the TTFT histogram's child: keeps each observation and passes it on."""

    def __init__(self, child, values: list[float]) -> None:
        self.child, self.values = child, values

    def observe(self, value: float) -> None:
        self.values.append(value)
        self.child.observe(value)


class Workload:
    """Conversations of random tokens: a first message of about `first` tokens, then `user` tokens per turn."""

    def __init__(self, conversations: int, turns: int, first: int, user: int, max_tokens: int, vocab: int) -> None:
        self.rng = random.Random(0)
        self.turns, self.user, self.vocab = turns, user, vocab
        self.first = [self._tokens(first // 2 + self.rng.randrange(first)) for _ in range(conversations)]
        self.params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        # The most tokens the histories reach: the working set the caches compete for.
        self.working_set = sum(len(f) + turns * (user + max_tokens) for f in self.first)

    def _tokens(self, count: int) -> list[int]:
        return [self.rng.randrange(100, self.vocab - 100) for _ in range(count)]

    def run(self, llm: LLM) -> dict:
        self.rng = random.Random(1)  # the same user messages for every engine
        ttfts: list[float] = []
        metrics = llm.engine.metrics
        metrics._ttft = _Recorder(metrics._ttft, ttfts)  # every request's time to first token, unbucketed
        histories = [list(f) for f in self.first]
        outputs, generated = [], 0
        started = time.perf_counter()
        for _ in range(self.turns):
            results = llm.generate(histories, self.params)
            for history, result in zip(histories, results, strict=True):
                tokens = list(result.outputs[0].token_ids)
                outputs.append(tokens)
                generated += len(tokens)
                history.extend(tokens + self._tokens(self.user))
        seconds = time.perf_counter() - started
        stats, tier = llm.engine.scheduler.stats, llm.engine.block_table.host_tier
        ttfts.sort()
        return {
            "outputs": outputs,
            "prompt_tokens": stats.num_prefix_query_tokens,
            "cached_tokens": stats.num_prefix_hit_tokens + stats.num_host_hit_tokens,
            "device_hit_tokens": stats.num_prefix_hit_tokens,
            "host_hit_tokens": stats.num_host_hit_tokens,
            "ttft_p50_s": round(statistics.median(ttfts), 4),
            "ttft_p90_s": round(ttfts[int(0.9 * (len(ttfts) - 1))], 4),
            "output_tok_per_s": round(generated / seconds, 1),
            "seconds": round(seconds, 1),
            "offloaded_blocks": tier.num_offloaded if tier else 0,
            "loaded_blocks": tier.num_loaded if tier else 0,
        }


def compare(name: str, model_dir: Path, args: argparse.Namespace) -> dict:
    from pagerail.worker.model_loader import load_hf_config

    vocab = load_hf_config(model_dir).vocab_size
    workload = Workload(args.conversations, args.turns, args.first_tokens, args.user_tokens, args.max_tokens, vocab)
    device_blocks = -(-workload.working_set // (args.ratio * args.block_size))
    # Room on the host for the whole working set and a quarter more.
    host_bytes = int(1.25 * workload.working_set * kv_bytes_per_token(model_dir))
    report = {
        "model": name,
        "working_set_tokens": workload.working_set,
        "device_cache_tokens": device_blocks * args.block_size,
        "kv_offload_bytes": host_bytes,
    }
    runs = {}
    for engine, extra in (("off", {}), ("host_tier", {"kv_offload_bytes": host_bytes})):
        llm = LLM(str(model_dir), block_size=args.block_size, num_gpu_blocks=device_blocks, **extra)
        llm.generate([[5] * 40], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))  # warm-up
        runs[engine] = workload.run(llm)
        llm.shutdown()
    off, on = runs["off"], runs["host_tier"]
    report["identical"] = sum(a == b for a, b in zip(off.pop("outputs"), on.pop("outputs"), strict=True))
    report["requests"] = args.conversations * args.turns
    report.update(off=off, host_tier=on)
    report["cached_tokens_ratio"] = round(on["cached_tokens"] / max(off["cached_tokens"], 1), 2)
    report["ttft_p50_ratio"] = round(on["ttft_p50_s"] / off["ttft_p50_s"], 3)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("small", "embedded", "both"), default="both")
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--first-tokens", type=int, default=1000, help="first messages: half to 1.5x this many")
    parser.add_argument("--user-tokens", type=int, default=120)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--ratio", type=int, default=4, help="working set / device KV cache")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    models = []
    if args.model in ("small", "both"):
        models.append(("small-random-llama", small_llama(Path(tempfile.mkdtemp(prefix="pagerail-offload-")))))
    if args.model in ("embedded", "both"):
        from pagerail.common.model_source import resolve_model_dir

        models.append(("smollm2-135m-instruct", resolve_model_dir(None)))
    reports = [compare(name, model_dir, args) for name, model_dir in models]
    if args.json:
        print(json.dumps(reports))
        return
    for report in reports:
        print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
