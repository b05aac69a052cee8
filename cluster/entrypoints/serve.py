"""`pagerail serve`: start (or join) Ray, the workers and head of one model replica, and its frontend."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from cluster.core.config import CacheConfig, EngineConfig, ObservabilityConfig, SchedulerConfig
from cluster.frontend.tool_calls import TOOL_CALL_PARSERS
from common.logs import LOG_FORMAT_ENV, configure_logging


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="local dir, .gguf file or hub id (default: embedded SmolLM2)")
    parser.add_argument("--served-model-name", default=None, help="the model name clients send (default: derived)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"))
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port)")
    parser.add_argument("--grpc-port", type=int, default=50051, help="gRPC port (0: any free port)")
    parser.add_argument("--ray-address", default=None, help='join this Ray cluster ("auto": the local one)')
    parser.add_argument(
        "--placement-strategy", default="PACK", choices=("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"),
        help="how the ranks' bundles are placed: STRICT_SPREAD puts one rank per node",
    )
    parser.add_argument("--api-key", default=os.environ.get("PAGERAIL_API_KEY"), help="or PAGERAIL_API_KEY")
    parser.add_argument(
        "--admin-api-key",
        default=os.environ.get("PAGERAIL_ADMIN_API_KEY"),
        help="opens /pause and /resume, which are off without it (or PAGERAIL_ADMIN_API_KEY)",
    )
    parser.add_argument("--grpc-tls-cert", default=None, help="PEM certificate chain: the gRPC port speaks TLS only")
    parser.add_argument("--grpc-tls-key", default=None, help="PEM private key of --grpc-tls-cert")
    parser.add_argument(
        "--grpc-tls-client-ca", default=None, help="PEM CA: gRPC clients must present a certificate it signed"
    )
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-waiting-requests", type=int, default=None)
    parser.add_argument(
        "--session-idle-timeout", type=float, default=300.0,
        help="seconds a streaming-input session may wait for its next chunk before it is closed",
    )
    parser.add_argument(
        "--max-sessions", type=int, default=None, help="open streaming-input sessions at once (default: max-num-seqs)"
    )
    parser.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="split long prompts across steps so running decodes keep their pace",
    )
    parser.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="reuse KV blocks of prompts that share a prefix",
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule and send step N+1 while step N runs on the ranks (--no-async-scheduling: strictly serial "
        "steps); default: on when the ranks run on GPUs, off on CPUs, whose cores the head would share",
    )
    parser.add_argument("--log-format", default="text", choices=("text", "json"), help="json: one object per line")
    parser.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        help="OTLP collector for traces, e.g. http://localhost:4317 (gRPC; HTTP/protobuf when "
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf); default: tracing off",
    )
    parser.add_argument("--trace-sampling-ratio", type=float, default=1.0, help="share of traces kept, in [0, 1]")
    parser.add_argument(
        "--trace-respect-client-sampling",
        action="store_true",
        help="follow the sampled flag of a client's traceparent (default: the server's ratio decides; the "
        "client's trace id is continued either way)",
    )
    parser.add_argument(
        "--tool-call-parser",
        choices=TOOL_CALL_PARSERS,
        default=None,
        help="how tool calls are read from the model's text with tool_choice auto (default: from its chat template)",
    )
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="seconds SIGTERM waits for requests")
    parser.add_argument(
        "--step-timeout", type=float, default=300.0,
        help="seconds a step may take before its ranks count as hung and are restarted (a failed or dead rank "
        "is noticed at once)",
    )
    parser.add_argument(
        "--max-worker-restarts", type=int, default=3,
        help="worker-group restarts in a row, without a successful step between them, before in-flight requests fail",
    )


def grpc_tls_from_args(args: argparse.Namespace):
    """The public gRPC port's TLS from the --grpc-tls-* flags (None: plaintext); ValueError for an incomplete set."""
    from common.tls import ServerTls

    if args.grpc_tls_cert is None and args.grpc_tls_key is None:
        if args.grpc_tls_client_ca is not None:
            raise ValueError("--grpc-tls-client-ca needs --grpc-tls-cert and --grpc-tls-key")
        return None
    if args.grpc_tls_cert is None or args.grpc_tls_key is None:
        raise ValueError("--grpc-tls-cert and --grpc-tls-key go together")
    return ServerTls.from_files(args.grpc_tls_cert, args.grpc_tls_key, args.grpc_tls_client_ca)


