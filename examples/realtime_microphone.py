"""A live conversation with a /v1/realtime server: your microphone in, the model's voice out.

    pip install '.[mic]'   # sounddevice; it needs PortAudio (apt install libportaudio2, brew install portaudio)
    python examples/realtime_microphone.py ws://127.0.0.1:8080/v1/realtime \
        --system-prompt "Be concise and answer in one sentence."
    python examples/realtime_microphone.py --list-devices

Captures the default (or --input-device) microphone, downmixes it to mono, resamples it to 16 kHz and sends an
append every 80 ms; plays the response.audio.delta stream on the default (or --output-device) speaker through a
ring buffer; prints the transcript and the answer as they arrive; Ctrl-C commits, waits for response.done and
quits. There is no echo cancellation and the model listens while it speaks: use headphones.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import signal
import sys
import threading

import numpy as np

from orchestrator.audio import filter_reach, ratio, resample

INPUT_RATE = 16_000
FRAME_SAMPLES = 1280  # one 80 ms append at 16 kHz
INSTALL_HINT = ("the microphone client needs sounddevice: pip install '.[mic]' (and the PortAudio library: "
                "apt install libportaudio2, or brew install portaudio)")


class MissingAudioBackend(RuntimeError):
    pass


def load_sounddevice():
    """sounddevice, imported only when audio devices are needed, so the core install does without PortAudio."""
    try:
        import sounddevice
    except (ImportError, OSError) as exc:  # OSError: the module is there but the PortAudio library is not
        raise MissingAudioBackend(f"{INSTALL_HINT} ({exc})") from None
    return sounddevice


# --------------------------------------------------------------------------------------------- audio path


class StreamResampler:
    """orchestrator.audio.resample, block by block: the concatenated output equals resampling the whole signal.

    Each call resamples a window that starts on an input sample aligned to the output grid and keeps only the
    outputs whose filter taps are all inside what has arrived; `flush` emits the rest (the last sample held past
    the end, as for the whole signal).

    >>> r = StreamResampler(48_000, 16_000)
    >>> sum(len(r.process(np.zeros(480, np.float32))) for _ in range(10)) + len(r.flush())
    1600
    """

    def __init__(self, source_hz: int, target_hz: int):
        self.source_hz, self.target_hz = source_hz, target_hz
        self.up, self.down = ratio(source_hz, target_hz)
        self.half = filter_reach(self.up, self.down)  # in upsampled samples
        self.buffer = np.zeros(0, np.float32)
        self.start = 0  # input index of buffer[0]; a multiple of `down`, so it falls on the output grid
        self.received = 0
        self.emitted = 0

    def process(self, block: np.ndarray) -> np.ndarray:
        block = np.asarray(block, np.float32).reshape(-1)
        if self.up == self.down:
            return block
        self.buffer = np.concatenate([self.buffer, block])
        self.received += len(block)
        # output n is complete once its last tap, input floor((n*down + half) / up), has arrived
        return self._emit((self.received * self.up - self.half - 1) // self.down + 1)

    def flush(self) -> np.ndarray:
        if self.up == self.down:
            return np.zeros(0, np.float32)
        return self._emit(-(-self.received * self.up // self.down))

    def _emit(self, end: int) -> np.ndarray:
        if end <= self.emitted:
            return np.zeros(0, np.float32)
        window = resample(self.buffer, self.source_hz, self.target_hz)
        offset = self.start * self.up // self.down
        out = window[self.emitted - offset : end - offset]
        self.emitted = end
        first_needed = max(0, -((self.half - end * self.down) // self.up))  # ceil((end*down - half) / up)
        keep = first_needed // self.down * self.down
        if keep > self.start:
            self.buffer = self.buffer[keep - self.start :]
            self.start = keep
        return out


def to_mono(block: np.ndarray) -> np.ndarray:
    """(frames, channels) -> (frames,) by averaging the channels."""
    block = np.asarray(block, np.float32)
    return block.mean(axis=1) if block.ndim == 2 else block


class RingBuffer:
    """Playback samples between the network (writer) and the audio callback (reader), thread-safe.

    Reading past what is there gives silence; writing past the capacity drops the oldest samples, so a late
    speaker never builds up delay beyond `capacity`."""

    def __init__(self, capacity: int):
        self.data = np.zeros(capacity, np.float32)
        self.capacity = capacity
        self.read_at = 0
        self.size = 0
        self.dropped = 0
        self.underruns = 0
        self._lock = threading.Lock()

    def write(self, samples: np.ndarray) -> None:
        samples = np.asarray(samples, np.float32)
        with self._lock:
            if len(samples) > self.capacity:
                self.dropped += len(samples) - self.capacity
                samples = samples[-self.capacity :]
            overflow = self.size + len(samples) - self.capacity
            if overflow > 0:
                self.read_at = (self.read_at + overflow) % self.capacity
                self.size -= overflow
                self.dropped += overflow
            at = (self.read_at + self.size) % self.capacity
            first = min(len(samples), self.capacity - at)
            self.data[at : at + first] = samples[:first]
            self.data[: len(samples) - first] = samples[first:]
            self.size += len(samples)

    def read(self, n: int) -> np.ndarray:
        out = np.zeros(n, np.float32)
        with self._lock:
            take = min(n, self.size)
            first = min(take, self.capacity - self.read_at)
            out[:first] = self.data[self.read_at : self.read_at + first]
            out[first:take] = self.data[: take - first]
            self.read_at = (self.read_at + take) % self.capacity
            self.size -= take
            if take < n:
                self.underruns += 1
        return out


class Capture:
    """Microphone blocks (any rate, any channels) -> 16 kHz mono appends of FRAME_SAMPLES samples."""

    def __init__(self, device_rate: int):
        self.resampler = StreamResampler(device_rate, INPUT_RATE)
        self.pending = np.zeros(0, np.float32)

    def push(self, block: np.ndarray) -> list[np.ndarray]:
        self.pending = np.concatenate([self.pending, self.resampler.process(to_mono(block))])
        whole = len(self.pending) // FRAME_SAMPLES * FRAME_SAMPLES
        frames = [self.pending[i : i + FRAME_SAMPLES] for i in range(0, whole, FRAME_SAMPLES)]
        self.pending = self.pending[whole:]
        return frames


def append_message(samples: np.ndarray) -> str:
    pcm = np.clip(np.round(samples.astype(np.float64) * 32768.0), -32768, 32767).astype("<i2")
    return json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm.tobytes()).decode(),
                       "sample_rate": INPUT_RATE})


class Display:
    """Server events -> the terminal and the speaker's ring buffer."""

    def __init__(self, ring: RingBuffer, output_rate: int, out=None, err=None):
        self.ring, self.output_rate = ring, output_rate
        self.out, self.err = out or sys.stdout, err or sys.stderr
        self.playback: StreamResampler | None = None
        self.line: str | None = None  # whose words the current line holds
        self.transcript = self.text = ""
        self.done: dict | None = None
        self.errors: list[dict] = []

    def _say(self, who: str, delta: str) -> None:
        if self.line != who:
            self.out.write(("\n" if self.line else "") + f"[{who}] ")
            self.line = who
        self.out.write(delta)
        self.out.flush()

    def handle(self, event: dict) -> bool:
        """Take one server event; True when the conversation is over."""
        kind = event.get("type")
        if kind == "response.audio.delta":
            if self.playback is None:
                self.playback = StreamResampler(int(event["sample_rate"]), self.output_rate)
            pcm = np.frombuffer(base64.b64decode(event["delta"]), "<i2").astype(np.float32) / 32767.0
            self.ring.write(self.playback.process(pcm))
        elif kind == "conversation.item.input_audio_transcription.delta":
            # the text from *_start on (absent within the server's --text-window) replaces what is held from there
            self.transcript = self.transcript[:event.get("transcript_start", 0)] + event["transcript"]
            self._say("user", event["delta"])
        elif kind == "response.text.delta":
            self.text = self.text[:event.get("text_start", 0)] + event["text"]
            self._say("assistant", event["delta"])
        elif kind == "response.function.delta":
            self._say("function", event["delta"])
        elif kind == "error":
            self.errors.append(event["error"])
            print(f"\nerror: {event['error']['code']}: {event['error']['message']}", file=self.err)
            return event["error"]["code"] == "server_busy"
        elif kind in ("response.done", "response.cancelled"):
            self.done = event
            if self.line:
                self.out.write("\n")
            return True
        return False


