"""Required test dependencies: skipped when missing on a developer's machine, a failure when missing in CI.

CI sets CI=true and installs everything the suite needs (Ray, helm-python-sdk, kubernetes-validate, jsonschema,
Triton, a C compiler, promtool); a dependency missing or broken there is a broken build, never a skipped test.
Both helpers work at module level (before a test module's other imports) and inside tests and fixtures.
"""

from __future__ import annotations

import importlib
import os
import platform
import shutil
import sys
from types import ModuleType
from typing import NoReturn

import pytest

_TRUE = {"1", "true", "yes", "on"}
# pyproject installs Triton (for its CPU interpreter) only on Linux x86-64; elsewhere it is optional.
TRITON_REQUIRED = sys.platform == "linux" and platform.machine() == "x86_64"


def in_ci() -> bool:
    """True when the suite runs in CI (CI=true, as GitHub Actions, GitLab and .ci/run set it)."""
    return os.environ.get("CI", "").strip().lower() in _TRUE


def missing(reason: str, *, required_in_ci: bool = True) -> NoReturn:
    """Skip the test (or the whole module) for `reason`; fail it instead in CI when the dependency is required."""
    if required_in_ci and in_ci():
        pytest.fail(f"required dependency missing in CI: {reason}", pytrace=False)
    pytest.skip(reason, allow_module_level=True)


def require(condition: object, reason: str, *, required_in_ci: bool = True) -> None:
    """Go on when `condition` holds; otherwise skip locally and fail in CI."""
    if not condition:
        missing(reason, required_in_ci=required_in_ci)


def require_module(name: str, reason: str | None = None, *, required_in_ci: bool = True) -> ModuleType:
    """Import `name` and return it; when it is missing or fails to import, skip locally and fail in CI."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        why = f"{reason} ({error})" if reason else f"needs {name} ({error})"
        missing(why, required_in_ci=required_in_ci)


def require_executable(name: str, reason: str | None = None, *, required_in_ci: bool = True) -> str:
    """The path of program `name` on PATH; when it is not there, skip locally and fail in CI."""
    path = shutil.which(name)
    if path is None:
        missing(reason or f"needs {name} on PATH", required_in_ci=required_in_ci)
    return path
