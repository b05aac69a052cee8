"""Offline throughput with tracing off and on (sampling 1.0, OTLP/gRPC to a local receiver), in alternating rounds.

Each mode runs in its own process (a process installs its tracer provider once), both loaded before the first
round and driven in turn from here, so drift on a shared machine hits both alike. A round is the same workload
on the embedded model in-process: every request gets a request span (standing in for the frontend's) whose
context it carries, so the traced rounds pay for everything the head and a rank do per step: the step span with
its links and events, schedule, dispatch, prepare_inputs, forward and sample, and the OTLP export.

Throughput on a shared CPU drifts by more than tracing costs, so each process also times the per-step span work
alone (the same spans, links and events, without the model) against its median step time.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import statistics
import time
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class CountingReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """The collector's side: accepts OTLP exports and counts the spans."""

    def __init__(self) -> None:
        self.num_spans = 0

    def Export(self, request, context):  # noqa: N802
        self.num_spans += sum(len(s.spans) for r in request.resource_spans for s in r.scope_spans)
        return trace_service_pb2.ExportTraceServiceResponse()


def span_cost_per_step_s(num_requests: int, tracer, repeats: int = 300) -> float:
    """Seconds one step spends on its spans: step (linked to every request), schedule, dispatch and a rank's three."""
    from opentelemetry import trace

    from pagerail.cluster.core.engine_request import EngineRequest
    from pagerail.cluster.core.request import Request
    from pagerail.cluster.core.scheduler import ScheduledRequest, SchedulerOutput
    from pagerail.cluster.core.step_tracing import dispatch_span, end_step_span, start_step_span
    from pagerail.common import telemetry
    from pagerail.common.sampling_params import SamplingParams
    from pagerail.proto import step_pb2

    out = SchedulerOutput(num_batched_tokens=num_requests)
    for i in range(num_requests):
        carrier = telemetry.inject_carrier(trace.set_span_in_context(tracer.start_span("request")))
        envelope = EngineRequest(f"cost-{i}", [1], SamplingParams(max_tokens=1), trace_context=carrier)
        request = Request(envelope, i, frozenset())
        out.scheduled.append(ScheduledRequest(request, 1, []))
    batch = step_pb2.StepBatch(step_id=1)
    started = time.perf_counter()
    for _ in range(repeats):
        span = start_step_span(out, time.time_ns())
        with dispatch_span(span, batch):
            for name in ("prepare_inputs", "forward", "sample"):
                with telemetry.traced(tracer, name):
                    pass
        end_step_span(span)
    return (time.perf_counter() - started) / repeats


def run_rounds(mode: str, endpoint: str, args: argparse.Namespace, conn) -> None:
    """One mode's process: load the model, warm up, then run a round each time the driver asks."""
    from opentelemetry import trace

    from pagerail import LLM, SamplingParams
    from pagerail.cluster.core.engine_request import EngineRequest
    from pagerail.common import telemetry

    if mode == "on":
        telemetry.configure_tracing("head", endpoint=endpoint, sampling_ratio=1.0)
    tracer = telemetry.get_tracer("bench")
    llm = LLM(args.model, num_gpu_blocks=args.num_blocks)
    rng = random.Random(args.seed)
    prompts = [[rng.randrange(100, 20000) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    engine = llm.engine

    step_seconds: list[float] = []

    def one_round(tag: str) -> float:
        spans = []
        started = time.perf_counter()
        for i, prompt in enumerate(prompts):
            span = tracer.start_span("request")
            spans.append(span)
            carrier = telemetry.inject_carrier(trace.set_span_in_context(span))
            engine.add_request(EngineRequest(f"{tag}-{i}", prompt, params, trace_context=carrier))
        while engine.has_unfinished():
            step_started = time.perf_counter()
            engine.step()
            step_seconds.append(time.perf_counter() - step_started)
        for span in spans:
            span.end()
        return time.perf_counter() - started

    one_round("warmup")
    step_seconds.clear()
    conn.send("ready")
    number = 0
    while conn.recv() == "run":
        number += 1
        conn.send(one_round(f"round{number}"))
    telemetry.flush()
    conn.send((statistics.median(step_seconds), span_cost_per_step_s(args.num_requests, tracer)))
    telemetry.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=5, help="rounds per mode")
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    receiver = CountingReceiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    endpoint = f"http://127.0.0.1:{server.add_insecure_port('127.0.0.1:0')}"
    server.start()

    spawn = multiprocessing.get_context("spawn")
    pipes, processes = {}, []
    for mode in ("off", "on"):
        parent, child = spawn.Pipe()
        process = spawn.Process(target=run_rounds, args=(mode, endpoint, args, child), daemon=True)
        process.start()
        pipes[mode] = parent
        processes.append(process)
    for pipe in pipes.values():
        assert pipe.recv() == "ready"

    tokens = args.num_requests * args.max_tokens
    rates: dict[str, list[float]] = {"off": [], "on": []}
    for number in range(args.rounds):
        # Alternate who goes first, so neither mode always follows the other.
        for mode in ("off", "on") if number % 2 == 0 else ("on", "off"):
            pipes[mode].send("run")
            rates[mode].append(tokens / pipes[mode].recv())
    step_figures = {}
    for mode, pipe in pipes.items():
        pipe.send("stop")
        step_figures[mode] = pipe.recv()  # (median step seconds, span seconds per step)
    for process in processes:
        process.join(timeout=60)
    server.stop(grace=None)

    off, on = statistics.median(rates["off"]), statistics.median(rates["on"])
    report = {
        "workload": f"{args.num_requests} requests x {args.max_tokens} tokens, prompts of {args.prompt_len}, greedy",
        "rounds_per_mode": args.rounds,
        "tokens_per_s_off": [round(r, 1) for r in rates["off"]],
        "tokens_per_s_on": [round(r, 1) for r in rates["on"]],
        "median_tokens_per_s_off": round(off, 1),
        "median_tokens_per_s_on": round(on, 1),
        "on_over_off": round(on / off, 4),
        "overhead_percent": round(100 * (1 - on / off), 2),
        "median_step_ms_off": round(1e3 * step_figures["off"][0], 2),
        "median_step_ms_on": round(1e3 * step_figures["on"][0], 2),
        "span_work_us_per_step_off": round(1e6 * step_figures["off"][1], 1),
        "span_work_us_per_step_on": round(1e6 * step_figures["on"][1], 1),
        "span_work_percent_of_step_on": round(100 * step_figures["on"][1] / step_figures["on"][0], 3),
        "spans_exported": receiver.num_spans,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
