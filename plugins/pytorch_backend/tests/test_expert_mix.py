"""A sparse MoE block in one native call (native/expert_mix.py, csrc/moe_mix.c).

The experts' oracle is models.sparse_moe.mix_experts over the same packed weights: equal bit for bit in a step
without prompt rows; with prompt rows, each token's rows on the loop its own row takes (the prompt loop for a prompt
token's), which the oracle here spells out expert by expert. The whole block's (routing in C too) is the block's
torch routing and shared expert: the same experts chosen, the weights and outputs within float rounding.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from core_pytorch_backend.kernels import native, select_ops
from core_pytorch_backend.loader import load_checkpoint
from core_pytorch_backend.models.sparse_moe import SparseMoeBlock, mix_experts
from core_pytorch_backend.native import tile_rows
from core_pytorch_backend.native.expert_mix import ExpertMix
from core_pytorch_backend.native.library import available
from core_pytorch_backend.quant.kernel_choice import PackedKernel
from core_pytorch_backend.testing import torch_threads

pytestmark = pytest.mark.skipif(available() is None, reason="the native kernels do not build here")
ARCHS = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "granitemoe", "granitemoeshared"]
# shared experts 64 wide, whose down projection int4's groups of 32 pack (the tiny configs' 48 stay float: F.linear)
PACKED_SHARED = {"qwen2_moe": dict(shared_expert_intermediate_size=64), "granitemoeshared": dict(shared_intermediate_size=64)}


@pytest.fixture
def native_packed(monkeypatch):
    """Weights quantized at load go to the native kernels, whatever this CPU measures fastest."""
    monkeypatch.setattr("core_pytorch_backend.loader.packed_kernel", lambda: PackedKernel(available(), torch.float32))


def _blocks(path, quantization: str, dtype: str) -> list[SparseMoeBlock]:
    model = load_checkpoint(path, dtype=dtype, quantization=quantization, ops=select_ops("cpu", kind="native")).model
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


def _inputs(block: SparseMoeBlock, tokens: int, dtype: torch.dtype, seed: int):
    hidden = torch.randn(tokens, block.gate.weight.shape[1], generator=torch.Generator().manual_seed(seed)).to(dtype)
    weights, chosen = block.routing(hidden)
    return hidden, weights, chosen


def _native_mix(block: SparseMoeBlock, hidden, weights, chosen) -> torch.Tensor | None:
    """The block's experts mixed in the native call (ExpertMix.mix), or None where it has none."""
    kernel = block.native_kernel(hidden.device)
    return None if kernel is None else kernel.mix(hidden, weights, chosen)


def _expert_by_expert(block: SparseMoeBlock, hidden, weights, chosen, tiled: torch.Tensor) -> torch.Tensor:
    """mix_experts with each token's rows on its own loop (`tiled` [T] bool)."""
    out = torch.zeros_like(hidden)
    for expert in torch.unique(chosen).tolist():
        tokens, slot = torch.where(chosen == expert)
        mlp = block.experts[expert]
        for on_tiles in (False, True):
            pick = tiled[tokens] == on_tiles
            if not pick.any():
                continue
            rows, slots = tokens[pick], slot[pick]
            product = mlp.gate_up_proj.weight.linear(hidden[rows], None, tiles=on_tiles)
            y = mlp.down_proj.weight.linear(native.silu_and_mul(product), None, tiles=on_tiles)
            out.index_add_(0, rows, y * weights[rows, slots, None])
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("arch", ARCHS)
def test_the_experts_in_one_call_are_mix_experts_bit_for_bit(tiny_checkpoint_factory, native_packed, arch,
                                                              quantization, dtype):
    blocks = _blocks(tiny_checkpoint_factory(arch), quantization, dtype)
    assert blocks and all(ExpertMix.of(b.experts) is not None for b in blocks)
    for tokens in (1, 3, 17):
        for index, block in enumerate(blocks):
            hidden, weights, chosen = _inputs(block, tokens, blocks[0].gate.weight.dtype, seed=tokens + index)
            mixed = _native_mix(block, hidden, weights, chosen)
            assert torch.equal(mixed, mix_experts(block.experts, hidden, weights, chosen)), (tokens, index)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ARCHS)
