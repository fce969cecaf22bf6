"""Text that grows with a conversation, kept at a flat cost per frame: the RNNT transcript grows at its end only
(each frame costs its own pieces), the assistant's channels decode a bounded tail of ids, and the perception
stream sends each frame's delta, its client summing them."""

import numpy as np
import pytest

from orchestrator.stream_clients import GrpcPerceptionStream
from orchestrator.text import SETTLING_IDS, GrowingText, TextDecoder, TokenAccumulator
from protos.voicechat.v1 import perception_pb2
from services.common.config import VoiceChatConfig
from services.common.tensors import to_proto_np
from services.perception.rnnt import RNNT, RNNTState
from services.perception.vocabulary import join_pieces

# word starts, word pieces, specials, pieces of whitespace alone (a transcript may end in them for a while)
VOCAB = ["<unk>", "<en-US>", "\u2581hel", "lo", "\u2581world", "\u2581", "\u2581\u2581", "\t", "x", "<pad>"]


def test_the_transcript_grows_at_its_end_as_the_joined_pieces_stripped():
    rnnt = RNNT.__new__(RNNT)  # update_text needs the vocabulary alone
    rnnt.vocabulary = VOCAB
    rng = np.random.default_rng(0)
    for trial in range(200):
        state, ids, summed = RNNTState(blank=len(VOCAB)), [], ""
        for _ in range(int(rng.integers(1, 12))):
            frame = [int(i) for i in rng.integers(0, len(VOCAB), int(rng.integers(0, 4)))]
            before = len(state.token_ids)
            state.token_ids += frame
            ids += frame
            delta = rnnt.update_text(state, before)
            summed += delta
            # what the transcript is by definition, recomputed from every piece so far
            assert state.text == join_pieces(ids, VOCAB).strip() == summed, (trial, ids)


def test_a_channels_text_is_the_decode_of_every_id_while_it_decodes_a_bounded_tail(tiny_checkpoint):
    decoder = TextDecoder(tiny_checkpoint, VoiceChatConfig.load(tiny_checkpoint))
    vocab = decoder.tokenizer.get_vocab_size()
    ids = [int(i) for i in np.random.default_rng(1).integers(0, vocab, 600)]  # byte pieces split characters
    accumulator, kept, longest = TokenAccumulator(decoder), [], 0
    for token in ids:
        update = accumulator.append(token)
        if token in decoder.hidden:
            assert update is None
            continue
        kept.append(token)
        whole = decoder.decode(kept)
        previous = decoder.decode(kept[:-1])
        delta = whole[len(previous):] if whole.startswith(previous) else decoder.decode([token])
        assert update == (delta, whole)  # what decoding every id each token gives
        longest = max(longest, len(accumulator.tail))
    assert len(kept) > 500 and longest < 2 * SETTLING_IDS  # the ids decoded per token stay bounded


@pytest.mark.parametrize("window", [200, 8])  # 8: shorter than the tail's text, where the tail bounds the start
def test_a_windowed_channel_rebuilds_the_whole_text_from_events_of_bounded_size(tiny_checkpoint, window):
    decoder = TextDecoder(tiny_checkpoint, VoiceChatConfig.load(tiny_checkpoint))
    vocab = decoder.tokenizer.get_vocab_size()
    ids = [int(i) for i in np.random.default_rng(2).integers(0, vocab, 3000)]
    whole, windowed = TokenAccumulator(decoder), TokenAccumulator(decoder, window)
    client, kept, starts = "", [], []
    for token in ids:
        settled = len(windowed.settled)  # before the token: what no later token revises
        full, update = whole.update(token), windowed.update(token)
        if token in decoder.hidden:
            assert full is None and update is None
            continue
        kept.append(token)
        assert full.start == 0 and update.delta == full.delta
        if len(full.text) <= window:  # under the window: the event is the unbounded one
            assert update == full
        assert update.start == min(settled, max(0, len(full.text) - window))  # never inside the tail
        assert update.start <= len(client)
        assert len(update.text) <= window + (len(full.text) - settled)  # the window plus the tail's text
        client = client[:update.start] + update.text
        assert client == full.text
        starts.append(update.start)
    assert client == decoder.decode(kept) == windowed.text
    assert len(client) > 10 * window and min(starts[-100:]) > 0  # far past the window
    assert len(windowed._settled._recent) <= 2 * window  # only the settled text's end is kept at hand


class _Replies:
    """A perception stream whose service answers each frame with the given (delta, transcript)."""

    def __init__(self, answers: list[tuple[str, str]]):
        self.answers = iter(answers)

    def call(self, request):
        return perception_pb2.PerceptionStreamResponse()

    def send(self, request):
        from orchestrator.pending import Pending

        delta, whole = next(self.answers)
        zero = to_proto_np(np.zeros(2, np.float32))
        return Pending.answered(perception_pb2.PerceptionStreamResponse(frame=perception_pb2.PerceptionFrame(
            audio_embedding=zero, encoder_output=zero, transcript_delta=delta, transcript=whole)))


class _Channel:
    def __init__(self, stream):
        self.stream_ = stream

    def stream(self, method):
        return self.stream_


def test_the_perception_client_passes_the_deltas_on_and_turns_a_whole_transcript_into_one():
    # the fifth answer holds the whole transcript (and a stale delta): what it adds past the 8 characters so far
    answers = [("", ""), ("Hi", ""), ("", ""), (" there", ""), ("?", "Hi there, you"), ("!", "")]
    stream = GrpcPerceptionStream(_Channel(_Replies(answers)), 16_000)
    deltas = [stream.push(np.zeros(1280, np.float32)).transcript_delta for _ in answers]
    assert deltas == ["", "Hi", "", " there", ", you", "!"]
    assert stream.transcript_length == len("Hi there, you!")


@pytest.mark.parametrize("window", [None, 4])
def test_a_growing_text_gives_every_suffix_and_keeps_only_its_end_at_hand(window):
    pieces = ["ab", "", "cdefghij", "k", "lmnopqrstuvwxyz", "0", "123456789"]
    text, whole = GrowingText(window), ""
    for piece in pieces:
        text.append(piece)
        whole += piece
        assert text.length == len(whole) and str(text) == whole
        assert [text.since(start) for start in range(len(whole) + 1)] == [whole[start:] for start in
                                                                          range(len(whole) + 1)]
        if window:
            assert window <= len(text._recent) <= 2 * window or len(text._recent) == len(whole)
