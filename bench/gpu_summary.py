"""summary.txt of the one-call GPU check: every stage's verdict, and each figure next to its target.

Reads what the stages left in the results folder, however far they got: gpu-tests.xml (test counts, the
batch-16 graphs-vs-eager figures, compiled Triton variants), parity.json, and the throughput JSONs.

    python bench/gpu_summary.py OUT STAGES_FILE OWN_LIMIT

STAGES_FILE holds one "name<TAB>verdict<TAB>seconds<TAB>limit" line per stage run so far; OWN_LIMIT is this
summary's own time limit, counted in the total.
"""

from __future__ import annotations

import json
import sys
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

# Issue 13's targets on one H200 with Llama-3.1-8B's shape in bf16.
DECODE_BOUND_RATIO = 1.3
OUTPUT_TOKENS_PER_S = 20_000
GRAPHS_OVER_EAGER = 1.5


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def stage_lines(stages_file: Path, own_limit: int) -> list[str]:
    lines, total_limit = [], own_limit
    for row in stages_file.read_text().splitlines() if stages_file.exists() else []:
        name, verdict, seconds, limit = row.split("\t")
        total_limit += int(limit)
        lines.append(f"  {name}: {verdict} in {seconds} s (limit {limit} s)")
    lines.append(f"  summary: this file (limit {own_limit} s)")
    return [f"stages (limits add up to {total_limit} s):", *lines]


def gpu_tests(path: Path) -> tuple[list[str], dict]:
    """Counts, the recorded properties by test, and the suite's compiled variants."""
    try:
        root = ElementTree.parse(path).getroot()
    except (OSError, ElementTree.ParseError):
        return ["tests/gpu: no gpu-tests.xml"], {}
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {key: int(suite.get(key, 0)) for key in ("tests", "failures", "errors", "skipped")}
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    lines = [
        f"tests/gpu: {passed} passed, {counts['failures']} failed, {counts['errors']} errors, "
        f"{counts['skipped']} skipped of {counts['tests']}"
    ]
    for case in suite.iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            lines.append(f"  FAILED {case.get('classname')}::{case.get('name')}")
    properties: dict = {}
    for case in suite.iter("testcase"):
        for prop in case.iter("property"):
            properties.setdefault(case.get("name"), {})[prop.get("name")] = prop.get("value")
    for prop in suite.findall("./properties/property"):
        properties.setdefault("", {})[prop.get("name")] = prop.get("value")
    return lines, properties


def batch16_lines(properties: dict) -> tuple[list[str], float | None]:
    lines, best = [], None
    for test, values in sorted(properties.items()):
        if "graphs_vs_eager" in values:
            ratio = float(values["graphs_vs_eager"])
            lines.append(
                f"  decode at batch 16, {test}: graphs {values['graphs_tokens_per_s']} tok/s, eager "
                f"{values['eager_tokens_per_s']} tok/s: {ratio:.2f}x"
            )
            if "smollm2" in test:
                best = ratio
        if "graphs_vs_eager_identical" in values:
            lines.append(
                f"  graph tokens vs eager tokens, {test}: {values['graphs_vs_eager_identical']} identical, "
                f"{values['graphs_vs_eager_near_ties']} first differences at a near-tie"
            )
    return lines, best


def parity_lines(path: Path) -> list[str]:
    report = _load(path)
    if report is None:
        return ["parity: no parity.json"]
    lines = [f"parity ({report['device']}, {report['dtype']}{'' if report.get('complete') else ', INCOMPLETE'}):"]
    for model in report["models"]:
        n = model["prompts"]
        row = [f"{mode} {model[mode]['passed']}/{n}" for mode in ("eager", "cuda_graphs") if mode in model]
        vs = model.get("graphs_vs_eager")
        if vs is not None:
            row.append(f"graphs vs eager {vs['identical']}/{n} identical, {vs['near_ties']} near-ties")
        lines.append(f"  {model['model']}: " + "; ".join(row))
    return lines


def throughput_runs(out: Path) -> dict[str, dict]:
    runs = {}
    for path in sorted(out.glob("*-graphs.json")) + sorted(out.glob("*-eager.json")):
        report = _load(path)
        if report is not None and "pagerail" in report:
            runs[path.stem] = report
    return runs