def test_the_whole_block_in_one_call_routes_as_torch_and_mixes_what_it_chose(tiny_checkpoint_factory, native_packed,
                                                                             arch, dtype):
    """Routing in C (softmax, top_k, renormalized; Granite's softmax of the top_k logits) chooses the experts torch
    chooses, with its weights to float rounding; the block's output is the native mix of that choice (bit for bit)
    plus the shared expert (Qwen2-MoE's behind its sigmoid gate, Granite MoE Shared's ungated), and the forward
    takes it, within rounding of the modules' torch routing and shared expert."""
    blocks = _blocks(tiny_checkpoint_factory(arch, **PACKED_SHARED.get(arch, {})), "int4", dtype)
    kernels = [b.native_kernel(torch.device("cpu")) for b in blocks]
    assert blocks and all(k is not None and k.moe is not None for k in kernels)
    loose = dict(rtol=2e-2, atol=2e-2) if dtype == "bfloat16" else dict(rtol=1e-4, atol=1e-5)
    for tokens in (1, 3, 17, 40):
        for index, (block, kernel) in enumerate(zip(blocks, kernels, strict=True)):
            hidden, weights, chosen = _inputs(block, tokens, block.gate.weight.dtype, seed=tokens + index)
            hidden = hidden[_untied(block, hidden)]  # a tie at the k-th logit: torch.topk's pick is its own
            weights, chosen = block.routing(hidden)
            c_weights, c_chosen = kernel.route(hidden)
            experts = len(block.experts)
            torch.testing.assert_close(_dense(c_weights, c_chosen, experts), _dense(weights, chosen, experts), **loose)
            assert torch.equal(_dense(c_weights, c_chosen, experts) > 0, _dense(weights, chosen, experts) > 0)
            whole = kernel.block(hidden)
            if block.shared_expert is None:
                assert torch.equal(whole, kernel.mix(hidden, c_weights, c_chosen)), (tokens, index)
            _assert_forward_takes_it(block, hidden, whole, loose)


def _untied(block: SparseMoeBlock, hidden: torch.Tensor) -> torch.Tensor:
    """The tokens whose k-th and (k + 1)-th largest router logits differ (bfloat16 logits often tie)."""
    logits = torch.nn.functional.linear(hidden, block.gate.weight, block.gate.bias).float()
    if block.top_k == logits.shape[1]:
        return torch.ones(hidden.shape[0], dtype=torch.bool)
    best = logits.topk(block.top_k + 1, dim=-1).values
    return best[:, -2] != best[:, -1]


def _dense(weights: torch.Tensor, chosen: torch.Tensor, experts: int) -> torch.Tensor:
    """Each token's weight for every expert [T, experts] (0: not chosen), whatever the order of its choices."""
    return torch.zeros(chosen.shape[0], experts).scatter(1, chosen, weights.float())


def _assert_forward_takes_it(block: SparseMoeBlock, hidden: torch.Tensor, whole: torch.Tensor, loose: dict) -> None:
    """The block's forward is the one native call (its result, counted), and within rounding of the modules' torch
    routing, mix_experts and shared expert."""
    ids, kernel = block._native
    calls = []
    block._native = (ids, _Counting(kernel, calls))
    through_native = block(hidden)
    block._native = (ids, None)  # described as not fitting: torch and mix_experts
    through_python = block(hidden)
    block._native = (ids, kernel)
    assert len(calls) == 1 and torch.equal(through_native, whole)
    torch.testing.assert_close(through_native, through_python, **loose)


