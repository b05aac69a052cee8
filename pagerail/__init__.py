"""pagerail: distributed LLM serving. The public Python API: `from pagerail import LLM, SamplingParams`."""

import importlib
from typing import TYPE_CHECKING

__all__ = [
    "LLM",
    "SamplingParams",
    "StructuredOutputs",
    "RequestOutput",
    "CompletionOutput",
    "BeamSearchParams",
    "BeamSearchOutput",
    "LoRARequest",
]

if TYPE_CHECKING:
    from pagerail.cluster.core.beam_search import BeamSearchOutput, BeamSearchParams
    from pagerail.cluster.core.outputs import CompletionOutput, RequestOutput
    from pagerail.cluster.entrypoints.llm import LLM
    from pagerail.common.lora import LoRARequest
    from pagerail.common.sampling_params import SamplingParams
    from pagerail.common.structured_outputs import StructuredOutputs

# Imported lazily so the plain-Python scheduler modules load without torch or transformers.
_HOMES = {
    "LLM": "pagerail.cluster.entrypoints.llm",
    "RequestOutput": "pagerail.cluster.core.outputs",
    "CompletionOutput": "pagerail.cluster.core.outputs",
    "SamplingParams": "pagerail.common.sampling_params",
    "StructuredOutputs": "pagerail.common.structured_outputs",
    "BeamSearchParams": "pagerail.cluster.core.beam_search",
    "BeamSearchOutput": "pagerail.cluster.core.beam_search",
    "LoRARequest": "pagerail.common.lora",
}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'pagerail' has no attribute {name!r}")
    return getattr(importlib.import_module(_HOMES[name]), name)
