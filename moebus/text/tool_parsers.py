"""From generated text to function calls, as the text streams: a ToolStream per choice turns each
text delta into content text, call starts (id, name) and argument fragments, so every API (chat
chunks, Responses events, Anthropic Messages events) streams calls the way its clients expect and
builds its final body from the same state.

Streams: `PlainText` (no tools, or tool_choice none), `NamedCall` (tool_choice names a function:
the constrained output is its arguments), `CallArray` (tool_choice required: the constrained output
is `[{"name": ..., "arguments": {...}}, ...]`) and the per-model parsers of free text for
tool_choice auto, registered in PARSERS (Hermes: `<tool_call>{json}</tool_call>`). A parser for
another model's format (DeepSeek's) is one more class satisfying ToolStream.
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(slots=True)
class Text:
    text: str


@dataclass(slots=True)
class CallStart:
    index: int  # the call's position among this choice's calls
    id: str
    name: str


@dataclass(slots=True)
class CallArgs:
    index: int
    fragment: str  # the next piece of the arguments' JSON text


Out = Text | CallStart | CallArgs


@dataclass(slots=True)
class Call:
    id: str
    name: str
    arguments: str = ""
    complete: bool = False  # its JSON object closed (else the output was cut: max_tokens)


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@runtime_checkable
class ToolStream(Protocol):
    """One choice's text -> content and calls. `content` and `calls` hold what was emitted so far."""

    content: str
    calls: list[Call]

    def feed(self, text: str) -> list[Out]: ...

    def finish(self) -> list[Out]:
        """The text ended: release what was held back."""
        ...


@dataclass
class Emitter:
    """What every stream keeps: content, calls, and the outs of the current step."""

    new_id: Callable[[], str] = new_call_id
    max_calls: int | None = None  # parallel_tool_calls false: 1 (later calls are dropped)
    content: str = ""
    calls: list[Call] = field(default_factory=list)
    _outs: list[Out] = field(default_factory=list)

    def text(self, s: str) -> None:
        if s:
            self.content += s
            self._outs.append(Text(s))

    def start(self, name: str) -> int | None:
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            return None
        call = Call(self.new_id(), name)
        self.calls.append(call)
        self._outs.append(CallStart(len(self.calls) - 1, call.id, name))
        return len(self.calls) - 1

    def args(self, index: int | None, fragment: str) -> None:
        if index is not None and fragment:
            self.calls[index].arguments += fragment
            last = self._outs[-1] if self._outs else None
            if isinstance(last, CallArgs) and last.index == index:  # one piece per step, not per character
                last.fragment += fragment
            else:
                self._outs.append(CallArgs(index, fragment))

    def take(self) -> list[Out]:
        outs, self._outs = self._outs, []
        return outs


class PlainText(Emitter):
    def feed(self, text: str) -> list[Out]:
        self.text(text)
        return self.take()

    def finish(self) -> list[Out]:
        return []


@dataclass
class NamedCall(Emitter):
    """tool_choice names the function: all the (constrained) output is its arguments."""

    name: str = ""
    _index: int | None = None

    def feed(self, text: str) -> list[Out]:
        if self._index is None and text:
            self._index = self.start(self.name)
        self.args(self._index, text)
        return self.take()

    def finish(self) -> list[Out]:
        if self._index is None:
            self._index = self.start(self.name)
        if self._index is not None:
            call = self.calls[self._index]
            call.complete = _is_object(call.arguments)
        return self.take()


