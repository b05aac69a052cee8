"""`pagerail bench overhead`: engine overhead at GPU-like step times. One workload on a small random Llama runs
through the model alone (the forward ceiling), the offline `LLM`, and `pagerail serve` at tensor parallel 1 and 2,
in one invocation, so each is reported as a share of the ceiling next to the others."""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagerail.cluster.bench.overhead_report import build_report, format_report
from pagerail.cluster.bench.step_phases import counter_total, outside_forward, totals_from_registry, totals_from_text
from pagerail.cluster.bench.tiny_llama import TinyLlamaShape, write_tiny_llama
from pagerail.cluster.bench.workload import BenchRequest, describe, random_workload, throughput
from pagerail.common.engine_args import add_engine_arguments

WARMUP_REQUESTS = 16
WARMUP_OUTPUT_LEN = 4
PREEMPTIONS = "pagerail_num_preemptions"


def add_overhead_arguments(parser: argparse.ArgumentParser) -> None:
    workload = parser.add_argument_group("workload")
    workload.add_argument("--num-requests", type=int, default=256, help="requests (default 256)")
    workload.add_argument("--prompt-len", type=int, default=128, help="prompt tokens of every request (default 128)")
    workload.add_argument("--output-len", type=int, default=256, help="output tokens of every request (default 256)")
    workload.add_argument("--users", type=int, default=256, help="concurrent streaming users for serve (default 256)")
    workload.add_argument("--seed", type=int, default=0, help="seed of the prompts and the weights")
    workload.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per served request")
    model = parser.add_argument_group("model (a random Llama written for the run)")
    defaults = TinyLlamaShape()
    model.add_argument("--hidden-size", type=int, default=defaults.hidden_size)
    model.add_argument("--num-layers", type=int, default=defaults.num_layers)
    model.add_argument("--num-heads", type=int, default=defaults.num_heads)
    model.add_argument("--num-kv-heads", type=int, default=defaults.num_kv_heads)
    model.add_argument("--intermediate-size", type=int, default=defaults.intermediate_size)
    model.add_argument("--vocab-size", type=int, default=defaults.vocab_size)
    engine = parser.add_argument_group("engine", "the offline LLM's and each pagerail serve's")
    add_engine_arguments(engine, only=("device", "dtype", "block_size", "max_num_batched_tokens", "async_scheduling"))
    engine.add_argument(
        "--cpus-per-worker", type=float, default=None, help="passed to each pagerail serve (default: the server's)"
    )
    parts = parser.add_argument_group("parts")
    parts.add_argument("--skip-serve", action="store_true", help="only the ceiling and the offline LLM")
    parts.add_argument("--skip-tp2", action="store_true", help="no tensor-parallel 2 server")
    parts.add_argument("--work-dir", default=None, help="keep the model and server logs here (default: a temp dir)")
    parts.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure the ceiling and the offline LLM this many times, alternating; the round with the median "
        "offline share is reported, with every round's share beside it (default 1)",
    )
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the report as JSON ('-': stdout)")


@dataclass(frozen=True)
class RunSettings:
    """What every part shares, so that they run the same model on the same KV capacity."""

    model_dir: Path
    requests: list[BenchRequest]
    warmup: list[BenchRequest]
    device: str
    dtype: str
    block_size: int
    max_num_batched_tokens: int
    num_blocks: int
    max_num_seqs: int
    async_scheduling: bool | None
    timeout: float
    cpus_per_worker: float | None = None


