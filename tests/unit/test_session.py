"""The online session over fake stream clients and a fake clock: framing, event order and shape, the prompt
prefix, pipelined against sequential, bad input, limits, cancel, failures, the profiler and --realtime pacing."""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from orchestrator.cli import drive
from orchestrator.clients import ServiceError
from orchestrator.pending import Pending
from orchestrator.profile import Profile, percentile
from orchestrator.session import ContextLimitError, OnlineSession, SessionClosedError, Stage
from orchestrator.stream_clients import PerceivedFrame, StreamClients
from orchestrator.text import TokenAccumulator
from orchestrator.timeline import SpeechInfo
from services.common.config import VoiceChatConfig
from tests.conftest import ROOT

CONFIG = VoiceChatConfig.from_dict(json.loads((ROOT / "tests" / "fixtures" / "config_full.json").read_text()))
N = CONFIG.input_frame_samples
PAD, EOS = CONFIG.pad_token_id, CONFIG.eos_token_id
Q = 4
INFO = SpeechInfo(prompt_frames=3, num_quantizers=Q, control_codes=(7, 9), silence_codes=(100, 101, 102, 103))


class FakeDecoder:
    hidden = CONFIG.special_text_ids

    def decode(self, ids):
        return "".join(f"<{i}>" for i in ids if i not in self.hidden)


class FakeClock:
    """Advances 1 ms per reading; sleep moves it forward without sleeping."""

    def __init__(self):
        self.t, self.slept = 0.0, []
        self._lock = threading.Lock()

    def now(self):
        with self._lock:
            self.t += 0.001
            return self.t

    def sleep(self, seconds):
        self.slept.append(round(seconds, 6))
        with self._lock:
            self.t += max(seconds, 0.0)


class Log:
    def __init__(self):
        self.calls, self.closed = [], []
        self._lock = threading.Lock()

    def add(self, *item):
        with self._lock:
            self.calls.append(item)


def make_clients(log: Log, prefix: int = 0, fail_at: dict | None = None) -> StreamClients:
    fail_at = fail_at or {}

    def check(stage, index):
        if fail_at.get(stage) == index:
            raise ServiceError(f"the {stage} service at x:1 stopped responding (UNAVAILABLE: gone)")

    class Perception:
        def open(self):
            class Stream:
                index = 0

                def push(self, frame):
                    check("perception", self.index)
                    value = float(frame.sum())
                    self.index += 1
                    tokens = [3] if self.index % 2 else []
                    return PerceivedFrame(np.full(2, value, np.float32), np.full(3, value, np.float32),
                                          "w" if tokens else "", tokens)

                def send_push(self, frame):
                    return Pending(lambda: self.push(frame))  # answered when taken, in the order sent

                def close(self):
                    log.closed.append("perception")

            return Stream()

    class Language:
        def open(self, system_prompt):
            log.add("language.open", system_prompt)

            class Session:
                prompt_positions = prefix
                prompt_embeds = np.zeros((prefix, 2), np.float32)
                index = 0

                def step(self, embedding):
                    check("language", self.index)
                    self.index += 1
                    cycle = [40, PAD, 41, EOS, 42]
                    return cycle[(self.index - 1) % len(cycle)], 50 + self.index % 2

                def send_step(self, embedding):
                    return Pending(lambda: self.step(embedding))

                def close(self):
                    log.closed.append("language")

            return Session()

    class Speech:
        def info(self):
            return INFO

        def open(self, seed, prompt_codes, prefix_steps):
            log.add("speech.open", seed, prompt_codes.shape, prefix_steps)

            class Session:
                index = 0

                def step(self, text_id):
                    check("tts", self.index)
                    self.index += 1
                    return np.array([text_id, 7, self.index, 9], np.int32)

                def send_step(self, text_id):
                    return Pending(lambda: self.step(text_id))

                def close(self):
                    log.closed.append("tts")

            return Session()

    class Codec:
        def prompt_codes(self, frames):
            return np.zeros((frames, Q), np.int32)

        def open_stream(self):
            class Stream:
                def decode(self, codes):
                    return np.full(1764, float(codes.sum()), np.float32)

                def send_decode(self, codes):
                    return Pending(lambda: self.decode(codes))

                def close(self):
                    log.closed.append("codec")

            return Stream()

    return StreamClients(Perception(), Language(), Speech(), Codec())


