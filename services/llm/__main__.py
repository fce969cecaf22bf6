"""`python -m services.llm --model DIR --port N`: the language service (Nemotron-H, text + function heads)."""

from __future__ import annotations

import argparse

from services.common.cli import ServiceSpec, exit_process, run_service
from services.llm.engine import MAX_PROMPT_TOKENS, PREFIX_DTYPES
from services.llm.service import DEFAULT_PREFIX_DTYPE, build_spec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-prompt-tokens", type=int, default=MAX_PROMPT_TOKENS,
        help=f"longest system prompt in tokens, bos and eos included (default {MAX_PROMPT_TOKENS})",
    )
    parser.add_argument(
        "--prompt-prefix-dtype", choices=sorted(PREFIX_DTYPES), default=DEFAULT_PREFIX_DTYPE,
        help="dtype the prompt rows enter the model in: float32 as the reference's offline turn, bfloat16 as "
             f"its streaming session (default {DEFAULT_PREFIX_DTYPE})",
    )


def build(args: argparse.Namespace) -> ServiceSpec:
    if args.max_prompt_tokens <= 0:
        raise ValueError(f"--max-prompt-tokens {args.max_prompt_tokens}: must be positive")
    return build_spec(args.model, args.max_prompt_tokens, args.prompt_prefix_dtype)


if __name__ == "__main__":
    exit_process(
        run_service(
            build,
            prog="services.llm",
            description="VoiceChat language service: fused audio/text Nemotron-H with text and function heads",
            add_arguments=add_arguments,
        )
    )
