"""`orchestrator`: run VoiceChat turns across the four network services.

    orchestrator offline IN.wav [--model DIR] [-p PROMPT] [--seed N] [--extra-decoding-seconds S]
                                [--output-audio OUT.wav] [--dump OUT.npz] [--json]
                                [--services perception=HOST:PORT,llm=...,tts=...,codec=...] [--in-process]

    orchestrator stream IN.wav [--model DIR] [-p PROMPT] [--seed N] [--chunk-ms M] [--realtime] [--profile]
                               [--output-audio OUT.wav] [--dump OUT.npz] [--sequential] [--max-streaming-seconds S]
                               [--services ...] [--in-process]
    orchestrator serve [--port N] [--host H] [--max-sessions 4] [--model DIR] [--services ...] [--in-process]
                       [--metrics-port N] [--metrics-host H] [--latency-budget-ms MS] [--tools MODULE]
                       [--tool-timeout S] [--api-key KEY] [--tls-cert PEM --tls-key PEM] [--text-window CHARS]

Without service addresses the four services start as child processes on free local ports and stop when the
command ends; `--in-process` runs the engines inside this process instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from orchestrator.audio import AudioError, check_writable, read_audio, write_wav
from orchestrator.clients import MAX_MESSAGE_BYTES
from orchestrator.connect import (
    ServiceError,
    UsageError,
    add_connection_flags,
    add_failover_flags,
    batch_flags,
    connect,
    connection_from_args,
    reconnected,
)
from orchestrator.latency import add_budget_flag
from orchestrator.lockstep import FrameTicker
from orchestrator.model import MODEL_ENV, resolve_model
from orchestrator.profile import MonotonicClock
from orchestrator.realtime import OnlineSessionFactory, add_realtime_flags, server_from_args
from orchestrator.session import ContextLimitError, OnlineSession, transcript_vocabulary
from orchestrator.stream_clients import connect_streams
from orchestrator.supervisor import Supervisor
from orchestrator.text import TextDecoder, add_text_window_flag, text_window_from_args
from orchestrator.timeline import OfflineResult, append_silence, run_offline
from services.common.checkpoint import CheckpointError
from services.common.cli import exit_process
from services.common.config import ConfigError, VoiceChatConfig
from services.common.errors import EXIT_BIND, BindError
from services.common.loading import process_settings
from services.common.metrics import Metrics, add_metrics_flags, start_from_args
from services.common.security import load_tls
from services.common.server import DEFAULT_GRACE_S


def _add_turn_flags(parser: argparse.ArgumentParser, extra_help: str) -> None:
    """What `offline` and `stream` share: the input file, where the networks run, prompt, seed, trailing silence."""
    parser.add_argument("input", type=Path, help="audio file (any rate, mono or stereo)")
    add_connection_flags(parser)
    parser.add_argument("-p", "--system-prompt", default=None, help="system prompt (default: the checkpoint's)")
    parser.add_argument("--seed", type=int, default=0, help="speech sampling seed (default 0)")
    parser.add_argument("--extra-decoding-seconds", type=float, default=3.0, help=extra_help)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orchestrator", description="Full-duplex VoiceChat over four services.")
    commands = parser.add_subparsers(dest="command", required=True)
    offline = commands.add_parser("offline", help="one spoken turn: transcript, answer text and answer audio")
    _add_turn_flags(offline, "silence appended so the model can finish answering (default 3)")
    offline.add_argument("--output-audio", type=Path, default=Path("response.wav"),
                         help="response WAV, 22050 Hz mono PCM16 (default response.wav)")
    offline.add_argument("--force", action="store_true", help="overwrite an existing output file")
    offline.add_argument("--dump", type=Path, help="write every intermediate array to this .npz")
    offline.add_argument("--json", action="store_true", help="print one JSON object instead of text lines")
    _add_stream_parser(commands)
    _add_serve_parser(commands)
    return parser


def _add_stream_parser(commands) -> None:
    stream = commands.add_parser("stream",
                                  help="the online session: push the file in chunks, print events as they come")
    _add_turn_flags(stream, "silence pushed after the file so the model can finish answering (default 3)")
    add_failover_flags(stream)
    stream.add_argument("--chunk-ms", type=float, default=80.0, help="push size in milliseconds (default 80)")
    stream.add_argument("--realtime", action="store_true", help="pace the pushes like a live microphone")
    stream.add_argument("--sequential", action="store_true", help="run the stages one after another (no pipelining)")
    stream.add_argument("--max-streaming-seconds", type=float, default=None, help="bound on the session's input")
    stream.add_argument("--profile", action="store_true",
                        help="print per-stage timings and the real-time factor (JSON)")
    stream.add_argument("--drop-cold-frames", type=int, default=5, help="frames left out of --profile (default 5)")
    stream.add_argument("--output-audio", type=Path, default=Path("response.wav"),
                        help="the audio events as one WAV, 22050 Hz mono PCM16 (default response.wav)")
    stream.add_argument("--force", action="store_true", help="overwrite an existing output file")
    stream.add_argument("--dump", type=Path, help="write the streamed arrays and events to this .npz")


def _add_serve_parser(commands) -> None:
    serve = commands.add_parser("serve", help="the gRPC conversation service (one duplex stream per conversation)")
    add_connection_flags(serve)
    add_failover_flags(serve)
    serve.add_argument("--host", default="[::]", help="address to bind (default [::])")
    serve.add_argument("--port", type=int, default=0, help="port to bind; 0 picks a free one (default)")
    serve.add_argument("--max-sessions", type=int, default=4, help="concurrent conversations (default 4)")
    serve.add_argument("--max-streaming-seconds", type=float, default=600.0,
                       help="upper bound on one conversation's input audio (default 600)")
    serve.add_argument("--sequential", action="store_true", help="run each session's stages without pipelining")
    add_text_window_flag(serve)
    serve.add_argument("--drain-seconds", type=float, default=DEFAULT_GRACE_S,
                       help="on SIGTERM: new conversations are refused and running ones get this many seconds, then "
                            f"end with an error (default {DEFAULT_GRACE_S:g})")
    serve.add_argument("--frame-tick-ms", type=float, default=0.0,
                       help="send every conversation's next frame to the services on one shared clock's tick, this "
                            "many ms apart, so each service steps them as one batch (a frame waits at most one "
                            "tick; 80 is the frame's length; default 0: each frame goes as soon as it is ready)")
    serve.add_argument("--no-realtime", action="store_true", help="serve gRPC only, without ws://.../v1/realtime")
    serve.add_argument("--alias", default=None, help="model id the realtime session.updated reports")
    serve.add_argument("--tools", default=None, metavar="MODULE",
                       help="a Python module whose typed, documented functions are tools every session declares; "
                            "the server runs their calls and feeds the results back (see docs/protocol.md)")
    serve.add_argument("--tool-timeout", type=float, default=10.0,
                       help="seconds a --tools call may run before its output is a timeout error (default 10)")
    add_realtime_flags(serve)
    add_metrics_flags(serve)
    add_budget_flag(serve)


def dump_offline(path: Path, result: OfflineResult, meta: dict) -> None:
    arrays = {
        "mel": result.perception.mel,
        "encoder": result.perception.encoder,
        "audio_embeds": result.audio_embeds,
        "text_tokens": result.text_tokens,
        "function_tokens": result.function_tokens,
        "audio_codes": result.audio_codes,
        "audio": result.audio,
        "prompt_codes": result.prompt_codes,
        "meta": np.array(json.dumps(meta, ensure_ascii=False, sort_keys=True)),
    }
    save_npz(path, arrays)


def save_npz(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """An uncompressed .npz whose bytes depend only on the arrays (fixed zip timestamps), written atomically."""
    tmp = path.with_name(f".{path.name}.part")
    try:
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_STORED) as archive:
            for name, value in arrays.items():
                info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
                value = np.asarray(value)
                if not value.flags.c_contiguous:  # one byte layout whatever produced the array
                    value = value.copy(order="C")
                with archive.open(info, "w", force_zip64=True) as member:
                    np.lib.format.write_array(member, value, allow_pickle=False)
        tmp.replace(path)
    finally:
        tmp.unlink(missing_ok=True)


def model_for(args: argparse.Namespace) -> Path:
    """The checkpoint this command reads its config, tokenizer and transcript vocabulary from. With --services it
    must be named: running services bring their own checkpoint, and the demo would silently not match it."""
    if args.services is not None and not (args.model or os.environ.get(MODEL_ENV)):
        raise UsageError(f"--services needs --model DIR (or ${MODEL_ENV}): the checkpoint those services run, whose "
                         "config, tokenizer and transcript vocabulary this orchestrator reads")
    return resolve_model(args.model)


def prepare_turn(args: argparse.Namespace) -> tuple[Path, VoiceChatConfig, np.ndarray, TextDecoder]:
    """What `offline` and `stream` share: flags checked and outputs writable before any work, then the model,
    its config, the input at 16 kHz with the decoding silence appended, and the text decoder."""
    if args.seed < 0:
        raise UsageError(f"--seed {args.seed}: must be non-negative")
    if args.extra_decoding_seconds < 0:
        raise UsageError(f"--extra-decoding-seconds {args.extra_decoding_seconds}: must be non-negative")
    check_writable(args.output_audio, overwrite=args.force)
    if args.dump:
        check_writable(args.dump, overwrite=args.force)
    model = model_for(args)
    config = VoiceChatConfig.load(model)
    waveform = read_audio(args.input, config.input_sample_rate)
    waveform = append_silence(waveform, args.extra_decoding_seconds, config.input_sample_rate)
    return model, config, waveform, TextDecoder(model, config)


def offline_max_seconds(config: VoiceChatConfig, limit_bytes: int = MAX_MESSAGE_BYTES) -> float:
    """The longest input (decoding silence included) one offline turn carries over gRPC: its perception call
    sends the whole waveform (float32) and gets back every frame's encoder output and embedding and every mel
    frame (float32), and each message must fit `limit_bytes`. 5% is left for the messages' framing."""
    audio = config.audio_config
    frame = config.input_frame_samples
    request = frame * 4
    reply = (audio.encoder.d_model + config.text_config.hidden_size
             + frame / audio.preprocessor.hop_length * audio.preprocessor.features) * 4
    return 0.95 * limit_bytes / max(request, reply) * config.frame_duration


