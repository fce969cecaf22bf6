"""The /v1/realtime protocol over a fake session, with a real `websockets` client against a server on port 0:
messages and events field for field, every error code and its triggers, the limits, the session slots and
their release, and the checks on the upgrade request."""

from __future__ import annotations

import asyncio
import base64
import re

import numpy as np
import pytest
from websockets.exceptions import InvalidStatus

from orchestrator.realtime import RealtimeLimits, RealtimeServer, decode_pcm16, encode_pcm16, session_options
from tests.realtime.fakes import OUT, VARYING_FIELDS, Client, FakeFactory, N, pcm16_b64, serve, wait_for

EVENT_ID = re.compile(r"^event_[0-9a-f]{16}$")
SESSION_ID = re.compile(r"^sess_[0-9a-f]{16}$")
PCM16_16K = {"type": "pcm16", "sample_rate": 16000}
PCM16_22K = {"type": "pcm16", "sample_rate": 22050}


def ramp(n: int, start: int = 0) -> np.ndarray:
    """n distinct PCM16-exact samples."""
    return ((np.arange(start, start + n) % 20000) - 10000).astype(np.float32) / 32768.0


# ------------------------------------------------------------------------------------------ the happy path


def test_a_conversation_field_for_field():
    factory = FakeFactory()
    audio = ramp(3000)

    async def scenario(server: RealtimeServer):
        client = await Client.open(server.url)
        created = await client.recv()
        await client.send({"type": "session.update",
                           "session": {"system_prompt": "Be brief.", "seed": 3, "model": "anything"}})
        updated = await client.recv()
        await client.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(audio), "sample_rate": 16000})
        appended = [await client.recv() for _ in range(6)]  # two whole frames: 3 events each
        await client.send({"type": "input_audio_buffer.commit"})
        rest = await client.rest()
        assert server.live_sessions == 0  # released before the close frame reached the client
        return created, updated, appended, rest, client.close_code

    created, updated, appended, rest, code = serve(scenario, factory)
    assert created["type"] == "session.created" and EVENT_ID.match(created["event_id"])
    assert SESSION_ID.match(created["session"]["id"])
    assert created["session"] == {"id": created["session"]["id"], "state": "configuring",
                                  "input_audio_format": PCM16_16K, "output_audio_format": PCM16_22K}
    assert updated["session"] == {"id": created["session"]["id"], "state": "ready", "model": "fake-model",
                                  "frame_samples": 1280, "input_audio_format": PCM16_16K,
                                  "output_audio_format": PCM16_22K}
    session = factory.sessions[0]
    assert session.options == {"system_prompt": "Be brief.", "seed": 3, "max_streaming_seconds": 600.0}
    # one push per 1280-sample slice, samples decoded as int16 / 32768 exactly
    assert [len(p) for p in session.pushes] == [1280, 1280, 440]
    assert np.array_equal(np.concatenate(session.pushes), audio)
    assert len(session.threads) == 1 and next(iter(session.threads)).startswith("realtime-sess_")
    assert [e["type"] for e in appended] == ["conversation.item.input_audio_transcription.delta",
                                             "response.text.delta", "response.audio.delta"] * 2
    transcript, text, sound = appended[3:]
    assert transcript == {"type": transcript["type"], "event_id": transcript["event_id"], "frame_index": 1,
                          "delta": "w", "transcript": "ww"}
    assert text == {"type": "response.text.delta", "event_id": text["event_id"], "frame_index": 1,
                    "token_id": 101, "delta": "a", "text": "aa"}
    assert {k: v for k, v in sound.items() if k not in ("event_id", "delta", "latency_ms")} == {
        "type": "response.audio.delta", "frame_index": 1, "format": "pcm16", "sample_rate": 22050, "channels": 1,
        "audio_codes": list(range(1, 32))}
    # the server's latency against a live microphone: frame 0 goes out after its audio came in, and frame 1 is
    # due 80 ms after frame 0, so its latency is at least frame 0's less those 80 ms
    first_latency = appended[2]["latency_ms"]
    assert first_latency >= 0 and sound["latency_ms"] >= first_latency - 80.0
    pcm = np.frombuffer(base64.b64decode(sound["delta"]), "<i2")
    level = float(audio[N]) * 2.0
    expected = np.full(OUT, np.round(np.clip(level, -1, 1) * 32767), np.int16)
    expected[:4] = (-32767, -32767, 16384, 32767)  # round(clip(x, -1, 1) * 32767)
    assert np.array_equal(pcm, expected)
    # commit: committed, the padded partial frame's events, done, close 1000
    assert [e["type"] for e in rest] == ["input_audio_buffer.committed",
                                         "conversation.item.input_audio_transcription.delta",
                                         "response.text.delta", "response.audio.delta", "response.done"]
    assert rest[-1]["frame_index"] == 3
    assert np.array_equal(session.frames[2][:440], audio[2560:]) and not session.frames[2][440:].any()
    assert code == 1000
    assert session.closed and session.close_calls == 1
    ids = [e["event_id"] for e in [created, updated, *appended, *rest]]
    assert all(EVENT_ID.match(i) for i in ids) and len(set(ids)) == len(ids)


