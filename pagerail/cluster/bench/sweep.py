"""`pagerail bench sweep`: one workload at rising load levels, written out as a CSV and a latency/throughput plot."""

from __future__ import annotations

import argparse
import csv
import math
import sys
from pathlib import Path
from typing import Any

from pagerail.cluster.bench.online import (
    add_workload_arguments,
    benchmark_serving,
    load_label,
    prepare,
    to_json,
)
from pagerail.cluster.bench.stats import format_table
from pagerail.cluster.bench.workload import BenchRequest, build_workload
from pagerail.common import event_loops

DEFAULT_CONCURRENCIES = (1, 2, 4, 8, 16, 32)

CSV_HEADER = (
    "load",
    "completed",
    "failed",
    "output_throughput",
    "request_throughput",
    "ttft_mean_ms",
    "ttft_p50_ms",
    "ttft_p90_ms",
    "ttft_p99_ms",
    "tpot_p50_ms",
    "tpot_p99_ms",
    "itl_p50_ms",
    "itl_p99_ms",
    "e2e_p50_ms",
    "e2e_p99_ms",
)


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `bench sweep`."""
    add_workload_arguments(parser)
    levels = parser.add_mutually_exclusive_group()
    levels.add_argument(
        "--concurrencies",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help=f"in-flight request counts to try (default {' '.join(map(str, DEFAULT_CONCURRENCIES))})",
    )
    levels.add_argument(
        "--request-rates",
        type=float,
        nargs="+",
        default=None,
        metavar="R",
        help="Poisson arrival rates in requests/s to try instead; 'inf' sends all at once",
    )
    parser.add_argument("--output-dir", default="bench-results", help="where sweep.csv and sweep.png go")


def sweep_levels(args: argparse.Namespace) -> tuple[str, list[float]]:
    """("concurrency" | "request_rate", load levels) from the arguments, checked."""
    if args.request_rates is not None:
        if any(not rate > 0 for rate in args.request_rates):
            raise ValueError(f"request rates must be > 0, got {args.request_rates}")
        return "request_rate", list(args.request_rates)
    if args.max_concurrency is not None:
        raise ValueError("--max-concurrency goes with --request-rates")
    concurrencies = list(args.concurrencies or DEFAULT_CONCURRENCIES)
    if any(n < 1 for n in concurrencies):
        raise ValueError(f"concurrencies must be >= 1, got {concurrencies}")
    return "concurrency", concurrencies


async def _sweep(
    args: argparse.Namespace, model: str, api_key: str | None, requests: list[BenchRequest], mode: str, levels: list
) -> list[dict[str, Any]]:
    results = []
    for number, level in enumerate(levels):
        concurrency, rate = (level, None) if mode == "concurrency" else (args.max_concurrency, level)
        if number and not args.dataset:
            # Fresh random prompts per level: the server's prefix cache would otherwise serve every prompt
            # after the first level from cache and flatter its time to first token.
            requests = build_workload(argparse.Namespace(**{**vars(args), "seed": args.seed + number}))
        result = await benchmark_serving(
            args.base_url,
            model,
            requests,
            concurrency=concurrency,
            request_rate=rate,
            seed=args.seed,
            api_key=api_key,
            ignore_eos=args.ignore_eos,
            timeout=args.timeout,
        )
        # Progress on stderr, so --json output on stdout stays parseable.
        print(
            f"{load_label(result)}: {result['completed']} done, {result['failed']} failed, "
            f"{result['output_throughput']:.1f} tok/s, TTFT p50 {result['ttft_ms']['p50']:.1f} ms",
            file=sys.stderr,
        )
        results.append(result)
    return results


def _csv_row(load: float, result: dict[str, Any]) -> list[object]:
    figures = []
    for column in CSV_HEADER[3:]:
        if column.endswith("_ms"):  # "ttft_p50_ms": the p50 of results["ttft_ms"]
            metric, statistic, unit = column.rsplit("_", 2)
            figures.append(result[f"{metric}_{unit}"][statistic])
        else:
            figures.append(result[column])
    return [_load_text(load), result["completed"], result["failed"], *(f"{x:.3f}" for x in figures)]


def _load_text(load: float) -> str:
    return f"{load:g}"


def write_csv(path: Path, loads: list[float], results: list[dict[str, Any]]) -> None:
    """One row per load level, columns as in CSV_HEADER."""
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(CSV_HEADER)
        writer.writerows(_csv_row(load, result) for load, result in zip(loads, results, strict=True))


def plot_sweep(path: Path, mode: str, loads: list[float], results: list[dict[str, Any]], model: str) -> None:
    """TTFT p50/p99 on the left axis and output tokens/s on the right, against load, as a PNG."""
    # The Agg canvas on a bare Figure: no GUI backend and no pyplot global state.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    positions = _positions(loads)
    figure = Figure(figsize=(8, 5), dpi=100)
    FigureCanvasAgg(figure)
    latency = figure.add_subplot()
    latency.plot(positions, [r["ttft_ms"]["p50"] for r in results], "o-", color="tab:blue", label="TTFT p50")
    latency.plot(positions, [r["ttft_ms"]["p99"] for r in results], "s--", color="tab:blue", label="TTFT p99")
    latency.set_xlabel("concurrency (requests in flight)" if mode == "concurrency" else "request rate (req/s)")
    latency.set_ylabel("time to first token (ms)", color="tab:blue")
    latency.set_ylim(bottom=0)
    throughput = latency.twinx()
    throughput.plot(
        positions, [r["output_throughput"] for r in results], "^-", color="tab:orange", label="output tok/s"
    )
    throughput.set_ylabel("output tokens/s", color="tab:orange")
    throughput.set_ylim(bottom=0)
    # Levels usually double, so a log axis spaces them evenly.
    if min(positions) > 0 and max(positions) / min(positions) >= 4:
        latency.set_xscale("log", base=2)
    latency.set_xticks(positions, [_load_text(load) for load in loads])
    latency.minorticks_off()
    lines = latency.get_lines() + throughput.get_lines()
    latency.legend(lines, [line.get_label() for line in lines], loc="upper left")
    latency.grid(alpha=0.3)
    latency.set_title(f"{model}: latency and throughput against load")
    figure.tight_layout()
    figure.savefig(path, format="png")


def _positions(loads: list[float]) -> list[float]:
    """x positions: an infinite rate sits one doubling past the largest finite one."""
    finite = [load for load in loads if math.isfinite(load)]
    beyond = 2 * max(finite) if finite else 1.0
    return [load if math.isfinite(load) else beyond for load in loads]


def format_sweep(loads: list[float], results: list[dict[str, Any]], mode: str) -> str:
    """One line per level: completions, throughputs and the latencies that show where the cliff is."""
    header = [
        "concurrency" if mode == "concurrency" else "req/s",
        "done",
        "failed",
        "req/s",
        "out tok/s",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "ITL p50",
        "E2E p50",
    ]
    rows = [
        [
            _load_text(load),
            r["completed"],
            r["failed"],
            r["request_throughput"],
            r["output_throughput"],
            r["ttft_ms"]["p50"],
            r["ttft_ms"]["p99"],
            r["tpot_ms"]["p50"],
            r["itl_ms"]["p50"],
            r["e2e_ms"]["p50"],
        ]
        for load, r in zip(loads, results, strict=True)
    ]
    return format_table(header, rows) + "\n(latencies in ms)"


def run_sweep(args: argparse.Namespace) -> int:
    """`bench sweep`: 0 when every level completed at least one request, 1 otherwise."""
    mode, loads = sweep_levels(args)
    prepared = prepare(args, "sweep")
    if prepared is None:
        return 1
    model, api_key, requests = prepared
    results = event_loops.run(_sweep(args, model, api_key, requests, mode, loads))

    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    csv_path, png_path = out / "sweep.csv", out / "sweep.png"
    write_csv(csv_path, loads, results)
    plot_sweep(png_path, mode, loads, results, model)

    if args.json:
        print(to_json({"model": model, "levels": results, "csv": str(csv_path), "png": str(png_path)}))
    else:
        print(f"model: {model}")
        print(format_sweep(loads, results, mode))
        print(f"csv: {csv_path}\nplot: {png_path}")
    return 0 if all(r["completed"] for r in results) else 1