def check_offline_length(args: argparse.Namespace, config: VoiceChatConfig, waveform: np.ndarray) -> None:
    """UsageError before any work when the input is past what one offline turn carries over gRPC."""
    seconds = len(waveform) / config.input_sample_rate
    limit = offline_max_seconds(config)
    if not args.in_process and seconds > limit:
        raise UsageError(f"{args.input}: {seconds / 60:.1f} min of audio (with the decoding silence) is past the "
                         f"{limit / 60:.1f} min one offline turn carries over gRPC with this checkpoint (its "
                         f"perception call would pass the {MAX_MESSAGE_BYTES >> 20} MiB message limit); use "
                         "`orchestrator stream` for longer audio, split the input, or pass --in-process")


def offline(args: argparse.Namespace) -> int:
    model, config, waveform, decoder = prepare_turn(args)
    check_offline_length(args, config, waveform)
    prompt = config.default_system_prompt if args.system_prompt is None else args.system_prompt
    with connect(model, **connection_from_args(args)) as clients:
        result = run_offline(clients, waveform, system_prompt=prompt, seed=args.seed)
    text = decoder.decode(result.text_tokens)
    function_text = decoder.decode(result.function_tokens)
    meta = {
        "transcript": result.perception.transcript,
        "text": text,
        "function_text": function_text,
        "prompt_frames": result.prompt_frames,
        "sample_rate": config.output_sample_rate,
    }
    failure = save((args.output_audio, lambda: write_wav(args.output_audio, result.audio, config.output_sample_rate)),
                   (args.dump, lambda: dump_offline(args.dump, result, meta)))
    if args.json:
        report = {**meta, "frames": int(result.text_tokens.shape[0]),
                  "output_audio": None if failure else str(args.output_audio),
                  "seconds": {k: round(v, 4) for k, v in result.seconds.items()}}
        print(json.dumps(report, ensure_ascii=False))
    else:
        print(f"[user] {result.perception.transcript}")
        print(text)
        if function_text:
            print(f"[function] {function_text}")
    if failure:  # printed after the answer, which is not lost with the file
        raise failure
    if not args.json:
        print(f"wrote {args.output_audio} ({len(result.audio) / config.output_sample_rate:.2f} s)", file=sys.stderr)
    return 0


