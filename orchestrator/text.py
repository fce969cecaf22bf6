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


# Ids a channel decodes again with each new one; older ones are settled text, so a token costs the same at any
# age of the conversation (decoding every id so far would cost the whole conversation's length each token).
SETTLING_IDS = 16


class TokenAccumulator:
    """Cumulative text of one channel; `append` gives (delta, text) or None for a hidden id.

    The delta is the new suffix when the cumulative decode extends the previous text, else the one-token
    decode (a tokenizer may revise a partial byte sequence; the cumulative text stays authoritative).

    The text is `settled` (the text of every id before `tail`, final) plus the decode of `tail`, the last ids:
    ids leave the tail once decoding them apart from the newest SETTLING_IDS gives the same text as together (a
    character split across tokens, or a decoder that reads its neighbours, keeps them in it). So the text is
    the decode of every id, at a cost per token that does not grow with the conversation.
    """

    def __init__(self, decoder: TextDecoder):
        self.decoder = decoder
        self.settled = ""
        self.tail: list[int] = []
        self.text = ""

    def append(self, token_id: int) -> tuple[str, str] | None:
        if token_id in self.decoder.hidden:
            return None
        self.tail.append(token_id)
        tail_text = self.decoder.decode(self.tail)
        updated = self.settled + tail_text
        if updated.startswith(self.text):
            delta = updated[len(self.text):]
        else:
            delta = self.decoder.decode([token_id])
        self.text = updated
        self._settle(tail_text)
        return delta, updated

    def _settle(self, tail_text: str) -> None:
        """Move the tail's older ids into `settled` when their text is final (see the class)."""
        if len(self.tail) < 2 * SETTLING_IDS:
            return
        older, newest = self.tail[:-SETTLING_IDS], self.tail[-SETTLING_IDS:]
        older_text = self.decoder.decode(older)
        if older_text + self.decoder.decode(newest) == tail_text:
            self.settled += older_text
            self.tail = newest
