"""Fails on anything that would make the host wait for the device: what a CUDA graph capture cannot contain.

`HostSyncGuard` is a TorchDispatchMode plus a few patched entry points, so it runs on the CPU too, where a
captured forward is re-run by a stand-in backend. It raises `HostSync` on:

- ops whose result size or value the host needs: `.item()`/`int(t)`/`bool(t)` (`_local_scalar_dense`,
  `is_nonzero`), `nonzero`, `masked_select`, `unique*`, `repeat_interleave` without `output_size`, `equal`,
  indexing or index_put with a boolean mask;
- copies between devices (`copy_`, `_to_copy` to another device), `.cpu()`, `.tolist()`, `.numpy()`, and
  `.item()`/`int()`/`float()`/`bool()`/`operator.index()` at the Python level too (inference_mode's CPU fast path);
- `torch.cuda.synchronize`, and stream or event synchronize.

Triton kernel launches run with the guard suspended (`exempt_kernels`): under the interpreter a launch reads
its arguments on the host, which on a GPU happens on the device.
"""

from __future__ import annotations

import contextlib
import threading
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_SYNCING_OPS = {
    aten._local_scalar_dense.default,
    aten.is_nonzero.default,
    aten.nonzero.default,
    aten.nonzero.out,
    aten.masked_select.default,
    aten.equal.default,
    aten.unique_consecutive.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.repeat_interleave.Tensor,
}
# Under inference_mode `.to(device)` reaches the mode as aten.to itself, not decomposed into _to_copy.
_COPYING_OPS = {aten._to_copy.default, aten.to.dtype_layout, aten.to.device}
_INDEXING_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}


class HostSync(AssertionError):
    """An operation that waits for the device ran where none may."""


def _is_mask(index: object) -> bool:
    return isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)


class HostSyncGuard(TorchDispatchMode):
    """`with HostSyncGuard():` raises HostSync at the first host sync inside the block (see the module)."""

    def __init__(self) -> None:
        super().__init__()
        self._suspended = threading.local()
        self._patches: list[tuple[object, str, object]] = []

    # --- the dispatcher's view ----------------------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.suspended:
            self._check(func, args, kwargs)
        return func(*args, **kwargs)

    def _check(self, func, args, kwargs) -> None:
        if func in _SYNCING_OPS:
            if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is not None:
                return
            self.fail(f"aten.{func.__name__}")
        if func in _INDEXING_OPS:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(_is_mask(index) for index in indices or ()):
                self.fail(f"aten.{func.__name__} with a boolean mask")
        if func is aten.copy_.default and args[0].device != args[1].device:
            self.fail(f"copy from {args[1].device} to {args[0].device}")
        if func in _COPYING_OPS:
            target = args[1] if func is aten.to.device else kwargs.get("device")
            if target is not None and torch.device(target) != args[0].device:
                self.fail(f"copy from {args[0].device} to {target}")

    # --- entry points that never reach the dispatcher on CPU tensors --------------------------------------------

    def __enter__(self) -> HostSyncGuard:
        # Under inference_mode a CPU tensor's item() and int() skip the Python dispatcher, so they are caught here.
        for name in ("item", "__int__", "__float__", "__bool__", "__index__"):
            self._patch(torch.Tensor, name, f"Tensor.{name}()")
        self._patch(torch.Tensor, "tolist", "Tensor.tolist()")
        self._patch(torch.Tensor, "numpy", "Tensor.numpy()")
        self._patch(torch.Tensor, "cpu", "Tensor.cpu()")
        self._patch(torch.cuda, "synchronize", "torch.cuda.synchronize()")
        self._patch(torch.cuda.Stream, "synchronize", "Stream.synchronize()")
        self._patch(torch.cuda.Event, "synchronize", "Event.synchronize()")
        return super().__enter__()

    def __exit__(self, *exc) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for owner, name, original in reversed(self._patches):
                setattr(owner, name, original)
            self._patches.clear()

    def _patch(self, owner: object, name: str, what: str) -> None:
        original = getattr(owner, name)
        guard = self

        def refused(*args, **kwargs):
            if not guard.suspended:
                guard.fail(what)
            return original(*args, **kwargs)

        self._patches.append((owner, name, original))
        setattr(owner, name, refused)

    # --- suspension for kernel launches -------------------------------------------------------------------------

    @property
    def suspended(self) -> bool:
        return getattr(self._suspended, "depth", 0) > 0

    @contextlib.contextmanager
    def suspend(self):
        self._suspended.depth = getattr(self._suspended, "depth", 0) + 1
        try:
            yield
        finally:
            self._suspended.depth -= 1

    def fail(self, what: str) -> None:
        where = "".join(traceback.format_stack(limit=12)[:-2])
        raise HostSync(f"host sync in a captured region: {what}\n{where}")


def exempt_kernels(guard: HostSyncGuard):
    """Within the block, every engine Triton kernel launches with `guard` suspended."""
    from tests.triton_launches import around_kernel_launches

    def suspended(launch, args, kwargs):
        with guard.suspend():
            return launch(*args, **kwargs)

    return around_kernel_launches(suspended)
