"""The engine with decode attention through the Triton paged kernel, run by Triton's CPU interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.requirements import TRITON_REQUIRED, require_module

require_module("triton", "needs Triton", required_in_ci=TRITON_REQUIRED)


def test_engine_parity_through_triton_kernel():
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(root)}
    # A separate interpreter: the variable must be set before triton is first imported.
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_engine_tiny.py", "-k", "llama"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "1 passed" in result.stdout
