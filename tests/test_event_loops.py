"""pagerail's own loops (the head's step streams, the benchmark clients) run on uvloop where it is installed."""

from __future__ import annotations

import asyncio
import sys

import pytest

from pagerail.common import event_loops

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="uvloop does not run on Windows")


def test_new_loops_are_uvloop_loops():
    import uvloop  # a dependency on this platform: missing, this fails rather than skips

    loop = event_loops.new_event_loop()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()


def test_run_returns_the_result_from_a_uvloop_loop_and_closes_it():
    import uvloop

    async def which_loop():
        await asyncio.sleep(0)
        return asyncio.get_running_loop()

    loop = event_loops.run(which_loop())
    assert isinstance(loop, uvloop.Loop) and loop.is_closed()
