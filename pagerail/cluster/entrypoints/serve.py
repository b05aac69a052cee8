"""`pagerail serve`: start (or join) Ray, the workers and head of one model replica, and its frontend."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

from pagerail.cluster.distributed.cluster_options import DEFAULT_OPTIONS, PLACEMENT_STRATEGIES
from pagerail.cluster.frontend.lora_modules import LoRAModule
from pagerail.cluster.frontend.tool_calls import TOOL_CALL_PARSERS
from pagerail.cluster.routing.autoscale import ScalingPolicy
from pagerail.cluster.routing.routed_client import ROUTING_INDEXES
from pagerail.cluster.routing.router import POLICIES
from pagerail.common.engine_args import add_engine_arguments, engine_config_from_args
from pagerail.common.logs import LOG_FORMAT_ENV, configure_logging
from pagerail.common.pooling_config import read_pooling_config


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def cpus_per_worker(
    requested: float | None, use_gpu: bool, cluster_cpus: float, num_ranks: int, largest_node_cpus: float | None = None
) -> float:
    """The CPUs each rank reserves: as asked, else 1 beside a GPU, else an equal share of the cluster's CPUs
    (no more than its largest node has, so that a rank's bundle fits on some node).

    A CPU rank computes with as many torch threads as it reserves, so on a CPU-only node one rank takes every
    core rather than one (the head and the frontend reserve none and run in the gaps of the forward pass).
    """
    if requested is not None:
        if not requested > 0:
            raise ValueError(f"--cpus-per-worker must be > 0, got {requested:g}")
        return requested
    if use_gpu:
        return 1.0
    share = int(cluster_cpus) // max(1, num_ranks)
    if largest_node_cpus is not None:
        share = min(share, int(largest_node_cpus))
    return float(max(1, share))


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser.add_argument_group("engine", "the model replica (the same settings as LLM(...))"))
    parser.add_argument(
        "--data-parallel-size",
        default="1",
        help='model replicas behind the one frontend, each with --tensor-parallel-size ranks of its own ("auto": '
        "every GPU Ray sees divided by --tensor-parallel-size; 1 on CPUs)",
    )
    parser.add_argument(
        "--routing-policy",
        default="prefix-aware",
        choices=POLICIES,
        help="how each request picks a replica: the one likely holding its prompt prefix (unless much busier), "
        "the least loaded, or in turn",
    )
    parser.add_argument(
        "--prefill-replicas",
        type=int,
        default=None,
        help="prefill/decode disaggregation: this many replicas compute each new prompt and its first token, and "
        "its KV moves to one of --decode-replicas, which streams the rest (needs --kv-offload-bytes)",
    )
    parser.add_argument("--decode-replicas", type=int, default=None, help="see --prefill-replicas")
    parser.add_argument(
        "--routing-index",
        default="events",
        choices=ROUTING_INDEXES,
        help="what prefix-aware routing knows of each replica's KV cache (device and host tier): the block events "
        "the replicas publish, or an estimate from the prompts sent to each",
    )
    parser.add_argument(
        "--min-replicas",
        type=int,
        default=None,
        help="idle replicas are drained down to this many (default: data-parallel size)",
    )
    parser.add_argument(
        "--max-replicas", type=int, default=None, help="scale up to this many replicas (default: data-parallel size)"
    )
    parser.add_argument(
        "--target-waiting-per-replica",
        type=float,
        default=8.0,
        help="a replica is added while more requests than this wait per replica",
    )
    parser.add_argument(
        "--cpus-per-worker",
        type=_positive_float,
        default=None,
        help="CPUs Ray reserves for each rank, and on CPUs its torch thread count (default: 1 with GPUs; on CPUs "
        "the cluster's CPUs shared out among every rank of every replica)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port)")
    parser.add_argument("--grpc-port", type=int, default=50051, help="gRPC port (0: any free port)")
    parser.add_argument("--ray-address", default=None, help='join this Ray cluster ("auto": the local one)')
    parser.add_argument(
        "--placement-strategy",
        default=DEFAULT_OPTIONS.placement_strategy,
        choices=PLACEMENT_STRATEGIES,
        help="how the ranks' bundles are placed: STRICT_SPREAD puts one rank per node",
    )
    parser.add_argument("--api-key", default=os.environ.get("PAGERAIL_API_KEY"), help="or PAGERAIL_API_KEY")
    parser.add_argument(
        "--admin-api-key",
        default=os.environ.get("PAGERAIL_ADMIN_API_KEY"),
        help="opens /pause and /resume, which are off without it (or PAGERAIL_ADMIN_API_KEY)",
    )
    parser.add_argument(
        "--tenants",
        default=None,
        help="YAML file of tenants: their API keys, fair-share weight, max_concurrency, tokens_per_minute and default "
        "priority (docs/serving.md); other keys are the tenant `default`",
    )
    parser.add_argument("--grpc-tls-cert", default=None, help="PEM certificate chain: the gRPC port speaks TLS only")
    parser.add_argument("--grpc-tls-key", default=None, help="PEM private key of --grpc-tls-cert")
    parser.add_argument(
        "--grpc-tls-client-ca", default=None, help="PEM CA: gRPC clients must present a certificate it signed"
    )
    parser.add_argument("--log-format", default="text", choices=("text", "json"), help="json: one object per line")
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
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        type=LoRAModule.parse,
        default=(),
        metavar="NAME=PATH",
        help='LoRA adapters served from the start, as name=path or {"name": ..., "path": ..., "base_model_name": ...} '
        "(needs --enable-lora); a request picks one with its model",
    )
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="seconds SIGTERM waits for requests")
    parser.add_argument(
        "--step-timeout",
        type=float,
        default=DEFAULT_OPTIONS.step_timeout_s,
        help="seconds a step may take before its ranks count as hung and are restarted (a failed or dead rank "
        "is noticed at once)",
    )
    parser.add_argument(
        "--max-worker-restarts",
        type=int,
        default=DEFAULT_OPTIONS.max_restarts,
        help="worker-group restarts in a row, without a successful step between them, before in-flight requests fail",
    )


def grpc_tls_from_args(args: argparse.Namespace):
    """The public gRPC port's TLS from the --grpc-tls-* flags (None: plaintext); ValueError for an incomplete set."""
    from pagerail.common.tls import ServerTls

    if args.grpc_tls_cert is None and args.grpc_tls_key is None:
        if args.grpc_tls_client_ca is not None:
            raise ValueError("--grpc-tls-client-ca needs --grpc-tls-cert and --grpc-tls-key")
        return None
    if args.grpc_tls_cert is None or args.grpc_tls_key is None:
        raise ValueError("--grpc-tls-cert and --grpc-tls-key go together")
    return ServerTls.from_files(args.grpc_tls_cert, args.grpc_tls_key, args.grpc_tls_client_ca)


def data_parallel_size(value: str, tensor_parallel_size: int, num_gpus: float, use_gpu: bool) -> int:
    """The number of replicas from --data-parallel-size: a positive integer, or "auto" (every GPU Ray sees
    divided by --tensor-parallel-size, at least 1; 1 on CPUs)."""
    if value == "auto":
        return max(1, int(num_gpus) // tensor_parallel_size) if use_gpu else 1
    try:
        size = int(value)
    except ValueError:
        size = 0
    if size < 1:
        raise ValueError(f'--data-parallel-size must be a positive integer or "auto", got {value!r}')
    return size


def replica_bounds(args: argparse.Namespace, size: int) -> tuple[int, int]:
    """(--min-replicas, --max-replicas), both defaulting to the data-parallel size, which lies between them."""
    low = size if args.min_replicas is None else args.min_replicas
    high = size if args.max_replicas is None else args.max_replicas
    if low < 1:
        raise ValueError(f"--min-replicas must be at least 1, got {low}")
    if not low <= size <= high:
        raise ValueError(
            f"--data-parallel-size ({size}) must lie between --min-replicas ({low}) and --max-replicas ({high})"
        )
    # The same checks the frontend's scaling applies, raised here as flag errors before anything starts.
    try:
        ScalingPolicy(low, high, args.target_waiting_per_replica)
    except ValueError as error:
        raise ValueError(f"--target-waiting-per-replica: {error}") from None
    return low, high


def check_replica_flags(args: argparse.Namespace) -> None:
    """Reject bad replica flags before Ray starts ("auto" is resolved once Ray reports its GPUs)."""
    prefill, decode = getattr(args, "prefill_replicas", None), getattr(args, "decode_replicas", None)
    if prefill is not None or decode is not None:
        if not (isinstance(prefill, int) and isinstance(decode, int) and prefill >= 1 and decode >= 1):
            raise SystemExit("--prefill-replicas and --decode-replicas go together, each at least 1")
        if args.data_parallel_size not in ("1", "auto", str(prefill + decode)):
            raise SystemExit(
                f"--data-parallel-size {args.data_parallel_size} differs from --prefill-replicas "
                f"{prefill} + --decode-replicas {decode}"
            )
        if args.min_replicas is not None or args.max_replicas is not None:
            raise SystemExit("--prefill-replicas / --decode-replicas do not scale: leave out --min/--max-replicas")
        if not args.kv_offload_bytes:
            raise SystemExit(
                "--prefill-replicas needs --kv-offload-bytes: the decode replicas' host KV tier receives "
                "the prompts' KV"
            )
        args.data_parallel_size = str(prefill + decode)
    if args.data_parallel_size != "auto":
        replica_bounds(args, data_parallel_size(args.data_parallel_size, args.tensor_parallel_size, 0, False))


def _say(message: str) -> None:
    print(f"pagerail: {message}", flush=True)


def serve(args: argparse.Namespace) -> int:
    import ray

    from pagerail.cluster.core.engine_request import EngineRequest
    from pagerail.cluster.distributed.cluster_options import ClusterOptions
    from pagerail.cluster.distributed.launcher import HeadLauncher, connect, start_heads, stop_head, uses_gpu
    from pagerail.cluster.frontend.actor import FrontendActor
    from pagerail.cluster.frontend.settings import FrontendSettings, LoRASettings
    from pagerail.cluster.frontend.tenants import NO_TENANTS, TenantsFileError, load_tenants
    from pagerail.cluster.routing.replica_pool import ReplicaSettings
    from pagerail.common.model_source import resolve_model_dir
    from pagerail.common.sampling_params import SamplingParams

    check_replica_flags(args)

    config = engine_config_from_args(args)
    if args.lora_modules and not config.lora.enable_lora:
        raise SystemExit("--lora-modules needs --enable-lora")
    grpc_tls = grpc_tls_from_args(args)  # read here: the frontend may run on a node without these files
    try:
        tenants = load_tenants(args.tenants) if args.tenants else NO_TENANTS
    except TenantsFileError as error:
        raise SystemExit(str(error)) from None
    # Actors started by this process inherit the environment, so every process logs the same way.
    os.environ[LOG_FORMAT_ENV] = args.log_format
    configure_logging(args.log_format)
    started = time.monotonic()
    _say("locating the model")
    model_dir = resolve_model_dir(config.model)  # the embedded model is converted once, with a progress bar
    served_name = config.model_name
    _say(f"starting Ray{' at ' + args.ray_address if args.ray_address else ''}")
    connect(args.ray_address)
    # Installed after Ray starts: its own crash handler would otherwise take SIGTERM and abort the process.
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    use_gpu = uses_gpu(config.device)
    size = data_parallel_size(
        args.data_parallel_size, args.tensor_parallel_size, ray.cluster_resources().get("GPU", 0), use_gpu
    )
    min_replicas, max_replicas = replica_bounds(args, size)
    node_cpus = [node["Resources"].get("CPU", 0) for node in ray.nodes() if node.get("Alive")]
    cpus = cpus_per_worker(
        args.cpus_per_worker, use_gpu, ray.cluster_resources().get("CPU", 1), args.tensor_parallel_size * max_replicas,
        max(node_cpus, default=None),
    )  # fmt: skip
    options = ClusterOptions(
        use_gpu=use_gpu,
        placement_strategy=args.placement_strategy,
        cpus_per_worker=cpus,
        step_timeout_s=args.step_timeout,
        max_restarts=args.max_worker_restarts,
    )
    prefix = f"pagerail-head-{os.getpid()}"
    routed = size > 1 or max_replicas > 1
    head_names = [f"{prefix}-{i}" for i in range(size)] if routed else [prefix]
    workers = f"{args.tensor_parallel_size} worker(s)" + (f" per replica, {size} replicas" if routed else "")
    _say(f"loading {served_name} on {workers}")
    heads = start_heads(config, options, head_names)
    if args.prefill_replicas:
        from pagerail.cluster.core.kv_handoff import check_roles

        layouts = dict(zip(head_names, ray.get([head.kv_layout.remote() for head in heads]), strict=True))
        check_roles(layouts, head_names[: args.prefill_replicas])
    _say("warming up")
    warmup = SamplingParams(max_tokens=2, ignore_eos=True)
    ray.get([head.generate.remote(EngineRequest("warmup", [1] * 8, warmup)) for head in heads])
    replicas = None
    if routed:
        replicas = ReplicaSettings(
            routing_policy=args.routing_policy,
            routing_index=args.routing_index,
            prefill_replicas=tuple(head_names[: args.prefill_replicas or 0]),
            block_size=config.cache.block_size,
            adapter_slots=config.lora.max_loras,
            min_replicas=min_replicas,
            max_replicas=max_replicas,
            target_waiting_per_replica=args.target_waiting_per_replica,
            name_prefix=prefix,
            launcher=HeadLauncher(config, options) if min_replicas != max_replicas else None,
        )
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
        lora=LoRASettings(config.lora.max_lora_rank, tuple(args.lora_modules)) if config.lora.enable_lora else None,
        pooling=read_pooling_config(model_dir, config.runner, config.convert, config.pooler_config),
        tenants=tenants,
    )
    frontend = (
        ray.remote(FrontendActor)
        .options(num_cpus=0, max_concurrency=10_000)
        .remote(head_names, str(model_dir), settings, ray.get(heads[0].model_info.remote()), replicas)
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
        head_names = ray.get(frontend.head_names.remote(), timeout=60)  # with those scaling added
        ray.get(frontend.stop.remote(), timeout=60)
        for name in head_names:
            try:
                head = ray.get_actor(name)
            except ValueError:  # already gone
                continue
            stop_head(head, timeout_s=60)
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