def test_appends_of_any_size_make_the_same_frames():
    audio = ramp(5 * N + 77)

    def run(sizes):
        factory = FakeFactory()

        async def scenario(server):
            client = await Client.open(server.url)
            await client.configure()
            start = 0
            for size in sizes:
                await client.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(audio[start:start + size])})
                start += size
            await client.send({"type": "input_audio_buffer.commit", "pad_partial": False})
            return await client.rest()

        events = serve(scenario, factory)
        return events, factory.sessions[0]

    whole, session_whole = run([len(audio)])
    pieces, session_pieces = run([1, 1279, 3000, 17, len(audio) - 4297])
    strip = [{k: v for k, v in e.items() if k not in VARYING_FIELDS} for e in whole]
    assert strip == [{k: v for k, v in e.items() if k not in VARYING_FIELDS} for e in pieces]
    assert whole[-1] == {**whole[-1], "type": "response.done", "frame_index": 5}  # pad_partial false: 77 dropped
    assert all(len(p) <= N for p in session_pieces.pushes)
    assert np.array_equal(np.concatenate(session_whole.frames), np.concatenate(session_pieces.frames))


def test_cancel_and_response_cancel_end_with_cancelled_and_1000():
    for kind in ("session.cancel", "response.cancel"):
        factory = FakeFactory()

        async def scenario(server, kind=kind):
            client = await Client.open(server.url)
            await client.configure()
            await client.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(ramp(N + 5))})
            await client.until("response.audio.delta")
            await client.send({"type": kind})
            rest = await client.rest()
            assert server.live_sessions == 0
            return rest, client.close_code

        rest, code = serve(scenario, factory)
        assert [e["type"] for e in rest] == ["response.cancelled"] and rest[0]["frame_index"] == 1
        assert code == 1000 and factory.sessions[0].closed


def test_ping_pong_before_and_after_configuration():
    async def scenario(server):
        client = await Client.open(server.url)
        await client.recv()
        await client.send({"type": "session.ping"})
        first = await client.recv()
        await client.send({"type": "session.update"})
        await client.recv()
        await client.send({"type": "session.ping"})
        return first, await client.recv()

    first, second = serve(scenario)
    assert first["type"] == second["type"] == "session.pong" and EVENT_ID.match(first["event_id"])


# ------------------------------------------------------------------------------------- invalid_request


def test_everything_but_update_and_ping_before_update_is_invalid_request():
    async def scenario(server):
        client = await Client.open(server.url)
        await client.recv()
        answers = []
        for message in ({"type": "input_audio_buffer.append", "audio": pcm16_b64(ramp(N))},
                        {"type": "input_audio_buffer.commit"}, {"type": "session.cancel"}, {"type": "no.such"},
                        {"no": "type"}):
            await client.send(message)
            answers.append(await client.recv())
        await client.send({"type": "session.update"})
        answers.append(await client.recv())
        return answers

    answers = serve(scenario)
    for error in answers[:-1]:
        assert error["type"] == "error" and error["error"] == {"code": "invalid_request",
                                                               "message": "send session.update before audio"}
    assert answers[-1]["type"] == "session.updated"


def test_second_update_and_unknown_types_after_update_are_invalid_request():
    factory = FakeFactory()

    async def scenario(server):
        client = await Client.open(server.url)
        await client.configure(seed=1)
        answers = []
        for message in ({"type": "session.update", "session": {"seed": 2}}, {"type": "conversation.item.create"},
                        {"type": 5}):
            await client.send(message)
            answers.append(await client.recv())
        await client.send({"type": "session.ping"})
        answers.append(await client.recv())
        return answers

    answers = serve(scenario, factory)
    assert [a["error"]["code"] for a in answers[:3]] == ["invalid_request"] * 3
    assert "already configured" in answers[0]["error"]["message"]
    assert "conversation.item.create" in answers[1]["error"]["message"]
    assert answers[3]["type"] == "session.pong"
    assert len(factory.sessions) == 1 and factory.sessions[0].options["seed"] == 1


