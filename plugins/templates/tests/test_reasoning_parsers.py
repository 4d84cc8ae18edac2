"""<think> reasoning: whole-text and streamed parsing agree at every cut of the text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from core.parsers import ParseContext, ReasoningDelta
from core_templates.jinja_template import JinjaChatTemplate
from core_templates.parsers.think import (
    DeepSeekR1ReasoningParser,
    PromptThinkReasoningParser,
    Qwen3ReasoningParser,
    ThinkReasoningParser,
)

DATA = Path(__file__).parent / "data"


def prompt(template: str, system: str = "", **kwargs: Any) -> str:
    """The prompt a real template (data/TEMPLATE.jinja) renders for one question."""
    messages = [{"role": "system", "content": system}] if system else []
    source = (DATA / f"{template}.jinja").read_text(encoding="utf-8")
    return JinjaChatTemplate(source).render([*messages, {"role": "user", "content": "Hi"}], **kwargs)


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

NO_THINKING = {"enable_thinking": False}
# Hybrid families, with the prompts their own templates render: Qwen3.5 and Nemotron-H open <think> in the
# prompt; LFM2.5 and MiniMax-M1 write it themselves.
CASES += [
    (Qwen3ReasoningParser, ParseContext(prompt("qwen3_5")), "Paris, then.\n</think>\n\nSunny.", ("Paris, then.", "Sunny.")),
    (Qwen3ReasoningParser, ParseContext(prompt("qwen3_5", **NO_THINKING), chat_template_kwargs=NO_THINKING),
     "Sunny.", (None, "Sunny.")),
    (PromptThinkReasoningParser, ParseContext(prompt("nemotron_nano_v2")), "Hm.\n</think>\n\nSunny.", ("Hm.", "Sunny.")),
    # Nano 2's template ignores enable_thinking (it still opens <think>): the prompt decides
    (PromptThinkReasoningParser, ParseContext(prompt("nemotron_nano_v2", **NO_THINKING), chat_template_kwargs=NO_THINKING),
     "Hm.\n</think>\n\nSunny.", ("Hm.", "Sunny.")),
    (PromptThinkReasoningParser, ParseContext(prompt("nemotron_nano_v2", system="/no_think")), "Sunny.", (None, "Sunny.")),
    (PromptThinkReasoningParser, ParseContext(prompt("nemotron3_nano")), "Hm.\n</think>\nSunny.", ("Hm.", "Sunny.")),
    (PromptThinkReasoningParser, ParseContext(prompt("nemotron3_nano", **NO_THINKING), chat_template_kwargs=NO_THINKING),
     "Sunny.", (None, "Sunny.")),
    (PromptThinkReasoningParser, ParseContext(chat_template_kwargs=NO_THINKING), "<think>x</think>y", (None, "<think>x</think>y")),
    (PromptThinkReasoningParser, ParseContext(prompt("lfm2_5")), "<think>Easy.</think>Sunny.", ("Easy.", "Sunny.")),
    (PromptThinkReasoningParser, ParseContext(prompt("lfm2_5")), "Sunny.", (None, "Sunny.")),
    # LFM2.5's and MiniMax-M1's templates ignore enable_thinking: the model's own <think> still counts
    (PromptThinkReasoningParser, ParseContext(prompt("lfm2_5_8b_a1b"), chat_template_kwargs=NO_THINKING),
     "<think>Easy.</think>Sunny.", ("Easy.", "Sunny.")),
    (PromptThinkReasoningParser, ParseContext(prompt("minimax_m1")), "<think>\nEasy.\n</think>\nSunny.", ("Easy.", "Sunny.")),
    (PromptThinkReasoningParser, ParseContext(prompt("minimax_m1"), chat_template_kwargs=NO_THINKING),
     "<think>\nEasy.\n</think>\nSunny.", ("Easy.", "Sunny.")),
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
    (Qwen3ReasoningParser, ParseContext(prompt("qwen3_5")), True),
    (Qwen3ReasoningParser, ParseContext(prompt("qwen3_5", **NO_THINKING)), False),
    (PromptThinkReasoningParser, ParseContext(prompt("nemotron_nano_v2"), chat_template_kwargs=NO_THINKING), True),
    (PromptThinkReasoningParser, ParseContext(prompt("nemotron_nano_v2", system="/no_think")), False),
    (PromptThinkReasoningParser, ParseContext(prompt("nemotron3_nano", **NO_THINKING)), False),
])
def test_a_constraint_waits_for_the_end_of_reasoning(cls: Any, context: ParseContext, waits: bool) -> None:
    parser = cls().start(context)
    assert parser.reasoning_end == "</think>" and parser.constraint_waits() is waits
