"""<think> reasoning: whole-text and streamed parsing agree at every cut of the text."""

from __future__ import annotations

from typing import Any

import pytest

from core.parsers import ParseContext, ReasoningDelta
from core_templates.parsers.think import DeepSeekR1ReasoningParser, Qwen3ReasoningParser, ThinkReasoningParser

QWEN3_PROMPT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
QWEN3_NO_THINK_PROMPT = QWEN3_PROMPT + "<think>\n\n</think>\n\n"
R1_PROMPT = "<｜User｜>Hi<｜Assistant｜><think>\n"

# (parser class, context, model text, expected (reasoning, content))
CASES: list[tuple[type[ThinkReasoningParser], ParseContext, str, tuple[str | None, str]]] = [
    (Qwen3ReasoningParser, ParseContext(QWEN3_PROMPT), "<think>\nLet me see.\n</think>\n\nHello!",
     ("Let me see.", "Hello!")),
    (Qwen3ReasoningParser, ParseContext(), "<think>\na < b </thi\n</think>\n\nx</think>y",
     ("a < b </thi", "x</think>y")),
    (Qwen3ReasoningParser, ParseContext(QWEN3_NO_THINK_PROMPT), "  Hello <think> there", (None, "  Hello <think> there")),
    (Qwen3ReasoningParser, ParseContext(chat_template_kwargs={"enable_thinking": False}),
     "<think>x</think>y", (None, "<think>x</think>y")),
    (Qwen3ReasoningParser, ParseContext(), "<think>\nstill thinking when cut off  ", ("still thinking when cut off", "")),
    (Qwen3ReasoningParser, ParseContext(), "<thin", (None, "<thin")),
    (Qwen3ReasoningParser, ParseContext(), "", (None, "")),
    (DeepSeekR1ReasoningParser, ParseContext(R1_PROMPT), "Okay, 2+2.\n</think>\n\n**4**", ("Okay, 2+2.", "**4**")),
    (DeepSeekR1ReasoningParser, ParseContext(), "Okay.</think>4", ("Okay.", "4")),
    (DeepSeekR1ReasoningParser, ParseContext(), "<think>Okay.</think>\n4 \n", ("Okay.", "4 \n")),
    (DeepSeekR1ReasoningParser, ParseContext(), "<thin", ("<thin", "")),
    (DeepSeekR1ReasoningParser, ParseContext("<｜User｜>Hi<｜Assistant｜>"), "Just content", (None, "Just content")),
    (DeepSeekR1ReasoningParser, ParseContext(R1_PROMPT), "  \n </think>", ("", "")),
]


def stream(parser: ThinkReasoningParser, pieces: list[str]) -> tuple[str, str]:
    deltas = [parser.feed(piece) for piece in pieces] + [parser.flush()]
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)


def cuts(text: str) -> list[list[str]]:
    """The text cut in two at every boundary, and one character at a time."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


@pytest.mark.parametrize(("cls", "context", "text", "expected"), CASES)
def test_split(cls: Any, context: ParseContext, text: str, expected: tuple[str | None, str]) -> None:
    assert cls().start(context).split(text) == expected


@pytest.mark.parametrize(("cls", "context", "text", "expected"), CASES)
def test_streaming_matches_split_at_every_cut(cls: Any, context: ParseContext, text: str,
                                              expected: tuple[str | None, str]) -> None:
    reasoning, content = expected
    for pieces in cuts(text):
        assert stream(cls(None).start(context), pieces) == (reasoning or "", content), pieces


def test_content_streams_without_waiting_for_the_end() -> None:
    parser = Qwen3ReasoningParser().start(ParseContext(QWEN3_PROMPT))
    assert parser.feed("<think>\nhm") == ReasoningDelta(reasoning="hm")
    assert parser.feed("m</think>\n\nHel") == ReasoningDelta(reasoning="m", content="Hel")
    assert parser.feed("lo") == ReasoningDelta(content="lo")
    assert not parser.flush()


@pytest.mark.parametrize(("cls", "context", "waits"), [
    (Qwen3ReasoningParser, ParseContext(QWEN3_PROMPT), True),
    (Qwen3ReasoningParser, ParseContext(QWEN3_NO_THINK_PROMPT), False),  # the prompt closed the reasoning
    (Qwen3ReasoningParser, ParseContext(QWEN3_PROMPT, chat_template_kwargs={"enable_thinking": False}), False),
    (DeepSeekR1ReasoningParser, ParseContext(R1_PROMPT), True),
    (DeepSeekR1ReasoningParser, ParseContext(), True),
])
def test_a_constraint_waits_for_the_end_of_reasoning(cls: Any, context: ParseContext, waits: bool) -> None:
    parser = cls().start(context)
    assert parser.reasoning_end == "</think>" and parser.constraint_waits() is waits
