"""A model architecture added by another plugin through core_register_model_architectures."""

from __future__ import annotations

import json

from core import hookimpl
from core.config import EngineConfig, GenerationConfig
from core.engine import AsyncEngine
from core.plugins import load_plugins
from core.response import collect
from core_pytorch_backend.backend import PytorchBackend
from core_pytorch_backend.models.llama import LlamaForCausalLM


class ToyForCausalLM(LlamaForCausalLM):
    """A third party's model: Llama's weights, with every logit of token 0 forced to win."""

    def compute_logits(self, hidden):
        logits = super().compute_logits(hidden)
        logits[:, 0] = logits.max() + 1.0
        return logits


class ToyArchitecturePlugin:
    @hookimpl
    def core_register_model_architectures(self, register):
        register("ToyForCausalLM", ToyForCausalLM, backend="pytorch")


async def test_a_plugin_architecture_is_used_by_the_backend(tiny_checkpoint_factory, monkeypatch, tmp_path):
    source = tiny_checkpoint_factory("llama")
    for item in source.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "architectures": ["ToyForCausalLM"]}))

    host = load_plugins(allow="pytorch_backend", use_environment=False)
    host.register(ToyArchitecturePlugin(), name="toy")
    monkeypatch.setattr("core.plugins.get_plugins", lambda: host)
    backend = PytorchBackend(EngineConfig(model=str(tmp_path), dtype="float32", kv_cache_memory_gib=0.01))
    engine = AsyncEngine(backend)
    try:
        assert isinstance(backend.loop.runner.model, ToyForCausalLM)
        response = await collect(engine.generate([5, 6, 7], GenerationConfig(temperature=0, max_new_tokens=4,
                                                                             ignore_eos=True)))
        assert response.token_ids == [0, 0, 0, 0]
    finally:
        await engine.close()
