"""`pagerail bench throughput`: offline throughput through the engine API, with baselines in the same run."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from pagerail.cluster.bench.stats import format_table
from pagerail.cluster.bench.step_phases import on_step_results
from pagerail.cluster.bench.structured import add_structured_arguments
from pagerail.cluster.bench.workload import BenchRequest, add_request_arguments, describe, throughput
from pagerail.common.engine_args import add_engine_arguments, engine_arg_values

BASELINES = ("static", "continuous", "roofline")

# Performance targets for the standard workload, each checked against this run's figures.
TARGETS = {
    "vs_transformers_generate": 6.0,
    "vs_transformers_continuous": 6.0,
    "share_of_roofline": 0.60,
    "outside_forward_share": 0.05,
    "peak_slot_utilisation": 0.96,
    "concurrency_vs_contiguous": 3.0,
}


def add_throughput_arguments(parser: argparse.ArgumentParser) -> None:
    add_request_arguments(parser)
    # --seed and --tokenizer are the workload's here (its prompts and their lengths).
    group = parser.add_argument_group("engine", "the same settings as `pagerail serve` and LLM(...)")
    add_engine_arguments(group, exclude=("seed", "tokenizer"))
    parser.add_argument(
        "--baseline",
        nargs="*",
        choices=BASELINES,
        default=None,
        help="also run these in the same invocation (no value: all of them)",
    )
    parser.add_argument(
        "--static-batch-sizes",
        type=int,
        nargs="+",
        default=(8, 64),
        help="static batch sizes for transformers generate; the fastest one is the baseline",
    )
    parser.add_argument(
        "--memory-bandwidth-gbs",
        type=float,
        default=None,
        help="device memory bandwidth (GB/s) for the decode step's bandwidth bound, e.g. 4800 for an H200",
    )
    add_structured_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def build_llm(args: argparse.Namespace):
    from pagerail import LLM

    return LLM(**engine_arg_values(args))


def run_pagerail(llm, requests: list[BenchRequest]) -> dict[str, Any]:
    """Every request queued at once, then engine steps until all finish; greedy, exact output lengths."""
    from pagerail import SamplingParams

    def params(request: BenchRequest) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=request.output_len, ignore_eos=True)

    llm.generate([requests[0].prompt_token_ids[:8]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
    if llm.engine is None:
        # Tensor parallel on Ray: the head drives the steps, so only end-to-end figures are available.
        started = time.perf_counter()
        outputs = llm.generate([r.prompt_token_ids for r in requests], [params(r) for r in requests])
        seconds = time.perf_counter() - started
        produced = sum(len(o.outputs[0].token_ids) for o in outputs)
        return {**throughput(requests, seconds, produced, "pagerail"), "steps": None}

    from pagerail.cluster.core.engine_request import EngineRequest
    from pagerail.cluster.core.scheduler_output import SchedulerStats
    from pagerail.worker.layers.kernel_variants import compiled_variants

    engine = llm.engine
    variants_before = compiled_variants()
    engine.scheduler.stats = SchedulerStats()  # the warm-up request must not count toward peaks
    # Forward seconds in all, and (seconds, sequences, context tokens) of every pure decode step, its seconds being
    # the whole step on the rank.
    forward = {"seconds": 0.0}
    decode_steps: list[tuple[float, int, int]] = []

    def on_submit(batch):
        decodes = batch.cached_requests
        num_decodes = len(decodes) + len(batch.decode_handles)
        decode = bool(num_decodes) and not batch.new_requests and all(d.num_scheduled_tokens == 1 for d in decodes)
        # Read when the step is submitted: with overlapped steps the scheduler has already moved past it later.
        context = sum(r.next_position for r in engine.scheduler.running) if decode else 0

        def record(result) -> None:
            forward["seconds"] += result.forward_seconds
            if decode:
                decode_steps.append((result.compute_seconds, num_decodes, context))

        return record

    with on_step_results(engine, on_submit):
        for i, request in enumerate(requests):
            engine.add_request(EngineRequest(f"bench-{i}", request.prompt_token_ids, params(request)))
        produced = 0
        started = time.perf_counter()
        while engine.has_unfinished():
            for finished in engine.step():
                produced += len(finished.output_token_ids) if finished.finished else 0
        seconds = time.perf_counter() - started
    forward_seconds = forward["seconds"]
    variants = compiled_variants()
    runner = engine.executor.worker.runner if hasattr(engine.executor, "worker") else None
    stats = engine.scheduler.stats
    block_table = engine.block_table
    kv_slots = block_table.num_blocks * block_table.block_size
    longest = max(r.prompt_len + r.output_len for r in requests)
    return {
        **throughput(requests, seconds, produced, "pagerail"),
        "steps": stats.num_steps,
        "forward_seconds": forward_seconds,
        # Scheduling, step message building, sampling and bookkeeping: everything the forward pass is not.
        "outside_forward_share": max(0.0, 1.0 - forward_seconds / seconds),
        "preemptions": stats.num_preemptions,
        "peak_slot_utilisation": stats.peak_utilisation,
        "peak_used_slots": stats.peak_used_slots,
        "peak_running": stats.peak_running,
        "kv_cache_slots": kv_slots,
        "max_model_len": engine.max_model_len,
        # The same KV memory reserved contiguously per sequence: at the model's length limit, and at the
        # longest request of this workload (the most favourable reservation a static server could make).
        "contiguous_seqs_at_max_model_len": kv_slots // engine.max_model_len,
        "contiguous_seqs_at_longest_request": kv_slots // longest,
        "decode_step": _typical_decode_step(decode_steps),
        **_speculation_figures(engine),
        # Triton variants compiled by the end of the run, and inside the timed part (each one seconds on a GPU).
        "kernel_variants": variants,
        "kernel_variants_compiled_in_run": {name: count - variants_before[name] for name, count in variants.items()},
        # Steps of the in-process rank that replayed a CUDA graph and that ran eagerly (warm-up included).
        "graph_steps": None
        if runner is None
        else {"replayed": runner.num_replayed_steps, "eager": runner.num_eager_steps},
    }


def _typical_decode_step(steps: list[tuple[float, int, int]]) -> dict[str, float] | None:
    """The pure decode step at the median batch size, with its duration and context length."""
    if not steps:
        return None
    by_size = sorted(steps, key=lambda s: s[1])
    median_size = by_size[len(by_size) // 2][1]
    same = sorted((s for s in steps if s[1] == median_size), key=lambda s: s[0])
    seconds, sequences, context = same[len(same) // 2]
    return {"seconds": seconds, "sequences": sequences, "context_tokens": context}


def memory_bound_seconds(model_dir, dtype: torch.dtype, step: dict[str, float], bandwidth_gbs: float) -> float:
    """Least time a decode step can take when every weight and every live KV byte is read once."""
    from pagerail.cluster.bench.roofline import shapes_from_config

    shapes = shapes_from_config(model_dir)
    element = torch.finfo(dtype).bits // 8
    kv = shapes.num_layers * shapes.kv_width * step["context_tokens"]
    return (shapes.num_weights + kv) * element / (bandwidth_gbs * 1e9)


def _model_dtype(llm) -> tuple[torch.device, torch.dtype]:
    """The device and dtype the engine resolved, so baselines run exactly like it."""
    from pagerail.worker.worker import resolve_device, resolve_dtype

    device = resolve_device(llm.config.device)
    return device, resolve_dtype(llm.config.dtype, device)


def run_baselines(llm, requests: list[BenchRequest], which: tuple[str, ...], args: argparse.Namespace) -> dict:
    from pagerail.cluster.bench import baselines, roofline

    device, dtype = _model_dtype(llm)
    results: dict[str, Any] = {}
    if "roofline" in which:
        shapes = roofline.shapes_from_config(llm.model_dir)
        results["roofline"] = roofline.measure_roofline(
            shapes, requests, rows=args.max_num_batched_tokens, dtype=dtype, device=device
        )
    if "static" in which:
        model = baselines.load_hf_model(llm.model_dir, dtype, device)
        runs = [baselines.run_static_batching(model, requests, size) for size in args.static_batch_sizes]
        # The fastest batch size is the baseline, so ratios are not flattered by a poor choice.
        results["transformers_generate"] = {"best": max(runs, key=lambda r: r["output_tokens_per_s"]), "runs": runs}
        del model
    if "continuous" in which:
        model = baselines.load_hf_model(llm.model_dir, dtype, device)  # the manager switches to paged attention
        # Never more KV than the engine had, nor more than every request at once needs (256-token pages).
        needed = sum(r.prompt_len + r.output_len + 256 for r in requests)
        engine_slots = llm.engine.block_table.num_blocks * args.block_size if llm.engine else needed
        results["transformers_continuous"] = baselines.run_continuous_batching(
            model,
            requests,
            kv_slots=min(engine_slots, needed),
            max_batch_tokens=args.max_num_batched_tokens,
            max_requests=args.max_num_seqs,
        )
        del model
    return results


def compare(ours: dict, others: dict) -> dict[str, float]:
    """Ratios of pagerail's output tokens/s to each baseline, and the other target figures."""
    rate = ours["output_tokens_per_s"]
    figures: dict[str, float] = {}
    if "transformers_generate" in others:
        figures["vs_transformers_generate"] = rate / others["transformers_generate"]["best"]["output_tokens_per_s"]
    if "transformers_continuous" in others:
        figures["vs_transformers_continuous"] = rate / others["transformers_continuous"]["output_tokens_per_s"]
    if "roofline" in others:
        figures["share_of_roofline"] = rate / others["roofline"]["output_tokens_per_s"]
    if ours.get("steps") is not None:
        figures["outside_forward_share"] = ours["outside_forward_share"]
        figures["peak_slot_utilisation"] = ours["peak_slot_utilisation"]
        figures["concurrency_vs_contiguous"] = ours["peak_running"] / max(1, ours["contiguous_seqs_at_max_model_len"])
    return figures


