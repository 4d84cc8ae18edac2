"""The native decode stack (native_decode.py, csrc/decoder_stack.c): a decode step's layers in one call.

Its oracle is the model's own modules on the native op set: the hidden states must be equal bit for bit
(the same kernels on the same buffers), for every decoder it takes (Llama, Qwen2's q/k/v bias, Qwen3's
q/k norms, Mistral's sliding window past its width, SmolLM3's layers without rotary), int8 and int4 weights,
float32 and bfloat16.
"""

from __future__ import annotations

import asyncio
import logging

import pytest
import torch

from core.scheduling.scheduler import ScheduledSequence
from core.scheduling.sequence import Sequence
from core_pytorch_backend import native_decode
from core_pytorch_backend.attention_metadata import AttentionMetadata
from core_pytorch_backend.kernels import kv_int8, select_ops
from core_pytorch_backend.loader import load_checkpoint
from core_pytorch_backend.model_runner import ModelRunner, StepInputs
from core_pytorch_backend.native import tile_rows
from core_pytorch_backend.native.library import available
from core_pytorch_backend.native_decode import DoesNotFit, NativeDecodeStack, describe, make_native_decode
from core_pytorch_backend.quant.kernel_choice import PackedKernel
from core_pytorch_backend.testing import torch_threads

pytestmark = pytest.mark.skipif(available() is None, reason="the native kernels do not build here")
CPU = torch.device("cpu")
BLOCK = 4
TABLES = [[7, 3, 12, 20, 21, 22, 23, 24, 25, 26], [0, 9, 4, 30, 31, 32, 33, 34, 35, 36],
          [5, 1, 14, 40, 41, 42, 43, 44, 45, 46]]
PROMPT_LENS = [5, 17, 26]  # Mistral's tiny window is 12: the longer ones attend to a window
# shared experts 64 wide, whose down projection int4's groups of 32 pack (the tiny configs' 48 stay float: F.linear)
PACKED_SHARED = {"qwen2_moe": dict(shared_expert_intermediate_size=64), "granitemoeshared": dict(shared_intermediate_size=64)}


@pytest.fixture
def native_packed(monkeypatch):
    """Weights quantized at load go to the native kernels, whatever this CPU measures fastest."""
    monkeypatch.setattr("core_pytorch_backend.loader.packed_kernel", lambda: PackedKernel(available(), torch.float32))


def _load(path, quantization: str, dtype: str = "float32", kind: str = "native"):
    return load_checkpoint(path, dtype=dtype, quantization=quantization, ops=select_ops("cpu", kind=kind)).model


def _runner(model, num_blocks: int = 64, kv_cache_dtype: torch.dtype | None = None) -> ModelRunner:
    return ModelRunner(model, block_size=BLOCK, num_blocks=num_blocks, device=CPU,
                       dtype=next(model.parameters()).dtype, kv_cache_dtype=kv_cache_dtype,
                       decode_path=lambda m: make_native_decode(m, device=CPU, enabled=True))


def _step(lengths: list[int], new: list[int], seed: int, tables: list[list[int]] = TABLES) -> StepInputs:
    meta = AttentionMetadata.build(lengths, new, tables[: len(lengths)], BLOCK)
    ids = torch.randint(0, 250, (sum(new),), generator=torch.Generator().manual_seed(seed))
    return StepInputs(input_ids=ids, positions=meta.positions(), meta=meta, sample_indices=meta.last_token_indices(),
                      sampling=[None] * len(lengths))


def _decode_both_ways(runner: ModelRunner, steps: int = 12) -> None:
    """Prefill three sequences through the modules, then decode: the stack's hidden states equal the
    modules' every step (each pass writes the same K/V into the same slots)."""
    model, stack = runner.model, runner.decode_path
    runner.zero_blocks(range(50))
    with torch.inference_mode():
        prefill = _step([0, 0, 0], PROMPT_LENS, seed=0)
        assert stack.run(model, prefill) is None  # a prefill step takes the modules
        model(prefill.input_ids, prefill.positions, prefill.meta)
        lengths = list(PROMPT_LENS)
        for i in range(steps):
            decode = _step(lengths, [1, 1, 1], seed=i + 1)
            through_stack = stack.run(model, decode)
            through_modules = model(decode.input_ids, decode.positions, decode.meta)
            assert through_stack is not None
            assert torch.equal(through_stack, through_modules), f"step {i}"
            lengths = [n + 1 for n in lengths]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "smollm3", "phi3", "phi3-partial-rotary",
                                  "granite", "olmo2", "olmo3", "exaone4", "glm4", "gemma", "gemma3_text", "gemma2", "vaultgemma",
                                  "stablelm", "stablelm-parallel", "starcoder2", "phi", "cohere", "cohere2", "arcee", "jais2", "nemotron", "ministral3", "apertus", "nanochat", "qwen3_moe", "qwen2_moe", "mixtral", "granitemoe",
                                  "granitemoeshared", "olmoe"])
