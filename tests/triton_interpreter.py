"""Runs tests under Triton's CPU interpreter in a child process.

Triton decides whether a kernel is compiled or interpreted when it is decorated, so TRITON_INTERPRET must be set
before triton is first imported: the interpreted run gets a process of its own, and the test process never sees
the variable.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.requirements import TRITON_REQUIRED, require_module

REPO_ROOT = Path(__file__).resolve().parent.parent


def run_interpreted(
    args: list[str], timeout: int = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """`python ARGS` from the repository root with the interpreter on; fails in CI when triton is missing."""
    require_module("triton", "needs Triton", required_in_ci=TRITON_REQUIRED)
    child_env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    return subprocess.run(
        [sys.executable, *args], cwd=REPO_ROOT, env=child_env, capture_output=True, text=True, timeout=timeout
    )


def interpreted_report(module: str, timeout: int = 300, env: dict[str, str] | None = None) -> dict:
    """The JSON line that `module._report()` prints when run under the interpreter."""
    result = run_interpreted(["-c", f"from {module} import _report; _report()"], timeout=timeout, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def assert_interpreted_tests_pass(test_file: str, selector: str, passed: int, timeout: int = 600) -> None:
    """Run `pytest test_file -k selector` under the interpreter; exactly `passed` tests must pass there."""
    command = ["-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", selector]
    result = run_interpreted(command, timeout=timeout)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    assert f"{passed} passed" in result.stdout
