"""`pagerail bench overhead`: the tiny checkpoint, the forward ceiling's batches, the step-phase arithmetic, and
whole runs (offline in-process; serve parts against a stand-in server process)."""

from __future__ import annotations

import json
import sys

import httpx
import pytest
from safetensors.torch import load_file
from transformers import AutoTokenizer

from pagerail.cluster.bench import server_process
from pagerail.cluster.bench.forward_ceiling import measure_forward_ceiling
from pagerail.cluster.bench.overhead import median_round
from pagerail.cluster.bench.step_phases import PHASES, outside_forward, totals_from_registry, totals_from_text
from pagerail.cluster.bench.tiny_llama import TinyLlamaShape, write_tiny_llama
from pagerail.cluster.bench.workload import BenchRequest
from pagerail.cluster.cli import main
from tests.stand_in_server import PHASE_SECONDS

SMALL = TinyLlamaShape(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128, vocab_size=512)
SMALL_FLAGS = ["--hidden-size", "64", "--num-layers", "2", "--intermediate-size", "128", "--vocab-size", "512"]


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("overhead") / "model", SMALL, seed=3)


def test_checkpoint_is_reproducible_and_its_tokenizer_matches_the_vocabulary(small_dir, tmp_path):
    again = write_tiny_llama(tmp_path / "again", SMALL, seed=3)
    first, second = load_file(small_dir / "model.safetensors"), load_file(again / "model.safetensors")
    assert first.keys() == second.keys() and all(first[k].equal(second[k]) for k in first)
    assert first["model.embed_tokens.weight"].shape == (512, 64)
    assert json.loads((small_dir / "config.json").read_text())["vocab_size"] == 512
    tokenizer = AutoTokenizer.from_pretrained(str(small_dir))
    assert len(tokenizer) == 512
    text = "Any text at all, ünïcode and 数字 included: 12345!"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert max(ids) < 512 and tokenizer.decode(ids) == text


def test_ceiling_runs_the_workloads_batches_and_counts_every_output_token(small_dir):
    # Prompts of 16 tokens in a budget of 10: chunked across prefill steps (48 tokens → 5 steps).
    requests = [BenchRequest(list(range(100, 116)), n) for n in (1, 3, 5)]
    result = measure_forward_ceiling(small_dir, requests, block_size=4, max_num_batched_tokens=10, device="cpu")
    assert result["output_tokens"] == 9
    assert result["prefill_steps"] == 5
    # One decode step per output position after the first; only requests still short of their length run.
    assert result["decode_steps"] == 4 and result["max_decode_batch"] == 2
    assert 0 < result["forward_seconds"] <= result["rank_compute_seconds"] <= result["wall_seconds"]
    assert result["output_tokens_per_s"] == pytest.approx(9 / result["forward_seconds"])


def test_outside_forward_splits_wall_time_between_forward_rank_work_and_idle():
    before = {phase: (1.0, 10.0) for phase in PHASES}
    after = {"schedule": (1.05, 20.0), "dispatch": (1.2, 20.0), "forward": (1.8, 20.0), "sample": (1.1, 20.0)}
    phases = outside_forward(before, after, wall_seconds=1.0)
    assert phases["steps"] == 10
    assert phases["outside_forward_share"] == pytest.approx(0.2)
    assert phases["rank_other_share"] == pytest.approx(0.1)
    assert phases["rank_idle_share"] == pytest.approx(0.1)
    assert phases["outside_forward_ms_per_step"] == pytest.approx(20.0)
    assert phases["schedule_ms_per_step"] == pytest.approx(5.0)
    assert phases["forward_ms_per_step"] == pytest.approx(80.0)