def throughput_lines(runs: dict[str, dict]) -> list[str]:
    lines = ["throughput:" if runs else "throughput: no results"]
    for name, report in runs.items():
        ours = report["pagerail"]
        line = f"  {name}: output {ours['output_tokens_per_s']:.0f} tok/s"
        step = ours.get("decode_step")
        if step and step.get("memory_bound_seconds"):
            ratio = step["seconds"] / step["memory_bound_seconds"]
            line += (
                f"; decode step at {step['sequences']} sequences {1000 * step['seconds']:.2f} ms vs HBM bound "
                f"{1000 * step['memory_bound_seconds']:.2f} ms ({ratio:.2f}x)"
            )
        if ours.get("graph_steps"):
            line += f"; steps replayed/eager {ours['graph_steps']['replayed']}/{ours['graph_steps']['eager']}"
        lines.append(line)
    for name in runs:
        if name.endswith("-graphs") and name.removesuffix("-graphs") + "-eager" in runs:
            graphs = runs[name]["pagerail"]["output_tokens_per_s"]
            eager = runs[name.removesuffix("-graphs") + "-eager"]["pagerail"]["output_tokens_per_s"]
            lines.append(f"  {name.removesuffix('-graphs')}: graphs {graphs / eager:.2f}x eager")
    return lines


def variant_lines(properties: dict, runs: dict[str, dict]) -> list[str]:
    columns: dict[str, dict[str, str]] = {}
    suite = properties.get("", {}).get("kernel_variants")
    if suite:
        for kernel, count in json.loads(suite).items():
            columns.setdefault(kernel, {})["tests/gpu"] = str(count)
    for name, report in runs.items():
        ours = report["pagerail"]
        for kernel, count in (ours.get("kernel_variants") or {}).items():
            in_run = ours["kernel_variants_compiled_in_run"][kernel]
            columns.setdefault(kernel, {})[name] = f"{count} ({in_run} in the timed run)"
    if not columns:
        return ["Triton variants compiled: no counts"]
    lines = ["Triton variants compiled per kernel, by the end of each process:"]
    for kernel, by_run in sorted(columns.items()):
        lines.append(f"  {kernel}: " + ", ".join(f"{where} {count}" for where, count in by_run.items()))
    return lines


def _judged(label: str, figure: float | None, shown: str, ok: bool | None) -> str:
    verdict = "no figure" if figure is None else ("met" if ok else "NOT met")
    return f"  {label}: {'-' if figure is None else shown}, {verdict}"


def target_lines(runs: dict[str, dict], batch16: float | None) -> list[str]:
    cuda = any(report.get("device") == "cuda" for report in runs.values())
    lines = ["targets (issue 13, one H200, Llama-3.1-8B shape, bf16):" + ("" if cuda else " not judged off a GPU")]
    if not cuda:
        return lines
    small = next((r for name, r in runs.items() if name in ("1000x128x128-bf16-graphs", "1000x128x128-graphs")), None)
    step = (small or {}).get("pagerail", {}).get("decode_step") or {}
    bound = step["seconds"] / step["memory_bound_seconds"] if step.get("memory_bound_seconds") else None
    rate = small["pagerail"]["output_tokens_per_s"] if small else None
    where = f" (measured at {step['sequences']} sequences)" if step and step.get("sequences") != 256 else ""
    return lines + [
        _judged(
            f"decode step at batch 256 <= {DECODE_BOUND_RATIO}x HBM bound",
            bound,
            f"{bound or 0:.2f}x{where}",
            bound is not None and bound <= DECODE_BOUND_RATIO,
        ),
        _judged(
            f">= {OUTPUT_TOKENS_PER_S} output tok/s on 1000 x 128/128",
            rate,
            f"{rate or 0:.0f}",
            rate is not None and rate >= OUTPUT_TOKENS_PER_S,
        ),
        _judged(
            f"CUDA graphs >= {GRAPHS_OVER_EAGER}x eager at batch 16 (SmolLM2 shape)",
            batch16,
            f"{batch16 or 0:.2f}x",
            batch16 is not None and batch16 >= GRAPHS_OVER_EAGER,
        ),
    ]


def summarize(out: Path, stages_file: Path, own_limit: int) -> str:
    tests, properties = gpu_tests(out / "gpu-tests.xml")
    batch16, best = batch16_lines(properties)
    runs = throughput_runs(out)
    sections = [
        [f"GPU check, {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}"],
        stage_lines(stages_file, own_limit),
        tests + batch16,
        parity_lines(out / "parity.json"),
        throughput_lines(runs),
        variant_lines(properties, runs),
        target_lines(runs, best),
    ]
    return "\n\n".join("\n".join(section) for section in sections) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[0])
    text = summarize(out, Path(argv[1]), int(argv[2]))
    (out / "summary.txt").write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
