"""Declare a tool over /v1/realtime and answer the model's calls to it.

    python examples/realtime_tool_client.py ws://127.0.0.1:8080/v1/realtime question.wav \
        --instructions "Be concise."

The session declares one tool, `get_weather(city)`. The file is streamed as 16 kHz PCM16 in 80 ms appends
(then --extra-seconds of silence, default 3) and committed; at most WINDOW appends are ahead of the audio that
came back, as a live microphone would be, so an answer is read back within a few frames of its call. Whenever
the model calls the tool (response.function_call_arguments.done), this client runs its local `get_weather` and
answers with conversation.item.create {type: "function_call_output", call_id, output}; the server reads the
answer back to the model on its function channel. Each call and answer is printed:

    [call] call_3f9c0a1b2c3d4e5f get_weather {"city":"Paris"}
    [answer] call_3f9c0a1b2c3d4e5f {"city": "Paris", "sky": "clear", "temp_c": 21}

Exit status: 0 on response.done, 1 on a refused session.update or connection.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import sys

import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus, InvalidURI

from orchestrator.audio import AudioError, read_audio, to_pcm16

RATE, FRAME = 16_000, 1280
WINDOW = 2  # appends sent whose audio has not come back (the pipelined gateway answers one append later)
TOOLS = [{
    "type": "function", "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "the city's name"}},
                   "required": ["city"]},
}]


def get_weather(city: str) -> dict:
    """A stand-in for a real weather service."""
    return {"city": city, "sky": "clear", "temp_c": 21}


LOCAL = {"get_weather": get_weather}


def answer(call: dict) -> dict:
    """The conversation.item.create answering one response.function_call_arguments.done event."""
    try:
        output = json.dumps(LOCAL[call["name"]](**json.loads(call["arguments"])))
    except (KeyError, TypeError, ValueError) as exc:  # a call this client cannot run: say so to the model
        output = json.dumps({"error": f"{call['name']}: {exc}"})
    return {"type": "conversation.item.create",
            "item": {"type": "function_call_output", "call_id": call["call_id"], "output": output}}


def appends(samples: np.ndarray) -> list[dict]:
    """80 ms input_audio_buffer.append messages."""
    return [{"type": "input_audio_buffer.append", "sample_rate": RATE,
             "audio": base64.b64encode(to_pcm16(samples[i:i + FRAME], 32768.0).astype("<i2").tobytes()).decode()}
            for i in range(0, len(samples), FRAME)]


async def converse(url: str, samples: np.ndarray, instructions: str | None, out=sys.stdout) -> int:
    """Run one session; returns the exit status."""
    async with connect(url, max_size=None) as ws:
        await ws.recv()  # session.created
        session = {"tools": TOOLS, "tool_choice": "auto", **({"instructions": instructions} if instructions else {})}
        await ws.send(json.dumps({"type": "session.update", "session": session}))
        reply = json.loads(await ws.recv())
        if reply["type"] != "session.updated":
            print(f"error: {reply['error']['message']}", file=sys.stderr)
            return 1

        window = asyncio.Semaphore(WINDOW)

        async def listen() -> int:
            async for message in ws:
                event = json.loads(message)
                kind = event["type"]
                if kind == "response.audio.delta":
                    window.release()
                elif kind == "response.function_call_arguments.done":
                    print(f"[call] {event['call_id']} {event['name']} {event['arguments']}", file=out)
                    reply = answer(event)
                    await ws.send(json.dumps(reply))
                    print(f"[answer] {event['call_id']} {reply['item']['output']}", file=out)
                elif kind == "error":
                    print(f"[error] {event['error']['code']}: {event['error']['message']}", file=out)
                elif kind == "response.done":
                    return 0
            return 1

        listening = asyncio.create_task(listen())
        for message in appends(samples):
            await window.acquire()
            await ws.send(json.dumps(message))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        return await listening


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="ws://HOST:PORT/v1/realtime")
    parser.add_argument("audio", help="an audio file (any rate and channel count)")
    parser.add_argument("--instructions", default=None, help="the system prompt the tools are listed after")
    parser.add_argument("--extra-seconds", type=float, default=3.0, help="silence after the file (default 3)")
    args = parser.parse_args(argv)
    try:
        samples = read_audio(args.audio, RATE)
    except AudioError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    samples = np.concatenate([samples, np.zeros(round(args.extra_seconds * RATE), np.float32)])
    try:
        return asyncio.run(converse(args.url, samples, args.instructions))
    except (OSError, InvalidStatus, InvalidURI) as exc:
        print(f"error: cannot connect to {args.url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
