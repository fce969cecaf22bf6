"""Drive an audio file through a /v1/realtime WebSocket and write the spoken answer.

    python examples/realtime_file_client.py ws://127.0.0.1:8080/v1/realtime question.wav response_ws.wav \
        --system-prompt "Be concise and answer in one sentence." --seed 0

The file is read as 16 kHz mono (any rate or channel count; resampled), followed by --extra-seconds of silence
(default 3) so the model can finish answering, and sent as base64 PCM16 in 80 ms appends; then it commits. The
answer's text is printed as it arrives, then `[user] <transcript>` (and `[function] <text>` when that channel
spoke); the response.audio.delta payloads are written as one 22050 Hz mono PCM16 WAV, sample for sample.
Exit status: 0 on response.done, 1 on any error event or a refused connection (the WAV is written only once
response.done has arrived).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np
import soundfile as sf
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus, InvalidURI

from orchestrator.audio import AudioError, check_writable, read_audio, to_pcm16

INPUT_RATE = 16_000


def to_wire(samples: np.ndarray) -> bytes:
    """Float samples as the PCM16 the server decodes by / 32768 (a PCM16 file round-trips exactly)."""
    return to_pcm16(samples, 32768.0).astype("<i2").tobytes()


def appends(samples: np.ndarray, chunk: int) -> list[dict]:
    """The input_audio_buffer.append messages for `samples`, `chunk` samples each."""
    return [{"type": "input_audio_buffer.append", "audio": base64.b64encode(to_wire(samples[i:i + chunk])).decode(),
             "sample_rate": INPUT_RATE} for i in range(0, len(samples), chunk)]


class Answer:
    """What the server said: the channels' cumulative texts, the audio frames, the errors.

    A text event carries its channel's text from `text_start` (`transcript_start`) on, absent while the text is
    within the server's --text-window: each event's text replaces what the client holds from that character on."""

    def __init__(self, out=None):
        self.out = out or sys.stdout
        self.transcript = self.text = self.function = ""
        self.audio: list[np.ndarray] = []
        self.sample_rate = 22_050
        self.errors: list[dict] = []
        self.done: dict | None = None

    def handle(self, event: dict) -> bool:
        """Take one server event; True once the response is over (done, cancelled or server_busy)."""
        kind = event.get("type")
        if kind == "conversation.item.input_audio_transcription.delta":
            self.transcript = self.transcript[:event.get("transcript_start", 0)] + event["transcript"]
        elif kind == "response.text.delta":
            self.text = self.text[:event.get("text_start", 0)] + event["text"]
            self.out.write(event["delta"])
            self.out.flush()
        elif kind == "response.function.delta":
            self.function = self.function[:event.get("text_start", 0)] + event["text"]
        elif kind == "response.audio.delta":
            self.audio.append(np.frombuffer(base64.b64decode(event["delta"]), "<i2"))
            self.sample_rate = event["sample_rate"]
        elif kind == "error":
            self.errors.append(event["error"])
            print(f"\nerror: {event['error']['code']}: {event['error']['message']}", file=sys.stderr)
            return event["error"]["code"] == "server_busy"
        elif kind in ("response.done", "response.cancelled"):
            self.done = event
            return True
        return False


async def converse(url: str, samples: np.ndarray, *, system_prompt: str | None = None, seed: int = 0,
                   api_key: str | None = None, chunk: int = 1280, realtime: bool = False,
                   answer: Answer | None = None) -> Answer:
    """One conversation: configure, append every chunk, commit, and collect events until the socket closes."""
    answer = answer or Answer()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    # No client pings: a server working through a backlog of appends reads our ping only after them, so its
    # pong could come later than any timeout; the server pings us and we answer at once.
    async with connect(url, additional_headers=headers, max_size=None, ping_interval=None) as ws:
        created = json.loads(await ws.recv())
        if created.get("type") != "session.created":
            answer.handle(created)
            return answer
        session = {"seed": seed}
        if system_prompt is not None:
            session["system_prompt"] = system_prompt
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        updated = json.loads(await ws.recv())
        if updated.get("type") != "session.updated":
            answer.handle(updated)
            return answer

        async def send_all() -> None:
            loop = asyncio.get_running_loop()
            start = loop.time()
            for i, message in enumerate(appends(samples, chunk)):
                if realtime:  # a live microphone delivers a chunk once its last sample has been spoken
                    await asyncio.sleep(max(0.0, start + (i + 1) * chunk / INPUT_RATE - loop.time()))
                await ws.send(json.dumps(message))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))

        sender = asyncio.create_task(send_all())
        try:
            async for frame in ws:
                if answer.handle(json.loads(frame)):
                    break
        except ConnectionClosed:
            pass
        finally:
            if not sender.done():
                sender.cancel()
        try:
            await sender
        except (asyncio.CancelledError, ConnectionClosed):
            pass
    return answer


def write_pcm16(path: Path, pcm: np.ndarray, sample_rate: int) -> None:
    """The received PCM16 as it came, to a temporary name renamed when complete."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".part", dir=path.parent)
    os.close(fd)
    try:
        sf.write(tmp, pcm, sample_rate, subtype="PCM_16", format="WAV")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="ws://HOST:PORT/v1/realtime")
    parser.add_argument("input", type=Path, help="audio file (any rate, mono or stereo)")
    parser.add_argument("output", type=Path, help="the answer's audio: 22050 Hz mono PCM16 WAV")
    parser.add_argument("--system-prompt", default=None, help="system prompt (default: the checkpoint's)")
    parser.add_argument("--seed", type=int, default=0, help="speech sampling seed (default 0)")
    parser.add_argument("--extra-seconds", type=float, default=3.0,
                        help="silence sent after the file so the model can finish answering (default 3)")
    parser.add_argument("--api-key", default=os.environ.get("VOICECHAT_API_KEY"),
                        help="sent as `Authorization: Bearer KEY` (default: $VOICECHAT_API_KEY)")
    parser.add_argument("--realtime", action="store_true", help="pace the appends like a live microphone")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.extra_seconds < 0:
        print(f"error: --extra-seconds {args.extra_seconds}: must be non-negative", file=sys.stderr)
        return 2
    try:
        check_writable(args.output)
        samples = read_audio(args.input, INPUT_RATE)
    except AudioError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    samples = np.concatenate([samples, np.zeros(round(args.extra_seconds * INPUT_RATE), np.float32)])
    try:
        answer = asyncio.run(converse(args.url, samples, system_prompt=args.system_prompt, seed=args.seed,
                                      api_key=args.api_key, realtime=args.realtime))
    except InvalidStatus as exc:
        print(f"error: the server refused the connection: HTTP {exc.response.status_code} "
              f"{exc.response.body.decode(errors='replace').strip()}", file=sys.stderr)
        return 1
    except (OSError, InvalidURI, ConnectionClosed) as exc:
        print(f"error: {args.url}: {exc}", file=sys.stderr)
        return 1
    if answer.done is None or answer.done["type"] != "response.done":
        print("error: the server ended the conversation without response.done; nothing written", file=sys.stderr)
        return 1
    print()
    print(f"[user] {answer.transcript}")
    if answer.function:
        print(f"[function] {answer.function}")
    pcm = np.concatenate(answer.audio) if answer.audio else np.zeros(0, np.int16)
    write_pcm16(args.output, pcm, answer.sample_rate)
    print(f"wrote {args.output} ({len(pcm) / answer.sample_rate:.2f} s)", file=sys.stderr)
    return 1 if answer.errors else 0


if __name__ == "__main__":
    sys.exit(main())
