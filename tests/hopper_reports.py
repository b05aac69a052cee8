"""Runs a test module's `_hopper_report()` (offline sm_90 builds) with this Triton and with the GPU image's, in two
child processes at once (one core each), and returns their JSON reports by "this" / "image"; and the recording,
building and checking those reports share."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict

from tests.requirements import TRITON_REQUIRED, missing, require_module
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


@contextlib.contextmanager
def recording_kernels(recorder, module, *attrs: str, stand_ins: dict[str, object] | None = None) -> Iterator[None]:
    """Within the block, `module`'s kernels `attrs` record their launches on `recorder` instead of running (and the
    `stand_ins` attributes are replaced, e.g. an availability check a CPU run would fail); restored after."""
    from tests.triton_launches import _Recording

    originals = {attr: getattr(module, attr) for attr in (*attrs, *(stand_ins or {}))}
    for attr in attrs:
        setattr(module, attr, _Recording(recorder, attr, originals[attr]))
    for attr, stand_in in (stand_ins or {}).items():
        setattr(module, attr, stand_in)
    try:
        yield
    finally:
        for attr, original in originals.items():
            setattr(module, attr, original)


def build_launches(recorder, built: set, builds: list, failures: list, **labels: str) -> None:
    """Build every distinct launch `recorder` saw that is not in `built` yet for sm_90, appending each build (or its
    failure, naming the kernel) with `labels` (e.g. shape=...)."""
    from tests.triton_launches import build_for_hopper

    for launch in recorder.distinct():
        if (launch.kernel, launch.key) in built:
            continue
        built.add((launch.kernel, launch.key))
        try:
            builds.append({**labels, **asdict(build_for_hopper(launch))})
        except Exception as error:  # reported with the variant, so one failure names its kernel and shape
            failures.append({**labels, "kernel": launch.kernel, "key": launch.key, "error": repr(error)[:2000]})


def checked_report(which: str, reports: dict[str, dict], kernels: set[str]) -> dict:
    """The report of `which` Triton ("this" or "image"; the test is marked missing when the image's is not
    installed), after the checks every kernel family shares: the image's version, no failed build, exactly
    `kernels` built, and shared memory within sm_90's limit. Spills are left to the caller (bounds differ)."""
    from tests.test_hopper_builds import IMAGE_TRITON, IMAGE_TRITON_VERSION

    if which not in reports:
        missing(f"the GPU image's Triton {IMAGE_TRITON_VERSION} is not installed at {IMAGE_TRITON} (make venv)")
    report = reports[which]
    if which == "image":
        assert report["triton"] == IMAGE_TRITON_VERSION
    assert not report["failures"], json.dumps(report["failures"], indent=1)
    assert {build["kernel"] for build in report["builds"]} == kernels
    for build in report["builds"]:
        where = f"{build['kernel']} for {build.get('shape', '')} {build['constexprs']}"
        assert build["shared_bytes"] <= 232448, f"{where}: {build['shared_bytes']} bytes of shared memory"
    return report
