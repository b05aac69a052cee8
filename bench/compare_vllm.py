"""pagerail next to vLLM: each server is started on the same model and workload, driven by `pagerail bench serve`
(streaming /v1/completions, token-id prompts, ignore_eos so both generate the same token counts), then stopped.
One table shows output tokens/s, TTFT p50 and ITL p50 of both, with the pagerail / vLLM ratio. With --rounds N
the servers alternate N times (the first one changing every round); the table gives each round and the median of
the rounds' ratios. Each run also reports the CPU seconds per generated token of every process of the server
(the HTTP frontend, the engine or head, the ranks), read from /proc over the client's run.

Workloads:
  standard  the embedded SmolLM2-135M-Instruct (the same safetensors directory for both), 64 requests,
            prompts 32-512, outputs 16-256, 16 concurrent users
  overhead  a small random Llama written once for both (cluster/bench/tiny_llama.py: identical weights, a
            tokenizer cut to its vocabulary), 256 requests, prompts 64-256, outputs 128, 64 concurrent users

Both servers run fp32 on the CPU with the same token budget (2048), sequence limit (256) and KV cache bytes.
vLLM runs from its own interpreter (--vllm-python or $VLLM_PYTHON); it is never imported here.

Usage:
  VLLM_PYTHON=/path/to/vllm-venv/bin/python .venv/bin/python bench/compare_vllm.py
  VLLM_PYTHON=... .venv/bin/python bench/compare_vllm.py --workloads overhead --rounds 3
  .venv/bin/python bench/compare_vllm.py --servers pagerail --workloads overhead --num-requests 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from pagerail.cluster.bench.process_cpu import cpu_spent, session_cpu
from pagerail.cluster.bench.server_process import ServerProcess, free_port, pagerail_serve_command
from pagerail.cluster.bench.stats import format_table

SERVERS = ("pagerail", "vllm")
TOKEN_BUDGET = 2048
MAX_NUM_SEQS = 256
MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class Workload:
    name: str
    num_requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    concurrency: int
    seed: int = 0


WORKLOADS = {
    "standard": Workload("standard", 64, (32, 512), (16, 256), 16),
    "overhead": Workload("overhead", 256, (64, 256), (128, 128), 64),
}


def model_dir(workload: str, out: Path) -> Path:
    """The checkpoint directory both servers load for this workload."""
    if workload == "standard":
        from pagerail.common.model_source import resolve_model_dir

        return resolve_model_dir(None)
    from pagerail.cluster.bench.tiny_llama import write_tiny_llama

    return write_tiny_llama(out / "tiny-llama")  # the same bytes every time: cheap to write again


def server_command(server: str, model: Path, name: str, port: int, args: argparse.Namespace) -> list[str]:
    kv_bytes = str(int(args.kv_cache_gib * (1 << 30)))
    if server == "pagerail":
        flags = ["--served-model-name", name, "--device", "cpu", "--dtype", "float32", "--kv-cache-memory-bytes"]
        flags += [kv_bytes, "--max-num-batched-tokens", str(TOKEN_BUDGET), "--max-num-seqs", str(MAX_NUM_SEQS)]
        flags += ["--max-model-len", str(MAX_MODEL_LEN), *args.pagerail_flags]
        return pagerail_serve_command(args.pagerail_python, model, port, *flags)
    command = [args.vllm_python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)]
    command += ["--served-model-name", name, "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port)]
    command += ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS)]
    command += ["--max-num-batched-tokens", str(TOKEN_BUDGET), "--seed", "0"]
    # Sampling defaults from vLLM itself, not from a generation_config.json next to the weights.
    command += ["--generation-config", "vllm", "--disable-log-stats", "--disable-uvicorn-access-log"]
    return command


def server_env(server: str, args: argparse.Namespace) -> dict[str, str]:
    # Everything is local: neither server may reach for the network.
    env = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if server == "vllm":
        env["VLLM_CPU_KVCACHE_SPACE"] = f"{args.kv_cache_gib:g}"
    return env


def run_one(server: str, workload: Workload, model: Path, args: argparse.Namespace, tag: str = "1") -> dict:
    """Start the server, run `pagerail bench serve` against it, stop it; the client's JSON results, with the CPU
    milliseconds per generated token of each of the server's processes."""
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    name = f"{workload.name}-model"
    logs = args.out / f"{workload.name}-{server}-{tag}.log"
    command = server_command(server, model, name, port, args)
    client = [args.pagerail_python, "-m", "pagerail.cluster.cli", "bench", "serve"]
    client += ["--base-url", base_url, "--model", name]
    client += ["--tokenizer", str(model), "--num-requests", str(workload.num_requests), "--seed", str(workload.seed)]
    client += ["--prompt-len", *map(str, workload.prompt_len), "--output-len", *map(str, workload.output_len)]
    client += ["--concurrency", str(workload.concurrency), "--json"]
    print(f"== {workload.name}: {server} (server log {logs})", flush=True)
    env = server_env(server, args)
    with ServerProcess(command, base_url, logs, ready_timeout_s=args.start_timeout, env=env) as running:
        # The server leads a session of its own, which its helper processes (Ray's actors, vLLM's engine) join.
        before = session_cpu(running.process.pid)
        done = subprocess.run(client, capture_output=True, text=True, check=False)
        spent = cpu_spent(before, session_cpu(running.process.pid))
    if done.returncode != 0:
        raise RuntimeError(f"pagerail bench serve against {server} failed:\n{done.stderr[-3000:]}")
    results = json.loads(done.stdout)
    generated = results.get("total_output_tokens") or 0
    results["cpu_ms_per_token"] = {
        label: round(1000 * seconds / generated, 4) for label, seconds in spent.items() if generated
    }
    (args.out / f"{workload.name}-{server}-{tag}.json").write_text(json.dumps(results, indent=2))
    return results


