"""Tool declarations, the system prompt that lists them (character for character), the function channel's call
parser, the response text and queue, and the server-side runner's schemas, timeouts and errors."""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import types
from typing import Literal

import pytest

from orchestrator.tool_runner import ToolRunner, function_tool, json_schema
from orchestrator.tools import (
    CallParser,
    ResponseQueue,
    Tool,
    ToolChannel,
    parse_tool_choice,
    parse_tools,
    render_system_prompt,
    response_text,
)

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}

# The text with the tool list above filled in, keys sorted: written out by hand, not by the code.
EXPECTED_PROMPT = (
    'Be brief.\n\nYou can use the following tools to assist the user if required:\n<AVAILABLE_TOOLS>[{"description": '
    '"The current weather in a city.", "name": "get_weather", "parameters": {"properties": {"city": {"type": '
    '"string"}}, "required": ["city"], "type": "object"}}]</AVAILABLE_TOOLS>\n\nIf you decide to call any tool(s), '
    'use the following format:\n<TOOLCALL>[{"name": "tool_name1", "arguments": "tool_args1"}, ...]</TOOLCALL>\n\n'
    'The user will execute tool-calls and return responses from tool(s) in this format:\n<TOOL_RESPONSE>[{"tool_'
    'response1"}, ...]</TOOL_RESPONSE>\n\nBased on the tool responses, you can call additional tools if needed, '
    'correct tool calls if any errors are found, or just respond to the user.'
)


def test_prompt_is_the_conventions_text_character_for_character():
    assert render_system_prompt("Be brief.", parse_tools([WEATHER])) == EXPECTED_PROMPT
    assert render_system_prompt(None, parse_tools([WEATHER])) == EXPECTED_PROMPT[len("Be brief.\n\n"):]
    assert render_system_prompt("Be brief.", []) == "Be brief."  # no tools: the instructions as they are


@pytest.mark.parametrize(("tools", "message"), [
    ({"type": "function"}, "tools must be a list of tools"),
    ([WEATHER] * 6, "tools declares 6 tools; at most 5 are allowed"),
    ([{**WEATHER, "type": "code"}], 'tools\\[0\\].type must be "function", got "code"'),
    ([{**WEATHER, "name": "get weather"}], "tools\\[0\\].name must be 1-64 letters"),
    ([{**WEATHER, "description": 3}], "tools\\[0\\].description must be a string"),
    ([{**WEATHER, "parameters": {"type": "array"}}], "tools\\[0\\].parameters must be a JSON schema object"),
    ([WEATHER, WEATHER], "get_weather is declared more than once"),
    ([WEATHER, "get_time"], "tools\\[1\\] must be an object"),
])
def test_bad_tools_are_named(tools, message):
    with pytest.raises(ValueError, match=message):
        parse_tools(tools)


def test_tool_choice():
    assert (parse_tool_choice(None), parse_tool_choice("auto"), parse_tool_choice("none")) == ("auto", "auto", "none")
    with pytest.raises(ValueError, match='tool_choice must be "auto" or "none", got "required"'):
        parse_tool_choice("required")


def feed(parser, chunks):
    return [e for chunk in chunks for e in parser.feed(chunk)]


def test_parser_literal_markers_split_across_frames():
    parser = CallParser({"get_weather"})
    events = feed(parser, ["noise <TOOL", 'CALL>[{"name": "get_', 'weather", "arguments": {"city": "Paris"}}]</TO',
                           "OLCALL> after"])
    assert [(e.kind, e.delta) for e in events[:-1]] == [
        ("delta", '[{"name": "get_'), ("delta", 'weather", "arguments": {"city": "Paris"}}]')]
    done = events[-1]
    assert (done.kind, done.name, done.arguments, done.call_id) == ("done", "get_weather", '{"city":"Paris"}',
                                                                    events[0].call_id)
    assert done.call_id.startswith("call_") and len(done.call_id) == 21


def test_parser_special_tokens_and_several_calls():
    parser = CallParser({"a", "b"})
    events = feed(parser, ["<SPECIAL_20>", '[{"name": "a", "arguments": "{\\"x\\": 1}"}, {"name": "b"}]',
                           "<SPECIAL_21>"])
    assert [(e.kind, e.name, e.arguments) for e in events] == [
        ("delta", None, None), ("done", "a", '{"x": 1}'), ("done", "b", "{}")]
    assert events[1].call_id == events[0].call_id != events[2].call_id


