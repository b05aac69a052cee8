"""bench/compare_vllm.py builds both servers' commands from the same settings; pagerail flags reach pagerail only."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "compare_vllm.py"


def _load():
    spec = importlib.util.spec_from_file_location("compare_vllm", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _args(**overrides) -> argparse.Namespace:
    values = dict(kv_cache_gib=1.0, pagerail_python="pagerail-python", vllm_python="vllm-python", pagerail_flags=[])
    return argparse.Namespace(**{**values, **overrides})


def test_both_servers_get_the_same_budget_sequences_and_context():
    module = _load()
    for server in module.SERVERS:
        command = module.server_command(server, Path("/model"), "m", 1234, _args())
        pairs = dict(zip(command, command[1:], strict=False))
        assert pairs["--max-num-batched-tokens"] == str(module.TOKEN_BUDGET)
        assert pairs["--max-num-seqs"] == str(module.MAX_NUM_SEQS)
        assert pairs["--max-model-len"] == str(module.MAX_MODEL_LEN)
        assert pairs["--dtype"] == "float32"


def test_pagerail_flags_are_appended_to_pagerail_serve_only():
    module = _load()
    args = _args(pagerail_flags=["--cpus-per-worker=1", "--no-async-scheduling"])
    pagerail = module.server_command("pagerail", Path("/model"), "m", 1234, args)
    assert pagerail[-2:] == ["--cpus-per-worker=1", "--no-async-scheduling"]
    vllm = module.server_command("vllm", Path("/model"), "m", 1234, args)
    assert "--cpus-per-worker=1" not in vllm and vllm[0] == "vllm-python"


def test_rounds_are_reported_one_by_one_with_the_median_ratio():
    module = _load()

    def result(tok_s: float, ttft: float, itl: float) -> dict:
        timing = {"completed": 4, "failed": 0, "output_throughput": tok_s}
        return {**timing, "ttft_ms": {"p50": ttft}, "itl_ms": {"p50": itl}, "cpu_ms_per_token": {"ray::HeadActor": 0.5}}

    rounds = [
        {"pagerail": result(300, 10, 5), "vllm": result(100, 20, 10)},  # 3.00x
        {"pagerail": result(200, 10, 5), "vllm": result(100, 20, 10)},  # 2.00x
        {"pagerail": result(100, 10, 5), "vllm": result(100, 20, 10)},  # 1.00x
    ]
    table = module.format_comparison({"overhead": rounds}, {"pagerail": "x", "vllm": "y"})
    median_row = next(line for line in table.splitlines() if "median" in line)
    assert "2.00x" in median_row and "0.50x" in median_row
    assert "overhead round 2 pagerail: CPU ms per generated token: ray::HeadActor 0.500" in table