def session(log=None, **kwargs) -> OnlineSession:
    log = log or Log()
    prefix = kwargs.pop("prefix", 0)
    fail_at = kwargs.pop("fail_at", None)
    kwargs.setdefault("clock", FakeClock())
    return OnlineSession(make_clients(log, prefix, fail_at), CONFIG, FakeDecoder(), **kwargs)


def run(waveform, chunk, **kwargs):
    s = session(**kwargs)
    events = []
    for start in range(0, len(waveform), chunk):
        events += s.push_audio(waveform[start : start + chunk])
    events += s.flush(pad_partial=True)
    return events


def comparable(events):
    return [(e.kind, e.frame_index, e.token_id, e.delta, e.text,
             None if e.samples is None else e.samples.tolist(),
             None if e.audio_codes is None else e.audio_codes.tolist(),
             None if e.raw_codes is None else e.raw_codes.tolist()) for e in events]


WAVE = np.random.default_rng(0).standard_normal(N * 6 + 500).astype(np.float32)


def test_frames_events_and_their_order():
    events = run(WAVE, N, pipelined=False)
    assert [e.frame_index for e in events if e.kind == "audio"] == list(range(7))  # 6 frames + the padded one
    assert events[-1].kind == "done" and events[-1].frame_index == 7
    order = {"user_transcript_delta": 0, "assistant_text_delta": 1, "function_delta": 2, "audio": 3}
    for t in range(7):
        kinds = [e.kind for e in events if e.frame_index == t and e.kind != "done"]
        assert kinds == sorted(kinds, key=order.__getitem__) and kinds[-1] == "audio"
    text = [e for e in events if e.kind == "assistant_text_delta"]
    assert [e.token_id for e in text] == [40, 41, 42, 40]  # pad and EOS skipped
    assert text[-1].text == "<40><41><42><40>" and text[1].delta == "<41>"
    first = next(e for e in events if e.kind == "audio")
    assert first.audio_codes.tolist() == list(INFO.silence_codes)  # position 0: codec silence, no speech step
    second = [e for e in events if e.kind == "audio"][1]
    assert second.raw_codes.tolist() == [PAD, 7, 1, 9] and second.audio_codes.tolist() == [PAD, 101, 1, 103]
    assert second.samples.shape == (1764,) and second.samples[0] == second.audio_codes.sum()


def test_push_sizes_give_identical_events():
    reference = comparable(run(WAVE, N, pipelined=False))
    for chunk in (1, 160, 4000, len(WAVE)):
        assert comparable(run(WAVE, chunk, pipelined=False)) == reference, chunk


def test_pipelined_equals_sequential():
    for chunk in (N, 4000):
        assert comparable(run(WAVE, chunk, pipelined=True)) == comparable(run(WAVE, chunk, pipelined=False))


def test_every_frame_runs_the_session_stage_objects_in_order():
    s = session(pipelined=False)
    assert [stage.name for stage in s.stages] == ["perception", "language", "tts", "codec"]
    seen = []

    def traced(stage):  # the same stage, noting each frame it sends and takes
        def send(f):
            seen.append((stage.name, "send", f.index))
            return stage.send(f)

        def take(f, answer):
            seen.append((stage.name, "take", f.index))
            stage.take(f, answer)

        return Stage(stage.name, send, take)

    s.stages = tuple(traced(stage) for stage in s.stages)
    events = s.push_audio(WAVE[: 2 * N]) + s.flush(pad_partial=False)
    assert seen == [(name, step, t) for t in range(2) for name in ("perception", "language", "tts", "codec")
                    for step in ("send", "take")]
    assert comparable(events) == comparable(run(WAVE[: 2 * N], N, pipelined=False))


def test_prompt_prefix_steps_speech_and_emits_nothing():
    log = Log()
    s = session(log, prefix=5, system_prompt="hello", seed=7, pipelined=False)
    assert ("language.open", "hello") in log.calls and ("speech.open", 7, (3, Q), 4) in log.calls
    events = s.push_audio(WAVE[:N]) + s.flush()
    audio = [e for e in events if e.kind == "audio"]
    assert len(audio) == 1 and audio[0].frame_index == 0
    assert audio[0].raw_codes.tolist() == [40, 7, 1, 9]  # with a prefix, frame 0 has a speech step


