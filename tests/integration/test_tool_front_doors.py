"""Tool calls through both front doors on the tiny checkpoint: the language service runs as a real gRPC server
(so the forced function token crosses the wire), the other engines in-process, and a scripted function head
writes the calls. /v1/realtime and ConversationService give the same call events; the output's token ids are
the next frames' function tokens and the model's next inputs; bad tools, outputs, call ids and malformed calls
get clear errors and the conversation goes on."""

from __future__ import annotations

import asyncio
import json
import queue
import threading

import grpc
import numpy as np
import pytest

from orchestrator.clients import GrpcLanguage
from orchestrator.conversation import SERVICE_NAME, ConversationServicer, registrations
from orchestrator.local import LocalEngines
from orchestrator.realtime import OnlineSessionFactory, RealtimeServer
from protos.voicechat.v1 import conversation_pb2 as pb
from protos.voicechat.v1 import conversation_pb2_grpc, language_pb2
from services.common.server import start_server
from services.common.tensors import to_proto_np
from services.llm.service import build_spec as llm_spec
from tests.realtime.fakes import Client, pcm16_b64
from tests.scripted_head import NoPrefixSpeech, ScriptedLanguage, call_script

N = 1280
HOST = "127.0.0.1"
TOOL = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
CALL = '[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
BAD_CALL = '[{"name": "launch_rocket"}]'
FIRST = 1  # the frame the scripted call starts at; the malformed one starts after the response was read back
OUTPUT = '{"temp_c": 21}'
EXAMPLE_OUTPUT = '{"city": "Paris", "sky": "clear", "temp_c": 21}'  # what the example client answers


class Stack:
    """The llm service over gRPC, the conversation service and the realtime gateway on one background loop."""

    def __init__(self, model):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.engines = LocalEngines(model)
        self.running = []
        self.run(self._start(model))

    def run(self, coroutine):
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(120)

    async def _start(self, model):
        spec = llm_spec(model)
        self.llm_close = spec.close
        llm = await start_server(spec.registrations, spec.service_names, host=HOST, port=0)
        await llm.become_ready(spec.load)
        self.running.append(llm)
        self.tokenizer = self.engines.engines["llm"].tokenizer
        call = call_script(self.tokenizer, CALL, FIRST)
        self.bad_first = max(call) + len(response_ids(self, EXAMPLE_OUTPUT)) + 8  # after the longest answer
        script = {**call, **call_script(self.tokenizer, BAD_CALL, self.bad_first)}
        self.frames = max(script) + 2
        self.clients = self.engines.clients()
        self.grpc_language = GrpcLanguage(f"{HOST}:{llm.port}", prefix_precision=language_pb2.PREFIX_PRECISION_BFLOAT16)
        self.clients.language = ScriptedLanguage(self.grpc_language, script)
        self.clients.speech = NoPrefixSpeech(self.clients.speech)  # the tests read no audio
        self.conversation = ConversationServicer(self.clients, model, max_sessions=2, pipelined=False)
        running = await start_server(registrations(self.conversation), [SERVICE_NAME], host=HOST, port=0)
        await running.become_ready(None)
        self.running.append(running)
        self.address = f"{HOST}:{running.port}"
        self.realtime = await RealtimeServer(OnlineSessionFactory(self.clients, model), max_sessions=2).start()

    def close(self):
        async def stop():
            await self.realtime.stop()
            for running in self.running:
                await running.stop(0)

        self.run(stop())
        self.grpc_language.channel.close()
        self.llm_close()
        self.engines.close()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def stack(tiny_checkpoint):
    stack = Stack(tiny_checkpoint)
    yield stack
    stack.close()


def frame(t: int) -> np.ndarray:
    return np.random.default_rng(t).uniform(-0.1, 0.1, N).astype(np.float32)


def response_ids(stack, output: str = OUTPUT) -> list[int]:
    return stack.tokenizer.encode(f"<TOOL_RESPONSE>[{json.dumps(json.loads(output), separators=(',', ':'))}]"
                                  "</TOOL_RESPONSE>", add_special_tokens=False).ids


def check_round_trip(stack, calls, deltas, functions, fused, output_frame, frames):
    """What both doors must show: one call with its fields, its text as deltas, the response read back one id
    per frame from the frame the output was queued at (model input included), then the malformed call's error."""
    done = calls[0]
    last = FIRST + len(call_script(stack.tokenizer, CALL, 0)) - 1
    assert (done["name"], done["arguments"], done["frame_index"]) == ("get_weather", '{"city":"Paris"}', last)
    assert "".join(d["delta"] for d in deltas if d["call_id"] == done["call_id"]) == CALL
    response = response_ids(stack)
    assert output_frame == last + 1
    assert [functions[t] for t in range(output_frame, output_frame + len(response))] == response
    steps = len(fused) - frames  # the spy saw this session's `frames` steps last
    assert fused[steps + output_frame + 1: steps + output_frame + 1 + len(response)] == response


