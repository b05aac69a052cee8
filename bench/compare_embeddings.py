"""Embeddings per second, pagerail next to vLLM's pooling runner, on the same model and inputs, in one invocation.

Both servers load the same small random Llama (cluster/bench/tiny_llama.py) as a decoder embedder (last-token
pooling, normalised): pagerail serves `/v1/embeddings` on its causal model, vLLM runs `--runner pooling --convert
embed`. One client sends the same inputs to each (`--num-requests` requests of `--batch` texts of 16-128 tokens,
`--concurrency` at once) and counts embedded inputs per second; with --rounds N the servers alternate N times and
the table gives each round and the median ratio. The first vectors of both are compared (cosine) as a check that
they embed alike.

    VLLM_PYTHON=/path/to/vllm-venv/bin/python .venv/bin/python bench/compare_embeddings.py --rounds 3
"""

from __future__ import annotations

import argparse
import asyncio
import math
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
from pagerail.common import event_loops

SERVERS = ("pagerail", "vllm")


def server_command(server: str, model: Path, port: int, args: argparse.Namespace) -> list[str]:
    kv_bytes = str(int(args.kv_cache_gib * (1 << 30)))
    if server == "pagerail":
        flags = ["--served-model-name", "embed", "--device", "cpu", "--dtype", "float32"]
        return pagerail_serve_command(sys.executable, model, port, *flags, "--kv-cache-memory-bytes", kv_bytes)
    command = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    command += ["--served-model-name", "embed", "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--runner", "pooling", "--convert", "embed", "--max-model-len", "4096", "--disable-log-stats"]
    return command


def inputs(args: argparse.Namespace) -> list[list[list[int]]]:
    """The requests: each a batch of token-id inputs (the same for both servers)."""
    rng = random.Random(args.seed)
    return [
        [[rng.randrange(100, 1000) for _ in range(rng.randint(16, 128))] for _ in range(args.batch)]
        for _ in range(args.num_requests)
    ]


async def drive(base_url: str, requests: list[list[list[int]]], concurrency: int) -> tuple[float, list[float]]:
    """Inputs embedded per second, and the first input's vector."""
    gate = asyncio.Semaphore(concurrency)
    first: list[float] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:

        async def one(number: int, batch: list[list[int]]) -> None:
            async with gate:
                response = await client.post(
                    "/v1/embeddings", json={"model": "embed", "input": batch, "encoding_format": "float"}
                )
                response.raise_for_status()
                if number == 0:
                    first.extend(response.json()["data"][0]["embedding"])

        await one(0, requests[0])  # warm-up, and the vector to compare
        started = time.perf_counter()
        await asyncio.gather(*(one(n + 1, batch) for n, batch in enumerate(requests[1:])))
        elapsed = time.perf_counter() - started
    return sum(len(batch) for batch in requests[1:]) / elapsed, first


def run_one(server: str, model: Path, requests, args: argparse.Namespace, tag: str) -> tuple[float, list[float]]:
    port = free_port()
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if server == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{args.kv_cache_gib:g}"
    logs = args.out / f"{server}-{tag}.log"
    print(f"== {server} round {tag} (server log {logs})", flush=True)
    command = server_command(server, model, port, args)
    with ServerProcess(command, f"http://127.0.0.1:{port}", logs, ready_timeout_s=1200, env=env):
        return event_loops.run(drive(f"http://127.0.0.1:{port}", requests, args.concurrency))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"))
    parser.add_argument("--servers", default=",".join(SERVERS), help="which to run (a comparison needs both)")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--batch", type=int, default=32, help="inputs per request")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=Path("bench-results/compare-embeddings"))
    args = parser.parse_args()
    servers = [name for name in args.servers.split(",") if name]
    if set(servers) - set(SERVERS) or not servers:
        parser.error(f"--servers must name some of {', '.join(SERVERS)}")
    if "vllm" in servers and not args.vllm_python:
        parser.error("vLLM needs its interpreter: --vllm-python PATH or VLLM_PYTHON=PATH")
    args.out.mkdir(parents=True, exist_ok=True)
    model = write_tiny_llama(args.out / "tiny-llama")
    requests = inputs(args)
    rows, ratios = [], []
    for number in range(1, args.rounds + 1):
        order = servers if number % 2 else servers[::-1]
        results = {server: run_one(server, model, requests, args, str(number)) for server in order}
        if len(results) == 1:
            rows.append([number] + [f"{results[s][0]:.1f}" if s in results else "" for s in SERVERS] + ["", ""])
            continue
        (ours, our_vector), (theirs, their_vector) = results["pagerail"], results["vllm"]
        dot = sum(a * b for a, b in zip(our_vector, their_vector, strict=True))
        cosine = dot / (math.hypot(*our_vector) * math.hypot(*their_vector))
        ratios.append(ours / theirs)
        rows.append([number, f"{ours:.1f}", f"{theirs:.1f}", f"{ours / theirs:.2f}x", f"{cosine:.5f}"])
    if len(ratios) > 1:
        rows.append(["median", "", "", f"{statistics.median(ratios):.2f}x", ""])
    header = ["round", "pagerail inputs/s", "vLLM inputs/s", "pagerail / vLLM", "cosine of first vectors"]
    table = format_table(header, rows)
    (args.out / "comparison.txt").write_text(table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
