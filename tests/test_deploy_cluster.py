"""A Ray cluster started the way `ray up` starts one (`ray start --head`, then `ray start --address=...` as separate
processes) runs `pagerail serve --ray-address ...` with tensor parallel 2, one rank per node, and answers an
OpenAI request; everything it started is stopped again."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
# The embedded model's tokenizer files, next to a tiny random Llama with the tokenizer's vocabulary size.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def _free_ports(count: int) -> list[int]:
    # All bound at once, so the ports differ from each other; released just before Ray binds them.
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _session_of(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Fields after the command name, which may itself hold spaces and parentheses: state ppid pgrp session ...
    return int(stat.rsplit(")", 1)[1].split()[3])


def _processes_in_sessions(sessions: set[int]) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _session_of(int(entry.name)) in sessions:
            found.append(int(entry.name))
    return found


def _stop_sessions(sessions: set[int]) -> None:
    """End every process of the sessions this test started (Ray daemons and workers stay in them), by pid."""
    # Ray's raylet and agents take well over 10 s to act on SIGTERM (`ray stop` itself waits 16 s before killing):
    # a short grace, then SIGKILL; what is checked is only that nothing is left running afterwards.
    for sig, grace in ((signal.SIGTERM, 1.0), (signal.SIGKILL, 5.0)):
        pids = _processes_in_sessions(sessions)
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and any(_is_running(pid) for pid in pids):
            time.sleep(0.2)


def _is_running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _tiny_llama_with_tokenizer(path: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from pagerail.common.model_source import resolve_model_dir
    from tests.tiny_models import tiny_config

    embedded = resolve_model_dir(None)
    config = tiny_config("llama")  # four heads and two KV heads: tensor parallel 2 splits both
    config.vocab_size = 49152  # SmolLM2's tokenizer
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path, safe_serialization=True)
    for name in TOKENIZER_FILES:
        if (embedded / name).is_file():
            shutil.copy(embedded / name, path / name)
    return path


def _start_node(args: list[str], env: dict[str, str], sessions: set[int]) -> None:
    # Its own session, as on a machine of its own: every daemon it leaves behind can be found and ended.
    process = subprocess.Popen(
        [str(BIN / "ray"), "start", *args, "--disable-usage-stats"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        start_new_session=True,
    )
    sessions.add(process.pid)
    output, _ = process.communicate(timeout=90)
    assert process.returncode == 0, output[-3000:]


def _ranks_nodes(address: str, env: dict[str, str]) -> tuple[int, list[str]]:
    """(alive Ray nodes, the node of each rank), asked from a separate driver as an operator would."""
    script = textwrap.dedent(
        f"""
        import re
        import ray
        ray.init(address={address!r}, namespace="pagerail", log_to_driver=False)
        heads = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                 if re.fullmatch(r"pagerail-head-[0-9]+", a["name"])]  # not its ranks, named after it
        print(sum(node["Alive"] for node in ray.nodes()))
        print(*ray.get(ray.get_actor(heads[0]).__ray_call__.remote(lambda head: list(head.group.node_ids))))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60, start_new_session=True
    )
    assert result.returncode == 0, result.stderr[-3000:]
    alive, nodes = result.stdout.strip().splitlines()[-2:]
    return int(alive), nodes.split()


def test_serve_on_a_two_node_ray_cluster_started_like_ray_up(tmp_path):
    # Written while the two nodes start (seconds of torch and transformers imports otherwise spent in turn).
    writer = ThreadPoolExecutor(max_workers=1)
    model_future = writer.submit(_tiny_llama_with_tokenizer, tmp_path / "tiny-llama")
    writer.shutdown(wait=False)  # the submitted write still runs; its thread ends after it
    # Unix socket paths are limited to 107 bytes: Ray's session directories need a short root.
    temp_root = Path(tempfile.mkdtemp(prefix="pr-", dir="/tmp"))
    (gcs, dashboard, client, *agent_ports) = _free_ports(11)
    address = f"127.0.0.1:{gcs}"
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_")}
    # Token authentication, as the Helm chart sets it up: the same token in every process, not ~/.ray.
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), PYTHONUNBUFFERED="1")
    sessions: set[int] = set()
    serve = None
    lines: list[str] = []
    try:
        head_agent, worker_agent = agent_ports[:4], agent_ports[4:]
        node_ports = "--dashboard-agent-listen-port={} --dashboard-agent-grpc-port={} --metrics-export-port={}"
        node_ports += " --runtime-env-agent-port={}"
        _start_node(
            [
                "--head",
                f"--port={gcs}",
                "--num-cpus=1",
                "--include-dashboard=false",
                f"--dashboard-port={dashboard}",
                f"--ray-client-server-port={client}",
                f"--temp-dir={temp_root / 'head'}",
                *node_ports.format(*head_agent).split(),
            ],
            env,
            sessions,
        )
        _start_node(
            [
                f"--address={address}",
                "--num-cpus=1",
                f"--temp-dir={temp_root / 'worker'}",
                *node_ports.format(*worker_agent).split(),
            ],
            env,
            sessions,
        )

        command = [
            str(BIN / "pagerail"),
            "serve",
            "--ray-address",
            address,
            "--model",
            str(model_future.result(timeout=120)),
            "--served-model-name",
            "tiny-llama",
            "--tensor-parallel-size",
            "2",
            "--placement-strategy",
            "STRICT_SPREAD",
            "--device",
            "cpu",
            # 16 MiB of KV cache per rank (65,536 tokens of the tiny model), not the 2 GiB CPU default.
            "--kv-cache-memory-bytes",
            str(16 << 20),
            "--port",
            "0",
            "--grpc-port",
            "0",
        ]
        serve = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**env, "RAY_ADDRESS": address},
            start_new_session=True,
        )
        sessions.add(serve.pid)
        ready = threading.Event()
        url: list[str] = []

        def read_output() -> None:
            # Drained to the end, so serve never blocks on a full pipe.
            for line in serve.stdout:
                lines.append(line)
                match = re.search(r"ready in .*OpenAI API (http://\S+/v1)", line)
                if match:
                    url.append(match.group(1).rstrip(","))
                    ready.set()
            ready.set()

        reader = threading.Thread(target=read_output, daemon=True)
        reader.start()
        assert ready.wait(timeout=180) and url, "".join(lines[-40:])

        client_api = openai.OpenAI(base_url=url[0], api_key="unused", max_retries=0, timeout=60)
        reply = client_api.completions.create(
            model="tiny-llama",
            prompt="The capital of France is",
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert reply.usage.completion_tokens == 8
        assert reply.choices[0].text and reply.choices[0].finish_reason == "length"
        # One rank per node gives the tokens of one process holding the whole model.
        from pagerail import LLM, SamplingParams

        with LLM(str(model_future.result()), kv_cache_memory_bytes=1 << 20) as whole:
            params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
            assert reply.choices[0].text == whole.generate(["The capital of France is"], params)[0].outputs[0].text

        alive, rank_nodes = _ranks_nodes(address, env)
        assert alive == 2
        assert len(rank_nodes) == 2 and len(set(rank_nodes)) == 2, "each rank on its own node"

        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=90) == 0, "".join(lines[-40:])
        reader.join(timeout=10)
        assert any("stopped" in line for line in lines), "".join(lines[-20:])
    finally:
        if serve is not None and serve.poll() is None:
            serve.kill()
        _stop_sessions(sessions)
        shutil.rmtree(temp_root, ignore_errors=True)
    assert not [pid for pid in _processes_in_sessions(sessions) if _is_running(pid)], "processes left running"
