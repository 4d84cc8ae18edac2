"""The native CPU kernels (native/csrc): the build, the packed linear layer and the decode-step ops.

Every variant this CPU can run is built and checked: its SIMD loops against the plain-C reference
loop and against float math on the dequantized weights, and the op set against the plain-torch
reference ops (the oracle) in float32 and bfloat16.
"""

from __future__ import annotations

import ctypes
import random

import numpy as np
import pytest
import torch

from core_pytorch_backend.attention_metadata import AttentionMetadata
from core_pytorch_backend.kernels import kv_int8, native, reference, select_ops
from core_pytorch_backend.native import build, tile_rows
from core_pytorch_backend.native.library import CpuKernelError, load
from core_pytorch_backend.native.packed_weight import NativeWeight
from core_pytorch_backend.quant.affine import AffineWeight, quantize_int4, quantize_int8

if build.compiler() is None:
    pytest.skip("no C compiler", allow_module_level=True)

RUNNABLE = [v for v, needed in build.VARIANT_CPU_FLAGS.items() if needed <= build.cpu_flags()]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(params=RUNNABLE)
def kernels(request):
    return load(request.param)


def test_the_best_variant_follows_the_cpu_flags():
    assert build.best_variant(frozenset()) == "generic"
    assert build.best_variant(frozenset({"avx2", "fma", "f16c"})) == "avx2"
    vnni = build.VARIANT_CPU_FLAGS["avx512-vnni"]
    assert build.best_variant(frozenset(vnni)) == "avx512-vnni"  # Ice Lake: AVX-512 VNNI without BF16
    assert build.best_variant(frozenset(vnni | {"avx512_bf16"})) == "avx512-bf16"  # Zen 4/5
    assert build.best_variant(frozenset(build.VARIANT_CPU_FLAGS["amx-bf16"])) == "amx-bf16"  # Sapphire Rapids on
    assert build.best_variant(frozenset(vnni | {"avx512_bf16", "amx_tile", "amx_bf16"})) == "avx512-bf16"  # no VBMI
    assert build.best_variant(frozenset(vnni - {"avx512_vnni"})) == "avx2"  # AVX-512 without VNNI


def test_core_cpu_kernels_overrides_the_variant_within_what_the_cpu_runs(monkeypatch):
    vnni = frozenset(build.VARIANT_CPU_FLAGS["avx512-vnni"])
    monkeypatch.delenv("CORE_CPU_KERNELS", raising=False)
    assert build.chosen_variant(vnni) == ("avx512-vnni", "chosen from this CPU's flags")
    monkeypatch.setenv("CORE_CPU_KERNELS", "avx2")
    assert build.chosen_variant(vnni) == ("avx2", "set by CORE_CPU_KERNELS")
    monkeypatch.setenv("CORE_CPU_KERNELS", "avx512-vnni")
    with pytest.raises(ValueError, match="CORE_CPU_KERNELS=avx512-vnni needs CPU flags .*avx512_vnni"):
        build.chosen_variant(frozenset({"avx2", "fma", "f16c"}))
    monkeypatch.setenv("CORE_CPU_KERNELS", "sse9")
    with pytest.raises(ValueError, match="CORE_CPU_KERNELS must be one of amx-bf16, avx512-bf16, avx512-vnni, avx2, generic, got 'sse9'"):
        build.chosen_variant(vnni)


def test_the_served_kernels_follow_core_cpu_kernels_and_the_log_says_why(monkeypatch, caplog):
    """What the backend serves with (library.available, uncached here): the variable's variant, logged as
    set by it; a variant the CPU cannot run stops the start (not a warning and a fallback to torch)."""
    from core.errors import InvalidRequestError
    from core_pytorch_backend.native import library

    monkeypatch.setenv("CORE_CPU_KERNELS", "generic")
    with caplog.at_level("INFO", logger=library.__name__):
        kernels = library.available.__wrapped__()
    assert kernels.variant == "generic" and "the generic variant (set by CORE_CPU_KERNELS)" in caplog.text
    monkeypatch.setenv("CORE_CPU_KERNELS", "sse9")
    with pytest.raises(InvalidRequestError, match="CORE_CPU_KERNELS must be one of"):
        library.available.__wrapped__()


def test_a_missing_compiler_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(build.CpuBuildError, match="no C compiler"):
        build.build_library("generic")


def test_an_edit_to_the_sources_changes_the_cache_key(tmp_path, monkeypatch):
    cc = build.compiler()
    before = build.build_key("generic", cc)
    (tmp_path / "a.c").write_text("int x;")
    monkeypatch.setattr(build, "CSRC", tmp_path)
    assert build.build_key("generic", cc) != before


def test_a_copy_of_the_sources_elsewhere_builds_the_same_library(tmp_path, monkeypatch):
    """build_library(sources=...) (benchmarks/kernel_ab.py's earlier revision): the same files elsewhere
    are the same library; an edited copy is another one, built from that folder."""
    import shutil

    monkeypatch.setenv("CORE_CACHE_DIR", str(tmp_path / "cache"))
    copy, cc = tmp_path / "csrc", build.compiler()
    shutil.copytree(build.CSRC, copy)
    assert build.build_key("generic", cc, copy) == build.build_key("generic", cc)
    (copy / "argmax.c").write_text((copy / "argmax.c").read_text() + "\nint core_ab_marker(void) { return 7; }\n")
    assert build.build_key("generic", cc, copy) != build.build_key("generic", cc)
    edited = build.build_library("generic", sources=copy)
    assert build.build_key("generic", cc, copy) in edited.name and ctypes.CDLL(str(edited)).core_ab_marker() == 7


def test_a_source_that_does_not_compile_is_a_clear_error(tmp_path, monkeypatch):
    """Each file is compiled apart (all at once): the error names the file's command and the compiler's
    message, and nothing is left in the cache."""
    import shutil

    monkeypatch.setenv("CORE_CACHE_DIR", str(tmp_path / "cache"))
    copy = tmp_path / "csrc"
    shutil.copytree(build.CSRC, copy)
    (copy / "broken.c").write_text("int core_broken(void) { return missing_name; }\n")
    with pytest.raises(build.CpuBuildError, match=r"(?s)broken\.c.*missing_name"):
        build.build_library("generic", sources=copy)
    assert not list((tmp_path / "cache" / "cpu").glob("*.so"))


def test_the_library_names_its_variant(kernels):
    assert kernels.variant in build.VARIANT_FLAGS


# ---------------------------------------------------------------- packed linear

