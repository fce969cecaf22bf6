"""`python -m services.codec --model DIR --port N`: the codec service (encode, decode, streaming decode)."""

from __future__ import annotations

import argparse

from services.codec.engine import DEFAULT_MAX_FRAMES
from services.codec.service import build_spec
from services.common.batching import BatchOptions
from services.common.cli import ServiceSpec, exit_process, run_service


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-frames",
        type=int,
        default=DEFAULT_MAX_FRAMES,
        help=f"most code frames (80 ms each) one Encode or Decode call may carry (default {DEFAULT_MAX_FRAMES})",
    )


def build(args: argparse.Namespace) -> ServiceSpec:
    if args.max_frames <= 0:
        raise ValueError(f"--max-frames {args.max_frames}: must be positive")
    return build_spec(args.model, args.max_frames, BatchOptions.from_args(args))


if __name__ == "__main__":
    exit_process(
        run_service(
            build,
            prog="services.codec",
            description="VoiceChat codec service: 22.05 kHz audio <-> 31-codebook codes, and causal streaming decode",
            add_arguments=add_arguments,
        )
    )
