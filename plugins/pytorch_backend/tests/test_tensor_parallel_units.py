"""Tensor parallelism without processes: the shard layout and its start-up errors, the slices of dense
and packed tensors, the plan's kinds, and the options refused before anything is spawned."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from core.config import EngineConfig
from core_pytorch_backend.distributed.plan import (
    COLUMN,
    KV_COLUMN,
    ROW,
    VOCAB,
    kind_of,
    layout_of,
    plan_of,
    sharded_config,
)
from core_pytorch_backend.distributed.slicing import shard_tensor
from core_pytorch_backend.models.llama import LlamaForCausalLM
from core_pytorch_backend.quant.affine import quantize_int4


def _config(**overrides):
    """The tests' tiny Llama shape (conftest.tiny_config): 4 heads, 2 KV heads, MLP 128, vocabulary 260."""
    from transformers import LlamaConfig

    shape = {"vocab_size": 260, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2}
    return LlamaConfig(**{**shape, **overrides})


def test_two_ranks_split_heads_mlp_and_a_padded_vocabulary():
    layout = layout_of(_config(), rank=1, world=2)
    assert (layout.num_heads, layout.num_kv_heads, layout.kv_replicas, layout.head_dim) == (2, 1, 1, 16)
    assert (layout.vocab_per_rank, layout.vocab_start, layout.kv_head_start) == (130, 130, 1)
    shard = sharded_config(_config(), layout)
    sizes = (shard.num_attention_heads, shard.num_key_value_heads, shard.intermediate_size, shard.vocab_size)
    assert sizes == (2, 1, 64, 130)
    assert _config().num_attention_heads == 4  # the original is left alone


def test_kv_heads_fewer_than_ranks_are_replicated():
    layouts = [layout_of(_config(), rank, 4) for rank in range(4)]
    assert [lay.num_kv_heads for lay in layouts] == [1] * 4
    assert [lay.kv_head_start for lay in layouts] == [0, 0, 1, 1]  # q heads 0-1 read KV head 0, 2-3 head 1
    assert layouts[3].vocab_per_rank == 65