def bad_frame_then_ping(frame) -> tuple[dict, dict]:
    """A configured session is sent `frame`, then a ping: (the answer to the frame, the answer to the ping)."""

    async def scenario(server):
        client = await Client.open(server.url)
        await client.configure()
        await client.send(frame)
        error = await client.recv()
        await client.send({"type": "session.ping"})
        return error, await client.recv()

    return serve(scenario)


@pytest.mark.parametrize("frame", ["{not json", "[1, 2]", "42", '"text"', "null", b"\x00\x01binary"])
def test_frames_that_are_not_json_objects_are_invalid_request_and_the_loop_goes_on(frame):
    error, pong = bad_frame_then_ping(frame)
    assert error["type"] == "error" and error["error"]["code"] == "invalid_request"
    assert pong["type"] == "session.pong"


@pytest.mark.parametrize("frame", ["[" * 50_000 + "]" * 50_000, '{"a":' * 50_000 + "0" + "}" * 50_000])
def test_deeply_nested_json_is_invalid_request_and_the_loop_goes_on(frame):
    """json.loads raises RecursionError (not a ValueError) past the recursion limit; it used to end the
    connection with 1011 instead of an error event."""
    error, pong = bad_frame_then_ping(frame)
    assert error["type"] == "error" and error["error"] == {
        "code": "invalid_request",
        "message": "the frame's JSON nests too deeply to parse; every client message is a JSON object"}
    assert pong["type"] == "session.pong"


# -------------------------------------------------------------------------- session_initialization_failed


@pytest.mark.parametrize("session", [{"seed": -1}, {"seed": 1.5}, {"seed": "0"}, {"seed": True},
                                     {"max_streaming_seconds": 0}, {"max_streaming_seconds": -3},
                                     {"max_streaming_seconds": "10"}, {"system_prompt": 7}, {"model": 3}, []])
def test_invalid_session_fields_fail_initialization_and_the_connection_may_retry(session):
    factory = FakeFactory()

    async def scenario(server):
        client = await Client.open(server.url)
        await client.recv()
        await client.send({"type": "session.update", "session": session})
        error = await client.recv()
        await client.send({"type": "session.update", "session": {"seed": 0}})
        return error, await client.recv()

    error, updated = serve(scenario, factory)
    assert error["type"] == "error" and error["error"]["code"] == "session_initialization_failed"
    assert updated["type"] == "session.updated" and len(factory.sessions) == 1


def test_a_failing_factory_is_session_initialization_failed():
    factory = FakeFactory(fail_open=RuntimeError("the tts service at x:3 is unavailable"))

    async def scenario(server):
        client = await Client.open(server.url)
        await client.recv()
        await client.send({"type": "session.update"})
        error = await client.recv()
        factory.fail_open = None
        await client.send({"type": "session.update"})
        return error, await client.recv()

    error, updated = serve(scenario, factory)
    assert error["error"] == {"code": "session_initialization_failed",
                              "message": "RuntimeError: the tts service at x:3 is unavailable"}
    assert updated["type"] == "session.updated"


def test_session_options_clamp_and_defaults():
    limits = RealtimeLimits(max_session_seconds=10)
    assert session_options(None, limits) == {"system_prompt": None, "seed": 0, "max_streaming_seconds": 10.0}
    assert session_options({"max_streaming_seconds": 99}, limits)["max_streaming_seconds"] == 10.0
    assert session_options({"max_streaming_seconds": 2.5, "seed": None}, limits)["max_streaming_seconds"] == 2.5


# ------------------------------------------------------------------------------------------ inference_error


@pytest.mark.parametrize("message, fragment", [
    ({"audio": "not base64!"}, "not valid base64"),
    ({"audio": base64.b64encode(b"\x01\x02\x03").decode()}, "even byte count"),
    ({}, "base64 string"),
    ({"audio": 12}, "base64 string"),
    ({"audio": pcm16_b64(ramp(10)), "sample_rate": 16000.5}, "integer"),
    ({"audio": pcm16_b64(ramp(10)), "sample_rate": "16000"}, "integer"),
    ({"audio": pcm16_b64(ramp(10)), "sample_rate": True}, "integer"),
    ({"audio": pcm16_b64(ramp(10)), "sample_rate": 44100}, "44100 Hz"),
    ({"audio": "", "sample_rate": 8000}, "8000 Hz"),
])
def test_bad_appends_are_inference_errors_and_the_loop_goes_on(message, fragment):
    factory = FakeFactory()

    async def scenario(server):
        client = await Client.open(server.url)
        await client.configure()
        await client.send({"type": "input_audio_buffer.append", **message})
        error = await client.recv()
        await client.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(ramp(N))})
        return error, await client.until("response.audio.delta")

    error, events = serve(scenario, factory)
    assert error["type"] == "error" and error["error"]["code"] == "inference_error"
    assert fragment in error["error"]["message"]
    assert events[-1]["frame_index"] == 0