def test_phase_totals_read_the_engines_own_histograms():
    from pagerail.cluster.core.engine_metrics import EngineMetrics

    metrics = EngineMetrics("m")
    for _ in range(3):
        for phase in PHASES:
            metrics.step_duration.labels("m", phase).observe(0.25)
    from prometheus_client import generate_latest

    from_registry = totals_from_registry(metrics.registry)
    from_text = totals_from_text(generate_latest(metrics.registry).decode())
    assert from_registry == from_text == {phase: (0.75, 3.0) for phase in PHASES}


def _report(path) -> dict:
    return json.loads(path.read_text())


def test_offline_run_reports_every_figure_over_the_same_tokens(tmp_path, capsys):
    out = tmp_path / "report.json"
    argv = ["bench", "overhead", "--num-requests", "8", "--prompt-len", "12", "--output-len", "6", "--users", "8"]
    argv += [*SMALL_FLAGS, "--device", "cpu", "--skip-serve", "--json", str(out)]
    assert main(argv) == 0
    table = capsys.readouterr().out
    report = _report(out)
    parts = report["parts"]
    assert set(parts) == {"ceiling", "offline"}
    assert report["workload"]["output_tokens"] == 48
    # The ceiling is measured over exactly the tokens the engine produced.
    assert parts["ceiling"]["output_tokens"] == parts["offline"]["output_tokens"] == 48
    assert parts["ceiling"]["decode_steps"] == 5 and parts["ceiling"]["max_decode_batch"] == 8
    offline = parts["offline"]
    assert report["share_of_ceiling"]["offline"] == pytest.approx(
        offline["output_tokens_per_s"] / parts["ceiling"]["output_tokens_per_s"]
    )
    phases = offline["phases"]
    assert phases["steps"] >= 6 and 0 <= phases["outside_forward_share"] < 1
    assert phases["forward_seconds"] <= phases["wall_seconds"]
    assert offline["preemptions"] == 0
    assert set(report["targets"]) == {"offline_share_of_ceiling", "offline_outside_forward_share"}
    for label in ("forward ceiling", "LLM offline", "% of ceiling", "outside forward", "targets:"):
        assert label in table
    assert "pagerail serve" not in table


def test_the_median_round_is_reported_with_every_rounds_share():
    def round_of(ceiling: float, offline: float) -> dict:
        return {
            "ceiling": {"output_tokens_per_s": ceiling},
            "offline": {"output_tokens_per_s": offline, "mark": offline},
        }

    # Shares 0.5, 0.9, 0.7: the median is the third round's, not the fastest offline run nor the last one.
    chosen = median_round([round_of(100, 50), round_of(50, 45), round_of(200, 140)])
    assert chosen["ceiling"]["output_tokens_per_s"] == 200 and chosen["offline"]["mark"] == 140
    assert chosen["offline"]["round_shares"] == pytest.approx([0.5, 0.7, 0.9])
    single = median_round([round_of(10, 8)])
    assert single["offline"]["round_shares"] == pytest.approx([0.8])


def test_rounds_alternate_ceiling_and_offline_runs(tmp_path, capsys):
    out = tmp_path / "report.json"
    argv = ["bench", "overhead", "--num-requests", "4", "--prompt-len", "8", "--output-len", "3", "--users", "4"]
    argv += [*SMALL_FLAGS, "--device", "cpu", "--skip-serve", "--rounds", "3", "--json", str(out)]
    assert main(argv) == 0
    report = _report(out)
    shares = report["parts"]["offline"]["round_shares"]
    assert len(shares) == 3 and shares == sorted(shares)
    assert report["share_of_ceiling"]["offline"] == pytest.approx(shares[1])
    assert "in each of 3 rounds" in capsys.readouterr().out
    assert main([*argv[:-2], "--rounds", "0"]) != 0
    assert "--rounds must be >= 1" in capsys.readouterr().err