def run_offline(settings: RunSettings) -> dict[str, Any]:
    """Every request through `LLM.generate` at once; wall time, and the engine's step phases over the run."""
    from pagerail import LLM, SamplingParams

    llm = LLM(
        str(settings.model_dir),
        device=settings.device,
        dtype=settings.dtype,
        block_size=settings.block_size,
        num_gpu_blocks=settings.num_blocks,
        max_num_seqs=settings.max_num_seqs,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        async_scheduling=settings.async_scheduling,
    )

    def params(request: BenchRequest) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True)

    try:
        llm.generate([r.prompt_token_ids for r in settings.warmup], [params(r) for r in settings.warmup])
        engine = llm.engine
        preempted = engine.scheduler.stats.num_preemptions
        before = totals_from_registry(engine.metrics.registry)
        started = time.perf_counter()
        outputs = llm.generate([r.prompt_token_ids for r in settings.requests], [params(r) for r in settings.requests])
        seconds = time.perf_counter() - started
        after = totals_from_registry(engine.metrics.registry)
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        return {
            **throughput(settings.requests, seconds, produced, "LLM.generate"),
            "output_tokens": produced,
            "preemptions": engine.scheduler.stats.num_preemptions - preempted,
            "phases": outside_forward(before, after, seconds),
        }
    finally:
        if llm.engine is not None:
            llm.engine.executor.shutdown()
        del llm
        gc.collect()


