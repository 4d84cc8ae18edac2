"""LoRA adapters over HTTP against a real `core serve`: start-up adapters, /v1/models, run-time load,
use, unload and reload with the official client, the key, bad input, and the KV cache back to idle."""

from __future__ import annotations

import dataclasses

import httpx
import openai
import pytest
from conftest import TINY_LLAMA, resolve_spec, run_server
from server_helpers import assert_openai_error, wait_idle

peft = pytest.importorskip("peft")
torch = pytest.importorskip("torch")
KEY = "lora-key"


def make_adapter(base, folder, seed):
    """A PEFT LoRA folder on all projections, with random non-zero A and B."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"], lora_dropout=0.0))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def lora_server(request, tmp_path_factory):
    spec = resolve_spec(TINY_LLAMA, request)
    root = tmp_path_factory.mktemp("loras")
    first = make_adapter(spec.model, root / "first", 1)
    make_adapter(spec.model, root / "second", 2)
    args = ("--dtype", "float32", "--lora-modules", f"first={first}", "--enable-runtime-lora",
            "--allowed-lora-path", str(root), "--max-loras", "2")
    with run_server(dataclasses.replace(spec, args=spec.args + args), ("--api-key", KEY), api_key=KEY) as server:
        yield server, root


def complete(client, model, prompt="the quick brown fox"):
    result = client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    return result.choices[0].text


def test_load_use_unload_reload(lora_server):
    server, root = lora_server
    http = httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60)
    with openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0) as client:
        base_name = client.models.list().data[0].id
        cards = {m.id: m for m in client.models.list().data}
        assert cards["first"].model_extra["parent"] == base_name
        base_text, first_text = complete(client, base_name), complete(client, "first")
        assert first_text != base_text
        client.post("/load_lora_adapter", body={"lora_name": "second", "lora_path": str(root / "second")},
                    cast_to=httpx.Response)
        assert "second" in {m.id for m in client.models.list().data}
        second_text = complete(client, "second")
        assert second_text not in (base_text, first_text)
        assert complete(client, "first") == first_text and complete(client, base_name) == base_text
        client.post("/unload_lora_adapter", body={"lora_name": "second"}, cast_to=httpx.Response)
        with pytest.raises(openai.NotFoundError):
            complete(client, "second")
        client.post("/load_lora_adapter", body={"lora_name": "second", "lora_path": str(root / "second")},
                    cast_to=httpx.Response)
        assert complete(client, "second") == second_text
    wait_idle(http)


def test_a_prefix_shared_across_adapters_is_not_a_cache_hit(lora_server):
    server, _ = lora_server
    http = httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60)
    prompt = "a long shared prefix " * 6
    with openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0) as client:
        base_name = client.models.list().data[0].id
        complete(client, base_name, prompt)
        before = wait_idle(http)["core:prefix_cache_hits_total"]
        complete(client, "first", prompt)
        assert wait_idle(http)["core:prefix_cache_hits_total"] == before
        complete(client, "first", prompt)
        assert wait_idle(http)["core:prefix_cache_hits_total"] > before


def test_bad_runtime_loads_are_400s_naming_the_field(lora_server, tmp_path):
    server, root = lora_server
    post = lambda path, body, **kw: httpx.post(server.url(path), json=body, headers=kw.get("headers", server.headers))  # noqa: E731
    assert post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(root / "first")},
                headers={}).status_code == 401
    assert_openai_error(post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path)}), 400,
                        "lora_path")  # outside --allowed-lora-path
    assert_openai_error(post("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(root / "nope")}), 400,
                        "lora_path")
    assert_openai_error(post("/v1/load_lora_adapter", {"lora_name": "first", "lora_path": str(root / "first")}),
                        400, "lora_name")  # a duplicate
    assert_openai_error(post("/v1/unload_lora_adapter", {"lora_name": "nope"}), 404)


def test_the_response_names_the_adapter_the_request_named(lora_server):
    server, _ = lora_server
    http = httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60)
    with openai.OpenAI(base_url=server.url("/v1"), api_key=KEY, max_retries=0) as client:
        base_name = client.models.list().data[0].id
        for model in (base_name, "first"):
            args = {"model": model, "max_tokens": 4, "temperature": 0}
            assert client.completions.create(prompt="hi", **args).model == model
            assert {c.model for c in client.completions.create(prompt="hi", stream=True, **args)} == {model}
            chat = {"messages": [{"role": "user", "content": "hi"}], **args}
            assert client.chat.completions.create(**chat).model == model
            assert {c.model for c in client.chat.completions.create(stream=True, **chat)} == {model}
            assert client.responses.create(model=model, input="hi", max_output_tokens=4).model == model
            message = http.post("/v1/messages", json=chat)
            assert message.status_code == 200 and message.json()["model"] == model
    wait_idle(http)
