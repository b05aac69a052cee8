"""`pagerail bench {throughput,serve,sweep,overhead}`: argument wiring; each command lives in its own module."""

from __future__ import annotations

import argparse


def _throughput(args: argparse.Namespace) -> int:
    from cluster.bench.offline import run_throughput

    return run_throughput(args)


def _serve(args: argparse.Namespace) -> int:
    from cluster.bench.online import run_serve

    return run_serve(args)


def _sweep(args: argparse.Namespace) -> int:
    from cluster.bench.sweep import run_sweep

    return run_sweep(args)


def _overhead(args: argparse.Namespace) -> int:
    from cluster.bench.overhead import run_overhead

    return run_overhead(args)


def add_bench_parser(commands: argparse._SubParsersAction) -> None:
    """Registers `bench` and its subcommands on the top-level `pagerail` parser."""
    from cluster.bench.offline import add_throughput_arguments
    from cluster.bench.online import add_serve_arguments
    from cluster.bench.overhead import add_overhead_arguments
    from cluster.bench.sweep import add_sweep_arguments

    bench = commands.add_parser("bench", help="benchmark throughput and serving latency")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    throughput = kinds.add_parser(
        "throughput", help="offline throughput through the engine API, optionally next to baselines"
    )
    add_throughput_arguments(throughput)
    throughput.set_defaults(func=_throughput)
    serve = kinds.add_parser("serve", help="latency and throughput against an OpenAI-compatible server")
    add_serve_arguments(serve)
    serve.set_defaults(func=_serve)
    sweep = kinds.add_parser("sweep", help="`bench serve` at rising load: CSV and a latency-throughput PNG")
    add_sweep_arguments(sweep)
    sweep.set_defaults(func=_sweep)
    overhead = kinds.add_parser(
        "overhead", help="engine overhead at short step times: forward ceiling, offline LLM and serve side by side"
    )
    add_overhead_arguments(overhead)
    overhead.set_defaults(func=_overhead)
