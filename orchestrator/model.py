"""Which checkpoint a command runs on: `--model`, else `$VOICECHAT_MODEL`, else the demo checkpoint."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

from services.common.checkpoint import Checkpoint, CheckpointError

MODEL_ENV = "VOICECHAT_MODEL"
DEMO_PRESET, DEMO_SEED = "tiny", 0


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "voicechat"


def demo_checkpoint() -> Path:
    """The tiny random checkpoint, made once under the user's cache folder (built aside, then renamed)."""
    from tools.make_checkpoint import write_checkpoint

    target = cache_dir() / f"demo-{DEMO_PRESET}-seed{DEMO_SEED}"
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".demo-", dir=target.parent))
    try:
        write_checkpoint(staging, DEMO_PRESET, DEMO_SEED)
        try:
            staging.rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_model(model: str | None, *, announce=print) -> Path:
    """The checkpoint folder to use, checked to be one; announces when it falls back to the demo."""
    chosen = model or os.environ.get(MODEL_ENV)
    if chosen:
        path = Path(chosen).expanduser()
        Checkpoint(path).close()  # fails with one clear line when the folder is not a checkpoint
        return path
    path = demo_checkpoint()
    announce(
        f"note: no --model given and ${MODEL_ENV} unset: using the demo checkpoint {path} (random weights, so "
        "the answer is babble); pass --model DIR of a converted VoiceChat checkpoint for a real answer",
        file=sys.stderr,
    )
    return path


__all__ = ["CheckpointError", "MODEL_ENV", "demo_checkpoint", "resolve_model"]
