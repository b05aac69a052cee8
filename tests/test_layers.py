"""Every import inside the pagerail package goes one way: from a higher layer to a lower one."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Lowest first; a module may import its own layer and the ones before it. The longest matching prefix wins.
LAYERS = [
    ("pagerail.proto", 0),
    ("pagerail.common", 1),
    ("pagerail.worker", 2),
    ("pagerail.cluster.core", 2),
    ("pagerail.cluster.distributed", 3),
    ("pagerail.cluster.routing", 3),  # beside the Ray layer: routed clients over the heads' engine clients
    ("pagerail.cluster.frontend", 4),
    ("pagerail.cluster.entrypoints", 5),
    ("pagerail.cluster.bench", 6),
    ("pagerail.cluster.cli", 6),
    ("pagerail.cluster", 6),
    ("pagerail", 6),  # the package facade re-exports the public API
]
# The only places the head side reaches into the worker package: where it starts worker processes or makes their
# settings, and the benchmarks, which also time the model alone.
STARTS_WORKERS = {
    "pagerail.cluster.distributed.head",
    "pagerail.cluster.distributed.worker_group",
    "pagerail.cluster.distributed.local_executor",
    "pagerail.cluster.entrypoints.llm",
    "pagerail.cluster.bench",
}
# The engine core is plain Python: scheduling decisions never wait on a framework.
CORE_FORBIDDEN = ("torch", "ray", "grpc", "transformers", "fastapi")


def layer_of(module: str) -> tuple[str, int] | None:
    matches = [(name, rank) for name, rank in LAYERS if module == name or module.startswith(name + ".")]
    return max(matches, key=lambda m: len(m[0])) if matches else None


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path) -> list[tuple[str, int]]:
    """Every imported module with its line, including imports inside functions and TYPE_CHECKING blocks."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.extend((alias.name, node.lineno) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, node.lineno))
            # `from pagerail.cluster import core` imports the module pagerail.cluster.core
            found.extend((f"{node.module}.{alias.name}", node.lineno) for alias in node.names)
    return found


def violations_in(path: Path, root: Path = ROOT) -> list[str]:
    here = module_name(path, root)
    own = layer_of(here)
    if own is None:
        return []
    problems = []
    for imported, line in imports_of(path):
        where = f"{path.relative_to(root)}:{line} imports {imported}"
        target = layer_of(imported)
        if own[0] == "pagerail.cluster.core" and imported.split(".")[0] in CORE_FORBIDDEN:
            problems.append(f"{where}: the engine core imports no framework")
        if target is None or target[0] == own[0]:
            continue
        if here.startswith("pagerail.worker") and imported.startswith("pagerail.cluster"):
            problems.append(f"{where}: worker/ never imports cluster/")
        elif (
            here.startswith("pagerail.cluster")
            and imported.startswith("pagerail.worker")
            and not any(here == allowed or here.startswith(allowed + ".") for allowed in STARTS_WORKERS)
        ):
            problems.append(f"{where}: only {sorted(STARTS_WORKERS)} may import worker/")
        elif target[1] > own[1] and not (imported == "pagerail" and here.startswith("pagerail.")):
            problems.append(f"{where}: {own[0]} is below {target[0]}")
    return problems


def python_files() -> list[Path]:
    files = (ROOT / "pagerail").rglob("*.py")
    return sorted(p for p in files if not p.name.endswith(("_pb2.py", "_pb2_grpc.py")))


def test_no_import_goes_from_a_lower_layer_to_a_higher_one():
    problems = [problem for path in python_files() for problem in violations_in(path)]
    assert not problems, "layer violations:\n" + "\n".join(problems)


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        (
            "pagerail.cluster.core.engine",
            "from pagerail.cluster.frontend.engine_client import RequestDelta\n",
            "is below",
        ),
        ("pagerail.cluster.core.engine", "import torch\n", "no framework"),
        ("pagerail.worker.sampler", "from pagerail.cluster.core.request import Request\n", "never imports cluster"),
        (
            "pagerail.cluster.distributed.launcher",
            "from pagerail.worker.actor import WorkerActor\n",
            "may import worker",
        ),
        (
            "pagerail.cluster.frontend.server",
            "def f():\n    from pagerail.cluster.entrypoints.serve import main\n",
            "is below",
        ),
    ],
)
def test_the_checker_catches_each_kind_of_violation(tmp_path, module, source, expected):
    path = tmp_path.joinpath(*module.split(".")).with_suffix(".py")
    path.parent.mkdir(parents=True)
    path.write_text(source)
    assert any(expected in problem for problem in violations_in(path, tmp_path))


def test_what_both_sides_share_sits_below_both():
    for shared in ("telemetry", "tls", "logs", "auth"):
        shared = f"pagerail.common.{shared}"
        assert (ROOT / Path(*shared.split("."))).with_suffix(".py").exists()
        assert layer_of(shared)[1] < layer_of("pagerail.worker.worker")[1]


def import_graph(files: list[Path], root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, annotation-only (TYPE_CHECKING) imports included."""
    modules = {module_name(path, root): path for path in files}
    return {
        module: {imported for imported, _ in imports_of(path) if imported in modules and imported != module}
        for module, path in modules.items()
    }


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    cycles.append(sorted(group))
    return cycles


def test_no_module_imports_itself_through_others():
    cycles = import_cycles(import_graph(python_files()))
    assert not cycles, "import cycles (annotation-only imports count):\n" + "\n".join(map(" <-> ".join, cycles))


def test_the_cycle_check_sees_annotation_only_imports(tmp_path):
    sources = {
        "pagerail/cluster/core/a.py": "from pagerail.cluster.core.b import B\n",
        "pagerail/cluster/core/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from pagerail.cluster.core.a import A\n",
        "pagerail/cluster/core/c.py": "from pagerail.cluster.core.a import A\n",
    }
    for name, source in sources.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(source)
    files = sorted(tmp_path.rglob("*.py"))
    assert import_cycles(import_graph(files, tmp_path)) == [["pagerail.cluster.core.a", "pagerail.cluster.core.b"]]
