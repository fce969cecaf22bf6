"""A tool call's full round trip through an OnlineSession on the tiny checkpoint's engines (in-process): the
scripted function head writes a call, the session reports it, the output's token ids enter the language model as
its function-channel input one per frame, and the session goes on; the server-side runner does the same by
itself. Bad outputs and unknown call ids get clear errors and change nothing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from orchestrator.local import LocalEngines
from orchestrator.session import OnlineSession
from orchestrator.text import TextDecoder
from orchestrator.tool_runner import ToolRunner
from orchestrator.tools import Tool, render_system_prompt
from services.common.config import VoiceChatConfig
from tests.scripted_head import NoPrefixSpeech, ScriptedLanguage, call_script

N = 1280
WEATHER = Tool("get_weather", "The current weather in a city.",
               {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
CALL = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
FIRST = 2  # the frame the scripted call starts at


def get_weather(city: str) -> dict:
    """The current weather in a city.

    Args:
        city: the city's name
    """
    return {"city": city, "temp_c": 21}


@pytest.fixture(scope="module")
def engines(tiny_checkpoint):
    engines = LocalEngines(tiny_checkpoint)
    yield engines
    engines.close()


def open_session(engines, checkpoint, script, prompts=None, pipelined=False, **kwargs) -> OnlineSession:
    config = VoiceChatConfig.load(checkpoint)
    decoder = TextDecoder(checkpoint, config)
    clients = engines.clients()
    scripted = ScriptedLanguage(clients.language, script)
    if prompts is not None:
        opened = scripted.open
        scripted.open = lambda prompt: (prompts.append(prompt), opened(prompt))[1]
    clients.language = scripted
    clients.speech = NoPrefixSpeech(clients.speech)  # these tests read no audio
    return OnlineSession(clients, config, decoder, system_prompt="Be brief.", pipelined=pipelined, **kwargs)


def push_frames(session, frames: int, start: int = 0) -> list:
    rng = np.random.default_rng(start)
    events = []
    for _ in range(frames):
        events += session.push_audio(rng.uniform(-0.1, 0.1, N).astype(np.float32), 16_000)
    return events


def of(events, kind):
    return [e for e in events if e.kind == kind]


def test_client_tool_round_trip(engines, tiny_checkpoint, fused):
    tokenizer = engines.engines["llm"].tokenizer
    script = call_script(tokenizer, CALL, FIRST)
    last = max(script)
    prompts: list[str] = []
    session = open_session(engines, tiny_checkpoint, script, prompts, tools=[WEATHER])
    assert prompts == [render_system_prompt("Be brief.", [WEATHER])]

    events = push_frames(session, last + 1)
    deltas, done = of(events, "function_call_delta"), of(events, "function_call_done")
    assert len(done) == 1 and not of(events, "function_call_error")
    call = done[0]
    assert (call.name, json.loads(call.arguments), call.frame_index) == ("get_weather", {"city": "Paris"}, last)
    assert call.arguments == '{"city":"Paris"}'
    assert all(d.call_id == call.call_id for d in deltas)
    assert "".join(d.delta for d in deltas) == CALL  # the call's text, frame by frame, markers left out
    assert [d.frame_index for d in deltas] == list(range(FIRST + 1, last))  # a delta per token of the text

    # the answer: its tokens become the function channel's next picks and the model's next inputs
    response = tokenizer.encode('<TOOL_RESPONSE>[{"temp_c":21}]</TOOL_RESPONSE>', add_special_tokens=False).ids
    answered = session.submit_function_output(call.call_id, '{"temp_c": 21}')
    assert [(e.kind, e.call_id, e.name, e.output, e.frame_index) for e in answered] == [
        ("function_call_output", call.call_id, "get_weather", '{"temp_c": 21}', last + 1)]
    steps_before = len(fused)
    events = push_frames(session, len(response) + 3, start=1)
    function = {e.frame_index: e.token_id for e in of(events, "function_delta")}
    forced_frames = range(last + 1, last + 1 + len(response))
    assert [function[t] for t in forced_frames] == response  # one per 80 ms frame, in order
    # frame t's step fuses frame t-1's function token: the response's ids, then the head's own picks again
    assert fused[steps_before + 1: steps_before + 1 + len(response)] == response
    assert not of(events, "function_call_delta") and not of(events, "function_call_done")

    # the session goes on: every frame's audio, then done
    assert [e.frame_index for e in of(events, "audio")] == list(range(last + 1, last + 4 + len(response)))
    tail = session.flush(pad_partial=False)
    assert tail[-1].kind == "done" and tail[-1].frame_index == last + 4 + len(response)


def test_bad_outputs_and_unknown_call_ids(engines, tiny_checkpoint):
    tokenizer = engines.engines["llm"].tokenizer
    script = call_script(tokenizer, CALL, 0)
    session = open_session(engines, tiny_checkpoint, script, tools=[WEATHER])
    call = of(push_frames(session, max(script) + 1), "function_call_done")[0]
    with pytest.raises(ValueError, match=r'unknown call_id "call_nope": no call of this session awaits an output '
                                         rf"by that id \(awaiting: {call.call_id}\)"):
        session.submit_function_output("call_nope", "x")
    with pytest.raises(ValueError, match="function_call_output needs `call_id`: the id of a call this session"):
        session.submit_function_output({"id": call.call_id}, "x")  # any JSON value may arrive
    with pytest.raises(ValueError, match="`output` must be a string"):
        session.submit_function_output(call.call_id, {"temp": 21})
    with pytest.raises(ValueError, match=r"this output is \d+ more; at most 1024 may wait"):
        session.submit_function_output(call.call_id, "x" * 5000)
    assert len(session._tools.queue) == 0  # nothing of a refused output is queued; the call still awaits one
    session.submit_function_output(call.call_id, "sunny")
    with pytest.raises(ValueError, match="unknown call_id"):  # answered once
        session.submit_function_output(call.call_id, "sunny")
    session.close()


def test_no_tools_and_tool_choice_none(engines, tiny_checkpoint):
    tokenizer = engines.engines["llm"].tokenizer
    script = call_script(tokenizer, CALL, 0)
    prompts: list[str] = []
    session = open_session(engines, tiny_checkpoint, script, prompts, tools=[WEATHER], tool_choice="none")
    events = push_frames(session, max(script) + 1)
    assert prompts == ["Be brief."]  # not listed
    assert not [e for e in events if e.kind.startswith("function_call")]  # nor parsed: the raw deltas only
    assert "".join(e.delta for e in of(events, "function_delta")).endswith(f"<SPECIAL_20>{CALL}<SPECIAL_21>")
    with pytest.raises(ValueError, match="this session declares no tools"):
        session.submit_function_output("call_x", "1")
    session.close()


def test_server_runner_round_trip(engines, tiny_checkpoint, fused):
    tokenizer = engines.engines["llm"].tokenizer
    script = call_script(tokenizer, CALL, 0)
    runner = ToolRunner([get_weather], timeout_s=5)
    try:
        session = open_session(engines, tiny_checkpoint, script, runner=runner)
        events = push_frames(session, max(script) + 1)
        call = of(events, "function_call_done")[0]
        with pytest.raises(ValueError, match="runs on the server"):
            session.submit_function_output(call.call_id, "1")
        later: list = []
        while not of(later, "function_call_output") and len(later) < 2000:  # the runner's thread answers
            later += push_frames(session, 1, start=2)
        outputs = of(later, "function_call_output")
        assert [(e.call_id, e.name, json.loads(e.output)) for e in outputs] == [
            (call.call_id, "get_weather", {"city": "Paris", "temp_c": 21})]
        response = tokenizer.encode('<TOOL_RESPONSE>[{"city":"Paris","temp_c":21}]</TOOL_RESPONSE>',
                                    add_special_tokens=False).ids
        later += push_frames(session, len(response) + 1, start=3)
        # the frame running when the result came may have sent its step already: the ids start there or after
        function = {e.frame_index: e.token_id for e in of(later, "function_delta")}
        reported = outputs[0].frame_index
        starts = [t for t in (reported, reported + 1)
                  if [function.get(t + i) for i in range(len(response))] == response]
        assert len(starts) == 1
        session.close()
    finally:
        runner.close()


def test_the_servers_tools_count_toward_the_limit_and_names_stay_distinct(engines, tiny_checkpoint):
    runner = ToolRunner([get_weather])
    try:
        five = [Tool(f"t{i}") for i in range(5)]
        with pytest.raises(ValueError, match=r"6 tools declared \(1 by the server\); at most 5 are allowed"):
            open_session(engines, tiny_checkpoint, {}, tools=five, runner=runner)
        with pytest.raises(ValueError, match="get_weather is declared more than once"):
            open_session(engines, tiny_checkpoint, {}, tools=[WEATHER], runner=runner)
    finally:
        runner.close()


def test_pipelined_session_reads_the_answer_back_in_order(engines, tiny_checkpoint):
    tokenizer = engines.engines["llm"].tokenizer
    script = call_script(tokenizer, CALL, 0)
    session = open_session(engines, tiny_checkpoint, script, pipelined=True, tools=[WEATHER])
    events = push_frames(session, max(script) + 1) + session.drain()
    call = of(events, "function_call_done")[0]
    (added,) = session.submit_function_output(call.call_id, "sunny")
    response = tokenizer.encode('<TOOL_RESPONSE>["sunny"]</TOOL_RESPONSE>', add_special_tokens=False).ids
    events = push_frames(session, len(response) + 2, start=1) + session.drain()
    function = [e.token_id for e in of(events, "function_delta") if e.frame_index >= added.frame_index]
    assert function[: len(response)] == response  # frames sent after the answer was queued take its ids in order
    assert session.flush(pad_partial=False)[-1].kind == "done"
