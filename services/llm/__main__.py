"""`python -m services.llm --model DIR --port N`: the language service (Nemotron-H, text + function heads)."""

from __future__ import annotations

import argparse

from services.common.batching import BatchOptions
from services.common.cli import ServiceSpec, add_max_context_flag, add_split_matmuls_flag, exit_process, run_service
from services.common.loading import LoadOptions
from services.llm.engine import MAX_PROMPT_TOKENS, PROMPTS_KEPT
from services.llm.service import build_spec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--max-prompt-tokens", type=int, default=MAX_PROMPT_TOKENS,
        help=f"longest system prompt in tokens, bos and eos included (default {MAX_PROMPT_TOKENS})",
    )
    parser.add_argument(
        "--weights-dtype", choices=["stored", "bfloat16"], default="stored",
        help="stored (default) keeps quantized projections quantized; bfloat16 dequantizes them at load: more "
             "memory, dense matmuls that batch across sessions on a GPU",
    )
    parser.add_argument(
        "--float32-weights", action="store_true",
        help="keep in float32 what every frame's matmuls convert to float32: the dense weights (with "
             "--weights-dtype bfloat16: twice their memory) or the quantized layers' scales and biases (stored: "
             "about 1/16 byte more a parameter); identical outputs, fewer conversions per frame",
    )
    parser.add_argument(
        "--prompts-kept", type=int, default=PROMPTS_KEPT,
        help=f"keep the caches of the last N distinct prompts, so later sessions opening with one feed nothing "
             f"(default {PROMPTS_KEPT}; about 140 MB each on the full model; 0: every session feeds its own)",
    )
    add_split_matmuls_flag(parser, " (--weights-dtype bfloat16)")
    add_max_context_flag(parser, "the attention layers")


def build(args: argparse.Namespace) -> ServiceSpec:
    if args.max_prompt_tokens <= 0:
        raise ValueError(f"--max-prompt-tokens {args.max_prompt_tokens}: must be positive")
    if args.prompts_kept < 0:
        raise ValueError(f"--prompts-kept {args.prompts_kept}: must be 0 (keep none) or more")
    return build_spec(args.model, args.max_prompt_tokens, BatchOptions.from_args(args), LoadOptions.from_args(args),
                      args.prompts_kept)


if __name__ == "__main__":
    exit_process(
        run_service(
            build,
            prog="services.llm",
            description="VoiceChat language service: fused audio/text Nemotron-H with text and function heads",
            add_arguments=add_arguments,
        )
    )
