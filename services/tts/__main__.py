"""`python -m services.tts --model DIR --port N`: the EAR-TTS speech service."""

from __future__ import annotations

import argparse

from protos.voicechat.v1 import speech_pb2_grpc
from services.common.cli import ServiceSpec, exit_process, run_service
from services.common.engine_thread import EngineThread
from services.tts.service import SERVICE_NAME, SpeechServicer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--float32-weights", action="store_true",
        help="keep float32 copies of the weights whose matmuls run in float32 (faster frames, identical outputs, "
             "twice those weights' memory)",
    )


def build(args: argparse.Namespace) -> ServiceSpec:
    engine_thread = EngineThread("tts-engine")
    servicer = SpeechServicer(engine_thread)
    return ServiceSpec(
        registrations=[(speech_pb2_grpc.add_SpeechServiceServicer_to_server, servicer)],
        service_names=[SERVICE_NAME],
        load=lambda: servicer.load(args.model, args.float32_weights),
        close=engine_thread.close,
        metrics=servicer.metrics,
    )


if __name__ == "__main__":
    exit_process(run_service(build, prog="services.tts", description="EAR-TTS: text tokens to codec codes",
                             add_arguments=add_arguments))
