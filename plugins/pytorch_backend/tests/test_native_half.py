"""16-bit float weights multiplied by the native kernels (csrc/half_linear.c, native/half_weights.py).

Every variant this CPU runs is checked, in both arithmetics (bfloat16 activations: bf16 products;
float32 activations: float32 FMAs of exact bf16 / f16 weights): its SIMD loop against the plain-C loop bit
for bit (on AVX512-BF16 builds that is `vdpbf16ps` against the order the C loop sums in), every row's
result the same in any batch, and the results against float math on the same values. Then the loader:
a bf16 checkpoint on the CPU has every linear layer and the LM head on these kernels, the native decode
stack takes it, and greedy decoding follows torch's bf16 path; a GGUF file's F16 / BF16 tensors stay
16-bit and the model follows its float32 copy.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from core_pytorch_backend.kernels import select_ops
from core_pytorch_backend.layers.embedding import LMHead, VocabEmbedding
from core_pytorch_backend.loader import load_checkpoint
from core_pytorch_backend.model_runner import ModelRunner
from core_pytorch_backend.native import build
from core_pytorch_backend.native.half_weights import half_kernels
from core_pytorch_backend.native.library import load
from core_pytorch_backend.native.packed_weight import NativeWeight
from core_pytorch_backend.native_decode import NativeDecodeStack, make_native_decode

sys.path.insert(0, str(Path(__file__).parent))  # --import-mode=importlib leaves sys.path alone
from test_native_decode import _decode_both_ways  # noqa: E402
from test_quantized import _rewritten_gguf  # noqa: E402

if build.compiler() is None:
    pytest.skip("no C compiler", allow_module_level=True)

RUNNABLE = [v for v, needed in build.VARIANT_CPU_FLAGS.items() if needed <= build.cpu_flags()]
CPU = torch.device("cpu")
SHAPES = [(16, 64), (40, 100), (72, 576), (3, 130)]  # N and K padded (to 16 and 64) or not


@pytest.fixture(params=RUNNABLE)
def kernels(request):
    return load(request.param)


def _weight(n: int, k: int, seed: int = 0, dtype=torch.bfloat16) -> torch.Tensor:
    return (torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05).to(dtype)


def _rows(m: int, k: int, seed: int = 1, dtype=torch.bfloat16) -> torch.Tensor:
    return torch.randn(m, k, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 9, 300])  # tiles of 4 rows, the rest, and several units
def test_the_simd_loop_is_the_plain_c_loop_bit_for_bit_and_near_float_math(kernels, shape, rows):
    n, k = shape
    weight = _weight(n, k)
    packed = NativeWeight.from_half(weight, kernels)
    x = _rows(rows, k)
    y = packed.linear(x, None)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    assert torch.equal(y, packed.linear(x, None, reference=True))
    exact = x.double() @ weight.double().T
    # float32 sums of exact products, rounded once to bfloat16: within a bf16 rounding and float32 sums
    assert torch.allclose(y.double(), exact, rtol=2 ** -8, atol=1e-5 * k)


@pytest.mark.parametrize("shape", SHAPES)
def test_a_rows_result_does_not_depend_on_its_batch(kernels, shape):
    n, k = shape
    packed = NativeWeight.from_half(_weight(n, k), kernels)
    x = _rows(37, k)
    together = packed.linear(x, None)
    for first, count in [(0, 1), (5, 3), (9, 4), (20, 17)]:
        assert torch.equal(packed.linear(x[first : first + count], None), together[first : first + count])


@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 300])
def test_float32_rows_take_float32_products_of_the_exact_weights(kernels, weight_dtype, shape, rows):
    """float32 activations: FMAs input by input, the SIMD loop the plain C loop's; within float32 sums of
    the float32 model's own products (the weights as float32 exactly)."""
    n, k = shape
    weight = _weight(n, k, dtype=weight_dtype)
    packed = NativeWeight.from_half(weight, kernels)
    x = _rows(rows, k, dtype=torch.float32)
    y = packed.linear(x, None)
    assert y.dtype == torch.float32
    assert torch.equal(y, packed.linear(x, None, reference=True))
    exact = x.double() @ weight.double().T
    assert torch.allclose(y.double(), exact, rtol=1e-5, atol=1e-6 * k)
    for first, count in [(0, 1), (rows // 2, rows - rows // 2)]:
        assert torch.equal(packed.linear(x[first : first + count], None), y[first : first + count])


def test_the_bias_is_added_in_float32(kernels):
    n, k = 40, 100
    packed = NativeWeight.from_half(_weight(n, k), kernels)
    x = _rows(6, k, dtype=torch.float32)
    bias = torch.randn(n)
    assert torch.equal(packed.linear(x, bias), packed.linear(x, None) + bias)
    assert torch.equal(packed.linear(x, bias), packed.linear(x, bias, reference=True))


def test_bfloat16_rows_need_bfloat16_weights(kernels):
    from core_pytorch_backend.native.library import CpuKernelError

    packed = NativeWeight.from_half(_weight(16, 64, dtype=torch.float16), kernels)
    with pytest.raises(CpuKernelError, match="core_packed_linear: bad arguments"):
        packed.linear(_rows(2, 64), None)


def test_subnormal_inputs_count_as_zero_as_vdpbf16ps_reads_them(kernels):
    weight = _weight(16, 64)
    tiny = torch.tensor([1e-39], dtype=torch.float32).bfloat16()  # a bf16 subnormal
    weight[3, 10] = tiny
    zeroed = weight.clone()
    zeroed[3, 10] = 0
    x = _rows(2, 64)
    x[1, 7] = tiny
    x_zeroed = x.clone()
    x_zeroed[1, 7] = 0
    y = NativeWeight.from_half(weight, kernels).linear(x, None)
    assert torch.equal(y, NativeWeight.from_half(zeroed, kernels).linear(x_zeroed, None))


def test_only_a_two_dimensional_16_bit_weight_is_taken():
    kernels = load("generic")
    with pytest.raises(ValueError, match="weight must be a 2-D bfloat16 or float16 tensor, got torch.float32"):
        NativeWeight.from_half(torch.zeros(16, 64), kernels)
    with pytest.raises(ValueError, match="float16 tensor, got torch.bfloat16 of shape \\(64,\\)"):
        NativeWeight.from_half(torch.zeros(64, dtype=torch.bfloat16), kernels)
    packed = NativeWeight.from_half(torch.zeros(20, 70, dtype=torch.bfloat16), kernels)
    assert packed.kind == "bf16-native" and packed.padded_k == 128 and "bfloat16" in repr(packed)
    assert NativeWeight.from_half(torch.zeros(20, 70, dtype=torch.float16), kernels).kind == "f16-native"


# -- the loader -----------------------------------------------------------------------------------------------

needs_bf16_kernels = pytest.mark.skipif(half_kernels(CPU, torch.bfloat16, False, False) is None,
                                        reason="no native kernels, or they have AMX tiles (oneDNN's bf16 stays)")


def test_which_models_the_kernels_take():
    assert half_kernels(torch.device("meta"), torch.bfloat16, False, False) is None
    assert half_kernels(CPU, torch.float16, False, False) is None
    assert half_kernels(CPU, torch.bfloat16, True, False) is None  # a tensor-parallel rank
    assert half_kernels(CPU, torch.float32, False, False) is None  # float32 checkpoints keep torch's GEMMs


@needs_bf16_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_a_bfloat16_checkpoint_multiplies_every_linear_layer_natively(tiny_checkpoint_factory, arch):
    path = tiny_checkpoint_factory(arch)
    loaded = load_checkpoint(path, dtype="bfloat16")
    assert loaded.quantization == "none"  # 16-bit floats are not quantized weights (the server's info says so)
    model = loaded.model
    layers = [m for m in model.modules() if hasattr(m, "matmul")]
    assert layers and all(isinstance(m.weight, NativeWeight) and m.weight.bits == 16 for m in layers)
    head = next(m for m in model.modules() if isinstance(m, LMHead))
    assert isinstance(head.weight, NativeWeight)
    embedding = next(m for m in model.modules() if isinstance(m, VocabEmbedding))
    if head.tied:  # the table's rows are read from the head's blocks, the same values
        assert embedding.weight is head.weight
        ids = torch.tensor([[0, 5, 17], [255, 31, 16]])
        table = torch.nn.functional.embedding(ids, _dense_table(path))
        assert torch.equal(embedding(ids), table) and embedding(ids).dtype == torch.bfloat16
    else:
        assert isinstance(embedding.weight, torch.Tensor) and embedding.weight.dtype == torch.bfloat16


@needs_bf16_kernels
def test_a_float32_model_of_bfloat16_values_keeps_torchs_gemms(tiny_checkpoint_factory, tmp_path):
    """``--dtype float32`` of a bf16 checkpoint (every weight 16 bits hold exactly): torch's GEMMs, which the
    float32 oracle (transformers' generate) runs too; only a GGUF file's float32 model takes the kernels."""
    import shutil

    from safetensors.torch import load_file, save_file

    folder = shutil.copytree(tiny_checkpoint_factory("llama"), tmp_path / "bf16-values")
    for file in folder.glob("*.safetensors"):
        save_file({name: t.bfloat16().float() for name, t in load_file(file).items()}, file, metadata={"format": "pt"})
    model = load_checkpoint(folder, dtype="float32").model
    assert not any(isinstance(m, NativeWeight) for m in model.modules())
    assert any(isinstance(m, NativeWeight) for m in load_checkpoint(folder, dtype="bfloat16").model.modules())


def _dense_table(path) -> torch.Tensor:
    """The checkpoint's embedding table as bf16, read from its safetensors."""
    from safetensors.torch import load_file

    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(file))
    return next(t for name, t in tensors.items() if name.endswith("embed_tokens.weight")).bfloat16()


def test_rows_of_a_16_bit_weight_are_its_values():
    kernels = load("generic")
    for dtype in (torch.bfloat16, torch.float16):
        weight = _weight(37, 100, dtype=dtype)
        packed = NativeWeight.from_half(weight, kernels)
        ids = torch.tensor([[0, 36, 16], [15, 17, 3]])
        assert torch.equal(packed.rows(ids, torch.float32), weight.float()[ids])
        assert torch.equal(packed.rows(ids, dtype), weight[ids])


@needs_bf16_kernels
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_decode_stack_takes_a_bfloat16_model_bit_for_bit(tiny_checkpoint_factory, arch):
    model = load_checkpoint(tiny_checkpoint_factory(arch), dtype="bfloat16", ops=select_ops("cpu")).model
    runner = ModelRunner(model, block_size=4, num_blocks=64, device=CPU, dtype=torch.bfloat16,
                         decode_path=lambda m: make_native_decode(m, device=CPU, enabled=True))
    assert isinstance(runner.decode_path, NativeDecodeStack)
    _decode_both_ways(runner)


@needs_bf16_kernels
def test_greedy_decoding_follows_torchs_bfloat16_path(tiny_checkpoint_factory, monkeypatch):
    """The same bf16 values, sums in another order: the teacher-forced next tokens of a random prompt agree
    with torch's F.linear at nearly every position."""
    path = tiny_checkpoint_factory("llama")
    native = load_checkpoint(path, dtype="bfloat16").model
    monkeypatch.setattr("core_pytorch_backend.loader.half_kernels", lambda *args: None)
    plain = load_checkpoint(path, dtype="bfloat16").model
    assert not any(isinstance(m, NativeWeight) for m in plain.modules())
    ids = torch.randint(0, 250, (1, 64), generator=torch.Generator().manual_seed(3))
    picks = [_teacher_forced_argmax(m, ids) for m in (native, plain)]
    assert (picks[0] == picks[1]).float().mean() >= 0.9


def _teacher_forced_argmax(model, ids: torch.Tensor) -> torch.Tensor:
    from core_pytorch_backend.attention_metadata import AttentionMetadata

    length = ids.shape[1]
    meta = AttentionMetadata.build([0], [length], [list(range(length // 4 + 1))], 4)
    runner = ModelRunner(model, block_size=4, num_blocks=64, device=CPU, dtype=torch.bfloat16)
    runner.zero_blocks(range(length // 4 + 1))
    with torch.inference_mode():
        hidden = model(ids[0], meta.positions(), meta)
        return model.compute_logits(hidden).argmax(-1)


HALF_TYPES = {"attn_q": "F16", "attn_k": "F16", "attn_v": "F16", "attn_output": "BF16", "ffn_gate": "BF16",
              "ffn_up": "BF16", "ffn_down": "F16"}


@pytest.mark.slow
def test_a_gguf_files_16_bit_tensors_stay_16_bit_and_follow_its_float32_model(default_gguf_path, tmp_path):
    """The default model's GGUF rewritten with F16 and BF16 projections: served (quantization auto) they
    are f16 / bf16 NativeWeights multiplied in float32, and the decoder's hidden states follow the same
    file dequantized to float32 (torch's GEMMs) up to the order of float32 sums (the logits would add the
    8-bit LM head's rounding of its activations)."""
    path = _rewritten_gguf(default_gguf_path, tmp_path / "halves.gguf", HALF_TYPES)
    dense = load_checkpoint(path, dtype="float32", quantization="none", cache_dir=tmp_path / "cache")
    assert not any(isinstance(m, NativeWeight) for m in dense.model.modules())
    ids = torch.tensor(dense.tokenizer("The capital of France is Paris, and the capital of Italy is").input_ids)
    loaded = load_checkpoint(path, cache_dir=tmp_path / "cache")
    layer = loaded.model.model.layers[0]
    assert (layer.self_attn.qkv_proj.weight.kind, layer.self_attn.o_proj.weight.kind,
            layer.mlp.gate_up_proj.weight.kind, layer.mlp.down_proj.weight.kind) == (
               "f16-native", "bf16-native", "bf16-native", "f16-native")
    torch.testing.assert_close(_decoded(loaded.model, ids), _decoded(dense.model, ids), rtol=1e-4, atol=1e-4)


def _decoded(model, ids: torch.Tensor) -> torch.Tensor:
    """The decoder's last hidden states (after the final norm) of one prompt, float32 KV cache."""
    from core_pytorch_backend.attention_metadata import AttentionMetadata
    from core_pytorch_backend.layers.attention import allocate_kv_caches

    allocate_kv_caches(model, 4, 16)
    meta = AttentionMetadata.build([0], [len(ids)], [[0]], 16)
    with torch.inference_mode():
        return model(ids, meta.positions(), meta)


def test_keep_sixteen_bit_wraps_only_2_d_16_bit_tensors():
    from core_pytorch_backend.native.half_weights import HalfWeight, keep_sixteen_bit

    weights = [("a", torch.ones(4, 8, dtype=torch.float16)), ("b", torch.ones(4, 8, dtype=torch.bfloat16)),
               ("c", torch.ones(8, dtype=torch.float16)), ("d", torch.ones(4, 8)), ("e", "codes")]
    kept = dict(keep_sixteen_bit(weights))
    assert isinstance(kept["a"], HalfWeight) and kept["a"].values.dtype == torch.float16
    assert isinstance(kept["b"], HalfWeight) and kept["b"].values.dtype == torch.bfloat16
    assert [type(kept[n]) for n in "cde"] == [torch.Tensor, torch.Tensor, str]
    assert HalfWeight.concat([kept["a"], HalfWeight(torch.ones(4, 8, dtype=torch.bfloat16))]) is None
    assert HalfWeight.concat([kept["a"], kept["a"]]).values.shape == (8, 8)
    assert kept["b"].dequantize().dtype.name == "float32"


@pytest.mark.slow
def test_a_gguf_files_16_bit_tensors_are_packed_as_stored(default_gguf_path, tmp_path, monkeypatch):
    """Each F16 / BF16 tensor of the file (the projections, and the embedding table the LM head is tied to)
    becomes a 16-bit NativeWeight without a float32 copy (nothing is left for pack_exact_halves), holding
    exactly the values (rows in the order) of the same file dequantized by transformers; the embedding
    looks its rows up in the head's blocks."""
    import core_pytorch_backend.loader as loader

    path = _rewritten_gguf(default_gguf_path, tmp_path / "halves.gguf", {**HALF_TYPES, "token_embd": "F16"})
    dense = load_checkpoint(path, dtype="float32", quantization="none", cache_dir=tmp_path / "cache")
    packed_later = []
    real = loader.pack_exact_halves
    monkeypatch.setattr(loader, "pack_exact_halves", lambda model, k: packed_later.append(real(model, k)))
    loaded = load_checkpoint(path, cache_dir=tmp_path / "cache")
    assert packed_later == [0]
    params = dict(dense.model.named_parameters())
    checked = 0
    for name, module in loaded.model.named_modules():
        weight = getattr(module, "weight", None)
        if not isinstance(weight, NativeWeight) or isinstance(module, VocabEmbedding):
            continue
        assert weight.bits == 16, name
        reference = params[f"{name}.weight" if f"{name}.weight" in params else "model.embed_tokens.weight"]
        assert torch.equal(weight.rows(torch.arange(weight.shape[0]), torch.float32), reference), name
        checked += 1
    assert checked == 4 * 30 + 1  # qkv, o, gate_up, down of 30 layers, and the LM head
    head, table = loaded.model.lm_head, loaded.model.model.embed_tokens
    assert isinstance(head, LMHead) and table.weight is head.weight
    ids = torch.tensor([0, 5, 49151, 17])
    assert torch.equal(table(ids), dense.model.model.embed_tokens(ids))


@pytest.mark.slow
def test_a_fused_layer_of_f16_and_bf16_shards_is_loaded_dense_first(default_gguf_path, tmp_path, monkeypatch):
    """q in F16 and k / v in BF16: the fused qkv weight has no one stored format, so it loads as float32
    values, which float16 holds (these BF16 values are small: float16's 10-bit mantissa holds their 8) and
    pack_exact_halves then keeps as float16, equal to transformers' dequantization of the file; the other
    layers keep their Q4_1 codes."""
    import core_pytorch_backend.loader as loader

    path = _rewritten_gguf(default_gguf_path, tmp_path / "mixed.gguf", {"attn_q": "F16", "attn_k": "BF16",
                                                                          "attn_v": "BF16"})
    dense = load_checkpoint(path, dtype="float32", quantization="none", cache_dir=tmp_path / "cache")
    packed_later = []
    real = loader.pack_exact_halves
    monkeypatch.setattr(loader, "pack_exact_halves", lambda model, k: packed_later.append(real(model, k)))
    loaded = load_checkpoint(path, cache_dir=tmp_path / "cache")
    assert packed_later == [30]  # every layer's qkv, from its float32 parameter
    attention = loaded.model.model.layers[3].self_attn
    weight = attention.qkv_proj.weight
    assert weight.kind == "f16-native"
    assert torch.equal(weight.rows(torch.arange(weight.shape[0]), torch.float32),
                       dense.model.model.layers[3].self_attn.qkv_proj.weight)
    assert attention.o_proj.weight.kind == "int4-native"
