"""/v1/completions echo (with and without logprobs, max_tokens 0) and vLLM's prompt_logprobs on completions
and chat, through the official client. On the tiny Llama the prompt logprobs equal the log-softmax of
transformers' logits on the same float32 weights (within 1e-4), also when the prompt is cached."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
from conftest import RunningServer
from server_helpers import assert_openai_error

PROMPT = "The quick brown fox jumps over"
TOLERANCE = 1e-4


def prompt_ids(http: httpx.Client, prompt: str = PROMPT) -> list[int]:
    return http.post("/tokenize", json={"prompt": prompt}).json()["tokens"]


def test_echo_without_logprobs_repeats_the_prompt(client: openai.OpenAI, model: str):
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
    echoed = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPT + plain.choices[0].text
    assert echoed.choices[0].logprobs is None
    usage = (echoed.usage.prompt_tokens, echoed.usage.completion_tokens)
    assert usage == (plain.usage.prompt_tokens, plain.usage.completion_tokens)


def test_echo_with_max_tokens_0_scores_the_prompt_only(client: openai.OpenAI, model: str, http: httpx.Client):
    """lm-eval's local-completions request: OpenAI's legacy logprobs of the prompt, nothing generated."""
    ids = prompt_ids(http)
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True, logprobs=1)
    choice = out.choices[0]
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert out.usage.completion_tokens == 0 and out.usage.prompt_tokens == len(ids)
    lp = choice.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs[1:])
    assert all(len(top) == 1 for top in lp.top_logprobs[1:])
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(ids))]
    assert lp.tokens == [http.post("/detokenize", json={"tokens": [t]}).json()["prompt"] for t in ids]


def test_echo_with_generation_puts_the_prompt_first(client: openai.OpenAI, model: str, http: httpx.Client):
    ids = prompt_ids(http)
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2, echo=True)
    choice, generated = out.choices[0], plain.choices[0].logprobs
    assert choice.text == PROMPT + plain.choices[0].text
    assert len(choice.logprobs.tokens) == len(ids) + 3
    assert choice.logprobs.token_logprobs[len(ids):] == generated.token_logprobs
    assert choice.logprobs.tokens[len(ids):] == generated.tokens
    assert choice.logprobs.text_offset[len(ids):] == [len(PROMPT) + o for o in generated.text_offset]
    assert all(len(top) == 2 for top in choice.logprobs.top_logprobs[1:])


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_streamed_echo_equals_the_whole_response(client: openai.OpenAI, model: str, max_tokens: int):
    kwargs = dict(model=model, prompt=PROMPT, max_tokens=max_tokens, temperature=0, logprobs=1, echo=True)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    pieces = [c.choices[0] for c in chunks if c.choices]
    assert "".join(p.text for p in pieces) == whole.text
    assert [x for p in pieces if p.logprobs for x in p.logprobs.token_logprobs] == whole.logprobs.token_logprobs
    assert [x for p in pieces if p.logprobs for x in p.logprobs.text_offset] == whole.logprobs.text_offset
    assert pieces[-1].finish_reason == whole.finish_reason
    assert chunks[-1].usage.completion_tokens == max_tokens


def test_token_prompts_echo_their_text(client: openai.OpenAI, model: str, http: httpx.Client):
    ids = prompt_ids(http)
    out = client.completions.create(model=model, prompt=[ids, ids[:3]], max_tokens=0, echo=True, logprobs=0)
    texts = [http.post("/detokenize", json={"tokens": p}).json()["prompt"] for p in (ids, ids[:3])]
    assert [c.text for c in out.choices] == texts
    assert [len(c.logprobs.tokens) for c in out.choices] == [len(ids), 3]


def test_prompt_logprobs_in_vllms_shape(client: openai.OpenAI, model: str, http: httpx.Client):
    ids = prompt_ids(http)
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=2, extra_body={"prompt_logprobs": 2})
    entries = out.choices[0].model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for token, entry in zip(ids[1:], entries[1:], strict=True):
        assert str(token) in entry and 2 <= len(entry) <= 3
        assert {r["rank"] for r in entry.values()} >= {1, 2}
        assert all(set(r) == {"logprob", "rank", "decoded_token"} for r in entry.values())
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": PROMPT}], max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    entries = chat.model_extra["prompt_logprobs"]
    assert len(entries) == chat.usage.prompt_tokens and entries[0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["rank"] >= 1 for e in entries[1:])


def test_prompt_logprobs_are_refused_when_streaming(http: httpx.Client, model: str):
    body = {"model": model, "prompt": PROMPT, "stream": True, "prompt_logprobs": 1}
    assert_openai_error(http.post("/v1/completions", json=body), 400, "prompt_logprobs")


def test_max_tokens_0_needs_echo(http: httpx.Client, model: str):
    error = assert_openai_error(http.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": 0}),
                                400, "max_tokens")
    assert "echo" in error["message"]


# -- the oracle ------------------------------------------------------------------------------------------


def transformers_logprobs(checkpoint: Path, ids: list[int]) -> list[float]:
    """log-softmax of transformers' logits: the logprob of each token after the first."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [logprobs[i - 1, ids[i]].item() for i in range(1, len(ids))]