def test_the_stack_gives_the_modules_hidden_states_bit_for_bit(tiny_checkpoint_factory, native_packed, arch,
                                                                 quantization, dtype):
    """Granite's multipliers, OLMo 2 / 3's and EXAONE 4's post-norm layers (OLMo's q / k norms over all heads),
    GLM-4's RMSNorm sandwich (and GLM's pairwise partial rotary), StableLM's LayerNorms with biases
    (core_layer_norm, from the modules' LayerNorm and from the stack), its parallel residual (the MLP on the
    attention's input norm) and partial rotary, StarCoder 2's LayerNorms and ungated GELU-tanh MLP with biases
    (core_act, which the modules' Activation calls too), Phi's (one LayerNorm, attn + mlp summed beside the residual,
    the output projection named dense), Cohere's (one float32 LayerNorm without bias, StableLM's parallel residual;
    Cohere 2's global layers without rotary), the ungated relu^2 MLPs of Arcee, Jais 2 (LayerNorms with biases) and
    Nemotron (LayerNorm1P's 1 + w, partial rotary), Apertus's xIELU of per-layer parameters, Ministral 3's q scaled by
    a factor of its position after rotary (its tiny original context of 16 makes it bite), NanoChat's weightless
    norms and q/k norms after rotary, VaultGemma's (Gemma 2's model over Gemma 1's layers) and Gemma's decoders too: float32 norms of 1 + w
    (core_rms_norm_float), GELU-tanh * up, Gemma 2 and 3's norms of the attention's and the MLP's outputs, Gemma 2's
    soft-capped scores (the native op set's decode attention caps them as the stack's does), Gemma 3's sliding layers
    with their own rotary table. The sparse MoE models' blocks (a dense layer among them in Qwen3-MoE's, Qwen2-MoE's
    gated and Granite MoE Shared's ungated shared experts, OLMoE's experts without renormalization after its q, k
    and v clamped by clip_qkv) run routing and experts in moe_mix.c's one call, from the modules and from the stack
    alike."""
    overrides = PACKED_SHARED.get(arch, {})
    if arch == "stablelm-parallel":  # use_parallel_residual: h + attn(norm(h)) + mlp(norm(h))
        arch, overrides = "stablelm", dict(use_parallel_residual=True)
    if arch == "phi3-partial-rotary":  # Phi-4-mini's: rotary on the first three quarters of each head
        arch, overrides = "phi3", dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                        "partial_rotary_factor": 0.75})
    runner = _runner(_load(tiny_checkpoint_factory(arch, **overrides), quantization, dtype))
    assert isinstance(runner.decode_path, NativeDecodeStack)
    # row groups would read each expert once a group: an MoE model's steps go through in one call
    assert (runner.decode_path.plan.group_rows == 0) == ("moe" in arch or arch == "mixtral")
    _decode_both_ways(runner)


@pytest.mark.parametrize("group_rows", [0, 1])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_stack_over_an_int8_kv_cache_gives_the_modules_bits(tiny_checkpoint_factory, native_packed, monkeypatch,
                                                                  dtype, group_rows):
    """--kv-cache-dtype int8: the stack stores and attends over the cache's 8-bit rows (kernels/kv_int8.py) as the
    modules' native ops do, in the kernels' splits and in row groups."""
    monkeypatch.setattr("core_pytorch_backend.native_decode.GROUP_ROWS", max(group_rows, 1))
    monkeypatch.setattr("core_pytorch_backend.native_decode.EXACT_TILES_GROUP_ROWS", 0)
    monkeypatch.setattr("core_pytorch_backend.native_decode.row_group_from", lambda _: 2 if group_rows else 10**6)
    runner = _runner(_load(tiny_checkpoint_factory("llama"), "int4", dtype), kv_cache_dtype=kv_int8.DTYPE)
    assert runner.kv_caches[0][0].dtype == kv_int8.DTYPE and isinstance(runner.decode_path, NativeDecodeStack)
    _decode_both_ways(runner)


