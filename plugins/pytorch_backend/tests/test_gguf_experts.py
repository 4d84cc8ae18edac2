"""MoE GGUF files (Qwen2-MoE, Qwen3-MoE, Mixtral) as llama.cpp's converter writes them: each layer's experts
stacked in three tensors (``blk.N.ffn_gate_exps`` / ``ffn_up_exps`` [experts, width, hidden],
``ffn_down_exps`` [experts, hidden, width]) and the experts' widths in ``{arch}.expert_feed_forward_length``
/ ``expert_shared_feed_forward_length``; Mixtral as a ``llama`` file with ``llama.expert_count``. Such a file
failed to load (the stacks went to transformers' processor, which keeps its output to itself; a Mixtral
file was read as a dense Llama), and transformers' config mapping reads neither width."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from core_pytorch_backend import loader
from core_pytorch_backend.quant.affine import AffineWeight
from core_pytorch_backend.quant.gguf_file import gguf_weights
from core_pytorch_backend.testing import finish_gguf, gguf_writer, llama_cpp_qk_rows

GGUF_ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama"}
#: the tiny checkpoints' experts (64 wide: whole Q8_0 blocks) and, for Qwen2-MoE, a shared expert of 48:
#: neither is the config class's default, so a width the loader does not read from the file cannot fit
SIZES = {"qwen3_moe": dict(vocab_size=49152, max_position_embeddings=512, moe_intermediate_size=64,
                           mlp_only_layers=[], norm_topk_prob=True),  # as every Qwen3-MoE (and llama.cpp) has it
         "qwen2_moe": dict(vocab_size=49152, max_position_embeddings=512, moe_intermediate_size=64),
         "mixtral": dict(vocab_size=49152, max_position_embeddings=512, intermediate_size=64, sliding_window=None)}
EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
#: an expert's tensor in the checkpoint (Mixtral's: block_sparse_moe.experts.{e}.w1 / w3 / w2)
CHECKPOINT_EXPERT = re.compile(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\."
                               r"(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
PROJECTION = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}


def _writer(target, architecture: str, config, tokenizer_source):
    """``testing.gguf_writer`` with the keys every file here states besides (KV heads, rotary base, norm
    epsilon, experts a token)."""
    writer = gguf_writer(target, architecture, config, tokenizer_source)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_used_count(config.num_experts_per_tok)
    return writer


def _add_stack(writer, name: str, stack: np.ndarray, expert_type: str) -> None:
    """A stack of experts as llama.cpp stores it: F32, or quantized to ``expert_type``."""
    import gguf

    stack = np.ascontiguousarray(stack)
    if expert_type == "F32":
        writer.add_tensor(name, stack)
    else:
        kind = gguf.GGMLQuantizationType[expert_type]
        writer.add_tensor(name, gguf.quants.quantize(stack, kind), raw_dtype=kind)


def _moe_gguf(folder, tokenizer_source, target, arch: str, expert_type: str = "F32"):
    """The checkpoint in ``folder`` as llama.cpp writes a ``arch`` GGUF: experts stacked per layer and
    projection, stored as ``expert_type`` (F32 or Q8_0); every other tensor float32, the shared expert's
    gate a vector."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    writer = _writer(target, GGUF_ARCH[arch], config, tokenizer_source)
    if arch == "mixtral":
        writer.add_expert_count(config.num_local_experts)
        writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)
    else:
        writer.add_expert_count(config.num_experts)
        writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "qwen3_moe":
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
    elif arch == "qwen2_moe":
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    arch_id = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == GGUF_ARCH[arch])
    names = gguf.get_tensor_name_map(arch_id, config.num_hidden_layers)
    stacks: dict[tuple[int, str], dict[int, np.ndarray]] = {}
    for name, tensor in load_file(folder / "model.safetensors").items():
        if match := CHECKPOINT_EXPERT.fullmatch(name):
            stacks.setdefault((int(match[1]), PROJECTION[match[3]]), {})[int(match[2])] = tensor.float().numpy()
            continue
        values = llama_cpp_qk_rows(name, tensor, config).float().numpy() if arch == "mixtral" else tensor.float().numpy()
        if name.endswith("shared_expert_gate.weight"):
            values = values[0]
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), values)
    for (layer, projection), experts in sorted(stacks.items()):
        stack = np.stack([experts[e] for e in range(len(experts))])
        _add_stack(writer, f"blk.{layer}.ffn_{projection}_exps.weight", stack, expert_type)
    return finish_gguf(writer, target)


