"""Hook implementation: one vision processor per architecture, registered lazily.

Targets are "module:Class" strings, so importing this module (e.g. for `core plugins`) never imports
torch or transformers.
"""

from __future__ import annotations

from core import hookimpl

#: Architecture name in a checkpoint's config.json -> the VisionProcessor class that handles it.
VISION_PROCESSORS: dict[str, str] = {
    "Qwen2VLForConditionalGeneration": "core_vl_models.qwen2_vl:Qwen2VLVisionProcessor",
    "Qwen2_5_VLForConditionalGeneration": "core_vl_models.qwen2_vl:Qwen2_5_VLVisionProcessor",
    "LlavaForConditionalGeneration": "core_vl_models.llava:LlavaVisionProcessor",
    "LlavaNextForConditionalGeneration": "core_vl_models.llava:LlavaNextVisionProcessor",
    "Idefics3ForConditionalGeneration": "core_vl_models.idefics3:Idefics3VisionProcessor",
    "SmolVLMForConditionalGeneration": "core_vl_models.idefics3:SmolVLMVisionProcessor",
    "InternVLForConditionalGeneration": "core_vl_models.internvl:InternVLVisionProcessor",
    "Gemma3ForConditionalGeneration": "core_vl_models.gemma3:Gemma3VisionProcessor",
}


@hookimpl
def core_register_vision_processors(register):
    for architecture, target in VISION_PROCESSORS.items():
        register(architecture, target)