def test_realtime_round_trip(stack, fused):
    frames = stack.frames

    async def scenario():
        client = await Client.open(stack.realtime.url)
        created = await client.recv()
        await client.send({"type": "session.update", "session": {"tools": [{**TOOL, "type": "web"}]}})
        refused = await client.recv()
        await client.send({"type": "session.update", "session": {"instructions": "Be brief.", "tools": [TOOL],
                                                                 "tool_choice": "auto"}})
        events = [created, refused, await client.recv(60)]  # the listed tools make a longer prompt to prefill
        await client.send({"type": "conversation.item.create",
                           "item": {"type": "function_call_output", "call_id": "call_0", "output": "1"}})
        events.append(await client.recv())
        for t in range(frames):
            await client.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(frame(t))})
            events += await client.until("response.audio.delta", timeout=60)
            if events[-2]["type"] == "response.function_call_arguments.done":
                call_id = events[-2]["call_id"]
                await client.send({"type": "conversation.item.create", "item": {
                    "type": "function_call_output", "call_id": call_id, "output": {"temp_c": 21}}})
                events.append(await client.recv())
                await client.send({"type": "conversation.item.create", "item": {
                    "type": "function_call_output", "call_id": call_id, "output": OUTPUT}})
                events.append(await client.recv())
        await client.send({"type": "session.update", "session": {"tools": []}})
        events.append(await client.recv())
        await client.send({"type": "input_audio_buffer.commit", "pad_partial": False})
        events += await client.rest(timeout=60)
        return events

    events = asyncio.run_coroutine_threadsafe(scenario(), stack.loop).result(300)
    errors = [e["error"] for e in events if e["type"] == "error"]
    assert errors[0]["code"] == "session_initialization_failed"
    assert errors[0]["message"] == 'session.tools[0].type must be "function", got "web"'
    updated = events[2]["session"]
    assert (updated["tools"], updated["tool_choice"], updated["instructions"]) == ([TOOL], "auto", "Be brief.")
    assert errors[1] == {"code": "invalid_request", "message": 'unknown call_id "call_0": no call of this session '
                                                               "awaits an output by that id (awaiting: none)"}
    assert errors[2]["code"] == "invalid_request" and "`output` must be a string" in errors[2]["message"]
    calls = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert len(calls) == 1
    (created,) = [e for e in events if e["type"] == "conversation.item.created"]
    assert created["item"] == {"type": "function_call_output", "call_id": calls[0]["call_id"], "name": "get_weather",
                               "output": OUTPUT}
    functions = {e["frame_index"]: e["token_id"] for e in events if e["type"] == "response.function.delta"}
    deltas = [e for e in events if e["type"] == "response.function_call_arguments.delta"]
    check_round_trip(stack, calls, deltas, functions, fused, created["frame_index"], frames)
    # the scripted bad call: an error quoting it, and the session went on to its last frame and response.done
    assert errors[4]["code"] == "invalid_request"  # the tools cannot change inside the live session
    assert errors[4]["message"].endswith("instructions and tools cannot change inside a live session)")
    assert errors[3]["code"] == "invalid_function_call"
    assert errors[3]["message"].endswith(f"raw text: <SPECIAL_20>{BAD_CALL}<SPECIAL_21>")
    assert 'names "launch_rocket", which is not a declared tool (get_weather)' in errors[3]["message"]
    assert events[-1] == {**events[-1], "type": "response.done", "frame_index": frames}
    print("\nrealtime event sequence:")
    for e in fold(events):
        print("  ", e)


STREAMS = ("response.audio.delta", "response.function.delta", "response.text.delta",
           "conversation.item.input_audio_transcription.delta")


def fold(events) -> list[str]:
    """The events as short lines for `pytest -s`: the per-frame stream deltas left out (counted at the end),
    each run of call deltas as one line with its frames and joined text."""
    lines, run, counts = [], None, {kind: 0 for kind in STREAMS}
    for e in events:
        kind = e["type"]
        if kind in STREAMS:
            counts[kind] += 1
            continue
        if kind == "response.function_call_arguments.delta":
            if run is None:
                run = {"type": kind, "call_id": e["call_id"], "frames": [e["frame_index"]] * 2, "text": ""}
                lines.append(run)
            run["frames"][1], run["text"] = e["frame_index"], run["text"] + e["delta"]
            continue
        run = None
        lines.append({k: v for k, v in e.items() if k not in ("event_id", "session")})
    return [json.dumps(line)[:240] for line in lines] + [f"{kind} x{n}" for kind, n in counts.items()]