def test_a_model_failure_stops_the_append_at_its_slice_and_commit_still_ends_with_done():
    factory = FakeFactory(fail_at=1)

    async def scenario(server):
        client = await Client.open(server.url)
        await client.configure()
        await client.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(ramp(4 * N))})
        events = await client.until("error")
        events.append(await client.recv())
        for _ in range(5):  # audio after the failure: dropped, not answered with an error each
            await client.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(ramp(N))})
        await client.send({"type": "input_audio_buffer.commit"})
        return events, await client.rest(), client.close_code, server.metrics

    events, rest, code, metrics = serve(scenario, factory)
    assert [e["type"] for e in events[:3]] == ["conversation.item.input_audio_transcription.delta",
                                               "response.text.delta", "response.audio.delta"]
    fault = "ServiceError: the llm service at x:1 stopped responding (UNAVAILABLE: gone)"
    assert events[3]["error"] == {"code": "inference_error", "message": fault}
    assert len(factory.sessions[0].pushes) == 2  # the failing slice was the last one pushed
    assert events[4]["error"] == {"code": "session_closed", "message": (
        f"this session is closed because of the error above ({fault}); commit to end it, then open a new connection")}
    assert [e["type"] for e in rest] == ["input_audio_buffer.committed", "response.done"]
    assert metrics.value("voicechat_errors_total", code="inference_error") == 1  # the fault, once
    assert metrics.value("voicechat_errors_total", code="session_closed") is None
    assert rest[-1]["frame_index"] == 1 and code == 1000


# ------------------------------------------------------------------------------------------------ limits


def test_max_session_seconds_clamps_the_session_and_ends_the_stream_with_inference_error():
    factory = FakeFactory()
    limits = RealtimeLimits(max_session_seconds=0.24)  # three frames

    async def scenario(server):
        client = await Client.open(server.url)
        await client.configure(max_streaming_seconds=1000)
        await client.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(ramp(5 * N))})
        events = await client.until("error")
        await client.send({"type": "input_audio_buffer.commit"})
        return events, await client.rest(), client.close_code

    events, rest, code = serve(scenario, factory, limits=limits)
    assert factory.sessions[0].options["max_streaming_seconds"] == 0.24
    assert [e["frame_index"] for e in events if e["type"] == "response.audio.delta"] == [0, 1, 2]
    assert events[-1]["error"]["code"] == "inference_error"
    assert "max_streaming_seconds" in events[-1]["error"]["message"]
    assert [e["type"] for e in rest] == ["input_audio_buffer.committed", "response.done"] and code == 1000


def test_session_value_below_the_limit_is_kept():
    factory = FakeFactory()

    async def scenario(server):
        client = await Client.open(server.url)
        await client.configure(max_streaming_seconds=0.16)

    serve(scenario, factory, limits=RealtimeLimits(max_session_seconds=0.24))
    assert factory.sessions[0].options["max_streaming_seconds"] == 0.16


def test_a_message_over_the_size_limit_closes_1009_and_frees_the_slot():
    factory = FakeFactory()

    async def scenario(server):
        client = await Client.open(server.url, max_size=None)
        await client.configure()
        await client.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(ramp(4000))})  # ~10.7 kB
        rest = await client.rest()
        await wait_for(lambda: server.live_sessions == 0)
        again = await Client.open(server.url)
        return rest, client.close_code, await again.recv()

    rest, code, created = serve(scenario, factory, limits=RealtimeLimits(max_message_bytes=8192))
    assert rest == [] and code == 1009
    assert factory.sessions[0].closed and created["type"] == "session.created"


