"""Incremental detokenization (router/calls/text_stream.py): UTF-8 characters split across tokens, special
tokens, and stop strings that must never reach the client, not even partially."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanovllm.router.calls.text_stream import TextStream
from tests.model_factory import EOS_ID, build_tokenizer

PAD_ID = 0
MIXED = "東京🙂 café Ελληνικά"
QUICK = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tok():
    return build_tokenizer()


@pytest.fixture(scope="module")
def backend(tok):
    return tok.backend_tokenizer


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def stream_deltas(backend, ids: Sequence[int], stop: Sequence[str] = (), chunk: int = 1):
    """Push ids `chunk` at a time; returns (stream, push deltas, finish delta)."""
    stream = TextStream(backend, stop)
    deltas = [stream.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    return stream, deltas, stream.finish()


def expected_text(full: str, stop: Sequence[str]) -> str:
    """What a client must receive: the text before the earliest stop-string occurrence."""
    hits = [i for i in (full.find(s) for s in stop if s) if i >= 0]
    return full[: min(hits)] if hits else full


# --- UTF-8 and special tokens ---------------------------------------------------------------------------


def test_mixed_text_really_splits_characters_across_tokens(tok, backend):
    """Guards the premise of the UTF-8 tests: some tokens of MIXED hold only part of a character."""
    ids = encode(tok, MIXED)
    assert any("\ufffd" in backend.decode([i]) for i in ids)


def test_split_characters_never_yield_replacement_char(tok, backend):
    """Token-by-token pushes never emit U+FFFD for a character split across tokens, and the deltas plus
    finish() reproduce the full decode."""
    ids = encode(tok, MIXED)
    stream, deltas, tail = stream_deltas(backend, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=True) == MIXED
    assert not stream.stopped


def test_partial_character_is_held_until_complete(tok, backend):
    """A push ending mid-character returns nothing for that character; the completing token releases it."""
    ids = encode(tok, "🙂")
    assert len(ids) > 1
    stream = TextStream(backend)
    assert [stream.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert stream.push(ids[-1:]) == "🙂"
    assert stream.finish() == ""


@pytest.mark.parametrize("chunk", [2, 3, 5, 1000])
def test_chunked_pushes_give_the_same_text(tok, backend, chunk):
    """Pushing several tokens per call yields the same concatenation as one at a time."""
    ids = encode(tok, MIXED + " " + QUICK)
    _, deltas, tail = stream_deltas(backend, ids, chunk=chunk)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + tail == MIXED + " " + QUICK


def test_special_tokens_are_skipped(tok, backend):
    """<eos>/<pad> ids contribute no text, even between the byte tokens of one character."""
    mixed = encode(tok, MIXED)
    ids = [EOS_ID, *mixed[:1], EOS_ID, PAD_ID, *mixed[1:], EOS_ID, *encode(tok, " ok"), PAD_ID]
    _, deltas, tail = stream_deltas(backend, ids)
    text = "".join(deltas) + tail
    assert text == tok.decode(ids, skip_special_tokens=True) == MIXED + " ok"
    assert "<eos>" not in text and "<pad>" not in text


def test_finish_renders_an_incomplete_last_character_like_the_full_decode(tok, backend):
    """A request that ends mid-character still gets its text; the stray bytes come out as U+FFFD."""
    ids = encode(tok, "ok " + MIXED)
    cut = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd"))
    _, deltas, tail = stream_deltas(backend, ids[:cut])
    assert "".join(deltas) + tail == tok.decode(ids[:cut], skip_special_tokens=True)
    assert tail.endswith("\ufffd")


def test_empty_stream(backend):
    """No tokens: nothing to send."""
    stream = TextStream(backend, ["x"])
    assert stream.push([]) == ""
    assert stream.finish() == ""
    assert not stream.stopped


# --- stop strings ---------------------------------------------------------------------------------------


def check_stop(tok, backend, text: str, stop: list[str], expected: str, chunk: int = 1) -> None:
    ids = encode(tok, text)
    stream, deltas, tail = stream_deltas(backend, ids, stop, chunk)
    sent = ""
    for delta in deltas:
        sent += delta
        # every intermediate state is a prefix of the truncated text: no stop prefix ever leaks
        assert expected.startswith(sent), (sent, expected)
    assert sent == expected
    assert tail == ""
    assert stream.stopped
    assert stream.push(encode(tok, " more text")) == ""
    assert stream.finish() == ""


@pytest.mark.parametrize("chunk", [1, 2, 1000])
def test_stop_string_spanning_several_tokens(tok, backend, chunk):
    """A stop string covering several tokens truncates the text right before it, never partially sent."""
    stop = "brown fox jumps"
    assert len(encode(tok, " " + stop)) >= 3  # it really spans tokens
    check_stop(tok, backend, QUICK, [stop], "The quick ", chunk)


@pytest.mark.parametrize("chunk", [1, 2, 1000])
@pytest.mark.parametrize(
    "stop, expected",
    [
        ("京🙂", "東"),  # starts inside the tokens that split 東 and 京
        ("🙂 c", "東京"),  # starts in the bytes of the emoji, split over three tokens
        ("é Ελ", "東京🙂 caf"),
        ("\u03bb\u03b7", "東京🙂 café Ελ"),
    ],
)
def test_stop_string_in_multibyte_region(tok, backend, chunk, stop, expected):
    """Stop strings made of (or starting with) characters split across tokens match exactly."""
    check_stop(tok, backend, MIXED, [stop], expected, chunk)


def test_stop_at_the_very_start(tok, backend):
    """A stop string at the start of the output sends nothing at all."""
    check_stop(tok, backend, QUICK, ["The"], "")


@pytest.mark.parametrize("chunk", [1, 1000])
def test_earliest_stop_string_wins(tok, backend, chunk):
    """With several stop strings, the text ends before the first occurrence of any of them."""
    check_stop(tok, backend, QUICK, ["lazy", "fox", "zzz"], "The quick brown ", chunk)


def test_stop_prefix_is_held_back(tok, backend):
    """Text that could be the start of a stop string is not sent while it might still complete."""
    stream = TextStream(backend, ["brown cow"])
    assert stream.push(encode(tok, "The quick brown")) == "The quick "
    assert stream.push(encode(tok, " c")) == ""  # "brown c": still a prefix of the stop string
    assert stream.push(encode(tok, "at")) == "brown cat"  # cannot complete any more: released
    assert not stream.stopped


@pytest.mark.parametrize("text", ["The quick brown", "The quick brown c", "The quick brown co"])
def test_unfinished_stop_prefix_is_released_by_finish(tok, backend, text):
    """A held stop prefix that never completes (the request ends on "brown co", stop "brown cow") is
    sent by finish(): nothing is lost."""
    stream, deltas, tail = stream_deltas(backend, encode(tok, text), ["brown cow"])
    assert "".join(deltas) == "The quick "
    assert tail == text.removeprefix("The quick ")
    assert not stream.stopped


def test_stop_prefix_that_diverges_is_released_by_push(tok, backend):
    """Once held text can no longer become the stop string ("brown fox" vs "brown cow"), push sends it."""
    stream, deltas, tail = stream_deltas(backend, encode(tok, QUICK), ["brown cow"])
    assert "".join(deltas) + tail == QUICK
    assert tail == ""
    assert not stream.stopped


def test_ids_outside_the_tokenizer_vocabulary_add_no_text(tok, backend):
    """A model's padded vocabulary can produce ids the tokenizer lacks: they add no text, like a full
    decode, and the stream carries on."""
    unknown = backend.get_vocab_size() + 3
    assert backend.id_to_token(unknown) is None
    ids = [*encode(tok, "The quick"), unknown, *encode(tok, " brown")]
    _, deltas, tail = stream_deltas(backend, ids)
    assert "".join(deltas) + tail == tok.decode(ids, skip_special_tokens=True) == "The quick brown"


def test_empty_stop_strings_are_ignored(tok, backend):
    """An empty stop string matches nothing (it would otherwise stop every request at once)."""
    _, deltas, tail = stream_deltas(backend, encode(tok, QUICK), ["", "zzz"])
    assert "".join(deltas) + tail == QUICK


@pytest.mark.parametrize(
    "text_ids, stop, expected",
    [
        # "The brown fox" + token 391 = b" \xf0\x9f" (a space and half an emoji)
        ((321, 475, 462, 391), "fox ", "The brown "),
        # token 469 = b" \xce\x95\xce\xbb\xce\xbb\xce\xb7\xce" (" Ελλη" and half a character)
        ((469,), "λλ", " Ε"),
    ],
)
def test_stop_string_in_text_released_by_finish(tok, backend, text_ids, stop, expected):
    """A request that ends on half a character: the text finish() releases may hold a stop string, which
    must not reach the client either (DecodeStream holds everything since its last output)."""
    ids = list(text_ids)
    assert tok.decode(ids).endswith("\ufffd")  # the token ids still mean what the comments say
    assert expected + stop in tok.decode(ids)
    _, deltas, tail = stream_deltas(backend, ids, [stop])
    assert "".join(deltas) + tail == expected


# --- property -------------------------------------------------------------------------------------------


STOP_ALPHABET = "The quick brown fox λη東京🙂é\ufffd"


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ids=st.lists(st.integers(2, 511), max_size=40),
    chunks=st.lists(st.integers(1, 4), min_size=1, max_size=8),
    data=st.data(),
)
def test_property_deltas_render_the_full_decode(backend, ids, chunks, data):
    """For random token ids, chunkings and stop strings, every intermediate concatenation of the deltas is
    a prefix of the expected text (so no stray U+FFFD and no partial stop string is ever sent), and the
    final text is the full decode truncated before the first stop-string occurrence."""
    full = backend.decode(ids, skip_special_tokens=True)
    kind = data.draw(st.sampled_from(["none", "substring", "random"]), label="stop kind")
    stop: list[str] = []
    if kind == "substring" and full:
        start = data.draw(st.integers(0, len(full) - 1), label="stop start")
        end = data.draw(st.integers(start + 1, min(len(full), start + 8)), label="stop end")
        stop = [full[start:end]]
    elif kind == "random":
        stop = [data.draw(st.text(alphabet=STOP_ALPHABET, min_size=1, max_size=4), label="stop")]
    expected = expected_text(full, stop)

    stream = TextStream(backend, stop)
    sent, i, n = "", 0, 0
    while i < len(ids):
        size = chunks[n % len(chunks)]
        sent += stream.push(ids[i : i + size])
        assert expected.startswith(sent), (sent, expected)
        i, n = i + size, n + 1
    if stream.stopped:
        assert sent == expected
        assert stream.push([300, 301]) == ""
    tail = stream.finish()
    assert sent + tail == expected
    assert stream.stopped == (expected != full)
