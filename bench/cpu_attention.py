"""Time of one native CPU decode-attention call over three layouts of the same blocks: each sequence's blocks
in a row, interleaved (the engine's pattern when every sequence grows by a block in the same step), and
scattered at random. With --against, a second kernel source (an older build's, say) takes turns call by call
with the shipped one on the same inputs (each figure is the median call), and both must give the same output.

Usage:
  .venv/bin/python bench/cpu_attention.py [--seqs 256] [--context 130 384] [--rounds 2] [--against OLD.c]

  git show <commit>:worker/layers/csrc/paged_attention_cpu.c > /tmp/old.c   # a kernel to compare against
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch

from pagerail.worker.host_memory import zeros_on_huge_pages
from pagerail.worker.layers.cpu_paged_attention import NativeKernel, build_native_kernel


def _layouts(seqs: int, max_blocks: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    blocks = seqs * max_blocks
    return {
        "in a row": torch.arange(blocks).view(seqs, max_blocks),
        "interleaved": torch.arange(blocks).view(max_blocks, seqs).t().contiguous(),
        "scattered": torch.randperm(blocks, generator=generator).view(seqs, max_blocks),
    }


def _ms_per_call(kernels: list[NativeKernel], inputs: tuple, calls: int) -> list[float]:
    """Median ms of one call for each kernel, the kernels taking turns call by call, so a change in the
    machine's speed during the measurement reaches every kernel alike."""
    for kernel in kernels:
        for _ in range(3):
            kernel.decode(*inputs)
    times: list[list[float]] = [[] for _ in kernels]
    for _ in range(calls):
        for kernel, kernel_times in zip(kernels, times, strict=True):
            started = time.perf_counter()
            kernel.decode(*inputs)
            kernel_times.append(time.perf_counter() - started)
    return [statistics.median(kernel_times) * 1e3 for kernel_times in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--context", type=int, nargs=2, default=(130, 384), metavar=("MIN", "MAX"))
    parser.add_argument("--heads", type=int, nargs=2, default=(4, 2), metavar=("QUERY", "KV"))
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--against", type=Path, default=None, help="another kernel source to time alongside")
    args = parser.parse_args()
    kernels = {"shipped": build_native_kernel()}
    if args.against is not None:
        scratch = Path(tempfile.mkdtemp(prefix="pagerail-kernel-"))
        kernels[args.against.name] = build_native_kernel(args.against, scratch)
    generator = torch.Generator().manual_seed(0)
    (num_heads, num_kv_heads), bs = args.heads, args.block_size
    max_blocks = -(-args.context[1] // bs)
    slots = args.seqs * max_blocks * bs
    key_cache = zeros_on_huge_pages((num_kv_heads, slots, args.head_dim), torch.float32).normal_(generator=generator)
    value_cache = zeros_on_huge_pages((num_kv_heads, slots, args.head_dim), torch.float32).normal_(generator=generator)
    queries = torch.randn(args.seqs, num_heads, args.head_dim, generator=generator)
    lens = torch.randint(args.context[0], args.context[1] + 1, (args.seqs,), generator=generator)
    layouts = _layouts(args.seqs, max_blocks, generator)
    shape = f"{num_heads} query / {num_kv_heads} KV heads of {args.head_dim}, blocks of {bs}"
    print(f"{args.seqs} sequences, context {args.context[0]}-{args.context[1]}, {shape}; ms per call (one layer)")
    print("round  layout       " + "  ".join(f"{name:>12}" for name in kernels))
    for round_number in range(1, args.rounds + 1):
        for layout, table in layouts.items():
            inputs = (queries, key_cache, value_cache, table, lens, bs, args.head_dim**-0.5)
            outputs = [kernel.decode(*inputs) for kernel in kernels.values()]
            if any(not torch.allclose(out, outputs[0], atol=1e-5) for out in outputs[1:]):
                raise SystemExit("the kernels disagree")
            times = _ms_per_call(list(kernels.values()), inputs, args.calls)
            print(f"{round_number:5d}  {layout:11s}  " + "  ".join(f"{ms:12.2f}" for ms in times))


if __name__ == "__main__":
    main()
