"""Tool calls over the function channel: declared tools, the system prompt that lists them, the parser of the
model's calls and the queue of responses read back to it.

The checkpoint's convention: the tools are listed in the system prompt after the instructions; the model writes
`<TOOLCALL>[{"name": ..., "arguments": ...}]</TOOLCALL>` on its function channel (the markers as text or as the
tokenizer's `<SPECIAL_20>` / `<SPECIAL_21>`); a result goes back as the tokens of
`<TOOL_RESPONSE>[output]</TOOL_RESPONSE>`, forced into the function channel one per 80 ms frame in place of the
function head's pick, so the model reads them as its function-channel input.

    tools = parse_tools(session["tools"])                      # OpenAI Realtime's {type, name, description, ...}
    prompt = render_system_prompt(instructions, tools)
    channel = ToolChannel(tools, tokenizer)
    forced = channel.next_forced()                             # before frame t's language step: an id or None
    events = channel.frame(delta, forced is not None)          # after it: call deltas, done, malformed calls
    channel.submit_output(call_id, output)                     # the answer, queued behind any still draining
"""

from __future__ import annotations

import collections
import json
import re
import secrets
import threading
from dataclasses import dataclass, field
from typing import Any

MAX_TOOLS = 5
MAX_QUEUED_TOKENS = 1024  # response tokens waiting for the function channel: 82 s at one per 80 ms frame
MAX_CALL_CHARS = 16_384  # a call still open past this many characters is reported malformed and dropped
TOOL_CHOICES = ("auto", "none")
CALL_START, CALL_END = "<TOOLCALL>", "</TOOLCALL>"
RESPONSE_START, RESPONSE_END = "<TOOL_RESPONSE>", "</TOOL_RESPONSE>"
# the tokenizer's markers, as the function channel's text spells them, and the text they stand for
SPECIAL_MARKERS = {"<SPECIAL_20>": CALL_START, "<SPECIAL_21>": CALL_END}
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")

TOOLS_PROMPT = (
    "You can use the following tools to assist the user if required:\n"
    "<AVAILABLE_TOOLS>{tools}</AVAILABLE_TOOLS>\n\n"
    "If you decide to call any tool(s), use the following format:\n"
    '<TOOLCALL>[{{"name": "tool_name1", "arguments": "tool_args1"}}, ...]</TOOLCALL>\n\n'
    "The user will execute tool-calls and return responses from tool(s) in this format:\n"
    '<TOOL_RESPONSE>[{{"tool_response1"}}, ...]</TOOL_RESPONSE>\n\n'
    "Based on the tool responses, you can call additional tools if needed, correct tool calls if any errors are "
    "found, or just respond to the user."
)


def new_call_id() -> str:
    """`call_` and 16 hex digits."""
    return "call_" + secrets.token_hex(8)


@dataclass(frozen=True)
class Tool:
    """One declared function; `parameters` is its JSON schema (an object schema)."""

    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})

    def listing(self) -> dict:
        """What the system prompt lists of it."""
        return {"name": self.name, "description": self.description, "parameters": self.parameters}


def parse_tool(value: Any, where: str = "tool") -> Tool:
    """One OpenAI Realtime tool `{type: "function", name, description, parameters}`; ValueError naming the field."""
    if not isinstance(value, dict):
        raise ValueError(f"{where} must be an object {{type: \"function\", name, description, parameters}}")
    if value.get("type") != "function":
        raise ValueError(f"{where}.type must be \"function\", got {json.dumps(value.get('type'))}")
    name = value.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ValueError(f"{where}.name must be 1-64 letters, digits, '_' or '-', got {json.dumps(name)}")
    description = value.get("description", "")
    if not isinstance(description, str):
        raise ValueError(f"{where}.description must be a string")
    parameters = value.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise ValueError(f"{where}.parameters must be a JSON schema object with \"type\": \"object\"")
    return Tool(name, description, parameters)


