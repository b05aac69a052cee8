"""Capture safety on the CPU: the decode forward a GPU captures as a graph makes the host wait for nothing.

A CUDA graph records device work only; an `.item()`, a `.tolist()`, a `nonzero` or a device-to-host copy inside
the captured forward either breaks the capture or, worse, is baked in as the value it had at capture time. The
runner here captures and replays its decode graphs through a stand-in backend that runs the forward under
`HostSyncGuard` (tests/host_sync_guard.py), on the Triton decode path the GPU takes (under the interpreter, in a
child process), and serves decode steps from the replays.
"""

from __future__ import annotations

import pytest
import torch

from tests.host_sync_guard import HostSync, HostSyncGuard, exempt_kernels
from tests.triton_interpreter import assert_interpreted_tests_pass

x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
mask = x > 5

SYNCS = {
    "item": lambda: x.sum().item(),
    "int": lambda: int(x[0, 1]),
    "bool": lambda: bool(x[0, 1] > 0),
    "float": lambda: float(x.max()),
    "index": lambda: [0, 1, 2][x.argmax() % 3],
    "tolist": lambda: x.tolist(),
    "numpy": lambda: x.numpy(),
    "cpu": lambda: x.cpu(),
    "nonzero": lambda: torch.nonzero(x),
    "mask_index": lambda: x[mask],
    "mask_index_put": lambda: x.clone().index_put_((mask,), torch.tensor(0.0)),
    "masked_select": lambda: torch.masked_select(x, mask),
    "unique": lambda: torch.unique(x),
    "repeat_interleave": lambda: torch.repeat_interleave(torch.tensor([1, 2])),
    "to_another_device": lambda: x.to("meta"),
    "cuda_synchronize": lambda: torch.cuda.synchronize(),
}

DEVICE_WORK = {
    "matmul": lambda: x @ x.T,
    "index_select": lambda: x.index_select(0, torch.tensor([2, 0])),
    "long_index": lambda: x[torch.tensor([1, 2])],
    "index_put_long": lambda: x.clone().index_put_((torch.tensor([0]),), torch.tensor(1.0)),
    "argmax": lambda: x.argmax(dim=-1),
    "where": lambda: torch.where(mask, x, 0.0),
    "same_device_copy": lambda: torch.empty_like(x).copy_(x),
    "to_dtype": lambda: x.to(torch.float16),
    "repeat_interleave_sized": lambda: torch.repeat_interleave(torch.tensor([1, 2]), output_size=3),
}


# The runner's forward runs under inference_mode, where CPU scalar reads skip the Python dispatcher.
GRAD_MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


@pytest.mark.parametrize("mode", sorted(GRAD_MODES))
@pytest.mark.parametrize("name", sorted(SYNCS))
def test_guard_refuses_each_kind_of_host_sync(name, mode):
    with GRAD_MODES[mode](), pytest.raises(HostSync), HostSyncGuard():
        SYNCS[name]()


@pytest.mark.parametrize("mode", sorted(GRAD_MODES))
@pytest.mark.parametrize("name", sorted(DEVICE_WORK))
def test_guard_lets_device_work_through(name, mode):
    with GRAD_MODES[mode](), HostSyncGuard():
        DEVICE_WORK[name]()


def test_guard_restores_what_it_patched_and_suspends():
    guard = HostSyncGuard()
    with guard:
        with guard.suspend():
            assert x.tolist()[0][0] == 0.0
        with pytest.raises(HostSync):
            x.tolist()
    assert x.tolist()[0][0] == 0.0 and torch.Tensor.tolist.__name__ == "tolist"


# --- the runner's captured decode forward, on the Triton path -------------------------------------------------------


class GuardedBackend:
    """Stand-in graphs whose capture and every replay run the forward under a fresh HostSyncGuard."""

    def __init__(self) -> None:
        self.captured: list[int] = []
        self.replays = 0
        self.syncs: list[HostSync] = []

    def _guarded(self, fn) -> None:
        # The runner falls back to eager decodes when a capture raises, so the sync is kept here too.
        guard = HostSyncGuard()
        try:
            with guard, exempt_kernels(guard):
                fn()
        except HostSync as sync:
            self.syncs.append(sync)
            raise

    def capture(self, fn):
        self._guarded(fn)
        self.captured.append(fn.args[0])

        def replay() -> None:
            self.replays += 1
            self._guarded(fn)

        return replay

    def memory(self) -> tuple[int, int]:
        return 0, 0

    def synchronize(self) -> None:
        pass


def _run_guarded_decodes() -> GuardedBackend:
    """A runner on the Triton decode path with guarded stand-in graphs, through prefills and padded decodes."""
    import tempfile
    from pathlib import Path

    from pagerail.worker.model_runner import decode_path_of
    from tests.test_cuda_graphs import SHORT_STAGES, make_runner, run_stages
    from tests.tiny_models import make_tiny_model

    backend = GuardedBackend()
    with tempfile.TemporaryDirectory() as tmp:
        runner = make_runner(make_tiny_model("qwen3", Path(tmp) / "qwen3"), 8, backend)
        assert decode_path_of(runner.model, torch.device("cpu"), torch.float32) == "triton"
        run_stages(SHORT_STAGES, 5, lambda stage, batch: runner.execute(batch))
    assert runner.num_replayed_steps == backend.replays
    return backend


def test_interpreted_captured_decode_forward_never_syncs():
    """Runs under TRITON_INTERPRET=1 (from the test below): capture and replays pass the guard."""
    import pagerail.worker.layers.triton_attention as triton_attention

    if not triton_attention.INTERPRETED:
        pytest.skip("runs under TRITON_INTERPRET=1 only")
    backend = _run_guarded_decodes()
    assert backend.syncs == []
    assert backend.captured == [8, 4, 2, 1] and backend.replays > 0


def test_interpreted_guard_catches_a_sync_in_the_captured_forward(monkeypatch):
    """Runs under TRITON_INTERPRET=1: the same run with a host read in the norm fails at capture."""
    import pagerail.worker.layers.triton_attention as triton_attention
    import pagerail.worker.layers.triton_fused as triton_fused

    if not triton_attention.INTERPRETED:
        pytest.skip("runs under TRITON_INTERPRET=1 only")
    fused_norm = triton_fused.rms_norm

    def checked_norm(x, *args, **kwargs):
        # A broken variant: a NaN check that reads a value back to the host on every layer.
        if torch.isnan(x).any():
            raise ValueError("NaN in the hidden states")
        return fused_norm(x, *args, **kwargs)

    monkeypatch.setattr(triton_fused, "rms_norm", checked_norm)
    backend = _run_guarded_decodes()
    assert backend.syncs, "the guard let a host read through"
    assert "Tensor.__bool__()" in str(backend.syncs[0]) and "checked_norm" in str(backend.syncs[0])
    assert backend.replays == 0  # the runner fell back to eager decodes


@pytest.mark.slow
def test_captured_decode_forward_on_the_triton_path_never_syncs():
    assert_interpreted_tests_pass(__file__, "interpreted", 2)
