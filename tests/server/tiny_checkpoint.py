"""A tiny random-weight Llama checkpoint for running the server tests against a real model.

It reuses the pytorch backend's test builders (plugins/pytorch_backend/tests/conftest.py: the 2-layer
config, the byte-level tokenizer, the larger random init) and adds what a server needs: a chat template
that renders tools, a generation_config.json with sampling defaults, a context window long enough for
the tests, and an output restricted to printable ASCII: the model never produces a special token (token
counts do not depend on luck) nor a stray byte of a multi-byte character (every token is visible text).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PYTORCH_TEST_BUILDERS = REPO / "plugins" / "pytorch_backend" / "tests" / "conftest.py"
CONTEXT_WINDOW = 1024
# Greedy unless the request says otherwise: the tests check that this default applies and that request
# values override it.
GENERATION_CONFIG = {"do_sample": False, "bos_token_id": 257, "eos_token_id": 258, "pad_token_id": 259}
CHAT_TEMPLATE = (
    "{% if tools %}<s>system\nTools: {{ tools | tojson }}</s>\n{% endif %}"
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)
CONSTANT_DIM = 0  # the residual-stream dimension that silences tokens
SILENCED_LOGIT_WEIGHT = -100.0


def pytorch_test_builders() -> ModuleType:
    """The pytorch backend's checkpoint builders, imported by path (its tests are not a package)."""
    spec = importlib.util.spec_from_file_location("core_server_tests_pytorch_builders", PYTORCH_TEST_BUILDERS)
    if spec is None or spec.loader is None:
        raise FileNotFoundError(f"cannot import the checkpoint builders from {PYTORCH_TEST_BUILDERS}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def printable_ascii_ids(tokenizer: Any) -> list[int]:
    """Ids of the tokens that decode to one printable ASCII character."""
    return [i for i in range(len(tokenizer)) if len(text := tokenizer.decode([i])) == 1 and " " <= text <= "~"]


def silence_tokens_(model: Any, silenced_ids: list[int]) -> None:
    """Make the logits of `silenced_ids` about -100/rms whatever the context.

    Random weights would end a reply with `</s>` about once in 260 tokens, and emit bytes that are no
    text on their own. Residual dimension CONSTANT_DIM is pinned to 1 (every embedding has 1 there and
    no layer writes to it), so after the final RMSNorm it is always positive; the silenced tokens'
    output rows weigh it by -100, the others by 0.
    """
    import torch

    with torch.no_grad():
        model.model.embed_tokens.weight[:, CONSTANT_DIM] = 1.0
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight[CONSTANT_DIM, :] = 0.0
            layer.mlp.down_proj.weight[CONSTANT_DIM, :] = 0.0
        model.model.norm.weight[CONSTANT_DIM] = 1.0
        model.lm_head.weight[:, CONSTANT_DIM] = 0.0
        model.lm_head.weight[silenced_ids, CONSTANT_DIM] = SILENCED_LOGIT_WEIGHT


def build_tiny_llama(out: Path, seed: int = 0) -> Path:
    """Save the tiny Llama (safetensors, float32), its tokenizer and generation config into `out`."""
    import torch
    from transformers import AutoModelForCausalLM

    builders = pytorch_test_builders()
    config = builders.tiny_config("llama", max_position_embeddings=CONTEXT_WINDOW)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    builders.reinit_(model, seed=seed)
    tokenizer = builders.tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    allowed = set(printable_ascii_ids(tokenizer))
    silence_tokens_(model, [i for i in range(config.vocab_size) if i not in allowed])
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return out
