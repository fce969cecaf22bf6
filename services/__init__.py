"""The four network services (perception, llm, tts, codec) and what they share (services.common).

On CUDA, MLX runs float32 matmuls of two or more rows in TF32 unless MLX_ENABLE_TF32=0. A session's rows in a
batched step would then round differently from the same session stepped alone (a one-row matmul never uses
TF32), and near-tied tokens could flip with the batch's company, so the services keep float32 matmuls in full
float32 unless the environment says otherwise. Set before MLX runs its first matmul; no effect off CUDA.
"""

import os

os.environ.setdefault("MLX_ENABLE_TF32", "0")