def _weight(n: int, k: int, bits: int | str):
    """4- or 8-bit codes per 32 inputs of a random weight; "k16": the 16-input groups of Q6_K / Q3_K / Q2_K,
    6-bit codes under a signed scale and any offset per 16 inputs."""
    rng = np.random.default_rng(n * k + (6 if bits == "k16" else bits))
    if bits == "k16":
        scale = (rng.uniform(0.5, 1.5, (n, k // 16)) * rng.choice([-1, 1], (n, k // 16)) * 2e-3).astype(np.float32)
        offset = (rng.uniform(-40, 8, (n, k // 16)) * np.abs(scale)).astype(np.float32)
        return AffineWeight(rng.integers(0, 64, (n, k), dtype=np.uint8), scale, offset, 6, 16)
    dense = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    return quantize_int4(dense) if bits == 4 else quantize_int8(dense)


BITS = [4, 8, "k16"]


def _code_bits(bits: int | str) -> int:
    """The codes' width of a BITS case ("k16": 8-bit codes with a scale per 16 inputs)."""
    return 8 if bits == "k16" else bits


@pytest.mark.parametrize("bits", BITS)
# K = 96 and 32 pad to 128 / 64; N = 72: 5 blocks, the last half full, so that tiles of two blocks (AVX-512)
# and a block left alone both occur whatever the thread count
@pytest.mark.parametrize("shape", [(48, 256), (40, 96), (16, 32), (72, 128)])
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 17])  # 16 rows on: tiles of two blocks (AVX-512)
def test_packed_linear_follows_the_dequantized_weights(kernels, bits, shape, rows):
    codes = _weight(*shape, bits)
    weight = NativeWeight.from_affine(codes, kernels)
    x = torch.randn(rows, shape[1])
    bias = torch.randn(shape[0])
    expected = x @ torch.from_numpy(codes.dequantize()).T + bias
    simd, plain = weight.linear(x, bias), weight.linear(x, bias, reference=True)
    torch.testing.assert_close(simd, plain, rtol=1e-5, atol=1e-5)  # same integer dots, other sum order
    # the activations are rounded per 32 inputs in two int8 steps, to within max|x| / 32258 of each input:
    # ~1e-4 relative error (one int8 step: ~5e-3; bf16 activations: ~2e-3); builds with exact int8 tiles take
    # a second step of 16 units for 4-bit codes, not 127 (max|x| / 4064: ~6e-4)
    assert ((simd - expected).norm() / expected.norm()) < (3e-4 if kernels.acts_base(_code_bits(bits)) == 127 else 2e-3)


def test_packed_linear_takes_and_returns_bfloat16(kernels):
    codes = _weight(64, 128, 4)
    weight = NativeWeight.from_affine(codes, kernels)
    x = torch.randn(2, 128)
    out = weight.linear(x.bfloat16(), None)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), weight.linear(x.bfloat16().float(), None), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bits", [4, 8])
def test_the_simd_loops_quantize_activations_to_the_references_codes(kernels, dtype, bits):
    """An identity weight (code 1, scale 1, offset 0) returns each input as its two int8 codes give it back,
    d * (base q1 + q2) (base 127, or 16 for 4-bit codes on builds with exact int8 tiles), exactly: so SIMD and plain C agree bit for bit only where their codes and scales do
    (the outputs' tolerance above would let a code off by one through)."""
    k = 256
    identity = AffineWeight(np.eye(k, dtype=np.uint8), np.ones((k, k // 32), np.float32),
                            np.zeros((k, k // 32), np.float32), bits, 32)
    weight = NativeWeight.from_affine(identity, kernels)
    # groups of very different magnitudes
    x = (torch.randn(5, k, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, k)).to(dtype)
    simd, plain = weight.linear(x, None), weight.linear(x, None, reference=True)
    assert torch.equal(simd, plain)
    # and the codes are the two steps': within max|x| / (2 x 127 x base) of each input (32258 for base 127), its
    # group's maximum, plus the output's own rounding (half a unit: 2^-8 of the value in bf16, float32's
    # products a few 2^-24)
    group_max = x.float().view(5, k // 32, 32).abs().amax(-1, keepdim=True).expand(5, k // 32, 32).reshape(5, k)
    rounding = x.float().abs() * (2**-8 if dtype == torch.bfloat16 else 2**-22)
    assert ((simd.float() - x.float()).abs() <= group_max / (2 * 127 * kernels.acts_base(bits)) + rounding).all()


def test_symmetric_codes_store_their_zero_point_as_offsets(kernels):
    rng = np.random.default_rng(0)
    scale = rng.random((16, 2)).astype(np.float32)
    codes = AffineWeight(rng.integers(0, 256, (16, 64), dtype=np.uint8), scale, -128 * scale, 8, 32)  # as Q8_0
    weight = NativeWeight.from_affine(codes, kernels)
    assert weight.offset.shape == weight.scale.shape == (16 * 2,)  # one block of 16 rows, two groups
    torch.testing.assert_close(weight.offset, -128 * weight.scale)


@pytest.mark.parametrize("bits", [4, 8])
def test_scales_that_halves_hold_exactly_are_kept_as_halves(kernels, bits):
    """GGUF's scales are float16: kept so, a weight reads a sixth fewer bytes, and gives the same result."""
    codes = _weight(40, 96, bits)
    halves = AffineWeight(codes.q, codes.scale.astype(np.float16).astype(np.float32),
                          codes.offset.astype(np.float16).astype(np.float32), codes.bits, codes.group_size)
    weight, wide = NativeWeight.from_affine(halves, kernels), NativeWeight.from_affine(codes, kernels)
    assert weight.scale.dtype == weight.offset.dtype == torch.float16 and wide.scale.dtype == torch.float32
    x = torch.randn(5, 96)
    expected = x @ torch.from_numpy(halves.dequantize()).T
    simd, plain = weight.linear(x, None), weight.linear(x, None, reference=True)
    torch.testing.assert_close(simd, plain, rtol=1e-5, atol=1e-5)
    assert ((simd - expected).norm() / expected.norm()) < (3e-4 if kernels.acts_base(bits) == 127 else 2e-3)


# K-quants: their fp16 d (and dmin) bytes, and the group size (csrc DT_S8_32 / DT_S8_16)
K_QUANTS = {"Q4_K": (144, 0, 2), "Q5_K": (176, 0, 2), "Q6_K": (210, 208, 1), "Q3_K": (110, 108, 1),
            "Q2_K": (84, 80, 2), "IQ4_XS": (136, 0, 1)}


def _k_quant(name: str, rows: int, supers: int) -> AffineWeight:
    """Random valid super-blocks of ``name`` (any code and scale bytes under small fp16 d and dmin), unpacked."""
    from core_pytorch_backend.quant.gguf_blocks import unpack

    size, at, halves = K_QUANTS[name]
    rng = np.random.default_rng(supers * 1000 + rows)
    data = rng.integers(0, 256, size=(rows, supers, size), dtype=np.uint8)
    d = rng.uniform(0.001, 0.01, size=(rows, supers, halves)).astype(np.float16)
    data[..., at : at + 2 * halves] = d.view(np.uint8).reshape(rows, supers, 2 * halves)
    return unpack(name, data.reshape(rows, supers * size))


@pytest.mark.parametrize("name", list(K_QUANTS))
def test_k_quant_scales_kept_as_int8_multiples_give_the_float_scales_bits(kernels, name):
    """A K-quant's scales and offsets (d * sc, -dmin * mn: an int8 under a super-block's fp16 d) are kept as int8
    codes and a float32 unit per 256 inputs, three eighths of the bytes or less, and every loop multiplies them back to
    the float32 values the file gives: the bits of the float32 layout, at any row count, on the prompt loop too."""
    factored = _k_quant(name, 40, 2)  # 40 rows: 3 blocks, the last half full
    plain = AffineWeight(factored.q, factored.scale, factored.offset, factored.bits, factored.group_size)
    weight, wide = NativeWeight.from_affine(factored, kernels), NativeWeight.from_affine(plain, kernels)
    assert weight.scale.dtype == torch.int8 and wide.scale.dtype == torch.float32
    assert weight.scale.numel() * 8 <= wide.scale.numel() * wide.scale.element_size() * 3
    for rows in (1, 5, 17):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(weight.linear(x, None), wide.linear(x, None)), rows
        assert torch.equal(weight.linear(x, None, reference=True), wide.linear(x, None, reference=True)), rows
        if kernels.prompt_loop is not None:
            assert torch.equal(weight.linear(x, None, tiles=True), wide.linear(x, None, tiles=True)), rows
    expected = x @ torch.from_numpy(plain.dequantize()).T
    assert ((weight.linear(x, None) - expected).norm() / expected.norm()) < 2e-3


def test_scales_that_are_not_int8_multiples_of_their_units_keep_the_float_layout(kernels):
    """Units that do not divide every scale (a hand-made weight, a corrupt file), a K of partial super-blocks, or
    no units: float32 scales, as before."""
    weight = _k_quant("Q4_K", 16, 1)
    off = weight.scale.copy()
    off[3, 2] *= 1.0000001
    not_multiples = AffineWeight(weight.q, off, weight.offset, weight.bits, weight.group_size, weight.units)
    assert NativeWeight.from_affine(not_multiples, kernels).scale.dtype == torch.float32
    too_large = AffineWeight(weight.q, weight.scale, weight.offset, weight.bits, weight.group_size,
                             (weight.units[0] / 1024, weight.units[1]))
    assert NativeWeight.from_affine(too_large, kernels).scale.dtype == torch.float32
    assert NativeWeight.from_affine(weight, kernels).scale.dtype == torch.int8


# (K, rows, slices): one chunk of rows; and K = 1536, whose chunks of activation codes (csrc
# ACTS_CHUNK_BYTES) hold 32 rows, so 101 rows take four chunks and a tile left over
BATCH_CASES = {"one chunk": (96, 11, [(0, 1), (3, 5), (2, 9), (5, 11)]),
               "several chunks": (1536, 101, [(0, 1), (30, 35), (2, 99), (64, 101)]),
               # on an AMX build, the VNNI loop's calls of 16 rows or more take its exact tile loop for each 16
               # (the rest the vector loop): a row's bits whichever tile, place in it or loop it falls to
               "exact tiles": (576, 37, [(0, 1), (5, 21), (3, 36), (20, 37), (21, 37)]),
               # the tile loop's chunks (AMX_ACTS_BYTES) hold 160 rows of K = 1536
               "several tile chunks": (1536, 400, [(0, 1), (150, 170), (3, 399)])}


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("case", BATCH_CASES)
@pytest.mark.parametrize("tiles", [False, True], ids=["vnni", "tiles"])
def test_a_rows_result_does_not_depend_on_its_batch(kernels, bits, case, tiles):
    """Each activation row is quantized and summed the same way whatever M is: a prompt's KV cache is
    the same whether its prefix was prefilled alone, in a batch or read from the prefix cache. The tile
    loop and the vector prompt loop too: a row is the same sequence of products over K in any tile, pair or chunk
    of rows (a weight of 16-input groups takes the VNNI loop there)."""
    if tiles and kernels.prompt_loop is None:
        pytest.skip(f"the {kernels.variant} variant has no prompt loop")
    k, rows, slices = BATCH_CASES[case]
    weight = NativeWeight.from_affine(_weight(40, k, bits), kernels)
    x = torch.randn(rows, k)
    batched = weight.linear(x, None, tiles=tiles)
    for start, stop in slices:
        assert torch.equal(weight.linear(x[start:stop], None, tiles=tiles), batched[start:stop])


def _bf16_oracle(codes: AffineWeight, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The tile loop's arithmetic in torch: each weight q * s + o rounded once to float32 (the kernel's fma)
    and then to bfloat16, the activations rounded to bfloat16, products summed in float32."""
    scale = np.repeat(codes.scale.astype(np.float64), codes.group_size, axis=1)[:, : codes.q.shape[1]]
    offset = np.repeat(codes.offset.astype(np.float64), codes.group_size, axis=1)[:, : codes.q.shape[1]]
    dense = torch.from_numpy((codes.q.astype(np.float64) * scale + offset).astype(np.float32))
    out = x.bfloat16().float() @ dense.bfloat16().float().T
    return out if bias is None else out + bias


TILES = pytest.mark.skipif(not any(load(v).uses_amx for v in RUNNABLE), reason="no AMX tiles on this machine")
PROMPT_LOOP = pytest.mark.skipif(not any(load(v).prompt_loop for v in RUNNABLE), reason="no prompt loop on this machine")


@pytest.fixture
def tile_kernels(kernels):
    if not kernels.uses_amx:
        pytest.skip(f"the {kernels.variant} variant has no AMX tile loop")
    return kernels


@pytest.fixture
def prompt_kernels(kernels):
    """A variant with a prompt loop: the AMX tile loop, or the vector prompt loop (AVX512-BF16)."""
    if kernels.prompt_loop is None:
        pytest.skip(f"the {kernels.variant} variant has no prompt loop")
    return kernels


def _tile_arithmetic(codes: AffineWeight, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """`tdpbf16ps`'s arithmetic exactly (DESIGN.md): the weights and activations rounded as in _bf16_oracle;
    per group of 32 inputs (one tile product of 16 pairs) two float32 chains from zero, over the pairs' first
    and second elements in order (each product of two bfloat16 values is exact in float32, so each step
    rounds once, as an FMA), and the row's sum += first + second."""
    scale = np.repeat(codes.scale.astype(np.float64), codes.group_size, axis=1)[:, : codes.q.shape[1]]
    offset = np.repeat(codes.offset.astype(np.float64), codes.group_size, axis=1)[:, : codes.q.shape[1]]
    k = codes.q.shape[1]
    padded = (k + 31) // 32 * 32
    weights = torch.zeros(codes.q.shape[0], padded)
    weights[:, :k] = torch.from_numpy((codes.q.astype(np.float64) * scale + offset).astype(np.float32)).bfloat16().float()
    acts = torch.zeros(x.shape[0], padded)
    acts[:, :k] = x.bfloat16().float()
    total = torch.zeros(x.shape[0], codes.q.shape[0])
    for group in range(padded // 32):
        first, second = torch.zeros_like(total), torch.zeros_like(total)
        for pair in range(16):
            at = 32 * group + 2 * pair
            first = first + acts[:, at, None] * weights[None, :, at]
            second = second + acts[:, at + 1, None] * weights[None, :, at + 1]
        total = total + (first + second)
    return total + bias


@TILES
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 33])
def test_the_tile_loop_gives_the_tiles_arithmetic_bit_for_bit(tile_kernels, bits, rows):
    """The tile loop's results are exactly the arithmetic _tile_arithmetic writes down (what a vector loop
    must do to give the same results: DESIGN.md, the AMX tile loop)."""
    codes = _weight(72, 1536, bits)
    weight = NativeWeight.from_affine(codes, tile_kernels)
    x, bias = torch.randn(rows, 1536), torch.randn(72)
    assert torch.equal(weight.linear(x, bias, tiles=True), _tile_arithmetic(codes, x, bias))


@TILES
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(72, 1536), (40, 96), (96, 160)])
def test_the_tile_loops_vector_twin_gives_the_tiles_bits(tile_kernels, bits, dtype, shape):
    """Calls of one or two rows take the tile loop's vector twin (csrc/packed_linear.c packed_linear_twin): bit for
    bit what the tile loop gives those rows, alone (the twin turned off) and inside a call of 20 rows (the
    tiles), for the product and for the gated epilogue (where the halves are whole blocks)."""
    weight = NativeWeight.from_affine(_weight(*shape, bits), tile_kernels)
    generator = torch.Generator().manual_seed(bits + shape[0])
    x, bias = torch.randn(20, shape[1], generator=generator).to(dtype), torch.randn(shape[0], generator=generator)
    gated = shape[0] % 32 == 0
    with tile_rows.prompt_token_rows(tile_rows.rows_of([(0, 20)], 20)):
        many = weight.linear(x, bias, tiles=True), weight.gated_linear(x, bias, "silu") if gated else None
    assert tile_kernels.tile_twin()
    for rows in (1, 2, 3, 4):
        with tile_rows.prompt_token_rows(tile_rows.rows_of([(0, rows)], rows)):
            twin = weight.linear(x[:rows], bias, tiles=True), weight.gated_linear(x[:rows], bias, "silu") if gated else None
            try:
                tile_kernels.tile_twin(False)
                assert not tile_kernels.tile_twin()
                tiles = weight.linear(x[:rows], bias, tiles=True), weight.gated_linear(x[:rows], bias, "silu") if gated else None
            finally:
                tile_kernels.tile_twin(True)
        for fused in range(2 if gated else 1):
            assert torch.equal(twin[fused], tiles[fused]) and torch.equal(twin[fused], many[fused][:rows]), (rows, fused)


@PROMPT_LOOP
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(48, 256), (40, 96), (16, 32), (72, 128), (576, 1536)])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 33, 70])  # one tile of rows, a pair, a pair and more
def test_the_prompt_loop_multiplies_in_bfloat16(prompt_kernels, bits, shape, rows):
    codes = _weight(*shape, bits)
    weight = NativeWeight.from_affine(codes, prompt_kernels)
    x = torch.randn(rows, shape[1])
    bias = torch.randn(shape[0])
    tiles = weight.linear(x, bias, tiles=True)
    torch.testing.assert_close(tiles, _bf16_oracle(codes, x, bias), rtol=1e-5, atol=2e-5)  # other sum order
    expected = x @ torch.from_numpy(codes.dequantize()).T + bias  # bf16 rounding: ~2e-3 relative
    assert ((tiles - expected).norm() / expected.norm()) < 5e-3
    out = weight.linear(x.bfloat16(), None, tiles=True)  # bfloat16 in and out
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), (tiles - bias).bfloat16().float(), rtol=1e-2, atol=1e-2)


