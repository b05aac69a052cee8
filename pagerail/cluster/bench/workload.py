"""Benchmark requests: random token prompts with length ranges and a seed (optionally behind shared prefixes), or
prompts read from a file."""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class BenchRequest:
    """One request: its prompt as token ids (and text when it came from a file) and its exact output length."""

    prompt_token_ids: list[int]
    output_len: int
    prompt_text: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def _check_range(name: str, bounds: tuple[int, int]) -> tuple[int, int]:
    low, high = bounds
    if low < 1 or high < low:
        raise ValueError(f"{name} must be two integers 1 <= min <= max, got {low} {high}")
    return low, high


def random_workload(
    num_requests: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
) -> list[BenchRequest]:
    """Uniform lengths in the inclusive ranges; token ids avoid the lowest and highest ids, where specials live."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    prompt_len = _check_range("prompt_len", prompt_len)
    output_len = _check_range("output_len", output_len)
    margin = min(100, vocab_size // 4)
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        length = rng.randint(*prompt_len)
        prompt = [rng.randrange(margin, vocab_size - margin) for _ in range(length)]
        requests.append(BenchRequest(prompt, rng.randint(*output_len)))
    return requests


def shared_prefix_workload(
    num_requests: int,
    num_prefixes: int,
    prefix_len: int,
    prompt_len: tuple[int, int],
    output_len: tuple[int, int],
    vocab_size: int,
    seed: int = 0,
) -> list[BenchRequest]:
    """Requests that share long prefixes, as users of a few system prompts do: each prefix starts the same number
    of requests (give or take one), in a seeded random order so that they interleave without a period a
    round-robin balancer could fall in step with; each request then has its own random part of `prompt_len`."""
    if num_prefixes < 1 or prefix_len < 1:
        raise ValueError(f"--shared-prefix needs NUM >= 1 and LEN >= 1, got {num_prefixes} {prefix_len}")
    rng = random.Random(seed)
    margin = min(100, vocab_size // 4)
    prefixes = [[rng.randrange(margin, vocab_size - margin) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    order = [i % num_prefixes for i in range(num_requests)]
    rng.shuffle(order)
    own = random_workload(num_requests, prompt_len, output_len, vocab_size, seed + 1)
    return [
        BenchRequest(prefixes[which] + request.prompt_token_ids, request.output_len)
        for which, request in zip(order, own, strict=True)
    ]


def file_workload(path: str | Path, tokenizer: Any, output_len: tuple[int, int], seed: int = 0) -> list[BenchRequest]:
    """Prompts from a file: JSON lines with "prompt" (and optional "output_len"), or one plain-text prompt per line.

    Output lengths missing from the file are drawn from `output_len` with `seed`.
    """
    output_len = _check_range("output_len", output_len)
    rng = random.Random(seed)
    requests = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        fixed = None
        if line.lstrip().startswith("{"):
            record = json.loads(line)
            if not isinstance(record.get("prompt"), str):
                raise ValueError(f"{path}:{number}: each JSON line needs a string 'prompt'")
            text, fixed = record["prompt"], record.get("output_len")
            if fixed is not None and (not isinstance(fixed, int) or fixed < 1):
                raise ValueError(f"{path}:{number}: output_len must be an integer >= 1, got {fixed!r}")
        else:
            text = line
        ids = tokenizer.encode(text, add_special_tokens=False)
        if not ids:
            raise ValueError(f"{path}:{number}: the prompt encodes to no tokens")
        requests.append(BenchRequest(list(ids), fixed or rng.randint(*output_len), prompt_text=text))
    if not requests:
        raise ValueError(f"{path} holds no prompts")
    return requests


def throughput(requests: list[BenchRequest], seconds: float, produced: int, who: str) -> dict[str, float]:
    """Token and request rates of one run, after checking it produced exactly the workload's output tokens."""
    output = sum(r.output_len for r in requests)
    if produced != output:
        raise RuntimeError(f"{who} produced {produced} output tokens, the workload asks for {output}")
    prompt = sum(r.prompt_len for r in requests)
    return {
        "seconds": seconds,
        "output_tokens_per_s": output / seconds,
        "total_tokens_per_s": (prompt + output) / seconds,
        "request_throughput": len(requests) / seconds,
    }


def describe(requests: list[BenchRequest]) -> dict[str, int]:
    """Totals that every report states next to its figures."""
    return {
        "num_requests": len(requests),
        "prompt_tokens": sum(r.prompt_len for r in requests),
        "output_tokens": sum(r.output_len for r in requests),
    }


def add_request_arguments(parser: argparse.ArgumentParser) -> None:
    """The workload options every bench command shares."""
    workload = parser.add_argument_group("workload")
    workload.add_argument("--num-requests", type=int, default=64, help="requests in the workload (default 64)")
    workload.add_argument(
        "--prompt-len", type=int, nargs=2, default=(32, 512), metavar=("MIN", "MAX"), help="random prompt lengths"
    )
    workload.add_argument(
        "--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"), help="output lengths"
    )
    workload.add_argument("--seed", type=int, default=0, help="seed for lengths, token ids and arrival gaps")
    workload.add_argument(
        "--dataset", default=None, metavar="FILE", help="prompts file (JSON lines with 'prompt', or one per line)"
    )
    workload.add_argument(
        "--shared-prefix",
        type=int,
        nargs=2,
        default=None,
        metavar=("NUM", "LEN"),
        help="random prompts start with one of NUM shared prefixes of LEN tokens, interleaved (system prompts)",
    )
    workload.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer dir or hub id for --dataset and the vocabulary size (default: the embedded model's tokenizer)",
    )
    workload.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="token ids for random prompts are drawn below this (default: the size of the tokenizer)",
    )


def build_workload(args: argparse.Namespace, tokenizer: Any = None) -> list[BenchRequest]:
    """The request list the arguments describe: prompts from --dataset, else random token prompts.

    `tokenizer` is used when --tokenizer is not given (the offline engine passes its own).
    """
    if args.tokenizer is not None or tokenizer is None:
        tokenizer = _load_tokenizer(args.tokenizer) if (args.dataset or not args.vocab_size) else None
    if args.dataset:
        return file_workload(args.dataset, tokenizer, tuple(args.output_len), args.seed)
    vocab_size = args.vocab_size or len(tokenizer)
    if getattr(args, "shared_prefix", None):
        num_prefixes, prefix_len = args.shared_prefix
        return shared_prefix_workload(
            args.num_requests,
            num_prefixes,
            prefix_len,
            tuple(args.prompt_len),
            tuple(args.output_len),
            vocab_size,
            args.seed,
        )
    return random_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), vocab_size, args.seed)


def _load_tokenizer(name: str | None) -> Any:
    from transformers import AutoTokenizer

    if name is None:
        from pagerail.common.model_source import resolve_model_dir

        name = str(resolve_model_dir(None))
    return AutoTokenizer.from_pretrained(name)
