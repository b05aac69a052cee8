"""Tool calls read out of generated text as it streams: the model's own formats (Hermes, Llama 3 JSON) and the
outputs of a named or `required` tool_choice constraint."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol

from pagerail.cluster.frontend.tool_scan import CallArrayScanner

# Parsers a server may be told to use for tool_choice "auto"; "hermes" also reads a JSON list inside one tag.
TOOL_CALL_PARSERS = ("hermes", "llama3_json")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCallStart:
    """Call number `index` of a choice begins: its function's name is known, its arguments follow."""

    index: int
    name: str


@dataclass(frozen=True)
class ArgumentsDelta:
    """More of the JSON arguments text of call `index`."""

    index: int
    text: str


# What a parser hands back as text arrives: content text (str), or a piece of a tool call.
Event = str | ToolCallStart | ArgumentsDelta


class ToolCallParser(Protocol):
    """Fed a choice's text in pieces of any size; the events of all pieces are the same however it was cut."""

    def feed(self, text: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


def choose_parser(chat_template: object, override: str | None = None) -> str:
    """The parser for tool_choice "auto": `override` when given, else the format the chat template teaches."""
    if override is not None:
        if override not in TOOL_CALL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, got {override!r}")
        return override
    # Hermes-style tags are the common format (Qwen2/Qwen3, SmolLM2, Hermes); Llama 3 teaches a python tag.
    template = chat_template if isinstance(chat_template, str) else json.dumps(chat_template, default=str)
    if HERMES_OPEN not in template and (PYTHON_TAG in template or "<|eom_id|>" in template):
        return "llama3_json"
    return "hermes"


def auto_parser(name: str) -> ToolCallParser:
    """A parser of the model's own tool-call format, by name (see TOOL_CALL_PARSERS)."""
    return HermesParser() if name == "hermes" else Llama3JsonParser()


class ContentParser:
    """No tool calls: every piece of text is content."""

    def feed(self, text: str) -> list[Event]:
        return [text] if text else []

    def finish(self) -> list[Event]:
        return []


class FirstCallOnly:
    """parallel_tool_calls false under tool_choice "auto": calls after the first are left out."""

    def __init__(self, parser: ToolCallParser) -> None:
        self._parser = parser

    def feed(self, text: str) -> list[Event]:
        return [event for event in self._parser.feed(text) if _first_call_or_content(event)]

    def finish(self) -> list[Event]:
        return [event for event in self._parser.finish() if _first_call_or_content(event)]


def _first_call_or_content(event: Event) -> bool:
    return isinstance(event, str) or event.index == 0


class NamedCallParser:
    """tool_choice names a function: the whole output is that function's arguments."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._started = False

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = self._start()
        if text:
            events.append(ArgumentsDelta(0, text))
        return events

    def finish(self) -> list[Event]:
        return self._start()  # a call even when nothing was generated, so the response says which was asked for

    def _start(self) -> list[Event]:
        if self._started:
            return []
        self._started = True
        return [ToolCallStart(0, self._name)]


class RequiredCallsParser:
    """tool_choice "required": the output is a JSON array of {"name": ..., "parameters": {...}}; each element's
    parameters text streams out as that call's arguments while it is generated."""

    def __init__(self) -> None:
        self._scanner = CallArrayScanner(name_key="name", arguments_keys=("parameters",))

    def feed(self, text: str) -> list[Event]:
        return _call_events(self._scanner.feed(text))

    def finish(self) -> list[Event]:
        return []


def _call_events(found: list[tuple[int, str | None, str]]) -> list[Event]:
    events: list[Event] = []
    for index, name, arguments in found:
        if name is not None:
            events.append(ToolCallStart(index, name))
        if arguments:
            events.append(ArgumentsDelta(index, arguments))
    return events


class _HeldWhitespace:
    """Content with the whitespace around tool calls left out: a piece's trailing whitespace waits until more
    content follows, and is dropped if a call comes next or the text ends after a call."""

    def __init__(self) -> None:
        self.held = ""
        self.calls = 0

    def content(self, text: str, events: list[Event]) -> None:
        if not text:
            return
        text = self.held + text
        kept = text.rstrip()
        self.held = text[len(kept) :]
        if kept:
            events.append(kept)

    def call(self, calls: list[tuple[str, str]], events: list[Event]) -> None:
        self.held = ""
        for name, arguments in calls:
            events.append(ToolCallStart(self.calls, name))
            events.append(ArgumentsDelta(self.calls, arguments))
            self.calls += 1

    def finish(self, events: list[Event]) -> None:
        # Without any call the text comes back exactly as generated.
        if self.held and not self.calls:
            events.append(self.held)
        self.held = ""


class HermesParser:
    """`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (a JSON list inside one tag is read too).

    Content outside the tags streams as it comes; each call is held until its closing tag and then sent whole,
    so a call whose JSON does not parse goes back into the content as the text it was."""

    def __init__(self) -> None:
        self._buffer = ""
        self._in_call = False
        self._out = _HeldWhitespace()

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while True:
            if not self._in_call:
                at = self._buffer.find(HERMES_OPEN)
                if at < 0:
                    # A tag may be arriving in pieces: keep a tail that could be its start.
                    keep = _partial_tail(self._buffer, HERMES_OPEN)
                    self._out.content(self._buffer[: len(self._buffer) - keep], events)
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    return events
                self._out.content(self._buffer[:at], events)
                self._buffer = self._buffer[at + len(HERMES_OPEN) :]
                self._in_call = True
            at = self._buffer.find(HERMES_CLOSE)
            if at < 0:
                return events
            self._close(self._buffer[:at], HERMES_OPEN + self._buffer[: at + len(HERMES_CLOSE)], events)
            self._buffer = self._buffer[at + len(HERMES_CLOSE) :]
            self._in_call = False

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self._in_call:
            # Generation ended inside a tag (a model that stops at the JSON's end): read what is there.
            self._close(self._buffer, HERMES_OPEN + self._buffer, events)
        else:
            self._out.content(self._buffer, events)
        self._buffer, self._in_call = "", False
        self._out.finish(events)
        return events

    def _close(self, body: str, raw: str, events: list[Event]) -> None:
        calls = _json_calls(body.strip(), ("arguments", "parameters"))
        if calls:
            self._out.call(calls, events)
        else:
            self._out.content(raw, events)


class Llama3JsonParser:
    """Llama 3's JSON tool calls: the whole message is `{"name": ..., "parameters": {...}}` (several separated by
    semicolons), possibly after `<|python_tag|>`. A message that starts otherwise streams as content."""

    def __init__(self) -> None:
        self._buffer = ""
        self._mode: str | None = None  # None: undecided, "json": held to the end, "content": streamed
        self._out = _HeldWhitespace()

    def feed(self, text: str) -> list[Event]:
        if self._mode == "content":
            return [text] if text else []
        self._buffer += text
        head = self._buffer.lstrip()
        if not head or (self._mode is None and PYTHON_TAG.startswith(head)):
            return []
        if head.startswith(("{", PYTHON_TAG)):
            self._mode = "json"
            return []
        self._mode = "content"
        text, self._buffer = self._buffer, ""
        return [text]

    def finish(self) -> list[Event]:
        events: list[Event] = []
        body = self._buffer.strip()
        if body.startswith(PYTHON_TAG):
            body = body[len(PYTHON_TAG) :].strip()
        calls = _json_calls_sequence(body) if self._mode == "json" else []
        if calls:
            self._out.call(calls, events)
        elif self._buffer:
            events.append(self._buffer)
        self._buffer = ""
        return events


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def _json_calls(body: str, arguments_keys: tuple[str, ...]) -> list[tuple[str, str]]:
    """(name, arguments JSON) of a call object or a list of them; [] when the text is anything else."""
    try:
        value = json.loads(body)
    except ValueError:
        return []
    items = value if isinstance(value, list) else [value]
    calls = [_call_of(item, arguments_keys) for item in items]
    return calls if calls and all(call is not None for call in calls) else []  # type: ignore[return-value]


def _json_calls_sequence(body: str) -> list[tuple[str, str]]:
    """Calls of Llama 3's format: JSON objects one after another, separated by `;` or whitespace."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(body):
        try:
            value, at = decoder.raw_decode(body, at)
        except ValueError:
            return []
        call = _call_of(value, ("parameters", "arguments"))
        if call is None:
            return []
        calls.append(call)
        while at < len(body) and (body[at].isspace() or body[at] == ";"):
            at += 1
    return calls


def _call_of(item: object, arguments_keys: tuple[str, ...]) -> tuple[str, str] | None:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
        return None
    arguments = next((item[key] for key in arguments_keys if key in item), {})
    if isinstance(arguments, str):
        return item["name"], arguments  # already JSON text, as some models write it
    if not isinstance(arguments, dict):
        return None
    return item["name"], json.dumps(arguments, ensure_ascii=False)


def collect(events: list[Event]) -> tuple[str, list[tuple[str, str]]]:
    """The content text and the (name, arguments) calls that a list of events adds up to."""
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, str):
            content.append(event)
        elif isinstance(event, ToolCallStart):
            calls[event.index] = [event.name]
        elif event.index in calls:
            calls[event.index].append(event.text)
    return "".join(content), [(parts[0], "".join(parts[1:])) for _, parts in sorted(calls.items())]