@PROMPT_LOOP
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(72, 1536), (40, 96), (16, 32), (200, 160)])
@pytest.mark.parametrize("rows", [1, 5, 33, 70])  # one unit of rows (PROMPT_UNIT_ROWS), more, a partial tile
def test_the_vector_prompt_loop_gives_the_bf16_weights_bits(prompt_kernels, bits, shape, rows):
    """The vector prompt loop (csrc/packed_linear.c packed_linear_prompt) is the bf16 loop of half_linear.c on the
    weight dequantized as the tile loop does (q * s + o rounded once to float32, then to bfloat16) and the
    activations rounded to bfloat16: bit for bit that loop's plain-C reference (vdpbf16ps's arithmetic), for
    float32 outputs (the kernel called directly) and bfloat16 ones."""
    if prompt_kernels.prompt_loop != "vectors":
        pytest.skip("the AMX tile loop has its own arithmetic (test_the_tile_loop_gives_the_tiles_arithmetic_bit_for_bit)")
    codes = _weight(*shape, bits)
    weight = NativeWeight.from_affine(codes, prompt_kernels)
    scale = np.repeat(codes.scale.astype(np.float64), codes.group_size, axis=1)[:, : codes.q.shape[1]]
    offset = np.repeat(codes.offset.astype(np.float64), codes.group_size, axis=1)[:, : codes.q.shape[1]]
    dense = torch.from_numpy((codes.q.astype(np.float64) * scale + offset).astype(np.float32)).bfloat16()
    half = NativeWeight.from_half(dense, prompt_kernels)
    generator = torch.Generator().manual_seed(rows + shape[0])
    x, bias = torch.randn(rows, shape[1], generator=generator), torch.randn(shape[0], generator=generator)
    n, k = shape
    rounded, expected = x.bfloat16(), torch.empty(rows, n)
    prompt_kernels.call("core_packed_linear_reference", rounded.data_ptr(), 1, rows, k, half.codes.data_ptr(), 16, 32,
                        n, half.padded_k, half.scale.data_ptr(), half.offset.data_ptr(), 1, bias.data_ptr(),
                        expected.data_ptr(), 0)  # bfloat16 activations, float32 outputs
    assert torch.equal(weight.linear(x, bias, tiles=True), expected)
    assert torch.equal(weight.linear(rounded, bias, tiles=True), half.linear(rounded, bias, reference=True))