class _CallObject:
    """Scans one `{"name": ..., "arguments": ...}` object a character at a time: the name starts the
    call, the arguments' text streams as it comes (an arguments string is decoded at its end)."""

    def __init__(self, out: Emitter) -> None:
        self.out = out
        self.state = "open"  # open, key, colon, value, after, done, bad
        self.key, self.token, self.depth = "", "", 0
        self.in_str = self.esc = False
        self.name: str | None = None
        self.index: int | None = None
        self.started = False
        self.held_args = ""  # arguments seen before the name
        self.raw = ""  # every character fed (given back as text if it was no call)

    def feed(self, ch: str) -> None:
        self.raw += ch
        st = self.state
        if st in ("done", "bad"):
            return
        if st == "open":
            if ch == "{":
                self.state = "key"
            elif not ch.isspace():
                self.state = "bad"
        elif st == "key":
            if self._string(ch):
                if self.token is not None and not self.in_str and self.token.startswith('"'):
                    self.key, self.token, self.state = json.loads(self.token), "", "colon"
            elif ch == "}":
                self.state = "done"
            elif not ch.isspace() and ch != ",":
                self.state = "bad"
        elif st == "colon":
            if ch == ":":
                self.state = "value"
        elif st == "value":
            self._value(ch)
        elif st == "after":
            if ch == "}":
                self.state = "done"
            elif ch == ",":
                self.state = "key"

    def _string(self, ch: str) -> bool:
        """Feeds a string token (self.token); True while the character belongs to one."""
        if not self.token:
            if ch != '"':
                return False
            self.token, self.in_str = '"', True
            return True
        self.token += ch
        self._string_char(ch)
        return True

    def _string_char(self, ch: str) -> None:
        """One character inside a JSON string: an escape, or the closing quote."""
        if self.esc:
            self.esc = False
        elif ch == "\\":
            self.esc = True
        elif ch == '"':
            self.in_str = False

    def _value(self, ch: str) -> None:
        if not self.token and ch.isspace():
            return
        self.token += ch
        first = self.token[0]
        if first not in '{["':  # a bare value (number, true, null) ends at the next , or }
            if ch in ",}":
                value, self.token = self.token[:-1].strip(), ""
                self.state = "done" if ch == "}" else "key"
                self._ended(value)
            return
        if self.in_str:
            self._string_char(ch)
        elif ch == '"':
            self.in_str = True
        elif ch in "{[":
            self.depth += 1
        elif ch in "}]":
            self.depth -= 1
        if self.key in ("arguments", "parameters") and first in "{[":
            self._args(ch)  # streamed as it comes
        if self.depth == 0 and not self.in_str:  # the string's closing quote, or the container's close
            value, self.token, self.state = self.token, "", "after"
            self._ended(value)

    def _ended(self, value: str) -> None:
        if self.key == "name" and self.name is None:
            try:
                self.name = str(json.loads(value))
            except ValueError:
                self.state = "bad"
                return
            self.index = self.out.start(self.name)
            self.started = True
            self.out.args(self.index, self.held_args)
            self.held_args = ""
        elif self.key in ("arguments", "parameters") and value[:1] not in ("{", "["):
            try:
                decoded = json.loads(value)
            except ValueError:
                decoded = value
            self._args(decoded if isinstance(decoded, str) else json.dumps(decoded))

    def _args(self, text: str) -> None:
        if self.started:
            self.out.args(self.index, text)
        else:
            self.held_args += text

    def close(self) -> None:
        if self.index is not None:
            self.out.calls[self.index].complete = self.state == "done"


@dataclass
class CallArray(Emitter):
    """tool_choice required: the constrained output is a JSON array of call objects."""

    _obj: _CallObject | None = None
    _opened: bool = False

    def feed(self, text: str) -> list[Out]:
        for ch in text:
            if self._obj is not None:
                self._obj.feed(ch)
                if self._obj.state in ("done", "bad"):
                    self._obj.close()
                    self._obj = None
            elif not self._opened:
                self._opened = ch == "["
            elif ch == "{":
                self._obj = _CallObject(self)
                self._obj.feed(ch)
        return self.take()

    def finish(self) -> list[Out]:
        if self._obj is not None:
            self._obj.close()
        return self.take()


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


@dataclass
class HermesParser(Emitter):
    """Hermes / Qwen / SmolLM style: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any
    number of them, with text around them. Text that may be the start of a tag is held back."""

    _held: str = ""
    _obj: _CallObject | None = None
    _in_call: bool = False

    def feed(self, text: str) -> list[Out]:
        buf = self._held + text
        self._held = ""
        while buf:
            if not self._in_call:
                at = buf.find(_OPEN)
                if at < 0:
                    keep = _partial_suffix(buf, _OPEN)
                    self._content(buf[:len(buf) - keep])
                    self._held = buf[len(buf) - keep:]
                    break
                self._content(buf[:at])
                buf, self._in_call, self._obj = buf[at + len(_OPEN):], True, _CallObject(self)
            else:
                at = buf.find(_CLOSE)
                body = buf if at < 0 else buf[:at]
                if at < 0:  # the closing tag may be arriving: keep its possible start back
                    keep = _partial_suffix(body, _CLOSE)
                    body, self._held = body[:len(body) - keep], body[len(body) - keep:]
                for ch in body:
                    self._obj.feed(ch)
                if at < 0:
                    break
                self._end_call()
                buf = buf[at + len(_CLOSE):]
        return self.take()

    def _content(self, text: str) -> None:
        if self.calls and not text.strip():  # whitespace between and after calls is layout, not content
            return
        self.text(text)

    def _end_call(self) -> None:
        if self._obj is not None:
            if self._obj.name is None:  # not a call after all: the text goes out as it was
                self.text(_OPEN + self._obj.raw)
            self._obj.close()
        self._in_call, self._obj = False, None

    def finish(self) -> list[Out]:
        if self._in_call:
            for ch in self._held:
                self._obj.feed(ch)
            self._held = ""
            self._end_call()
        elif self._held:
            self._content(self._held)
            self._held = ""
        return self.take()


# tool_choice auto: parser name -> its ToolStream class (made with new_id and max_calls)
PARSERS: dict[str, Callable[..., ToolStream]] = {"hermes": HermesParser}


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that is a start of `tag`."""
    for k in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _is_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except ValueError:
        return False
