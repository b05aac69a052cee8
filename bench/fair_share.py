"""Fair share between tenants against a real `pagerail serve` (the tiny random Llama on CPU, `--tenants` with three
tenants): tenant A floods with --flood streams while B and C send --light streams each, every stream a closed loop
of streamed completions. Time to first token of B's and C's requests is measured three ways in one invocation: B
and C alone, beside the flood under FCFS (`--fairness none`), and beside the flood under `--fairness vtc`. Then all
three tenants flood at once with weights 2:1:1 under vtc, and the output tokens each was served are compared with
its weight.

    .venv/bin/python bench/fair_share.py
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

KEYS = {"a": "sk-tenant-a", "b": "sk-tenant-b", "c": "sk-tenant-c"}


def tenants_file(path: Path, weights: dict[str, float]) -> Path:
    lines = ["tenants:"]
    for name, weight in weights.items():
        lines += [f"  - name: {name}", f"    api_keys: [{KEYS[name]}]", f"    weight: {weight:g}"]
    path.write_text("\n".join(lines) + "\n")
    return path


async def stream_loop(client: httpx.AsyncClient, tenant: str, stop_at: float, args, ttfts: list, tokens: dict):
    """Streamed completions one after another until `stop_at`: each one's time to first token, and its tokens."""
    headers = {"Authorization": f"Bearer {KEYS[tenant]}"}
    body = {"model": "base", "prompt": [7] * args.prompt_tokens, "max_tokens": args.max_tokens, "stream": True}
    body |= {"ignore_eos": True, "temperature": 0}
    while time.perf_counter() < stop_at:
        started, first = time.perf_counter(), None
        async with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if line.startswith("data: {") and first is None:
                    first = time.perf_counter() - started
                if line.startswith("data: {"):
                    tokens[tenant] = tokens.get(tenant, 0) + 1
        if first is not None:
            ttfts.append((tenant, first))


def flood_process(base_url: str, flood: dict[str, int], args, out) -> None:
    """The flood's closed loops, 2 s longer than the measured window on each side; their tokens into `out`."""
    os.nice(19)

    async def loops() -> dict:
        tokens: dict = {}
        async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
            stop_at = time.perf_counter() + args.seconds + 4
            await asyncio.gather(
                *(stream_loop(client, t, stop_at, args, [], tokens) for t, n in flood.items() for _ in range(n))
            )
        return tokens

    out.update(event_loops.run(loops()))


async def phase(base_url: str, streams: dict[str, int], args) -> tuple[list, dict, dict]:
    ttfts: list = []
    tokens: dict = {}
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
        warm = time.perf_counter() + 2
        await asyncio.gather(*(stream_loop(client, t, warm, args, [], {}) for t in streams for _ in range(1)))
        before = engine_means((await client.get("/metrics")).text)
        # A flood's streams run in a client process of their own, at the lowest CPU priority: they stand in for
        # callers on other machines, so the measured tenants' client never waits behind them for this machine's
        # CPU (the server's own work for them is what is measured).
        flood = {t: n for t, n in streams.items() if n > args.light}
        flood_tokens = multiprocessing.Manager().dict() if flood else None
        flooder = None
        if flood:
            flooder = multiprocessing.Process(target=flood_process, args=(base_url, flood, args, flood_tokens))
            flooder.start()
            await asyncio.sleep(2)  # the flood is under way before the measured window opens
        stop_at = time.perf_counter() + args.seconds
        measured = {t: n for t, n in streams.items() if t not in flood}
        loops = [stream_loop(client, t, stop_at, args, ttfts, tokens) for t, n in measured.items() for _ in range(n)]
        await asyncio.gather(*loops)
        after = engine_means((await client.get("/metrics")).text)
        if flooder is not None:
            await asyncio.to_thread(flooder.join)
            tokens |= dict(flood_tokens)
    # The engine's own view over the measured window, by tenant: mean queue time and mean time to first token.
    server = {}
    for tenant in streams:
        for metric in ("tenant_request_queue_time_seconds", "tenant_time_to_first_token_seconds"):
            (total, count), (total0, count0) = after.get((metric, tenant), (0, 0)), before.get((metric, tenant), (0, 0))
            server[(metric, tenant)] = (total - total0) / (count - count0) if count > count0 else float("nan")
    return ttfts, tokens, server


