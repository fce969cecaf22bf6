"""Turning token ids into text: the assistant and function channels share the checkpoint's tokenizer."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NamedTuple

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


# Characters of a channel's text a served session's text events carry whole (`--text-window`); docs/operations.md
# (Long sessions) counts about 10 KB of transcript per 10 minutes of speech.
DEFAULT_TEXT_WINDOW = 16384


def add_text_window_flag(parser: argparse.ArgumentParser) -> None:
    """`--text-window CHARS` for the commands that serve online sessions; read it with `text_window_from_args`."""
    parser.add_argument("--text-window", type=int, default=DEFAULT_TEXT_WINDOW, metavar="CHARS",
                        help="a text event carries its channel's whole text while that is at most CHARS characters, "
                             "then its last CHARS from text_start on (docs/protocol.md); 0 = always the whole text "
                             f"(default {DEFAULT_TEXT_WINDOW})")


def text_window_from_args(args: argparse.Namespace) -> int | None:
    """The sessions' text_window (None: unbounded); ValueError naming a negative value."""
    if args.text_window < 0:
        raise ValueError(f"--text-window {args.text_window}: must be 0 (every text event carries the whole text) or a "
                         f"positive number of characters (default {DEFAULT_TEXT_WINDOW})")
    return args.text_window or None


# Ids a channel decodes again with each new one; older ones are settled text, so a token costs the same at any
# age of the conversation (decoding every id so far would cost the whole conversation's length each token).
SETTLING_IDS = 16


def text_start(length: int, window: int | None, kept: int) -> int:
    """Where an event's text starts within a channel's text of `length` characters: 0 while the text is at most
    `window` characters (None or 0: always), else its last `window` characters, but never past `kept`, the
    characters the client already holds for good (so `whole[:start] + text` rebuilds the whole text)."""
    if not window:
        return 0
    return min(kept, max(0, length - window))


class TextUpdate(NamedTuple):
    """One token's change to a channel's text, as its event carries it."""

    delta: str
    text: str  # the channel's text from character `start` on
    start: int  # characters before `text`: the whole text is the previous whole text's first `start` + `text`


class GrowingText:
    """A text that only grows at its end (a channel's final text), kept so that an event's text costs the
    window's length, not the conversation's: `append(delta)` costs the delta (and at most the kept end's copy),
    `since(start)` is the text from character `start` on. With a `window` (characters; None or 0: unbounded) the
    last `window` to 2 x `window` characters are kept at hand and the earlier ones as pieces, never joined again
    unless a caller asks for text before the kept end (`str()`, or `since` a start that far back)."""

    def __init__(self, window: int | None = None):
        self.window = window or None
        self.length = 0  # characters so far
        self._earlier: list[str] = []  # windowed: the text before `_recent`, in pieces
        self._recent = ""  # the text's end: all of it unbounded, else at least its last `window` characters

    def __str__(self) -> str:
        return "".join(self._earlier) + self._recent

    def append(self, delta: str) -> None:
        self.length += len(delta)
        self._recent += delta
        if self.window is not None and len(self._recent) > 2 * self.window:
            cut = len(self._recent) - self.window
            self._earlier.append(self._recent[:cut])
            self._recent = self._recent[cut:]

    def since(self, start: int) -> str:
        recent_start = self.length - len(self._recent)
        if start >= recent_start:
            return self._recent[start - recent_start :]
        return str(self)[start:]


class TokenAccumulator:
    """Cumulative text of one channel; `update` gives a TextUpdate or None for a hidden id (`append` the same as
    (delta, whole text)).

    The delta is the new suffix when the cumulative decode extends the previous text, else the one-token
    decode (a tokenizer may revise a partial byte sequence; the cumulative text stays authoritative).

    The text is `settled` (the text of every id before `tail`, final) plus the decode of `tail`, the last ids:
    ids leave the tail once decoding them apart from the newest SETTLING_IDS gives the same text as together (a
    character split across tokens, or a decoder that reads its neighbours, keeps them in it). So the text is
    the decode of every id, at a cost per token that does not grow with the conversation. Since `settled` only
    grows by final text, the cumulative decode extends the previous text exactly when the tail's decode extends
    the tail's previous one.

    With a `window` (characters; None or 0: unbounded) an update's text is the whole text from `text_start(...)`
    on: all of it while it is at most `window` characters, else its last `window` characters, never starting
    inside the tail (which a later token may still revise). The settled text is a `GrowingText`, so building an
    update costs the window's length, not the conversation's.
    """

    def __init__(self, decoder: TextDecoder, window: int | None = None):
        if window is not None and window < 0:
            raise ValueError(f"window must be a non-negative number of characters (0: unbounded), got {window}")
        self.decoder = decoder
        self.window = window or None
        self.tail: list[int] = []
        self._tail_text = ""  # the decode of `tail`
        self._settled = GrowingText(window)  # the text of every id before the tail

    @property
    def settled(self) -> str:
        """The text of every id before the tail (final)."""
        return str(self._settled)

    @property
    def text(self) -> str:
        """The whole text so far."""
        return self.settled + self._tail_text

    def append(self, token_id: int) -> tuple[str, str] | None:
        """(delta, the whole text) for a shown id, None for a hidden one."""
        update = self.update(token_id)
        return None if update is None else (update.delta, self.text)

    def update(self, token_id: int) -> TextUpdate | None:
        """The id's delta and the text from the window's start on; None for a hidden id."""
        if token_id in self.decoder.hidden:
            return None
        self.tail.append(token_id)
        tail_text = self.decoder.decode(self.tail)
        if tail_text.startswith(self._tail_text):
            delta = tail_text[len(self._tail_text):]
        else:
            delta = self.decoder.decode([token_id])
        settled = self._settled.length
        start = text_start(settled + len(tail_text), self.window, settled)
        text = self._settled.since(start) + tail_text
        self._tail_text = tail_text
        self._settle()
        return TextUpdate(delta, text, start)

    def _settle(self) -> None:
        """Move the tail's older ids into `settled` when their text is final (see the class)."""
        if len(self.tail) < 2 * SETTLING_IDS:
            return
        older, newest = self.tail[:-SETTLING_IDS], self.tail[-SETTLING_IDS:]
        older_text, newest_text = self.decoder.decode(older), self.decoder.decode(newest)
        if older_text + newest_text == self._tail_text:
            self.tail, self._tail_text = newest, newest_text
            self._settled.append(older_text)