@pytest.fixture(params=sorted(GGUF_ARCH))
def moe_checkpoint(request, make_tiny_checkpoint, tmp_path, monkeypatch):
    monkeypatch.setenv("CORE_CACHE_DIR", str(tmp_path / "cache"))
    arch = request.param
    return arch, make_tiny_checkpoint(arch, tmp_path, **SIZES[arch])


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_a_moe_gguf_loads_and_continues_as_transformers_does(moe_checkpoint, quantization, default_gguf_path,
                                                             tmp_path):
    """Both ways a GGUF file loads (its tensors read by core: ``auto``; by transformers' GGUF loader:
    ``none``) give the experts of the file's widths, and greedy output equals transformers' float32
    ``generate`` on the checkpoint the file was written from, token for token."""
    from transformers import AutoModelForCausalLM

    import core

    arch, folder = moe_checkpoint
    path = _moe_gguf(folder, default_gguf_path, tmp_path / f"tiny-{arch}.gguf", arch)
    config = loader.gguf_config(path)
    assert (config.intermediate_size if arch == "mixtral" else config.moe_intermediate_size) == 64
    if arch == "qwen2_moe":
        assert config.shared_expert_intermediate_size == 48
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = [1, 504, 3458, 282, 4649, 314, 7042, 28, 284, 260] * 3
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
    with core.pipeline(str(path), quantization=quantization) as pipe:
        response = pipe.infer(prompt, max_new_tokens=12, temperature=0.0, ignore_eos=True)
    assert list(response.token_ids) == expected.tolist()


def test_quantized_expert_stacks_stay_packed_one_expert_at_a_time(moe_checkpoint, default_gguf_path, tmp_path):
    """A Q8_0 stack of experts comes out of the file as each expert's own packed codes, under the name of
    that expert's projection, holding exactly the values llama.cpp's dequantization gives its slice; and
    the packed model serves them (no expert dequantized to a dense copy)."""
    import gguf

    arch, folder = moe_checkpoint
    path = _moe_gguf(folder, default_gguf_path, tmp_path / f"tiny-{arch}-q8.gguf", arch, expert_type="Q8_0")
    config = loader.gguf_config(path)
    stacks = {t.name: t for t in gguf.GGUFReader(path).tensors if t.name.endswith("_exps.weight")}
    experts = {name: weight for name, weight in gguf_weights(path, config) if EXPERT.fullmatch(name)}
    experts_per_layer = getattr(config, "num_local_experts", None) or config.num_experts
    assert len(experts) == 3 * experts_per_layer * config.num_hidden_layers
    for name, weight in experts.items():
        layer, expert, projection = EXPERT.fullmatch(name).groups()
        stack = stacks[f"blk.{layer}.ffn_{projection}_exps.weight"]
        values = gguf.quants.dequantize(stack.data, stack.tensor_type)[int(expert)]
        assert isinstance(weight, AffineWeight), name
        np.testing.assert_array_equal(weight.dequantize(), values, err_msg=name)

    loaded = loader.load_checkpoint(path)
    for expert in loaded.model.model.layers[0].mlp.experts:
        for projection in (expert.gate_up_proj, expert.down_proj):
            assert not isinstance(projection.weight, torch.nn.Parameter)  # packed, not a dense copy


