"""The in-process engine and `bench throughput` run on a machine without Ray, FastAPI, uvicorn or OpenTelemetry."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BLOCKED = ("ray", "fastapi", "uvicorn", "starlette", "opentelemetry")

# Runs in a fresh interpreter whose first act is to make every blocked package (and submodule) unimportable.
CHILD = textwrap.dedent(
    """
    import contextlib, io, json, sys

    BLOCKED = {blocked!r}
    attempts = []

    class Missing:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                attempts.append(name)
                raise ImportError(f"No module named {{name!r}} (blocked by the test)")
            return None

    sys.meta_path.insert(0, Missing())

    from cluster.bench.tiny_llama import TinyLlamaShape, write_tiny_llama
    from cluster.cli import main
    from cluster.entrypoints.llm import LLM
    from cluster.core.sampling_params import SamplingParams
    from common import telemetry

    shape = TinyLlamaShape(hidden_size=64, intermediate_size=128, vocab_size=512, max_position_embeddings=256)
    model = str(write_tiny_llama({model_dir!r}, shape))
    llm = LLM(model=model, load_format="dummy", device="cpu", max_model_len=128, num_gpu_blocks=32)
    outputs = llm.generate(["Hello there", "The sky is"], SamplingParams(max_tokens=4, temperature=0.0))
    tokens = [list(output.outputs[0].token_ids) for output in outputs]

    argv = ["bench", "throughput", "--model", model, "--load-format", "dummy", "--vocab-size", "512"]
    argv += ["--num-requests", "3", "--prompt-len", "4", "8", "--output-len", "2", "3", "--max-model-len", "64"]
    argv += ["--num-kv-blocks", "16", "--baseline", "roofline", "--json"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(argv)

    try:
        telemetry.configure_tracing("head", endpoint="http://localhost:4317")
        otlp_error = None
    except ImportError as exc:
        otlp_error = str(exc)

    loaded = sorted(name for name in sys.modules if name.split(".")[0] in BLOCKED)
    print(json.dumps(dict(tokens=tokens, code=code, bench=printed.getvalue(), loaded=loaded,
                          attempts=sorted(set(attempts)), otlp_error=otlp_error,
                          tracing=telemetry.tracing_enabled())))
    """
)


def test_engine_and_bench_run_with_cluster_packages_missing(tmp_path):
    script = CHILD.format(blocked=BLOCKED, model_dir=str(tmp_path / "tiny"))
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])

    # (a) greedy generation in process: both prompts come back with their tokens.
    assert [len(tokens) for tokens in result["tokens"]] == [4, 4]
    assert all(0 <= token < 512 for tokens in result["tokens"] for token in tokens)
    # (b) bench throughput prints its JSON report.
    assert result["code"] == 0
    report = json.loads(result["bench"])
    assert report["workload"]["num_requests"] == 3 and report["pagerail"]["output_tokens_per_s"] > 0
    # (c) nothing blocked was loaded; tracing stayed off, and asking for it names the missing package.
    assert result["loaded"] == []
    assert result["tracing"] is False
    assert result["otlp_error"] is not None and "opentelemetry" in result["otlp_error"]