def test_flush_without_padding_drops_the_partial_frame_and_frees_every_stream():
    log = Log()
    s = session(log, pipelined=True)
    s.push_audio(WAVE[: N + 10])
    events = s.flush(pad_partial=False)
    assert [e.kind for e in events][-1] == "done" and events[-1].frame_index == 1
    assert sorted(log.closed) == ["codec", "language", "perception", "tts"]
    assert s.flush() == []


def test_bad_input_is_rejected_and_the_session_goes_on():
    s = session(pipelined=False)
    with pytest.raises(ValueError, match="16000 Hz"):
        s.push_audio(WAVE[:N], 8000)
    with pytest.raises(ValueError, match="non-finite"):
        s.push_audio(np.array([0.0, np.nan], np.float32))
    with pytest.raises(ValueError, match="mono"):
        s.push_audio(np.zeros((2, 10), np.float32))
    assert [e.kind for e in s.push_audio(WAVE[:N])][-1] == "audio"
    s.flush()
    with pytest.raises(SessionClosedError, match="after flush"):
        s.push_audio(WAVE[:N])


@pytest.mark.parametrize("pipelined", [False, True])
def test_max_streaming_seconds_bounds_the_session(pipelined):
    s = session(pipelined=pipelined, max_streaming_seconds=0.2)  # int(0.2 / 0.08) = 2 frames
    assert s.max_frames == 2
    with pytest.raises(ContextLimitError, match="max_streaming_seconds"):
        s.push_audio(WAVE[: 3 * N])
    assert s.frame_index == 2
    # The two frames before the limit still reach the caller, with the next call.
    assert [e.frame_index for e in s.drain() if e.kind == "audio"] == [0, 1]
    with pytest.raises(ValueError):
        session(max_streaming_seconds=0)


def test_cancel_drops_pending_audio():
    for pipelined in (False, True):
        log = Log()
        s = session(log, pipelined=pipelined)
        s.push_audio(WAVE[: N + 100])
        events = s.cancel()
        assert events[-1].kind == "cancelled" and events[-1].frame_index == s.frame_index
        assert len(log.closed) == 4 and s.cancel() == []
        with pytest.raises(SessionClosedError):
            s.push_audio(WAVE[:N])


@pytest.mark.parametrize("stage", ["perception", "language", "tts"])
@pytest.mark.parametrize("pipelined", [False, True])
def test_a_failing_service_is_named_and_nothing_hangs(stage, pipelined):
    log = Log()
    seen = []
    s = session(log, pipelined=pipelined, fail_at={stage: 2}, on_event=seen.append)
    with pytest.raises(ServiceError, match=f"the {stage} service"):
        s.push_audio(WAVE)
        s.flush()
    assert len(log.closed) == 4 and s.closed  # every service session freed at the failure
    s.close()
    done = [0, 1, 2] if stage == "tts" else [0, 1]  # frame 0 takes no speech step: its step 2 is frame 3
    assert [e.frame_index for e in seen if e.kind == "audio"] == done
    if pipelined:
        assert [e.kind for e in seen][-1] == "error" and stage in seen[-1].message


def test_on_event_receives_the_same_events():
    seen = []
    s = session(pipelined=True, on_event=seen.append)
    assert s.push_audio(WAVE) == []
    assert s.flush() == []
    assert comparable(seen) == comparable(run(WAVE, N, pipelined=False))


def test_profile_measures_every_stage():
    s = session(pipelined=False, profile=True)
    s.push_audio(WAVE)
    s.flush()
    frames = s.profile.frames
    assert len(frames) == 7
    # the fake clock advances 1 ms per reading: each stage reads it twice, so every stage lasts 1 ms
    assert all(f.perception_ms == pytest.approx(1.0) and f.codec_ms == pytest.approx(1.0) for f in frames)
    summary = s.profile.summary(drop_first=2)
    assert summary["frames"] == 5 and summary["dropped_cold_frames"] == 2 and summary["mode"] == "sequential"
    assert set(summary["stages"]) == {"perception", "rnnt", "language", "tts", "codec", "total", "interval"}
    total = summary["stages"]["total"]["mean_ms"]
    assert total >= 4.0 and summary["realtime_factor"] == pytest.approx(
        summary["stages"]["interval"]["mean_ms"] / 80.0)
    json.dumps(summary)