class Conversation:
    """A Converse stream driven message by message."""

    def __init__(self, address):
        self.channel = grpc.insecure_channel(address)
        self.requests: queue.Queue = queue.Queue()
        stub = conversation_pb2_grpc.ConversationServiceStub(self.channel)
        self.responses = stub.Converse(iter(self.requests.get, None), timeout=300)

    def send(self, **message):
        self.requests.put(pb.ConverseRequest(**message))

    def until(self, kind: str) -> list:
        got = []
        for response in self.responses:
            got.append(response)
            if response.WhichOneof("event") == kind:
                return got
        return got

    def close(self):
        self.requests.put(None)
        rest = list(self.responses)
        self.channel.close()
        return rest


def test_grpc_round_trip(stack, fused):
    frames = stack.frames
    tool = pb.Tool(name=TOOL["name"], description=TOOL["description"], parameters_json=json.dumps(TOOL["parameters"]))
    conversation = Conversation(stack.address)
    conversation.send(configure=pb.Configure(tools=[pb.Tool(name="get weather")]))
    conversation.send(configure=pb.Configure(tools=[pb.Tool(name="f", parameters_json="{")]))
    conversation.send(configure=pb.Configure(system_prompt="Be brief.", tools=[tool]))
    events = conversation.until("ready")
    for t in range(frames):
        conversation.send(audio=pb.AudioIn(float32=to_proto_np(frame(t))))
        got = conversation.until("audio")
        events += got
        done = [r.function_call_done for r in got if r.WhichOneof("event") == "function_call_done"]
        if done:
            answer = pb.FunctionCallOutput(call_id="call_nope", output=OUTPUT)
            conversation.send(function_call_output=answer)
            events += conversation.until("error")
            conversation.send(function_call_output=pb.FunctionCallOutput(call_id=done[0].call_id, output=OUTPUT))
            events += conversation.until("function_call_output")
    conversation.send(flush=pb.Flush(pad_partial=False))
    events += conversation.close()
    kinds = [r.WhichOneof("event") for r in events]
    errors = [r.error for r in events if r.WhichOneof("event") == "error"]
    assert [(pb.ErrorCode.Name(e.code), e.message) for e in errors[:2]] == [
        ("ERROR_CODE_SESSION_INITIALIZATION_FAILED", 'Configure.tools[0].name must be 1-64 letters, digits, \'_\' or '
                                                     '\'-\', got "get weather"'),
        ("ERROR_CODE_SESSION_INITIALIZATION_FAILED", "Configure.tools[0].parameters_json is not JSON (Expecting "
                                                     "property name enclosed in double quotes: line 1 column 2 (char "
                                                     "1))")]
    assert pb.ErrorCode.Name(errors[2].code) == "ERROR_CODE_INVALID_REQUEST"
    assert errors[2].message.startswith('unknown call_id "call_nope"')
    calls = [{"call_id": r.function_call_done.call_id, "name": r.function_call_done.name,
              "arguments": r.function_call_done.arguments, "frame_index": r.function_call_done.frame_index}
             for r in events if r.WhichOneof("event") == "function_call_done"]
    deltas = [{"call_id": r.function_call_delta.call_id, "delta": r.function_call_delta.delta}
              for r in events if r.WhichOneof("event") == "function_call_delta"]
    functions = {r.function.frame_index: r.function.token_id for r in events if r.WhichOneof("event") == "function"}
    (added,) = [r.function_call_output for r in events if r.WhichOneof("event") == "function_call_output"]
    assert (added.call_id, added.name, added.output) == (calls[0]["call_id"], "get_weather", OUTPUT)
    check_round_trip(stack, calls, deltas, functions, fused, added.frame_index, frames)
    assert pb.ErrorCode.Name(errors[3].code) == "ERROR_CODE_INVALID_FUNCTION_CALL"
    assert errors[3].message.endswith(f"raw text: <SPECIAL_20>{BAD_CALL}<SPECIAL_21>")
    assert kinds[-1] == "done" and events[-1].done.frame_index == frames


def test_the_example_tool_client_answers_the_call(stack, fused):
    import importlib.util
    import io

    from tests.conftest import ROOT

    spec = importlib.util.spec_from_file_location("realtime_tool_client", ROOT / "examples" / "realtime_tool_client.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    samples = np.concatenate([frame(t) for t in range(stack.frames)])
    out = io.StringIO()
    status = asyncio.run_coroutine_threadsafe(example.converse(stack.realtime.url, samples, "Be brief.", out),
                                              stack.loop).result(300)
    lines = out.getvalue().splitlines()
    assert status == 0
    call_id = lines[0].split()[1]
    assert lines[:2] == [f'[call] {call_id} get_weather {{"city":"Paris"}}', f"[answer] {call_id} {EXAMPLE_OUTPUT}"]
    assert lines[2].startswith("[error] invalid_function_call: malformed tool call")
    # the answer was read back: its ids entered the model one per frame, in order
    response = response_ids(stack, EXAMPLE_OUTPUT)
    runs = [i for i in range(len(fused)) if fused[i: i + len(response)] == response]
    assert len(runs) == 1
