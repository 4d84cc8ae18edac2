"""Gemma 3 images on the pytorch backend, where its bidirectional image attention meets the scheduler:
a prefix-cache hit that ends inside an image, and an image longer than the step's token budget."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import transformers

pytest.importorskip("core_pytorch_backend")

from core.backend import GenerateRequest  # noqa: E402
from core.config import EngineConfig, GenerationConfig  # noqa: E402
from core.errors import InvalidRequestError  # noqa: E402
from core_pytorch_backend.backend import PytorchBackend  # noqa: E402
from core_pytorch_backend.models import BUILTIN_ARCHITECTURES  # noqa: E402
from core_vl_models.gemma3 import Gemma3VisionProcessor  # noqa: E402

ARCHITECTURE = "Gemma3ForConditionalGeneration"
BLOCK_SIZE = 8
NEW_TOKENS = 6
GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True, logprobs=True)


@pytest.fixture(scope="module")
def gemma3(checkpoint_dir):
    path = str(checkpoint_dir(ARCHITECTURE))
    return path, Gemma3VisionProcessor(path), transformers.Gemma3ForConditionalGeneration.from_pretrained(path).eval()


def _backend(path: str, **options) -> PytorchBackend:
    config = EngineConfig(model=path, kv_cache_memory_gib=0.02, block_size=BLOCK_SIZE, **options)
    return PytorchBackend(config, architectures=dict(BUILTIN_ARCHITECTURES))


def _prompt_with_a_cacheable_prefix_inside_the_image(vision: Gemma3VisionProcessor, image):
    """A raw prompt ending 3 tokens after its 16-token image, padded so that the longest cacheable
    prefix (whole blocks, never the last token) ends as early inside the image as blocks of 8 allow:
    a second identical request then recomputes the image's last tokens, which attend to each other."""
    best = None
    for pad in range(BLOCK_SIZE):
        inputs = vision.preprocess("<|im_start|>user\nLook" + "!" * pad + "<start_of_image>", [image])
        span = inputs.placeholder_ranges[0]
        cached = (len(inputs.prompt_token_ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
        if span.start < cached < span.start + span.length and (best is None or cached - span.start < best[2]):
            best = (inputs, cached, cached - span.start)
    assert best is not None and best[2] < 12, "no padding puts the cacheable prefix well inside the image"
    inputs, cached, _ = best
    inputs.image_embeds = vision.encode(inputs)
    return inputs, cached


async def _generate(backend: PytorchBackend, session: str, inputs) -> tuple[list[int], list[float], int]:
    """Greedy tokens, their logprobs and the prompt tokens served from the prefix cache."""
    request = GenerateRequest(session, inputs.prompt_token_ids, GREEDY, NEW_TOKENS, multimodal=inputs)
    tokens, logprobs, cached = [], [], 0
    async for out in backend.generate(request):
        tokens.extend(out.token_ids)
        logprobs.extend(lp.logprob for lp in out.logprobs or ())
        cached = max(cached, out.num_cached_tokens)
    return tokens, logprobs, cached


def _transformers_greedy(model, inputs) -> list[int]:
    ids = torch.tensor([inputs.prompt_token_ids])
    token_types = torch.zeros_like(ids)
    token_types[0, inputs.embedding_positions(0)] = 1
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), token_type_ids=token_types,
                             pixel_values=inputs.tensors["pixel_values"], max_new_tokens=NEW_TOKENS,
                             min_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


async def test_a_prefix_hit_ending_inside_an_image_gives_the_same_tokens(gemma3, images):
    path, vision, model = gemma3
    inputs, hit = _prompt_with_a_cacheable_prefix_inside_the_image(vision, images["a"])
    expected = _transformers_greedy(model, inputs)
    backend = _backend(path)
    try:
        first, first_logprobs, first_cached = await _generate(backend, "first", inputs)
        again, again_logprobs, again_cached = await _generate(backend, "again", dataclasses.replace(inputs))
    finally:
        await backend.close()
    assert (first_cached, again_cached) == (0, hit)
    assert first == again == expected
    # Finer than the tokens: the resumed image tokens attended to each other as in the first run.
    assert again_logprobs == pytest.approx(first_logprobs, abs=1e-5)


async def test_an_image_longer_than_the_step_budget_is_a_clear_400(gemma3, images):
    path, vision, _ = gemma3
    inputs, _ = _prompt_with_a_cacheable_prefix_inside_the_image(vision, images["a"])
    backend = _backend(path, max_num_batched_tokens=8)
    try:
        with pytest.raises(InvalidRequestError, match="16 tokens .* exceeds max_num_batched_tokens=8"):
            await _generate(backend, "big", inputs)
        assert backend.stats().running == backend.stats().waiting == 0
    finally:
        await backend.close()
