"""One streamed completion request: its payload, the SSE stream it reads, and what it measured."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from pagerail.cluster.bench.sse_client import SseClient
from pagerail.cluster.bench.workload import BenchRequest


@dataclass
class RequestResult:
    """What one streamed request measured; times in seconds."""

    success: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens the server found in its prefix cache (usage.prompt_tokens_details)
    output_tokens: int = 0

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def build_payload(model: str, request: BenchRequest, ignore_eos: bool) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        "prompt": request.prompt_text if request.prompt_text is not None else request.prompt_token_ids,
        "max_tokens": request.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    # Only sent when wanted: a server without the extension may reject the unknown field.
    if ignore_eos:
        payload["ignore_eos"] = True
    return payload


def _is_content(chunk: dict[str, Any]) -> bool:
    """A chunk that delivered output: text, or a token whose text the server is still holding back.

    A closing chunk with empty text and a finish reason delivered nothing and would add a fake gap.
    """
    choices = chunk.get("choices") or []
    return any(choice.get("text") or choice.get("finish_reason") is None for choice in choices)


def _error_text(body: str) -> str:
    try:
        error = json.loads(body).get("error")
    except (ValueError, AttributeError):
        return body.strip()[:300]
    if isinstance(error, dict):
        return str(error.get("message") or error)[:300]
    return str(error if error is not None else body)[:300]


async def send_streaming(
    client: SseClient,
    path: str,
    headers: dict[str, str],
    payload: dict[str, Any],
    prompt_len: int,
    timeout: float,
) -> RequestResult:
    result = RequestResult(prompt_tokens=prompt_len)
    chunks = 0
    usage_tokens: int | None = None
    done = False
    start = last = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            async with client.stream(path, payload, headers) as response:
                if response.status_code != 200:
                    body = (await response.aread()).decode(errors="replace")
                    result.error = f"HTTP {response.status_code}: {_error_text(body)}"
                    return result
                async for line in response.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        break
                    now = time.perf_counter()
                    chunk = json.loads(data)
                    if chunk.get("error"):
                        result.error = f"stream error: {_error_text(data)}"
                        return result
                    if _is_content(chunk):
                        if chunks == 0:
                            result.ttft = now - start
                        else:
                            result.itl.append(now - last)
                        last = now
                        chunks += 1
                    usage = chunk.get("usage") or {}
                    if usage.get("completion_tokens") is not None:
                        usage_tokens = int(usage["completion_tokens"])
                    if usage.get("prompt_tokens") is not None:
                        result.prompt_tokens = int(usage["prompt_tokens"])
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        result.cached_tokens = int(details["cached_tokens"])
    except TimeoutError:
        result.error = f"timed out after {timeout:g} s"
        return result
    except Exception as error:  # one broken request is a failure to count, not a reason to stop the run
        result.error = f"{type(error).__name__}: {error}"
        return result
    result.e2e = time.perf_counter() - start
    if not done:
        result.error = "the stream ended before data: [DONE]"
    elif chunks == 0:
        result.error = "the stream carried no output"
    else:
        result.success = True
        # One chunk may carry several tokens, so the server's own count wins when it reports one.
        result.output_tokens = usage_tokens if usage_tokens is not None else chunks
    return result
