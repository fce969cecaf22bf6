"""`python -m services.perception --model DIR --port N`: the perception network as a gRPC service."""

from __future__ import annotations

import argparse

from services.common.batching import BatchOptions
from services.common.cli import ServiceSpec, add_split_matmuls_flag, exit_process, run_service
from services.common.engine_thread import EngineThread
from services.common.loading import LoadOptions
from services.perception.service import SERVICE_NAME, PerceptionServicer, registrations


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--float32-weights", action="store_true",
        help="keep float32 copies of the weights whose matmuls run in float32 (faster frames, identical outputs, "
             "twice those weights' memory)",
    )
    add_split_matmuls_flag(parser)


def build(args: argparse.Namespace) -> ServiceSpec:
    engine_thread = EngineThread("perception")
    servicer = PerceptionServicer(engine_thread, batching=BatchOptions.from_args(args))

    async def load() -> None:
        await servicer.load(args.model, LoadOptions.from_args(args))

    return ServiceSpec(registrations(servicer), [SERVICE_NAME], load=load, close=engine_thread.close,
                       metrics=servicer.metrics)


if __name__ == "__main__":
    exit_process(
        run_service(
            build,
            prog="services.perception",
            add_arguments=add_arguments,
            description="Log-mel, FastConformer and RNNT transcript over gRPC (whole utterances and 80 ms streams).",
        )
    )
