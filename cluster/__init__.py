"""pagerail's head side: scheduler, global KV block table, engine loop and the public Python API."""

from typing import TYPE_CHECKING

__all__ = ["LLM", "SamplingParams", "StructuredOutputs", "RequestOutput", "CompletionOutput"]

if TYPE_CHECKING:
    from cluster.core.outputs import CompletionOutput, RequestOutput
    from cluster.core.sampling_params import SamplingParams
    from cluster.core.structured_outputs import StructuredOutputs
    from cluster.entrypoints.llm import LLM


def __getattr__(name: str):
    # Imported lazily so the plain-Python scheduler modules load without torch or transformers.
    if name == "LLM":
        from cluster.entrypoints.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from cluster.core import outputs

        return getattr(outputs, name)
    if name == "SamplingParams":
        from cluster.core.sampling_params import SamplingParams

        return SamplingParams
    if name == "StructuredOutputs":
        from cluster.core.structured_outputs import StructuredOutputs

        return StructuredOutputs
    raise AttributeError(f"module 'cluster' has no attribute {name!r}")
