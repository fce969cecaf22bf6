"""The text window on the wire: a windowed event's start is a field (gRPC) or a key (realtime JSON) that is absent,
and the message byte for byte the one without it, while the text is within the window; `--text-window` on the
commands that serve sessions."""

from __future__ import annotations

import argparse

import pytest

from orchestrator.conversation import event_to_proto
from orchestrator.realtime import event_message
from orchestrator.session import Event
from orchestrator.text import DEFAULT_TEXT_WINDOW, add_text_window_flag, text_window_from_args
from protos.voicechat.v1 import conversation_pb2 as pb

TEXT_KINDS = ("assistant_text_delta", "function_delta")


def text_event(kind: str, start: int) -> Event:
    if kind == "user_transcript_delta":
        return Event(kind, 7, delta="ld", text="world", text_start=start)
    return Event(kind, 7, token_id=42, delta="ld", text="world", text_start=start)


@pytest.mark.parametrize("kind", TEXT_KINDS)
def test_a_text_delta_within_the_window_is_the_message_without_text_start(kind):
    field = "text" if kind == "assistant_text_delta" else "function"
    plain = pb.ConverseResponse(**{field: pb.TextDelta(frame_index=7, token_id=42, delta="ld", text="world")})
    within = event_to_proto(text_event(kind, 0), 22050)
    assert within.SerializeToString() == plain.SerializeToString()
    past = event_to_proto(text_event(kind, 6), 22050)
    assert past.SerializeToString() != plain.SerializeToString()
    parsed = pb.ConverseResponse.FromString(past.SerializeToString())
    assert getattr(parsed, field).text_start == 6 and getattr(parsed, field).text == "world"


def test_a_transcript_delta_within_the_window_is_the_message_without_transcript_start():
    plain = pb.ConverseResponse(transcript=pb.TranscriptDelta(frame_index=7, delta="ld", transcript="world"))
    within = event_to_proto(text_event("user_transcript_delta", 0), 22050)
    assert within.SerializeToString() == plain.SerializeToString()
    parsed = pb.ConverseResponse.FromString(event_to_proto(text_event("user_transcript_delta", 6), 22050)
                                            .SerializeToString())
    assert (parsed.transcript.transcript_start, parsed.transcript.transcript) == (6, "world")


def test_realtime_events_name_the_start_only_past_the_window():
    assert event_message(text_event("assistant_text_delta", 0), 22050) == {
        "type": "response.text.delta", "frame_index": 7, "token_id": 42, "delta": "ld", "text": "world"}
    assert event_message(text_event("function_delta", 6), 22050) == {
        "type": "response.function.delta", "frame_index": 7, "token_id": 42, "delta": "ld", "text": "world",
        "text_start": 6}
    assert event_message(text_event("user_transcript_delta", 0), 22050) == {
        "type": "conversation.item.input_audio_transcription.delta", "frame_index": 7, "delta": "ld",
        "transcript": "world"}
    assert event_message(text_event("user_transcript_delta", 6), 22050)["transcript_start"] == 6


def test_describe_names_text_start_only_past_the_window():
    assert text_event("assistant_text_delta", 0).describe() == {
        "kind": "assistant_text_delta", "frame_index": 7, "token_id": 42, "delta": "ld", "text": "world"}
    assert text_event("assistant_text_delta", 6).describe()["text_start"] == 6


def test_the_flag_defaults_to_the_window_and_zero_is_unbounded():
    parser = argparse.ArgumentParser()
    add_text_window_flag(parser)
    assert text_window_from_args(parser.parse_args([])) == DEFAULT_TEXT_WINDOW == 16384
    assert text_window_from_args(parser.parse_args(["--text-window", "0"])) is None
    assert text_window_from_args(parser.parse_args(["--text-window", "20"])) == 20


MESSAGE = ("error: --text-window -5: must be 0 (every text event carries the whole text) or a positive number of "
           "characters (default 16384)")


def test_serve_refuses_a_negative_text_window(tiny_checkpoint, capsys):
    from orchestrator import cli

    assert cli.main(["serve", "--model", str(tiny_checkpoint), "--text-window", "-5", "--in-process"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == MESSAGE


def test_the_standalone_gateway_refuses_a_negative_text_window(tiny_checkpoint, capsys):
    from orchestrator import realtime

    assert realtime.main(["--model", str(tiny_checkpoint), "--text-window", "-5", "--in-process"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == MESSAGE
