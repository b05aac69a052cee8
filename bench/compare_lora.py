"""Multi-LoRA serving throughput, pagerail next to vLLM's CPU build, on the same model, adapters and requests, in one
invocation; and pagerail's own base-model throughput on the same requests.

Both servers load the same small random Llama (cluster/bench/tiny_llama.py) and the same `--num-adapters` random
PEFT adapters (cluster/bench/tiny_lora.py, rank `--rank` on q/k/v/o and gate/up/down), served by name with vLLM's
flags (`--enable-lora --max-loras N --max-lora-rank R --lora-modules name=path ...`). One client sends
`--num-requests` completions at once, request i naming adapter i mod N, each `--max-tokens` tokens with EOS
ignored, and counts output tokens per second; then pagerail serves the same requests for the base model (the
`base` row). With --rounds K the servers alternate K times and the table gives each round and the median ratios.
As a check that both apply the adapters alike, the greedy texts of each adapter's first request are compared
(fp32 on both sides: equal but for near-ties) and must differ from the base model's.

    VLLM_PYTHON=/path/to/vllm-venv/bin/python .venv/bin/python bench/compare_lora.py --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

from pagerail.cluster.bench.server_process import ServerProcess, free_port, pagerail_serve_command
from pagerail.cluster.bench.stats import format_table
from pagerail.cluster.bench.tiny_llama import write_tiny_llama
from pagerail.cluster.bench.tiny_lora import write_adapter
from pagerail.common import event_loops

SERVERS = ("pagerail", "vllm")


def server_command(server: str, model: Path, adapters: list[Path], port: int, args: argparse.Namespace) -> list[str]:
    lora = ["--enable-lora", "--max-loras", str(len(adapters)), "--max-lora-rank", str(args.rank)]
    lora += ["--lora-modules", *(f"adapter-{i}={path}" for i, path in enumerate(adapters))]
    if server == "pagerail":
        kv_bytes = str(int(args.kv_cache_gib * (1 << 30)))
        flags = ["--served-model-name", "base", "--device", "cpu", "--dtype", "float32", *lora]
        return pagerail_serve_command(sys.executable, model, port, *flags, "--kv-cache-memory-bytes", kv_bytes)
    command = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    command += ["--served-model-name", "base", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port)]
    return [*command, "--max-model-len", "4096", "--disable-log-stats", *lora]


def prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [[rng.randrange(100, 1000) for _ in range(args.prompt_tokens)] for _ in range(args.num_requests)]


async def drive(
    base_url: str, requests: list[list[int]], models: list[str], max_tokens: int
) -> tuple[float, list[str]]:
    """Output tokens per second of the requests, all sent at once (request i asks for models[i]), and the texts."""
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:

        async def one(prompt: list[int], model: str) -> tuple[int, str]:
            body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            response = await client.post("/v1/completions", json=body)
            response.raise_for_status()
            answer = response.json()
            return answer["usage"]["completion_tokens"], answer["choices"][0]["text"]

        await asyncio.gather(*(one(p, m) for p, m in zip(requests[:4], models[:4], strict=True)))  # warm-up
        started = time.perf_counter()
        answers = await asyncio.gather(*(one(p, m) for p, m in zip(requests, models, strict=True)))
        elapsed = time.perf_counter() - started
        return sum(tokens for tokens, _ in answers) / elapsed, [text for _, text in answers]


def run_one(server: str, model: Path, adapters: list[Path], args: argparse.Namespace, tag: str) -> dict[str, tuple]:
    """(tokens/s, texts) with adapters (and, on pagerail, for the base model) in one server start."""
    port = free_port()
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if server == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{args.kv_cache_gib:g}"
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "0"
    logs = args.out / f"{server}-{tag}.log"
    print(f"== {server} round {tag} (server log {logs})", flush=True)
    requests = prompts(args)
    names = [f"adapter-{i % len(adapters)}" for i in range(len(requests))]
    base_url = f"http://127.0.0.1:{port}"
    with ServerProcess(
        server_command(server, model, adapters, port, args), base_url, logs, ready_timeout_s=1200, env=env
    ):
        results = {"lora": event_loops.run(drive(base_url, requests, names, args.max_tokens))}
        if server == "pagerail":
            results["base"] = event_loops.run(drive(base_url, requests, ["base"] * len(requests), args.max_tokens))
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"))
    parser.add_argument("--servers", default=",".join(SERVERS), help="which to run (a comparison needs both)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--num-adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=Path("bench-results/compare-lora"))
    args = parser.parse_args()
    servers = [name for name in args.servers.split(",") if name]
    if set(servers) - set(SERVERS) or not servers:
        parser.error(f"--servers must name some of {', '.join(SERVERS)}")
    if "vllm" in servers and not args.vllm_python:
        parser.error("vLLM needs its interpreter: --vllm-python PATH or VLLM_PYTHON=PATH")
    args.out.mkdir(parents=True, exist_ok=True)
    model = write_tiny_llama(args.out / "tiny-llama")
    adapters = [
        write_adapter(args.out / f"adapter-{i}", model, args.rank, seed=i + 1) for i in range(args.num_adapters)
    ]
    rows, versus_vllm, versus_base = [], [], []
    for number in range(1, args.rounds + 1):
        order = servers if number % 2 else servers[::-1]
        results = {server: run_one(server, model, adapters, args, str(number)) for server in order}
        ours, theirs = results.get("pagerail"), results.get("vllm")
        row = [number, f"{ours['lora'][0]:.0f}" if ours else "", f"{theirs['lora'][0]:.0f}" if theirs else ""]
        row.append(f"{ours['base'][0]:.0f}" if ours else "")
        if ours and theirs:
            versus_vllm.append(ours["lora"][0] / theirs["lora"][0])
            row.append(f"{versus_vllm[-1]:.2f}x")
        else:
            row.append("")
        if ours:
            versus_base.append(ours["lora"][0] / ours["base"][0])
            row.append(f"{versus_base[-1]:.2f}x")
            # Each adapter's first request (request i is adapter i's): its text, against the base model's.
            first = range(args.num_adapters)
            changed = sum(ours["lora"][1][i] != ours["base"][1][i] for i in first)
            row.append(f"{changed}/{args.num_adapters}")
        else:
            row.append("")
        if ours and theirs:
            same = sum(ours["lora"][1][i] == theirs["lora"][1][i] for i in range(args.num_adapters))
            row.append(f"{same}/{args.num_adapters}")
        rows.append(row + [""] * (8 - len(row)))
    if args.rounds > 1:
        median = [f"{statistics.median(v):.2f}x" if v else "" for v in (versus_vllm, versus_base)]
        rows.append(["median", "", "", "", *median, "", ""])
    header = ["round", "pagerail LoRA tok/s", "vLLM LoRA tok/s", "pagerail base tok/s", "LoRA: pagerail / vLLM"]
    extra = ["pagerail LoRA / base", "adapters changing the text", "same text as vLLM"]
    table = format_table([*header, *extra], rows)
    (args.out / "comparison.txt").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