@pytest.mark.parametrize(("body", "why"), [
    ("[{\"name\": \"get_weather\"", "not JSON"),
    ("[]", "expected a non-empty JSON list"),
    ('[{"name": "launch"}]', 'call 0 names "launch", which is not a declared tool \\(get_weather\\)'),
    ('[{"name": "get_weather", "arguments": "city=Paris"}]', 'a string but not JSON text'),
])
def test_malformed_calls_are_errors_with_the_raw_text(body, why):
    parser = CallParser({"get_weather"})
    events = feed(parser, ["<TOOLCALL>", body, "</TOOLCALL>"])
    error = events[-1]
    assert error.kind == "error" and error.call_id == events[0].call_id
    assert f"raw text: <TOOLCALL>{body}</TOOLCALL>" in error.message
    assert re.search(f"malformed tool call {error.call_id}: .*{why}", error.message)
    # the parser goes on: the next call parses
    assert feed(parser, ['<TOOLCALL>[{"name": "get_weather"}]</TOOLCALL>'])[-1].kind == "done"


def test_unterminated_call_at_the_end():
    parser = CallParser({"f"})
    feed(parser, ["<TOOLCALL>[{\"name\""])
    (error,) = parser.finish()
    assert error.kind == "error" and error.message.endswith('ended before </TOOLCALL>; raw text: <TOOLCALL>[{"name"')
    assert parser.finish() == []


def test_response_text():
    assert response_text('{"temp": 21, "sky": "clear"}') == '<TOOL_RESPONSE>[{"temp":21,"sky":"clear"}]</TOOL_RESPONSE>'
    assert response_text("sunny") == '<TOOL_RESPONSE>["sunny"]</TOOL_RESPONSE>'
    assert response_text("21") == "<TOOL_RESPONSE>[21]</TOOL_RESPONSE>"


def test_queue_is_bounded_and_ordered():
    queue = ResponseQueue(max_tokens=5)
    queue.put([1, 2, 3])
    with pytest.raises(ValueError, match="has 3 response tokens still to read and this output is 3 more; at most 5"):
        queue.put([4, 5, 6])
    queue.put([4, 5])
    assert [queue.take() for _ in range(6)] == [1, 2, 3, 4, 5, None]


def test_channel_skips_forced_frames_and_tracks_open_calls():
    channel = ToolChannel([Tool("f")], lambda text: [ord(c) for c in text])
    assert channel.frame("<TOOLCALL>[{\"name\": \"f\"}]</TOOLCALL>", forced=True) == []  # our own response text
    (delta, done) = channel.frame("<TOOLCALL>[{\"name\": \"f\"}]</TOOLCALL>", forced=False)
    assert channel.submit_output(done.call_id, "ok") == "f"
    assert [channel.next_forced() for _ in range(3)] == [ord(c) for c in '<TO']


# ------------------------------------------------------------------------------------------- the runner


def weather(city: str, unit: Literal["C", "F"] = "C", days: list[int] | None = None) -> dict:
    """The forecast for a city.

    More words that are not the description.

    Args:
        city: the city's name
        unit (str): the temperature unit
    """
    return {"city": city, "unit": unit}


def test_schema_from_hints_and_docstring():
    assert function_tool(weather) == Tool("weather", "The forecast for a city.", {
        "type": "object", "required": ["city"], "properties": {
            "city": {"type": "string", "description": "the city's name"},
            "unit": {"enum": ["C", "F"], "description": "the temperature unit"},
            "days": {"type": "array", "items": {"type": "integer"}}}})
    assert json_schema(dict[str, float], "x") == {"type": "object", "additionalProperties": {"type": "number"}}
    with pytest.raises(ValueError, match="parameter x: type <class 'set'> has no JSON schema here"):
        json_schema(set, "parameter x")


def test_functions_need_hints_and_docstrings():
    def undocumented(city: str) -> str:
        return city

    def untyped(city) -> str:
        """Doc."""

    with pytest.raises(ValueError, match="undocumented has no docstring"):
        function_tool(undocumented)
    with pytest.raises(ValueError, match="untyped: parameter city needs a type hint"):
        function_tool(untyped)


