"""IncrementalDetokenizer: UTF-8 safety, stop strings across tokens, special tokens."""

from __future__ import annotations

import pytest

from core.detokenize import IncrementalDetokenizer
from core.testing.fake import EOS, ByteTokenizer

TOK = ByteTokenizer()


def stream(text_or_ids, **options):
    ids = list(text_or_ids.encode()) if isinstance(text_or_ids, str) else list(text_or_ids)
    detok = IncrementalDetokenizer(TOK, TOK.encode("prompt"), **options)
    deltas = [detok.update([t]).text for t in ids]
    deltas.append(detok.update([], final=True).text)
    return deltas, detok


def test_multibyte_characters_are_never_split():
    deltas, _ = stream("a😀b€")
    assert "".join(deltas) == "a😀b€"
    assert all("\ufffd" not in d for d in deltas)
    assert deltas[1:4] == ["", "", ""]  # the emoji's first three bytes are held back


def test_an_incomplete_character_at_the_end_is_not_dropped():
    ids = [*b"ab", *"😀".encode()[:2]]  # the reply ends inside a 4-byte character
    deltas, detok = stream(ids)
    assert "".join(deltas) == detok.output_text == TOK.decode(ids) == "ab\ufffd"
    assert deltas[-1] == "\ufffd"


@pytest.mark.parametrize("text", ["xxSTOPyy", "xxSTOP", "STOPyy"])
def test_stop_string_spanning_tokens(text):
    deltas, detok = stream(text, stop=["STOP"])
    assert "".join(deltas) == text.split("STOP")[0] and detok.stopped == "STOP"


def test_partial_stop_prefix_is_released_when_it_cannot_match():
    deltas, detok = stream("aSTObSTOP", stop=["STOP"])
    assert "".join(deltas) == "aSTOb" and detok.stopped == "STOP"
    assert deltas[:4] == ["a", "", "", ""]


def test_earliest_of_several_stops_wins_and_can_be_included():
    deltas, detok = stream("one two three", stop=["three", "two"], include_stop_str_in_output=True)
    assert "".join(deltas) == "one two" and detok.stopped == "two"


def test_held_back_text_is_flushed_at_the_end():
    deltas, detok = stream("abcST", stop=["STOP"])
    assert "".join(deltas) == "abcST" and detok.stopped is None


def test_special_tokens_skipped_or_kept():
    ids = [*b"hi", EOS, *b"!"]
    assert "".join(stream(ids)[0]) == "hi!"
    assert "".join(stream(ids, skip_special_tokens=False)[0]) == "hi<eos>!"
