"""Runs a test module's `_hopper_report()` (offline sm_90 builds) with this Triton and with the GPU image's, in two
child processes at once (one core each), and returns their JSON reports by "this" / "image"."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

from tests.requirements import TRITON_REQUIRED, require_module
from tests.triton_interpreter import REPO_ROOT


def hopper_reports_of(module: str) -> dict[str, dict]:
    """`module._hopper_report()`'s last printed JSON line under each Triton installed here."""
    from tests.test_hopper_builds import IMAGE_TRITON

    require_module("triton", "needs Triton", required_in_ci=TRITON_REQUIRED)
    paths = {"this": [str(REPO_ROOT)]}
    if (IMAGE_TRITON / "triton" / "__init__.py").is_file():
        paths["image"] = [str(IMAGE_TRITON), str(REPO_ROOT)]
    code = f"from {module} import _hopper_report; _hopper_report()"
    with tempfile.TemporaryDirectory() as caches:
        children = {}
        for which, path in paths.items():
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "TRITON_CACHE_DIR": f"{caches}/{which}"}
            env.update({"TRITON_DEFAULT_FP_FUSION": "1", "CUDA_VISIBLE_DEVICES": ""})
            env.pop("TRITON_INTERPRET", None)
            children[which] = subprocess.Popen(
                [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip
        reports = {}
        for which, child in children.items():
            stdout, stderr = child.communicate(timeout=600)
            assert child.returncode == 0, stderr[-4000:]
            reports[which] = json.loads(stdout.strip().splitlines()[-1])
    return reports
