"""Data-parallel routing policies side by side: `pagerail serve --data-parallel-size N` started once per policy on
the same small random Llama, driven by `pagerail bench serve` with a shared-prefix workload (a few long system
prompts, many users each, interleaved), then stopped. One table shows each policy's cached prompt tokens,
output tokens/s and TTFT, with the ratio to round-robin.

Each replica's KV cache is kept small (--kv-cache-memory-bytes) so that one replica cannot hold every system
prompt at once: where requests land then decides what the prefix caches can serve. Ray is started with one
logical CPU per replica, so that N replicas fit on a machine with fewer cores (they share them).

Usage:
  .venv/bin/python bench/data_parallel.py
  .venv/bin/python bench/data_parallel.py --policies round-robin prefix-aware --num-requests 64
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from pagerail.cluster.bench.server_process import ServerProcess, free_port, pagerail_serve_command
from pagerail.cluster.bench.stats import format_table
from pagerail.cluster.bench.tiny_llama import write_tiny_llama

POLICIES = ("round-robin", "least-loaded", "prefix-aware")
# A throwaway local Ray for one run: no token to hand from `ray start` to the server.
RAY_ENV = {"RAY_AUTH_MODE": "disabled"}


def start_ray(num_cpus: int) -> str:
    """A local Ray head offering `num_cpus` logical CPUs (one per replica's rank, whatever the cores), its address."""
    port = free_port()
    ray = str(Path(sys.executable).with_name("ray"))
    command = [ray, "start", "--head", "--port", str(port), "--num-cpus", str(num_cpus), "--include-dashboard=false"]
    subprocess.run(command, check=True, capture_output=True, env={**os.environ, **RAY_ENV})
    return f"127.0.0.1:{port}"


def stop_ray() -> None:
    subprocess.run([str(Path(sys.executable).with_name("ray")), "stop", "--force"], check=False, capture_output=True)


def run_policy(args: argparse.Namespace, model_dir: Path, policy: str, work: Path) -> dict:
    port = free_port()
    flags = [
        "--ray-address", start_ray(args.replicas),
        "--data-parallel-size", str(args.replicas), "--routing-policy", policy,
        "--kv-cache-memory-bytes", str(args.kv_cache_bytes), "--device", "cpu", "--dtype", "float32",
    ]  # fmt: skip
    command = pagerail_serve_command(sys.executable, model_dir, port, *flags)
    base_url = f"http://127.0.0.1:{port}"
    with ServerProcess(command, base_url, work / f"serve-{policy}.log", env=RAY_ENV):
        bench = [
            sys.executable, "-m", "pagerail.cluster.cli", "bench", "serve", "--base-url", base_url, "--json",
            "--tokenizer", str(model_dir), "--num-requests", str(args.num_requests),
            "--shared-prefix", str(args.num_prefixes), str(args.prefix_len),
            "--prompt-len", "16", "64", "--output-len", str(args.output_len), str(args.output_len),
            "--concurrency", str(args.concurrency), "--seed", "0",
        ]  # fmt: skip
        try:
            done = subprocess.run(bench, capture_output=True, text=True, check=True)
        finally:
            stop_ray()
    return json.loads(done.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES))
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument(
        "--kv-cache-memory-bytes", dest="kv_cache_bytes", type=int, default=3 << 19,
        help="per replica (the default model takes 1 KiB per token: about 1500 tokens)",
    )  # fmt: skip
    parser.add_argument("--work-dir", default="/tmp/pagerail-bench-dp")
    args = parser.parse_args(argv)
    work = Path(args.work_dir)
    model_dir = write_tiny_llama(work / "model")
    results = {policy: run_policy(args, model_dir, policy, work) for policy in args.policies}
    base = results.get("round-robin")
    rows = []
    for policy, result in results.items():
        cached = result["total_cached_tokens"]
        ratio = f"{cached / base['total_cached_tokens']:.2f}" if base and base["total_cached_tokens"] else "-"
        rows.append([
            policy, f"{result['completed']}/{result['completed'] + result['failed']}", cached,
            f"{cached / max(result['total_input_tokens'], 1):.0%}", ratio,
            f"{result['output_throughput']:.1f}", f"{result['ttft_ms']['p50']:.0f}",
        ])  # fmt: skip
    print(
        f"{args.replicas} replicas, {args.num_requests} requests behind {args.num_prefixes} shared prefixes of "
        f"{args.prefix_len} tokens, {args.concurrency} concurrent users, {args.kv_cache_bytes} bytes of KV per replica"
    )
    header = ["policy", "ok", "cached prompt tokens", "of prompt", "× round-robin", "output tok/s", "TTFT p50 ms"]
    print(format_table(header, rows))
    print(json.dumps(results, indent=1), file=open(work / "results.json", "w"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
