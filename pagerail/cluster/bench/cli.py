"""`pagerail bench {throughput,serve,sweep,overhead,soak}`: argument wiring; each command lives in its own module."""

from __future__ import annotations

import argparse


def add_bench_parser(commands: argparse._SubParsersAction) -> None:
    """Registers `bench` and its subcommands on the top-level `pagerail` parser."""
    from pagerail.cluster.bench.offline import add_throughput_arguments, run_throughput
    from pagerail.cluster.bench.online import add_serve_arguments, run_serve
    from pagerail.cluster.bench.overhead import add_overhead_arguments, run_overhead
    from pagerail.cluster.bench.soak import add_soak_arguments, run_soak_command
    from pagerail.cluster.bench.sweep import add_sweep_arguments, run_sweep

    bench = commands.add_parser("bench", help="benchmark throughput and serving latency")
    kinds = bench.add_subparsers(dest="bench_command", required=True)
    throughput = kinds.add_parser(
        "throughput", help="offline throughput through the engine API, optionally next to baselines"
    )
    add_throughput_arguments(throughput)
    throughput.set_defaults(func=run_throughput)
    serve = kinds.add_parser("serve", help="latency and throughput against an OpenAI-compatible server")
    add_serve_arguments(serve)
    serve.set_defaults(func=run_serve)
    sweep = kinds.add_parser("sweep", help="`bench serve` at rising load: CSV and a latency-throughput PNG")
    add_sweep_arguments(sweep)
    sweep.set_defaults(func=run_sweep)
    overhead = kinds.add_parser(
        "overhead", help="engine overhead at short step times: forward ceiling, offline LLM and serve side by side"
    )
    add_overhead_arguments(overhead)
    overhead.set_defaults(func=run_overhead)
    soak = kinds.add_parser(
        "soak", help="a served cluster under mixed clients and scheduled faults, checked for exactness and leaks"
    )
    add_soak_arguments(soak)
    soak.set_defaults(func=run_soak_command)