def parse_tools(value: Any, where: str = "tools") -> list[Tool]:
    """A list of at most MAX_TOOLS tools with distinct names (None: no tools); ValueError naming the fault."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise ValueError(f"{where} must be a list of tools")
    if len(value) > MAX_TOOLS:
        raise ValueError(f"{where} declares {len(value)} tools; at most {MAX_TOOLS} are allowed")
    tools = [parse_tool(item, f"{where}[{i}]") for i, item in enumerate(value)]
    check_distinct(tools)
    return tools


def check_distinct(tools: list[Tool]) -> None:
    names = [t.name for t in tools]
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"tool names must be distinct; {', '.join(repeated)} is declared more than once")


def parse_tool_choice(value: Any, where: str = "tool_choice") -> str:
    """"auto" (the default) or "none"; the other OpenAI choices cannot be enforced on this model."""
    if value is None:
        return "auto"
    if value not in TOOL_CHOICES:
        raise ValueError(f"{where} must be \"auto\" or \"none\", got {json.dumps(value)} (this model decides by "
                         "itself whether to call a tool: \"required\" or a named function cannot be enforced)")
    return value


def render_system_prompt(instructions: str | None, tools: list[Tool]) -> str | None:
    """The instructions, then (after a blank line) the tools block of the checkpoint's convention; the tools'
    JSON has its keys sorted. Without tools the instructions are returned as they are."""
    if not tools:
        return instructions
    block = TOOLS_PROMPT.format(tools=json.dumps([t.listing() for t in tools], sort_keys=True, ensure_ascii=False))
    return f"{instructions}\n\n{block}" if instructions and instructions.strip() else block


def response_text(output: str) -> str:
    """`<TOOL_RESPONSE>[output]</TOOL_RESPONSE>`: the output parsed as JSON when it is JSON, else as a string,
    with compact separators.

    >>> response_text('{"temp": 21}'), response_text("sunny")
    ('<TOOL_RESPONSE>[{"temp":21}]</TOOL_RESPONSE>', '<TOOL_RESPONSE>["sunny"]</TOOL_RESPONSE>')
    """
    try:
        value = json.loads(output)
    except ValueError:
        value = output
    return f"{RESPONSE_START}{json.dumps([value], separators=(',', ':'), ensure_ascii=False)}{RESPONSE_END}"


@dataclass
class CallEvent:
    """What the parser reports: kind "delta" (text of the call as written), "done" (one parsed call) or
    "error" (a malformed call: `message` says why and quotes the raw text)."""

    kind: str
    call_id: str
    delta: str | None = None
    name: str | None = None
    arguments: str | None = None  # JSON text
    message: str | None = None


def _held_back(text: str, markers: tuple[str, ...]) -> int:
    """Characters at the end of `text` that may be the start of one of `markers` (kept for the next frame)."""
    for n in range(min(len(text), max(len(m) for m in markers) - 1), 0, -1):
        if any(m.startswith(text[-n:]) for m in markers):
            return n
    return 0


class CallParser:
    """The function channel's text, frame by frame, into tool-call events. Text outside a call is ignored;
    inside one, each frame's new text is a delta; the end marker completes it."""

    STARTS = (CALL_START, "<SPECIAL_20>")
    ENDS = (CALL_END, "<SPECIAL_21>")

    def __init__(self, declared: set[str]):
        self.declared = declared
        self.buffer = ""  # outside a call: the tail that may begin a start marker; inside: the call's text
        self.sent = 0  # characters of the call's text already sent as deltas
        self.call_id: str | None = None
        self.opened = ""  # the start marker as written

    def feed(self, text: str) -> list[CallEvent]:
        """The new text of one frame -> the events it completes."""
        self.buffer += text
        events: list[CallEvent] = []
        while True:
            if self.call_id is None:
                start = _first(self.buffer, self.STARTS)
                if start is None:
                    self.buffer = self.buffer[len(self.buffer) - _held_back(self.buffer, self.STARTS):]
                    return events
                self.call_id, self.sent, self.opened = new_call_id(), 0, start[1]
                self.buffer = self.buffer[start[0] + len(start[1]):]
                continue
            end = _first(self.buffer, self.ENDS)
            if end is None:
                self._delta(events, self.buffer[: len(self.buffer) - _held_back(self.buffer, self.ENDS)])
                if len(self.buffer) > MAX_CALL_CHARS:
                    events.append(self._malformed(f"the call passed {MAX_CALL_CHARS} characters without "
                                                  f"{CALL_END}", self.opened + self.buffer))
                    self.buffer = ""
                return events
            body, self.buffer = self.buffer[: end[0]], self.buffer[end[0] + len(end[1]):]
            self._delta(events, body)
            events += self._complete(body, self.opened + body + end[1])

    def finish(self) -> list[CallEvent]:
        """End of the channel: a call still open is malformed."""
        if self.call_id is None:
            return []
        body, self.buffer = self.buffer, ""
        return [self._malformed(f"the function channel ended before {CALL_END}", self.opened + body)]

    def _delta(self, events: list[CallEvent], written: str) -> None:
        """The call's text not sent yet, of `written` (its text so far, less a possible end marker's start)."""
        if len(written) > self.sent:
            events.append(CallEvent("delta", self.call_id, delta=written[self.sent:]))
            self.sent = len(written)

    def _complete(self, body: str, raw: str) -> list[CallEvent]:
        """The calls of one `<TOOLCALL>` block: the first keeps the block's call id, the others get new ones."""
        try:
            calls = parse_calls(body, self.declared)
        except ValueError as exc:
            return [self._malformed(str(exc), raw)]
        events = [CallEvent("done", self.call_id if i == 0 else new_call_id(), name=name, arguments=arguments)
                  for i, (name, arguments) in enumerate(calls)]
        self.call_id = None
        return events

    def _malformed(self, why: str, raw: str) -> CallEvent:
        """The open call as an error event quoting `raw`, the call's text as written (markers included)."""
        call_id, self.call_id = self.call_id, None
        return CallEvent("error", call_id, message=f"malformed tool call {call_id}: {why}; raw text: {raw}")