@pytest.mark.parametrize("group_rows", [1, 2])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
def test_the_row_group_path_gives_the_modules_hidden_states_bit_for_bit(tiny_checkpoint_factory, native_packed,
                                                                          monkeypatch, arch, dtype, group_rows):
    """Steps of 3 rows cut into groups of 1 (three) or 2 (two, one short): each thread takes one layer of
    one group at a time, its kernels on that thread alone, and the hidden states are the modules' still."""
    monkeypatch.setattr("core_pytorch_backend.native_decode.GROUP_ROWS", group_rows)
    monkeypatch.setattr("core_pytorch_backend.native_decode.EXACT_TILES_GROUP_ROWS", 0)
    monkeypatch.setattr("core_pytorch_backend.native_decode.row_group_from", lambda _: 2)
    runner = _runner(_load(tiny_checkpoint_factory(arch), "int4", dtype))
    assert runner.decode_path.plan.decoder.group_rows == group_rows
    with torch_threads(2):  # the path needs a team
        _decode_both_ways(runner)


def test_a_step_of_64_rows_takes_the_row_group_path_as_served_and_gives_the_modules_bits(tiny_checkpoint_factory,
                                                                                          native_packed):
    """No patching: 64 decode rows on 2 threads reach the row-group path with the rule the server runs
    (row_group_from: units of 32 rows on the exact int8 tiles where this CPU has AMX, of 8 elsewhere), and
    the hidden states are the modules' bit for bit, step after step."""
    sequences, prompt, blocks_each = 64, 5, 3
    with torch_threads(2):
        runner = _runner(_load(tiny_checkpoint_factory("llama"), "int4"), num_blocks=sequences * blocks_each)
        decoder = runner.decode_path.plan.decoder
        assert sequences >= decoder.group_from and sequences > decoder.group_rows  # the row-group path
        tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(sequences)]
        runner.zero_blocks(range(sequences * blocks_each))
        with torch.inference_mode():
            prefill = _step([0] * sequences, [prompt] * sequences, seed=0, tables=tables)
            runner.model(prefill.input_ids, prefill.positions, prefill.meta)
            for i in range(4):
                decode = _step([prompt + i] * sequences, [1] * sequences, seed=i + 1, tables=tables)
                through_stack = runner.decode_path.run(runner.model, decode)
                assert torch.equal(through_stack, runner.model(decode.input_ids, decode.positions, decode.meta)), i


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_sequences_rows_of_one_step_go_through_the_layers_together(tiny_checkpoint_factory, native_packed,
                                                                      monkeypatch, arch):
    """A speculating chunk's verified positions (or a preempted sequence's recomputed output) are decode rows
    of one token each, and each reads the K/V the rows before it write in the same step: the row-group path,
    which runs groups of rows layer by layer apart, would let a row's attention read a slot another thread
    has not yet written (greedy output then followed the timing). Such a step takes one call, whose every
    layer stores all rows' K/V before any attends; the hidden states are the modules', step after step, and
    a step of independent rows takes the row groups again."""
    monkeypatch.setattr("core_pytorch_backend.native_decode.GROUP_ROWS", 1)
    monkeypatch.setattr("core_pytorch_backend.native_decode.EXACT_TILES_GROUP_ROWS", 0)
    monkeypatch.setattr("core_pytorch_backend.native_decode.row_group_from", lambda _: 2)
    with torch_threads(2):  # the row-group path needs a team
        runner = _runner(_load(tiny_checkpoint_factory(arch), "int4"))
        model, stack = runner.model, runner.decode_path
        runner.zero_blocks(range(50))
        with torch.inference_mode():
            for step in range(6):
                generated = [8 + i for i in range(8 + 4 * step)]
                speculating = _sequence("spec", [3, 4, 5, 6, 7], generated, computed=5 + 4 * step, table=TABLES[0])
                before = _sequence("a", [5, 6, 7], [8, 9, 10 + step], computed=5 + step, table=TABLES[1])
                after = _sequence("b", [6, 7], [9, 10, 11 + step], computed=4 + step, table=TABLES[2])
                inputs = runner.prepare([ScheduledSequence(before, 1), ScheduledSequence(speculating, 8),
                                         ScheduledSequence(after, 1)])
                assert inputs.meta.is_decode and not inputs.meta.rows_independent
                stale = [cache.clone() for pair in runner.kv_caches for cache in pair]  # this step's slots unwritten
                expected = model(inputs.input_ids, inputs.positions, inputs.meta)
                for attempt in range(5):
                    for cache, before_step in zip((c for pair in runner.kv_caches for c in pair), stale, strict=True):
                        cache.copy_(before_step)  # the row groups' race showed in about one step of six
                    assert torch.equal(stack.run(model, inputs), expected), (step, attempt)
                    assert stack.plan.decoder.group_rows == 0  # one call: not the row groups
            independent = runner.prepare([ScheduledSequence(before, 1), ScheduledSequence(after, 1)])
            assert independent.meta.rows_independent and stack.run(model, independent) is not None
            assert stack.plan.decoder.group_rows == 1


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_the_stack_takes_biases_on_every_projection(tiny_checkpoint_factory, native_packed, arch):
    """attention_bias (q, k, v and o) and Llama's mlp_bias (gate, up and down) go through the stack too."""
    extra = {"mlp_bias": True} if arch == "llama" else {}
    runner = _runner(_load(tiny_checkpoint_factory(arch, attention_bias=True, **extra), "int8", "float32"))
    assert isinstance(runner.decode_path, NativeDecodeStack)
    layer = runner.model.model.layers[0]
    assert layer.self_attn.o_proj.bias is not None and layer.self_attn.qkv_proj.bias is not None
    _decode_both_ways(runner)


