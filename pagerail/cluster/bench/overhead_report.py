"""The report of `pagerail bench overhead`: every part as a share of the forward ceiling, where each run's wall
time went, and the targets next to the figures."""

from __future__ import annotations

import argparse
from dataclasses import asdict

from pagerail.cluster.bench.process_cpu import usable_cores
from pagerail.cluster.bench.stats import format_table
from pagerail.cluster.bench.tiny_llama import TinyLlamaShape

# name → (target, "min" when the figure must reach it, "max" when it must stay at or below it)
TARGETS = {
    "offline_share_of_ceiling": (0.90, "min"),
    "serve_tp1_share_of_ceiling": (0.70, "min"),
    "offline_outside_forward_share": (0.05, "max"),
    "serve_tp1_outside_forward_share": (0.05, "max"),
}
RUNS = (
    ("offline", "LLM offline (in-process engine)"),
    ("serve_tp1", "pagerail serve, TP 1, HTTP streaming"),
    ("serve_tp2", "pagerail serve, TP 2, HTTP streaming"),
)


def build_report(shape: TinyLlamaShape, workload: dict[str, int], args: argparse.Namespace, parts: dict) -> dict:
    from pagerail.worker.worker import resolve_device, resolve_dtype

    device = resolve_device(args.device)
    ceiling = parts["ceiling"]["output_tokens_per_s"]
    shares = {name: parts[name]["output_tokens_per_s"] / ceiling for name, _ in RUNS if name in parts}
    figures = {f"{name}_share_of_ceiling": share for name, share in shares.items()}
    figures |= {f"{name}_outside_forward_share": parts[name]["phases"]["outside_forward_share"] for name in shares}
    targets = {}
    for name, (target, kind) in TARGETS.items():
        if name in figures:
            value = figures[name]
            met = value >= target if kind == "min" else value <= target
            targets[name] = {"value": value, "target": target, "met": met}
    return {
        "model": {**asdict(shape), "seed": args.seed},
        "device": device.type,
        "cores": usable_cores(),
        "dtype": str(resolve_dtype(args.dtype, device)).removeprefix("torch."),
        "async_scheduling": args.async_scheduling,
        "workload": {**workload, "prompt_len": args.prompt_len, "output_len": args.output_len, "users": args.users},
        "parts": parts,
        "share_of_ceiling": shares,
        "targets": targets,
    }


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def format_report(report: dict) -> str:
    model, work, parts = report["model"], report["workload"], report["parts"]
    ceiling = parts["ceiling"]
    lines = [
        f"model: random Llama, hidden {model['hidden_size']}, {model['num_layers']} layers, {model['num_heads']} heads "
        f"({model['num_kv_heads']} KV), MLP {model['intermediate_size']}, vocabulary {model['vocab_size']}, seed "
        f"{model['seed']}; {report['device']} {report['dtype']}; overlapped steps "
        f"{ {True: 'on', False: 'off', None: 'the default for the device'}[report['async_scheduling']] }",
        f"workload: {work['num_requests']} requests × {work['prompt_len']} prompt + {work['output_len']} output "
        f"tokens ({work['output_tokens']} output tokens); serve: {work['users']} concurrent streaming users",
        f"forward ceiling: {ceiling['prefill_steps']} prefill + {ceiling['decode_steps']} decode steps of up to "
        f"{ceiling['max_decode_batch']} sequences; decode forward p50 {1e3 * ceiling['decode_forward_p50_s']:.2f} ms",
        "",
    ]
    header = ["run", "output tok/s", "% of ceiling", "target", "TTFT p50 ms", "ITL p50 ms", "outside forward"]
    rows = [["forward ceiling (model alone)", ceiling["output_tokens_per_s"], "100.0%", "", "", "", ""]]
    rank_rate = ceiling["output_tokens"] / ceiling["rank_compute_seconds"]
    rows.append(["rank steps alone (+ inputs, sampling)", rank_rate, _pct(rank_rate / ceiling["output_tokens_per_s"])])
    rows[-1] += ["", "", "", _pct(1 - ceiling["forward_seconds"] / ceiling["rank_compute_seconds"])]
    for name, label in RUNS:
        if name not in parts:
            continue
        run = parts[name]
        target = TARGETS.get(f"{name}_share_of_ceiling")
        served = "ttft_p50_ms" in run
        rows.append(
            [
                label,
                run["output_tokens_per_s"],
                _pct(report["share_of_ceiling"][name]),
                f">= {100 * target[0]:.0f}%" if target else "",
                f"{run['ttft_p50_ms']:.1f}" if served else "",
                f"{run['itl_p50_ms']:.2f}" if served else "",
                _pct(run["phases"]["outside_forward_share"]),
            ]
        )
    lines.append(format_table(header, rows))
    shares = parts["offline"].get("round_shares", [])
    if len(shares) > 1:
        lines.append(
            f"offline share of the ceiling in each of {len(shares)} rounds (each against its own ceiling, the median "
            f"round above): {', '.join(_pct(share) for share in shares)}"
        )
    lines += [
        "",
        "per step, ms (means). schedule: the head's; dispatch: round trip less the rank's step, including the wait",
        "behind the step before it when steps overlap; rank other: the rank's inputs and sampling; rank idle: share",
        "of the wall time the rank computed nothing.",
    ]
    header = ["run", "steps", "forward", "outside fwd", "schedule", "dispatch", "rank other", "rank idle", "preempt"]
    rows = []
    for name, label in RUNS:
        if name in parts:
            p = parts[name]["phases"]
            rows.append(
                [
                    label.split(",")[0] + (f" TP {parts[name]['tensor_parallel_size']}" if name != "offline" else ""),
                    p["steps"],
                    p["forward_ms_per_step"],
                    p["outside_forward_ms_per_step"],
                    p["schedule_ms_per_step"],
                    p["dispatch_ms_per_step"],
                    p["rank_other_ms_per_step"],
                    _pct(p["rank_idle_share"]),
                    parts[name]["preemptions"],
                ]
            )
    lines.append(format_table(header, rows))
    lines += _cpu_lines(report)
    for name, _ in RUNS:
        run = parts.get(name, {})
        if run and not run.get("complete", True):
            lines.append(f"WARNING: {name}: {run['completed']} completed, {run['failed']} failed: {run['errors']}")
    if report["targets"]:
        lines += ["", "targets:"]
        for name, check in report["targets"].items():
            relation = ">=" if TARGETS[name][1] == "min" else "<="
            verdict = "met" if check["met"] else "NOT met"
            lines.append(f"  {name:<34} {_pct(check['value']):>7}  ({relation} {_pct(check['target'])}: {verdict})")
    return "\n".join(lines)


def _cpu_lines(report: dict) -> list[str]:
    """Each served run's CPU seconds by process over its measured stream, against what the cores could give."""
    lines = []
    for name, label in RUNS:
        run = report["parts"].get(name, {})
        cpu = run.get("cpu_seconds")
        if not cpu:
            continue
        capacity = report["cores"] * run["seconds"]
        used = sum(cpu.values())
        lines += [
            "",
            f"{label}: CPU seconds by process over the stream ({report['cores']} cores × {run['seconds']:.2f} s = "
            f"{capacity:.2f} s; {_pct(used / capacity)} used)",
        ]
        rows = [[process, seconds, _pct(seconds / capacity)] for process, seconds in cpu.items()]
        lines.append(format_table(["process", "CPU s", "of the cores"], rows))
    return lines