def check_targets(figures: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Each figure next to its target; the outside-forward share is the one that must stay below."""
    checks = {}
    for name, value in figures.items():
        target = TARGETS[name]
        met = value < target if name == "outside_forward_share" else value >= target
        checks[name] = {"value": value, "target": target, "met": met}
    return checks


def format_report(report: dict) -> str:
    ours, others = report["pagerail"], report["baselines"]
    work = report["workload"]
    lines = [
        f"model {report['model']} on {report['device']} ({report['dtype']}), {work['num_requests']} requests, "
        f"{work['prompt_tokens']} prompt + {work['output_tokens']} output tokens",
        "",
    ]
    rows = [["pagerail", ours["output_tokens_per_s"], ours["total_tokens_per_s"], ours["seconds"], "1.00"]]

    def add(label: str, result: dict) -> None:
        ratio = ours["output_tokens_per_s"] / result["output_tokens_per_s"]
        rows.append([label, result["output_tokens_per_s"], result["total_tokens_per_s"], result["seconds"], ratio])

    for run in others.get("transformers_generate", {}).get("runs", []):
        add(f"transformers generate, batch {run['batch_size']}", run)
    if "transformers_continuous" in others:
        add("transformers continuous batching", others["transformers_continuous"])
    if "roofline" in others:
        add(f"compute roofline ({others['roofline']['rows']}-row matmuls)", others["roofline"])
    header = ["run", "output tok/s", "total tok/s", "seconds", "pagerail ×"]
    lines.append(format_table(header, rows))
    if ours.get("steps") is not None:
        lines += [
            "",
            f"steps {ours['steps']}, preemptions {ours['preemptions']}, "
            f"outside the forward pass {100 * ours['outside_forward_share']:.1f}% of step time",
            f"KV cache {ours['kv_cache_slots']} slots: peak {ours['peak_running']} sequences at once, "
            f"{100 * ours['peak_slot_utilisation']:.1f}% of allocated slots holding live tokens; contiguous "
            f"reservation would hold {ours['contiguous_seqs_at_longest_request']} (longest request) or "
            f"{ours['contiguous_seqs_at_max_model_len']} (max_model_len {ours['max_model_len']})",
        ]
        step = ours.get("decode_step")
        if step:
            line = (
                f"decode step with {step['sequences']} sequences and {step['context_tokens']} context tokens: "
                f"{1000 * step['seconds']:.2f} ms"
            )
            if "memory_bound_seconds" in step:
                line += f" (memory-bandwidth bound {1000 * step['memory_bound_seconds']:.2f} ms)"
            lines.append(line)
    if report["targets"]:
        lines += ["", "targets:"]
        for name, check in report["targets"].items():
            verdict = "met" if check["met"] else "NOT met"
            relation = "<" if name == "outside_forward_share" else ">="
            lines.append(f"  {name:<28} {check['value']:8.3f}  ({relation} {check['target']:g}: {verdict})")
    return "\n".join(lines)


def run_throughput(args: argparse.Namespace) -> int:
    from pagerail.cluster.bench.workload import build_workload

    if args.json_schema:
        return _run_json_schema(args)
    if args.rounds != 1:
        raise ValueError("--rounds repeats the runs of --json-schema; give it with --json-schema")
    llm = build_llm(args)
    requests = build_workload(args, tokenizer=llm.tokenizer)
    device, dtype = _model_dtype(llm)
    ours = run_pagerail(llm, requests)
    which = BASELINES if args.baseline == [] else tuple(args.baseline or ())
    others = run_baselines(llm, requests, which, args) if which else {}
    figures = compare(ours, others)
    if args.memory_bandwidth_gbs and ours.get("decode_step"):
        step = ours["decode_step"]
        step["memory_bound_seconds"] = memory_bound_seconds(llm.model_dir, dtype, step, args.memory_bandwidth_gbs)
    report = {
        "model": llm.config.model_name,
        "device": device.type,
        "dtype": str(dtype).removeprefix("torch."),
        "workload": describe(requests),
        "pagerail": ours,
        "baselines": others,
        "figures": figures,
        "targets": check_targets(figures),
    }
    llm.shutdown()
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _run_json_schema(args: argparse.Namespace) -> int:
    """--json-schema: the constrained workload next to the unconstrained one; the other baselines do not apply."""
    from pagerail.cluster.bench import structured
    from pagerail.cluster.bench.workload import build_workload

    if args.baseline is not None:
        raise ValueError("--baseline compares unconstrained runs; --json-schema brings its own unconstrained baseline")
    schemas = structured.load_schemas(args.json_schema)  # before the model loads: a bad file fails fast
    structured.check_rounds(args.rounds)
    llm = build_llm(args)
    try:
        requests = build_workload(args, tokenizer=llm.tokenizer)
        device, dtype = _model_dtype(llm)
        report = {
            "model": llm.config.model_name,
            "device": device.type,
            "dtype": str(dtype).removeprefix("torch."),
            "workload": describe(requests),
            "structured": structured.run_structured(llm, requests, schemas, run_pagerail, args.rounds),
        }
    finally:
        llm.shutdown()
    print(json.dumps(report, indent=2) if args.json else structured.format_structured_report(report))
    return 0


def _speculation_figures(engine) -> dict:
    """Speculative decoding's totals for the run, when it was on."""
    policy = engine.speculation
    if not policy.enabled:
        return {}
    return {
        "speculation": {
            "drafts": policy.num_drafts,
            "draft_tokens": policy.num_draft_tokens,
            "accepted_tokens": policy.num_accepted_tokens,
            "acceptance_rate": policy.num_accepted_tokens / policy.num_draft_tokens if policy.num_draft_tokens else 0.0,
            "mean_acceptance_length": policy.mean_acceptance_length,
            "accepted_per_position": list(policy.accepted_per_position),
            "backoff_steps": policy.num_backoff_steps,
        }
    }
