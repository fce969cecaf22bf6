"""A fake session and factory for the gateway's protocol tests, and a small `websockets` client helper."""

from __future__ import annotations

import asyncio
import base64
import json
import threading

import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from orchestrator.clients import ServiceError
from orchestrator.realtime import RealtimeServer
from orchestrator.session import ContextLimitError, Event, SessionClosedError

# What differs between two runs of the same session: each event's random id and the server's latency measure.
VARYING_FIELDS = ("event_id", "latency_ms")

N = 1280  # input samples per frame
OUT = 1764  # output samples per frame
RATE = 16_000


class FakeSession:
    """Frames of 1280 samples; per frame a transcript delta, a text delta and an audio event derived from it."""

    def __init__(self, *, system_prompt, seed, max_streaming_seconds, fail_at=None, closes_on_failure=True):
        self.options = {"system_prompt": system_prompt, "seed": seed, "max_streaming_seconds": max_streaming_seconds}
        self.max_frames = int(max_streaming_seconds / 0.08)
        self.fail_at = fail_at
        self.closes_on_failure = closes_on_failure
        self.pending = np.zeros(0, np.float32)
        self.pushes: list[np.ndarray] = []  # every push_audio chunk, as received
        self.frames: list[np.ndarray] = []
        self.frame_index = 0
        self.closed = False
        self.close_calls = 0
        self.threads: set[str] = set()

    def _frame(self, samples: np.ndarray) -> list[Event]:
        if self.frame_index >= self.max_frames:
            raise ContextLimitError(f"the stream passed max_streaming_seconds ({self.max_frames} frames of 80 ms)")
        if self.fail_at == self.frame_index:
            self.closed = self.closes_on_failure
            raise ServiceError("the llm service at x:1 stopped responding (UNAVAILABLE: gone)")
        i = self.frame_index
        self.frames.append(samples)
        level = float(samples[0])
        audio = np.full(OUT, level * 2.0, np.float32)  # values past +-1 test the clip
        audio[:4] = (-2.0, -1.0, 0.5, 1.0)
        self.frame_index += 1
        return [Event("user_transcript_delta", i, delta="w", text="w" * (i + 1)),
                Event("assistant_text_delta", i, token_id=100 + i, delta="a", text="a" * (i + 1)),
                Event("audio", i, samples=audio, audio_codes=np.arange(31, dtype=np.int32) + i,
                      raw_codes=np.arange(31, dtype=np.int32))]

    def push_audio(self, samples, sample_rate=RATE):
        self.threads.add(threading.current_thread().name)
        if self.closed:
            raise SessionClosedError("audio after flush or cancel: this session is closed; open a new one")
        if sample_rate != RATE:
            raise ValueError(f"expected {RATE} Hz PCM, received {sample_rate} Hz; resample first")
        self.pushes.append(np.array(samples))
        pending = np.concatenate([self.pending, samples])
        events = []
        try:
            while len(pending) >= N:
                events += self._frame(pending[:N])
                pending = pending[N:]
        finally:
            self.pending = pending
        return events

    def wait_behind(self, frames):
        return []  # every push runs its frames at once

    def flush(self, pad_partial=True):
        if self.closed:
            return []
        events = []
        if pad_partial and len(self.pending):
            events += self._frame(np.pad(self.pending, (0, N - len(self.pending))))
        self.pending = np.zeros(0, np.float32)
        self.closed = True
        return events + [Event("done", self.frame_index)]

    def cancel(self):
        if self.closed:
            return []
        self.closed = True
        return [Event("cancelled", self.frame_index)]

    def close(self):
        self.close_calls += 1
        self.closed = True


class FakeFactory:
    model_id = "fake-model"
    input_sample_rate = RATE
    output_sample_rate = 22_050
    frame_samples = N

    def __init__(self, fail_open: Exception | None = None, **session_kwargs):
        self.fail_open = fail_open
        self.session_kwargs = session_kwargs
        self.sessions: list[FakeSession] = []

    def __call__(self, **options):
        if self.fail_open is not None:
            raise self.fail_open
        session = FakeSession(**options, **self.session_kwargs)
        self.sessions.append(session)
        return session


def pcm16_b64(samples: np.ndarray) -> str:
    """Float samples as the append payload (int16 = round(x * 32768), clipped)."""
    ints = np.clip(np.round(np.asarray(samples, np.float64) * 32768), -32768, 32767).astype("<i2")
    return base64.b64encode(ints.tobytes()).decode()


def serve(scenario, factory=None, **server_kwargs):
    """asyncio.run a scenario(server) against a RealtimeServer on a free port; returns what it returns."""

    async def main():
        async with RealtimeServer(factory or FakeFactory(), **server_kwargs) as server:
            return await scenario(server)

    return asyncio.run(main())


class Client:
    """A `websockets` client that reads JSON events and records the close code."""

    def __init__(self, ws):
        self.ws = ws

    @classmethod
    async def open(cls, url: str, **kwargs) -> Client:
        return cls(await connect(url, **kwargs))

    async def send(self, message) -> None:
        await self.ws.send(message if isinstance(message, str | bytes) else json.dumps(message))

    async def recv(self, timeout: float = 10.0) -> dict:
        return json.loads(await asyncio.wait_for(self.ws.recv(), timeout))

    async def until(self, kind: str, timeout: float = 30.0) -> list[dict]:
        """Every event up to and including the first of type `kind`."""
        events = []
        while True:
            event = await self.recv(timeout)
            events.append(event)
            if event["type"] == kind:
                return events

    async def rest(self, timeout: float = 30.0) -> list[dict]:
        """Every event until the server closes the socket."""
        events = []
        try:
            while True:
                events.append(json.loads(await asyncio.wait_for(self.ws.recv(), timeout)))
        except ConnectionClosed:
            return events

    async def configure(self, **session) -> dict:
        created = await self.recv()
        assert created["type"] == "session.created"
        await self.send({"type": "session.update", "session": session})
        updated = await self.recv()
        assert updated["type"] == "session.updated", updated
        return updated

    @property
    def close_code(self):
        return self.ws.close_code

    async def close(self) -> None:
        await self.ws.close()


async def wait_for(predicate, timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)