def test_the_runner_decodes_through_the_stack_and_describes_a_new_cache_again(tiny_checkpoint_factory, native_packed):
    runner = _runner(_load(tiny_checkpoint_factory("llama"), "int8"))
    stack = runner.decode_path
    calls = []
    original = stack.run
    stack.run = lambda model, inputs: calls.append(result := original(model, inputs)) or result
    runner.zero_blocks(range(50))
    runner.execute(_step([0, 0, 0], PROMPT_LENS, seed=0))
    logits = runner.execute(_step(PROMPT_LENS, [1, 1, 1], seed=1))
    assert calls[0] is None and calls[1] is not None and logits.shape == (3, 260)
    runner.sleep(level=1)
    assert stack.plan is None  # released with the KV cache: it points into it
    runner.wakeup({"kv_cache", "weights"}, load_model=lambda: None)
    assert stack.plan is not None and stack.plan.cache_ptr == runner.kv_caches[0][0].data_ptr()
    _decode_both_ways(runner, steps=3)


def test_rows_that_are_not_plain_decode_rows_take_the_modules(tiny_checkpoint_factory, native_packed):
    runner = _runner(_load(tiny_checkpoint_factory("llama"), "int8"))
    model, stack = runner.model, runner.decode_path
    decode = _step(PROMPT_LENS, [1, 1, 1], seed=1)
    mixed = _step(PROMPT_LENS, [1, 3, 1], seed=1)  # a chunk of 3 beside decode rows
    mrope = StepInputs(decode.input_ids, decode.positions.expand(3, -1), decode.meta, decode.sample_indices,
                       decode.sampling)
    assert stack.run(model, mixed) is None
    assert stack.run(model, mrope) is None


def _sequence(seq_id: str, prompt: list[int], generated: list[int], computed: int, table: list[int]):
    seq = Sequence(seq_id, prompt)
    for token in generated:
        seq.append_token(token)
    seq.num_computed_tokens, seq.block_table = computed, table
    return seq


