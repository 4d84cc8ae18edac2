"""Vision-language models end to end on the pytorch backend: the engine (chat template, media intake,
vision processor, encoder off the event loop) and the backend's own paged language models (embedding
injection, M-RoPE, chunked prefill across an image) against transformers' greedy `generate`, and the
prefix cache keyed by image content."""

from __future__ import annotations

import pytest
import torch
import transformers
from PIL import Image

pytest.importorskip("core_pytorch_backend")
pytest.importorskip("core_templates")

from core.config import EngineConfig, GenerationConfig  # noqa: E402
from core.engine import AsyncEngine  # noqa: E402
from core.errors import InvalidRequestError  # noqa: E402
from core.pipelines import Pipeline  # noqa: E402
from core.plugins import load_plugins  # noqa: E402
from core.resolve import resolve_chat_template  # noqa: E402
from core_pytorch_backend.backend import PytorchBackend  # noqa: E402
from core_pytorch_backend.models import BUILTIN_ARCHITECTURES  # noqa: E402
from core_vl_models.base import without_video  # noqa: E402
from core_vl_models.plugin import VISION_PROCESSORS  # noqa: E402

NEW_TOKENS = 6
BLOCK_SIZE = 4
# Small steps: prompts are prefilled in chunks, so images are split across steps.
CHUNK_TOKENS = 24
SERVED = sorted(set(VISION_PROCESSORS) & set(BUILTIN_ARCHITECTURES))
GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS)


def _plugins():
    return load_plugins(allow="core-vl-models,core-templates", use_environment=False)


@pytest.fixture(scope="module", params=SERVED)
def served(request, checkpoint_dir):
    """(pipeline over the pytorch backend, transformers' model, its processor, our processor)."""
    architecture = request.param
    path = str(checkpoint_dir(architecture))
    plugins = _plugins()
    config = EngineConfig(model=path, kv_cache_memory_gib=0.02, block_size=BLOCK_SIZE,
                          max_num_batched_tokens=CHUNK_TOKENS)
    backend = PytorchBackend(config, architectures=dict(BUILTIN_ARCHITECTURES))
    template = resolve_chat_template(plugins, None, backend.model_info, backend.tokenizer)
    vision = plugins.vision_processors.get(architecture).load()(path)
    pipe = Pipeline(AsyncEngine(backend, chat_template=template, vision=vision))
    model = getattr(transformers, architecture).from_pretrained(path).eval()
    reference = without_video(getattr(transformers, vision.processor_class)).from_pretrained(path)
    yield pipe, model, reference, vision
    pipe.close()


def _user(text: str, pictures) -> dict:
    return {"role": "user", "content": [*({"type": "image", "image": p} for p in pictures),
                                        {"type": "text", "text": text}]}


def _expected(served, messages, pictures) -> list[int]:
    """transformers' greedy tokens for `messages` (rendered by the model's own processor)."""
    _, model, reference, vision = served
    text = vision.render(messages)
    batch = ([pictures] if vision.nested_images else pictures) if pictures else None
    inputs = reference(text=[text], images=batch, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("names", [("a",), ("a", "b")], ids=["one_image", "two_images"])
def test_matches_transformers(served, images, names):
    pictures = [images[n] for n in names]
    messages = [_user("Describe.", pictures)]
    response = served[0].infer(messages, GREEDY)
    assert response.token_ids == _expected(served, messages, pictures)
    image_tokens = sum(len(e) for e in served[3].encode(served[3].preprocess(messages, pictures)))
    assert response.prompt_tokens > image_tokens  # usage counts the image tokens


def test_chat_history_keeps_its_images(served, images):
    """The second turn resends the first turn's image: same output as transformers on the whole chat."""
    pipe = served[0]
    session = pipe.chat(("What is this?", images["a"]), gen_config=GREEDY)
    first = session.messages[0]["content"]
    assert any(part.get("type") == "image" for part in first)
    pipe.chat("And now?", session, GREEDY)
    assert session.response.token_ids == _expected(served, session.messages[:-1], [images["a"]])
    assert session.response.cached_tokens > 0  # the earlier turn, image included, came from the cache


def test_batched_with_text_only_requests(served, images):
    """Image and text-only requests run in the same steps and each matches its solo reference."""
    prompts = [[_user("One.", [images["a"]])], [{"role": "user", "content": "Plain text, no image."}],
               [_user("Two.", [images["b"]])]]
    responses = served[0].infer(prompts, GREEDY)
    expected = [_expected(served, prompts[0], [images["a"]]), _expected(served, prompts[1], []),
                _expected(served, prompts[2], [images["b"]])]
    assert [r.token_ids for r in responses] == expected


def test_prefix_cache_keys_include_the_image(served, images):
    pipe, vision = served[0], served[3]
    text = "Cache test: what do you see?"
    first = pipe.infer((text, images["b"]), GREEDY)
    again = pipe.infer((text, images["b"].copy()), GREEDY)  # pixel-equal copy: same content hash
    # Same size, so the same placeholder tokens: only the content differs.
    flipped = images["b"].transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    other = pipe.infer((text, flipped), GREEDY)
    prompt_len = again.prompt_tokens
    assert other.prompt_tokens == prompt_len
    assert again.cached_tokens == (prompt_len - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert again.token_ids == first.token_ids
    start = vision.preprocess([_user(text, [flipped])], [flipped]).placeholder_ranges[0].start
    assert other.cached_tokens <= start  # only the text before the image may be shared
    assert other.token_ids == _expected(served, [_user(text, [flipped])], [flipped])


def test_forks_share_the_image(served, images):
    """n > 1: greedy choices fork after the prompt and all continue from the image's KV."""
    if served[3].architecture != SERVED[-1]:
        pytest.skip("one family is enough")
    messages = [_user("Fork.", [images["a"]])]
    response = served[0].infer(messages, GREEDY.replace(n=2))
    expected = _expected(served, messages, [images["a"]])
    assert [c.token_ids for c in response.choices] == [expected, expected]


@pytest.fixture(scope="module")
def tiny_text_checkpoint(tmp_path_factory) -> str:
    """A text-only Llama with the byte tokenizer and a ChatML template."""
    from core_vl_models_test_checkpoints import TEXT, byte_tokenizer, chat_template

    path = tmp_path_factory.mktemp("text-only")
    tok = byte_tokenizer([])
    tok.chat_template = chat_template("<image>")
    config = transformers.LlamaConfig(**TEXT, vocab_size=len(tok), eos_token_id=tok.eos_token_id)
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def test_text_only_model_refuses_images(images, tiny_text_checkpoint):
    plugins = _plugins()
    backend = PytorchBackend(EngineConfig(model=tiny_text_checkpoint, kv_cache_memory_gib=0.01),
                             architectures=dict(BUILTIN_ARCHITECTURES))
    template = resolve_chat_template(plugins, None, backend.model_info, backend.tokenizer)
    with Pipeline(AsyncEngine(backend, chat_template=template)) as pipe:
        with pytest.raises(InvalidRequestError, match="text-only model and does not accept images") as info:
            pipe.infer([_user("Hi", [images["a"]])], GREEDY)
        assert info.value.param == "messages[0].content[0].image"
