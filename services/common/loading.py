"""How a service loads its model: one `LoadOptions` value from the command line to the engine, and the process
setting the services make at their entry points before MLX runs a matmul. No MLX here.

    options = LoadOptions.from_args(args)     # --weights-dtype, --float32-weights, --split-matmuls, --max-context
    engine = LanguageEngine.load(model_dir, options=options)
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

TF32_ENV = "MLX_ENABLE_TF32"
WEIGHTS_DTYPES = ("stored", "bfloat16")
# Attention positions a session keeps past its prompt (--max-context): one a frame in both the language model and
# the speech backbone, so 8192 frames of 80 ms keep every conversation of up to 10.9 minutes exact.
DEFAULT_MAX_CONTEXT = 8192


# The sizes of MLX's CUDA plan caches (cuDNN convolution plans, cuFFT plans, cuDNN attention graphs; by default
# 128, 128 and 256), keyed by shape, which stop the process ("Cache thrashing is happening") once their misses
# pass twice their size. Every batch size a service compiles is shapes of its own: perception's 32 sessions,
# their first pushes, young windows and full ones, need more than 128 convolution plans.
PLAN_CACHES = {"MLX_CUDA_CONV_CACHE_SIZE": "4096", "MLX_CUDA_FFT_CACHE_SIZE": "4096",
               "MLX_CUDA_SDPA_CACHE_SIZE": "4096"}


def process_settings() -> None:
    """What MLX reads from the environment at its first use, set unless the environment says otherwise: call at
    a process's entry point, before MLX runs (no effect off CUDA).

    On CUDA, MLX runs float32 matmuls of two or more rows in TF32 unless MLX_ENABLE_TF32=0. A session's rows in
    a batched step would then round differently from the same session stepped alone (a one-row matmul never
    uses TF32), and near-tied tokens could flip with the batch's company: TF32 off. The plan caches get room
    for every batch size's shapes (`PLAN_CACHES`)."""
    os.environ.setdefault(TF32_ENV, "0")
    for name, size in PLAN_CACHES.items():
        os.environ.setdefault(name, size)


@dataclass(frozen=True)
class LoadOptions:
    """How an engine keeps its weights, the same value from the flags through the servicer to `Engine.load`.

    weights_dtype: "stored" keeps quantized projections quantized; "bfloat16" dequantizes them at load (more
    memory, dense matmuls that batch almost for free on a GPU; the language service's --weights-dtype).
    float32_weights: keep in float32 the arrays that every frame's float32 activations would convert in each
    call (outputs identical; twice those arrays' memory). split_matmuls (a CUDA GPU only): dense bf16
    projections meet float32 activations in `split_matmul`, on the tensor cores at float32's accuracy.
    max_context: the attention keys a session keeps past its prompt (the language model's attention layers, the
    speech backbone's global layers); past it the oldest of them give way (`services.common.cache.Bound`). 0 or
    None keeps every key.

    >>> LoadOptions.from_args(argparse.Namespace(float32_weights=True))
    LoadOptions(weights_dtype='stored', float32_weights=True, split_matmuls=False, max_context=8192)
    >>> LoadOptions(weights_dtype="float16")
    Traceback (most recent call last):
    ...
    ValueError: weights_dtype must be 'stored' or 'bfloat16', got 'float16'
    """

    weights_dtype: str = "stored"
    float32_weights: bool = False
    split_matmuls: bool = False
    max_context: int | None = DEFAULT_MAX_CONTEXT

    def __post_init__(self) -> None:
        if self.weights_dtype not in WEIGHTS_DTYPES:
            raise ValueError(f"weights_dtype must be 'stored' or 'bfloat16', got {self.weights_dtype!r}")
        if self.max_context is not None and self.max_context < 0:
            raise ValueError(f"max_context must be 0 (every key kept) or more, got {self.max_context}")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> LoadOptions:
        """From a service's flags; a flag the service does not define keeps its default."""
        return cls(getattr(args, "weights_dtype", "stored"), getattr(args, "float32_weights", False),
                   getattr(args, "split_matmuls", False), getattr(args, "max_context", DEFAULT_MAX_CONTEXT))

    def only_stored(self, service: str) -> LoadOptions:
        """These options, for a service whose weights are kept as stored (ValueError for any other dtype)."""
        if self.weights_dtype != "stored":
            raise ValueError(f"weights_dtype {self.weights_dtype!r} applies to the language service only, "
                             f"not to {service}")
        return self


AS_STORED = LoadOptions()  # the default: weights as the checkpoint stores them, nothing kept wider
