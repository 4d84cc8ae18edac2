"""Every hook is documented and has a test of its own (test_hook_<name>), as datasette does."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from core import hookimpl, hookspecs
from core.chat_template import ChatTemplate
from core.cli import build_parser
from core.config import EngineConfig
from core.engine import AsyncEngine
from core.errors import PluginError
from core.plugins import PluginHost, load_plugins
from core.resolve import resolve_chat_template, select_backend
from core.testing.fake import ByteTokenizer, FakeBackend

HOOKS = hookspecs.hook_names()


@pytest.fixture
def host() -> PluginHost:
    return load_plugins(allow="", use_environment=False)


class PlainTemplate(ChatTemplate):
    def __init__(self, tag: str = "plain") -> None:
        self.tag = tag

    def render(self, messages, *, add_generation_prompt=True, tools=None, **kwargs):
        return self.tag + ":" + "|".join(m["content"] for m in messages)


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_is_documented(hook):
    info = hookspecs.describe(hook)
    for parameter in inspect.signature(getattr(hookspecs, hook)).parameters:
        assert f":param {parameter}:" in info["doc"], f"{hook} does not document {parameter}"
    assert ":returns:" in info["doc"]


@pytest.mark.parametrize("hook", HOOKS)
def test_every_hook_has_a_test(hook):
    sources = "".join(p.read_text() for p in Path(__file__).parent.rglob("test_*.py"))
    assert re.search(rf"def test_hook_{hook}\b", sources), f"no test_hook_{hook}"


def test_every_registration_hook_is_specified():
    assert set(hookspecs.REGISTRATION_HOOKS) <= set(HOOKS)


def test_hook_core_register_backends(host):
    class Plugin:
        @hookimpl
        def core_register_backends(self, register):
            register("toy", lambda config: FakeBackend(max_model_len=64), priority=100)
            register("broken", "nowhere:Backend", priority=200, available=lambda: "needs a quantum computer")

    host.register(Plugin())
    assert select_backend(host, None).name == "toy"  # "broken" is unavailable, however high its priority
    with pytest.raises(PluginError, match="quantum"):
        select_backend(host, "broken")
    with pytest.raises(PluginError, match="no backend named 'nope'; installed: broken, toy"):
        select_backend(host, "nope")
    engine = AsyncEngine.from_config(EngineConfig(backend="toy"), plugins=host)
    assert engine.model_info.max_model_len == 64


def test_hook_core_register_model_architectures(host):
    class Plugin:
        @hookimpl
        def core_register_model_architectures(self, register):
            register("ToyForCausalLM", "core.testing.fake:FakeBackend", backend="pytorch")
            register("ToyForCausalLM", "core.testing.fake:ByteTokenizer", backend="other")

    host.register(Plugin())
    assert host.model_architectures.in_scope("pytorch")["ToyForCausalLM"].load() is FakeBackend
    assert host.model_architectures.get("ToyForCausalLM", scope="other").load() is ByteTokenizer


def test_hook_core_register_chat_templates(host):
    class Plugin:
        @hookimpl
        def core_register_chat_templates(self, register):
            register("plain", lambda tokenizer: PlainTemplate(), architectures=("FakeForCausalLM",))

    host.register(Plugin())
    model = FakeBackend().model_info
    by_architecture = resolve_chat_template(host, None, model, ByteTokenizer())
    by_name = resolve_chat_template(host, "plain", model, None)
    assert isinstance(by_architecture, PlainTemplate) and isinstance(by_name, PlainTemplate)
    with pytest.raises(PluginError, match="neither a file nor a registered template"):
        resolve_chat_template(host, "missing", model, None)


def test_hook_core_make_chat_template(host, tmp_path):
    class Plugin:
        @hookimpl
        def core_make_chat_template(self, source, tokenizer):
            return PlainTemplate(tag=source.strip()) if source.startswith("TAG") else None

    model = FakeBackend().model_info
    with pytest.raises(PluginError, match="no installed plugin can render"):
        resolve_chat_template(host, None, type(model)(**{**model.__dict__, "chat_template": "TAG1"}), None)
    host.register(Plugin())
    own = resolve_chat_template(host, None, type(model)(**{**model.__dict__, "chat_template": "TAG1"}), None)
    path = tmp_path / "t.jinja"
    path.write_text("TAG2")
    assert own.tag == "TAG1" and resolve_chat_template(host, str(path), model, None).tag == "TAG2"


def check_parser_registration(host, hook, registry):
    plugin = type("Plugin", (), {hook: hookimpl(lambda self, register: register("p", object, architectures=("A",)))})
    host.register(plugin())
    entry = getattr(host, registry).get("p")
    assert entry.load() is object and entry.meta["architectures"] == ("A",)


def test_hook_core_register_reasoning_parsers(host):
    check_parser_registration(host, "core_register_reasoning_parsers", "reasoning_parsers")


def test_hook_core_register_tool_call_parsers(host):
    check_parser_registration(host, "core_register_tool_call_parsers", "tool_call_parsers")


def test_hook_core_register_vision_processors(host):
    class Plugin:
        @hookimpl
        def core_register_vision_processors(self, register):
            register("ToyVLForConditionalGeneration", "core.testing.fake:ByteTokenizer")

    host.register(Plugin())
    assert host.vision_processors.get("ToyVLForConditionalGeneration").load() is ByteTokenizer


def test_hook_core_register_commands(monkeypatch, host, capsys):
    calls = []

    class Plugin:
        @hookimpl
        def core_register_commands(self, register):
            register("hello", lambda args: calls.append(args.name) or 0, help="say hello",
                     configure=lambda parser: parser.add_argument("name"))

    host.register(Plugin())
    monkeypatch.setattr("core.plugins.get_plugins", lambda: host)
    args = build_parser().parse_args(["hello", "Ada"])
    assert args.run(args) == 0 and calls == ["Ada"]
    assert "say hello" in build_parser().format_help()
