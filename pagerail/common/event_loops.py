"""The event loop pagerail's own threads and clients run on: uvloop where installed, else asyncio's.

A streamed token costs the frontend a socket write and a few task wake-ups, and the head an output hand-off and a
step send, each a pass of the event loop; uvloop does that pass in C. Ray's async actors (the head and the
frontend) already pick uvloop when it is installed; the threads and clients that make their own loop ask here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

try:
    import uvloop
except ImportError:  # a platform without uvloop (Windows) runs on asyncio's own loop
    uvloop = None

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A fresh event loop, not set as any thread's current one."""
    return uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run(main) on the loop new_event_loop makes."""
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(main)