@pytest.fixture
def checkpoint(server: RunningServer) -> Path:
    if server.spec.is_fake:
        pytest.skip("the oracle needs the real model")
    return Path(server.spec.model)


def test_prompt_logprobs_equal_transformers_also_when_cached(client: openai.OpenAI, model: str, http: httpx.Client,
                                                             checkpoint: Path):
    prompt = PROMPT * 4  # several KV blocks: the second request would find them cached
    ids = prompt_ids(http, prompt)
    expected = transformers_logprobs(checkpoint, ids)
    for _ in range(2):
        out = client.completions.create(model=model, prompt=prompt, max_tokens=0, echo=True, logprobs=1,
                                        extra_body={"prompt_logprobs": 1})
        choice = out.choices[0]
        assert max(abs(a - b) for a, b in zip(choice.logprobs.token_logprobs[1:], expected, strict=True)) < TOLERANCE
        vllm = [e[str(t)]["logprob"] for t, e in zip(ids[1:], choice.model_extra["prompt_logprobs"][1:], strict=True)]
        assert max(abs(a - b) for a, b in zip(vllm, expected, strict=True)) < TOLERANCE
        assert out.usage.prompt_tokens_details.cached_tokens == 0
    # its blocks were cached all the same: a request without prompt logprobs reads them
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=1)
    assert plain.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_prompt_logprobs_equal_transformers(client: openai.OpenAI, model: str, http: httpx.Client,
                                                 checkpoint: Path):
    messages = [{"role": "user", "content": PROMPT}]
    ids = http.post("/tokenize", json={"messages": messages}).json()["tokens"]
    expected = transformers_logprobs(checkpoint, ids)
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    got = [e[str(t)]["logprob"] for t, e in zip(ids[1:], chat.model_extra["prompt_logprobs"][1:], strict=True)]
    assert max(abs(a - b) for a, b in zip(got, expected, strict=True)) < TOLERANCE


def test_lm_eval_style_loglikelihood_equals_transformers(client: openai.OpenAI, model: str, http: httpx.Client,
                                                         checkpoint: Path):
    """lm-eval's request (token prompt, echo, max_tokens 1, logprobs 1) and its reading of the answer:
    the continuation's logprobs are token_logprobs[context length:-1]."""
    context = prompt_ids(http, "Question: 2 + 2 =")
    continuation = http.post("/tokenize", json={"prompt": " four", "add_special_tokens": False}).json()["tokens"]
    ids = context + continuation
    out = client.completions.create(model=model, prompt=[ids], max_tokens=1, echo=True, logprobs=1, temperature=0)
    got = sum(out.choices[0].logprobs.token_logprobs[len(context):-1])
    assert abs(got - sum(transformers_logprobs(checkpoint, ids)[len(context) - 1:])) < TOLERANCE