def run_served(settings: RunSettings, tensor_parallel_size: int, users: int, log_path: Path) -> dict[str, Any]:
    """`pagerail serve` as a child process, streamed to by `users` concurrent clients over HTTP."""
    from pagerail.cluster.bench.online import benchmark_serving, resolve_model
    from pagerail.cluster.bench.process_cpu import cpu_spent, session_cpu
    from pagerail.cluster.bench.server_process import ServerProcess, free_port, pagerail_serve_command
    from pagerail.worker.kv_cache import bytes_per_block
    from pagerail.worker.worker import resolve_device, resolve_dtype

    # The server sizes its cache in bytes per rank; the same block count as offline, whatever the rank's share.
    shape = json.loads((settings.model_dir / "shape.json").read_text())
    per_block = bytes_per_block(
        shape["num_layers"],
        max(1, shape["num_kv_heads"] // tensor_parallel_size),
        shape["hidden_size"] // shape["num_heads"],
        settings.block_size,
        resolve_dtype(settings.dtype, resolve_device(settings.device)),
    )
    flags = [
        "--tensor-parallel-size", str(tensor_parallel_size),
        "--device", settings.device,
        "--dtype", settings.dtype,
        "--block-size", str(settings.block_size),
        "--max-num-batched-tokens", str(settings.max_num_batched_tokens),
        "--max-num-seqs", str(settings.max_num_seqs),
        "--kv-cache-memory-bytes", str(settings.num_blocks * per_block),
    ]  # fmt: skip
    if settings.cpus_per_worker is not None:
        flags += ["--cpus-per-worker", f"{settings.cpus_per_worker:g}"]
    if settings.async_scheduling is not None:
        flags.append("--async-scheduling" if settings.async_scheduling else "--no-async-scheduling")
    port = free_port()
    base_url = f"http://127.0.0.1:{port}"
    api_key = os.environ.get("PAGERAIL_API_KEY") or None
    command = pagerail_serve_command(sys.executable, settings.model_dir, port, *flags)

    def stream(requests: list[BenchRequest], concurrency: int) -> dict[str, Any]:
        return asyncio.run(
            benchmark_serving(
                base_url, model, requests, concurrency=concurrency, request_rate=None, seed=0,
                api_key=api_key, ignore_eos=True, timeout=settings.timeout,
            )
        )  # fmt: skip

    with ServerProcess(command, base_url, log_path) as server:
        model = resolve_model(base_url, api_key)
        stream(settings.warmup, len(settings.warmup))
        before_text = server.metrics_text()
        # The server leads a session of its own, which its Ray daemons and actors join; the client streams from
        # this process. Together they are every process that competes for the cores during the stream.
        cpu_before, client_before = session_cpu(server.process.pid), time.process_time()
        results = stream(settings.requests, users)
        cpu = {"client (bench process)": round(time.process_time() - client_before, 3)}
        cpu |= cpu_spent(cpu_before, session_cpu(server.process.pid))
        after_text = server.metrics_text()
    expected = sum(r.output_len for r in settings.requests)
    return {
        "tensor_parallel_size": tensor_parallel_size,
        "users": users,
        "seconds": results["duration_s"],
        "output_tokens_per_s": results["output_throughput"],
        "output_tokens": results["total_output_tokens"],
        "complete": results["failed"] == 0 and results["total_output_tokens"] == expected,
        "completed": results["completed"],
        "failed": results["failed"],
        "errors": results["errors"],
        "ttft_p50_ms": results["ttft_ms"]["p50"],
        "itl_p50_ms": results["itl_ms"]["p50"],
        "tpot_p50_ms": results["tpot_ms"]["p50"],
        "preemptions": int(counter_total(after_text, PREEMPTIONS) - counter_total(before_text, PREEMPTIONS)),
        "phases": outside_forward(totals_from_text(before_text), totals_from_text(after_text), results["duration_s"]),
        "cpu_seconds": cpu,
    }


def median_round(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    """The round (a ceiling and an offline run measured back to back) whose offline share of its own ceiling is
    the median; its offline part also lists every round's share, lowest first, so the spread shows beside it."""
    shares = [r["offline"]["output_tokens_per_s"] / r["ceiling"]["output_tokens_per_s"] for r in rounds]
    order = sorted(range(len(rounds)), key=shares.__getitem__)
    chosen = rounds[order[len(order) // 2]]
    return {"ceiling": chosen["ceiling"], "offline": {**chosen["offline"], "round_shares": [shares[i] for i in order]}}


def run_overhead(args: argparse.Namespace) -> int:
    # Imported here: the worker's modules are only needed once a run starts, not to build the command line.
    from pagerail.cluster.bench.forward_ceiling import kv_blocks_needed, measure_forward_ceiling

    shape = TinyLlamaShape(
        hidden_size=args.hidden_size,
        num_layers=args.num_layers,
        num_heads=args.num_heads,
        num_kv_heads=args.num_kv_heads,
        intermediate_size=args.intermediate_size,
        vocab_size=args.vocab_size,
    )
    if min(args.num_requests, args.prompt_len, args.output_len, args.users, args.rounds) < 1:
        raise ValueError("--num-requests, --prompt-len, --output-len, --users and --rounds must be >= 1")
    lengths = ((args.prompt_len, args.prompt_len), (args.output_len, args.output_len))
    requests = random_workload(args.num_requests, *lengths, vocab_size=shape.vocab_size, seed=args.seed)
    # Other prompts than the measured ones, so warming up leaves nothing in the prefix cache they could hit.
    warmup = random_workload(
        min(WARMUP_REQUESTS, args.num_requests), lengths[0], (WARMUP_OUTPUT_LEN, WARMUP_OUTPUT_LEN),
        vocab_size=shape.vocab_size, seed=args.seed + 1,
    )  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="pagerail-overhead-") as scratch:
        work = Path(args.work_dir or scratch)
        settings = RunSettings(
            model_dir=write_tiny_llama(work / "model", shape, seed=args.seed),
            requests=requests,
            warmup=warmup,
            device=args.device,
            dtype=args.dtype,
            block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            # One spare block per request: a step scheduled ahead may reach into the next block.
            num_blocks=kv_blocks_needed(requests, args.block_size) + len(requests),
            max_num_seqs=max(args.num_requests, args.users),
            async_scheduling=args.async_scheduling,
            timeout=args.timeout,
            cpus_per_worker=args.cpus_per_worker,
        )
        rounds = []
        for _ in range(args.rounds):
            ceiling = measure_forward_ceiling(
                settings.model_dir, requests, warmup=warmup, block_size=args.block_size,
                max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype, device=args.device,
            )  # fmt: skip
            rounds.append({"ceiling": ceiling, "offline": run_offline(settings)})
        parts: dict[str, Any] = median_round(rounds)
        if not args.skip_serve:
            parts["serve_tp1"] = run_served(settings, 1, args.users, work / "serve-tp1.log")
            if not args.skip_tp2:
                parts["serve_tp2"] = run_served(settings, 2, args.users, work / "serve-tp2.log")
    report = build_report(shape, describe(requests), args, parts)
    if args.json == "-":
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0
