"""The one-call GPU check's scripts, exercised on the CPU: their plumbing, the parity verdicts, a parity dry run."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
BENCH = REPO_ROOT / "bench"
sys.path.insert(0, str(BENCH))

import gpu_parity  # noqa: E402

# Child processes, the Triton interpreter or offline GPU builds: left out of `make test-fast`.
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("script", ["gpu_check.sh", "gpu.sh", "gpu_wheels.sh"])
def test_scripts_parse(script):
    subprocess.run(["bash", "-n", str(BENCH / script)], check=True)


def test_gpu_sh_runs_both_workloads_in_bf16_and_fp8_with_graphs_on_and_off(tmp_path):
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
    assert len(calls) == 12
    for call in calls:
        assert call[:4] == ["-m", "pagerail.cluster.cli", "bench", "throughput"]
        assert call[call.index("--device") + 1] == "cuda" and call[call.index("--dtype") + 1] == "bfloat16"

    def weights(call: list[str]) -> str:
        if "--quantization" not in call:
            return "bf16"
        assert call[call.index("--quantization") + 1] == "fp8"
        return "fp8kv" if "--kv-cache-dtype" in call else "fp8"

    shapes = [
        (c[c.index("--num-requests") + 1], c[c.index("--output-len") + 1], weights(c), "--enforce-eager" in c)
        for c in calls
    ]
    assert shapes == [
        (requests, length, kind, eager)
        for requests, length in (("1000", "128"), ("200", "1000"))
        for kind in ("bf16", "fp8", "fp8kv")
        for eager in (False, True)
    ]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        f"{label}-{kind}-{mode}.json"
        for label in ("1000x128x128", "200x1000x1000")
        for kind in ("bf16", "fp8", "fp8kv")
        for mode in ("eager", "graphs")
    )
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


EXPECTED_FILES = [
    "16x16x16-bf16-eager.json",
    "16x16x16-bf16-graphs.json",
    "4x64x64-bf16-eager.json",
    "4x64x64-bf16-graphs.json",
    "check.log",
    "gpu-tests.xml",
    "parity.json",
    "summary.txt",
]


def test_gpu_check_dry_run_writes_every_file_within_its_budget(tmp_path):
    """bench/gpu_check.sh --dry-run: every stage on the CPU, every Python command as the bare image would run it
    (bench/gpu_image.py refuses its missing modules); all 8 files, every stage passing, in under 8 minutes."""
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    started = time.perf_counter()
    done = subprocess.run(
        ["bash", str(BENCH / "gpu_check.sh"), "--dry-run"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=480,
    )
    seconds = time.perf_counter() - started
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == EXPECTED_FILES
    assert seconds < 480
    summary = (out / "summary.txt").read_text()
    limits = [int(m) for m in re.findall(r"\(limit (\d+) s\)", summary)]
    assert len(limits) == 8 and sum(limits) <= 480 and "limits add up to 480 s" in summary
    assert summary.count(": pass in ") == 7
    assert "tests/gpu: 0 passed, 0 failed, 0 errors" in summary  # collected, and skipped without CUDA
    assert "graphs vs eager 3/3 identical" in summary and "16x16x16-bf16: graphs" in summary
    assert "_paged_mixed_kernel: 16x16x16-bf16-graphs 0" in summary
    assert "not judged off a GPU" in summary
    log = (out / "check.log").read_text()
    assert "engine imports: ok" in log and "gcc:" in log and "present here: none" in log
    # The parity stage, in fp32 on the CPU, where pagerail must equal transformers outright.
    report = json.loads((out / "parity.json").read_text())
    (model,) = report["models"]
    assert report["complete"] is True and model["prompts"] == 3
    assert model["transformers_float32"]["identical_to_fp32"] == 3 and model["eager"]["passed"] == 3
    assert all(p["diverges"] == 8 for p in model["eager"]["prompts"])
    assert model["eager"]["graph_steps"]["replayed"] == 0 and model["eager"]["graph_steps"]["eager"] > 0
    throughput = json.loads((out / "16x16x16-bf16-graphs.json").read_text())["pagerail"]
    assert throughput["graph_steps"]["replayed"] == 0 and set(throughput["kernel_variants"]) >= {"_rms_norm_kernel"}


def test_an_interrupted_pytest_stage_still_writes_its_report(tmp_path):
    """The check stops a stage over its limit with SIGINT, on which pytest still writes the junit report."""
    (tmp_path / "test_slow.py").write_text(
        "import time\n\ndef test_fast():\n    pass\n\ndef test_slow():\n    time.sleep(60)\n"
    )
    report = tmp_path / "report.xml"
    command = ["timeout", "-s", "INT", "-k", "10", "6", sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    done = subprocess.run([*command, str(tmp_path / "test_slow.py"), f"--junitxml={report}"], cwd=tmp_path)
    assert done.returncode == 124
    assert 'name="test_fast"' in report.read_text()
