"""`core serve` on a vision-language model, end to end: a tiny random-weight Qwen2-VL checkpoint on the
pytorch backend, images sent with the official OpenAI client (data URI, local file), Anthropic image
blocks, the media allow-lists, the prefix cache on images, and a text-only model refusing images.

This module starts its own servers (a VL model needs its own flags and plugins).
"""

from __future__ import annotations

import base64
import importlib.util
import io
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("core_pytorch_backend")
pytest.importorskip("core_vl_models")
pytest.importorskip("core_templates")
openai = pytest.importorskip("openai")

HERE = Path(__file__).parent
VL_CHECKPOINTS = HERE.parents[1] / "plugins" / "vl_models" / "tests" / "vl_checkpoints.py"
START_TIMEOUT_S = 180.0
NEW_TOKENS = 6


def _builders():
    spec = importlib.util.spec_from_file_location("core_vl_models_test_checkpoints", VL_CHECKPOINTS)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module


def _image(seed: int, size: tuple[int, int] = (64, 56)):
    import random

    from PIL import Image

    rng = random.Random(seed)
    image = Image.new("RGB", size)
    image.putdata([(rng.randrange(256), rng.randrange(256), rng.randrange(256)) for _ in range(size[0] * size[1])])
    return image


def _png(image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _data_uri(image) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(image)).decode()


class _Server:
    """One `core serve` subprocess on a free port, logging to a temporary file."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+b", prefix="core-serve-vision-", suffix=".log", delete=False)
        command = [sys.executable, "-m", "core.cli", "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
        self.process = subprocess.Popen(command, env={**os.environ, **env}, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"core serve exited with {self.process.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.base_url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"core serve did not become healthy in {START_TIMEOUT_S} s:\n{self.output()}")

    def output(self) -> str:
        return Path(self.log.name).read_text(errors="replace")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        return self.process.returncode


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("media")
    (folder / "picture.png").write_bytes(_png(_image(1)))
    return folder


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory) -> Path:
    return _builders().build_qwen2_vl(tmp_path_factory.mktemp("qwen2-vl"))


@pytest.fixture(scope="module")
def vl_server(qwen2_vl, media_dir) -> Iterator[_Server]:
    server = _Server([str(qwen2_vl), "--backend", "pytorch", "--kv-cache-memory", "0.02", "--block-size", "4",
                      "--allowed-local-media-path", str(media_dir), "--allowed-media-domains", "images.example"],
                     {"CORE_PLUGINS": "pytorch_backend,templates,vl_models"})
    yield server
    assert server.stop() == 0, server.output()
    os.unlink(server.log.name)


@pytest.fixture(scope="module")
def expected(qwen2_vl) -> dict:
    """transformers' own greedy reply (and prompt length) for one image + "Describe."."""
    import torch
    import transformers

    from core_vl_models.base import without_video

    model = transformers.Qwen2VLForConditionalGeneration.from_pretrained(qwen2_vl).eval()
    processor = without_video(transformers.Qwen2VLProcessor).from_pretrained(qwen2_vl)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    inputs = processor(text=[text], images=[_image(1)], return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    ids = out[0, inputs["input_ids"].shape[1]:].tolist()
    return {"tokens": [processor.tokenizer.decode([i]) for i in ids], "prompt_tokens": inputs["input_ids"].shape[1]}


def _image_message(url: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "Describe."}]}]


def _chat(server: _Server, url: str):
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)
    return client.chat.completions.create(model=client.models.list().data[0].id, messages=_image_message(url),
                                          max_tokens=NEW_TOKENS, temperature=0.0, logprobs=True,
                                          extra_body={"min_tokens": NEW_TOKENS})


def _tokens(reply) -> list[str]:
    """The reply's tokens (random weights write partial UTF-8, so the text alone says less)."""
    return [entry.token for entry in reply.choices[0].logprobs.content]


def test_openai_client_with_a_data_uri_image(vl_server, expected):
    first = _chat(vl_server, _data_uri(_image(1)))
    assert _tokens(first) == expected["tokens"]
    assert first.usage.prompt_tokens == expected["prompt_tokens"]  # image tokens included
    assert first.usage.completion_tokens == NEW_TOKENS
    again = _chat(vl_server, _data_uri(_image(1)))
    assert _tokens(again) == expected["tokens"]
    assert again.usage.prompt_tokens_details.cached_tokens > 0  # same image and prefix: a cache hit


def test_local_file_under_the_allowed_path(vl_server, media_dir, expected):
    reply = _chat(vl_server, (media_dir / "picture.png").as_uri())
    assert _tokens(reply) == expected["tokens"]


@pytest.mark.parametrize("url, words", [
    ("file:///etc/hostname", "outside the allowed media directory"),
    ("http://elsewhere.example/cat.png", "--allowed-media-domains"),
    ("data:image/png;base64,AAAA", "cannot be decoded"),
])
def test_refused_images_are_400s_naming_the_field(vl_server, url, words):
    response = httpx.post(vl_server.base_url + "/v1/chat/completions",
                          json={"messages": _image_message(url), "max_tokens": 2})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert words in error["message"]
    assert error["param"] == "messages[0].content[0].image_url.url"


def test_anthropic_image_block(vl_server, expected):
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(_png(_image(1))).decode()}}
    body = {"max_tokens": NEW_TOKENS, "temperature": 0.0,
            "messages": [{"role": "user", "content": [block, {"type": "text", "text": "Describe."}]}]}
    response = httpx.post(vl_server.base_url + "/v1/messages", json=body, timeout=60)
    assert response.status_code == 200, response.text
    message = response.json()
    assert message["usage"]["input_tokens"] == expected["prompt_tokens"]
    assert message["content"][0]["type"] == "text"
    assert message["usage"]["output_tokens"] >= 1


def test_text_only_model_refuses_an_image():
    """The fake backend's model has no vision processor: an image is a 400 that says so."""
    server = _Server(["--backend", "fake", "--chat-template", "tiny-chatml"],
                     {"CORE_PLUGINS": "", "CORE_EXTRA_PLUGINS": "fake_backend_plugin",
                      "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))})
    try:
        response = httpx.post(server.base_url + "/v1/chat/completions",
                              json={"messages": _image_message(_data_uri(_image(2))), "max_tokens": 2})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert "does not accept images" in error["message"]
        assert error["param"] == "messages[0].content[0].image_url.url"
    finally:
        assert server.stop() == 0, server.output()
        os.unlink(server.log.name)
