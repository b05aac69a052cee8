"""Required dependencies fail their tests in CI and only skip them on a developer's machine."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.requirements import in_ci, require, require_executable, require_module

MISSING = "pagerail_no_such_module_for_tests"
REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    ("value", "expected"), [("true", True), ("1", True), ("TRUE", True), ("", False), ("0", False)]
)
def test_ci_is_read_from_the_environment(monkeypatch, value, expected):
    monkeypatch.setenv("CI", value)
    assert in_ci() is expected


def test_missing_module_fails_in_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=f"required dependency missing in CI: .*{MISSING}"):
        require_module(MISSING, "needs the test module")


def test_missing_module_skips_outside_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="needs the test module"):
        require_module(MISSING, "needs the test module")


def test_broken_module_fails_in_ci(monkeypatch, tmp_path):
    """A module that is installed but cannot import (a missing native library, say) counts as missing."""
    (tmp_path / "pagerail_broken_dependency.py").write_text(f"import {MISSING}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=MISSING):
        require_module("pagerail_broken_dependency")


def test_present_module_is_returned(monkeypatch):
    monkeypatch.setenv("CI", "true")
    assert require_module("json").__name__ == "json"


def test_failed_condition_fails_in_ci_and_skips_outside(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="no promtool"):
        require(None, "no promtool")
    require("/usr/bin/promtool", "no promtool")  # a true condition passes through
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="no promtool"):
        require(False, "no promtool")


def test_missing_program_fails_in_ci_and_skips_outside(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="needs promtool"):
        require_executable("promtool", "needs promtool")
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="needs promtool"):
        require_executable("promtool", "needs promtool")
    program = tmp_path / "promtool"
    program.write_text("#!/bin/sh\n")
    program.chmod(0o755)
    assert require_executable("promtool") == str(program)


def test_dependency_not_required_here_skips_even_in_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.skip.Exception):
        require_module(MISSING, "only on Linux x86-64", required_in_ci=False)


def test_missing_module_at_module_level_fails_the_run_in_ci(tmp_path):
    """Used before a test module's imports, the helper turns the whole module into an error, not a skip."""
    test_file = tmp_path / "test_needs_missing.py"
    test_file.write_text(
        textwrap.dedent(
            f"""
            from tests.requirements import require_module

            require_module("{MISSING}", "needs a module that is not installed")


            def test_uses_it():
                pass
            """
        )
    )

    def run(ci: str) -> subprocess.CompletedProcess[str]:
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT), "CI": ci}
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path)]
        return subprocess.run([*command, str(test_file)], cwd=tmp_path, env=env, capture_output=True, text=True)

    in_ci_run = run("true")
    assert in_ci_run.returncode not in (0, 5), in_ci_run.stdout  # 5: nothing collected, as a skipped module gives
    assert "1 error" in in_ci_run.stdout and "required dependency missing in CI" in in_ci_run.stdout, in_ci_run.stdout
    local_run = run("")
    assert "1 skipped" in local_run.stdout and "error" not in local_run.stdout, local_run.stdout


def test_ci_entry_point_sets_ci_and_fails_without_promtool(tmp_path):
    """.ci/run exports CI=true and stops with a clear error when promtool cannot be installed."""
    script = REPO_ROOT / ".ci" / "run"
    assert "\nexport CI=true\n" in script.read_text()
    # A PATH with no promtool, no make and an apt-get that cannot find the package.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("dirname", "mktemp", "tail", "rm"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    apt_get = bin_dir / "apt-get"
    apt_get.write_text('#!/bin/sh\necho "E: Unable to locate package prometheus" >&2\nexit 100\n')
    apt_get.chmod(0o755)
    bash = shutil.which("bash")
    result = subprocess.run([bash, str(script)], env={"PATH": str(bin_dir)}, capture_output=True, text=True)
    assert result.returncode == 1, result.stderr
    assert "promtool is required in CI and could not be installed" in result.stderr
    assert "Unable to locate package prometheus" in result.stderr  # apt-get's own reason is shown