def test_a_step_marks_its_prompt_tokens_rows_and_then_never_takes_the_stack(tiny_checkpoint_factory, native_packed):
    """native/tile_rows.py: prepare() spans each chunk's prompt tokens (positions below its prompt's
    length), whatever the chunk's size; a runner that marks them hands the forward pass those rows, and
    a step that has any (here a prompt's last token beside decode rows: the stack's shape) takes the modules,
    whose packed weights put those rows on the prompt loop where the kernels have one."""
    model = _load(tiny_checkpoint_factory("llama"), "int8")
    runner = _runner(model)
    assert runner.marks_tile_rows == (available().prompt_loop is not None)  # tile_rows.has_tiled_weights
    runner.marks_tile_rows = True  # as on a CPU with a prompt loop (has_tiled_weights), whatever this one has
    runner.zero_blocks(range(50))
    decoding = _sequence("decoding", [5, 6, 7], [8, 9], computed=4, table=TABLES[0])  # its last generated token
    last_prompt_token = _sequence("last", [1, 2, 3, 4, 5, 6], [], computed=5, table=TABLES[1])  # a cache hit to 5
    generated_then = _sequence("preempted", [3, 4], [5, 6], computed=0, table=TABLES[2])  # recomputed whole
    inputs = runner.prepare([ScheduledSequence(decoding, 1), ScheduledSequence(last_prompt_token, 1),
                             ScheduledSequence(generated_then, 4)])
    assert inputs.prompt_token_spans == ((1, 1), (2, 2))  # rows 1, 2 and 3 are prompt tokens
    # attended so too: the recomputed sequence's prompt as a chunk, its two generated tokens as decode rows
    meta = inputs.meta
    assert meta.query_lens_list == [1, 1, 2, 1, 1] and meta.context_lens_list == [4, 5, 0, 2, 3]
    assert meta.decode_sequences() == [0, 3, 4] and meta.chunk_sequences() == [1, 2]
    seen, stack_results = [], []
    original = runner.decode_path.run
    runner.decode_path.run = lambda model, step: stack_results.append(out := original(model, step)) or out
    model.register_forward_pre_hook(lambda *_: seen.append(tile_rows.current()))
    runner.execute(inputs)
    assert stack_results == [None] and seen[0].rows(True).tolist() == [1, 2, 3] and seen[0].rows(False).tolist() == [0, 4, 5]
    assert tile_rows.current() is None  # only during the pass
    decode_only = runner.prepare([ScheduledSequence(_sequence("d", [5, 6, 7], [8], computed=3, table=TABLES[0]), 1)])
    assert decode_only.prompt_token_spans == ()
    runner.execute(decode_only)
    assert stack_results[-1] is not None and len(seen) == 1  # no prompt tokens: the stack (not the modules) ran it
    if available().prompt_loop is not None:  # the stack's prompt loop: an AVX512-BF16 build's
        runner.tile_rule = "all"  # --amx-rows all: every row, generated tokens' too, the stack's by the prompt loop
        step = [ScheduledSequence(_sequence("e", [5, 6, 7], [8], computed=3, table=TABLES[0]), 1)]
        runner.execute(runner.prepare(step))
        assert stack_results[-1] is not None and len(seen) == 1
    with pytest.raises(ValueError, match="tile_rule must be one of prompt, all, none, got 'decode'"):
        ModelRunner(model, block_size=BLOCK, num_blocks=8, device=CPU, dtype=torch.float32, tile_rule="decode")


@pytest.mark.skipif(available() is None or available().prompt_loop is None, reason="no prompt loop here")
@pytest.mark.parametrize("row_groups", [False, True])
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_with_every_row_marked_the_stack_multiplies_on_the_tiles_as_the_modules_do(tiny_checkpoint_factory,
                                                                                  native_packed, monkeypatch,
                                                                                  quantization, row_groups):
    """--amx-rows all: the stack's packed matmuls take the prompt loop (decoder.tiles), bit for bit the modules'
    NativeWeight on the tiles, and not the VNNI loop's results; also where the step is large enough for the
    row-group path (which the tiles skip: all the rows in one call, each weight dequantized once)."""
    if row_groups:
        monkeypatch.setattr("core_pytorch_backend.native_decode.GROUP_ROWS", 1)
        monkeypatch.setattr("core_pytorch_backend.native_decode.EXACT_TILES_GROUP_ROWS", 0)
    monkeypatch.setattr("core_pytorch_backend.native_decode.row_group_from", lambda _: 2)
    runner = _runner(_load(tiny_checkpoint_factory("llama"), quantization))
    with torch_threads(2), tile_rows.prompt_token_rows(tile_rows.TileRows(3)):
        _decode_both_ways(runner, steps=3)
    step = _step([n + 3 for n in PROMPT_LENS], [1, 1, 1], seed=9)
    with tile_rows.prompt_token_rows(tile_rows.TileRows(3)):
        tiled = runner.decode_path.run(runner.model, step)
    assert not torch.equal(tiled, runner.decode_path.run(runner.model, step))


