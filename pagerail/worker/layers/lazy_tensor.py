"""Checkpoint tensors read on demand, so each tensor-parallel rank reads only the slice it keeps."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

# safetensors dtype names (as `get_dtype()` spells them) → torch dtypes.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": getattr(torch, "float8_e4m3fn", None),
    "F8_E5M2": getattr(torch, "float8_e5m2", None),
}


class LazyTensor:
    """A window onto a checkpoint tensor: shape and dtype are known up front, bytes are read on request.

    `narrow(dim, start, length)` and `full()` read and return real tensors (in the checkpoint's dtype; the
    caller's `copy_` casts to the model's). `split` and `window` return lazy views, so a fused checkpoint
    tensor can be cut into its parts without reading any of it. Any other torch operation on a LazyTensor
    reads the whole window first (see `__torch_function__`), so code written for plain tensors still works.
    """

    def __init__(
        self, source: Any, shape: Sequence[int], dtype: torch.dtype, offsets: Sequence[int] | None = None
    ) -> None:
        # `source` is indexable by a tuple of slices and returns a tensor: a safetensors slice or a tensor.
        self._source = source
        self.shape = torch.Size(shape)
        self.dtype = dtype
        self._offsets = tuple(offsets) if offsets is not None else (0,) * len(self.shape)

    @classmethod
    def from_safetensors(cls, handle: Any, name: str) -> LazyTensor:
        """The tensor `name` of an open `safetensors.safe_open` handle, with nothing read yet."""
        piece = handle.get_slice(name)
        dtype_name = piece.get_dtype()
        dtype = _SAFETENSORS_DTYPES.get(dtype_name)
        if dtype is None:
            raise ValueError(f"checkpoint tensor {name!r} has dtype {dtype_name}, which this torch cannot hold")
        return cls(piece, piece.get_shape(), dtype)

    def dim(self) -> int:
        return len(self.shape)

    def size(self, dim: int | None = None) -> torch.Size | int:
        return self.shape if dim is None else self.shape[dim]

    def numel(self) -> int:
        return self.shape.numel()

    @property
    def nbytes(self) -> int:
        return self.numel() * self.dtype.itemsize

    def window(self, dim: int, start: int, length: int) -> LazyTensor:
        """A lazy view of `length` entries from `start` along `dim`; reads nothing."""
        dim = self._check_dim(dim)
        if start < 0 or length < 0 or start + length > self.shape[dim]:
            raise ValueError(f"window start={start} length={length} exceeds size {self.shape[dim]} of dimension {dim}")
        shape = list(self.shape)
        shape[dim] = length
        offsets = list(self._offsets)
        offsets[dim] += start
        return LazyTensor(self._source, shape, self.dtype, offsets)

    def split(self, sizes: Sequence[int], dim: int = 0) -> list[LazyTensor]:
        """Lazy views of consecutive `sizes` along `dim`, which must add up to that dimension's size."""
        dim = self._check_dim(dim)
        if sum(sizes) != self.shape[dim]:
            raise ValueError(f"split sizes {list(sizes)} add up to {sum(sizes)}, expected {self.shape[dim]}")
        parts, start = [], 0
        for size in sizes:
            parts.append(self.window(dim, start, size))
            start += size
        return parts

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        """Read `length` entries from `start` along `dim` (and all of the other dimensions) as a real tensor."""
        return self.window(dim, start, length).full()

    def full(self) -> torch.Tensor:
        """Read the whole window as a real tensor."""
        index = tuple(slice(offset, offset + size) for offset, size in zip(self._offsets, self.shape, strict=True))
        return self._read(index)

    def _read(self, index: tuple[slice, ...]) -> torch.Tensor:
        # The single place bytes leave the file (tests count them here); `...` covers zero-dimensional tensors.
        return self._source[index if index else ...]

    def _check_dim(self, dim: int) -> int:
        if not -self.dim() <= dim < self.dim():
            raise ValueError(f"dim must be below {self.dim()} for a tensor of shape {tuple(self.shape)}, got {dim}")
        return dim % self.dim()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        # A torch op that does not know about slices (e.g. a replicated weight's `param.data.copy_(full)`)
        # gets the whole tensor: correct, and exactly what a replicated weight needs to read anyway.
        def real(value: Any) -> Any:
            if isinstance(value, LazyTensor):
                return value.full()
            if isinstance(value, (list, tuple)):
                return type(value)(real(item) for item in value)
            return value

        return func(*real(tuple(args)), **{key: real(value) for key, value in (kwargs or {}).items()})

    def __repr__(self) -> str:
        return f"LazyTensor(shape={tuple(self.shape)}, dtype={self.dtype}, offsets={self._offsets})"


def materialize(full: torch.Tensor | LazyTensor) -> torch.Tensor:
    """A real tensor for a real or lazy one (a lazy one is read in full)."""
    return full.full() if isinstance(full, LazyTensor) else full