@PROMPT_LOOP
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 17, 70])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_gated_prompt_loop_gives_the_bits_of_the_product_then_silu(prompt_kernels, bits, dtype, rows, with_bias):
    """gated_linear (silu * up in the prompt loop's epilogue) is bit for bit the prompt loop's [gate | up]
    product and then the native silu * up, for the rows the prompt loop takes; None where it does not apply."""
    codes = _weight(2 * 48, 160, bits)  # gate and up of 48 each: three blocks a half
    weight = NativeWeight.from_affine(codes, prompt_kernels)
    x, bias = torch.randn(rows, 160).to(dtype), torch.randn(96) if with_bias else None
    expected = native.silu_and_mul(weight.linear(x, bias, tiles=True))
    assert weight.gated_linear(x, bias, "silu") is None  # no step marked: the VNNI loop's rows
    with tile_rows.prompt_token_rows(tile_rows.rows_of([(0, rows)], rows)):
        fused = weight.gated_linear(x, bias, "silu")
        assert weight.gated_linear(x, bias, "gelu_tanh") is None
    assert fused.dtype == dtype and torch.equal(fused, expected)
    odd = NativeWeight.from_affine(_weight(2 * 40, 160, bits), prompt_kernels)  # halves not whole blocks
    with tile_rows.prompt_token_rows(tile_rows.rows_of([(0, rows)], rows)):
        assert odd.gated_linear(x, None, "silu") is None


