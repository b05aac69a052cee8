"""One chat choice's output as the response shows it: content and tool calls, as stream deltas or a whole message."""

from __future__ import annotations

import uuid
from typing import Any

from pagerail.cluster.frontend.tool_calls import (
    ArgumentsDelta,
    ContentParser,
    Event,
    ToolCallParser,
    ToolCallStart,
    collect,
)


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex}"


class ChoiceOutput:
    """Feeds one choice's text through its tool-call parser. Use either `deltas` (streaming) or `message`."""

    def __init__(self, parser: ToolCallParser) -> None:
        self._parser = parser
        self._plain = isinstance(parser, ContentParser)
        self._said_anything = False
        self.called = False

    def opening(self) -> dict[str, Any]:
        """The first delta of a streamed choice. Where calls may come, content starts as null, so a stream of only
        calls assembles into the same message as the whole response (content null)."""
        return {"role": "assistant", "content": "" if self._plain else None}

    def deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        """The `delta` objects of the chunks for this much more text: content, or one call's start (index, id,
        type, name, empty arguments) and then its arguments in pieces, as the openai client assembles them."""
        events = self._parser.feed(text)
        if final:
            events += self._parser.finish()
        out: list[dict[str, Any]] = []
        if final and not events and not self._said_anything and not self._plain:
            out.append({"content": ""})  # an empty answer is empty content, as in the whole message
        for event in _merged(events):
            self._said_anything = True
            if isinstance(event, str):
                out.append({"content": event})
            elif isinstance(event, ToolCallStart):
                self.called = True
                call = {"index": event.index, "id": tool_call_id(), "type": "function"}
                out.append({"tool_calls": [{**call, "function": {"name": event.name, "arguments": ""}}]})
            else:
                out.append({"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]})
        return out

    def message(self, text: str) -> dict[str, Any]:
        """The whole assistant message of the choice's text; content is null when only calls were made."""
        content, calls = collect(self._parser.feed(text) + self._parser.finish())
        if not calls:
            return {"role": "assistant", "content": content}
        self.called = True
        tool_calls = [
            {"id": tool_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
            for name, arguments in calls
        ]
        return {"role": "assistant", "content": content or None, "tool_calls": tool_calls}

    def finish_reason(self, engine_reason: str | None) -> str | None:
        # A call that the engine cut short (length, abort) keeps that reason: its arguments may be incomplete.
        return "tool_calls" if self.called and engine_reason == "stop" else engine_reason


def _merged(events: list[Event]) -> list[Event]:
    """Neighbouring content pieces, and neighbouring argument pieces of one call, as one event."""
    out: list[Event] = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, str) and isinstance(last, str):
            out[-1] = last + event
        elif isinstance(event, ArgumentsDelta) and isinstance(last, ArgumentsDelta) and last.index == event.index:
            out[-1] = ArgumentsDelta(event.index, last.text + event.text)
        else:
            out.append(event)
    return out
