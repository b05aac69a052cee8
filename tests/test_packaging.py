"""The built wheel installs one top-level package, `pagerail`, and sits beside proto-plus (whose import name is
`proto`) in one environment without either shadowing the other."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from tests.requirements import require

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
# `make venv` downloads proto-plus's wheel here; it is not a dependency of pagerail or of its tests.
WHEELHOUSE = ROOT / ".venv" / "wheelhouse"

_CHECK = """
import json, sys
import proto
import pagerail
from pagerail import LLM, SamplingParams
from pagerail.proto import step_pb2

class Point(proto.Message):
    x = proto.Field(proto.INT32, number=1)

print(json.dumps({
    "proto_plus": Point(x=3).x,
    "pagerail": pagerail.__file__,
    "proto": proto.__file__,
    "llm": LLM.__module__,
    "sampling": SamplingParams(max_tokens=4).max_tokens,
    "step": step_pb2.StepBatch.DESCRIPTOR.full_name,
}))
"""


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """pagerail's wheel, built from a copy of the sources (the build leaves nothing in the checkout)."""
    source = tmp_path_factory.mktemp("source")
    shutil.copytree(ROOT / "pagerail", source / "pagerail", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), "."]
    subprocess.run(command, cwd=source, check=True, capture_output=True, timeout=300)
    (built,) = out.glob("pagerail-*.whl")
    return built


def test_the_wheel_holds_only_the_pagerail_package(wheel):
    import zipfile

    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names if not name.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"pagerail"}
    assert "pagerail/proto/step_pb2.py" in names
    assert "pagerail/worker/layers/csrc/paged_attention_cpu.c" in names
    entry_points = next(name for name in names if name.endswith(".dist-info/entry_points.txt"))
    assert "pagerail = pagerail.cluster.cli:main" in zipfile.ZipFile(wheel).read(entry_points).decode()


def test_a_fresh_environment_imports_pagerail_beside_proto_plus(wheel, tmp_path):
    plus = sorted(WHEELHOUSE.glob("proto_plus-*.whl"))
    require(plus, f"needs proto-plus's wheel in {WHEELHOUSE} (make venv downloads it)")
    env_dir = tmp_path / "fresh"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    install = [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", "--no-index"]
    subprocess.run([*install, str(plus[-1]), str(wheel)], check=True, capture_output=True, timeout=300)
    fresh_site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    # Both installed into the same site-packages, each under its own name.
    assert (fresh_site / "proto" / "message.py").exists()
    assert (fresh_site / "pagerail" / "proto" / "step_pb2.py").exists()
    assert not any((fresh_site / name).exists() for name in ("cluster", "worker", "common"))
    # pagerail's own dependencies (protobuf, torch, ...) come from this environment, after the fresh one's packages;
    # a path in a .pth file is not a site directory, so the checkout's editable install is not seen there.
    (fresh_site / "outer.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    result = subprocess.run([str(python), "-c", _CHECK], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    import json

    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["proto_plus"] == 3
    assert seen["pagerail"].startswith(str(fresh_site))
    assert seen["proto"].startswith(str(fresh_site / "proto"))
    assert seen["llm"] == "pagerail.cluster.entrypoints.llm"
    assert seen["sampling"] == 4
    assert seen["step"] == "pagerail.step.StepBatch"