@TILES
@pytest.mark.parametrize("bits", [4, 8])
def test_outputs_of_2_mb_or_more_a_call_are_streamed_with_the_same_bits(tile_kernels, bits):
    """A tile-loop call whose float32 outputs reach 2 MB (AMX_STREAM_BYTES) writes them by streaming stores:
    the same bits as calls of 1,000 rows (ordinary stores), for whole aligned blocks, for 40 outputs a row
    (rows not on 64-byte lines, a part block) and for the gated epilogue."""
    rows = 13_200  # x 40 outputs x 4 bytes: just over 2 MB
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(5))
    for n in (256, 40):
        weight = NativeWeight.from_affine(_weight(n, 64, bits), tile_kernels)
        parts = [weight.linear(x[at : at + 1000], None, tiles=True) for at in range(0, rows, 1000)]
        assert torch.equal(weight.linear(x, None, tiles=True), torch.cat(parts)), n
    gated = NativeWeight.from_affine(_weight(2 * 48, 64, bits), tile_kernels)  # 13,200 x 48 x 4: 2.5 MB
    parts = []
    for at in range(0, rows, 1000):
        part = x[at : at + 1000]
        with tile_rows.prompt_token_rows(tile_rows.rows_of([(0, part.shape[0])], part.shape[0])):
            parts.append(gated.gated_linear(part, None, "silu"))
    with tile_rows.prompt_token_rows(tile_rows.rows_of([(0, rows)], rows)):
        assert torch.equal(gated.gated_linear(x, None, "silu"), torch.cat(parts))


@TILES
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(48, 256), (40, 96), (72, 128), (576, 1536)])
@pytest.mark.parametrize("rows", [16, 37, 64])  # one tile of rows; two and five left to the vector loop; four
@pytest.mark.parametrize("dtype", DTYPES)
def test_the_exact_tiles_give_the_vnni_loops_bits(tile_kernels, bits, shape, rows, dtype):
    """From 16 rows a call the VNNI loop multiplies on the AMX tiles (int8 dots, exact, folded with the scales
    by the vector loop's instructions): the outputs are the vector loop's alone, bit for bit, so which loop a
    row takes may follow the batch."""
    assert tile_kernels.exact_tiles()
    weight = NativeWeight.from_affine(_weight(*shape, bits), tile_kernels)
    x, bias = torch.randn(rows, shape[1]).to(dtype), torch.randn(shape[0])
    with_tiles = weight.linear(x, bias)
    try:
        tile_kernels.exact_tiles(False)
        assert not tile_kernels.exact_tiles()
        alone = weight.linear(x, bias)
    finally:
        tile_kernels.exact_tiles(True)
    assert with_tiles.dtype == dtype and torch.equal(with_tiles, alone)


def test_each_variant_has_the_prompt_loop_its_instructions_allow(kernels):
    """AVX512-BF16 builds have a prompt loop (the AMX tiles where Linux grants them, else vectors), the others
    none: the prompt-loop tests skip by it, so a wrong answer here would skip them all silently."""
    expected = {"amx-bf16": "amx" if kernels.uses_amx else "vectors", "avx512-bf16": "vectors"}.get(kernels.variant)
    assert kernels.prompt_loop == expected


def test_the_prompt_loop_is_refused_without_one(kernels):
    if kernels.prompt_loop is not None:
        pytest.skip(f"the {kernels.variant} variant has a prompt loop")
    weight = NativeWeight.from_affine(_weight(16, 64, 4), kernels)
    with pytest.raises(CpuKernelError, match="core_packed_linear_tiles: no prompt loop"):
        weight.linear(torch.randn(2, 64), None, tiles=True)


@PROMPT_LOOP
@pytest.mark.parametrize("max_runs", [8, 0], ids=["runs in place", "gathered"])
def test_marked_rows_take_the_prompt_loop_and_the_others_the_vnni_loop(prompt_kernels, monkeypatch, max_runs):
    """tile_rows: a step's prompt-token rows (marked) on the tiles, its generated tokens' by the VNNI loop,
    each row as it would be alone (each run of rows in place, or each loop's rows gathered where the runs
    are too many); unmarked passes, and a weight called with another row count, all VNNI."""
    monkeypatch.setattr("core_pytorch_backend.native.packed_weight.MAX_RUNS", max_runs)
    weight = NativeWeight.from_affine(_weight(40, 96, 4), prompt_kernels)
    x = torch.randn(9, 96)
    tiles, vnni = weight.linear(x, None, tiles=True), weight.linear(x, None, tiles=False)
    assert not torch.equal(tiles, vnni)
    marked = tile_rows.rows_of([(0, 0), (1, 3), (6, 2)], 9)  # rows 1-3 and 6-7 are prompt tokens
    with tile_rows.prompt_token_rows(marked):
        mixed = weight.linear(x, None)
        other_count = weight.linear(x[:5], None)
    prompt = torch.tensor([False, True, True, True, False, False, True, True, False])
    assert torch.equal(mixed[prompt], tiles[prompt]) and torch.equal(mixed[~prompt], vnni[~prompt])
    assert torch.equal(other_count, vnni[:5])
    with tile_rows.prompt_token_rows(tile_rows.rows_of([(0, 9)], 9)):
        assert torch.equal(weight.linear(x, None), tiles)
    assert torch.equal(weight.linear(x, None), vnni) and tile_rows.current() is None


def test_prompt_token_rows_of_a_step():
    assert tile_rows.rows_of([], 4) is None and tile_rows.rows_of([(0, 0), (2, 0)], 4) is None
    every = tile_rows.rows_of([(0, 3), (3, 1)], 4)
    assert every.total == 4 and every.all_tiled and every.runs == ()
    some = tile_rows.rows_of([(0, 2), (3, 1)], 5)
    assert not some.all_tiled and some.rows(True).tolist() == [0, 1, 3] and some.rows(False).tolist() == [2, 4]
    assert some.runs == ((0, 2, True), (2, 3, False), (3, 4, True), (4, 5, False))
    touching = tile_rows.rows_of([(2, 3), (5, 1), (7, 0)], 8)  # two chunks one after the other: one run
    assert touching.runs == ((0, 2, False), (2, 6, True), (6, 8, False))


def test_each_rule_marks_its_rows():
    """prompt: the prompt tokens' rows; all: every row (the LM head's too: no spans); none (--amx-rows none):
    no row, so every row takes the VNNI loop."""
    assert tile_rows.marked("prompt", [(1, 2)], 4).rows(True).tolist() == [1, 2]
    assert tile_rows.marked("prompt", (), 3) is None
    assert tile_rows.marked("all", (), 3).all_tiled and tile_rows.marked("all", [(1, 2)], 4).all_tiled
    assert tile_rows.marked("none", [(0, 4)], 4) is None and tile_rows.marked("none", (), 3) is None


@PROMPT_LOOP
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spans", [[(0, 20)], [(17, 19)], [(3, 5), (20, 16)]], ids=["first", "last", "between"])
def test_a_step_of_prompt_and_generated_rows_takes_the_gated_epilogue_run_by_run(prompt_kernels, dtype, spans):
    """gated_linear in a step of prompt and generated rows: the prompt rows' runs silu * up in the prompt loop's
    epilogue, the generated rows' product by the VNNI loop then the native silu * up: the bits of linear
    and then silu_and_mul over the whole step."""
    weight = NativeWeight.from_affine(_weight(2 * 48, 160, 4), prompt_kernels)
    x = torch.randn(36, 160).to(dtype)
    with tile_rows.prompt_token_rows(tile_rows.rows_of(spans, 36)):
        expected = native.silu_and_mul(weight.linear(x, None))
        fused = weight.gated_linear(x, None, "silu")
    assert fused is not None and fused.dtype == dtype and torch.equal(fused, expected)


