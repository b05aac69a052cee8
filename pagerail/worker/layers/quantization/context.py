"""The weight format of the model being built, so layers deep inside it create quantized parameters without every
constructor passing it along."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from pagerail.worker.layers.quantization.config import QuantConfig

_BUILDING: ContextVar[QuantConfig | None] = ContextVar("pagerail_building_quant_config", default=None)


@contextmanager
def building_with(config: QuantConfig | None) -> Iterator[None]:
    """Layers constructed inside see `config` through `building_config()`."""
    token = _BUILDING.set(config)
    try:
        yield
    finally:
        _BUILDING.reset(token)


def building_config() -> QuantConfig | None:
    """The weight format of the model under construction; None outside `building_with` or when unquantized."""
    return _BUILDING.get()
