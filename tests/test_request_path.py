"""docs/architecture.md's hop-by-hop list of one request stays true: every class it names exists, the ones built in
this process are the ones one streamed chat completion builds, no other class built on the path carries the
request's prompt or sampling settings, and a chunk passes the iterator layers the list says (3, or 4 routed)."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import inspect
import json
import re
import sys
from pathlib import Path

import httpx
import pytest

from pagerail import LLM
from pagerail.cluster.bench.tiny_llama import TinyLlamaShape, write_tiny_llama
from pagerail.cluster.core import async_engine
from pagerail.cluster.frontend.http_app import ServerState, create_app
from pagerail.cluster.frontend.settings import FrontendSettings
from pagerail.cluster.routing.routed_client import RoutedEngineClient

pytestmark = pytest.mark.slow  # the tiny model's tokenizer is trimmed from the embedded model's

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"
MODEL = "tiny"
# Attributes that would hold a copy of a request's prompt or sampling settings.
REQUEST_FIELDS = {"prompt_token_ids", "prompt", "params", "sampling_params", "sampling", "temperature"}


def documented_classes() -> list[str]:
    """The fully qualified class names the section lists."""
    text = DOC.read_text()
    section = text[text.index("## One request, hop by hop") :]
    end = section.find("\n## ", 3)
    section = section if end < 0 else section[:end]
    return sorted(set(re.findall(r"`(pagerail(?:\.\w+)+\.[A-Z]\w*)`", section)))


def qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


class ConstructedClasses:
    """Records the pagerail classes built while it is on, in this thread and the engine loop's (a profile hook)."""

    def __init__(self, engine_loop) -> None:
        self.classes: dict[str, type] = {}
        self._engine_loop = engine_loop

    def _hook(self, frame, event, arg) -> None:
        name = frame.f_code.co_name
        if event == "call" and name == "__init__":
            instance = frame.f_locals.get("self")
            if instance is not None:
                self._record(type(instance))
        elif event == "return" and name == "model_validate" and arg is not None:  # pydantic builds without __init__
            self._record(type(arg))

    def _record(self, cls: type) -> None:
        if cls.__module__.startswith("pagerail."):
            self.classes.setdefault(qualified(cls), cls)

    def _on_loop_thread(self, hook) -> None:
        asyncio.run(self._engine_loop.run_on_loop(lambda engine: sys.setprofile(hook)))

    def __enter__(self) -> ConstructedClasses:
        self._on_loop_thread(self._hook)
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)
        self._on_loop_thread(None)


def carries_request_fields(cls: type) -> set[str]:
    """The request-carrying attributes `cls` declares as fields (dataclass, slots or pydantic)."""
    names: set[str] = set()
    if dataclasses.is_dataclass(cls):
        names |= {field.name for field in dataclasses.fields(cls)}
    names |= set(getattr(cls, "model_fields", {}))
    for klass in cls.__mro__:
        names |= set(getattr(klass, "__slots__", ()))
    return names & REQUEST_FIELDS


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = write_tiny_llama(tmp_path_factory.mktemp("path") / "tiny", TinyLlamaShape(vocab_size=1024), seed=1)
    with LLM(str(path), served_model_name=MODEL, block_size=4, num_gpu_blocks=256) as llm:
        # The trimmed tokenizer ships none; the chat route needs one to format the conversation.
        llm.tokenizer.chat_template = "{% for m in messages %}<|im_start|>{{ m['content'] }}{% endfor %}"
        yield llm


def chat_body() -> dict:
    # Sampled (not greedy), so the rank builds its sampler's row too.
    messages = [{"role": "user", "content": "Say something."}]
    return {"model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0.8, "seed": 7, "stream": True}


async def stream_chat(engine) -> list[dict]:
    app = create_app(ServerState(engine, engine_tokenizer(engine), FrontendSettings(MODEL)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        response = await client.post("/v1/chat/completions", json=chat_body())
        assert response.status_code == 200, response.text
    events = [line[len("data: ") :] for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


_TOKENIZERS: dict[int, object] = {}


def engine_tokenizer(engine):
    return _TOKENIZERS[id(engine)]


def test_every_class_the_list_names_exists():
    names = documented_classes()
    assert len(names) >= 15, names
    for name in names:
        module, _, cls = name.rpartition(".")
        assert inspect.isclass(getattr(importlib.import_module(module), cls, None)), name


def test_one_streamed_chat_completion_builds_the_listed_classes_and_no_other_copy_of_the_request(llm):
    engine = llm.engine_client
    _TOKENIZERS[id(engine)] = llm.tokenizer
    asyncio.run(stream_chat(engine))  # warm: imports and first-use caches are not the request's path
    with ConstructedClasses(llm._engine_loop) as seen:
        chunks = asyncio.run(stream_chat(engine))
    assert chunks and chunks[-1]["choices"][0]["finish_reason"] == "length"
    documented = set(documented_classes())
    # Protobuf messages are built in C; the profile hook sees the Python classes only.
    in_process = {name for name in documented if not name.startswith("pagerail.proto.")}
    assert in_process <= set(seen.classes), sorted(in_process - set(seen.classes))
    copies = {
        name: sorted(fields)
        for name, cls in seen.classes.items()
        if name not in documented and (fields := carries_request_fields(cls))
    }
    assert not copies, f"classes on the path that carry a request's prompt or settings but are not listed: {copies}"


def iterator_layers() -> int:
    """Async generators of pagerail on the stack: the iterator layers between a request's queue and its reader."""
    frame, count = sys._getframe(1), 0
    while frame is not None:
        if frame.f_code.co_flags & inspect.CO_ASYNC_GENERATOR and frame.f_globals["__name__"].startswith("pagerail."):
            count += 1
        frame = frame.f_back
    return count


@pytest.mark.parametrize(("routed", "layers"), [(False, 3), (True, 4)])
def test_a_chunk_passes_the_listed_number_of_iterator_layers(llm, monkeypatch, routed, layers):
    engine = llm.engine_client
    if routed:
        engine = RoutedEngineClient({"r0": engine}, block_size=4)
    _TOKENIZERS[id(engine)] = llm.tokenizer
    real = async_engine.next_delta
    depths: list[int] = []

    async def counted(deltas):
        depths.append(iterator_layers())
        return await real(deltas)

    monkeypatch.setattr(async_engine, "next_delta", counted)
    chunks = asyncio.run(stream_chat(engine))
    # Each read of the stream goes through next_delta once, the first before the consumers' generators are all
    # entered. A loaded machine merges steps into fewer reads (the reader lags the engine), so the number of reads
    # is not fixed; every read after the first sees the listed depth.
    assert chunks and len(depths) >= 2, depths
    assert set(depths[1:]) == {layers}, depths