def test_packed_linear_with_no_rows_and_bad_arguments(kernels):
    weight = NativeWeight.from_affine(_weight(16, 64, 4), kernels)
    assert weight.linear(torch.randn(0, 64), None).shape == (0, 16)
    with pytest.raises(CpuKernelError, match="core_packed_linear: bad arguments"):
        kernels.call("core_packed_linear", 0, 0, 1, 64, 0, 4, 32, 16, 64, 0, 0, 0, 0, 0, 0)
    codes = weight._buffers["codes"]
    with pytest.raises(CpuKernelError, match="core_packed_linear: bad arguments"):  # 16-input groups: 8-bit only
        x, y = torch.randn(1, 64), torch.empty(1, 16)
        kernels.call("core_packed_linear", x.data_ptr(), 0, 1, 64, codes.data_ptr(), 4, 16, 16, 64,
                     weight.scale.data_ptr(), weight.offset.data_ptr(), 0, None, y.data_ptr(), 0)


# ---------------------------------------------------------------- decode-step ops

@pytest.fixture
def ops(kernels, monkeypatch):
    monkeypatch.setattr(native, "kernels", lambda: kernels)
    return native


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_the_reference(ops, dtype, with_residual):
    x, residual = torch.randn(5, 96).to(dtype), torch.randn(5, 96).to(dtype)
    weight = (torch.rand(96) + 0.5).to(dtype)
    mine = ops.rms_norm(x, weight, 1e-5, residual if with_residual else None)
    oracle = reference.rms_norm(x, weight, 1e-5, residual if with_residual else None)
    for a, b in zip(mine if with_residual else [mine], oracle if with_residual else [oracle], strict=True):
        assert a.dtype == dtype
        # bf16: within one rounding step (the sum of squares is added up in another order than torch's,
        # whose order follows its thread count)
        torch.testing.assert_close(a, b, rtol=1e-6 if dtype == torch.float32 else 2**-7, atol=1e-6 if dtype == torch.float32 else 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_ungated_gelu_tanh_matches_torch(ops, dtype):
    """core_act (StarCoder 2's ungated MLP, from the modules' Activation and the decode stack): torch's tanh GELU
    within a few float32 ulps, and act_and_mul's values for an up of ones."""
    x = (torch.randn(7, 300) * 4).to(dtype)
    mine = ops.gelu_tanh(x)
    assert mine.dtype == dtype
    torch.testing.assert_close(mine, torch.nn.functional.gelu(x, approximate="tanh"),
                               rtol=1e-5 if dtype == torch.float32 else 2**-7, atol=1e-5)  # x << 0: ~1e-7 or 0
    assert torch.equal(mine, ops.gelu_tanh_and_mul(torch.cat([x, torch.ones_like(x)], dim=-1)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_ungated_relu2_is_torchs_bit_for_bit(ops, dtype):
    """core_act's relu^2 (Nemotron's, Arcee's and Jais 2's MLPs, from the modules' Activation and the decode stack):
    torch's square(relu(x)) bit for bit, negative zeros and a NaN included."""
    x = (torch.randn(7, 300) * 40).to(dtype)
    x[0, :3] = torch.tensor([-0.0, float("nan"), 0.0])
    mine = ops.relu2(x)
    assert mine.dtype == dtype
    assert torch.equal(mine.nan_to_num(7.0), torch.square(torch.relu(x)).nan_to_num(7.0)) and mine[0, 1].isnan()


@pytest.mark.parametrize("dtype", DTYPES)
def test_ungated_xielu_matches_torch(ops, dtype):
    """core_act's xIELU (Apertus's MLP, from the modules' XIELU and the decode stack) against XIELU's torch forward
    with random parameters: float32 within a few ulps of the operands (expm1f against torch's expm1; the sums cancel
    near 0), bfloat16 the same bits but where that ulp crosses a rounding (each operation rounded as torch's are)."""
    from core_pytorch_backend.layers.activation import XIELU

    torch.manual_seed(0)
    act = XIELU(beta=0.5, eps=-1e-6)
    act.alpha_p.data, act.alpha_n.data = torch.randn(1), torch.randn(1)
    act = act.to(dtype)
    x = (torch.randn(7, 300) * 4).to(dtype)
    mine, oracle = ops.xielu(x, act.params()), act(x)
    assert mine.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(mine, oracle, rtol=1e-6, atol=1e-6)
    else:
        assert (mine != oracle).float().mean() < 0.01
        torch.testing.assert_close(mine, oracle, rtol=2**-7, atol=2**-7)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("with_bias", [False, True])
def test_layer_norm_matches_the_reference(ops, dtype, with_residual, with_bias):
    """core_layer_norm (StableLM's norms, from the modules' LayerNorm and the decode stack): torch's layer_norm of
    x + residual, rows off the mean of 3 so that a variance taken about 0 would show."""
    x, residual = (torch.randn(5, 96) + 3).to(dtype), torch.randn(5, 96).to(dtype)
    weight, bias = (torch.rand(96) + 0.5).to(dtype), torch.randn(96).to(dtype) if with_bias else None
    mine = ops.layer_norm(x, weight, bias, 1e-5, residual if with_residual else None)
    oracle = reference.layer_norm(x, weight, bias, 1e-5, residual if with_residual else None)
    for a, b in zip(mine if with_residual else [mine], oracle if with_residual else [oracle], strict=True):
        assert a.dtype == dtype
        torch.testing.assert_close(a, b, rtol=1e-5 if dtype == torch.float32 else 2**-7,
                                   atol=1e-5 if dtype == torch.float32 else 2**-7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_the_reference(ops, dtype):
    x = (torch.randn(7, 2 * 80) * 4).to(dtype)
    tol = {"rtol": 1e-6, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 0.008, "atol": 1e-3}
    torch.testing.assert_close(ops.silu_and_mul(x), reference.silu_and_mul(x), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul_matches_the_reference(ops, dtype):
    """Gemma's MLP. float32: within a few ulps of the exact function (float64) for gates above -3, where torch's
    own form, 1 + tanh(z) for tanh near -1, loses digits to cancellation that the kernel's x / (1 + e^(-2z)) keeps;
    bfloat16: within one rounding step of torch's."""
    x = (torch.randn(7, 2 * 80, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    mine = ops.gelu_tanh_and_mul(x)
    if dtype == torch.float32:
        gate, up = x.double().chunk(2, dim=-1)
        exact = torch.nn.functional.gelu(gate, approximate="tanh") * up
        kept = gate > -3
        torch.testing.assert_close(mine.double()[kept], exact[kept], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(mine, reference.gelu_tanh_and_mul(x), rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(mine, reference.gelu_tanh_and_mul(x), rtol=0.008, atol=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemmas_float_norm_is_its_modules_bit_for_bit(ops, dtype, with_residual):
    """core_rms_norm_float (the decode stack's Gemma norm) gives GemmaRMSNorm's bits: x (+ residual, rounded),
    upcast, normalised times the float32 1 + w, rounded once."""
    from core_pytorch_backend.models.gemma3 import GemmaRMSNorm

    generator = torch.Generator().manual_seed(5)
    x, residual = (torch.randn(6, 96, generator=generator).to(dtype) for _ in range(2))
    norm = GemmaRMSNorm(96, 1e-6, ops)  # the module over the same variant's kernels
    norm.weight.copy_(torch.randn(96, generator=generator) * 0.3)
    expected = norm(x, residual) if with_residual else (norm(x), None)
    weight = (1.0 + norm.weight.float()).contiguous()
    out, summed = torch.empty_like(x), torch.empty_like(x)
    code = native.DTYPE_CODES[dtype]
    ops.kernels().call("core_rms_norm_float", x.data_ptr(), code, 6, 96, residual.data_ptr() if with_residual else None,
                 weight.data_ptr(), 1e-6, out.data_ptr(), summed.data_ptr() if with_residual else None)
    assert torch.equal(out, expected[0])
    if with_residual:
        assert torch.equal(summed, expected[1])


def _argmax_cases() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    ties = torch.randn(6, 4097, generator=generator)
    ties[:, [9, 300, 4096]] = ties.max() + 1  # equal largest values: the first one wins
    special = torch.randn(7, 100, generator=generator)
    special[0] = float("-inf")  # every token masked: index 0, as torch
    special[1, 50] = float("inf")
    special[2, 70] = special[2, 3] = float("nan")  # a NaN counts as larger than any number: the first NaN
    special[3] = float("nan")
    special[4, :] = -1.0  # all equal
    special[5, 99] = 1e30
    special[6, 0] = float("nan")
    return {"vocabulary rows": torch.randn(33, 49152, generator=generator) * 5, "ties": ties,
            "masked, infinite and NaN rows": special, "one token": torch.randn(5, 1, generator=generator),
            "short rows": torch.randn(3, 7, generator=generator)}


ARGMAX_CASES = _argmax_cases()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ARGMAX_CASES)
def test_argmax_rows_follows_torch(ops, dtype, case):
    logits = ARGMAX_CASES[case].to(dtype)  # bf16 rounding makes more ties: still the first one
    assert torch.equal(ops.argmax_rows(logits), logits.argmax(dim=-1))
    assert torch.equal(ops.argmax_rows(logits.T.contiguous().T), logits.argmax(dim=-1))  # strided rows


def test_argmax_rows_leaves_other_inputs_to_torch(ops):
    assert torch.equal(ops.argmax_rows(torch.tensor([[1.0, 3.0]], dtype=torch.float16)), torch.tensor([1]))
    assert ops.argmax_rows(torch.randn(0, 10)).shape == (0,)
    with pytest.raises(CpuKernelError, match="core_argmax_rows: bad arguments"):
        ops.kernels().call("core_argmax_rows", 0, 0, 1, 0, 0)


def test_only_the_native_set_brings_its_argmax():
    from core_pytorch_backend.kernels import select_ops

    assert select_ops("cpu", kind="native").argmax_rows is native.argmax_rows
    assert not hasattr(select_ops("cpu", kind="reference"), "argmax_rows")  # the sampler takes torch's


def test_greedy_sampling_takes_the_op_sets_argmax(ops):
    from core_pytorch_backend.sampling import SamplingBatch, SamplingParams, SamplingRow, sample

    logits = ARGMAX_CASES["vocabulary rows"][:4]
    rows = [SamplingRow(SamplingParams(temperature=0.0))] * 4
    calls = []

    def counted(x):
        calls.append(x.shape)
        return ops.argmax_rows(x)

    chosen = sample(logits, SamplingBatch.from_rows(rows, device=logits.device), argmax=counted)
    assert calls == [(4, 49152)] and chosen.token_ids == logits.argmax(dim=-1).tolist()


ATTENTION_CASES = {
    "one decode row": ([100], [1]),
    "decode rows of many lengths": ([5, 40, 0, 77], [1, 1, 1, 1]),
    "decode rows mixed with a chunk": ([5, 30, 60], [1, 7, 1]),
    "prefill only": ([0], [20]),
    "contexts of several partitions": ([300, 129, 700], [1, 1, 1]),  # csrc PARTITION = 64 positions
    "contexts off the 16-position tiles": ([37, 64, 15, 80], [1, 1, 1, 1]),  # csrc partial_simd's score tiles
    "chunks over cached prefixes": ([100, 0, 33, 7], [40, 70, 2, 1]),  # csrc/chunk_attention.c: key tiles
    "a long chunk": ([0], [150]),  # of 16, query tiles of 64 / G rows
}


# (query dtype, cache dtype): a model's own, a float32 model over a bfloat16 cache (the default GGUF), and
# either over an int8 cache (--kv-cache-dtype int8: kernels/kv_int8.py)
ATTENTION_DTYPES = {"float32": (torch.float32, torch.float32), "bfloat16": (torch.bfloat16, torch.bfloat16),
                    "float32 over bfloat16": (torch.float32, torch.bfloat16),
                    "float32 over int8": (torch.float32, kv_int8.DTYPE),
                    "bfloat16 over int8": (torch.bfloat16, kv_int8.DTYPE)}


def random_cache(num_blocks: int, block_size: int, hkv: int, d: int, cache_dtype: torch.dtype,
                 generator: torch.Generator) -> torch.Tensor:
    values = torch.randn(num_blocks, block_size, hkv, d, generator=generator)
    return kv_int8.quantize(values) if kv_int8.is_int8(cache_dtype) else values.to(cache_dtype)


def attention_case(case: str, heads: tuple[int, int, int], dtypes: str):
    """(query, k cache, v cache, meta) of ATTENTION_CASES[case], the caches' blocks out of order."""
    hq, hkv, d = heads
    dtype, cache_dtype = ATTENTION_DTYPES[dtypes]
    block_size, num_blocks = 16, 128
    generator = torch.Generator().manual_seed(0)
    k_cache = random_cache(num_blocks, block_size, hkv, d, cache_dtype, generator)
    v_cache = random_cache(num_blocks, block_size, hkv, d, cache_dtype, generator)
    computed, new = ATTENTION_CASES[case]
    order = list(range(num_blocks))
    random.Random(1).shuffle(order)  # blocks out of order, as a prefix-cached pool hands them out
    tables, used = [], 0
    for c, n in zip(computed, new, strict=True):
        count = -(-(c + n) // block_size)
        tables.append(order[used : used + count])
        used += count
    meta = AttentionMetadata.build(computed, new, tables, block_size)
    query = torch.randn(sum(new), hq, d, generator=generator).to(dtype)
    return query, k_cache, v_cache, meta


def attention_tolerance(dtypes: str, d: int) -> dict[str, float]:
    """How close the native attention comes to the reference's for these dtypes and head width."""
    dtype, cache_dtype = ATTENTION_DTYPES[dtypes]
    # the avx512-bf16 and amx-bf16 variants multiply a bfloat16 cache in bfloat16 (heads of 64 or 128; decode rows in
    # csrc partial_bf16, the query and the softmax weights rounded to bfloat16; prefill chunks in chunk_attention.c's
    # run_task_bf16, the weights rounded): a float32 query over it is held to bf16's bar
    # (an int8 cache's prefill chunks too: its codes by the query in bfloat16 dot products, the weights rounded)
    bf16_math = cache_dtype in (torch.bfloat16, kv_int8.DTYPE) and native.kernels().variant in ("avx512-bf16", "amx-bf16") \
        and d in (64, 128)
    # the AVX512-VNNI variants score an int8 cache's decode rows against the query in two int8 steps and weigh its
    # values in int16 (csrc partial_kv8: ~15 bits of each)
    query_steps = kv_int8.is_int8(cache_dtype) and native.kernels().variant in ("avx512-vnni", "avx512-bf16", "amx-bf16") \
        and d in (64, 128)
    exact = dtype == torch.float32 and not bf16_math
    return {"rtol": 2e-4, "atol": 2e-4} if exact and query_steps else {"rtol": 1e-5, "atol": 1e-5} if exact else \
        {"rtol": 0.016, "atol": 0.016}


@pytest.mark.parametrize("dtypes", ATTENTION_DTYPES)
@pytest.mark.parametrize("window", [None, 10])
@pytest.mark.parametrize("case", ATTENTION_CASES)
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 32), (8, 1, 128)])  # (Hq, Hkv, D): grouped and plain
def test_paged_attention_matches_the_reference(ops, dtypes, window, case, heads):
    query, k_cache, v_cache, meta = attention_case(case, heads, dtypes)
    scale = heads[2] ** -0.5
    mine = ops.paged_attention(query, k_cache, v_cache, meta, scale, window)
    meta.op_cache.clear()
    oracle = reference.paged_attention(query, k_cache, v_cache, meta, scale, window)
    torch.testing.assert_close(mine, oracle, **attention_tolerance(dtypes, heads[2]))


@pytest.mark.parametrize("dtypes", ATTENTION_DTYPES)
@pytest.mark.parametrize("case", ["decode rows mixed with a chunk", "contexts of several partitions"])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 4, 32)])  # each variant's loops of 64 and the plain C's
def test_softcapped_attention_matches_the_reference(ops, dtypes, case, heads):
    """Gemma 2's soft-capped scores (cap * tanh(score / cap)): decode rows capped in every variant of
    core_decode_attention's loop (csrc cpu_ops.c cap_scores), chunks through the reference. A cap of 2 bends
    these scores (about N(0, 1)) well away from the uncapped attention's."""
    query, k_cache, v_cache, meta = attention_case(case, heads, dtypes)
    scale, window = heads[2] ** -0.5, 40
    mine = ops.softcapped_attention(query, k_cache, v_cache, meta, scale, window, 2.0)
    meta.op_cache.clear()
    oracle = reference.paged_attention(query, k_cache, v_cache, meta, scale, window, 2.0)
    torch.testing.assert_close(mine, oracle, **attention_tolerance(dtypes, heads[2]))
    meta.op_cache.clear()
    uncapped = reference.paged_attention(query, k_cache, v_cache, meta, scale, window)
    assert (mine.float() - uncapped.float()).abs().max() > 0.05


@pytest.mark.parametrize("dtypes", ATTENTION_DTYPES)
@pytest.mark.parametrize("window", [None, 40])
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 1, 128)])
def test_a_prompt_rows_attention_does_not_depend_on_its_chunk(ops, dtypes, window, heads):
    """A prompt's rows get the same bits whether its prefill runs in one chunk, in chunks over its cached
    prefix, or beside other sequences (csrc/chunk_attention.c: key tiles at absolute positions, a row's
    sums independent of the rows it shares a task or a tile with): greedy output must not depend on
    prefix caching, the chunk size or batch neighbours; a prompt token alone in its chunk (its prefix
    cached) is attended as a chunk, not as a decode row (AttentionMetadata.decode_sequences)."""
    hq, hkv, d = heads
    dtype, cache_dtype = ATTENTION_DTYPES[dtypes]
    block_size, length = 16, 300
    generator = torch.Generator().manual_seed(3)
    k_cache = random_cache(40, block_size, hkv, d, cache_dtype, generator)
    v_cache = random_cache(40, block_size, hkv, d, cache_dtype, generator)
    query = torch.randn(length, hq, d, generator=generator).to(dtype)
    table = list(range(39, 39 - -(-length // block_size), -1))  # blocks out of order

    def attend(splits: list[int], neighbour: bool) -> torch.Tensor:
        rows = []
        for begin, end in zip([0, *splits], [*splits, length], strict=True):
            computed, new, tables, queries = [begin], [end - begin], [table], [query[begin:end]]
            if neighbour:  # another sequence's chunk first, over the same blocks (its rows are discarded)
                computed, new, tables = [7, *computed], [33, *new], [table[:3], *tables]
                queries.insert(0, torch.randn(33, hq, d, generator=generator).to(dtype))
            meta = AttentionMetadata.build(computed, new, tables, block_size, prompt_lens=[length] * len(new))
            out = ops.paged_attention(torch.cat(queries), k_cache, v_cache, meta, d**-0.5, window)
            rows.append(out[-(end - begin):])
        return torch.cat(rows)

    whole = attend([], False)
    for splits, neighbour in [([1], False), ([100, 117, 250], False), ([64], True), ([], True), ([298], False),
                              ([length - 1], False), ([length - 1], True), ([150, 151], False)]:
        assert torch.equal(attend(splits, neighbour), whole), (splits, neighbour)


def test_the_cpu_gets_the_native_op_set():
    assert select_ops("cpu").name == "native"
    assert select_ops("cpu", kind="reference").name == "reference"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("fused_view", [False, True])
@pytest.mark.parametrize("table_dtype", DTYPES)  # a model cast to bf16 casts its tables too
def test_rotary_matches_the_reference(ops, dtype, fused_view, table_dtype):
    tokens, hq, hkv, d = 5, 9, 3, 64
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d).to(dtype)
    if fused_view:  # q and k as the model has them: views into the fused projection's rows
        query, key = qkv[:, : hq * d].view(tokens, hq, d), qkv[:, hq * d : (hq + hkv) * d].view(tokens, hkv, d)
    else:
        query, key = torch.randn(tokens, hq, d).to(dtype), torch.randn(tokens, hkv, d).to(dtype)
    freqs = torch.outer(torch.arange(100).float(), 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d)))
    positions = torch.tensor([0, 7, 31, 99, 3])
    cos, sin = freqs.cos().to(table_dtype), freqs.sin().to(table_dtype)
    mine = ops.apply_rotary(query, key, positions, cos, sin)
    oracle = reference.apply_rotary(query, key, positions, cos, sin)
    for a, b in zip(mine, oracle, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6 if dtype == torch.float32 else 0, atol=1e-6 if dtype == torch.float32 else 0)


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.float32, torch.bfloat16), (torch.float32, kv_int8.DTYPE),
                                    (torch.bfloat16, kv_int8.DTYPE)])
def test_store_kv_cache_matches_the_reference(ops, dtypes):
    """Bit for bit: an int8 cache's codes, scales and minimums too."""
    value_dtype, cache_dtype = dtypes
    kv = torch.randn(4, 2 * 3 * 16).to(value_dtype)
    kv[2, :16] = 0.25  # a row of equal values: scale 0, every code 0
    key, value = kv[:, :48].view(4, 3, 16), kv[:, 48:].view(4, 3, 16)  # views, as the model's
    slots = torch.tensor([5, -1, 0, 37])  # -1: a padded row, skipped
    caches = [torch.zeros(3, 16, 3, kv_int8.row_width(16, cache_dtype), dtype=cache_dtype) for _ in range(4)]
    ops.store_kv_cache(key, value, caches[0], caches[1], slots)
    reference.store_kv_cache(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(CpuKernelError):
        ops.store_kv_cache(key, value, caches[0], caches[1], torch.tensor([0, 1, 2, 48]))  # past the cache

