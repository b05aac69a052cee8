"""`bench serve` and `bench sweep` against the HTTP API over the fake engine: counts, latencies, limits, files."""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import time

import pytest
from transformers import AutoTokenizer

from pagerail.cluster.bench import online
from pagerail.cluster.bench.online import add_serve_arguments, benchmark_serving, run_serve
from pagerail.cluster.bench.sweep import add_sweep_arguments, run_sweep
from pagerail.cluster.bench.workload import random_workload, shared_prefix_workload
from pagerail.cluster.frontend.http_app import ServerState, create_app
from pagerail.cluster.frontend.settings import FrontendSettings
from tests.fake_engine import FakeEngineClient
from tests.http_server import BackgroundServer

KEY = "sk-bench-key"
SUMMARY_KEYS = {"mean", "p50", "p90", "p99"}
RESULT_KEYS = {
    "mode",
    "concurrency",
    "request_rate",
    "completed",
    "failed",
    "duration_s",
    "request_throughput",
    "output_throughput",
    "total_token_throughput",
    "total_input_tokens",
    "total_cached_tokens",
    "total_output_tokens",
    "ttft_ms",
    "tpot_ms",
    "itl_ms",
    "e2e_ms",
    "errors",
}


class CountingEngine(FakeEngineClient):
    """The fake engine, also recording the most generate calls it ever had running at once."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.running = 0
        self.peak = 0

    async def generate(self, *args, **kwargs):
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            async for delta in super().generate(*args, **kwargs):
                yield delta
        finally:
            self.running -= 1


@pytest.fixture(scope="module")
def tokenizer(smollm2_dir):
    return AutoTokenizer.from_pretrained(str(smollm2_dir))


@pytest.fixture(scope="module")
def server(tokenizer):
    # A small per-token delay keeps requests in flight long enough to overlap.
    engine = CountingEngine(model_name="fake", max_model_len=512, vocab_size=len(tokenizer), step_delay_s=0.002)
    state = ServerState(engine, tokenizer, FrontendSettings("fake", api_key=KEY))
    with BackgroundServer(create_app(state)) as base_url:
        yield base_url, engine


@pytest.fixture
def workload(tokenizer):
    return random_workload(8, (4, 24), (3, 12), vocab_size=len(tokenizer), seed=3)


def bench(base_url, requests, **overrides):
    options = {"concurrency": 4, "request_rate": None, "seed": 0, "api_key": KEY, "timeout": 30.0}
    options.update(overrides)
    model = options.pop("model", "fake")
    return asyncio.run(benchmark_serving(base_url, model, requests, **options))


def wait_idle(engine):
    """Requests a client gave up on may still be running on the server; let them finish before counting."""
    deadline = time.monotonic() + 10
    while engine.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine.running == 0
    engine.peak = 0


def assert_summaries(results):
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        summary = results[key]
        assert set(summary) == SUMMARY_KEYS, key
        assert 0 < summary["p50"] <= summary["p90"] <= summary["p99"], (key, summary)


def test_concurrency_run_completes_every_request_with_exact_lengths(server, workload):
    base_url, _ = server
    results = bench(base_url, workload)
    assert set(results) == RESULT_KEYS
    assert results["mode"] == "concurrency" and results["concurrency"] == 4 and results["request_rate"] is None
    assert results["completed"] == len(workload) and results["failed"] == 0 and results["errors"] == []
    assert results["total_output_tokens"] == sum(r.output_len for r in workload)
    assert results["total_input_tokens"] == sum(r.prompt_len for r in workload)
    assert_summaries(results)
    assert results["ttft_ms"]["mean"] > 0
    # Every request finishes after its first token, and no latency exceeds the whole run.
    assert results["e2e_ms"]["mean"] > results["ttft_ms"]["mean"]
    assert results["e2e_ms"]["p99"] <= results["duration_s"] * 1000
    expected = results["total_output_tokens"] / results["duration_s"]
    assert results["output_throughput"] == pytest.approx(expected)


def test_ramp_up_spreads_the_users_first_requests(server, workload):
    base_url, engine = server
    wait_idle(engine)
    results = bench(base_url, workload, concurrency=4, ramp_up=0.6)
    assert results["completed"] == len(workload) and results["failed"] == 0
    with pytest.raises(ValueError, match="ramp-up"):
        bench(base_url, workload, ramp_up=-1.0)


def test_ramp_up_delays_each_users_first_request_by_its_share(monkeypatch):
    """User i waits i/4 of the ramp-up once, before its first request; every request is still sent once."""
    events: list[tuple[str, float]] = []
    real_sleep = asyncio.sleep

    async def recorded_sleep(delay: float, *args, **kwargs):
        events.append(("sleep", delay))
        await real_sleep(0)

    async def run_one(index: int) -> None:
        events.append(("run", index))
        await real_sleep(0)

    monkeypatch.setattr(online.asyncio, "sleep", recorded_sleep)
    asyncio.run(online._run_closed_loop(run_one, 10, 4, ramp_up=0.6))
    delays = [value for kind, value in events if kind == "sleep"]
    assert delays == pytest.approx([0.0, 0.15, 0.3, 0.45])
    assert sorted(value for kind, value in events if kind == "run") == list(range(10))
    assert [kind for kind, _ in events[:4]] == ["sleep"] * 4  # every user waits its share before its first request


def test_poisson_arrivals_report_request_rate_mode(server, workload):
    base_url, _ = server
    results = bench(base_url, workload, concurrency=None, request_rate=40.0, seed=7)
    assert results["mode"] == "request_rate"
    assert results["request_rate"] == 40.0 and results["concurrency"] is None
    assert results["completed"] == len(workload) and results["failed"] == 0
    assert results["total_output_tokens"] == sum(r.output_len for r in workload)
    assert_summaries(results)


@pytest.mark.parametrize(
    ("overrides", "status"),
    [({"api_key": "sk-wrong"}, "401"), ({"api_key": None}, "401"), ({"model": "no-such-model"}, "404")],
    ids=["wrong key", "missing key", "unknown model"],
)
def test_failures_are_counted_not_raised(server, workload, overrides, status):
    base_url, _ = server
    results = bench(base_url, workload, **overrides)
    assert results["completed"] == 0 and results["failed"] == len(workload)
    assert results["errors"] and all(error.startswith(f"HTTP {status}") for error in results["errors"])
    assert results["total_output_tokens"] == 0 and results["output_throughput"] == 0
    assert results["ttft_ms"] == {key: 0.0 for key in SUMMARY_KEYS}


def test_a_request_past_its_timeout_fails(server, workload):
    base_url, engine = server
    engine.paused = True  # the fake engine holds every request at its first step
    try:
        results = bench(base_url, workload[:2], timeout=0.3)
    finally:
        engine.paused = False
        wait_idle(engine)
    assert results["failed"] == 2 and results["completed"] == 0
    assert any("timed out" in error for error in results["errors"]), results["errors"]


@pytest.mark.parametrize(
    ("concurrency", "request_rate"), [(2, None), (3, float("inf"))], ids=["closed loop", "max concurrency"]
)
def test_in_flight_requests_stay_within_the_limit(server, workload, concurrency, request_rate):
    base_url, engine = server
    wait_idle(engine)
    results = bench(base_url, workload, concurrency=concurrency, request_rate=request_rate)
    assert results["completed"] == len(workload)
    # The limit is reached (the requests do overlap) and never exceeded.
    assert engine.peak == concurrency


def test_unlimited_rate_sends_everything_at_once(server, workload):
    base_url, engine = server
    wait_idle(engine)
    results = bench(base_url, workload, concurrency=None, request_rate=float("inf"))
    assert results["completed"] == len(workload)
    assert engine.peak > 4


def parse(add_arguments, argv):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(argv)


def workload_argv(base_url, tokenizer):
    # No --model: the client asks /v1/models for it.
    return [
        "--base-url", base_url, "--api-key", KEY, "--num-requests", "6", "--prompt-len", "4", "16",
        "--output-len", "2", "8", "--vocab-size", str(len(tokenizer)), "--timeout", "30",
    ]  # fmt: skip


def test_run_serve_prints_json_results(server, tokenizer, capsys):
    base_url, _ = server
    args = parse(add_serve_arguments, [*workload_argv(base_url, tokenizer), "--concurrency", "3", "--json"])
    assert run_serve(args) == 0
    results = json.loads(capsys.readouterr().out)
    assert set(results) == RESULT_KEYS
    assert results["completed"] == 6 and results["failed"] == 0 and results["concurrency"] == 3
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(results[key]) == SUMMARY_KEYS


def test_run_serve_json_stays_strict_with_an_unlimited_rate(server, tokenizer, capsys):
    base_url, _ = server
    argv = [*workload_argv(base_url, tokenizer), "--request-rate", "inf", "--max-concurrency", "2", "--json"]
    assert run_serve(parse(add_serve_arguments, argv)) == 0

    def reject(constant):
        raise AssertionError(f"non-standard JSON constant {constant}")

    results = json.loads(capsys.readouterr().out, parse_constant=reject)
    assert results["mode"] == "request_rate" and results["request_rate"] == "inf" and results["concurrency"] == 2
    assert results["completed"] == 6


def test_run_serve_prints_a_table(server, tokenizer, capsys):
    base_url, _ = server
    args = parse(add_serve_arguments, [*workload_argv(base_url, tokenizer), "--request-rate", "inf"])
    assert run_serve(args) == 0
    out = capsys.readouterr().out
    for text in ("Successful requests:", "Output token throughput", "TTFT (ms)", "TPOT (ms)", "p99", "fake"):
        assert text in out


def test_run_serve_rejects_max_concurrency_without_a_rate(server, tokenizer):
    base_url, _ = server
    args = parse(add_serve_arguments, [*workload_argv(base_url, tokenizer), "--max-concurrency", "2"])
    with pytest.raises(ValueError, match="--max-concurrency"):
        run_serve(args)


def test_run_sweep_writes_csv_and_plot(server, tokenizer, tmp_path, capsys):
    base_url, _ = server
    out_dir = tmp_path / "sweep"
    argv = [*workload_argv(base_url, tokenizer), "--concurrencies", "1", "2", "--output-dir", str(out_dir), "--json"]
    assert run_sweep(parse(add_sweep_arguments, argv)) == 0

    report = json.loads(capsys.readouterr().out)
    assert report["model"] == "fake"
    assert [level["concurrency"] for level in report["levels"]] == [1, 2]
    assert all(level["completed"] == 6 for level in report["levels"])
    # Each level draws fresh prompts (seed + level), so no level is served from the previous one's prefix cache.
    first, second = (level["total_input_tokens"] for level in report["levels"])
    assert first != second

    with open(report["csv"], newline="") as handle:
        rows = list(csv.reader(handle))
    assert rows[0] == [
        "load", "completed", "failed", "output_throughput", "request_throughput",
        "ttft_mean_ms", "ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms",
        "tpot_p50_ms", "tpot_p99_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms", "e2e_p99_ms",
    ]  # fmt: skip
    assert [row[:3] for row in rows[1:]] == [["1", "6", "0"], ["2", "6", "0"]]
    assert all(float(value) > 0 for row in rows[1:] for value in row[3:])

    png = (out_dir / "sweep.png").read_bytes()
    assert report["png"] == str(out_dir / "sweep.png")
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000


def test_run_sweep_over_request_rates_prints_a_table(server, tokenizer, tmp_path, capsys):
    base_url, _ = server
    argv = [*workload_argv(base_url, tokenizer), "--request-rates", "50", "inf", "--output-dir", str(tmp_path)]
    assert run_sweep(parse(add_sweep_arguments, argv)) == 0
    out = capsys.readouterr().out
    assert "TTFT p50" in out and str(tmp_path / "sweep.csv") in out and str(tmp_path / "sweep.png") in out
    with open(tmp_path / "sweep.csv", newline="") as handle:
        assert [row["load"] for row in csv.DictReader(handle)] == ["50", "inf"]
    assert (tmp_path / "sweep.png").read_bytes().startswith(b"\x89PNG")


def test_a_shared_prefix_workload_shares_its_prefixes_evenly_in_random_order():
    requests = shared_prefix_workload(12, 3, 40, (5, 9), (2, 4), vocab_size=1000, seed=1)
    prefixes = [tuple(r.prompt_token_ids[:40]) for r in requests]
    assert len(set(prefixes)) == 3 and all(prefixes.count(p) == 4 for p in prefixes)
    # Interleaved in a random order: no period a round-robin balancer could fall in step with.
    assert any(prefixes[i] != prefixes[i + 3] for i in range(9))
    assert all(45 <= r.prompt_len <= 49 and 2 <= r.output_len <= 4 for r in requests)
    # Each request's own part differs, so only the prefix can be served from a cache.
    assert len({tuple(r.prompt_token_ids[40:]) for r in requests}) == 12
    with pytest.raises(ValueError, match="--shared-prefix"):
        shared_prefix_workload(4, 0, 40, (5, 9), (2, 4), vocab_size=1000)


def test_cached_prompt_tokens_are_read_from_the_usage(server, workload, monkeypatch):
    base_url, engine = server
    original = engine.generate

    async def with_cache_hits(*args, **kwargs):
        async for delta in original(*args, **kwargs):
            delta.num_cached_tokens = 3
            yield delta

    monkeypatch.setattr(engine, "generate", with_cache_hits)
    results = bench(base_url, workload)
    assert results["completed"] == len(workload)
    assert results["total_cached_tokens"] == 3 * len(workload)