def test_no_session_update_in_time_is_invalid_request_and_1008():
    async def scenario(server):
        client = await Client.open(server.url)
        await client.recv()
        await client.send({"type": "session.ping"})  # does not extend the update deadline
        pong = await client.recv()
        rest = await client.rest()
        assert server.live_sessions == 0
        return pong, rest, client.close_code

    pong, rest, code = serve(scenario, limits=RealtimeLimits(update_timeout_s=0.3))
    assert pong["type"] == "session.pong"
    assert [e["error"]["code"] for e in rest] == ["invalid_request"] and "session.update" in rest[0]["error"]["message"]
    assert code == 1008


def test_an_idle_session_is_invalid_request_and_1008_and_websocket_pings_do_not_count():
    factory = FakeFactory()

    async def scenario(server):
        client = await Client.open(server.url, ping_interval=None)
        await client.configure()
        loop = asyncio.get_running_loop()
        start = loop.time()
        for _ in range(4):  # client messages keep it alive past the idle limit (a wide margin: a loaded host)
            await asyncio.sleep(0.3)
            await client.send({"type": "session.ping"})
            assert (await client.recv())["type"] == "session.pong"
        alive_for = loop.time() - start

        async def pings():
            while True:
                await client.ws.ping()
                await asyncio.sleep(0.05)

        pinger = asyncio.create_task(pings())
        rest = await client.rest()
        pinger.cancel()
        assert server.live_sessions == 0
        return alive_for, rest, client.close_code

    alive_for, rest, code = serve(scenario, factory, limits=RealtimeLimits(idle_timeout_s=1.0))
    assert alive_for > 1.2
    assert [e["error"]["code"] for e in rest] == ["invalid_request"] and "1 s" in rest[0]["error"]["message"]
    assert code == 1008 and factory.sessions[0].closed


def test_limits_must_be_positive():
    for field in ("max_message_bytes", "max_session_seconds", "update_timeout_s", "idle_timeout_s"):
        with pytest.raises(ValueError, match=field):
            RealtimeLimits(**{field: 0})


# --------------------------------------------------------------------------------------- slots, server_busy


def test_a_second_connection_is_server_busy_with_1013_and_admitted_after_commit():
    async def scenario(server):
        first = await Client.open(server.url)
        await first.configure()
        second = await Client.open(server.url)
        busy = await second.rest()
        busy_code = second.close_code
        await first.send({"type": "input_audio_buffer.commit"})
        await first.rest()
        third = await Client.open(server.url)
        return busy, busy_code, await third.configure()

    busy, code, updated = serve(scenario)
    assert [e["type"] for e in busy] == ["error"] and busy[0]["error"]["code"] == "server_busy"
    assert code == 1013 and updated["session"]["state"] == "ready"


def test_max_sessions_admits_that_many():
    async def scenario(server):
        clients = [await Client.open(server.url) for _ in range(2)]
        for client in clients:
            await client.configure()
        third = await Client.open(server.url)
        return await third.rest(), third.close_code

    busy, code = serve(scenario, max_sessions=2)
    assert busy[0]["error"]["code"] == "server_busy" and code == 1013


@pytest.mark.parametrize("begun, code, message, close", [
    ("drain", "server_shutting_down", "this server is shutting down; connect to another instance", 1001),
    ("restart", "server_busy", "the tts service restarts; try again shortly", 1013)])
def test_a_drain_or_restart_begun_during_the_upgrade_refuses_the_socket(begun, code, message, close):
    class Racing(RealtimeServer):
        def _check_upgrade(self, connection, request):
            response = super()._check_upgrade(connection, request)  # the upgrade passes, then the state changes
            if begun == "drain":
                self.admission.drain()
            else:
                self.admission.unavailable = "the tts service restarts"
            return response

    async def main():
        async with Racing(FakeFactory()) as server:
            client = await Client.open(server.url)
            return await client.rest(), client.close_code, server.live_sessions

    events, close_code, live = asyncio.run(main())
    assert [(e["type"], e["error"]["code"], e["error"]["message"]) for e in events] == [("error", code, message)]
    assert close_code == close and live == 0


def test_a_dropped_connection_closes_its_session_and_frees_the_slot():
    factory = FakeFactory()

    async def scenario(server):
        first = await Client.open(server.url)
        await first.configure()
        await first.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(ramp(N + 10))})
        await first.until("response.audio.delta")
        first.ws.transport.abort()  # vanish without a close frame
        await wait_for(lambda: server.live_sessions == 0)
        second = await Client.open(server.url)
        return await second.configure()

    updated = serve(scenario, factory)
    assert updated["session"]["state"] == "ready"
    assert factory.sessions[0].close_calls == 1 and factory.sessions[0].closed