@pytest.mark.parametrize(("overrides", "world", "message"), [
    ({}, 3, "--tensor-parallel-size 3 must divide the model's 4 attention heads"),
    ({}, 8, "--tensor-parallel-size 8 must divide the model's 4 attention heads"),
    ({"hidden_size": 96, "num_attention_heads": 6, "num_key_value_heads": 3}, 2,
     "must divide the model's 3 KV heads"),
    ({"num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 8, "intermediate_size": 100}, 8,
     "MLP width"),
])
def test_sizes_that_do_not_split_are_start_up_errors_naming_the_flag(overrides, world, message):
    with pytest.raises(ValueError, match=message):
        layout_of(_config(**overrides), 0, world)


def test_the_engine_config_checks_the_size():
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig(tensor_parallel_size=0)
    assert EngineConfig(tensor_parallel_size=2).tensor_parallel_size == 2


def test_the_plan_names_every_projection():
    plan = plan_of(LlamaForCausalLM)
    assert kind_of("model.layers.0.self_attn.q_proj.weight", plan) == COLUMN
    assert kind_of("model.layers.1.self_attn.v_proj.bias", plan) == KV_COLUMN
    assert kind_of("model.layers.1.mlp.down_proj.weight", plan) == ROW
    assert kind_of("model.embed_tokens.weight", plan) == VOCAB and kind_of("lm_head.weight", plan) == VOCAB
    assert kind_of("model.layers.0.input_layernorm.weight", plan) is None


def test_a_class_without_a_plan_is_refused_by_name():
    from core_pytorch_backend.models.vision_language import Qwen2VLForConditionalGeneration

    with pytest.raises(ValueError, match="Qwen2VLForConditionalGeneration cannot be sharded"):
        plan_of(Qwen2VLForConditionalGeneration)


def test_dense_slices_rebuild_the_tensor():
    layouts = [layout_of(_config(), rank, 2) for rank in range(2)]
    weight = torch.randn(128, 64)
    assert torch.equal(torch.cat([shard_tensor("w", weight, COLUMN, lay) for lay in layouts]), weight)
    assert torch.equal(torch.cat([shard_tensor("w", weight, ROW, lay) for lay in layouts], dim=1), weight)
    bias = torch.randn(64)
    assert sum(shard_tensor("b", bias, ROW, lay) for lay in layouts).equal(bias)  # added once, after the sum
    table = torch.randn(260, 64)
    rows = [shard_tensor("e", table, VOCAB, lay) for lay in layout_of_many(4)]
    assert [r.shape[0] for r in rows] == [65] * 4 and torch.equal(torch.cat(rows), table)


def layout_of_many(world: int):
    return [layout_of(_config(), rank, world) for rank in range(world)]


def test_packed_codes_slice_along_rows_and_whole_groups():
    weight = np.random.default_rng(0).standard_normal((64, 128)).astype(np.float32)
    codes = quantize_int4(weight)
    layouts = layout_of_many(2)
    column = [shard_tensor("w", codes, COLUMN, lay) for lay in layouts]
    assert np.array_equal(np.concatenate([c.dequantize() for c in column]), codes.dequantize())
    row = [shard_tensor("w", codes, ROW, lay) for lay in layouts]  # 64 inputs each: two groups of 32
    assert all(hasattr(r, "q") for r in row)
    assert np.array_equal(np.concatenate([r.dequantize() for r in row], axis=1), codes.dequantize())
    split = [shard_tensor("w", codes, ROW, lay) for lay in layout_of_many(4)[:1]]  # 32 inputs: still whole
    assert hasattr(split[0], "q")


def test_a_row_slice_inside_a_group_is_dequantized():
    codes = quantize_int4(np.ones((16, 64), np.float32))
    layout = layout_of(_config(num_attention_heads=4, num_key_value_heads=4, intermediate_size=128), 0, 4)
    part = shard_tensor("w", codes, ROW, layout)  # 16 inputs of a group of 32
    assert isinstance(part, torch.Tensor) and part.shape == (16, 16)


def test_lora_adapters_are_refused_with_tensor_parallelism():
    from core.adapters import AdapterPolicy
    from core.errors import InvalidRequestError
    from core_pytorch_backend.distributed import TensorParallel

    config = EngineConfig(tensor_parallel_size=2, adapters=AdapterPolicy(runtime_loading=True))
    with pytest.raises(InvalidRequestError, match="--tensor-parallel-size"):
        TensorParallel.from_config(config, torch.device("cpu"))
    assert TensorParallel.from_config(EngineConfig(), torch.device("cpu")) is None


def test_encoders_refuse_tensor_parallelism_before_loading():
    from core.errors import InvalidRequestError
    from core_pytorch_backend.encoder_backend import PytorchEncoderBackend

    with pytest.raises(InvalidRequestError, match="--tensor-parallel-size"):
        PytorchEncoderBackend(EngineConfig(model="/nonexistent", tensor_parallel_size=2), architectures={})


def test_collectives_of_two_ranks_in_one_process():
    """The group's collectives between two threads: commands of one frame and of several, the all-reduce,
    the gather on rank 0 and the barrier."""
    from concurrent.futures import ThreadPoolExecutor

    from core_pytorch_backend.distributed.group import FRAME_BYTES, RankGroups, client_store, master_store

    store = master_store(2)
    big = {"tensor": torch.arange(FRAME_BYTES, dtype=torch.int32), "text": "x" * FRAME_BYTES}

    def rank(r: int):
        groups = RankGroups(r, 2)
        groups.connect(store if r == 0 else client_store(store.port, 2), torch.device("cpu"), timeout_s=30)
        small = groups.broadcast_object(("forward", (1, 2)) if r == 0 else None)
        large = groups.broadcast_object(big if r == 0 else None)
        summed = groups.all_reduce(torch.full((3,), float(r + 1)))
        gathered = groups.gather_last_dim(torch.full((2, 2), float(r)))
        result = small, large, summed, gathered, groups.all_ok(r == 0)
        groups.disconnect()
        return result

    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(rank, (0, 1))
    assert second[0] == ("forward", (1, 2)) and second[1]["text"] == big["text"]
    assert torch.equal(second[1]["tensor"], big["tensor"])
    assert first[2].tolist() == second[2].tolist() == [3.0, 3.0, 3.0]
    assert first[3].tolist() == [[0.0, 0.0, 1.0, 1.0]] * 2 and second[3] is None
    assert first[4] is second[4] is False


def test_each_rank_needs_a_gpu_of_its_own():
    from core.errors import InvalidRequestError
    from core_pytorch_backend.distributed.launch import _rank_devices

    assert _rank_devices(torch.device("cpu"), 3) == [torch.device("cpu")] * 3
    visible = torch.cuda.device_count()
    with pytest.raises(InvalidRequestError, match=f"--tensor-parallel-size {visible + 1} from cuda:0 needs"):
        _rank_devices(torch.device("cuda"), visible + 1)
    with pytest.raises(InvalidRequestError, match="CPU or on CUDA GPUs, not on meta"):
        _rank_devices(torch.device("meta"), 2)


@pytest.mark.parametrize("rule", ["prompt", "all"])
def test_the_other_ranks_take_rank_0s_amx_rule(rule):
    """--amx-rows reaches every rank (WorkerSpec.tile_rule), so each multiplies its shard as rank 0 does."""
    from types import SimpleNamespace

    from core_pytorch_backend.distributed.launch import TensorParallel

    config = EngineConfig(tensor_parallel_size=2)
    local = SimpleNamespace(dtype=torch.float32, model=torch.nn.Linear(2, 2), block_size=16, num_blocks=8,
                            kv_cache_dtype=torch.bfloat16, tile_rule=rule)  # rank 0's runner, as _spec reads it
    spec = TensorParallel(config, torch.device("cpu"))._spec(1, 0, local, config, "model", {}, None)
    assert spec.tile_rule == rule and spec.rank == 1
