"""`pagerail bench serve`: streams a workload to an OpenAI-compatible server and reports latency and throughput."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sys
import time
from typing import Any

import httpx

from pagerail.cluster.bench.sse_client import SseClient
from pagerail.cluster.bench.stats import format_table, summarize
from pagerail.cluster.bench.stream_request import RequestResult, build_payload, send_streaming
from pagerail.cluster.bench.workload import BenchRequest, add_request_arguments, build_workload
from pagerail.common import event_loops

MAX_ERRORS = 5  # distinct error messages kept in the results; one is usually enough to see what went wrong
DEFAULT_CONCURRENCY = 16
API_KEY_ENVS = ("PAGERAIL_API_KEY", "OPENAI_API_KEY")


# -- arguments ---------------------------------------------------------------------------------------


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """Server, workload and request options shared by `bench serve` and `bench sweep`."""
    server = parser.add_argument_group("server")
    server.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    server.add_argument("--model", default=None, help="model name to request (default: the first from /v1/models)")
    server.add_argument("--api-key", default=None, help="bearer key (default: $PAGERAIL_API_KEY or $OPENAI_API_KEY)")
    server.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per request (default 600)")
    server.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let requests stop at EOS instead of always producing their output length",
    )
    add_request_arguments(parser)
    parser.add_argument(
        "--max-concurrency", type=int, default=None, help="with request rates: cap on requests in flight"
    )
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `bench serve`."""
    add_workload_arguments(parser)
    load = parser.add_mutually_exclusive_group()
    load.add_argument(
        "--concurrency", type=int, default=None, help=f"requests kept in flight (default {DEFAULT_CONCURRENCY})"
    )
    parser.add_argument(
        "--ramp-up",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="with --concurrency: users start evenly over this many seconds instead of all at once",
    )
    load.add_argument(
        "--request-rate", type=float, default=None, help="Poisson arrivals in requests/s; 'inf' sends all at once"
    )


def resolve_api_key(args: argparse.Namespace) -> str | None:
    """--api-key, else the first key found in the environment."""
    if args.api_key:
        return args.api_key
    return next((os.environ[name] for name in API_KEY_ENVS if os.environ.get(name)), None)


def resolve_model(base_url: str, api_key: str | None, timeout: float = 30.0) -> str:
    """The first model id the server lists at /v1/models."""
    response = httpx.get(f"{base_url.rstrip('/')}/v1/models", headers=_headers(api_key), timeout=timeout)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise LookupError(f"{base_url}/v1/models lists no models; pass --model")
    return models[0]["id"]


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


# -- the run -----------------------------------------------------------------------------------------


async def benchmark_serving(
    base_url: str,
    model: str,
    requests: list[BenchRequest],
    *,
    concurrency: int | None,
    request_rate: float | None,
    seed: int,
    api_key: str | None,
    ignore_eos: bool = True,
    timeout: float,
    ramp_up: float = 0.0,
) -> dict[str, Any]:
    """Streams every request to {base_url}/v1/completions and returns the results dict.

    In the closed loop, `ramp_up` seconds spread the users' first requests evenly instead of all at once.

    With `request_rate`, requests arrive as a Poisson process (seeded exponential gaps; inf sends all at once)
    and `concurrency`, when given, caps how many are in flight. Without it, `concurrency` requests are kept in
    flight until the list is done.
    """
    if not requests:
        raise ValueError("the workload holds no requests")
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    if not ramp_up >= 0:
        raise ValueError(f"ramp-up must be >= 0 seconds, got {ramp_up}")
    if request_rate is None and concurrency is None:
        raise ValueError("give a concurrency or a request rate")
    if request_rate is not None and not request_rate > 0:
        raise ValueError(f"request rate must be > 0, got {request_rate}")

    headers = _headers(api_key)
    results: list[RequestResult | None] = [None] * len(requests)

    # One keep-alive connection per request in flight, so the load pattern alone decides what is in flight.
    async with SseClient(base_url) as client:

        async def run_one(index: int) -> None:
            request = requests[index]
            payload = build_payload(model, request, ignore_eos)
            results[index] = await send_streaming(
                client, "/v1/completions", headers, payload, request.prompt_len, timeout
            )

        start = time.perf_counter()
        if request_rate is None:
            await _run_closed_loop(run_one, len(requests), concurrency, ramp_up)
        else:
            await _run_poisson(run_one, len(requests), request_rate, concurrency, seed)
        duration = time.perf_counter() - start

    return _aggregate([r for r in results if r is not None], duration, concurrency, request_rate)


async def _run_closed_loop(run_one, count: int, concurrency: int, ramp_up: float = 0.0) -> None:
    """`concurrency` workers each take the next request as soon as their previous one finishes.

    Worker i starts i * ramp_up / concurrency seconds in, as users joining a service one after another would.
    """
    pending = iter(range(count))
    workers = min(concurrency, count)

    async def worker(number: int) -> None:
        if ramp_up:
            await asyncio.sleep(number * ramp_up / workers)
        for index in pending:  # the iterator is shared, so each index is taken by exactly one worker
            await run_one(index)

    await asyncio.gather(*(worker(number) for number in range(workers)))


async def _run_poisson(run_one, count: int, rate: float, limit: int | None, seed: int) -> None:
    rng = random.Random(seed)
    gate = asyncio.Semaphore(limit) if limit else contextlib.nullcontext()

    async def gated(index: int) -> None:
        async with gate:
            await run_one(index)

    tasks = []
    # Arrivals follow a fixed schedule from the start, so a slow sleep does not shift every later arrival.
    start, offset = time.perf_counter(), 0.0
    for index in range(count):
        if index and math.isfinite(rate):
            offset += rng.expovariate(rate)
            await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        tasks.append(asyncio.create_task(gated(index)))
    await asyncio.gather(*tasks)