def _say(message: str) -> None:
    print(f"pagerail: {message}", flush=True)


def serve(args: argparse.Namespace) -> int:
    import ray

    from cluster.core.sampling_params import SamplingParams
    from cluster.distributed.head import ClusterOptions
    from cluster.distributed.launcher import connect, start_head
    from cluster.distributed.local_executor import locate_model
    from cluster.frontend.actor import FrontendActor
    from cluster.frontend.server import FrontendSettings

    config = EngineConfig(
        model=args.model,
        served_model_name=args.served_model_name,
        dtype=args.dtype,
        device=args.device,
        tensor_parallel_size=args.tensor_parallel_size,
        cache=CacheConfig(
            block_size=args.block_size,
            kv_cache_memory_bytes=args.kv_cache_memory_bytes,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=args.enable_prefix_caching,
        ),
        scheduler=SchedulerConfig(
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            max_waiting_requests=args.max_waiting_requests,
            session_idle_timeout_s=args.session_idle_timeout,
            max_sessions=args.max_sessions,
            enable_chunked_prefill=args.enable_chunked_prefill,
            async_scheduling=args.async_scheduling,
        ),
        observability=ObservabilityConfig(
            otlp_traces_endpoint=args.otlp_traces_endpoint, trace_sampling_ratio=args.trace_sampling_ratio
        ),
    )
    grpc_tls = grpc_tls_from_args(args)  # read here: the frontend may run on a node without these files
    # Actors started by this process inherit the environment, so every process logs the same way.
    os.environ[LOG_FORMAT_ENV] = args.log_format
    configure_logging(args.log_format)
    started = time.monotonic()
    _say("locating the model")
    model_dir = locate_model(config)  # the embedded model is converted once, with a progress bar
    served_name = config.model_name
    _say(f"starting Ray{' at ' + args.ray_address if args.ray_address else ''}")
    connect(args.ray_address)
    # Installed after Ray starts: its own crash handler would otherwise take SIGTERM and abort the process.
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    use_gpu = args.device == "cuda" or (args.device == "auto" and ray.cluster_resources().get("GPU", 0) > 0)
    options = ClusterOptions(
        use_gpu=use_gpu, placement_strategy=args.placement_strategy,
        step_timeout_s=args.step_timeout, max_restarts=args.max_worker_restarts,
    )
    head_name = f"pagerail-head-{os.getpid()}"
    _say(f"loading {served_name} on {args.tensor_parallel_size} worker(s)")
    head = start_head(config, options, head_name)
    _say("warming up")
    ray.get(head.generate.remote("warmup", [1] * 8, SamplingParams(max_tokens=2, ignore_eos=True)))
    settings = FrontendSettings(
        served_model_name=served_name,
        host=args.host,
        port=args.port,
        grpc_port=args.grpc_port,
        api_key=args.api_key,
        admin_api_key=args.admin_api_key or None,
        otlp_traces_endpoint=args.otlp_traces_endpoint,
        trace_sampling_ratio=args.trace_sampling_ratio,
        trace_respect_client_sampling=args.trace_respect_client_sampling,
        grpc_tls=grpc_tls,
        tool_call_parser=args.tool_call_parser,
    )
    frontend = (
        ray.remote(FrontendActor)
        .options(num_cpus=0, max_concurrency=10_000)
        .remote(head_name, str(model_dir), settings, ray.get(head.model_info.remote()))
    )
    ports = ray.get(frontend.start.remote())
    base = f"http://{args.host}:{ports['http_port']}"
    _say(
        f"ready in {time.monotonic() - started:.0f}s: OpenAI API {base}/v1, gRPC {args.host}:{ports['grpc_port']}, "
        f"model {served_name!r}"
    )
    stop.wait()
    _say(f"draining (up to {args.drain_timeout:g}s)")
    try:
        left = ray.get(frontend.drain.remote(args.drain_timeout), timeout=args.drain_timeout + 30)
        if left:
            _say(f"aborting {left} request(s) still running")
        ray.get(frontend.stop.remote(), timeout=60)
        ray.get(head.shutdown.remote(), timeout=60)
        ray.kill(head, no_restart=True)
    except (ray.exceptions.RayError, TimeoutError) as error:
        # A signal sent to the whole process group (Ctrl-C) also stops Ray's own processes.
        _say(f"Ray went away while draining ({type(error).__name__}); stopping")
    ray.shutdown()
    _say("stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagerail serve")
    add_serve_arguments(parser)
    return serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
