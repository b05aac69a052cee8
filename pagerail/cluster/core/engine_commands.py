"""The commands other threads send to the engine loop thread (cluster/core/async_engine.py), one type each."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.cluster.core.output_sink import OutputSink
from pagerail.cluster.core.scheduler_output import PauseMode


@dataclass(frozen=True, slots=True)
class Add:
    """Admit `request`; its admission, deltas and errors go to `sink`, tagged with `key`."""

    request: EngineRequest
    sink: OutputSink
    key: Hashable


@dataclass(frozen=True, slots=True)
class Append:
    """The next input chunk of an open streaming-input session."""

    request_id: str
    token_ids: list[int]
    final: bool


@dataclass(frozen=True, slots=True)
class Abort:
    """Abort a request; with `sink`, only while that sink still owns it under `key`."""

    request_id: str
    sink: OutputSink | None = None
    key: Hashable = None
    stopped: bool = False  # the caller found a stop string: the request finishes with reason "stop"


@dataclass(frozen=True, slots=True)
class DropSink:
    """The consumer behind `sink` is gone: abort every request it owns."""

    sink: OutputSink


@dataclass(frozen=True, slots=True)
class Pause:
    """Hold new requests, every request, or none (resume)."""

    mode: PauseMode


@dataclass(frozen=True, slots=True)
class Call:
    """Run `fn(engine)` on the loop thread and settle `future` with its result; with `drain`, only once no step is
    in flight (their outputs delivered first)."""

    fn: Callable[[Any], Any]
    future: Future
    drain: bool = False


Command = Add | Append | Abort | DropSink | Pause | Call