def test_percentile_and_empty_summary():
    assert percentile([1, 2, 3, 4], 0.5) == 2.5 and percentile([], 0.95) == 0.0
    assert percentile([5.0], 0.95) == 5.0
    empty = Profile(80.0).summary(drop_first=5)
    assert empty["frames"] == 0 and empty["realtime_factor"] == 0.0


def test_realtime_drive_paces_pushes_with_the_clock():
    clock = FakeClock()
    s = session(pipelined=False, clock=clock)
    drive(s, WAVE[: 4 * N], N, realtime=True, clock=clock)
    assert s.closed and s.frame_index == 4
    assert len(clock.slept) == 4 and all(0.0 < x <= 0.08 for x in clock.slept)
    assert clock.t >= 4 * 0.08  # the pushes took at least the audio's own duration


def test_token_accumulator_falls_back_to_the_single_token_decode():
    class Revising(FakeDecoder):
        def decode(self, ids):
            return "x" if ids == [40] else "y" + "".join(map(str, ids))

    acc = TokenAccumulator(Revising())
    assert acc.append(40) == ("x", "x")
    assert acc.append(41) == ("y41", "y4041")


def windowed_run(transcripts, text_window):
    """A session whose perception answers frame t with transcripts[t] (its delta: the new end)."""

    class Perception:
        def open(self):
            class Stream:
                index, before = 0, ""

                def send_push(self, frame):
                    transcript = transcripts[self.index]
                    delta, self.before = transcript[len(self.before):], transcript
                    self.index += 1
                    return Pending.answered(PerceivedFrame(np.zeros(2, np.float32), np.zeros(3, np.float32), delta,
                                                           [3] if delta else []))

                def close(self):
                    pass

            return Stream()

    base = make_clients(Log())
    clients = StreamClients(Perception(), base.language, base.speech, base.codec)
    s = OnlineSession(clients, CONFIG, FakeDecoder(), clock=FakeClock(), pipelined=False, text_window=text_window)
    return s.push_audio(np.zeros(N * len(transcripts), np.float32)) + s.flush()


def test_a_windowed_transcript_carries_its_last_characters_from_text_start():
    transcripts = ["hel", "hel", "hello", "hello wor", "hello world", "hello world, and more"]
    events = [e for e in windowed_run(transcripts, 5) if e.kind == "user_transcript_delta"]
    # the last 5 characters, but never past the previous event's transcript (the last frame added 10 at once)
    assert [(e.text_start, e.text, e.delta) for e in events] == [
        (0, "hel", "hel"), (0, "hello", "lo"), (4, "o wor", " wor"), (6, "world", "ld"),
        (11, ", and more", ", and more")]
    assert [e.describe().get("text_start") for e in events] == [None, None, 4, 6, 11]
    unbounded = [e for e in windowed_run(transcripts, 0) if e.kind == "user_transcript_delta"]
    assert [(e.text_start, e.text) for e in unbounded] == [(0, t) for t in (transcripts[0], *transcripts[2:])]
    text = [e for e in windowed_run(transcripts, 5) if e.kind == "assistant_text_delta"]
    # four ids, all in the unsettled tail (a later id may still revise its text): the whole text each time
    assert [(e.text_start, e.text) for e in text] == [(0, "<40>"), (0, "<40><41>"), (0, "<40><41><42>"),
                                                      (0, "<40><41><42><40>")]


def test_a_negative_text_window_is_refused():
    with pytest.raises(ValueError, match="text_window must be a non-negative number of characters"):
        session(text_window=-1)