@pytest.mark.slow  # starts a server
def test_serve_parts_stream_to_the_server_and_read_its_step_metrics(tmp_path, capsys, monkeypatch):
    commands = []

    def stand_in(python, model_dir, port, *flags):
        commands.append(flags)
        return [sys.executable, "-m", "tests.stand_in_server", "--model", str(model_dir), "--port", str(port), *flags]

    monkeypatch.setattr(server_process, "pagerail_serve_command", stand_in)
    ports = []
    real_free_port = server_process.free_port
    monkeypatch.setattr(server_process, "free_port", lambda: ports.append(real_free_port()) or ports[-1])
    out = tmp_path / "report.json"
    argv = ["bench", "overhead", "--num-requests", "6", "--prompt-len", "8", "--output-len", "5", "--users", "3"]
    argv += [*SMALL_FLAGS, "--device", "cpu", "--json", str(out), "--work-dir", str(tmp_path / "work")]
    argv += ["--cpus-per-worker", "1.5"]
    assert main(argv) == 0
    table = capsys.readouterr().out
    report = _report(out)
    for name, tp in (("serve_tp1", 1), ("serve_tp2", 2)):
        run = report["parts"][name]
        assert run["complete"] and run["completed"] == 6 and run["output_tokens"] == 30
        assert run["tensor_parallel_size"] == tp and run["users"] == 3
        assert run["ttft_p50_ms"] > 0 and run["itl_p50_ms"] > 0
        # Only the measured run's 30 tokens count: the warm-up's are read off before it starts.
        assert run["phases"]["steps"] == 30
        assert run["phases"]["forward_seconds"] == pytest.approx(30 * PHASE_SECONDS["forward"])
        assert report["share_of_ceiling"][name] == pytest.approx(
            run["output_tokens_per_s"] / report["parts"]["ceiling"]["output_tokens_per_s"]
        )
        # Where the cores went over the measured stream: this process streamed, the stand-in server served.
        assert run["cpu_seconds"]["client (bench process)"] > 0
        assert set(run["cpu_seconds"]) <= {"client (bench process)", "python -m tests.stand_in_server"}
    assert "serve_tp1_share_of_ceiling" in report["targets"] and "serve_tp1_outside_forward_share" in report["targets"]
    assert "pagerail serve, TP 1, HTTP streaming: CPU seconds by process over the stream" in table
    assert "pagerail serve, TP 1" in table and "pagerail serve, TP 2" in table and "TTFT p50 ms" in table
    assert (tmp_path / "work" / "serve-tp1.log").exists()
    # Each server gets its tensor-parallel size, a sequence limit for every request and the same KV block count.
    flags = [dict(zip(command[::2], command[1::2], strict=False)) for command in commands]
    assert [f["--tensor-parallel-size"] for f in flags] == ["1", "2"]
    assert all(f["--max-num-seqs"] == "6" and f["--device"] == "cpu" for f in flags)
    assert all(f["--cpus-per-worker"] == "1.5" for f in flags)
    # K and V x 2 layers x 16 tokens x 16 dims x 4 bytes per KV head; TP 2 holds half the KV heads on each rank.
    per_head_block = 2 * 2 * 16 * 16 * 4
    blocks = int(flags[0]["--kv-cache-memory-bytes"]) // (2 * per_head_block)
    assert blocks == 6 + 6  # one block per request, and one spare each
    assert int(flags[1]["--kv-cache-memory-bytes"]) == blocks * per_head_block
    # Both servers were stopped.
    assert len(ports) == 2
    for port in ports:
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2.0)


def test_serve_can_turn_overlapped_steps_off():
    from pagerail.cluster.cli import build_parser

    assert build_parser().parse_args(["serve"]).async_scheduling is None  # the engine decides by device
    assert build_parser().parse_args(["serve", "--async-scheduling"]).async_scheduling is True
    assert build_parser().parse_args(["serve", "--no-async-scheduling"]).async_scheduling is False


def test_a_server_that_exits_early_fails_with_its_output(tmp_path):
    command = [sys.executable, "-c", "print('cannot start: no model'); raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match="cannot start: no model"):
        with server_process.ServerProcess(command, "http://127.0.0.1:9", tmp_path / "log"):
            pass
