"""The forward pass with the native CPU kernels for norm, rotary, activation and KV write against the torch path
they replace, on the batches of the overhead workload (`pagerail bench overhead`'s model and requests, replayed
through one rank as its forward ceiling does). The two take turns replay by replay in one process, so a change in
the machine's speed reaches both alike; each line is one replay, the last two the medians.

Usage:
  .venv/bin/python bench/cpu_fused.py [--rounds 4] [--num-requests 256] [--hidden-size 128] [--num-layers 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from pagerail.cluster.bench.forward_ceiling import _Replay, kv_blocks_needed
from pagerail.cluster.bench.tiny_llama import TinyLlamaShape, write_tiny_llama
from pagerail.cluster.bench.workload import random_workload
from pagerail.common.engine_args import engine_config
from pagerail.worker.config import WorkerConfig
from pagerail.worker.layers import cpu_fused
from pagerail.worker.worker import Worker


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--hidden-size", type=int, default=TinyLlamaShape.hidden_size)
    parser.add_argument("--num-layers", type=int, default=TinyLlamaShape.num_layers)
    parser.add_argument("--intermediate-size", type=int, default=TinyLlamaShape.intermediate_size)
    args = parser.parse_args()
    if cpu_fused.fused_kernels() is None:
        raise SystemExit("the native kernels are not available here (see the warning above)")
    shape = TinyLlamaShape(
        hidden_size=args.hidden_size, num_layers=args.num_layers, intermediate_size=args.intermediate_size
    )
    lengths = ((args.prompt_len, args.prompt_len), (args.output_len, args.output_len))
    requests = random_workload(args.num_requests, *lengths, vocab_size=shape.vocab_size, seed=0)
    with tempfile.TemporaryDirectory() as scratch:
        model = write_tiny_llama(Path(scratch) / "model", shape)
        engine = engine_config(
            dtype="float32", device="cpu", block_size=16, num_gpu_blocks=kv_blocks_needed(requests, 16),
            max_num_batched_tokens=2048,
        )  # fmt: skip
        config = WorkerConfig(str(model), engine)
        worker = Worker(config)
        _Replay(worker, requests[:16], 2048).run()  # kernel builds and weight packing outside the measurement
        results: dict[str, list[tuple[float, float]]] = {"torch": [], "native": []}
        for _ in range(args.rounds):
            for path in results:
                cpu_fused.ENABLED = path == "native"
                replay = _Replay(worker, requests, 2048)
                replay.run()
                decode_p50 = statistics.median(replay.decode_forwards) * 1e3
                results[path].append((replay.forward_seconds, decode_p50))
                print(f"{path:6s}  forward {replay.forward_seconds:.3f} s  decode forward p50 {decode_p50:.2f} ms")
        cpu_fused.ENABLED = True
    for path, runs in results.items():
        seconds = statistics.median(r[0] for r in runs)
        p50 = statistics.median(r[1] for r in runs)
        print(f"median {path:6s}  forward {seconds:.3f} s  decode forward p50 {p50:.2f} ms")


if __name__ == "__main__":
    main()
