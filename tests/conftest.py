"""Shared pytest fixtures: the embedded default model, converted once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import settings

# Property tests: a CI-sized run by default; `pytest --hypothesis-profile=long` explores for hours.
settings.register_profile("ci", max_examples=150, stateful_step_count=50, deadline=None)
settings.register_profile("long", max_examples=200_000, stateful_step_count=200, deadline=None)
settings.load_profile("ci")


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """Safetensors directory of the embedded SmolLM2-135M-Instruct (about 20 s to convert on first use)."""
    from pagerail.worker.model_loader import resolve_model_dir

    return resolve_model_dir(None)


def pytest_addoption(parser: pytest.Parser) -> None:
    # Half a minute in the suite keeps it within its time; a longer soak: pytest tests/test_soak.py --soak-minutes 30
    parser.addoption("--soak-minutes", type=float, default=0.5, help="how long tests/test_soak.py runs its clients")


@pytest.fixture(scope="session")
def soak_minutes(request: pytest.FixtureRequest) -> float:
    return request.config.getoption("--soak-minutes")
