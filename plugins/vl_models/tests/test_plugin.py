"""Registration: lazy, torch-free, and open to third-party processors; M-RoPE against transformers."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import transformers

from core import hookimpl
from core.errors import UnsupportedError
from core.plugins import load_plugins
from core.resolve import get_vision_processor
from core.testing.vision import decode_position
from core.vision import MultiModalInputs, VisionProcessor
from core_vl_models.plugin import VISION_PROCESSORS


def test_plugin_import_does_not_import_torch():
    code = "import sys, core_vl_models.plugin; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_architecture_is_registered():
    host = load_plugins(allow="core-vl-models", use_environment=False)
    assert host.vision_processors.names() == sorted(VISION_PROCESSORS)
    for entry in host.vision_processors:
        assert issubclass(entry.load(), VisionProcessor)


class _EchoProcessor(VisionProcessor):
    """A third party's processor: every image is one placeholder token 7."""

    def __init__(self, model_path: str) -> None:
        self.model_path = model_path

    def preprocess(self, prompt, images):
        return MultiModalInputs(prompt_token_ids=[1, 7, 2], image_token_id=7)

    def encode(self, inputs):
        return [torch.zeros(1, 4)]


class _ThirdPartyPlugin:
    @hookimpl
    def core_register_vision_processors(self, register):
        register("EchoVLForConditionalGeneration", _EchoProcessor)
        register("LlavaForConditionalGeneration", _EchoProcessor, override=True)


def test_third_party_processor_takes_effect():
    host = load_plugins(allow="", use_environment=False)
    with pytest.raises(UnsupportedError, match="EchoVLForConditionalGeneration"):
        get_vision_processor(host, "EchoVLForConditionalGeneration", "/nowhere")
    host.register(_ThirdPartyPlugin(), name="third-party")
    processor = get_vision_processor(host, "EchoVLForConditionalGeneration", "/nowhere")
    assert isinstance(processor, _EchoProcessor) and processor.model_path == "/nowhere"
    assert processor.preprocess("x", []).prompt_token_ids == [1, 7, 2]


def test_third_party_processor_can_override_a_builtin():
    host = load_plugins(allow="core-vl-models", use_environment=False)
    host.register(_ThirdPartyPlugin(), name="third-party")
    assert isinstance(get_vision_processor(host, "LlavaForConditionalGeneration", "/nowhere"), _EchoProcessor)


@pytest.mark.parametrize("architecture", ["Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration"])
def test_mrope_positions_match_get_rope_index(checkpoint_dir, images, architecture):
    path = checkpoint_dir(architecture)
    processor = load_plugins(allow="core-vl-models", use_environment=False).vision_processors.get(
        architecture).load()(str(path))
    messages = [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "image"},
                                             {"type": "text", "text": "two"}, {"type": "image"}]}]
    ours = processor.preprocess(messages, [images["b"], images["a"]])
    model = getattr(transformers, architecture).from_pretrained(path)
    ids = torch.tensor([ours.prompt_token_ids])
    positions, delta = model.model.get_rope_index(
        ids, ours.tensors["mm_token_type_ids"], image_grid_thw=ours.tensors["image_grid_thw"])
    assert torch.equal(ours.mrope_positions, positions[:, 0])
    assert ours.mrope_position_delta == int(delta)
    assert decode_position(ours, len(ours.prompt_token_ids)) == len(ours.prompt_token_ids) + int(delta)


def test_placeholder_and_image_count_mismatch_is_a_request_error(checkpoint_dir, images):
    from core.errors import InvalidRequestError

    architecture = "LlavaForConditionalGeneration"
    processor = load_plugins(allow="core-vl-models", use_environment=False).vision_processors.get(
        architecture).load()(str(checkpoint_dir(architecture)))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}]
    with pytest.raises(InvalidRequestError, match="do not match"):
        processor.preprocess(messages, [images["a"]])