def save(*writes: tuple[Path | None, Callable[[], object]]) -> AudioError | None:
    """Run each (path, write) whose path is set; the first that fails (a disk that filled or turned read-only
    since the check before the turn) stops them and comes back as one line naming its file."""
    for path, write in writes:
        if path is None:
            continue
        try:
            write()
        except OSError as exc:
            return AudioError(f"{path}: could not be written ({exc.strerror or exc}); the transcript and text are "
                              "printed above")
    return None


def stream(args: argparse.Namespace) -> int:
    if not args.chunk_ms > 0:
        raise UsageError(f"--chunk-ms {args.chunk_ms}: must be positive")
    if args.max_streaming_seconds is not None and not args.max_streaming_seconds > 0:
        raise UsageError(f"--max-streaming-seconds {args.max_streaming_seconds}: must be positive")
    if args.drop_cold_frames < 0:
        raise UsageError(f"--drop-cold-frames {args.drop_cold_frames}: must be non-negative")
    model, config, waveform, decoder = prepare_turn(args)
    chunk = max(1, round(args.chunk_ms * config.input_sample_rate / 1000))
    events = []

    def show(event) -> None:
        events.append(event)
        if event.kind == "assistant_text_delta":
            sys.stdout.write(event.delta)
            sys.stdout.flush()

    with connect_streams(model, **connection_from_args(args)) as clients:
        session = OnlineSession(clients, config, decoder, system_prompt=args.system_prompt, seed=args.seed,
                                max_streaming_seconds=args.max_streaming_seconds, pipelined=not args.sequential,
                                profile=args.profile, record=bool(args.dump), on_event=show,
                                rnnt_vocabulary=transcript_vocabulary(model, config))
        with session:
            drive(session, waveform, chunk, realtime=args.realtime, clock=MonotonicClock())
    failure = next((e for e in events if e.kind == "error"), None)
    if failure is not None:
        raise ServiceError(failure.message)
    audio_events = [e for e in events if e.kind == "audio"]
    audio = (np.concatenate([e.samples for e in audio_events]) if audio_events else np.zeros(0, np.float32))
    texts = {kind: "" for kind in ("user_transcript_delta", "assistant_text_delta", "function_delta")}
    for event in events:
        if event.kind in texts:
            texts[event.kind] = event.text
    print()
    print(f"[user] {texts['user_transcript_delta']}")
    if texts["function_delta"]:
        print(f"[function] {texts['function_delta']}")
    failure = save((args.output_audio, lambda: write_wav(args.output_audio, audio, config.output_sample_rate)),
                   (args.dump, lambda: dump_stream(args.dump, session, events, texts)))
    if failure:
        raise failure
    if args.profile:
        print(json.dumps(session.profile.summary(drop_first=args.drop_cold_frames)))
    print(f"wrote {args.output_audio} ({len(audio) / config.output_sample_rate:.2f} s)", file=sys.stderr)
    return 0