def _aggregate(
    results: list[RequestResult], duration: float, concurrency: int | None, request_rate: float | None
) -> dict[str, Any]:
    done = [r for r in results if r.success]
    errors: list[str] = []
    for result in results:
        if not result.success and result.error not in errors and len(errors) < MAX_ERRORS:
            errors.append(result.error)
    input_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    per_second = 1.0 / duration if duration > 0 else 0.0
    to_ms = 1000.0
    return {
        "mode": "concurrency" if request_rate is None else "request_rate",
        "concurrency": concurrency,
        "request_rate": request_rate,
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration,
        "request_throughput": len(done) * per_second,
        "output_throughput": output_tokens * per_second,
        "total_token_throughput": (input_tokens + output_tokens) * per_second,
        "total_input_tokens": input_tokens,
        "total_cached_tokens": sum(r.cached_tokens for r in done),
        "total_output_tokens": output_tokens,
        "ttft_ms": summarize([r.ttft * to_ms for r in done]),
        "tpot_ms": summarize([r.tpot * to_ms for r in done if r.tpot is not None]),
        "itl_ms": summarize([gap * to_ms for r in done for gap in r.itl]),
        "e2e_ms": summarize([r.e2e * to_ms for r in done]),
        "errors": errors,
    }


# -- reporting ---------------------------------------------------------------------------------------


LATENCY_ROWS = (("TTFT (ms)", "ttft_ms"), ("TPOT (ms)", "tpot_ms"), ("ITL (ms)", "itl_ms"), ("E2E (ms)", "e2e_ms"))


def load_label(results: dict[str, Any]) -> str:
    """How the load was applied, in words: "concurrency 16" or "rate 4 req/s (max 8 in flight)"."""
    if results["mode"] == "concurrency":
        return f"concurrency {results['concurrency']}"
    text = f"rate {results['request_rate']:g} req/s"
    return text + (f" (max {results['concurrency']} in flight)" if results["concurrency"] else "")


def format_results(results: dict[str, Any], model: str) -> str:
    """A results block: totals and throughputs, then latency mean and percentiles."""
    width = 50
    facts = [
        ("Model", model),
        ("Load", load_label(results)),
        ("Successful requests", results["completed"]),
        ("Failed requests", results["failed"]),
        ("Benchmark duration (s)", f"{results['duration_s']:.2f}"),
        ("Total input tokens", results["total_input_tokens"]),
        ("Cached input tokens", results["total_cached_tokens"]),
        ("Total output tokens", results["total_output_tokens"]),
        ("Request throughput (req/s)", f"{results['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{results['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{results['total_token_throughput']:.2f}"),
    ]
    lines = [" Serving Benchmark Result ".center(width, "=")]
    lines += [f"{name + ':':<36}{value}" for name, value in facts]
    lines.append("-" * width)
    header = ["metric", "mean", "p50", "p90", "p99"]
    rows = [[name, *(results[key][k] for k in ("mean", "p50", "p90", "p99"))] for name, key in LATENCY_ROWS]
    lines.append(format_table(header, rows))
    lines.append("=" * width)
    lines += [f"error: {error}" for error in results["errors"]]
    return "\n".join(lines)


def to_json(value: Any) -> str:
    """Strict JSON: an infinite request rate is written as the string "inf", which every parser reads."""

    def strict(item: Any) -> Any:
        if isinstance(item, float) and not math.isfinite(item):
            return str(item)
        if isinstance(item, dict):
            return {key: strict(inner) for key, inner in item.items()}
        if isinstance(item, list | tuple):
            return [strict(inner) for inner in item]
        return item

    return json.dumps(strict(value), indent=2, allow_nan=False)


def load_settings(args: argparse.Namespace) -> tuple[int | None, float | None]:
    """(concurrency, request_rate) from serve's arguments: a closed loop unless a request rate is given."""
    if args.request_rate is None:
        if args.max_concurrency is not None:
            raise ValueError("--max-concurrency goes with --request-rate; use --concurrency alone")
        return args.concurrency or DEFAULT_CONCURRENCY, None
    return args.max_concurrency, args.request_rate


def prepare(args: argparse.Namespace, command: str) -> tuple[str, str | None, list[BenchRequest]] | None:
    """(model, api key, requests) for a run against the server; None (after saying why) when it is unreachable."""
    api_key = resolve_api_key(args)
    try:
        model = args.model or resolve_model(args.base_url, api_key)
    except (httpx.HTTPError, LookupError) as error:
        print(f"pagerail bench {command}: cannot list models at {args.base_url}: {error}", file=sys.stderr)
        return None
    return model, api_key, build_workload(args)


def run_serve(args: argparse.Namespace) -> int:
    """`bench serve`: 0 when at least one request completed, 1 otherwise."""
    concurrency, request_rate = load_settings(args)
    prepared = prepare(args, "serve")
    if prepared is None:
        return 1
    model, api_key, requests = prepared
    results = event_loops.run(
        benchmark_serving(
            args.base_url,
            model,
            requests,
            concurrency=concurrency,
            request_rate=request_rate,
            seed=args.seed,
            api_key=api_key,
            ignore_eos=args.ignore_eos,
            timeout=args.timeout,
            ramp_up=args.ramp_up,
        )
    )
    print(to_json(results) if args.json else format_results(results, model))
    return 0 if results["completed"] else 1