def _gpt_oss_gguf(folder, tokenizer_source, target, expert_type: str = "F32"):
    """The gpt-oss checkpoint in ``folder`` as llama.cpp's converter writes it: each layer's fused,
    interleaved ``gate_up_proj`` [experts, hidden, 2 x width] split into gate and up stacks [experts, width,
    hidden], ``down_proj`` transposed, the biases split alike; the stacks as ``expert_type`` (F32 or MXFP4)."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    writer = _writer(target, "gpt-oss", config, tokenizer_source)
    writer.add_expert_feed_forward_length(config.intermediate_size)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_expert_count(config.num_local_experts)
    writer.add_sliding_window(config.sliding_window)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, config.num_hidden_layers)
    for name, tensor in load_file(folder / "model.safetensors").items():
        values = tensor.float().numpy()
        layer = name.split(".")[2] if ".mlp.experts." in name else None
        if name.endswith("experts.gate_up_proj"):
            stacks = {"gate": values[:, :, 0::2].transpose(0, 2, 1), "up": values[:, :, 1::2].transpose(0, 2, 1)}
        elif name.endswith("experts.down_proj"):
            stacks = {"down": values.transpose(0, 2, 1)}
        elif name.endswith("experts.gate_up_proj_bias"):
            for projection, part in (("gate", values[:, 0::2]), ("up", values[:, 1::2])):
                writer.add_tensor(f"blk.{layer}.ffn_{projection}_exps.bias", np.ascontiguousarray(part))
            continue
        elif name.endswith("experts.down_proj_bias"):
            writer.add_tensor(f"blk.{layer}.ffn_down_exps.bias", values)
            continue
        else:
            writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")) + (
                ".weight" if name.endswith(".sinks") else ""), values)
            continue
        for projection, stack in stacks.items():
            _add_stack(writer, f"blk.{layer}.ffn_{projection}_exps.weight", stack, expert_type)
    return finish_gguf(writer, target)


def _gpt_oss_checkpoint(folder):
    from transformers import AutoModelForCausalLM, GptOssConfig

    from core_pytorch_backend.testing import reinit_

    config = GptOssConfig(vocab_size=49152, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                          num_experts_per_tok=2, sliding_window=8, max_position_embeddings=4096)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    reinit_(model, seed=0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.sinks.mul_(10)  # sinks of a few units, as trained ones are
    model.save_pretrained(folder)
    return model


def _greedy(path, quantization: str, prompt: list[int]) -> list[int]:
    import core

    with core.pipeline(str(path), quantization=quantization) as pipe:
        return list(pipe.infer(prompt, max_new_tokens=12, temperature=0.0, ignore_eos=True).token_ids)


PROMPT = [1, 504, 3458, 282, 4649, 314, 7042, 28, 284, 260] * 3


@pytest.mark.slow
@pytest.mark.parametrize("quantization", ["auto", "none"])
def test_a_gpt_oss_gguf_continues_as_transformers_does(quantization, default_gguf_path, tmp_path, monkeypatch):
    """gpt-oss as llama.cpp writes it (gate and up stacks split from the fused, interleaved ``gate_up_proj``,
    the experts' biases stacked alike, the sinks as ``attn_sinks``): greedy output equals transformers'
    float32 ``generate`` on the checkpoint, token for token, both ways the file loads."""
    monkeypatch.setenv("CORE_CACHE_DIR", str(tmp_path / "cache"))
    reference = _gpt_oss_checkpoint(tmp_path / "hf").eval()
    path = _gpt_oss_gguf(tmp_path / "hf", default_gguf_path, tmp_path / "tiny-gpt-oss.gguf")
    with torch.no_grad():
        expected = reference.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)[0, len(PROMPT):]
    assert _greedy(path, quantization, PROMPT) == expected.tolist()


@pytest.mark.slow
def test_an_mxfp4_gpt_oss_gguf_keeps_its_experts_packed_and_exact(default_gguf_path, tmp_path, monkeypatch):
    """MXFP4 expert stacks (gpt-oss's GGUF files) unpack into 8-bit codes whose values are exactly llama.cpp's
    dequantization of each expert's slice; read dense, the file continues a prompt as transformers does on
    the checkpoint whose experts are those values."""
    import gguf

    monkeypatch.setenv("CORE_CACHE_DIR", str(tmp_path / "cache"))
    reference = _gpt_oss_checkpoint(tmp_path / "hf").eval()
    path = _gpt_oss_gguf(tmp_path / "hf", default_gguf_path, tmp_path / "tiny-gpt-oss-mxfp4.gguf", "MXFP4")
    stacks = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in gguf.GGUFReader(path).tensors
              if t.name.endswith("_exps.weight")}
    config = loader.gguf_config(path)
    experts = {name: weight for name, weight in gguf_weights(path, config) if EXPERT.fullmatch(name)}
    assert len(experts) == 3 * config.num_local_experts * config.num_hidden_layers
    for name, weight in experts.items():
        layer, expert, projection = EXPERT.fullmatch(name).groups()
        assert isinstance(weight, AffineWeight), name
        np.testing.assert_array_equal(weight.dequantize(), stacks[f"blk.{layer}.ffn_{projection}_exps.weight"][
            int(expert)], err_msg=name)
    with torch.no_grad():  # the checkpoint's experts as the file holds them
        for index, layer in enumerate(reference.model.layers):
            gate, up, down = (torch.from_numpy(stacks[f"blk.{index}.ffn_{p}_exps.weight"]) for p in ("gate", "up",
                                                                                                   "down"))
            layer.mlp.experts.gate_up_proj[:, :, 0::2] = gate.transpose(1, 2)
            layer.mlp.experts.gate_up_proj[:, :, 1::2] = up.transpose(1, 2)
            layer.mlp.experts.down_proj.copy_(down.transpose(1, 2))
        expected = reference.generate(torch.tensor([PROMPT]), max_new_tokens=12, do_sample=False)[0, len(PROMPT):]
    assert _greedy(path, "none", PROMPT) == expected.tolist()
    _greedy(path, "auto", PROMPT)  # served packed
