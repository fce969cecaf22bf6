"""Services started as several replicas (`--replicas NAME=N`): sessions spread over them round-robin, and each
session's events are the reference's, whichever replica stepped it."""

from __future__ import annotations

import json
import time

import numpy as np

from orchestrator.session import OnlineSession, transcript_vocabulary
from orchestrator.stream_clients import connect_streams
from orchestrator.text import TextDecoder
from services.common.config import VoiceChatConfig
from tests.conftest import load_golden

SESSIONS = 4


def rows_stepped(path) -> int:
    return sum(json.loads(line)["size"] for line in path.read_text().splitlines())


def test_sessions_spread_over_the_replicas_and_each_equals_the_reference(tiny_checkpoint, tmp_path):
    golden, meta = load_golden("online")
    wave = golden["waveform"]
    config = VoiceChatConfig.load(tiny_checkpoint)
    decoder, vocabulary = TextDecoder(tiny_checkpoint, config), transcript_vocabulary(tiny_checkpoint, config)
    flags = {name: [f"--step-log={tmp_path}/{name}-{{replica}}.jsonl"] for name in ("perception", "tts")}
    with connect_streams(tiny_checkpoint, replicas={"perception": 2, "tts": 2}, flags=flags) as clients:
        # the channels connect to every replica as they are made; round robin then alternates from the first
        # session on (without that connection the first sessions all go to whichever replica connected first)
        time.sleep(0.5)
        sessions = [OnlineSession(clients, config, decoder, record=True, rnnt_vocabulary=vocabulary)
                    for _ in range(SESSIONS)]
        events: list[list] = [[] for _ in sessions]
        for start in range(0, len(wave), 1280):  # the sessions' frames side by side, so replicas batch them
            for mine, session in zip(events, sessions, strict=True):
                mine += session.push_audio(wave[start : start + 1280])
        for mine, session in zip(events, sessions, strict=True):
            mine += session.flush(pad_partial=True)
            session.close()
    for mine, session in zip(events, sessions, strict=True):
        assert [e.describe() for e in mine if e.kind != "audio"] == meta["events"]
        codes = np.stack([e.audio_codes for e in mine if e.kind == "audio"])
        assert np.array_equal(codes, golden["audio_codes"])
        assert np.array_equal([r.text_id for r in session.records], golden["text_tokens"])
    frames = meta["frames"]
    per_replica = [rows_stepped(tmp_path / f"perception-{r}.jsonl") for r in range(2)]
    assert per_replica == [SESSIONS // 2 * frames] * 2, per_replica
    speech = [rows_stepped(tmp_path / f"tts-{r}.jsonl") for r in range(2)]
    assert speech[0] == speech[1] > 0, speech