# ----------------------------------------------------------------------------------------------- devices


def list_devices(sd, out=None, err=None) -> int:
    """Print the audio devices; 1 with a clear message when there are none."""
    out, err = out or sys.stdout, err or sys.stderr
    devices = list(sd.query_devices())
    if not devices:
        print("no audio devices found: PortAudio sees no microphone or speaker on this machine", file=err)
        return 1
    for index, device in enumerate(devices):
        print(f"{index:3d}  {device['name']}  (in {device['max_input_channels']}, out "
              f"{device['max_output_channels']}, {device['default_samplerate']:g} Hz)", file=out)
    return 0


class DeviceError(RuntimeError):
    pass


def open_streams(sd, source: dict, sink: dict, on_input, on_output, *, channels: int, input_device=None,
                 output_device=None):
    """The microphone and speaker streams (not started); DeviceError naming the device that would not open."""
    try:
        mic = sd.InputStream(samplerate=int(source["default_samplerate"]), channels=channels, dtype="float32",
                             device=input_device, blocksize=round(source["default_samplerate"] * 0.02),
                             callback=on_input)
    except Exception as exc:  # noqa: BLE001 - PortAudio errors have no common base we can import lazily
        raise DeviceError(f"could not open the microphone {source['name']!r}: {exc}; on macOS the terminal needs "
                          "Microphone access (System Settings > Privacy & Security > Microphone)") from None
    try:
        speaker = sd.OutputStream(samplerate=int(sink["default_samplerate"]), channels=1, dtype="float32",
                                  device=output_device, callback=on_output)
    except Exception as exc:  # noqa: BLE001
        mic.close()
        raise DeviceError(f"could not open the speaker {sink['name']!r}: {exc}") from None
    return mic, speaker


