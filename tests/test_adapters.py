"""core.adapters (torch-free): names, the policy's path checks, and a backend without adapters refusing them."""

from __future__ import annotations

import asyncio

import pytest

from core.adapters import AdapterPolicy, parse_lora_modules
from core.config import GenerationConfig
from core.errors import InvalidRequestError, UnsupportedError


def test_lora_modules_parse_and_refuse_duplicates():
    assert [m.name for m in parse_lora_modules(["a=/x", "b=/y"])] == ["a", "b"]
    assert parse_lora_modules({"a": "/x"})[0].path == "/x"
    with pytest.raises(InvalidRequestError, match="twice"):
        parse_lora_modules(["a=/x", "a=/y"])
    with pytest.raises(InvalidRequestError, match="name=path"):
        parse_lora_modules(["nopath"])


def test_runtime_paths_are_closed_by_default_and_checked(tmp_path):
    with pytest.raises(InvalidRequestError, match="runtime LoRA loading is off"):
        AdapterPolicy().check_runtime_path(str(tmp_path))
    policy = AdapterPolicy(runtime_loading=True, allowed_paths=(str(tmp_path),))
    assert policy.check_runtime_path(str(tmp_path / "a")) == str((tmp_path / "a").resolve())
    with pytest.raises(InvalidRequestError) as info:
        policy.check_runtime_path(str(tmp_path / ".." / "elsewhere"))
    assert info.value.param == "lora_path"


def test_a_backend_without_adapters_refuses_a_request_naming_one():
    from core.engine import AsyncEngine
    from core.testing.fake import FakeBackend

    engine = AsyncEngine(FakeBackend())
    assert not engine.backend.supports_adapters
    with pytest.raises(UnsupportedError) as info:
        asyncio.run(engine.prepare([1, 2, 3], GenerationConfig(adapter="a1")))  # the public path
    assert info.value.code.http_status == 400 and info.value.param == "model"
