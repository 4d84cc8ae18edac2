"""Fixtures: real templates, offline tokenizers for them, and the plugin host.

Test modules get these as fixtures (not imports), so the tests run under any pytest import mode.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from core.plugins import PluginHost, load_plugins
from core_templates.plugin import builtin_source

DATA = Path(__file__).parent / "data"

# template name -> (source, bos_token, eos_token) as the model's tokenizer declares them
TEMPLATES: dict[str, tuple[str, str | None, str | None]] = {
    "smollm2": ((DATA / "smollm2.jinja").read_text(), "<|im_start|>", "<|im_end|>"),
    "qwen2.5": ((DATA / "qwen2.5.jinja").read_text(), None, "<|im_end|>"),
    "deepseek_r1": ((DATA / "deepseek_r1.jinja").read_text(), "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "llama3": (builtin_source("llama3"), "<|begin_of_text|>", "<|eot_id|>"),
    "mistral": (builtin_source("mistral"), "<s>", "</s>"),
    "gemma": (builtin_source("gemma"), "<bos>", "<eos>"),
    "qwen3": (builtin_source("qwen3"), None, "<|im_end|>"),
    "chatml": (builtin_source("chatml"), None, "<|im_end|>"),
    "completion": (builtin_source("completion"), None, None),
    "gpt_oss": ((DATA / "gpt_oss.jinja").read_text(), "<|startoftext|>", "<|return|>"),
    "deepseek_v3": ((DATA / "deepseek_v3.jinja").read_text(), "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "deepseek_v31": ((DATA / "deepseek_v31.jinja").read_text(), "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
    "kimi_k2": ((DATA / "kimi_k2.jinja").read_text(), "[BOS]", "[EOS]"),
    "glm46": ((DATA / "glm46.jinja").read_text(), None, "<|endoftext|>"),
    "llama4_pythonic": ((DATA / "llama4_pythonic.jinja").read_text(), "<|begin_of_text|>", "<|eot|>"),
}


def make_tokenizer(bos: str | None, eos: str | None, chat_template: str | None = None):
    """A tiny offline Hugging Face tokenizer that knows only its special tokens."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, **{t: i + 1 for i, t in enumerate(t for t in (bos, eos) if t)}}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")), bos_token=bos, eos_token=eos
    )
    tokenizer.chat_template = chat_template
    return tokenizer


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "template_name" in metafunc.fixturenames:  # one test per real template
        metafunc.parametrize("template_name", sorted(TEMPLATES))


@pytest.fixture
def templates() -> dict[str, tuple[str, str | None, str | None]]:
    return TEMPLATES


@pytest.fixture(name="make_tokenizer")
def make_tokenizer_fixture() -> Callable[..., object]:
    return make_tokenizer


@pytest.fixture
def host() -> PluginHost:
    return load_plugins(allow="templates")
