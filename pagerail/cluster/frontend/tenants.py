"""Tenants from a `--tenants` file: which API keys belong to whom, and each tenant's share, quotas and default
priority. A request's tenant is the one whose `api_keys` hold its bearer key; any other key, or none, is the
tenant `default`. Tenant keys are labels for scheduling, not a login: authentication stays with `--api-key`.

    tenants:
      - name: chat
        api_keys: [sk-chat-1, sk-chat-2]
        weight: 4                 # its share under fair share (default 1)
        max_concurrency: 64       # requests in flight at once (default: no limit)
        tokens_per_minute: 200000 # prompt + generated tokens (default: no limit)
        priority: 0               # its requests' priority when they send none (default 0)
      - name: default             # optional: the settings of every other key
        weight: 1

A malformed file is refused at start with its line and the field.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from pagerail.cluster.core.engine_request import DEFAULT_TENANT_NAME, MAX_PRIORITY, MIN_PRIORITY

# Tenant names become metric labels and span attributes: short, printable, and known from the file.
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_FIELDS = ("name", "api_keys", "weight", "max_concurrency", "tokens_per_minute", "priority")


@dataclass(frozen=True)
class Tenant:
    """One tenant's share, quotas and default priority (None: no limit, or priority 0)."""

    name: str
    weight: float = 1.0
    max_concurrency: int | None = None
    tokens_per_minute: int | None = None
    priority: int | None = None

    def priority_for(self, requested: int | None) -> int:
        """A request's priority: the one it names, else this tenant's default, else 0."""
        if requested is not None:
            return requested
        return self.priority if self.priority is not None else 0


class TenantsFileError(ValueError):
    """A tenants file that cannot be used; the message names the file, the line and the field."""


@dataclass(frozen=True)
class Tenants:
    """Every tenant of the file (`default` among them, configured or not) and which key belongs to which."""

    tenants: Mapping[str, Tenant]
    # sha256 of a key -> its tenant's name: looked up by digest, so no key is kept in memory as text.
    _by_key: Mapping[bytes, str] = field(default_factory=dict, repr=False)

    @property
    def default(self) -> Tenant:
        return self.tenants[DEFAULT_TENANT_NAME]

    def of_key(self, key: str | None) -> Tenant:
        """The tenant a bearer key belongs to; `default` for any other key, or none."""
        if not key:
            return self.default
        name = self._by_key.get(hashlib.sha256(key.encode()).digest())
        return self.default if name is None else self.tenants[name]


NO_TENANTS = Tenants({DEFAULT_TENANT_NAME: Tenant(DEFAULT_TENANT_NAME)})