def test_runner_outputs_errors_and_timeouts():
    release = threading.Event()

    def slow(seconds: float) -> str:
        """Waits."""
        release.wait(seconds)
        return "late"

    def broken() -> str:
        """Fails."""
        raise RuntimeError("no network")

    runner = ToolRunner([weather, slow, broken], timeout_s=0.2)
    try:
        assert json.loads(runner.call("weather", '{"city": "Paris"}')) == {"city": "Paris", "unit": "C"}
        assert json.loads(runner.call("broken", "{}")) == {"error": "broken failed: RuntimeError: no network"}
        assert json.loads(runner.call("weather", "[1]")) == {"error": "weather: arguments must be a JSON object"}
        assert "TypeError" in json.loads(runner.call("weather", '{"town": "Paris"}'))["error"]
        started = time.monotonic()
        assert json.loads(runner.call("slow", '{"seconds": 5}')) == {"error": "slow did not finish within 0.2 s"}
        assert time.monotonic() - started < 2
        got = []
        done = threading.Event()
        runner.start("call_1", "weather", '{"city": "Oslo"}', lambda *a: (got.append(a), done.set()))
        assert done.wait(5) and got == [("call_1", '{"city": "Oslo", "unit": "C"}')]
    finally:
        release.set()
        runner.close()


def test_runner_from_module(monkeypatch):
    module = types.ModuleType("my_tools")
    exec("from typing import Literal\n"
         "def get_time(zone: str) -> str:\n    '''The time in a zone.'''\n    return zone\n"
         "def _helper() -> None:\n    pass\n", module.__dict__)
    monkeypatch.setitem(sys.modules, "my_tools", module)
    runner = ToolRunner.from_module("my_tools")
    assert [t.name for t in runner.tools] == ["get_time"]  # public functions of the module only, not Literal
    runner.close()
    with pytest.raises(ValueError, match="cannot import it"):
        ToolRunner.from_module("no_such_tools_module")


def test_the_test_tokenizer_has_the_tool_markers(tiny_checkpoint):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tiny_checkpoint / "tokenizer.json"))
    assert [tokenizer.token_to_id(f"<SPECIAL_{i}>") for i in (20, 21, 22)] == [3, 4, 5]
    assert tokenizer.encode("<SPECIAL_20>x<SPECIAL_21>", add_special_tokens=False).ids[::2] == [3, 4]
    assert tokenizer.get_vocab_size() == 1024 and tokenizer.token_to_id("<SPECIAL_6>") == 6  # the rest in place


def test_serve_tools_flag_loads_a_file_or_names_the_problem(tmp_path):
    from orchestrator.cli import build_parser, tool_runner
    from orchestrator.connect import UsageError
    from tests.conftest import ROOT

    args = build_parser().parse_args(["serve", "--tools", str(ROOT / "examples" / "weather_tools.py"),
                                      "--tool-timeout", "3"])
    runner = tool_runner(args)
    try:
        assert [t.name for t in runner.tools] == ["get_weather", "add"] and runner.timeout_s == 3
        assert runner.tools[0].parameters == {
            "type": "object", "required": ["city"], "properties": {
                "city": {"type": "string", "description": 'the city\'s name, e.g. "Paris"'},
                "unit": {"enum": ["C", "F"], "description": "the temperature unit"}}}
        assert json.loads(runner.call("get_weather", '{"city": "Oslo", "unit": "F"}')) == {
            "city": "Oslo", "sky": "snow", "temperature": 39, "unit": "F"}
    finally:
        runner.close()
    assert tool_runner(build_parser().parse_args(["serve"])) is None
    bad = tmp_path / "bad_tools.py"
    bad.write_text("def f(x):\n    '''Doc.'''\n")
    with pytest.raises(UsageError, match=f"--tools {bad}: tool function f: parameter x needs a type hint"):
        tool_runner(build_parser().parse_args(["serve", "--tools", str(bad)]))
    with pytest.raises(UsageError, match="--tools nowhere.py: cannot import it"):
        tool_runner(build_parser().parse_args(["serve", "--tools", "nowhere.py"]))
