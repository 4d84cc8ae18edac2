"""Every family against transformers itself: same token ids as its processor, and embeddings that,
scattered into the language model's inputs, reproduce its greedy `generate` token for token."""

from __future__ import annotations

import time

import pytest
import torch
import transformers

from core.plugins import load_plugins
from core.testing.vision import merge_image_embeddings
from core.vision import MultiModalInputs
from core_vl_models.base import without_video
from core_vl_models.plugin import VISION_PROCESSORS

NEW_TOKENS = 8
ARCHITECTURES = sorted(VISION_PROCESSORS)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def family(request, checkpoint_dir):
    """(architecture, checkpoint folder, our processor, transformers' model and processor)."""
    architecture = request.param
    started = time.perf_counter()
    path = checkpoint_dir(architecture)
    processor = load_plugins(allow="core-vl-models", use_environment=False).vision_processors.get(
        architecture).load()(str(path))
    model = getattr(transformers, architecture).from_pretrained(path).eval()
    reference = without_video(getattr(transformers, processor.processor_class)).from_pretrained(path)
    yield architecture, path, processor, model, reference
    print(f"{architecture}: {time.perf_counter() - started:.1f} s")


def _messages(n_images: int) -> list[dict]:
    parts = [{"type": "image"}] * n_images + [{"type": "text", "text": "Describe."}]
    return [{"role": "user", "content": parts}]


def _reference_inputs(family, n_images, images):
    _, _, processor, _, reference = family
    text = processor.render(_messages(n_images))
    batch = [images] if processor.nested_images else images
    return reference(text=[text], images=batch, return_tensors="pt")


def _generate(family, pictures) -> list[int]:
    """transformers' own greedy output for the chat with `pictures`."""
    model = family[3]
    reference = _reference_inputs(family, len(pictures), pictures)
    with torch.inference_mode():
        out = model.generate(**reference, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, reference["input_ids"].shape[1]:].tolist()


def _greedy_with_embeddings(model, inputs: MultiModalInputs, embeds: list[torch.Tensor]) -> list[int]:
    """Greedy decoding from our token ids + our image embeddings, the model's own forward otherwise."""
    ids = torch.tensor(inputs.prompt_token_ids)
    sequence = merge_image_embeddings(model.get_input_embeddings()(ids), inputs, embeds)
    image_mask = torch.zeros(len(ids), dtype=torch.long)
    for i in range(len(inputs.placeholder_ranges)):
        image_mask[inputs.embedding_positions(i)] = 1
    generated: list[int] = []
    with torch.inference_mode():
        for step in range(NEW_TOKENS):
            kwargs = {}
            length = sequence.shape[0]
            if inputs.mrope_positions is not None:
                tail = torch.arange(len(ids), length).expand(3, -1) + inputs.mrope_position_delta
                kwargs["position_ids"] = torch.cat([inputs.mrope_positions, tail], dim=1)[:, None]
            if inputs.bidirectional_image_attention:
                kwargs["token_type_ids"] = torch.cat([image_mask, torch.zeros(step, dtype=torch.long)])[None]
            logits = model(inputs_embeds=sequence[None], **kwargs).logits[0, -1]
            token = int(logits.argmax())
            generated.append(token)
            sequence = torch.cat([sequence, model.get_input_embeddings()(torch.tensor([token]))])
    return generated


@pytest.mark.parametrize("names", [("a",), ("a", "b")], ids=["one_image", "two_images"])
def test_matches_transformers(family, images, names):
    architecture, _, processor, model, _ = family
    pictures = [images[n] for n in names]
    reference = _reference_inputs(family, len(pictures), pictures)
    ours = processor.preprocess(_messages(len(pictures)), pictures)
    assert ours.prompt_token_ids == reference["input_ids"][0].tolist()
    assert len(ours.placeholder_ranges) == len(pictures)
    embeds = processor.encode(ours)
    assert [e.shape[0] for e in embeds] == [len(ours.embedding_positions(i)) for i in range(len(pictures))]
    assert _greedy_with_embeddings(model, ours, embeds) == _generate(family, pictures), architecture


def test_the_image_matters(family, images):
    """Guards the comparison above: with these weights a different image changes the output."""
    assert _generate(family, [images["a"]]) != _generate(family, [images["b"]])


def test_bidirectional_flag_is_needed(family, images):
    """Gemma 3: a causal-only engine would not reproduce the model; other families are causal."""
    _, _, processor, model, _ = family
    ours = processor.preprocess(_messages(1), [images["a"]])
    embeds = processor.encode(ours)
    assert ours.bidirectional_image_attention == (family[0] == "Gemma3ForConditionalGeneration")
    if ours.bidirectional_image_attention:
        ours.bidirectional_image_attention = False
        assert _greedy_with_embeddings(model, ours, embeds) != _generate(family, [images["a"]])


def test_content_hashes(family, images):
    _, _, processor, _, _ = family
    same = processor.preprocess(_messages(2), [images["a"], images["a_copy"]])
    other = processor.preprocess(_messages(2), [images["a"], images["b"]])
    assert same.image_hashes[0] == same.image_hashes[1] == other.image_hashes[0]
    assert other.image_hashes[1] != other.image_hashes[0]
