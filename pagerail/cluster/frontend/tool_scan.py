"""Reads a JSON array of call objects one character at a time, handing out each call's name and the raw text of
its arguments as they are generated."""

from __future__ import annotations

import json

# Where the scanner is inside one call object (the array's elements are at depth 2).
_KEY, _COLON, _VALUE_START, _VALUE, _AFTER_VALUE = range(5)


class CallArrayScanner:
    """`[{"name": "f", "parameters": {...}}, ...]` → (call index, name or None, arguments text) pieces.

    The arguments of a call are the exact text of its arguments value, so pieces joined give what a parser of
    the whole output would slice out. A call is announced (with its name) once its name string is complete;
    arguments read before that wait for it.
    """

    def __init__(self, name_key: str, arguments_keys: tuple[str, ...]) -> None:
        self._name_key = name_key
        self._arguments_keys = arguments_keys
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._calls = 0
        self._reset_call()

    def _reset_call(self) -> None:
        self._state = _KEY
        self._key: str | None = None
        self._raw: list[str] = []  # the key or value being read
        self._value_kind = ""  # "nested", "string" or "scalar"
        self._name: str | None = None
        self._announced = False
        self._arguments: list[str] = []  # arguments text not yet handed out
        self._reading_arguments = False

    def feed(self, text: str) -> list[tuple[int, str | None, str]]:
        out: list[tuple[int, str | None, str]] = []
        for char in text:
            self._step(char, out)
        self._flush(out)
        return out

    def _step(self, char: str, out: list) -> None:
        if self._in_string:
            self._take(char)
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._in_string = False
                if self._depth == 2:
                    self._string_closed(out)
            return
        in_call = self._depth == 2
        if in_call and self._state == _VALUE and self._value_kind == "scalar" and char in ",}":
            self._value_done(out)
        if char == '"':
            if in_call and self._state == _KEY:
                self._raw = []
            elif in_call and self._state == _VALUE_START:
                self._begin_value("string")
            self._in_string = True
            self._take(char)
        elif char in "{[":
            if self._depth == 1 and char == "{":
                self._reset_call()
            elif in_call and self._state == _VALUE_START:
                self._begin_value("nested")
            self._take(char)
            self._depth += 1
        elif char in "}]":
            self._depth -= 1
            if self._depth >= 2:
                self._take(char)
            if self._depth == 2 and self._state == _VALUE and self._value_kind == "nested":
                self._value_done(out)
            elif self._depth == 1 and char == "}":
                self._call_done(out)
        elif in_call and self._state == _COLON and char == ":":
            self._state = _VALUE_START
        elif in_call and self._state == _AFTER_VALUE and char == ",":
            self._state = _KEY
        elif in_call and self._state == _VALUE_START and not char.isspace():
            self._begin_value("scalar")
            self._take(char)
        else:
            self._take(char)

    def _take(self, char: str) -> None:
        """Keep a character that belongs to the key or value being read."""
        if self._depth < 2 or self._state not in (_KEY, _VALUE) or (self._state == _KEY and not self._in_string):
            return
        if self._reading_arguments:
            self._arguments.append(char)
        else:
            self._raw.append(char)

    def _begin_value(self, kind: str) -> None:
        self._state, self._value_kind, self._raw = _VALUE, kind, []
        self._reading_arguments = self._key in self._arguments_keys

    def _string_closed(self, out: list) -> None:
        if self._state == _KEY:
            self._key = _decoded("".join(self._raw[1:-1]))
            self._state = _COLON
        elif self._state == _VALUE and self._value_kind == "string":
            self._value_done(out)

    def _value_done(self, out: list) -> None:
        if self._key == self._name_key and self._value_kind == "string" and self._name is None:
            self._name = _decoded("".join(self._raw[1:-1]))
        self._state, self._reading_arguments, self._raw = _AFTER_VALUE, False, []
        self._flush(out)

    def _call_done(self, out: list) -> None:
        self._flush(out)
        if self._announced:
            self._calls += 1
        self._state = _AFTER_VALUE

    def _flush(self, out: list) -> None:
        """Hand out the call's name once known, and the arguments read since the last flush."""
        if self._name is None:
            return
        name = None
        if not self._announced:
            self._announced, name = True, self._name
        arguments, self._arguments = "".join(self._arguments), []
        if name is not None or arguments:
            out.append((self._calls, name, arguments))


def _decoded(raw: str) -> str:
    """A JSON string's characters (between its quotes) decoded; undecodable text is kept as it is."""
    try:
        return json.loads(f'"{raw}"')
    except ValueError:
        return raw
