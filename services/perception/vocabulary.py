"""The RNNT transcript's pieces: the checkpoint's vocabulary, which pieces are not text, pieces to text.

MLX-free, so the orchestrator (which tells transcript-extending emissions from specials) reads the same
vocabulary and applies the same test as the perception service without loading MLX.

    >>> pieces_to_text([0, 1, 2], ["<en-US>", "\u2581the", "re"])
    'there'
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from services.common.config import VoiceChatConfig

_LANG_TAG = re.compile(r"^<[a-z]{2,3}-[A-Za-z]{2,4}>$")
_SPECIAL = frozenset({"<unk>", "<pad>", "<s>", "</s>"})
WORD_START = "\u2581"  # SentencePiece's word-start mark


def is_special_piece(piece: str) -> bool:
    """`is_special_piece("<en-US>") is True`; `is_special_piece("▁the") is False`."""
    return piece in _SPECIAL or bool(_LANG_TAG.match(piece))


def join_pieces(ids: list[int], vocabulary: list[str]) -> str:
    """The text of `ids`, `▁` as a space, specials and out-of-range ids dropped, not stripped (a stream's
    deltas concatenate to its transcript)."""
    parts = [vocabulary[i] for i in ids if 0 <= i < len(vocabulary)]
    return "".join(p.replace(WORD_START, " ") for p in parts if not is_special_piece(p))


def pieces_to_text(ids: list[int], vocabulary: list[str]) -> str:
    """Join pieces with `▁` as a space, dropping specials and out-of-range ids: [▁the, re] -> "there"."""
    return join_pieces(ids, vocabulary).strip()


def load_vocabulary(config: VoiceChatConfig, model_dir: str | Path) -> list[str]:
    """The pieces by id: `config.rnnt_vocabulary` when set, else `rnnt_tokenizer/vocab.json` (a piece -> id
    map or a list), else [] (transcripts are then empty)."""
    if config.rnnt_vocabulary:
        return list(config.rnnt_vocabulary)
    path = Path(model_dir) / "rnnt_tokenizer" / "vocab.json"
    if not path.is_file():
        return []
    data = json.loads(path.read_text())
    if isinstance(data, dict):  # piece -> id
        return [piece for piece, _ in sorted(data.items(), key=lambda kv: kv[1])]
    return list(data)
