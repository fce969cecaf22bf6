"""`orchestrator`: run VoiceChat turns across the four network services.

    orchestrator offline IN.wav [--model DIR] [-p PROMPT] [--seed N] [--extra-decoding-seconds S]
                                [--output-audio OUT.wav] [--dump OUT.npz] [--json]
                                [--services perception=HOST:PORT,llm=...,tts=...,codec=...] [--in-process]

Without service addresses the four services start as child processes on free local ports and stop when the
command ends; `--in-process` runs the engines inside this process instead.
"""

from __future__ import annotations

import argparse
import json
import sys
import zipfile
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from orchestrator.audio import AudioError, check_writable, read_audio, write_wav
from orchestrator.connect import ServiceError, connect, parse_services
from orchestrator.model import resolve_model
from orchestrator.text import TextDecoder
from orchestrator.timeline import OfflineResult, append_silence, run_offline
from services.common.checkpoint import CheckpointError
from services.common.config import ConfigError, VoiceChatConfig


class UsageError(ValueError):
    """A command line that cannot run; reported in one line."""


def _add_connection_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", help="converted checkpoint folder (default $VOICECHAT_MODEL, else the demo)")
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--services", type=parse_services, metavar="perception=HOST:PORT,llm=...,tts=...,codec=...",
                       help="use running services instead of starting them")
    where.add_argument("--in-process", action="store_true", help="run the engines in this process")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orchestrator", description="Full-duplex VoiceChat over four services.")
    commands = parser.add_subparsers(dest="command", required=True)
    offline = commands.add_parser("offline", help="one spoken turn: transcript, answer text and answer audio")
    offline.add_argument("input", type=Path, help="audio file (any rate, mono or stereo)")
    _add_connection_flags(offline)
    offline.add_argument("-p", "--system-prompt", default=None, help="system prompt (default: the checkpoint's)")
    offline.add_argument("--seed", type=int, default=0, help="speech sampling seed (default 0)")
    offline.add_argument("--extra-decoding-seconds", type=float, default=3.0,
                         help="silence appended so the model can finish answering (default 3)")
    offline.add_argument("--output-audio", type=Path, default=Path("response.wav"),
                         help="response WAV, 22050 Hz mono PCM16 (default response.wav)")
    offline.add_argument("--force", action="store_true", help="overwrite an existing output file")
    offline.add_argument("--dump", type=Path, help="write every intermediate array to this .npz")
    offline.add_argument("--json", action="store_true", help="print one JSON object instead of text lines")
    return parser


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


def offline(args: argparse.Namespace) -> int:
    if args.seed < 0:
        raise UsageError(f"--seed {args.seed}: must be non-negative")
    if args.extra_decoding_seconds < 0:
        raise UsageError(f"--extra-decoding-seconds {args.extra_decoding_seconds}: must be non-negative")
    check_writable(args.output_audio, overwrite=args.force)
    if args.dump:
        check_writable(args.dump, overwrite=args.force)
    model = resolve_model(args.model)
    config = VoiceChatConfig.load(model)
    waveform = read_audio(args.input, config.input_sample_rate)
    waveform = append_silence(waveform, args.extra_decoding_seconds, config.input_sample_rate)
    decoder = TextDecoder(model, config)
    prompt = config.default_system_prompt if args.system_prompt is None else args.system_prompt
    with connect(model, services=args.services, in_process=args.in_process) as clients:
        result = run_offline(clients, waveform, system_prompt=prompt, seed=args.seed)
    text = decoder.decode(result.text_tokens)
    function_text = decoder.decode(result.function_tokens)
    write_wav(args.output_audio, result.audio, config.output_sample_rate)
    meta = {
        "transcript": result.perception.transcript,
        "text": text,
        "function_text": function_text,
        "prompt_frames": result.prompt_frames,
        "sample_rate": config.output_sample_rate,
    }
    if args.dump:
        dump_offline(args.dump, result, meta)
    if args.json:
        report = {**meta, "frames": int(result.text_tokens.shape[0]), "output_audio": str(args.output_audio),
                  "seconds": {k: round(v, 4) for k, v in result.seconds.items()}}
        print(json.dumps(report, ensure_ascii=False))
    else:
        print(f"[user] {result.perception.transcript}")
        print(text)
        if function_text:
            print(f"[function] {function_text}")
        print(f"wrote {args.output_audio} ({len(result.audio) / config.output_sample_rate:.2f} s)", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return {"offline": offline}[args.command](args)
    except (UsageError, AudioError, CheckpointError, ConfigError, ServiceError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
