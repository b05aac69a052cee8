"""Flex work beside an interactive stream, against a real `pagerail serve` (the tiny random Llama on CPU): the
interactive client streams completions one after another and its inter-token latency (ITL) is measured three
ways on one server: alone, beside a saturating batch workload sent as `service_tier: "flex"`, and beside the same
workload sent as ordinary (interactive) requests. The batch workload is --batch closed loops of whole (not
streamed) completions, run by a client process of its own so that its responses never hold up the interactive
client's event loop; how many of them completed shows that flex work still progresses.

    .venv/bin/python bench/flex_itl.py
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

from pagerail.cluster.bench.server_process import ServerProcess, free_port, pagerail_serve_command
from pagerail.cluster.bench.stats import format_table
from pagerail.cluster.bench.tiny_llama import write_tiny_llama
from pagerail.common import event_loops


async def interactive(client: httpx.AsyncClient, stop_at: float, args, gaps: list[float]) -> None:
    """Streamed completions one after another until `stop_at`: the gaps between consecutive tokens."""
    body = {"model": "base", "prompt": [7] * args.prompt_tokens, "max_tokens": args.max_tokens, "stream": True}
    body |= {"ignore_eos": True, "temperature": 0}
    while time.perf_counter() < stop_at:
        last = None
        async with client.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now


async def batch(client: httpx.AsyncClient, stop_at: float, args, tier: str, done: list[int]) -> None:
    """Whole completions one after another until `stop_at`, in service tier `tier`."""
    body = {"model": "base", "prompt": [9] * args.batch_prompt_tokens, "max_tokens": args.batch_max_tokens}
    body |= {"ignore_eos": True, "temperature": 0, "service_tier": tier}
    while time.perf_counter() < stop_at:
        response = await client.post("/v1/completions", json=body)
        response.raise_for_status()
        done.append(1)


async def batch_loops(base_url: str, seconds: float, args, tier: str) -> int:
    done: list[int] = []
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        stop_at = time.perf_counter() + seconds
        await asyncio.gather(*(batch(client, stop_at, args, tier, done) for _ in range(args.batch)))
    return len(done)


def batch_process(base_url: str, seconds: float, args, tier: str, completed) -> None:
    # The batch client stands in for callers on other machines: on a machine of few cores it must not take the
    # server's CPU time (the server's own work for the batch requests is what is measured).
    os.nice(19)
    completed.value = event_loops.run(batch_loops(base_url, seconds, args, tier))


async def phase(base_url: str, args, tier: str | None) -> tuple[list[float], int]:
    gaps: list[float] = []
    completed = multiprocessing.Value("i", 0)
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        await interactive(client, time.perf_counter() + 1, args, [])  # warm-up
        loader = None
        if tier is not None:
            # The batch client runs 2 s longer on each side: the measured window is saturated throughout.
            loader = multiprocessing.Process(
                target=batch_process, args=(base_url, args.seconds + 4, args, tier, completed)
            )
            loader.start()
            await asyncio.sleep(2)
        await interactive(client, time.perf_counter() + args.seconds, args, gaps)
        if loader is not None:
            await asyncio.to_thread(loader.join)
    return gaps, completed.value


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) >= 2 else float("nan")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32, help="concurrent batch requests")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--flex-tokens-per-step", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-prompt-tokens", type=int, default=256)
    parser.add_argument("--batch-max-tokens", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--out", type=Path, default=Path("bench-results/flex-itl"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = write_tiny_llama(args.out / "tiny-llama")
    port = free_port()
    flags = ["--served-model-name", "base", "--device", "cpu", "--dtype", "float32"]
    flags += ["--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory-bytes", str(256 << 20)]
    flags += ["--flex-tokens-per-step", str(args.flex_tokens_per_step)]
    command = pagerail_serve_command(sys.executable, model, port, *flags)
    base_url = f"http://127.0.0.1:{port}"
    results = {}
    with ServerProcess(command, base_url, args.out / "server.log", ready_timeout_s=600):
        for label, tier in (("alone", None), ("beside flex", "flex"), ("beside default", "default")):
            print(f"== interactive stream {label}", flush=True)
            results[label] = event_loops.run(phase(base_url, args, tier))
    alone = p99(results["alone"][0])
    rows = []
    for label, (gaps, done) in results.items():
        mine = p99(gaps)
        rows.append([label, f"{statistics.median(gaps) * 1000:.1f}", f"{mine * 1000:.1f}", f"{mine / alone:.2f}x"])
        rows[-1].append(str(done) if label != "alone" else "-")
    print(format_table(["interactive stream", "ITL p50 ms", "ITL p99 ms", "p99 / alone", "batch completed"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