def test_a_connection_dropped_before_update_frees_the_slot():
    async def scenario(server):
        first = await Client.open(server.url)
        await first.recv()
        await first.close()
        await wait_for(lambda: server.live_sessions == 0)

    serve(scenario)


def test_stopping_the_server_closes_live_sessions():
    factory = FakeFactory()

    async def main():
        server = await RealtimeServer(factory).start()
        client = await Client.open(server.url)
        await client.configure()
        await server.stop()
        await client.rest()
        return client.close_code, server.live_sessions

    code, live = asyncio.run(main())
    assert code == 1001 and live == 0 and factory.sessions[0].closed


# ------------------------------------------------------------------------------------- the upgrade request


def _status(url, **kwargs):
    async def attempt():
        try:
            client = await Client.open(url, **kwargs)
        except InvalidStatus as exc:
            return exc.response.status_code
        await client.recv()
        await client.close()
        return 101

    return attempt()


def test_the_api_key_is_checked_before_the_upgrade():
    async def scenario(server):
        return [await _status(server.url),
                await _status(server.url, additional_headers={"Authorization": "Bearer wrong"}),
                await _status(server.url, additional_headers={"Authorization": "sekret"}),
                await _status(server.url, additional_headers={"Authorization": "Bearer sekret"})]

    assert serve(scenario, api_key="sekret") == [401, 401, 401, 101]


def test_allowed_origins_gate_browsers_and_accept_clients_without_origin():
    async def scenario(server):
        return [await _status(server.url, origin="https://evil.example"),
                await _status(server.url, origin="https://app.example"),
                await _status(server.url, origin="HTTPS://APP.EXAMPLE/"),
                await _status(server.url)]

    assert serve(scenario, allowed_origins=["https://app.example"]) == [403, 101, 101, 101]

    async def anyone(server):
        return await _status(server.url, origin="https://evil.example")

    assert serve(anyone) == 101
    assert serve(anyone, allowed_origins=["*"]) == 101


def test_api_prefix_moves_the_endpoint_and_other_paths_are_404():
    async def scenario(server):
        base = server.url.removesuffix(server.path)
        return [server.path, await _status(base + "/api/v1/realtime"), await _status(base + "/v1/realtime"),
                await _status(base + "/api/v1/realtime?model=x")]

    assert serve(scenario, api_prefix="api/") == ["/api/v1/realtime", 101, 404, 101]


def test_the_key_is_checked_before_the_busy_rule():
    async def scenario(server):
        first = await Client.open(server.url, additional_headers={"Authorization": "Bearer k"})
        await first.recv()
        return await _status(server.url)

    assert serve(scenario, api_key="k") == 401


# ---------------------------------------------------------------------------------------------- helpers


def test_pcm16_codecs():
    assert decode_pcm16(base64.b64encode(np.array([16384, -32768, 32767], "<i2").tobytes()).decode()).tolist() == [
        0.5, -1.0, 32767 / 32768]
    assert np.frombuffer(base64.b64decode(encode_pcm16(np.array([2.0, -1.0, 0.25, 1e-5]))), "<i2").tolist() == [
        32767, -32767, 8192, 0]
    with pytest.raises(ValueError, match="base64"):
        decode_pcm16("@@@@")


def test_each_slice_events_are_sent_before_the_next_slice_runs(monkeypatch):
    import orchestrator.realtime as realtime

    order = []
    send = realtime._Connection.send

    async def recording_send(self, payload):
        order.append(("send", payload["type"], payload.get("frame_index")))
        await send(self, payload)

    monkeypatch.setattr(realtime._Connection, "send", recording_send)

    class Recording(FakeFactory):
        def __call__(self, **options):
            session = super().__call__(**options)
            push = session.push_audio

            def recording_push(samples, sample_rate=16_000):
                order.append(("push", len(samples), None))
                return push(samples, sample_rate)

            session.push_audio = recording_push
            return session

    async def scenario(server):
        client = await Client.open(server.url)
        await client.configure()
        await client.send({"type": "input_audio_buffer.append", "audio": pcm16_b64(ramp(3 * N))})
        await client.send({"type": "input_audio_buffer.commit"})
        await client.rest()

    serve(scenario, Recording())
    pushes = [i for i, item in enumerate(order) if item[0] == "push"]
    committed = order.index(("send", "input_audio_buffer.committed", None))
    assert len(pushes) == 3
    for frame, (at, following) in enumerate(zip(pushes, [*pushes[1:], committed], strict=True)):
        assert [item[2] for item in order[at + 1 : following]] == [frame] * 3  # sent before the next push
