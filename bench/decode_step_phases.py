"""Where a busy decode step's time goes outside the forward pass, timed inside the offline engine.

The overhead workload of `pagerail bench overhead` (a small random Llama, 256 requests of 128 prompt and 256 output
tokens) runs through `LLM.generate`; for every step of at least 200 bare decodes (the step message's
`decode_handles`) it adds up the head's time outside the rank's step and the rank's time outside its forward pass
and LM head. Each run prints the per-step means; the last line gives the median over the runs. Whole-run shares
of the ceiling move with this machine's speed from run to run; these per-step figures move much less, so two
builds are best compared by running this script from each checkout in turn.

Usage:
  .venv/bin/python bench/decode_step_phases.py --runs 3
"""

from __future__ import annotations

import argparse
import functools
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

from pagerail import LLM, SamplingParams
from pagerail.cluster.bench.forward_ceiling import kv_blocks_needed
from pagerail.cluster.bench.tiny_llama import TinyLlamaShape, write_tiny_llama
from pagerail.cluster.bench.workload import random_workload
from pagerail.cluster.core.engine import EngineCore
from pagerail.cluster.core.step_builder import StepMessageBuilder
from pagerail.worker.model_runner import ModelRunner
from pagerail.worker.worker import Worker

BUSY_DECODES = 200


class StepTimer:
    """Wraps the engine's step, the rank's step, its forward and its LM head; counts only busy decode steps."""

    def __init__(self) -> None:
        self.totals: Counter[str] = Counter()
        self.counting = False
        build = StepMessageBuilder.build

        def timed_build(builder, out):
            batch = build(builder, out)
            self.counting = len(batch.decode_handles) >= BUSY_DECODES and not batch.new_requests
            self.totals["steps"] += self.counting
            return batch

        StepMessageBuilder.build = timed_build
        self._wrap(EngineCore, "step", "engine")
        self._wrap(Worker, "execute_step", "rank")
        self._wrap(ModelRunner, "_forward", "forward")

    def wrap_model(self, model) -> None:
        self._wrap(type(model), "compute_logits", "lm_head")

    def _wrap(self, owner, name: str, label: str) -> None:
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                if self.counting:
                    self.totals[label] += time.perf_counter() - started

        setattr(owner, name, timed)

    def per_step_ms(self) -> tuple[float, float]:
        """(head outside the rank's step, rank outside forward and LM head), ms per busy decode step."""
        t, steps = self.totals, max(1, self.totals["steps"])
        return (t["engine"] - t["rank"]) / steps * 1e3, (t["rank"] - t["forward"] - t["lm_head"]) / steps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="LLM.generate runs of the whole workload (default 3)")
    args = parser.parse_args()
    shape = TinyLlamaShape()
    requests = random_workload(256, (128, 128), (256, 256), vocab_size=shape.vocab_size, seed=0)
    warmup = random_workload(16, (128, 128), (4, 4), vocab_size=shape.vocab_size, seed=1)
    timer = StepTimer()
    with tempfile.TemporaryDirectory(prefix="pagerail-phases-") as scratch:
        llm = LLM(
            str(write_tiny_llama(Path(scratch) / "model", shape, seed=0)),
            device="cpu",
            block_size=16,
            num_gpu_blocks=kv_blocks_needed(requests, 16) + len(requests),
            max_num_seqs=256,
            max_num_batched_tokens=2048,
        )
        timer.wrap_model(llm.engine.executor.worker.runner.model)

        def run(batch) -> None:
            params = [SamplingParams(temperature=0.0, max_tokens=r.output_len, ignore_eos=True) for r in batch]
            llm.generate([r.prompt_token_ids for r in batch], params)

        run(warmup)
        heads, ranks = [], []
        for _ in range(args.runs):
            timer.totals.clear()
            run(requests)
            head, rank = timer.per_step_ms()
            heads.append(head)
            ranks.append(rank)
            print(f"{timer.totals['steps']} busy decode steps: head {head:.3f} ms, rank outside forward {rank:.3f} ms")
    print(f"median of {args.runs}: head {statistics.median(heads):.3f} ms, rank {statistics.median(ranks):.3f} ms")


if __name__ == "__main__":
    main()
