import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from worker.engine.detokenizer import Detokenizer

MULTI = "héllo wörld 你好 🎉 naïve café 日本語 😀👍🏽"
SAMPLES = [
    "héllo wörld 你好 🎉 the lazy dog stop here",
    "🎉🎉 你好你好 — 👍🏽 ok",
    "plain ascii text with the quick brown fox",
    "日本語のテキスト 😀 and ünïcödé",
]


@pytest.fixture(scope="module")
def tok():
    """A byte-level BPE with ~300 tokens: ASCII words merge, most multi-byte characters stay
    split over several byte tokens."""
    words = ("the quick brown fox jumps over the lazy dog while seven wizards hex a jolly box "
             "of stop tokens and stream text").split()
    rng = random.Random(0)
    text = " ".join(rng.choice(words) for _ in range(800)) + " " + MULTI
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([text], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")


def enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def stream(detok, ids, chunk=1):
    """Push ids in chunks; return the deltas and the text emitted after each push."""
    deltas, emitted = [], ""
    for i in range(0, len(ids), chunk):
        delta, matched = detok.push(ids[i:i + chunk])
        deltas.append(delta)
        emitted += delta
        if matched is not None:
            break
    return deltas, emitted


def test_tokenizer_splits_multibyte_characters(tok):
    # The rest of the file relies on this: single tokens that decode to U+FFFD.
    assert any("\ufffd" in tok.decode([i]) for i in enc(tok, MULTI))


@pytest.mark.parametrize("text", SAMPLES)
@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_concatenate_to_decode(tok, text, chunk):
    ids = enc(tok, text)
    d = Detokenizer(tok, stop=[])
    deltas, emitted = stream(d, ids, chunk)
    tail = d.flush()
    assert emitted + tail == d.text == tok.decode(ids) == text
    assert tail == ""  # every character was complete by the last token
    for delta in deltas:
        assert "\ufffd" not in delta


def test_random_token_streams_match_decode(tok):
    # Random ids make invalid and truncated UTF-8 too: the stream must still equal decode().
    rng = random.Random(1)
    for _ in range(200):
        ids = [rng.randrange(len(tok)) for _ in range(rng.randrange(1, 30))]
        d = Detokenizer(tok, stop=[])
        i, emitted = 0, ""
        while i < len(ids):
            n = rng.randrange(1, 4)
            emitted += d.push(ids[i:i + n])[0]
            i += n
        emitted += d.flush()
        assert emitted == d.text == tok.decode(ids, skip_special_tokens=True)


def test_special_tokens(tok):
    ids = enc(tok, "the fox") + [tok.eos_token_id] + enc(tok, " 你好")
    d = Detokenizer(tok, stop=[])
    emitted = stream(d, ids)[1] + d.flush()
    assert emitted == "the fox 你好"
    d = Detokenizer(tok, stop=[], skip_special_tokens=False)
    emitted = stream(d, ids)[1] + d.flush()
    assert emitted == tok.decode(ids, skip_special_tokens=False) == "the fox<eos> 你好"


def test_prompt_gives_context_only(tok):
    prompt = enc(tok, "héllo wörld 🎉")
    out = enc(tok, " 你好 the dog")
    d = Detokenizer(tok, stop=[], prompt_ids=prompt)
    emitted = stream(d, out)[1] + d.flush()
    assert emitted == d.text == tok.decode(out)


def test_incomplete_character_is_flushed_as_replacement(tok):
    ids = enc(tok, "ok 🎉")
    d = Detokenizer(tok, stop=[])
    emitted = stream(d, ids[:-1])[1]
    assert "\ufffd" not in emitted
    assert emitted + d.flush() == d.text == tok.decode(ids[:-1])
    assert d.text.endswith("\ufffd")


def _held_tail(text, stops):
    return max([k for s in stops for k in range(1, len(s)) if text.endswith(s[:k])], default=0)


@pytest.mark.parametrize("stop", ["o w", "你好 🎉", "lazy dog", "wörld 你"])
def test_stop_across_token_boundaries(tok, stop):
    text = "héllo wörld 你好 🎉 the lazy dog stop here"
    ids = enc(tok, text)
    cut = text.index(stop)
    d = Detokenizer(tok, stop=[stop])
    emitted, seen = "", False
    for n in range(1, len(ids) + 1):
        delta, matched = d.push(ids[n - 1:n])
        emitted += delta
        # Nothing past the cut is ever emitted, not even part of the stop string.
        assert text[:cut].startswith(emitted)
        if matched is not None:
            seen = True
            assert matched == stop
            break
        # Held back: exactly the tail that could still grow into the stop string.
        so_far = tok.decode(ids[:n])
        if not so_far.endswith("\ufffd"):
            assert emitted == so_far[:len(so_far) - _held_tail(so_far, [stop])]
    assert seen
    assert emitted == d.text == text[:cut]
    assert d.flush() == ""
    with pytest.raises(RuntimeError):
        d.push(ids[:1])


def test_failed_partial_match_is_released(tok):
    text = "the lazy dog stops"
    ids = enc(tok, text)
    d = Detokenizer(tok, stop=["dog stop!", "s!"])
    emitted = stream(d, ids)[1]
    assert d.matched is None
    assert emitted == "the lazy dog stop"  # the final "s" could still be "s!"
    assert emitted + d.flush() == d.text == text


def test_stop_at_the_very_start(tok):
    d = Detokenizer(tok, stop=["hé"])
    deltas, emitted = stream(d, enc(tok, "héllo wörld"))
    assert d.matched == "hé"
    assert emitted == d.text == "" and all(x == "" for x in deltas)


def test_earliest_stop_wins(tok):
    text = "the quick brown fox 🎉 jumps"
    ids = enc(tok, text)
    for stops in (["🎉", "brown", "jumps"], ["jumps", "brown", "🎉"]):
        for chunk in (1, len(ids)):  # token by token, and all at once
            d = Detokenizer(tok, stop=stops)
            _, emitted = stream(d, ids, chunk)
            assert d.matched == "brown" and emitted == d.text == "the quick "
    # Overlapping stops: the one that completes first is the one generation meets.
    for chunk in (1, len(ids)):
        d = Detokenizer(tok, stop=["quick brown fox", "ick"])
        stream(d, ids, chunk)
        assert d.matched == "ick" and d.text == "the qu"


def test_bad_stop_is_named(tok):
    with pytest.raises(ValueError, match="stop"):
        Detokenizer(tok, stop=[""])
