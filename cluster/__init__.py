"""pagerail's head side: scheduler, global KV block table, engine loop and the public Python API."""

import importlib
from typing import TYPE_CHECKING

__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "RequestOutput", "CompletionOutput"]

if TYPE_CHECKING:
    from cluster.core.outputs import CompletionOutput, RequestOutput
    from cluster.core.sampling_params import SamplingParams
    from cluster.core.structured_outputs import StructuredOutputs
    from cluster.entrypoints.llm import LLM

# Imported lazily so the plain-Python scheduler modules load without torch or transformers.
_HOMES = {
    "LLM": "cluster.entrypoints.llm",
    "RequestOutput": "cluster.core.outputs",
    "CompletionOutput": "cluster.core.outputs",
    "SamplingParams": "cluster.core.sampling_params",
    "StructuredOutputs": "cluster.core.structured_outputs",
}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'cluster' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