@pytest.mark.skipif(available() is None or available().prompt_loop is None, reason="no prompt loop here")
def test_the_lm_head_takes_the_tiles_under_the_all_rule_and_the_vnni_loop_under_prompt(tiny_checkpoint_factory,
                                                                                       native_packed):
    runner = _runner(_load(tiny_checkpoint_factory("llama"), "int8"))
    head = runner.model.lm_head.weight  # a NativeWeight
    hidden = torch.randn(5, head.shape[1], generator=torch.Generator().manual_seed(3))
    vnni, tiles = head.linear(hidden, None, tiles=False), head.linear(hidden, None, tiles=True)
    assert not torch.equal(vnni, tiles)
    assert torch.equal(runner.logits(hidden), vnni)  # the prompt rule: no row of the head is a prompt token's
    runner.tile_rule = "all"
    assert torch.equal(runner.logits(hidden), tiles)
    prefill = _step([0, 0, 0], PROMPT_LENS, seed=0)  # a step's sampling rows too
    runner.zero_blocks(range(50))
    with torch.inference_mode(), tile_rows.prompt_token_rows(tile_rows.TileRows(sum(PROMPT_LENS))):
        last = runner.model(prefill.input_ids, prefill.positions, prefill.meta).index_select(0, prefill.sample_indices)
    runner.zero_blocks(range(50))
    assert torch.equal(runner.execute(prefill), head.linear(last, None, tiles=True))


def test_models_it_does_not_take_are_refused_at_start_with_the_reason(tiny_checkpoint_factory, native_packed,
                                                                     caplog):
    path = tiny_checkpoint_factory("llama")
    dense = _runner(_load(path, "none"))
    assert dense.decode_path is None  # float weights: F.linear, not the packed kernel
    with caplog.at_level(logging.INFO, logger="core_pytorch_backend.native_decode"):
        reference = _runner(_load(path, "int8", kind="reference"))
    assert reference.decode_path is None and "native op set" in caplog.text
    assert _runner(_load(tiny_checkpoint_factory("gpt2"), "int8")).decode_path is None  # LayerNorm, ungated MLP
    # the tiny configs' shared experts are 48 wide: --quantization leaves a down projection of 48 inputs (not whole
    # groups of 32) float, and the block takes the modules (released Qwen2-MoE / Granite MoE Shared widths pack)
    with caplog.at_level(logging.INFO, logger="core_pytorch_backend.native_decode"):
        assert _runner(_load(tiny_checkpoint_factory("qwen2_moe"), "int8")).decode_path is None
    assert ("layer 0's MoE block is not one native call (its shared_expert.down_proj of 48 inputs is not a packed "
            "weight)") in caplog.text
    packed = _load(path, "int8")
    assert make_native_decode(packed, device=CPU, enabled=False) is None  # --enforce-eager
    runner = ModelRunner(packed, block_size=BLOCK, num_blocks=64, device=CPU, dtype=torch.float32)
    assert runner.decode_path is None
    describe(packed)  # fits, its cache bound
    llama = type(packed.model)
    packed.model.__class__ = type("BuiltOtherwise", (llama,), {"make_norm": llama.make_norm})
    describe(packed)  # a subclass that runs Llama's forward (its layers checked one by one) fits
    packed.model.__class__ = type("RunsOtherwise", (llama,), {"run_layers": lambda self, *a: llama.run_layers(self, *a)})
    with pytest.raises(DoesNotFit, match="decoder is not"):  # one with a forward of its own does not
        describe(packed)
    packed.model.__class__ = llama
    layer_class = type(packed.model.layers[1])
    packed.model.layers[1].__class__ = type("OtherLayer", (layer_class,), {})  # (VaultGemma's Gemma 2 model has
    with pytest.raises(DoesNotFit, match="layers are not all LlamaDecoderLayers"):  # Gemma 1's layers)
        describe(packed)
    packed.model.layers[1].__class__ = layer_class
    handle = packed.model.layers[1].self_attn.o_proj.register_forward_hook(lambda *a: None)  # a TP all-reduce
    with pytest.raises(DoesNotFit, match="hooks"):
        describe(packed)
    stack = _runner(_load(path, "int8")).decode_path  # fits its model; then meets a model that
    with caplog.at_level(logging.INFO, logger="core_pytorch_backend.native_decode"):  # does not: the modules
        caplog.clear()
        assert stack.run(packed, _step(PROMPT_LENS, [1, 1, 1], seed=1)) is None
        assert stack.run(packed, _step(PROMPT_LENS, [1, 1, 1], seed=2)) is None
    assert stack.plan is None and caplog.text.count("native decode stack off") == 1  # described once
    handle.remove()
    packed.model.layers[0].mlp.down_proj.matmul = torch.nn.functional.linear
    with pytest.raises(DoesNotFit, match="layer 0's Linear"):
        describe(packed)


