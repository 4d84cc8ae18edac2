"""A GGUF checkpoint's config and tokenizer read back without transformers' per-architecture lookups
(``light_config``): every attribute the config class answers, for each architecture the backend builds;
the tokenizer AutoTokenizer gives; the cases where the slow way is taken instead; and a start that never
imports the config class."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import transformers

from core_pytorch_backend.light_config import (
    LIGHT_CONFIG_FILE,
    LightConfig,
    full_config,
    read_light_config,
    write_light_config,
)

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(**SMALL, rope_theta=10000.0, architectures=["LlamaForCausalLM"]),
    "qwen2": lambda: transformers.Qwen2Config(**SMALL, sliding_window=64, architectures=["Qwen2ForCausalLM"]),
    "qwen3": lambda: transformers.Qwen3Config(**SMALL, head_dim=16, architectures=["Qwen3ForCausalLM"]),
    "mistral": lambda: transformers.MistralConfig(**SMALL, sliding_window=32, architectures=["MistralForCausalLM"]),
    "gemma3_text": lambda: transformers.Gemma3TextConfig(**SMALL, head_dim=8, sliding_window=16,
                                                         architectures=["Gemma3ForCausalLM"]),
}
# A class-level plan JSON does not keep (tuples), for transformers' own pipeline parallelism (the backend
# has its own); a view built afresh on every access (compared by identity); the version a config was saved
# under (None in one built in memory).
NOT_COMPARED = {"base_model_pp_plan", "per_layer_config", "transformers_version"}


def _attributes(config) -> dict:
    values = {}
    for name in dir(config):
        if name.startswith("__") or name in NOT_COMPARED:
            continue
        try:
            value = getattr(config, name)
        except Exception as exc:  # noqa: BLE001 (an attribute that raises must raise the same way on both)
            value = ("raises", type(exc).__name__)
        if not callable(value):
            values[name] = value
    return values


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_the_light_config_answers_every_attribute_as_the_class_does(model_type, tmp_path):
    real = CONFIGS[model_type]()
    assert write_light_config(real, tmp_path, None)
    light, tokenizer_class = read_light_config(tmp_path)
    assert tokenizer_class is None
    assert isinstance(light, LightConfig) and not isinstance(light, type(real))
    assert light.model_type == real.model_type == model_type
    assert _attributes(light) == _attributes(real)
    assert light.get_text_config() is light
    assert light.to_dict() == real.to_dict()
    back = full_config(light)
    assert type(back) is type(real) and back.to_dict() == real.to_dict()
    assert full_config(real) is real


def test_the_models_built_from_either_config_are_the_same(tmp_path):
    from core_pytorch_backend.kernels import select_ops
    from core_pytorch_backend.loader import BUILTIN_ARCHITECTURES, build_model

    real = CONFIGS["qwen3"]()
    write_light_config(real, tmp_path, None)
    ops = select_ops(torch.device("cpu"))
    shapes = [{name: p.shape for name, p in build_model(c, BUILTIN_ARCHITECTURES, ops, "cpu", torch.float32)
               .state_dict().items()} for c in (real, read_light_config(tmp_path)[0])]
    assert shapes[0] == shapes[1] and shapes[0]


def test_no_light_config_where_the_class_is_needed_or_the_file_is_not_usable(tmp_path):
    composite = transformers.Gemma3Config(text_config=SMALL)  # sub-configs: not written
    assert not write_light_config(composite, tmp_path, None) and read_light_config(tmp_path) is None
    assert read_light_config(tmp_path / "missing") is None
    file = tmp_path / LIGHT_CONFIG_FILE
    file.write_text("{not json")
    assert read_light_config(tmp_path) is None
    write_light_config(CONFIGS["llama"](), tmp_path, transformers.PreTrainedTokenizerFast)
    assert read_light_config(tmp_path)[1] is transformers.PreTrainedTokenizerFast
    values = json.loads(file.read_text())
    for changed in ({"transformers_version": "4.0.0"}, {"tokenizer_class": "transformers:NoSuchTokenizer"},
                    {"tokenizer_class": "no_such_module:Tokenizer"}, {"values": None}):
        file.write_text(json.dumps({**values, **changed}))
        assert read_light_config(tmp_path) is None, changed
    assert not write_light_config(CONFIGS["llama"](), file / "below-a-file", None)


def _same_tokenizer(a, b) -> None:
    assert type(a) is type(b)
    assert a.get_vocab() == b.get_vocab() and a.special_tokens_map == b.special_tokens_map
    assert a.all_special_ids == b.all_special_ids and a.chat_template == b.chat_template
    assert a.model_max_length == b.model_max_length and a.added_tokens_decoder == b.added_tokens_decoder
    text = "<|im_start|>user\nHello, wörld! 3.14 \t tabs\n<|im_end|>def f(x): return x ** 2  # 🙂"
    for with_special in (True, False):
        assert a.encode(text, add_special_tokens=with_special) == b.encode(text, add_special_tokens=with_special)
    ids = a.encode(text)
    assert a.decode(ids, skip_special_tokens=True) == b.decode(ids, skip_special_tokens=True)
    chat = [{"role": "user", "content": "hi"}]
    assert (a.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
            == b.apply_chat_template(chat, tokenize=False, add_generation_prompt=True))


def test_the_kept_tokenizer_class_loads_what_autotokenizer_does(default_gguf_path, tmp_path):
    from core_pytorch_backend.loader import cached_gguf_folder

    folder = cached_gguf_folder(default_gguf_path, tmp_path, with_weights=False)
    slow = transformers.AutoTokenizer.from_pretrained(folder)
    assert write_light_config(transformers.AutoConfig.from_pretrained(folder), folder, type(slow))
    _, tokenizer_class = read_light_config(folder)
    _same_tokenizer(tokenizer_class.from_pretrained(folder), slow)


# Loads the default model as `core serve` does, from a cache made by an earlier load, and prints whether
# its config is a LightConfig and whether transformers' Llama configuration module was ever imported.
START = """
import sys
from core_pytorch_backend.loader import load_checkpoint
loaded = load_checkpoint(sys.argv[1], cache_dir=sys.argv[2])
print(type(loaded.hf_config).__name__, type(loaded.tokenizer).__name__,
      "transformers.models.llama.configuration_llama" in sys.modules, "transformers.models.auto.tokenization_auto" in sys.modules)
"""


def test_a_start_from_a_warm_cache_never_imports_the_config_class(default_gguf_path, tmp_path):
    """The saving (1.3-2 s of a start: transformers.activations -> torch.distributed.tensor, and the index
    of transformers' models) holds only while nothing else imports them: the first load writes the file,
    the second reads it."""
    def load() -> str:
        return subprocess.run([sys.executable, "-c", START, str(default_gguf_path), str(tmp_path)], check=True,
                              capture_output=True, text=True, timeout=300).stdout.split("\n")[-2]

    assert load() == "LlamaConfig TokenizersBackend True True"
    assert load() == "LightConfig TokenizersBackend False False"
