"""The chat page in a real browser against `core serve` on a tiny random-weight Qwen2-VL (the pytorch
backend and the vl_models plugin): the page offers images because /info says the model has a vision
processor; an attached image goes out as a data URI and reaches the model (its placeholder tokens are
in the prompt the server counted), and a pasted image is attached too."""

from __future__ import annotations

import base64
import importlib.util
import io
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from chromium_page import open_chat, send, stored_conversations, wait_reply_done
from conftest import ServerSpec, run_server

pytest.importorskip("core_pytorch_backend")
pytest.importorskip("core_vl_models")
pytest.importorskip("core_templates")

VL_CHECKPOINTS = Path(__file__).parents[2] / "plugins" / "vl_models" / "tests" / "vl_checkpoints.py"
SETTINGS = {"max_tokens": "3", "temperature": "0"}


def _build_qwen2_vl(path: Path) -> Path:
    spec = importlib.util.spec_from_file_location("core_vl_models_test_checkpoints", VL_CHECKPOINTS)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(spec.name, module)
    spec.loader.exec_module(module)
    return module.build_qwen2_vl(path)


def _png(size: tuple[int, int] = (64, 56)) -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 40, 90)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def qwen2_vl(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build_qwen2_vl(tmp_path_factory.mktemp("qwen2-vl"))


@pytest.fixture(scope="module")
def image_prompt_tokens(qwen2_vl: Path) -> int:
    """The length of the model's own processor's prompt for the image and "Describe." (transformers)."""
    import transformers

    from core_vl_models.base import without_video

    processor = without_video(transformers.Qwen2VLProcessor).from_pretrained(qwen2_vl)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    from PIL import Image

    return processor(text=[text], images=[Image.open(io.BytesIO(_png()))], return_tensors="pt")["input_ids"].shape[1]


@pytest.fixture(scope="module")
def vl_server(qwen2_vl: Path) -> Iterator[Any]:
    spec = ServerSpec("qwen2-vl", backend="pytorch", model=str(qwen2_vl), args=("--kv-cache-memory", "0.02"),
                      env={"CORE_PLUGINS": "pytorch_backend,templates,vl_models"})
    with run_server(spec) as server:
        yield server


def prompt_tokens(page: Any) -> int:
    return stored_conversations(page)[0]["messages"][-1]["usage"]["prompt_tokens"]


def test_an_attached_image_reaches_the_model(browser, vl_server, image_prompt_tokens, tmp_path):
    page = open_chat(browser, vl_server.base_url, SETTINGS)
    page.wait_for_selector("#attach", state="visible")  # /info said: a vision model
    send(page, "Describe.")
    assert not wait_reply_done(page).locator(".error").count()
    text_only = prompt_tokens(page)

    page.click("#new-chat")
    (tmp_path / "red.png").write_bytes(_png())
    page.set_input_files("#file", str(tmp_path / "red.png"))
    page.wait_for_selector("#attachments img")
    with page.expect_request("**/v1/chat/completions") as request:
        send(page, "Describe.")
    [message] = request.value.post_data_json["messages"]
    image, text = message["content"]
    assert image["image_url"]["url"] == "data:image/png;base64," + base64.b64encode(_png()).decode()
    assert text == {"type": "text", "text": "Describe."}
    reply = wait_reply_done(page)
    assert not reply.locator(".error").count(), reply.inner_text()
    assert prompt_tokens(page) == image_prompt_tokens > text_only  # the image's placeholders reached the model
    assert page.locator(".message.user .images img").count() == 1 and page.locator("#attachments").is_hidden()
    page.screenshot(path=str(tmp_path / "vision.png"))
    assert not page.errors


def test_a_pasted_image_is_attached(browser, vl_server):
    page = open_chat(browser, vl_server.base_url, SETTINGS)
    page.wait_for_selector("#attach", state="visible")
    page.evaluate("""(data) => {
        const bytes = Uint8Array.from(atob(data), (c) => c.charCodeAt(0));
        const transfer = new DataTransfer();
        transfer.items.add(new File([bytes], "pasted.png", {type: "image/png"}));
        document.querySelector("#prompt").dispatchEvent(new ClipboardEvent("paste", {clipboardData: transfer}));
    }""", base64.b64encode(_png()).decode())
    page.wait_for_selector("#attachments img")
    page.click("#attachments button")  # and removed again
    assert page.locator("#attachments").is_hidden()
