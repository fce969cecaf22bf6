"""A scripted function head for tests: the language model's function-channel picks at chosen frames replaced by
given token ids, through the language service's forced-token path, so the model reads them as its own output.

    clients.language = ScriptedLanguage(clients.language, {5: start_id, 6: ..., 30: end_id})

A frame the session itself forces (a tool response being read back) keeps the session's id.
"""

from __future__ import annotations


class ScriptedSession:
    def __init__(self, inner, script: dict[int, int]):
        self.inner, self.script, self.frame = inner, script, 0
        self.prompt_positions = inner.prompt_positions
        self.prompt_embeds = inner.prompt_embeds

    def send_step(self, audio_embedding, forced_function=None):
        pick = forced_function if forced_function is not None else self.script.get(self.frame)
        self.frame += 1
        if pick is None:
            return self.inner.send_step(audio_embedding)
        return self.inner.send_step(audio_embedding, pick)

    def step(self, audio_embedding, forced_function=None):
        return self.send_step(audio_embedding, forced_function).result()

    def close(self) -> None:
        self.inner.close()


class ScriptedLanguage:
    """A language client whose sessions follow `script` (frame index -> function token id)."""

    def __init__(self, inner, script: dict[int, int]):
        self.inner, self.script = inner, script

    def open(self, system_prompt: str) -> ScriptedSession:
        return ScriptedSession(self.inner.open(system_prompt), self.script)


def call_script(tokenizer, text: str, first_frame: int) -> dict[int, int]:
    """`<SPECIAL_20>` + the ids of `text` + `<SPECIAL_21>`, one per frame from `first_frame`."""
    ids = [tokenizer.token_to_id("<SPECIAL_20>"), *tokenizer.encode(text, add_special_tokens=False).ids,
           tokenizer.token_to_id("<SPECIAL_21>")]
    return {first_frame + i: token for i, token in enumerate(ids)}


class NoPrefixSpeech:
    """A speech client whose sessions open without the system prompt's pad steps, for tests of the language and
    tool path that read no audio. The pad steps only shift speech's random stream, and a prompt that lists tools
    is some 470 positions: seconds of sequential speech steps on the CPU for every session opened."""

    def __init__(self, inner):
        self.inner = inner
        self.channel = getattr(inner, "channel", None)

    def info(self):
        return self.inner.info()

    def open(self, seed: int, prompt_codes, prefix_steps: int):
        return self.inner.open(seed, prompt_codes, 0)
