"""Packed weights: GGUF block layouts, the int4/int8 kernels' wrappers, load-time quantization, and the
default model served from its packed Q4_1 / Q8_0 tensors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from core_pytorch_backend.layers.quantized import AffineRows, Int4Weight, int4_packable
from core_pytorch_backend.loader import load_checkpoint
from core_pytorch_backend.native.library import available
from core_pytorch_backend.native.packed_weight import NativeWeight
from core_pytorch_backend.quant.affine import AffineWeight, quantize_int4, quantize_int8
from core_pytorch_backend.quant.gguf_blocks import unpack
from core_pytorch_backend.quant.kernel_choice import PackedKernel, packed_kernel

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType  # noqa: E402
from gguf.quants import dequantize, quantize  # noqa: E402

RNG = np.random.default_rng(0)


def _weights(n: int = 48, k: int = 256) -> np.ndarray:
    return (RNG.standard_normal((n, k)) * 0.05).astype(np.float32)


KERNELS = ["native", "torch-bf16", "torch-f32"]


def use_kernel(monkeypatch, name: str) -> PackedKernel:
    """Make the loader take kernel ``name`` for packed weights, whatever this CPU measures fastest."""
    if name == "native" and available() is None:
        pytest.skip("the native kernels do not build here")
    chosen = {"native": lambda: PackedKernel(available(), torch.float32),
              "torch-bf16": lambda: PackedKernel(None, torch.bfloat16),
              "torch-f32": lambda: PackedKernel(None, torch.float32)}[name]()
    monkeypatch.setattr("core_pytorch_backend.loader.packed_kernel", lambda: chosen)
    return chosen


@pytest.mark.parametrize("name", ["Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1"])
def test_gguf_blocks_give_the_gguf_packages_dequantized_values(name):
    qtype = GGMLQuantizationType[name]
    raw = quantize(_weights(), qtype)
    codes = unpack(name, raw)
    expected = dequantize(raw, qtype)
    np.testing.assert_allclose(codes.dequantize(), expected, rtol=1e-6, atol=1e-7)
    assert codes.group_size == 32 and codes.bits == {"Q8_0": 8, "Q5_0": 5, "Q5_1": 5}.get(name, 4)


# bytes of a super-block, and where its fp16 d (and dmin) sit: the rest may hold any bits
SUPER_BLOCKS = {"Q4_K": (144, 0), "Q5_K": (176, 0), "Q6_K": (210, 208), "Q3_K": (110, 108), "Q2_K": (84, 80),
                "IQ4_XS": (136, 0), "IQ4_NL": (18, 0)}


def _random_super_blocks(name: str, rows: int, blocks: int) -> np.ndarray:
    """Valid (super-)blocks of type ``name``: random code and scale bytes under small fp16 d (and dmin)."""
    size, at = SUPER_BLOCKS[name]
    halves = 1 if name in ("Q6_K", "Q3_K", "IQ4_NL", "IQ4_XS") else 2
    data = RNG.integers(0, 256, size=(rows, blocks, size), dtype=np.uint8)
    d = RNG.uniform(0.001, 0.01, size=(rows, blocks, halves)).astype(np.float16)
    data[..., at : at + 2 * halves] = d.view(np.uint8).reshape(rows, blocks, 2 * halves)
    return data.reshape(rows, blocks * size)


@pytest.mark.parametrize("name", ["Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K", "IQ4_NL", "IQ4_XS"])
def test_gguf_super_block_codes_give_the_gguf_packages_dequantized_values(name):
    raw = _random_super_blocks(name, 16, 2)
    codes = unpack(name, raw)
    np.testing.assert_allclose(codes.dequantize(), dequantize(raw, GGMLQuantizationType[name]), rtol=1e-6, atol=1e-7)
    if name != "IQ4_NL":  # the K-quants' scales and offsets: int8 multiples of one unit a super-block
        per = 256 // codes.group_size
        for values, unit in zip((codes.scale, codes.offset), codes.units, strict=True):
            multiples = values / np.repeat(unit, per, axis=1)
            assert np.array_equal(multiples, np.rint(multiples)) and np.abs(multiples).max() <= 128
    # units follow the rows a weight is cut into (an expert's slice, a fused projection's parts)
    picked = codes.rows(np.array([3, 0]))
    assert picked.units is None or all(np.array_equal(p, u[[3, 0]]) for p, u in zip(picked.units, codes.units, strict=True))
    stacked = AffineWeight.concat([codes, codes.rows(np.arange(4))])
    assert (stacked.units is None) == (codes.units is None) and stacked.scale.shape[0] == 20
    assert codes.group_size == (16 if name in ("Q6_K", "Q3_K", "Q2_K") else 32)
    assert codes.bits == {"Q4_K": 4, "Q5_K": 5, "Q6_K": 6, "Q3_K": 3, "Q2_K": 2}.get(name, 8)


def test_mxfp4_blocks_give_the_gguf_packages_dequantized_values_bit_for_bit():
    """gpt-oss's MXFP4: any nibbles under any exponent byte up to 240 (subnormal scales included; above, the
    8-bit codes' products would overflow where no trained weight goes), exactly gguf's values."""
    raw = RNG.integers(0, 256, size=(16, 4, 17), dtype=np.uint8)
    raw[..., 0] = RNG.integers(0, 241, size=(16, 4), dtype=np.uint8)
    raw[0, :, 0] = [0, 1, 2, 127]
    raw = raw.reshape(16, 4 * 17)
    codes = unpack("MXFP4", raw)
    np.testing.assert_array_equal(codes.dequantize(), dequantize(raw, GGMLQuantizationType.MXFP4))
    assert codes.group_size == 32 and codes.bits == 8


def test_unsupported_gguf_types_are_not_unpacked():
    assert unpack("IQ2_XXS", np.zeros((1, 66), np.uint8)) is None
    assert unpack("F16", np.zeros((1, 4), np.uint8)) is None
    assert unpack("F32", np.zeros((1, 4), np.uint8)) is None


def _dense_linear(x: torch.Tensor, codes: AffineWeight) -> torch.Tensor:
    return x @ torch.from_numpy(codes.dequantize()).t()


@pytest.mark.parametrize("bits", [4, 8])
def test_int4_weight_multiplies_like_its_dequantized_weight(bits):
    raw = quantize(_weights(), GGMLQuantizationType.Q4_1 if bits == 4 else GGMLQuantizationType.Q8_0)
    codes = unpack("Q4_1" if bits == 4 else "Q8_0", raw)
    x = torch.randn(3, 256)
    packed = Int4Weight.from_affine(codes, torch.float32)
    assert packed.planes == (1 if bits == 4 else 2)
    torch.testing.assert_close(packed.linear(x, None), _dense_linear(x, codes), rtol=1e-4, atol=1e-4)
    bias = torch.randn(48)
    torch.testing.assert_close(packed.linear(x[None], bias)[0], _dense_linear(x, codes) + bias, rtol=1e-4, atol=1e-4)
    half = Int4Weight.from_affine(codes, torch.bfloat16).linear(x.bfloat16(), None).float()
    assert (half - _dense_linear(x, codes)).abs().max() < 0.02 * _dense_linear(x, codes).abs().max()


def test_int4_kernel_limits_are_checked():
    assert not int4_packable(AffineWeight(np.zeros((20, 64), np.uint8), np.zeros((20, 2), np.float32),
                                          np.zeros((20, 2), np.float32), 4, 32))  # N not a multiple of 16
    with pytest.raises(ValueError, match="multiple of the group size"):
        AffineWeight(np.zeros((16, 40), np.uint8), np.zeros((16, 1), np.float32), np.zeros((16, 1), np.float32), 4, 32)


def test_load_time_int8_and_int4_codes_match_the_float_weight():
    w = _weights()
    x = torch.randn(2, 256)
    ref = x @ torch.from_numpy(w).t()
    int8, int4 = quantize_int8(w), quantize_int4(w)
    assert int8.bits == 8 and np.abs(int8.dequantize() - w).max() <= int8.scale.max() / 2 + 1e-7
    assert int4.q.max() <= 15 and np.abs(int4.dequantize() - w).max() <= int4.scale.max() / 2 + 1e-6
    out8 = Int4Weight.from_affine(int8, torch.float32).linear(x, None)
    out4 = Int4Weight.from_affine(int4, torch.float32).linear(x, None)
    assert (out8 - ref).abs().max() < 0.01 * ref.abs().max()
    assert (out4 - ref).abs().max() < 0.15 * ref.abs().max()


def test_int8_codes_are_per_group_the_closer_of_symmetric_and_min_max():
    """Never further from the weight than Q8_0's symmetric codes, and exact on weights that are 4- or
    8-bit codes already (min/max steps hit Q4_1's 16 levels, symmetric ones Q8_0's)."""
    w = _weights() + 0.02  # groups not centred on zero: min/max steps are finer there
    symmetric = unpack("Q8_0", quantize(w, GGMLQuantizationType.Q8_0)).dequantize()
    ours = quantize_int8(w).dequantize()
    assert ((ours - w) ** 2).sum() < ((symmetric - w) ** 2).sum()
    for kind in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_1):
        coded = unpack(kind.name, quantize(_weights(), kind)).dequantize()
        np.testing.assert_allclose(quantize_int8(coded).dequantize(), coded, rtol=0, atol=2e-6)


def test_affine_rows_lookup_dequantizes_the_rows_it_reads():
    codes = unpack("Q8_0", quantize(_weights(), GGMLQuantizationType.Q8_0))
    rows = AffineRows(codes, torch.float32)
    ids = torch.tensor([[3, 0], [47, 3]])
    expected = torch.from_numpy(codes.dequantize())[ids]
    torch.testing.assert_close(rows.lookup(ids), expected, rtol=0, atol=0)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantization_at_load_packs_every_linear_layer(tiny_checkpoint_factory, mode, kernel, monkeypatch):
    use_kernel(monkeypatch, kernel)
    path = tiny_checkpoint_factory("llama", hidden_size=64, intermediate_size=128)
    dense = load_checkpoint(path, dtype="float32").model
    packed = load_checkpoint(path, dtype="float32", quantization=mode)
    layers = [m.weight for m in packed.model.model.layers.modules() if hasattr(m, "matmul")]
    head = packed.model.lm_head.weight  # 8-bit in both modes
    if kernel == "native":  # every layer, whatever its N
        assert layers and {w.bits for w in layers} == {int(mode[-1])} and all(isinstance(w, NativeWeight) for w in layers)
        assert isinstance(head, NativeWeight) and head.bits == 8  # no dense copy: it has none to keep
    else:  # two 4-bit planes for 8-bit codes; dense where the vocabulary does not fit the kernel
        assert layers and {w.planes for w in layers} == {1 if mode == "int4" else 2}
        assert getattr(head, "planes", 2) == 2 and isinstance(head, Int4Weight) == (head.shape[0] % 16 == 0)
    assert isinstance(packed.model.model.embed_tokens.weight, torch.nn.Parameter)  # tables stay dense
    assert mode in packed.quantization
    ids = torch.arange(12) % 50
    reference = _hidden(dense, ids)  # random weights: 4-bit codes of them are rough, 8-bit ones close
    error = (_hidden(packed.model, ids) - reference).norm() / reference.norm()
    assert error < (0.05 if mode == "int8" else 0.5), error


def _hidden(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    from core_pytorch_backend.attention_metadata import AttentionMetadata
    from core_pytorch_backend.layers.attention import allocate_kv_caches

    allocate_kv_caches(model, 4, 16)
    meta = AttentionMetadata.build([0], [len(ids)], [[0]], 16)
    with torch.inference_mode():
        return model.compute_logits(model(ids, meta.positions(), meta))


def test_unknown_quantization_is_a_clear_error(tiny_checkpoint_factory):
    with pytest.raises(ValueError, match="quantization must be one of"):
        load_checkpoint(tiny_checkpoint_factory("llama"), quantization="int3")
    with pytest.raises(ValueError, match="runs on the CPU only"):
        load_checkpoint(tiny_checkpoint_factory("llama"), quantization="int4", device="meta")


@pytest.mark.slow
def test_default_gguf_codes_are_transformers_dequantized_weights(default_gguf_path, default_model):
    """Every packed tensor (after Llama's q/k row permutation) stands for exactly the weight that
    transformers' own GGUF loader dequantizes."""
    from core_pytorch_backend.quant.gguf_file import gguf_weights

    dense = dict(default_model.model.named_parameters())
    seen = 0
    for name, value in gguf_weights(default_gguf_path, default_model.hf_config):
        if not isinstance(value, AffineWeight):
            continue
        ours = torch.from_numpy(value.dequantize())
        fused = _fused_slice(name, dense, default_model.hf_config)
        torch.testing.assert_close(ours, fused, rtol=1e-6, atol=1e-7, msg=name)
        seen += 1
    assert seen == 211  # 210 Q4_1 + the Q8_0 embedding


def _fused_slice(name: str, dense: dict, config) -> torch.Tensor:
    heads, kv, d = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    inter = config.intermediate_size
    pieces = {"q_proj": ("qkv_proj", 0, heads * d), "k_proj": ("qkv_proj", heads * d, (heads + kv) * d),
              "v_proj": ("qkv_proj", (heads + kv) * d, (heads + 2 * kv) * d),
              "gate_proj": ("gate_up_proj", 0, inter), "up_proj": ("gate_up_proj", inter, 2 * inter)}
    for part, (fused, start, end) in pieces.items():
        if f".{part}." in name:
            return dense[name.replace(part, fused)][start:end]
    return dense[name]


@pytest.mark.slow
@pytest.mark.parametrize("kernel", KERNELS)
def test_default_gguf_is_served_packed_and_matches_the_dequantized_model(default_gguf_path, default_model, kernel,
                                                                           monkeypatch):
    """Each kernel's logits follow the dequantized float32 model's: torch's int4 kernel in float32 up to
    rounding, the native kernel up to its activations' two int8 steps, torch's in bf16 mostly (the
    teacher-forced accuracy tests measure how far). With no dtype named the model runs in the chosen
    kernel's dtype, and with the native kernel its KV cache in bf16."""
    chosen = use_kernel(monkeypatch, kernel)
    ids = torch.tensor(default_model.tokenizer("The capital of France is Paris, and the capital of Italy is").input_ids)
    reference = _hidden(default_model.model, ids)
    loaded = load_checkpoint(default_gguf_path)
    assert loaded.dtype == chosen.dtype
    assert loaded.kv_cache_dtype == (torch.bfloat16 if kernel == "native" else chosen.dtype)
    kinds = "int4-native x120, int8-native x1" if kernel == "native" else "int4 x120, int8 x1"
    assert loaded.quantization == f"codes x1, {kinds}"
    logits = _hidden(loaded.model, ids).float()
    if kernel == "torch-bf16":
        assert (logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9
    elif kernel == "torch-f32":
        torch.testing.assert_close(logits, reference, rtol=0, atol=2e-3)
    else:  # activations in two int8 steps: a second step of 127 units (max 0.035, mean 0.007 here), or for the
        # 4-bit layers of 16 on builds with exact int8 tiles (max 0.22, mean 0.044: the bf16 tile loop's 0.38 / 0.041)
        wide = chosen.native.acts_base(4) == 127
        torch.testing.assert_close(logits, reference, rtol=0, atol=5e-2 if wide else 0.3)
        assert (logits - reference).abs().mean() < (0.01 if wide else 0.06)



def _q6_k_blocks(weight: np.ndarray) -> np.ndarray:
    """float32 [N, K] (K a multiple of 256) -> Q6_K super-blocks uint8 [N, K / 256 * 210] (llama.cpp's
    layout; each 16 inputs' scale absmax / 32, a plain rounding: enough for a test's weights)."""
    n, k = weight.shape
    w = weight.reshape(n, k // 256, 16, 16)
    scale = np.abs(w).max(-1) / 32
    d = (scale.max(-1) / 127).astype(np.float16)
    sc = np.rint(np.divide(scale, d.astype(np.float32)[..., None], out=np.zeros_like(scale),
                           where=d[..., None] > 0)).astype(np.int8)
    step = (d.astype(np.float32)[..., None] * sc)[..., None]
    q = np.clip(np.rint(np.divide(w, step, out=np.zeros_like(w), where=step > 0)) + 32, 0, 63).astype(np.uint8)
    q = q.reshape(n, k // 256, 2, 4, 32)  # [.., half, m, l]: input 128 half + 32 m + l
    ql = (q[:, :, :, 0:2] & 0x0F) | ((q[:, :, :, 2:4] & 0x0F) << 4)
    qh = sum((q[:, :, :, m] >> 4) << (2 * m) for m in range(4)).astype(np.uint8)
    parts = (ql.reshape(n, -1, 128), qh.reshape(n, -1, 64), sc.view(np.uint8), d.view(np.uint8).reshape(n, -1, 2))
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def _rewritten_gguf(source, target, types: dict[str, str]):
    """``source`` with each 2-D tensor whose name holds a key of ``types`` re-quantized to that type from
    its dequantized values; every metadata field and other tensor as it was."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(source)
    writer = GGUFWriter(target, reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.alignment"):
            continue
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)
    for tensor in reader.tensors:
        kind = next((t for key, t in types.items() if f".{key}." in f".{tensor.name}"), None)
        if kind is None:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
            continue
        values = dequantize(np.asarray(tensor.data), tensor.tensor_type)
        data = _q6_k_blocks(values) if kind == "Q6_K" else quantize(values, GGMLQuantizationType[kind])
        writer.add_tensor(tensor.name, data, raw_dtype=GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return target


def test_the_test_q6_k_blocks_are_llama_cpps_layout():
    """Within 1.5 steps of each 16 inputs' scale (absmax / 32; the 8-bit scale's rounding and the clip at
    +31 cost up to one more): a wrong layout moves values by their own size, tens of steps."""
    weight = _weights(16, 512)
    values = dequantize(_q6_k_blocks(weight), GGMLQuantizationType.Q6_K)
    step = np.abs(weight).reshape(16, -1, 16).max(-1, keepdims=True) / 32
    assert (np.abs(values - weight).reshape(16, -1, 16) <= step * 1.5).all()


MIXED_TYPES = {"attn_q": "Q5_0", "attn_k": "Q5_1", "attn_v": "Q8_0", "attn_output": "Q5_0", "ffn_gate": "Q5_1",
               "ffn_up": "Q5_0"}


@pytest.mark.slow
@pytest.mark.parametrize("down", ["Q5_1", "Q6_K"])
def test_a_gguf_of_5_and_6_bit_types_is_served_packed_and_follows_its_dequantized_model(default_gguf_path, tmp_path,
                                                                                       monkeypatch, down):
    """Q5_0 / Q5_1 codes (in bytes) and Q6_K's (in bytes, a scale per 16 inputs) are kept exactly: the
    logits follow the same file's dequantized float32 model up to the kernel's rounding of the
    activations (a little more than for Q4_1's: 49 of 639k logits between 0.05 and 0.062 here)."""
    use_kernel(monkeypatch, "native")
    path = _rewritten_gguf(default_gguf_path, tmp_path / "mixed.gguf", {**MIXED_TYPES, "ffn_down": down})
    dense = load_checkpoint(path, dtype="float32", quantization="none", cache_dir=tmp_path / "cache")
    ids = torch.tensor(dense.tokenizer("The capital of France is Paris, and the capital of Italy is").input_ids)
    reference = _hidden(dense.model, ids)
    loaded = load_checkpoint(path, cache_dir=tmp_path / "cache")
    assert loaded.quantization == "codes x1, int8-native x121"
    groups = {linear.weight.group for linear in (loaded.model.model.layers[0].mlp.down_proj,
                                                 loaded.model.model.layers[0].self_attn.qkv_proj)}
    assert groups == ({16, 32} if down == "Q6_K" else {32})
    torch.testing.assert_close(_hidden(loaded.model, ids).float(), reference, rtol=0, atol=0.1)

@pytest.mark.slow
def test_gguf_index_matches_the_gguf_packages_reader(default_gguf_path):
    from gguf import GGUFReader

    from core_pytorch_backend.quant.gguf_index import read_gguf_index

    ours = read_gguf_index(default_gguf_path)
    theirs = GGUFReader(str(default_gguf_path))
    assert ours.architecture == "llama" and len(ours.tensors) == len(theirs.tensors) == 272
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.type_name) == (ref.name, ref.tensor_type.name)
        assert np.array_equal(np.asarray(mine.data).reshape(-1).view(np.uint8),
                              np.asarray(ref.data).reshape(-1).view(np.uint8)), mine.name


def test_gguf_index_refuses_other_files(tmp_path):
    from core_pytorch_backend.quant.gguf_index import read_gguf_index

    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + bytes(64))
    with pytest.raises(ValueError, match="not a GGUF file"):
        read_gguf_index(bad)


def test_a_dense_copy_serves_steps_of_many_rows():
    codes = unpack("Q8_0", quantize(_weights(), GGMLQuantizationType.Q8_0))
    packed = Int4Weight.from_affine(codes, torch.bfloat16)
    packed.keep_dense_copy(codes, torch.bfloat16, min_rows=4)
    assert "dense" in dict(packed.named_buffers())
    few, many = torch.randn(3, 256), torch.randn(5, 256)
    packed.dense.zero_()  # a zeroed copy shows which path ran
    assert packed.linear(few, None).abs().max() > 0  # below min_rows: the packed kernel
    assert packed.linear(many, None).abs().max() == 0  # from min_rows on: the dense copy


@pytest.mark.slow
def test_default_gguf_lm_head_keeps_a_dense_copy_for_large_steps_on_torchs_kernel(default_gguf_path, default_model,
                                                                                   monkeypatch):
    use_kernel(monkeypatch, "torch-bf16")
    head = load_checkpoint(default_gguf_path).model.lm_head.weight
    torch.testing.assert_close(head.dense.float(), default_model.model.lm_head.weight, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("kernel", ["native", "torch-bf16"])
def test_backend_passes_quantization_through_and_bf16_lm_heads_keep_a_dense_copy(tiny_checkpoint_factory, kernel,
                                                                                  monkeypatch):
    """Torch's kernel: an LM head multiplied in bf16 keeps a dense copy for steps of many rows. The native
    kernel: every layer and the head on it, no copy (it is faster at any number of rows)."""
    from core.config import EngineConfig
    from core_pytorch_backend.backend import PytorchBackend

    use_kernel(monkeypatch, kernel)
    path = tiny_checkpoint_factory("llama", hidden_size=64, intermediate_size=128, vocab_size=272)  # fits
    backend = PytorchBackend(EngineConfig(model=str(path), quantization="int4", dtype="bfloat16",
                                          kv_cache_memory_gib=0.01))
    try:
        info = backend.model_info
        assert info.dtype == "bfloat16"
        head = backend.loop.runner.model.lm_head.weight
        if kernel == "native":
            assert info.quantization == "int4-native x8, int8-native x1"
            assert isinstance(head, NativeWeight) and head.bits == 8  # no dense copy: it has none to keep
        else:
            assert info.quantization == "int4 x8, int8 x1"
            assert isinstance(head, Int4Weight) and head.planes == 2
            assert head.dense is not None and head.dense.dtype == torch.bfloat16
    finally:
        backend.loop.stop()


def test_the_kernel_choice_is_native_wherever_it_builds():
    """Not timed: the two kernels' outputs differ, so a timed choice could change a greedy request's text
    from one start to the next (it did: the probe timed the native kernel right after torch's float32
    one had evicted its weights, and chose torch's kernel at 4 of 6 starts)."""
    from core_pytorch_backend.native.library import available
    from core_pytorch_backend.quant.kernel_choice import choose

    native = object()
    assert choose(native) == PackedKernel(native, torch.float32)
    assert choose(native, {"bfloat16": 1.0, "float32": 800.0}) == PackedKernel(native, torch.float32)
    assert choose(None, {"bfloat16": 20.0, "float32": 800.0}) == PackedKernel(None, torch.bfloat16)
    assert choose(None, {"bfloat16": 900.0, "float32": 30.0}) == PackedKernel(None, torch.float32)
    with pytest.raises(ValueError, match="torch_timings"):
        choose(None)
    if available() is not None:
        assert packed_kernel() == PackedKernel(available(), torch.float32)


def test_the_gguf_load_plan_is_cached_and_rebuilt_when_unreadable(default_gguf_path, tmp_path):
    """The GGUF -> HF name map (a transformers skeleton: 1.7 s of a start) and each tensor's row order
    (transformers' tensor processor, run on probes) are written once to the cache and read back the
    same; an unreadable file, or one without a step for some tensor of the file, is rebuilt, not fatal."""
    from transformers import AutoConfig

    from core_pytorch_backend.loader import cached_gguf_folder
    from core_pytorch_backend.quant.gguf_file import LoadPlan, load_plan
    from core_pytorch_backend.quant.gguf_index import read_gguf_index

    index = read_gguf_index(default_gguf_path)
    config = AutoConfig.from_pretrained(cached_gguf_folder(default_gguf_path, with_weights=False))
    built = load_plan(index.architecture, config, index.tensors)
    first = load_plan(index.architecture, config, index.tensors, tmp_path)
    (cached,) = tmp_path.glob("gguf-plan-*.json")
    assert _same_plans(first, built) and _same_plans(LoadPlan.from_json(cached.read_text()), built)
    assert "token_embd.weight" in built.names and set(built.steps) == {t.name for t in index.tensors}
    reordered = {name for name, step in built.steps.items() if step.order is not None}
    assert reordered == {f"blk.{i}.attn_{p}.weight" for i in range(config.num_hidden_layers) for p in "qk"}
    assert not any(step.processed for step in built.steps.values())  # Llama's processor only reorders rows
    tampered = json.loads(cached.read_text())
    tampered["steps"]["output_norm.weight"]["name"] = "read.from.the.cache"
    cached.write_text(json.dumps(tampered))
    assert load_plan(index.architecture, config, index.tensors, tmp_path).steps["output_norm.weight"].name == (
        "read.from.the.cache")  # read back, not built again
    del tampered["steps"]["output_norm.weight"]
    cached.write_text(json.dumps(tampered))
    assert _same_plans(load_plan(index.architecture, config, index.tensors, tmp_path), built)  # a step missing
    cached.write_text("{not json")
    assert _same_plans(load_plan(index.architecture, config, index.tensors, tmp_path), built)
    assert _same_plans(LoadPlan.from_json(cached.read_text()), built)


def _same_plans(a, b) -> bool:
    def steps(plan):
        return {name: (s.name, None if s.order is None else s.order.tolist(), s.processed)
                for name, s in plan.steps.items()}

    return a.names == b.names and steps(a) == steps(b)


class _Processor:
    """A stand-in for transformers' tensor processors: ``change`` applied to the weights of ``name``."""

    def __init__(self, name: str, change) -> None:
        self.name, self.change = name, change

    def process(self, weights, name, **_):
        from types import SimpleNamespace

        return SimpleNamespace(weights=self.change(weights) if name == self.name else weights, name=name)


@pytest.mark.parametrize(("change", "on_matrix", "on_vector"), [
    (lambda w: w, "as stored", "as stored"),
    (lambda w: w[::-1], "reordered", "processed"),  # a vector's values reversed: not a row order
    (lambda w: w - 1.0, "processed", "processed"),
    (np.abs, "processed", "processed"),  # the row indices alone (all >= 0) would take it for no change
    (lambda w: w[..., ::-1], "processed", "processed"),  # columns reversed: the rows stay, their values do not
    (lambda w: w.reshape(-1), "processed", "as stored"),
    (lambda w: 1 / 0, "processed", "processed"),
], ids=["identity", "rows-reversed", "minus-one", "abs", "columns-reversed", "flattened", "raises"])
def test_a_tensor_step_follows_what_the_processor_does_to_probes(change, on_matrix, on_vector):
    from core_pytorch_backend.quant.gguf_file import TensorStep, _step
    from core_pytorch_backend.quant.gguf_index import TensorEntry

    names = {"w": "model.w", "v": "model.v"}
    expected = {"as stored": TensorStep("model.w"), "processed": TensorStep(processed=True)}
    step = _step(_Processor("w", change), TensorEntry("w", "Q4_1", (6, 64), np.zeros((6, 40), np.uint8)), names)
    if on_matrix == "reordered":
        assert step.name == "model.w" and step.order.tolist() == [5, 4, 3, 2, 1, 0] and not step.processed
    else:
        assert step == expected[on_matrix]
    vector = TensorEntry("w", "F32", (6,), np.zeros(6, np.float32))
    assert _step(_Processor("w", change), vector, names) == expected[on_vector]
    unused = TensorEntry("u", "F32", (6, 64), np.zeros((6, 64), np.float32))
    assert _step(_Processor("w", change), unused, names) == TensorStep()  # not changed, and not the model's


def test_a_start_with_the_load_plan_cached_does_not_import_the_tensor_processors(default_gguf_path, tmp_path):
    """transformers' GGUF module (its processors) cost 0.23 s of a 2.4 s start on a Zen 5 EPYC: a start
    that finds the plan in the cache runs without it, and loads the same weights."""
    import subprocess
    import sys

    script = f"""
import sys
from core_pytorch_backend.loader import load_checkpoint
model = load_checkpoint({str(default_gguf_path)!r}, cache_dir={str(tmp_path)!r}).model
print("imported" if "transformers.modeling_gguf_pytorch_utils" in sys.modules else "not-imported")
print(repr(sum(float(t.double().sum()) for t in model.state_dict().values() if t.is_floating_point())))
"""
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout.split()
            for _ in range(2)]
    assert runs[0][0] == "imported" and runs[1][0] == "not-imported", runs
    assert runs[0][-1] == runs[1][-1]
