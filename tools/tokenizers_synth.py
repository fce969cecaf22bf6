"""Deterministic synthetic tokenizers for random-weight checkpoints.

The LLM tokenizer is a byte-level BPE in the Hugging Face `tokenizer.json` format with exactly 256
single-character tokens (the byte alphabet, which the EAR-TTS character table is built from), the
special ids the model uses (bos 1, eos 2, silence 11, pad 12), the tool-call markers `<SPECIAL_20>`,
`<SPECIAL_21>`, `<SPECIAL_22>` (ids 3, 4, 5 here), merges learned from a fixed word list
and filler tokens up to the LLM vocabulary size. The RNNT vocabulary is a SentencePiece-style piece
list with `<unk>`, language tags and `▁`-prefixed word pieces.
"""

from __future__ import annotations

from collections import Counter

NUM_SPECIALS = 16
# The released tokenizer's tool-call markers (start of call, end of call, end of tool response; ids 20-22
# there). This vocabulary has 16 special slots before its byte alphabet, so the markers take three unnamed
# ones and every byte, merge and filler id stays where the parity goldens have it: code finds them by name.
TOOL_SPECIALS = {3: "<SPECIAL_20>", 4: "<SPECIAL_21>", 5: "<SPECIAL_22>"}
SPECIAL_NAMES = {0: "<unk>", 1: "<s>", 2: "</s>", **TOOL_SPECIALS}

# A fixed word list with rough frequencies; merges are learned from it in a fixed order.
WORDS = (
    "the of and to a in is you that it he was for on are as with his they at be this have from or one "
    "had by word but not what all were we when your can said there use an each which she do how their "
    "if will up other about out many then them these so some her would make like him into time has "
    "look two more write go see number no way could people my than first water been call who oil its "
    "now find long down day did get come made may part over new sound take only little work know place "
    "year live me back give most very after thing our just name good sentence man think say great where "
    "help through much before line right too mean old any same tell boy follow came want show also "
    "around form three small set put end does another well large must big even such because turn here "
    "why ask went men read need land different home us move try kind hand picture again change off play "
    "spell air away animal house point page letter mother answer found study still learn should america "
    "world capital france paris question concise sentence be answer in one hello thanks weather today "
    "tomorrow music call open close stop start light voice assistant please could would"
).split()


def bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte-level alphabet: 256 printable characters, one per byte value."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    keep += list(range(ord("®"), ord("ÿ") + 1))
    mapping = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return dict(sorted(mapping.items()))


def _learn_merges(words: list[str], max_merges: int, alphabet: dict[int, str]) -> list[tuple[str, str]]:
    """Plain BPE on byte-level words; ties break on the lexicographically smallest pair."""
    corpus = Counter()
    for rank, word in enumerate(words):
        symbols = tuple(alphabet[b] for b in (" " + word).encode())
        corpus[symbols] += max(1, 50 - rank // 8)
    merges: list[tuple[str, str]] = []
    while len(merges) < max_merges:
        pairs: Counter = Counter()
        for symbols, count in corpus.items():
            for a, b in zip(symbols, symbols[1:], strict=False):
                pairs[(a, b)] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged = Counter()
        for symbols, count in corpus.items():
            out, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    out.append(symbols[i] + symbols[i + 1])
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            merged[tuple(out)] += count
        corpus = merged
    return merges


def _filler(index: int, alphabet: dict[int, str]) -> str:
    """A multi-character byte-level token that decodes to ` q<letters>`."""
    letters = ""
    n = index
    while True:
        letters = chr(ord("a") + n % 26) + letters
        n = n // 26 - 1
        if n < 0:
            break
    return alphabet[ord(" ")] + "q" + letters


def build_tokenizer(vocab_size: int, bos_id: int, eos_id: int, silence_id: int, pad_id: int) -> tuple[dict, dict]:
    """Return (`tokenizer.json`, `tokenizer_config.json`) contents with exactly `vocab_size` tokens."""
    alphabet = bytes_to_unicode()
    names = dict(SPECIAL_NAMES)
    for i in range(NUM_SPECIALS):
        names.setdefault(i, f"<SPECIAL_{i}>")
    names[bos_id], names[eos_id] = "<s>", "</s>"
    vocab: dict[str, int] = {names[i]: i for i in range(NUM_SPECIALS)}
    for char in alphabet.values():
        vocab[char] = len(vocab)
    merges = _learn_merges(list(WORDS), max(0, vocab_size - len(vocab)) // 2, alphabet)
    kept_merges = []
    for a, b in merges:
        if len(vocab) >= vocab_size:
            break
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
        kept_merges.append([a, b])
    index = 0
    while len(vocab) < vocab_size:
        token = _filler(index, alphabet)
        index += 1
        if token not in vocab:
            vocab[token] = len(vocab)
    if len(vocab) != vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the {len(vocab)} base tokens")
    added = [
        {"id": i, "content": names[i], "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
        for i in range(NUM_SPECIALS)
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": vocab, "merges": kept_merges,
        },
    }
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": names[bos_id],
        "eos_token": names[eos_id],
        "unk_token": names[0],
        "pad_token": names[pad_id],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1_000_000,
        "silence_token": names[silence_id],
    }
    return tokenizer, tokenizer_config


def build_rnnt_vocabulary(size: int) -> list[str]:
    """SentencePiece-style pieces: `<unk>`, language tags, `<pad>`, letters, then word pieces."""
    pieces = ["<unk>", "<en-US>", "<de-DE>", "<fr-FR>", "<pad>"]
    pieces += ["▁" + c for c in "abcdefghijklmnopqrstuvwxyz"] + list("abcdefghijklmnopqrstuvwxyz'?.,")
    for word in WORDS:
        for piece in ("▁" + word, word):
            if piece not in pieces:
                pieces.append(piece)
    n = 0
    while len(pieces) < size:
        pieces.append(f"▁w{n}")
        n += 1
    return pieces[:size]
