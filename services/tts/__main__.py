"""`python -m services.tts --model DIR --port N`: the EAR-TTS speech service."""

from __future__ import annotations

import argparse

from protos.voicechat.v1 import speech_pb2_grpc
from services.common.cli import ServiceSpec, exit_process, run_service
from services.common.engine_thread import EngineThread
from services.tts.service import SERVICE_NAME, SpeechServicer


def build(args: argparse.Namespace) -> ServiceSpec:
    engine_thread = EngineThread("tts-engine")
    servicer = SpeechServicer(engine_thread)
    return ServiceSpec(
        registrations=[(speech_pb2_grpc.add_SpeechServiceServicer_to_server, servicer)],
        service_names=[SERVICE_NAME],
        load=lambda: servicer.load(args.model),
        close=engine_thread.close,
        metrics=servicer.metrics,
    )


if __name__ == "__main__":
    exit_process(run_service(build, prog="services.tts", description="EAR-TTS: text tokens to codec codes"))