def drive(session, waveform: np.ndarray, chunk: int, *, realtime: bool, clock) -> None:
    """Push `waveform` in `chunk`-sample pieces (at the audio's own pace with `realtime`), then flush."""
    start = clock.now()
    rate = session.sample_rate
    for offset in range(0, len(waveform), chunk):
        if realtime:  # a live microphone delivers a chunk once its last sample has been spoken
            clock.sleep(start + min(offset + chunk, len(waveform)) / rate - clock.now())
        session.push_audio(waveform[offset : offset + chunk], rate)
    session.flush(pad_partial=True)


def dump_stream(path: Path, session, events: list, texts: dict[str, str]) -> None:
    records = session.records
    hidden = session.prompt_embeds.shape[1]
    embeds = np.stack([r.audio_embedding for r in records]) if records else np.zeros((0, hidden), np.float32)
    frame_index = {kind: np.array([e.frame_index for e in events if e.kind == kind], dtype=np.int64)
                   for kind in ("assistant_text_delta", "function_delta", "user_transcript_delta")}
    audio_events = [e for e in events if e.kind == "audio"]
    meta = {
        "transcript": texts["user_transcript_delta"],
        "text": texts["assistant_text_delta"],
        "function_text": texts["function_delta"],
        "prompt_frames": session.prompt_positions,
        "frames": len(records),
        "sample_rate": session.config.output_sample_rate,
        "events": [e.describe() for e in events if e.kind not in ("audio", "error")],
    }
    arrays = {
        "encoder": np.stack([r.encoder_out for r in records]) if records else np.zeros((0, 0), np.float32),
        "audio_embeds": np.concatenate([session.prompt_embeds, embeds]),
        "text_tokens": np.array([r.text_id for r in records], dtype=np.int32),
        "function_tokens": np.array([r.function_id for r in records], dtype=np.int32),
        "raw_codes": np.stack([r.raw_codes for r in records]).astype(np.int32),
        "audio_codes": np.stack([e.audio_codes for e in audio_events]).astype(np.int32),
        "audio": np.concatenate([e.samples for e in audio_events]).astype(np.float32),
        "prompt_codes": session.prompt_codes,
        "frame_index_text": frame_index["assistant_text_delta"],
        "frame_index_function": frame_index["function_delta"],
        "frame_index_transcript": frame_index["user_transcript_delta"],
        "meta": np.array(json.dumps(meta, ensure_ascii=False, sort_keys=True)),
    }
    save_npz(path, arrays)


