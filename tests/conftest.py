"""Shared pytest fixtures: the embedded default model, converted once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """Safetensors directory of the embedded SmolLM2-135M-Instruct (about 20 s to convert on first use)."""
    from worker.model_loader import resolve_model_dir

    return resolve_model_dir(None)
