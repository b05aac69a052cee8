"""Prometheus metrics of the data-parallel router, and the merge of the replicas' expositions under a replica label."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagerail.cluster.core.engine_metrics import PREFIX

# Routing is a hash walk and a sort over a handful of replicas: microseconds, unless something is wrong.
TRANSFER_BUCKETS = (1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
ROUTING_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 0.1)


class RouterMetrics:
    """Every series carries `model_name`; a registry of its own, rendered after the replicas' series."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        per_replica = ("model_name", "replica")

        def counter(name: str, doc: str, labels: tuple[str, ...] = per_replica) -> Counter:
            return Counter(PREFIX + name, doc, labels, registry=self.registry)

        self.requests = counter(
            "router_requests",
            "Requests sent to each replica, by why the router chose it (prefix, balance, load, round_robin, pinned, "
            "spill, failover).",
            (*per_replica, "reason"),
        )
        self.estimated_cached_tokens = counter(
            "router_estimated_cached_tokens",
            "Prompt tokens the router expected each replica to hold in its prefix cache.",
        )
        self.cached_tokens = counter(
            "router_cached_tokens", "Prompt tokens each replica reported found in its prefix cache."
        )
        self.routing_seconds = Histogram(
            PREFIX + "router_routing_seconds",
            "Time to choose a replica.",
            ["model_name"],
            buckets=ROUTING_BUCKETS,
            registry=self.registry,
        )
        self.failovers = counter("router_failovers", "Requests moved off a replica that failed while serving them.")
        self.kv_transfers = counter(
            "router_kv_transfers",
            "Requests moved with their KV (migration, disaggregation), by source and target.",
            ("model_name", "source", "target"),
        )
        self.kv_transfer_bytes = counter(
            "router_kv_transfer_bytes", "KV bytes moved between replicas.", ("model_name", "source", "target")
        )
        self.kv_transfer_seconds = Histogram(
            PREFIX + "router_kv_transfer_seconds",
            "Time to move one request's KV (export, transfer, import).",
            ["model_name"],
            buckets=TRANSFER_BUCKETS,
            registry=self.registry,
        )
        self.in_rotation = Gauge(
            PREFIX + "router_replicas_in_rotation",
            "Replicas new requests may go to.",
            ["model_name"],
            registry=self.registry,
        )
        self._routing = self.routing_seconds.labels(model_name)

    def routed(self, replica: str, reason: str, estimated_cached_tokens: int) -> None:
        self.requests.labels(self.model_name, replica, reason).inc()
        if estimated_cached_tokens:
            self.estimated_cached_tokens.labels(self.model_name, replica).inc(estimated_cached_tokens)

    def observe_kv_transfer(self, source: str, target: str, nbytes: int, seconds: float) -> None:
        self.kv_transfers.labels(self.model_name, source, target).inc()
        self.kv_transfer_bytes.labels(self.model_name, source, target).inc(nbytes)
        self.kv_transfer_seconds.labels(self.model_name).observe(seconds)

    def observe_routing(self, seconds: float) -> None:
        self._routing.observe(seconds)

    def render(self) -> str:
        return generate_latest(self.registry).decode()


def with_label(texts: dict[str, str], label: str = "replica") -> str:
    """Merge Prometheus text expositions, one per label value, into one: every sample gets `label="<key>"`, and each
    family keeps a single HELP and TYPE line with the samples of every source under it (a scraper refuses a family
    declared twice)."""
    families: dict[str, list[str]] = {}  # family -> its HELP/TYPE lines, then its samples
    declared: dict[str, set[str]] = {}
    for value, text in texts.items():
        pair = f'{label}="{_escape(value)}"'
        family = ""
        for line in text.splitlines():
            if not line.strip():
                continue
            if line.startswith("#"):
                parts = line.split(None, 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                    kinds = declared.setdefault(family, set())
                    if parts[1] not in kinds:
                        kinds.add(parts[1])
                        families.setdefault(family, []).append(line)
                continue  # other comments carry nothing a scraper reads
            name_end = len(line)
            for stop in ("{", " ", "\t"):
                found = line.find(stop)
                if found != -1:
                    name_end = min(name_end, found)
            name, rest = line[:name_end], line[name_end:]
            if not (family and (name == family or name.startswith(family + "_"))):
                family = name  # an untyped sample outside any declared family
            if rest.startswith("{}"):
                labelled = f"{name}{{{pair}}}{rest[2:]}"
            elif rest.startswith("{"):
                labelled = f"{name}{{{pair},{rest[1:]}"
            else:
                labelled = f"{name}{{{pair}}}{rest}"
            families.setdefault(family, []).append(labelled)
    lines = [line for family_lines in families.values() for line in family_lines]
    return "\n".join(lines) + "\n" if lines else ""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