def _first(text: str, markers: tuple[str, ...]) -> tuple[int, str] | None:
    """The earliest (index, marker) of `markers` in `text`."""
    found = [(text.find(m), m) for m in markers if m in text]
    return min(found) if found else None


def parse_calls(body: str, declared: set[str]) -> list[tuple[str, str]]:
    """The text between the markers -> [(name, arguments as JSON text)]; ValueError saying what is wrong.

    >>> parse_calls('[{"name": "f", "arguments": {"x": 1}}]', {"f"})
    [('f', '{"x":1}')]
    """
    try:
        value = json.loads(body)
    except ValueError as exc:
        raise ValueError(f"not JSON ({exc})") from None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ValueError("expected a non-empty JSON list of {\"name\", \"arguments\"} objects")
    calls = []
    for i, call in enumerate(value):
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError(f"call {i} is not an object with a string \"name\"")
        if call["name"] not in declared:
            raise ValueError(f"call {i} names {json.dumps(call['name'])}, which is not a declared tool "
                             f"({', '.join(sorted(declared)) or 'none declared'})")
        calls.append((call["name"], _arguments(call.get("arguments", {}), i)))
    return calls


def _arguments(value: Any, i: int) -> str:
    """A call's arguments as JSON text: a string is taken as JSON text already, anything else is serialized."""
    if isinstance(value, str):
        try:
            json.loads(value)
        except ValueError:
            raise ValueError(f"call {i} has \"arguments\" that are a string but not JSON text") from None
        return value
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class ResponseQueue:
    """Token ids waiting to be forced into the function channel, one per frame, responses in submit order.

    Bounded: a response that would take the queue past `max_tokens` is refused (nothing queued of it). Safe to
    submit from any thread while the session's language stage takes ids."""

    def __init__(self, max_tokens: int = MAX_QUEUED_TOKENS):
        self.max_tokens = max_tokens
        self._ids: collections.deque[int] = collections.deque()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._ids)

    def put(self, ids: list[int]) -> None:
        with self._lock:
            if len(self._ids) + len(ids) > self.max_tokens:
                raise ValueError(f"the function channel has {len(self._ids)} response tokens still to read and this "
                                 f"output is {len(ids)} more; at most {self.max_tokens} may wait (one is read per "
                                 "80 ms frame): send a shorter output, or wait until the queued ones are read")
            self._ids.extend(ids)

    def take(self) -> int | None:
        with self._lock:
            return self._ids.popleft() if self._ids else None


class ToolChannel:
    """One session's tool calls: parses the model's function-channel picks and queues the responses.

    `encode` tokenizes a response's text (the checkpoint's tokenizer, no special tokens added)."""

    def __init__(self, tools: list[Tool], encode, max_queued_tokens: int = MAX_QUEUED_TOKENS):
        self.tools = {t.name: t for t in tools}
        self.encode = encode
        self.parser = CallParser(set(self.tools))
        self.queue = ResponseQueue(max_queued_tokens)
        self.open_calls: dict[str, str] = {}  # call_id -> tool name, awaiting their output
        self._lock = threading.Lock()

    def next_forced(self) -> int | None:
        """The id to force into the next frame's function channel, if a response is draining."""
        return self.queue.take()

    def frame(self, text: str, forced: bool) -> list[CallEvent]:
        """A frame's new function-channel text: the model's picks are parsed, forced response tokens are not."""
        if forced:
            return []
        events = self.parser.feed(text)
        with self._lock:
            self.open_calls.update((e.call_id, e.name) for e in events if e.kind == "done")
        return events

    def finish(self) -> list[CallEvent]:
        return self.parser.finish()

    def submit_output(self, call_id: Any, output: Any) -> str:
        """Queue a call's output for the function channel; returns the call's tool name. ValueError for an unknown
        or answered call id, an output that is not a string, or a full queue (the call stays open then)."""
        if not isinstance(call_id, str) or not call_id:
            raise ValueError("function_call_output needs `call_id`: the id of a call this session reported")
        if not isinstance(output, str):
            raise ValueError(f"function_call_output {call_id}: `output` must be a string (JSON text or plain text)")
        with self._lock:
            if call_id not in self.open_calls:
                waiting = ", ".join(self.open_calls) or "none"
                raise ValueError(f"unknown call_id {json.dumps(call_id)}: no call of this session awaits an output "
                                 f"by that id (awaiting: {waiting})")
            self.queue.put(self.encode(response_text(output)))
            return self.open_calls.pop(call_id)
