"""Why mixed prefill+decode steps run eagerly: their device launches per step, counted on the Triton path.

A mixed step is never replayed from a graph, so each of its launches costs host time. The count must not grow
with the step's composition (decodes, prefills, their lengths): then the host cost per mixed step is a constant,
a + b × layers launches, set against device work that grows with the step's tokens. `python -m
tests.test_mixed_step_launches` prints the counts and the host time per launch on this machine.
"""

from __future__ import annotations

import json
import random
import tempfile
import time
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.triton_interpreter import assert_interpreted_tests_pass, run_interpreted

# Child processes, the Triton interpreter or offline GPU builds: left out of `make test-fast`.
pytestmark = pytest.mark.slow

# (decodes running, prompts joining, prompt length range): each pair of steps is one mixed step then decodes.
COMPOSITIONS = [(1, 1, (3, 6)), (4, 1, (20, 40)), (8, 2, (3, 14)), (2, 3, (30, 60))]
# What a launch-free op never reaches: views, metadata and allocations.
_NOT_LAUNCHES = {"empty", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh", "_to_copy_meta"}


class LaunchCounter(TorchDispatchMode):
    """Counts the ops that launch device work (views and allocations excluded) and the Triton launches."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.triton = 0
        self._inside_kernel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self._inside_kernel and not func.is_view and func._schema.name.split("::")[-1] not in _NOT_LAUNCHES:
            self.ops += 1
        return func(*args, **(kwargs or {}))

    def counting_triton(self):
        """Each engine kernel launch counts once; what the interpreter runs inside it does not."""
        from tests.triton_launches import around_kernel_launches

        def counted(launch, args, kwargs):
            self.triton += 1
            self._inside_kernel += 1
            try:
                return launch(*args, **kwargs)
            finally:
                self._inside_kernel -= 1

        return around_kernel_launches(counted)

    @property
    def total(self) -> int:
        return self.ops + self.triton


def _forward_launches(runner, batch) -> tuple[int, object]:
    """Launches of one step's forward (the model and the logits; sampling and staging excluded)."""
    counter = LaunchCounter()
    forward = runner._forward

    def counted(flat):
        with counter, counter.counting_triton():
            return forward(flat)

    runner._forward = counted
    try:
        result = runner.execute(batch)
    finally:
        runner._forward = forward
    return counter.total, result


def measure(num_layers: int) -> dict:
    """Launches per mixed step and per decode step for each composition, on a `num_layers` tiny qwen3."""
    from pagerail.worker.model_runner import decode_path_of
    from tests.test_cuda_graphs import Head, make_runner
    from tests.tiny_models import make_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        runner = make_runner(make_tiny_model("qwen3", Path(tmp) / "m", num_layers=num_layers), 16, None)
        assert decode_path_of(runner.model, torch.device("cpu"), torch.float32) == "triton"
        rng, head, handle = random.Random(3), Head(), 0
        rows = []
        for decodes, joining, (shortest, longest) in COMPOSITIONS:
            for old in list(head.requests):
                head.finish(old)
            for _ in range(decodes):
                head.add(handle, [rng.randrange(3, 250) for _ in range(rng.randint(3, 9))])
                handle += 1
            head.keep(runner.execute(head.batch()))  # their prompts
            for _ in range(joining):
                head.add(handle, [rng.randrange(3, 250) for _ in range(rng.randint(shortest, longest))])
                handle += 1
            batch = head.batch()
            tokens = sum(len(r.tokens) - r.computed for r in head.requests.values())
            mixed, result = _forward_launches(runner, batch)
            head.keep(result)
            decode, result = _forward_launches(runner, head.batch())
            head.keep(result)
            rows.append({"decodes": decodes, "prefills": joining, "tokens": tokens, "mixed": mixed, "decode": decode})
    return {"layers": num_layers, "steps": rows}


def host_seconds_per_launch() -> float:
    """This machine's host time for one small eager op (dispatch and launch, next to no work)."""
    x = torch.zeros(8)
    for _ in range(200):
        x.add_(1.0)
    started = time.perf_counter()
    for _ in range(5000):
        x.add_(1.0)
    return (time.perf_counter() - started) / 5000


def _report() -> None:
    print(json.dumps({"runs": [measure(1), measure(2)], "host_seconds_per_launch": host_seconds_per_launch()}))


def test_interpreted_mixed_step_launches_do_not_grow_with_the_step(monkeypatch):
    """Runs under TRITON_INTERPRET=1: one launch count per layer count, whatever the step holds."""
    import pagerail.worker.layers.triton_attention as triton_attention

    if not triton_attention.INTERPRETED:
        pytest.skip("runs under TRITON_INTERPRET=1 only")
    # The CPU matmul picks its kernel per row count by timing this machine, and a packed-kernel call is no torch
    # op: left to choose, a busy machine can count one more launch in a long step than an idle one. One library
    # for every layer keeps the count a property of the step alone.
    monkeypatch.setenv("PAGERAIL_CPU_MATMUL", "mkl")
    one, two = measure(1), measure(2)
    for run in (one, two):
        mixed = {row["mixed"] for row in run["steps"]}
        decode = {row["decode"] for row in run["steps"]}
        assert len(mixed) == 1, f"{run['layers']} layers: mixed-step launches vary with the step: {run['steps']}"
        assert len(decode) == 1, f"{run['layers']} layers: decode-step launches vary: {run['steps']}"
    per_layer = two["steps"][0]["mixed"] - one["steps"][0]["mixed"]
    assert 5 <= per_layer <= 40, per_layer


def test_mixed_step_launches_on_the_triton_path():
    assert_interpreted_tests_pass(__file__, "interpreted", 1)


if __name__ == "__main__":
    result = run_interpreted(["-c", "from tests.test_mixed_step_launches import _report; _report()"])
    print(result.stdout or result.stderr[-4000:])
