"""Head → worker dispatch cost: the head's time per decode step outside the ranks' compute, and wire bytes.

Part 1 runs a head actor and its worker ranks on Ray over loopback gRPC (at every tensor-parallel size
asked for, 1 included) with a tiny dummy-weight model, so the figures are dominated by dispatch, at several
numbers of decoding requests. Per step it reports:

- outside compute: from when the ranks could start the step (its submission, or the previous step's last
  reply when it was queued behind that step) to its last reply, minus the slowest rank's compute;
- ranks idle: from the previous step's last reply to this one's, minus the slowest rank's compute; above
  "outside compute" when the head submitted the step late (its own scheduling was not hidden);
- round trip: from when the ranks could start the step to its last reply.

Part 2 measures, for the embedded model in-process, the share of each decode step spent outside the model's
forward pass.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import ray

from pagerail import LLM, SamplingParams
from pagerail.cluster.bench.tiny_llama import TinyLlamaShape, hf_config
from pagerail.cluster.core.engine_request import EngineRequest

# Dummy weights of a tiny Llama: the step's compute is small next to its dispatch.
TINY_SHAPE = TinyLlamaShape(hidden_size=64, intermediate_size=128)


def dispatch_figures(tp: int, sizes: list[int], max_tokens: int, async_scheduling: bool | None = None) -> list[dict]:
    model_dir = Path(tempfile.mkdtemp()) / "tiny"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(hf_config(TINY_SHAPE)))
    ray.init(num_cpus=tp + 2, include_dashboard=False, log_to_driver=False)
    # ray_address: a head actor and worker ranks over gRPC even at tensor-parallel size 1.
    llm = LLM(
        str(model_dir),
        load_format="dummy",
        tensor_parallel_size=tp,
        num_gpu_blocks=8192,
        max_num_seqs=512,
        ray_address="auto",
        async_scheduling=async_scheduling,
    )
    head = llm._cluster.heads[0]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    rows = []
    try:
        for size in sizes:
            streams = [head.stream.remote(EngineRequest(f"n{size}-{i}", [7 + i % 50] * 8, params)) for i in range(size)]
            firsts = [next(stream) for stream in streams]
            ray.get(firsts)  # every request has its first token: from here on, steps are pure decodes
            ray.get(head.reset_dispatch_stats.remote())
            for stream in streams:
                for _ in stream:
                    pass
            stats = ray.get(head.stats.remote())["dispatch"]
            steps = max(stats["steps"], 1)
            rows.append(
                {
                    "tensor_parallel": tp,
                    "decoding_requests": size,
                    "steps": stats["steps"],
                    "outside_compute_p50_ms": 1e3 * stats["overhead_p50_s"],
                    "outside_compute_p99_ms": 1e3 * stats["overhead_p99_s"],
                    "ranks_idle_p50_ms": 1e3 * stats.get("idle_p50_s", float("nan")),
                    "round_trip_p50_ms": 1e3 * stats["round_trip_p50_s"],
                    "bytes_per_step_per_request": stats["total_bytes_sent"] / (steps * tp * size),
                }
            )
    finally:
        llm.shutdown()
        ray.shutdown()
    return rows


def outside_forward_share(num_requests: int, decode_steps: int) -> dict:
    """In-process, embedded model: (step wall time − forward time) / step wall time over decode steps."""
    llm = LLM(None)
    engine = llm.engine
    worker = engine.executor.worker
    forward_times: list[float] = []
    execute = worker.execute_step

    def timed_execute(batch):
        result = execute(batch)
        forward_times.append(result.forward_seconds)
        return result

    engine.executor.worker.execute_step = timed_execute
    rng = random.Random(0)
    for i in range(num_requests):
        prompt = [rng.randrange(100, 40000) for _ in range(rng.randint(32, 256))]
        params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 8, ignore_eos=True)
        engine.add_request(EngineRequest(f"r{i}", prompt, params))
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()
    forward_times.clear()
    walls = []
    for _ in range(decode_steps):
        started = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - started)
    outside = [w - f for w, f in zip(walls, forward_times, strict=True)]
    return {
        "decoding_requests": num_requests,
        "step_p50_ms": 1e3 * statistics.median(walls),
        "forward_p50_ms": 1e3 * statistics.median(forward_times),
        "outside_forward_share": sum(outside) / sum(walls),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tp", type=int, nargs="+", default=(2, 1), help="tensor-parallel sizes to measure")
    parser.add_argument("--sizes", type=int, nargs="+", default=(1, 64, 256))
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--embedded-requests", type=int, default=32)
    parser.add_argument("--embedded-steps", type=int, default=20)
    parser.add_argument("--skip-embedded", action="store_true", help="only part 1 (dispatch over gRPC)")
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="overlapped steps on or off (default: the engine's, off on CPUs)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    rows = []
    for tp in args.tp:
        rows += dispatch_figures(tp, list(args.sizes), args.max_tokens, args.async_scheduling)
    report = {"dispatch": rows}
    if not args.skip_embedded:
        report["embedded_tp1"] = outside_forward_share(args.embedded_requests, args.embedded_steps)
    if args.json:
        print(json.dumps(report, indent=2))
        return
    print("dispatch on loopback gRPC, head time per decode step outside the ranks' compute (see the module doc):")
    print("  tp  requests  steps  outside compute p50/p99 ms  ranks idle p50 ms  round trip p50 ms  bytes/step/request")
    for row in report["dispatch"]:
        print(
            f"  {row['tensor_parallel']:2d}  {row['decoding_requests']:8d}  {row['steps']:5d}  "
            f"{row['outside_compute_p50_ms']:12.3f} / {row['outside_compute_p99_ms']:8.3f}  "
            f"{row['ranks_idle_p50_ms']:17.3f}  {row['round_trip_p50_ms']:17.3f}  "
            f"{row['bytes_per_step_per_request']:18.1f}"
        )
    if args.skip_embedded:
        return
    e = report["embedded_tp1"]
    print(
        f"embedded model, tp 1, {e['decoding_requests']} decoding requests: step p50 {e['step_p50_ms']:.1f} ms, "
        f"forward p50 {e['forward_p50_ms']:.1f} ms, outside the forward pass {100 * e['outside_forward_share']:.1f}%"
    )


if __name__ == "__main__":
    main()
