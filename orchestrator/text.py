"""Turning token ids into text: the assistant and function channels share the checkpoint's tokenizer."""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer

from services.common.config import VoiceChatConfig


class TextDecoder:
    """Decodes id sequences with the pad, silence, BOS and EOS ids removed (other specials kept, as spelled)."""

    def __init__(self, model_dir: str | Path, config: VoiceChatConfig):
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{path}: not found; the checkpoint folder needs its tokenizer.json")
        self.tokenizer = Tokenizer.from_file(str(path))
        self.hidden = config.special_text_ids

    def decode(self, ids) -> str:
        kept = [int(i) for i in ids if int(i) not in self.hidden]
        return self.tokenizer.decode(kept, skip_special_tokens=False)


class TokenAccumulator:
    """Cumulative text of one channel; `append` gives (delta, text) or None for a hidden id.

    The delta is the new suffix when the cumulative decode extends the previous text, else the one-token
    decode (a tokenizer may revise a partial byte sequence; the cumulative text stays authoritative).
    """

    def __init__(self, decoder: TextDecoder):
        self.decoder = decoder
        self.ids: list[int] = []
        self.text = ""

    def append(self, token_id: int) -> tuple[str, str] | None:
        if token_id in self.decoder.hidden:
            return None
        self.ids.append(token_id)
        updated = self.decoder.decode(self.ids)
        if updated.startswith(self.text):
            delta = updated[len(self.text):]
        else:
            delta = self.decoder.decode([token_id])
        self.text = updated
        return delta, updated