def serve(args: argparse.Namespace) -> int:
    from orchestrator.conversation import run_server

    if args.max_sessions <= 0:
        raise UsageError(f"--max-sessions {args.max_sessions}: must be positive")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: must be 0..65535")
    if not args.max_streaming_seconds > 0:
        raise UsageError(f"--max-streaming-seconds {args.max_streaming_seconds}: must be positive")
    if args.drain_seconds < 0:
        raise UsageError(f"--drain-seconds {args.drain_seconds}: must be zero or more")
    if args.frame_tick_ms < 0:
        raise UsageError(f"--frame-tick-ms {args.frame_tick_ms}: must be zero (off) or more")
    text_window = text_window_from_args(args)
    runner = tool_runner(args)
    ticker = FrameTicker(args.frame_tick_ms / 1000.0) if args.frame_tick_ms else None
    if args.api_key == "":
        raise UsageError("--api-key must not be empty (leave it out to accept every client)")
    tls = load_tls(args.tls_cert, args.tls_key)
    model = model_for(args)
    metrics = Metrics("orchestrator", frame_budget_s=VoiceChatConfig.load(model).frame_duration,
                      latency_budget_s=args.latency_budget_s)
    exposition = start_from_args(metrics, args)  # bound before the services start: fails at once
    children: list = []  # the services started here (none with --services or --in-process): supervised
    try:
        connection = connection_from_args(args)
        # the services batch up to every conversation the server admits (gRPC and realtime), not 16 of them
        sessions = args.max_sessions + (0 if args.no_realtime else args.realtime_max_sessions)
        connection["flags"] = batch_flags(connection["flags"], sessions, connection["replicas"])
        with connect_streams(model, **connection, children=children) as clients:
            supervisor = Supervisor(children, connected=reconnected(clients)) if children else None
            realtime = None
            if not args.no_realtime:
                factory = OnlineSessionFactory(clients, model, model_id=args.alias, pipelined=args.realtime_pipelined,
                                               runner=runner, ticker=ticker, text_window=text_window)
                realtime = server_from_args(args, factory, metrics)
            run_server(clients, model, host=args.host, port=args.port, max_sessions=args.max_sessions,
                       max_streaming_seconds=args.max_streaming_seconds, pipelined=not args.sequential,
                       realtime=realtime, drain_seconds=args.drain_seconds, metrics=metrics,
                       metrics_server=exposition, runner=runner, ticker=ticker, api_key=args.api_key, tls=tls,
                       supervisor=supervisor, text_window=text_window)
    finally:
        if exposition is not None:
            exposition.stop()
        if runner is not None:
            runner.close()
    return 0


def tool_runner(args: argparse.Namespace):
    """The --tools module's runner (None without the flag); UsageError naming what is wrong with it."""
    from orchestrator.tool_runner import ToolRunner

    if args.tools is None:
        return None
    sys.path.insert(0, os.getcwd())  # a module next to where the server starts, as `python -m` would find it
    try:
        return ToolRunner.from_module(args.tools, timeout_s=args.tool_timeout)
    except ValueError as exc:
        raise UsageError(f"--tools {args.tools}: {exc}") from None


def main(argv: Sequence[str] | None = None) -> int:
    process_settings()  # before an in-process engine runs
    parser = build_parser()
    args = parser.parse_args(argv)
    code = _run(args)
    if argv is None and getattr(args, "in_process", False):
        # As a program with engines on their own threads: MLX aborts in interpreter teardown (as the services
        # do, see exit_process), so leave once the output is flushed. Callers passing argv (tests) get the code.
        exit_process(code)
    return code


def _run(args: argparse.Namespace) -> int:
    try:
        return {"offline": offline, "stream": stream, "serve": serve}[args.command](args)
    except (UsageError, AudioError, CheckpointError, ConfigError, ServiceError, ContextLimitError,
            ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except BindError as exc:  # a port in use: one line, and the exit code that says so
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_BIND
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