def versions(args: argparse.Namespace, servers: list[str]) -> dict[str, str]:
    from importlib.metadata import version

    repo = Path(__file__).resolve().parent.parent
    commit = subprocess.run(["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    found = {"pagerail": f"{version('pagerail')} ({commit.stdout.strip() or 'no git'})"}
    if "vllm" in servers:
        probe = [args.vllm_python, "-c", "import vllm; print(vllm.__version__)"]
        answer = subprocess.run(probe, capture_output=True, text=True, check=False)
        found["vllm"] = answer.stdout.strip().splitlines()[-1] if answer.returncode == 0 else "unknown"
    return found


def ratios(ours: dict, theirs: dict) -> tuple[float, float, float]:
    """pagerail / vLLM: output tokens/s, TTFT p50, ITL p50."""
    return (
        ours["output_throughput"] / theirs["output_throughput"],
        ours["ttft_ms"]["p50"] / theirs["ttft_ms"]["p50"],
        ours["itl_ms"]["p50"] / theirs["itl_ms"]["p50"],
    )


def format_comparison(runs: dict[str, list[dict[str, dict]]], found: dict[str, str]) -> str:
    """`runs`: per workload, one {server: results} per round."""
    header = ["workload", "round", "server", "version", "completed", "output tok/s", "TTFT p50 ms", "ITL p50 ms"]
    rows = []
    cpu_lines = []
    for workload, rounds in runs.items():
        per_round = []
        for number, by_server in enumerate(rounds, start=1):
            for server, r in by_server.items():
                done = f"{r['completed']}/{r['completed'] + r['failed']}"
                row = [r["output_throughput"], r["ttft_ms"]["p50"], r["itl_ms"]["p50"]]
                rows.append([workload, number, server, found.get(server, ""), done, *row])
                cpu = ", ".join(f"{label} {ms:.3f}" for label, ms in r.get("cpu_ms_per_token", {}).items())
                cpu_lines.append(f"{workload} round {number} {server}: CPU ms per generated token: {cpu}")
            if len(by_server) == len(SERVERS):
                per_round.append(ratios(by_server["pagerail"], by_server["vllm"]))
                rows.append([workload, number, "pagerail / vLLM", "", "", *(f"{x:.2f}x" for x in per_round[-1])])
        if len(per_round) > 1:
            medians = [statistics.median(column) for column in zip(*per_round, strict=True)]
            rows.append([workload, "median", "pagerail / vLLM", "", "", *(f"{x:.2f}x" for x in medians)])
    note = "ratios: output tok/s higher is better for pagerail; TTFT and ITL lower is better"
    return "\n".join([format_table(header, rows), note, *cpu_lines])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    parser.add_argument("--workloads", nargs="+", choices=tuple(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--num-requests", type=int, default=None, help="override every workload's request count")
    parser.add_argument("--concurrency", type=int, default=None, help="override every workload's users")
    parser.add_argument("--prompt-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=None, metavar=("MIN", "MAX"))
    parser.add_argument("--vllm-python", default=os.environ.get("VLLM_PYTHON"), help="vLLM's interpreter")
    parser.add_argument(
        "--pagerail-flags", nargs="+", default=[], metavar="FLAG", help="more flags for pagerail serve (e.g. =--x)"
    )
    parser.add_argument("--pagerail-python", default=sys.executable, help="pagerail's interpreter (default: this)")
    parser.add_argument("--kv-cache-gib", type=float, default=4.0, help="KV cache of each server (default 4 GiB)")
    parser.add_argument("--start-timeout", type=float, default=1200.0, help="seconds a server may take to start")
    parser.add_argument("--out", type=Path, default=Path("bench-results/compare-vllm"), help="logs and JSON")
    parser.add_argument(
        "--rounds", type=int, default=1, help="run the servers this many times, alternating which goes first"
    )
    args = parser.parse_args()
    if "vllm" in args.servers and not args.vllm_python:
        parser.error("vLLM needs its interpreter: --vllm-python PATH or VLLM_PYTHON=PATH")
    args.out.mkdir(parents=True, exist_ok=True)
    overrides = {
        key: value
        for key, value in (
            ("num_requests", args.num_requests),
            ("concurrency", args.concurrency),
            ("prompt_len", tuple(args.prompt_len) if args.prompt_len else None),
            ("output_len", tuple(args.output_len) if args.output_len else None),
        )
        if value is not None
    }
    runs: dict[str, list[dict[str, dict]]] = {}
    for name in args.workloads:
        workload = replace(WORKLOADS[name], **overrides)
        model = model_dir(name, args.out)
        runs[name] = []
        for number in range(1, args.rounds + 1):
            # Alternating order: neither server always runs on a machine the other just warmed or loaded.
            order = args.servers if number % 2 else list(reversed(args.servers))
            by_server = {server: run_one(server, workload, model, args, str(number)) for server in order}
            runs[name].append({server: by_server[server] for server in args.servers})
    found = versions(args, args.servers)
    table = format_comparison(runs, found)
    (args.out / "comparison.txt").write_text(table + "\n")
    (args.out / "comparison.json").write_text(json.dumps({"versions": found, "runs": runs}, indent=2) + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
