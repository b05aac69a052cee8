"""Schemathesis over the whole /openapi.json of the HTTP server (on the fake engine): no generated input, valid or
not, gets a 5xx, input the schema rules out is refused, and no route but the open ones answers without the key
(not_a_server_error, negative_data_rejection, ignored_auth)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagerail.cluster.frontend.http_app import ServerState, create_app
from pagerail.cluster.frontend.settings import FrontendSettings
from tests.fake_engine import FakeEngineClient
from tests.http_server import BackgroundServer
from tests.requirements import require_module

pytestmark = pytest.mark.slow  # a child process: the schemathesis CLI
KEY = "sk-fuzz"
# Enough to reach every operation's body shapes in a few seconds; run the CLI with more for a longer search.
EXAMPLES = 25


def test_no_generated_request_gets_a_server_error(smollm2_dir, tmp_path: Path):
    require_module("schemathesis", "the API fuzz test needs schemathesis")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(smollm2_dir))
    engine = FakeEngineClient(model_name="fake", max_model_len=256, vocab_size=len(tokenizer))
    app = create_app(ServerState(engine, tokenizer, FrontendSettings("fake", api_key=KEY)))
    cli = shutil.which("schemathesis", path=str(Path(sys.executable).parent)) or "schemathesis"
    with BackgroundServer(app) as base_url:
        command = [cli, "run", f"{base_url}/openapi.json", "-H", f"Authorization: Bearer {KEY}"]
        command += [
            "--checks",
            "not_a_server_error,negative_data_rejection,ignored_auth",
            "--max-examples",
            str(EXAMPLES),
        ]
        command += ["--workers", "1", "--seed", "1", "--no-color"]
        done = subprocess.run(command, capture_output=True, text=True, cwd=tmp_path, timeout=600, check=False)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and "failure" not in done.stdout.split("SUMMARY")[-1].lower(), done.stdout[-3000:]