@pytest.mark.parametrize("send_ahead", [1, 2, 3])
def test_a_stage_sends_the_next_frame_before_the_last_answer_and_never_more_than_send_ahead(send_ahead):
    """Pipelined, the language stage's request for frame k + 1 reaches its service while frame k's answer is
    still out (so the service never waits a round trip between frames), with at most `send_ahead` requests out
    (none ahead with 1)."""
    wait_s = 2.0 if send_ahead > 1 else 0.05  # how long frame k's answer waits for frame k + 1 to be sent
    log = Log()
    clients = make_clients(log)
    opened = clients.language.open

    class Watched:
        def __init__(self, session):
            self.session, self.sent, self.answered = session, 0, 0
            self.prompt_positions, self.prompt_embeds = session.prompt_positions, session.prompt_embeds
            self.outstanding_seen, self.next_sent_first = 0, []
            self._changed = threading.Condition()

        def send_step(self, embedding):
            with self._changed:
                self.sent += 1
                self.outstanding_seen = max(self.outstanding_seen, self.sent - self.answered)
                self._changed.notify_all()
            index = self.sent - 1

            def answer():
                with self._changed:  # hold frame k's answer until frame k + 1 is sent
                    self.next_sent_first.append(self._changed.wait_for(lambda: self.sent > index + 1, wait_s))
                    self.answered += 1
                return self.session.step(embedding)

            return Pending(answer)

        def close(self):
            self.session.close()

    watched = []
    clients.language.open = lambda prompt: watched.append(Watched(opened(prompt))) or watched[-1]
    s = OnlineSession(clients, CONFIG, FakeDecoder(), clock=FakeClock(), pipelined=True, send_ahead=send_ahead)
    events = s.push_audio(WAVE) + s.flush()
    language = watched[0]
    frames = [e.frame_index for e in events if e.kind == "audio"]
    assert frames == list(range(7))
    # every frame but the last saw its successor sent before its own answer came back
    assert language.next_sent_first == ([True] * 6 if send_ahead > 1 else [False] * 6) + [False]
    assert min(send_ahead, 2) <= language.outstanding_seen <= send_ahead
    assert comparable(events) == comparable(run(WAVE, N, pipelined=False))


def held_codec_session() -> tuple[OnlineSession, threading.Semaphore]:
    """A pipelined session whose codec answers a frame only when the test releases the semaphore once."""
    log = Log()
    clients = make_clients(log)
    released = threading.Semaphore(0)
    opened = clients.codec.open_stream

    def held_stream():
        stream = opened()
        decode = stream.decode

        def send_decode(codes):
            def answer():
                released.acquire()  # the codec answers a frame only when the test lets it
                return decode(codes)

            return Pending(answer)

        stream.send_decode = send_decode
        return stream

    clients.codec.open_stream = held_stream
    return OnlineSession(clients, CONFIG, FakeDecoder(), clock=FakeClock(), pipelined=True), released


def test_wait_behind_holds_the_caller_until_the_frames_in_the_stages_are_few_enough():
    s, released = held_codec_session()
    assert s.push_audio(WAVE) == [] and s.frames_pushed == 6  # queued, none through the codec yet
    returned: list = []
    waiter = threading.Thread(target=lambda: returned.append(s.wait_behind(2)))
    waiter.start()
    for _ in range(3):
        released.release()
    waiter.join(0.5)
    assert waiter.is_alive()  # 3 done, 3 still in the stages: more than 2
    released.release()
    waiter.join(5)
    assert not waiter.is_alive() and s.frame_index >= 4
    audio = [e.frame_index for e in returned[0] if e.kind == "audio"]
    assert audio == list(range(len(audio))) and len(audio) >= 4  # the events ready when it returned
    for _ in range(10):
        released.release()
    assert [e.frame_index for e in s.flush() if e.kind == "audio"] == list(range(len(audio), 7))
    with pytest.raises(ValueError, match="zero or more"):
        s.wait_behind(-1)


@pytest.mark.parametrize("end", ["cancel", "close"])
def test_wait_behind_lets_the_caller_go_when_the_session_is_cancelled_or_closed(end):
    s, released = held_codec_session()
    s.push_audio(WAVE)
    returned: list = []
    waiter = threading.Thread(target=lambda: returned.append(s.wait_behind(0)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # six frames held in the stages
    ender = threading.Thread(target=getattr(s, end))
    ender.start()
    while not s._cancelled.is_set():  # frames answered after this are dropped, without waking the waiter
        time.sleep(0.001)
    for _ in range(6):
        released.release()  # the workers stop once the frames they hold are answered
    ender.join(5)
    waiter.join(5)
    assert not ender.is_alive() and not waiter.is_alive()  # no frame completed after the end: the end woke it
    assert s.closed and returned and all(e.kind in ("audio", "cancelled") for e in returned[0])


def test_wait_behind_returns_at_once_in_the_sequential_mode_and_raises_a_stage_failure():
    s = session(pipelined=False)
    events = s.push_audio(WAVE)
    assert s.wait_behind(0) == [] and len([e for e in events if e.kind == "audio"]) == 6
    failing = session(pipelined=True, fail_at={"tts": 2})
    failing.push_audio(WAVE)
    with pytest.raises(ServiceError, match="tts service"):
        failing.wait_behind(0)
    assert failing.closed
