"""Which GPU each started service process runs on: `--gpus NAME=INDEX[,INDEX...]`.

A service given several GPUs runs one replica per GPU unless `--replicas` says how many; replica r runs on the
service's GPU r mod (its GPU count), so replicas spread evenly and wrap around when they outnumber the GPUs:

    >>> gpu_of_replicas(["0", "1"], 3)
    ['0', '1', '0']

A process sees only its own GPU (CUDA_VISIBLE_DEVICES), where MLX's CUDA backend takes it as device 0. Placement is
for NVIDIA GPUs; on Apple silicon every process shares the one GPU and the flag has nothing to choose.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from orchestrator.launcher import GPU_ENV, SERVICES, gpu_of_replicas

__all__ = ["GPU_ENV", "check_environment", "describe", "gpu_of_replicas", "parse_gpus", "service_gpus"]

# A GPU as CUDA_VISIBLE_DEVICES names one: its index, or its UUID (GPU-..., MIG-...).
_GPU = re.compile(r"\d+|(?:GPU|MIG)-[0-9A-Za-z-]+")


def parse_gpus(text: str) -> tuple[str, list[str]]:
    """`NAME=INDEX[,INDEX...]` (NAME one of the services or `all`) -> (NAME, the GPUs in order).

    >>> parse_gpus("tts=0,1")
    ('tts', ['0', '1'])
    """
    name, sep, listed = text.partition("=")
    name = name.strip()
    gpus = [gpu.strip() for gpu in listed.split(",")]
    if name not in (*SERVICES, "all") or not sep or not all(_GPU.fullmatch(gpu) for gpu in gpus):
        raise ValueError(f"--gpus {text!r}: expected NAME=INDEX[,INDEX...] with NAME one of {', '.join(SERVICES)} "
                         "or all and each INDEX a GPU's index (as nvidia-smi numbers them) or UUID, e.g. llm=1 or "
                         "tts=0,1")
    if len(set(gpus)) < len(gpus):
        raise ValueError(f"--gpus {text!r} names a GPU twice; to run several replicas on one GPU, list it once and "
                         "give --replicas")
    return name, gpus


def service_gpus(entries: Iterable[tuple[str, list[str]]] | None) -> dict[str, list[str]]:
    """Repeated --gpus -> name -> its GPUs, `all` first, so a service's own entry wins; services left unnamed
    are absent (they see what the orchestrator sees)."""
    gpus: dict[str, list[str]] = {}
    for name, listed in sorted(entries or [], key=lambda entry: entry[0] != "all"):
        for target in SERVICES if name == "all" else (name,):
            gpus[target] = listed
    return gpus


def check_environment(gpus: dict[str, list[str]], envs: dict[str, dict[str, str]]) -> None:
    """ValueError when a service is both placed and given its own GPU_ENV by --service-env: one would silently
    win."""
    for name in gpus:
        if GPU_ENV in envs.get(name, {}):
            raise ValueError(f"--gpus {name}=... and --service-env {name}={GPU_ENV}=... both choose the {name} "
                             f"service's GPU: give one of them")


def describe(gpus: dict[str, list[str]], counts: dict[str, int]) -> str:
    """One line saying where each placed service's replicas run, for the operator's log.

    >>> describe({"llm": ["1"], "tts": ["0", "1"]}, {"llm": 1, "tts": 3})
    'placement: llm on GPU 1; tts replicas 0-2 on GPUs 0, 1, 0'
    """
    parts = []
    for name in SERVICES:
        if name not in gpus:
            continue
        placed = gpu_of_replicas(gpus[name], counts[name])
        if len(placed) == 1:
            parts.append(f"{name} on GPU {placed[0]}")
        else:
            parts.append(f"{name} replicas 0-{len(placed) - 1} on GPUs {', '.join(placed)}")
    return "placement: " + "; ".join(parts)
