"""The test suite's Ray start retries once on Ray's own startup timeout, and on nothing else."""

from __future__ import annotations

import pytest

from tests.ray_start import with_one_retry

TIMEOUT = RuntimeError("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_y")


def scripted(*outcomes):
    calls: list[str] = []
    pending = list(outcomes)

    def start():
        calls.append("start")
        outcome = pending.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    return start, lambda: calls.append("cleanup"), calls


def test_a_startup_timeout_is_cleaned_up_and_tried_once_more():
    start, cleanup, calls = scripted(TIMEOUT, "up")
    assert with_one_retry(start, cleanup) == "up" and calls == ["start", "cleanup", "start"]


def test_a_second_timeout_fails():
    start, cleanup, calls = scripted(TIMEOUT, TIMEOUT)
    with pytest.raises(RuntimeError, match="Timed out waiting for file"):
        with_one_retry(start, cleanup)
    assert calls == ["start", "cleanup", "start"]


def test_any_other_error_fails_at_once():
    start, cleanup, calls = scripted(RuntimeError("address already in use"))
    with pytest.raises(RuntimeError, match="address already in use"):
        with_one_retry(start, cleanup)
    assert calls == ["start"]
