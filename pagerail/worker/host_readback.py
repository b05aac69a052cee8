"""A step's small results (sampled tokens, their logprobs) to the host with one wait: pinned buffers and an event."""

from __future__ import annotations

from collections.abc import Callable

import torch


class HostReadback:
    """`read(*tensors)` copies every tensor into a page-locked host buffer without blocking, records one event and
    waits for it: the host waits once per step, for its own copies only, not for the whole device.

    `tensor.tolist()` on a CUDA tensor would instead wait once per tensor, and `torch.cuda.synchronize()` waits
    for every stream of the device (a copy or a collective on another stream included).
    """

    def __init__(self, device: torch.device, event_factory: Callable[[], object] | None = None) -> None:
        self.device = device
        self._pinned = device.type == "cuda"
        if event_factory is None:
            event_factory = torch.cuda.Event if self._pinned else None
        self._event = event_factory() if event_factory is not None else None
        self._buffers: dict[torch.dtype, torch.Tensor] = {}
        self.num_waits = 0  # how many times the host has waited, for tests and metrics

    def read(self, *tensors: torch.Tensor) -> list[list]:
        """Each tensor's values as nested Python lists, in order, after one wait."""
        needed: dict[torch.dtype, int] = {}
        for tensor in tensors:
            needed[tensor.dtype] = needed.get(tensor.dtype, 0) + tensor.numel()
        for dtype, size in needed.items():
            self._reserve(dtype, size)
        used = dict.fromkeys(needed, 0)
        hosts = []
        for tensor in tensors:
            start = used[tensor.dtype]
            used[tensor.dtype] = start + tensor.numel()
            host = self._buffers[tensor.dtype][start : used[tensor.dtype]].view(tensor.shape)
            host.copy_(tensor, non_blocking=self._pinned)
            hosts.append(host)
        if self._event is not None:
            self._event.record()
            self._event.synchronize()
        self.num_waits += 1
        return [host.tolist() for host in hosts]

    def _reserve(self, dtype: torch.dtype, size: int) -> None:
        buffer = self._buffers.get(dtype)
        if buffer is None or buffer.numel() < size:
            # Doubling keeps reallocations (and their pinning) rare as batches grow.
            grown = max(size, 2 * (buffer.numel() if buffer is not None else 256))
            self._buffers[dtype] = torch.empty(grown, dtype=dtype, pin_memory=self._pinned)


def to_host(readback: HostReadback | None, *tensors: torch.Tensor) -> list[list]:
    """The tensors' values on the host: through `readback` (one wait for all), else one tolist() each (the CPU)."""
    if readback is not None:
        return readback.read(*tensors)
    return [tensor.tolist() for tensor in tensors]
