"""The torch pin is one version: the Makefile's TORCH_SPEC, the Dockerfile's TORCH_VERSION and the README agree."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_makefile_dockerfile_and_readme_pin_the_same_torch():
    makefile = re.search(r"^TORCH_SPEC \?= torch==(\S+)$", (ROOT / "Makefile").read_text(), re.M)
    dockerfile = re.search(r"^ARG TORCH_VERSION=(\S+)$", (ROOT / "deploy" / "Dockerfile").read_text(), re.M)
    assert makefile and dockerfile
    assert makefile.group(1) == dockerfile.group(1)
    readme = (ROOT / "README.md").read_text()
    assert f"pin the same torch, {makefile.group(1)}." in readme
    assert not re.search(r"torch==(?!" + re.escape(makefile.group(1)) + r")\d", readme), "another torch pin in README"