def load_tenants(path: str | Path) -> Tenants:
    """The tenants of a YAML file; raises TenantsFileError naming the line and the field of the first problem."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as error:
        raise TenantsFileError(f"--tenants {path}: cannot read it: {error.strerror or error}") from None
    return parse_tenants(text, str(path))


def parse_tenants(text: str, source: str = "tenants file") -> Tenants:
    """The tenants of a YAML document (see the module's docstring)."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise TenantsFileError(f"{source}{where}: not valid YAML: {getattr(error, 'problem', error)}") from None
    reader = _Reader(source)
    if root is None or not isinstance(root, yaml.MappingNode):
        raise TenantsFileError(f"{source}: must be a mapping with a `tenants` list")
    entries = None
    for key_node, value_node in root.value:
        key = reader.scalar(key_node, "a top-level key")
        if key != "tenants":
            raise reader.fail(key_node, f"unknown top-level key {key!r}: the file holds `tenants` only")
        entries = value_node
    if not isinstance(entries, yaml.SequenceNode):
        raise reader.fail(entries or root, "tenants must be a list of tenants")
    tenants: dict[str, Tenant] = {}
    by_key: dict[bytes, str] = {}
    for index, entry in enumerate(entries.value):
        tenant, keys = reader.tenant(entry, f"tenants[{index}]")
        if tenant.name in tenants:
            raise reader.fail(entry, f"tenants[{index}].name: tenant {tenant.name!r} is already defined")
        tenants[tenant.name] = tenant
        for position, (key, node) in enumerate(keys):
            digest = hashlib.sha256(key.encode()).digest()
            if digest in by_key:
                owner = by_key[digest]
                raise reader.fail(node, f"tenants[{index}].api_keys[{position}]: the key already belongs to {owner!r}")
            by_key[digest] = tenant.name
    tenants.setdefault(DEFAULT_TENANT_NAME, Tenant(DEFAULT_TENANT_NAME))
    return Tenants(tenants, by_key)


class _Reader:
    """Values out of a tenants file's nodes, each error naming the file, the node's line and the field."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._loader = yaml.SafeLoader("")

    def fail(self, node: yaml.Node, message: str) -> TenantsFileError:
        return TenantsFileError(f"{self.source} line {node.start_mark.line + 1}: {message}")

    def scalar(self, node: yaml.Node, name: str) -> object:
        if not isinstance(node, yaml.ScalarNode):
            raise self.fail(node, f"{name} must be a single value")
        return self._loader.construct_object(node)

    def tenant(self, entry: yaml.Node, where: str) -> tuple[Tenant, list[tuple[str, yaml.Node]]]:
        """One entry of the list: the tenant, and its keys with their nodes."""
        if not isinstance(entry, yaml.MappingNode):
            raise self.fail(entry, f"{where} must be a mapping of {', '.join(_FIELDS)}")
        nodes: dict[str, yaml.Node] = {}
        for key_node, value_node in entry.value:
            key = self.scalar(key_node, f"a key of {where}")
            if key not in _FIELDS:
                raise self.fail(key_node, f"{where}: unknown field {key!r}; known: {', '.join(_FIELDS)}")
            nodes[key] = value_node
        if "name" not in nodes:
            raise self.fail(entry, f"{where}.name is missing")
        name = self.scalar(nodes["name"], f"{where}.name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise self.fail(nodes["name"], f"{where}.name must be 1-64 of A-Z a-z 0-9 _ . -, got {name!r}")
        keys: list[tuple[str, yaml.Node]] = []
        if "api_keys" in nodes:
            if not isinstance(nodes["api_keys"], yaml.SequenceNode):
                raise self.fail(nodes["api_keys"], f"{where}.api_keys must be a list of keys")
            for position, key_node in enumerate(nodes["api_keys"].value):
                key = self.scalar(key_node, f"{where}.api_keys[{position}]")
                if not isinstance(key, str) or not key:
                    raise self.fail(key_node, f"{where}.api_keys[{position}] must be a non-empty string")
                keys.append((key, key_node))
        if name == DEFAULT_TENANT_NAME and keys:
            raise self.fail(nodes["api_keys"], f"{where}.api_keys: the default tenant takes every other key; list none")
        if name != DEFAULT_TENANT_NAME and not keys:
            raise self.fail(entry, f"{where}.api_keys must list at least one key")
        weight = self.number(nodes, where, "weight", False, 0.0)
        if weight is not None and weight <= 0:
            raise self.fail(nodes["weight"], f"{where}.weight must be a number > 0, got {weight!r}")
        tenant = Tenant(
            name,
            float(weight) if weight is not None else 1.0,
            self.number(nodes, where, "max_concurrency", True, 1),
            self.number(nodes, where, "tokens_per_minute", True, 1),
            self.number(nodes, where, "priority", True, MIN_PRIORITY, MAX_PRIORITY),
        )
        return tenant, keys

    def number(
        self, nodes: dict[str, yaml.Node], where: str, name: str, integer: bool, low: float, high: float | None = None
    ):
        if name not in nodes:
            return None
        value = self.scalar(nodes[name], f"{where}.{name}")
        kinds = (int,) if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or value < low or (high and value > high):
            what = "an integer" if integer else "a number"
            bound = f">= {low:g}" if high is None else f"in [{low:g}, {high:g}]"
            raise self.fail(nodes[name], f"{where}.{name} must be {what} {bound}, got {value!r}")
        return value
