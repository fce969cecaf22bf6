"""`python -m services.tts --model DIR --port N`: the EAR-TTS speech service."""

from __future__ import annotations

import argparse

from protos.voicechat.v1 import speech_pb2_grpc
from services.common.batching import BatchOptions
from services.common.cli import ServiceSpec, add_max_context_flag, add_split_matmuls_flag, exit_process, run_service
from services.common.engine_thread import EngineThread
from services.common.loading import LoadOptions
from services.tts.engine import DEFAULT_MAX_PREFIX_STEPS
from services.tts.service import SERVICE_NAME, SpeechServicer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--float32-weights", action="store_true",
        help="keep float32 copies of the weights whose matmuls run in float32 (faster frames, identical outputs, "
             "twice those weights' memory)",
    )
    add_split_matmuls_flag(parser)
    add_max_context_flag(parser, "the backbone's global layers (its local layers keep a fixed window already)")
    parser.add_argument(
        "--max-prefix-steps", type=int, default=DEFAULT_MAX_PREFIX_STEPS,
        help="most system-prompt prefix steps a session may ask for at open (one per prompt position after the "
             f"first; default {DEFAULT_MAX_PREFIX_STEPS})",
    )


def build(args: argparse.Namespace) -> ServiceSpec:
    if args.max_prefix_steps < 0:
        raise ValueError(f"--max-prefix-steps {args.max_prefix_steps}: must not be negative")
    engine_thread = EngineThread("tts-engine")
    servicer = SpeechServicer(engine_thread, batching=BatchOptions.from_args(args))
    return ServiceSpec(
        registrations=[(speech_pb2_grpc.add_SpeechServiceServicer_to_server, servicer)],
        service_names=[SERVICE_NAME],
        load=lambda: servicer.load(args.model, LoadOptions.from_args(args), args.max_prefix_steps),
        close=engine_thread.close,
        metrics=servicer.metrics,
    )


if __name__ == "__main__":
    exit_process(run_service(build, prog="services.tts", description="EAR-TTS: text tokens to codec codes",
                             add_arguments=add_arguments))
