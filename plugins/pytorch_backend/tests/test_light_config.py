"""A GGUF checkpoint's config read back without its transformers class (``light_config``): every
attribute the class answers, for each architecture the backend builds; the cases where the class is
imported instead; and a start that never imports it."""

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
    assert write_light_config(real, tmp_path)
    light = read_light_config(tmp_path)
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
    write_light_config(real, tmp_path)
    ops = select_ops(torch.device("cpu"))
    shapes = [{name: p.shape for name, p in build_model(c, BUILTIN_ARCHITECTURES, ops, "cpu", torch.float32)
               .state_dict().items()} for c in (real, read_light_config(tmp_path))]
    assert shapes[0] == shapes[1] and shapes[0]


def test_no_light_config_where_the_class_is_needed_or_the_file_is_not_this_transformers(tmp_path):
    composite = transformers.Gemma3Config(text_config=SMALL)  # sub-configs: not written
    assert not write_light_config(composite, tmp_path) and read_light_config(tmp_path) is None
    assert read_light_config(tmp_path / "missing") is None
    (tmp_path / LIGHT_CONFIG_FILE).write_text("{not json")
    assert read_light_config(tmp_path) is None
    write_light_config(CONFIGS["llama"](), tmp_path)
    values = json.loads((tmp_path / LIGHT_CONFIG_FILE).read_text())
    (tmp_path / LIGHT_CONFIG_FILE).write_text(json.dumps({**values, "transformers_version": "4.0.0"}))
    assert read_light_config(tmp_path) is None
    assert not write_light_config(CONFIGS["llama"](), tmp_path / LIGHT_CONFIG_FILE / "below-a-file")


# Loads the default model as `core serve` does, from a cache made by an earlier load, and prints whether
# its config is a LightConfig and whether transformers' Llama configuration module was ever imported.
START = """
import sys
from core_pytorch_backend.loader import load_checkpoint
loaded = load_checkpoint(sys.argv[1], cache_dir=sys.argv[2])
print(type(loaded.hf_config).__name__, "transformers.models.llama.configuration_llama" in sys.modules)
"""


def test_a_start_from_a_warm_cache_never_imports_the_config_class(default_gguf_path, tmp_path):
    """The saving (1-1.6 s of a start, most of it transformers.activations -> torch.distributed.tensor)
    holds only while nothing else imports the class: the first load writes the file, the second reads it."""
    def load() -> str:
        return subprocess.run([sys.executable, "-c", START, str(default_gguf_path), str(tmp_path)], check=True,
                              capture_output=True, text=True, timeout=300).stdout.split("\n")[-2]

    assert load() == "LlamaConfig True"
    assert load() == "LightConfig False"