def test_a_model_whose_describing_fails_otherwise_takes_the_modules(tiny_checkpoint_factory, native_packed,
                                                                   monkeypatch, caplog):
    packed = _load(tiny_checkpoint_factory("llama"), "int8")
    ModelRunner(packed, block_size=BLOCK, num_blocks=64, device=CPU, dtype=torch.float32)  # binds its cache

    def broken(model):
        raise AttributeError("'LlamaMLP' object has no attribute 'gate_up_proj'")

    monkeypatch.setattr(native_decode, "describe", broken)
    with caplog.at_level(logging.WARNING, logger="core_pytorch_backend.native_decode"):
        assert make_native_decode(packed, device=CPU, enabled=True) is None  # a warning, not a failed start
    assert "describing LlamaForCausalLM's layers failed" in caplog.text and "gate_up_proj" in caplog.text
    stack = NativeDecodeStack(available())
    assert not stack.try_capture(packed) and stack.refused is not None  # after a wakeup too, described once


@pytest.mark.parametrize("arch", ["qwen3", "gemma3_text", "olmo2", "gemma2", "phi", "nemotron"])
async def test_the_engine_serves_decode_steps_through_the_stack_unless_eager(tiny_checkpoint_factory, native_packed,
                                                                           monkeypatch, arch):
    """16 concurrent greedy requests of different lengths, chunked prefill, a cache small enough to
    preempt: token for token the same through the stack as through the modules (--enforce-eager), for a Llama
    layer, Gemma 3's sandwich norms and sliding layers, OLMo 2's post-norm layers, Gemma 2's soft-capped
    scores (chunks capped by the reference, decode rows by the C kernel), Phi's LayerNorm, ungated MLP and
    parallel sum, and Nemotron's LayerNorm1P (1 + w), relu^2 MLP and partial rotary."""
    from core.config import EngineConfig, GenerationConfig
    from core.engine import AsyncEngine
    from core.response import collect
    from core.scheduling import Scheduler
    from core_pytorch_backend.backend import PytorchBackend
    from core_pytorch_backend.kernels import native

    preempted = []
    preempt = Scheduler._preempt
    monkeypatch.setattr(Scheduler, "_preempt", lambda self, seq, out: preempted.append(seq) or preempt(self, seq, out))

    path = tiny_checkpoint_factory(arch)
    prompts = [[(11 * i + 7 * j + 3) % 250 for j in range(3 + (5 * i) % 37)] for i in range(16)]
    greedy = GenerationConfig(temperature=0.0, max_new_tokens=24, ignore_eos=True)
    outputs = {}
    for eager in (False, True):
        backend = PytorchBackend(EngineConfig(model=str(path), quantization="int4", kv_cache_memory_gib=0.0001,
                                              max_num_batched_tokens=64, backend_options={"enforce_eager": eager}))
        assert (backend.loop.runner.decode_path is None) == eager
        assert backend.loop.argmax_kernel is native.argmax_rows  # the greedy rows' argmax in C
        engine = AsyncEngine(backend)
        try:
            responses = await asyncio.gather(*(collect(engine.generate(p, greedy)) for p in prompts))
            outputs[eager] = [r.token_ids for r in responses]
        finally:
            await engine.close()
    assert outputs[False] == outputs[True]
    assert preempted  # 26 blocks for 16 sequences of up to 4
