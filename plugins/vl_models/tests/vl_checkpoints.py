"""Tiny random-weight vision-language checkpoints, built offline from transformers' config classes.

Each builder writes a folder with config.json, weights, tokenizer, processor and chat template, and
returns it. The tokenizer is byte-level (every text encodes) plus the family's special tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from core_vl_models.base import without_video

INIT_STD = 0.1  # at 0.02 some families ignore the image entirely
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16)


def byte_tokenizer(special: list[str], **named: str) -> transformers.PreTrainedTokenizerFast:
    """256 byte tokens, no merges, then ``<|im_start|>``, ``<|im_end|>`` and `special` tokens."""
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|pad|>",
        extra_special_tokens=named or None)
    fast.add_special_tokens({"additional_special_tokens": special}, replace_extra_special_tokens=False)
    return fast


def chat_template(image: str) -> str:
    """A ChatML template that writes `image` for each ``{"type": "image"}`` part."""
    return (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for c in m['content'] %}"
        "{% if c['type'] == 'image' %}" + image + "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}"
        "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )


def _save(path: Path, model_class: type, config, processor, std: float = INIT_STD) -> Path:
    for sub in [config, *(getattr(config, k, None) for k in ("text_config", "vision_config"))]:
        if sub is not None:
            sub.initializer_range = std
    torch.manual_seed(0)
    model = model_class(config).eval()
    with torch.no_grad():  # Gemma 3 initialises its projector to zeros: the image would not matter
        for name, parameter in model.named_parameters():
            if name.endswith("mm_input_projection_weight"):
                parameter.normal_(0, std)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def build_qwen2_vl(path: Path, version: str = "2") -> Path:
    tok = byte_tokenizer(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"])
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")}
    prefix = "Qwen2VL" if version == "2" else "Qwen2_5_VL"
    vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, patch_size=14, spatial_merge_size=2)
    if version == "2.5":
        vision = dict(depth=2, hidden_size=32, out_hidden_size=64, intermediate_size=64, num_heads=2,
                      patch_size=14, spatial_merge_size=2, window_size=56, fullatt_block_indexes=[1])
    config = getattr(transformers, f"{prefix}Config")(
        text_config=dict(TEXT, vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}),
        vision_config=vision, image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        architectures=[f"{prefix}ForConditionalGeneration"])
    image_processor = transformers.Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)
    processor = without_video(getattr(transformers, f"{prefix}Processor"))(
        image_processor=image_processor, tokenizer=tok,
        chat_template=chat_template("<|vision_start|><|image_pad|><|vision_end|>"))
    return _save(path, getattr(transformers, f"{prefix}ForConditionalGeneration"), config, processor)


def _llama_text(tok) -> dict:
    return dict(TEXT, model_type="llama", vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def _clip_vision(image_size: int) -> dict:
    return dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=2, image_size=image_size, patch_size=14, projection_dim=32)


def build_llava(path: Path) -> Path:
    tok = byte_tokenizer(["<image>"])
    config = transformers.LlavaConfig(
        text_config=_llama_text(tok), vision_config=_clip_vision(56), image_token_index=tok.convert_tokens_to_ids("<image>"),
        image_seq_length=16, vision_feature_layer=-1, architectures=["LlavaForConditionalGeneration"])
    image_processor = transformers.CLIPImageProcessorPil(size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56})
    processor = transformers.LlavaProcessor(
        image_processor=image_processor, tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=chat_template("<image>\n"))
    return _save(path, transformers.LlavaForConditionalGeneration, config, processor)


def build_llava_next(path: Path) -> Path:
    tok = byte_tokenizer(["<image>"])
    pinpoints = [[56, 56], [56, 112], [112, 56], [112, 112]]
    config = transformers.LlavaNextConfig(
        text_config=_llama_text(tok), vision_config=_clip_vision(56), image_token_index=tok.convert_tokens_to_ids("<image>"),
        image_grid_pinpoints=pinpoints, vision_feature_layer=-1, architectures=["LlavaNextForConditionalGeneration"])
    image_processor = transformers.LlavaNextImageProcessorPil(
        size={"shortest_edge": 56}, crop_size={"height": 56, "width": 56}, image_grid_pinpoints=pinpoints)
    processor = transformers.LlavaNextProcessor(
        image_processor=image_processor, tokenizer=tok, patch_size=14, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=chat_template("<image>\n"))
    return _save(path, transformers.LlavaNextForConditionalGeneration, config, processor)


def build_idefics3(path: Path, family: str = "Idefics3") -> Path:
    tiles = [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
    tok = byte_tokenizer(["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>", *tiles])
    config = getattr(transformers, f"{family}Config")(
        text_config=_llama_text(tok), scale_factor=2, image_token_id=tok.convert_tokens_to_ids("<image>"),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=32, patch_size=8),
        architectures=[f"{family}ForConditionalGeneration"])
    image_processor = getattr(transformers, f"{family}ImageProcessorPil")(
        size={"longest_edge": 64}, max_image_size={"longest_edge": 32}, do_image_splitting=True)
    processor_class = without_video(getattr(transformers, f"{family}Processor"))
    processor = processor_class(image_processor=image_processor, tokenizer=tok, image_seq_len=4,
                                chat_template=chat_template("<image>"))
    return _save(path, getattr(transformers, f"{family}ForConditionalGeneration"), config, processor)


def build_internvl(path: Path) -> Path:
    named = {"start_image_token": "<img>", "end_image_token": "</img>", "context_image_token": "<IMG_CONTEXT>",
             "video_token": "<video>"}
    tok = byte_tokenizer(list(named.values()), **named)
    config = transformers.InternVLConfig(
        text_config=dict(TEXT, model_type="qwen2", vocab_size=len(tok), bos_token_id=tok.bos_token_id,
                         eos_token_id=tok.eos_token_id),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=[56, 56], patch_size=[14, 14]),
        image_token_id=tok.convert_tokens_to_ids("<IMG_CONTEXT>"), image_seq_length=4, downsample_ratio=0.5,
        architectures=["InternVLForConditionalGeneration"])
    image_processor = transformers.GotOcr2ImageProcessorPil(
        size={"height": 56, "width": 56}, crop_to_patches=True, min_patches=1, max_patches=4)
    processor = without_video(transformers.InternVLProcessor)(
        image_processor=image_processor, tokenizer=tok, image_seq_length=4, chat_template=chat_template("<IMG_CONTEXT>"))
    return _save(path, transformers.InternVLForConditionalGeneration, config, processor)


def build_gemma3(path: Path) -> Path:
    named = {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
    tok = byte_tokenizer(list(named.values()), **named)
    ids = {k: tok.convert_tokens_to_ids(v) for k, v in named.items()}
    config = transformers.Gemma3Config(
        # Sliding layers whose window (8) is shorter than an image (16 tokens: the window still applies
        # inside an image) around a global one; with 3 layers the greedy output of each image prompt
        # depends on the image tokens attending both ways (test_bidirectional_flag_is_needed).
        text_config=dict(TEXT, model_type="gemma3_text", vocab_size=len(tok), sliding_window=8, num_hidden_layers=3,
                         layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id),
        vision_config=dict(model_type="siglip_vision_model", hidden_size=32, intermediate_size=64,
                           num_hidden_layers=2, num_attention_heads=2, image_size=56, patch_size=14),
        mm_tokens_per_image=16, boi_token_index=ids["boi_token"], eoi_token_index=ids["eoi_token"],
        image_token_index=ids["image_token"], tie_word_embeddings=False, architectures=["Gemma3ForConditionalGeneration"])
    image_processor = transformers.Gemma3ImageProcessorPil(size={"height": 56, "width": 56})
    processor = transformers.Gemma3Processor(image_processor=image_processor, tokenizer=tok, image_seq_length=16,
                                             chat_template=chat_template("<start_of_image>"))
    # Untied head and std 0.2: with less the output ignores the image and the attention pattern.
    return _save(path, transformers.Gemma3ForConditionalGeneration, config, processor, std=0.2)


BUILDERS: dict[str, Callable[[Path], Path]] = {
    "Idefics3ForConditionalGeneration": build_idefics3,
    "SmolVLMForConditionalGeneration": lambda p: build_idefics3(p, "SmolVLM"),
    "InternVLForConditionalGeneration": build_internvl,
    "Gemma3ForConditionalGeneration": build_gemma3,
    "LlavaForConditionalGeneration": build_llava,
    "LlavaNextForConditionalGeneration": build_llava_next,
    "Qwen2VLForConditionalGeneration": build_qwen2_vl,
    "Qwen2_5_VLForConditionalGeneration": lambda p: build_qwen2_vl(p, "2.5"),
}
SKIPPED: dict[str, str] = {}
