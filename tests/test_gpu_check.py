"""The one-call GPU check's scripts, exercised on the CPU: their plumbing, the parity verdicts, a parity dry run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCH = REPO_ROOT / "bench"
sys.path.insert(0, str(BENCH))

import gpu_parity  # noqa: E402


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu.sh", "gpu_wheels.sh"])
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(BENCH / script)], check=True)


def test_gpu_sh_runs_both_workloads_with_graphs_on_and_off(tmp_path):
    """A stand-in interpreter records each benchmark invocation and answers with a plausible report."""
    log = tmp_path / "calls.jsonl"
    fake = tmp_path / "python"
    fake.write_text(
        f"""#!{sys.executable}
import json, sys
args = sys.argv[1:]
if args[:1] == ["-"]:
    # The inline helpers: the model config writer, and the report printer (given a results file).
    code = sys.stdin.read()
    if len(args) > 1 and args[1].endswith(".json"):
        sys.argv = args  # as `python - FILE` sets it
        exec(compile(code, "report", "exec"), {{"__name__": "__main__"}})
    sys.exit(0)
with open({str(log)!r}, "a") as out:
    out.write(json.dumps(args) + "\\n")
step = {{"sequences": 256, "context_tokens": 40000, "seconds": 0.006, "memory_bound_seconds": 0.004}}
print(json.dumps({{"pagerail": {{"output_tokens_per_s": 1.0, "total_tokens_per_s": 2.0, "seconds": 3.0,
                                 "decode_step": step}}, "figures": {{"share_of_roofline": 0.5}}}}))
"""
    )
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "OUT": str(tmp_path / "out"), "MODEL_DIR": str(tmp_path / "model")}
    done = subprocess.run(["bash", str(BENCH / "gpu.sh")], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    calls = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(calls) == 4
    for call in calls:
        assert call[:4] == ["-m", "cluster.cli", "bench", "throughput"]
        assert call[call.index("--device") + 1] == "cuda" and call[call.index("--dtype") + 1] == "bfloat16"
    shapes = [(c[c.index("--num-requests") + 1], c[c.index("--output-len") + 1], "--enforce-eager" in c) for c in calls]
    assert shapes == [("1000", "128", False), ("1000", "128", True), ("200", "1000", False), ("200", "1000", True)]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "1000x128x128-eager.json",
        "1000x128x128-graphs.json",
        "200x1000x1000-eager.json",
        "200x1000x1000-graphs.json",
    ]
    assert "vs HBM bound 4.00 ms (1.50x)" in done.stdout


def _run(tokens: list[int], tops: list[set[int]] | None = None) -> tuple[list[int], list[set[int]]]:
    return tokens, tops if tops is not None else [{t} for t in tokens]


def test_parity_verdicts():
    fp32 = [_run([1, 2, 3, 4]), _run([5, 6, 7, 8]), _run([9, 9, 9, 9])]
    half = [_run([1, 2, 0, 0]), _run([5, 6, 7, 8]), _run([9, 9, 9, 9])]  # transformers bf16 stable for 2, 4, 4
    ours = [
        _run([1, 2, 9, 9]),  # diverges at 2, where transformers bf16 did too: passes
        _run([5, 6, 0, 8], [{5}, {6}, {0, 7}, {8}]),  # diverges inside the stable part, but a near-tie
        _run([9, 1, 9, 9]),  # diverges at 1 of 4 stable tokens with no tie: fails
    ]
    fp32[1][1][2].add(0)  # the reference also ranks our token in its top 5 at that step
    verdict = gpu_parity.judge(ours, fp32, half)
    assert [(p["stable"], p["diverges"], p["near_tie"], p["passes"]) for p in verdict["prompts"]] == [
        (2, 2, False, True),
        (4, 2, True, True),
        (4, 1, False, False),
    ]
    assert verdict["passed"] == 2


def test_graphs_vs_eager_verdicts():
    eager = [_run([1, 2, 3]), _run([4, 5, 6], [{4}, {5, 7}, {6}]), _run([7, 8, 9])]
    graphs = [_run([1, 2, 3]), _run([4, 7, 6], [{4}, {7, 5}, {6}]), _run([7, 1, 9])]
    verdict = gpu_parity.graphs_vs_eager(eager, graphs)
    assert [(p["diverges"], p["identical"], p["near_tie"]) for p in verdict["prompts"]] == [
        (3, True, False),
        (1, False, True),  # each side's pick is in the other's top tokens: rounding
        (1, False, False),  # 1 was nowhere near eager's choice: a wrong graph
    ]
    assert (verdict["identical"], verdict["near_ties"], verdict["passed"]) == (1, 1, 2)


def test_parity_dry_run_on_cpu(tmp_path):
    """The parity script end to end on the CPU in fp32, where pagerail must equal transformers outright; run as
    the bare GPU image would run it, with every module the image lacks refused (bench/gpu_image.py)."""
    report_path = tmp_path / "parity.json"
    done = subprocess.run(
        [
            sys.executable,
            str(BENCH / "gpu_image.py"),
            str(BENCH / "gpu_parity.py"),
            "--device",
            "cpu",
            "--models",
            "qwen3",
            "--prompts",
            "3",
            "--new-tokens",
            "8",
            "--json",
            str(report_path),
        ],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(report_path.read_text())
    (model,) = report["models"]
    assert model["transformers_float32"]["identical_to_fp32"] == 3
    assert model["eager"]["passed"] == 3
    assert all(p["diverges"] == 8 for p in model["eager"]["prompts"])
    steps = model["eager"]["graph_steps"]
    assert steps["replayed"] == 0 and steps["eager"] > 0  # no graphs on the CPU
    assert model["graphs_vs_eager"]["identical"] == 3 and report["complete"] is True
    assert "parity: PASS" in done.stdout