class _Counting:
    def __init__(self, kernel: ExpertMix, calls: list) -> None:
        self.kernel, self.calls = kernel, calls

    def block(self, hidden: torch.Tensor) -> torch.Tensor | None:
        self.calls.append(hidden)
        return self.kernel.block(hidden)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_experts_shared_among_threads_give_the_bits_of_one_thread(tiny_checkpoint_factory, native_packed, arch, dtype):
    """With two experts' rows a thread or more, each thread runs whole experts and the sums follow in expert order:
    the bits one thread gives, prompt rows on the prompt loop included."""
    block = _blocks(tiny_checkpoint_factory(arch, **PACKED_SHARED.get(arch, {})), "int4", dtype)[0]
    kernel = block.native_kernel(torch.device("cpu"))
    for tokens in (1, 9, 40):
        hidden, weights, chosen = _inputs(block, tokens, block.gate.weight.dtype, seed=tokens)
        rows = tile_rows.rows_of([(0, tokens // 2)], tokens) if tokens > 1 else None
        with contextlib.ExitStack() as marks:
            if rows is not None and kernel.prompt_loop:
                marks.enter_context(tile_rows.prompt_token_rows(rows))
            with torch_threads(1):
                alone = kernel.block(hidden), kernel.mix(hidden, weights, chosen)
            with torch_threads(2):
                shared = kernel.block(hidden), kernel.mix(hidden, weights, chosen)
        assert all(torch.equal(a, b) for a, b in zip(alone, shared, strict=True)), tokens


@pytest.mark.skipif(available() is None or available().prompt_loop is None, reason="no prompt loop on this CPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("spans", [[(0, 9)], [(2, 4)], [(0, 3), (6, 3)]])
def test_a_prompt_tokens_rows_take_the_prompt_loop_in_every_expert(tiny_checkpoint_factory, native_packed, spans,
                                                                   dtype):
    """Whatever else the step holds, in the native call and in mix_experts alike: an expert's rows took the step's
    marks only when every token chose it (its gathered rows were then the step's), so a prompt row's loop
    followed its neighbours' choices."""
    block = _blocks(tiny_checkpoint_factory("qwen3_moe"), "int4", dtype)[0]
    hidden, weights, chosen = _inputs(block, 9, block.gate.weight.dtype, seed=3)
    rows = tile_rows.rows_of(spans, 9)
    tiled = torch.zeros(9, dtype=torch.bool)
    for first, count in spans:
        tiled[first:first + count] = True
    with tile_rows.prompt_token_rows(rows):
        mixed = _native_mix(block, hidden, weights, chosen)
        in_python = mix_experts(block.experts, hidden, weights, chosen)  # its experts' rows marked (tile_rows.gathered)
    assert torch.equal(mixed, _expert_by_expert(block, hidden, weights, chosen, tiled))
    assert torch.equal(in_python, mixed)
    assert not torch.equal(mixed, _expert_by_expert(block, hidden, weights, chosen, torch.zeros_like(tiled)))


def test_experts_it_does_not_take_are_left_to_mix_experts_and_foreign_marks_apply_to_none(tiny_checkpoint_factory, native_packed):
    path = tiny_checkpoint_factory("qwen3_moe")
    dense = _blocks(path, "none", "float32")[0]  # float weights: F.linear
    assert ExpertMix.of(dense.experts) is None
    hidden, weights, chosen = _inputs(dense, 4, torch.float32, seed=1)
    assert _native_mix(dense, hidden, weights, chosen) is None
    packed = _blocks(path, "int8", "float32")[0]
    handle = packed.experts[1].down_proj.register_forward_hook(lambda *a: None)
    assert ExpertMix.of(packed.experts) is None  # a hook (a LoRA or tensor-parallel one) needs the modules
    handle.remove()
    mix = ExpertMix.of(packed.experts)
    unmarked = mix.mix(hidden, weights, chosen)
    with tile_rows.prompt_token_rows(tile_rows.rows_of([(0, 2)], 7)):  # marks of another row count: none apply
        assert torch.equal(mix.mix(hidden, weights, chosen), unmarked)
        assert torch.equal(mix_experts(packed.experts, hidden, weights, chosen), unmarked)


def test_a_bad_expert_index_is_refused_by_name(tiny_checkpoint_factory, native_packed):
    block = _blocks(tiny_checkpoint_factory("qwen3_moe"), "int8", "float32")[0]
    hidden, weights, chosen = _inputs(block, 2, torch.float32, seed=2)
    chosen[1, 0] = len(block.experts)
    with pytest.raises(RuntimeError, match="core_moe_mix: bad arguments"):
        _native_mix(block, hidden, weights, chosen)


def test_a_token_that_picks_an_expert_twice_is_added_twice_as_mix_experts_adds_it(tiny_checkpoint_factory,
                                                                                    native_packed):
    """No top-k router does it, but a custom one may: every (token, slot) pair counts, and an expert may then have
    more rows than the step has tokens."""
    block = _blocks(tiny_checkpoint_factory("qwen3_moe"), "int8", "float32")[0]
    hidden, weights, chosen = _inputs(block, 3, torch.float32, seed=4)
    chosen[:] = 1
    assert torch.equal(_native_mix(block, hidden, weights, chosen), mix_experts(block.experts, hidden, weights, chosen))