def engine_means(text: str) -> dict[tuple[str, str], tuple[float, float]]:
    """(metric, tenant) -> (sum, count) of the per-tenant histograms on /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    found: dict[tuple[str, str], list[float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            tenant = sample.labels.get("tenant")
            if tenant is None or not sample.name.startswith("pagerail_tenant_"):
                continue
            for suffix, index in (("_sum", 0), ("_count", 1)):
                if sample.name.endswith(suffix):
                    key = (sample.name[len("pagerail_") : -len(suffix)], tenant)
                    found.setdefault(key, [0.0, 0.0])[index] = sample.value
    return {key: (pair[0], pair[1]) for key, pair in found.items()}


def p99(values: list[float]) -> float:
    return statistics.quantiles(values, n=100)[98] if len(values) >= 2 else float("nan")


def run(model: Path, args, fairness: str, weights: dict[str, float], streams: dict[str, int], tag: str):
    port = free_port()
    flags = ["--served-model-name", "base", "--device", "cpu", "--dtype", "float32", "--fairness", fairness]
    flags += ["--tenants", str(tenants_file(args.out / f"tenants-{tag}.yaml", weights))]
    flags += ["--max-num-seqs", str(args.max_num_seqs), "--kv-cache-memory-bytes", str(256 << 20)]
    command = pagerail_serve_command(sys.executable, model, port, *flags)
    base_url = f"http://127.0.0.1:{port}"
    print(f"== {tag}: fairness {fairness}, streams {streams}", flush=True)
    with ServerProcess(command, base_url, args.out / f"server-{tag}.log", ready_timeout_s=600):
        return event_loops.run(phase(base_url, streams, args))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--flood", type=int, default=32)
    parser.add_argument("--light", type=int, default=2)
    parser.add_argument("--max-num-seqs", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--out", type=Path, default=Path("bench-results/fair-share"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = write_tiny_llama(args.out / "tiny-llama")
    equal = {"a": 1.0, "b": 1.0, "c": 1.0}
    light = {"b": args.light, "c": args.light}
    results = {
        "alone": run(model, args, "vtc", equal, light, "alone"),
        "fcfs": run(model, args, "none", equal, {"a": args.flood, **light}, "fcfs"),
        "vtc": run(model, args, "vtc", equal, {"a": args.flood, **light}, "vtc"),
    }
    alone = {t: p99([s for name, s in results["alone"][0] if name == t]) for t in ("b", "c")}
    rows = []
    for label, (ttfts, _, server) in results.items():
        row = [label]
        for tenant in ("b", "c"):
            mine = [s for name, s in ttfts if name == tenant]
            row += [f"{p99(mine) * 1000:.0f}", f"{p99(mine) / alone[tenant]:.2f}x"]
        queue = server[("tenant_request_queue_time_seconds", "b")]
        engine_ttft = server[("tenant_time_to_first_token_seconds", "b")]
        client_mean = statistics.mean(s for name, s in ttfts if name == "b")
        rows.append([*row, f"{client_mean * 1000:.1f}", f"{queue * 1000:.1f}", f"{engine_ttft * 1000:.1f}"])
    header = [
        "run",
        "B TTFT p99 ms",
        "B / alone",
        "C TTFT p99 ms",
        "C / alone",
        "B TTFT ms (mean)",
        "B queue ms (engine mean)",
        "B TTFT ms (engine mean)",
    ]
    print(format_table(header, rows))
    for tenant in ("b", "c"):
        fcfs = p99([s for name, s in results["fcfs"][0] if name == tenant])
        vtc = p99([s for name, s in results["vtc"][0] if name == tenant])
        print(f"{tenant.upper()}: TTFT p99 under FCFS / under vtc = {fcfs / vtc:.1f}x")
    weights = {"a": 2.0, "b": 1.0, "c": 1.0}
    each = max(args.flood // 2, args.max_num_seqs)
    _, tokens, _ = run(model, args, "vtc", weights, {t: each for t in weights}, "weights")
    total, weight_sum = sum(tokens.values()), sum(weights.values())
    for tenant, weight in weights.items():
        share, expected = tokens.get(tenant, 0) / total, weight / weight_sum
        print(f"all flooding, weights 2:1:1: {tenant.upper()} was served {share:.3f} of the output tokens", end=" ")
        print(f"(its weight's share {expected:.3f}: {share / expected - 1:+.1%})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
