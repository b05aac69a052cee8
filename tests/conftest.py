"""Shared pytest fixtures: the embedded default model, converted once per test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import settings

if os.environ.get("PYTEST_XDIST_WORKER"):
    # The fast tier runs one pytest worker per core: each worker's torch threads share out its core instead of
    # every worker spreading over all of them.
    import torch

    _workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _workers))

# Property tests: a CI-sized run by default (the whole suite); `make test-fast` takes the smaller "fast" profile
# for the inner loop; `pytest --hypothesis-profile=long` explores for hours.
settings.register_profile("ci", max_examples=150, stateful_step_count=50, deadline=None)
settings.register_profile("fast", max_examples=40, stateful_step_count=30, deadline=None)
settings.register_profile("long", max_examples=200_000, stateful_step_count=200, deadline=None)
settings.load_profile("ci")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """Safetensors directory of the embedded SmolLM2-135M-Instruct (about 20 s to convert on first use)."""
    from pagerail.common.model_source import resolve_model_dir

    return resolve_model_dir(None)


def pytest_addoption(parser: pytest.Parser) -> None:
    # One minute in the suite; a longer soak: pytest tests/test_soak.py --soak-minutes 30 (or pagerail bench soak)
    parser.addoption("--soak-minutes", type=float, default=1.0, help="how long tests/test_soak.py runs its clients")


@pytest.fixture(scope="session")
def soak_minutes(request: pytest.FixtureRequest) -> float:
    return request.config.getoption("--soak-minutes")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Files with slow tests first, each file whole and in its collected order: spread over pytest-xdist workers (one
    # file per work unit), the long files start at once and the many short ones fill the cores behind them. A file
    # is never split: its module-scoped fixtures (a server, a tracer provider) would be torn down and made again.
    slow_files = {item.path for item in items if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.path not in slow_files)