def _device(value: str | None):
    return int(value) if value is not None and value.isdigit() else value


async def converse(url: str, sd, stop: asyncio.Event, *, system_prompt: str | None = None, seed: int = 0,
                   api_key: str | None = None, input_device=None, output_device=None, out=None,
                   err=None) -> Display:
    """Hold one conversation until `stop` is set (then commit and wait for response.done) or the server ends it."""
    from websockets.asyncio.client import connect
    from websockets.exceptions import ConnectionClosed

    source = sd.query_devices(input_device, "input")
    sink = sd.query_devices(output_device, "output")
    in_rate, out_rate = int(source["default_samplerate"]), int(sink["default_samplerate"])
    channels = max(1, min(2, int(source["max_input_channels"])))
    ring = RingBuffer(out_rate * 30)
    display = Display(ring, out_rate, out, err)
    capture = Capture(in_rate)
    loop = asyncio.get_running_loop()
    blocks: asyncio.Queue = asyncio.Queue()

    def on_input(indata, frames, time, status) -> None:  # the audio thread
        loop.call_soon_threadsafe(blocks.put_nowait, np.array(indata, np.float32))

    def on_output(outdata, frames, time, status) -> None:  # the audio thread
        outdata[:] = ring.read(frames)[:, None]

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with connect(url, additional_headers=headers, max_size=None) as ws:
        created = json.loads(await ws.recv())
        if created.get("type") != "session.created":
            display.handle(created)
            return display
        session = {"seed": seed} | ({"system_prompt": system_prompt} if system_prompt is not None else {})
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        updated = json.loads(await ws.recv())
        if updated.get("type") != "session.updated":
            display.handle(updated)
            return display
        print(f"connected to {updated['session']['model']}; speak (Ctrl-C to finish)", file=display.err)

        async def receive() -> None:
            try:
                async for frame in ws:
                    if display.handle(json.loads(frame)):
                        return
            except ConnectionClosed:
                pass

        try:
            streams = open_streams(sd, source, sink, on_input, on_output, channels=channels,
                                   input_device=input_device, output_device=output_device)
        except DeviceError:
            await ws.send(json.dumps({"type": "session.cancel"}))
            raise
        receiver = asyncio.create_task(receive())
        try:
            with streams[0], streams[1]:
                stopping = asyncio.create_task(stop.wait())
                while not receiver.done():
                    getting = asyncio.create_task(blocks.get())
                    finished, _ = await asyncio.wait({getting, stopping, receiver},
                                                     return_when=asyncio.FIRST_COMPLETED)
                    if getting not in finished:
                        getting.cancel()
                        break
                    for frame in capture.push(getting.result()):
                        await ws.send(append_message(frame))
                stopping.cancel()
                if not receiver.done():
                    await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
                    await receiver
                deadline = loop.time() + ring.size / out_rate + 1.0
                while ring.size and loop.time() < deadline:  # let the speaker finish the answer
                    await asyncio.sleep(0.02)
        except ConnectionClosed:
            pass
        finally:
            receiver.cancel()
    return display


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", nargs="?", help="ws://HOST:PORT/v1/realtime")
    parser.add_argument("--system-prompt", default=None, help="system prompt (default: the checkpoint's)")
    parser.add_argument("--seed", type=int, default=0, help="speech sampling seed (default 0)")
    parser.add_argument("--input-device", default=None, help="microphone: index or name (default: the system's)")
    parser.add_argument("--output-device", default=None, help="speaker: index or name (default: the system's)")
    parser.add_argument("--api-key", default=os.environ.get("VOICECHAT_API_KEY"),
                        help="sent as `Authorization: Bearer KEY` (default: $VOICECHAT_API_KEY)")
    parser.add_argument("--list-devices", action="store_true", help="list the audio devices and exit")
    return parser


def main(argv=None, sd=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.list_devices and not args.url:
        parser.error("give the server's URL (ws://HOST:PORT/v1/realtime), or --list-devices")
    try:
        sd = sd or load_sounddevice()
    except MissingAudioBackend as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.list_devices:
        return list_devices(sd)

    async def run() -> Display:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        try:
            loop.add_signal_handler(signal.SIGINT, stop.set)  # Ctrl-C commits instead of killing the socket
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread, or Windows
            pass
        return await converse(args.url, sd, stop, system_prompt=args.system_prompt, seed=args.seed,
                              api_key=args.api_key, input_device=_device(args.input_device),
                              output_device=_device(args.output_device))

    try:
        display = asyncio.run(run())
    except DeviceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - one line for the user: a refused socket, an unknown device
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0 if display.done is not None and not display.errors else 1


if __name__ == "__main__":
    sys.exit(main())
