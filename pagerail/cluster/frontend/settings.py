"""A frontend's settings: where its front doors listen, how they guard themselves, and how they read tool calls."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagerail.cluster.frontend.lora_modules import LoRAModule
from pagerail.cluster.frontend.tenants import NO_TENANTS, Tenants
from pagerail.cluster.frontend.tool_calls import TOOL_CALL_PARSERS
from pagerail.common.pooling_config import PoolingConfig
from pagerail.common.tls import ServerTls


@dataclass(frozen=True)
class LoRASettings:
    """What the frontend needs of the engine's LoRA settings, and the adapters to serve from the start."""

    max_lora_rank: int = 16
    modules: tuple[LoRAModule, ...] = ()


@dataclass(frozen=True)
class FrontendSettings:
    """Where the front doors listen and how they guard themselves."""

    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    grpc_port: int = 50051
    # Kept out of the repr, so no log line or traceback shows a key.
    api_key: str | None = field(default=None, repr=False)
    # Opens /pause, /resume, /replicas/drain and /replicas/undrain (and only them); None: those routes are off.
    admin_api_key: str | None = field(default=None, repr=False)
    max_body_bytes: int = 4 << 20
    # OTLP collector for the request spans; None: tracing off.
    otlp_traces_endpoint: str | None = None
    trace_sampling_ratio: float = 1.0
    # False: the server's ratio decides for client requests too (a client's traceparent is continued, but its
    # sampled flag does not force tracing on); True: a client's sampling decision is followed.
    trace_respect_client_sampling: bool = False
    # TLS on the public gRPC port; None: plaintext.
    grpc_tls: ServerTls | None = None
    # How tool calls are read from generated text ("hermes", "llama3_json"); None: chosen from the chat template.
    tool_call_parser: str | None = None
    # What the model serves as a pooling model: its default pooling, its labels (a classifier's), whether it only
    # pools (the generation routes then answer 400).
    pooling: PoolingConfig = PoolingConfig()
    # LoRA adapters: None when the engine serves none (--enable-lora off), else the engine's settings and the
    # adapters served from the start (--lora-modules).
    lora: LoRASettings | None = None
    # Tenants (--tenants): which key belongs to whom, with shares, quotas and default priorities; by default one
    # tenant, `default`, without limits.
    tenants: Tenants = NO_TENANTS

    def __post_init__(self) -> None:
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {self.tool_call_parser!r}"
            )
