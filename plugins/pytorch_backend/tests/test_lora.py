"""LoRA adapters against transformers + peft on tiny random checkpoints: each adapter alone, a mixed batch
of adapters and the base, the prefix cache kept apart per adapter, slots and bad folders."""

from __future__ import annotations

import asyncio
import json
import logging
import random

import pytest
import torch

from core.config import GenerationConfig
from core.errors import AdapterInUseError, CoreError, InvalidRequestError
from core.pipelines import pipeline
from core.response import collect

peft = pytest.importorskip("peft")
NEW_TOKENS = 8
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(base, folder, seed, rank=4, alpha=8, rslora=False, targets=TARGETS, **extra):
    """A PEFT LoRA folder with random, non-zero A and B (peft starts B at zero)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora,
                             lora_dropout=0.0, **extra)
    peft_model = peft.get_peft_model(model, config)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.3)
    peft_model.save_pretrained(folder)
    return folder


def peft_greedy(base, adapter, prompt):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, adapter)
    model.eval()
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
                         max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                         eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def greedy(adapter=None):
    return GenerationConfig(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True, adapter=adapter)


@pytest.fixture(scope="module")
def base(tiny_checkpoint_factory):
    return tiny_checkpoint_factory("llama")


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("loras")
    return {
        "a1": make_adapter(base, root / "a1", 1, rank=4, alpha=8),
        "a2": make_adapter(base, root / "a2", 2, rank=8, alpha=4, rslora=True),
        "a3": make_adapter(base, root / "a3", 3, rank=2, alpha=2, targets=["q_proj", "v_proj", "down_proj"]),
    }


@pytest.fixture(scope="module")
def pipe(base, adapters):
    with pipeline(str(base), dtype="float32", lora_modules={k: str(v) for k, v in adapters.items()},
                  max_loras=3, max_lora_rank=8) as p:
        yield p


def prompts(count, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(0, 256) for _ in range(rng.randrange(5, 30))] for _ in range(count)]


def test_each_adapter_alone_matches_peft(pipe, base, adapters):
    prompt = prompts(1)[0]
    base_tokens = peft_greedy(base, None, prompt)
    for name, folder in adapters.items():
        expected = peft_greedy(base, folder, prompt)
        assert expected != base_tokens  # the adapter changes the output
        assert pipe.infer(prompt, greedy(name)).token_ids == expected, name
    assert pipe.infer(prompt, greedy()).token_ids == base_tokens


def test_mixed_batch_of_adapters_and_base_matches_each_oracle(pipe, base, adapters):
    batch = prompts(12, seed=5)
    names = [None, "a1", "a2", "a3"] * 3
    results = pipe.infer(batch, [greedy(n) for n in names])
    for prompt, name, result in zip(batch, names, results, strict=True):
        assert result.token_ids == peft_greedy(base, adapters.get(name), prompt), name
    stats = pipe.engine.stats()
    assert stats.kv_blocks_used == 0 and stats.running == 0
    assert pipe.engine.backend.lora.slots_in_use() == 0


def test_prefix_cache_is_kept_apart_per_adapter(pipe):
    prompt = list(range(40, 100))  # several full blocks
    pipe.infer(prompt, greedy("a1"))
    before = pipe.engine.stats()
    pipe.infer(prompt, greedy("a2"))
    after = pipe.engine.stats()
    assert after.prefix_cache_hits == before.prefix_cache_hits  # another adapter: no hit
    pipe.infer(prompt, greedy("a2"))
    assert pipe.engine.stats().prefix_cache_hits > after.prefix_cache_hits  # the same one: a hit


def test_unknown_adapter_is_a_404(pipe):
    with pytest.raises(CoreError) as info:
        pipe.infer([1, 2, 3], greedy("nope"))
    assert info.value.code.http_status == 404


def test_with_one_slot_requests_wait_for_it_and_match_their_oracle(base, adapters, caplog):
    """--max-loras 1, two adapters and the base at once: a request for the adapter not resident waits for
    the slot (no 503) while the base's and the resident adapter's pass it; every output is its oracle's."""
    batch = prompts(8, seed=7)
    names = ["a1", "a2", None, "a2", "a1", None, "a2", "a1"]
    with caplog.at_level(logging.DEBUG, logger="core_pytorch_backend.engine_loop"), \
            pipeline(str(base), dtype="float32", lora_modules={n: str(adapters[n]) for n in ("a1", "a2")},
                     max_loras=1, max_lora_rank=8) as p:
        results = p.infer(batch, [greedy(n) for n in names])
        for prompt, name, result in zip(batch, names, results, strict=True):
            assert result.error is None and result.token_ids == peft_greedy(base, adapters.get(name), prompt), name
        stats = p.engine.stats()
        assert stats.kv_blocks_used == 0 and stats.running == stats.waiting == 0
        assert p.engine.backend.lora.slots_in_use() == 0
    assert "waits for a LoRA slot" in caplog.text  # the slot was contended


def test_a_request_waiting_for_a_slot_aborts_and_leaks_nothing(base, adapters):
    from core.adapters import AdapterPolicy, LoraModule
    from core.config import EngineConfig
    from core.engine import AsyncEngine
    from core_pytorch_backend.backend import PytorchBackend

    policy = AdapterPolicy(lora_modules=tuple(LoraModule(n, str(adapters[n])) for n in ("a1", "a2")),
                           max_loras=1, max_lora_rank=8)
    engine = AsyncEngine(PytorchBackend(EngineConfig(model=str(base), dtype="float32", adapters=policy)))

    async def run():
        holder = engine.generate([1, 2, 3, 4], GenerationConfig(max_new_tokens=240, ignore_eos=True, adapter="a1"))
        first = await anext(aiter(holder))  # a1 holds the only slot
        assert first.finish_reason is None
        waiter = engine.generate([5, 6, 7], greedy("a2"))
        waiting = asyncio.ensure_future(collect(waiter))
        while engine.stats().waiting == 0:
            await asyncio.sleep(0.005)
        assert engine.stats().running == 1
        base_only = await collect(engine.generate([5, 6, 7], greedy()))  # the base passes the waiting request
        assert base_only.finish_reason == "length"
        await engine.abort(waiter.session_id)
        aborted = await waiting
        await engine.abort(holder.session_id)
        await holder.aclose()
        return aborted

    try:
        aborted = asyncio.run(run())
        assert aborted.finish_reason == "abort" and not aborted.token_ids
        stats = engine.stats()
        assert stats.kv_blocks_used == 0 and stats.running == stats.waiting == stats.sessions == 0
        assert engine.backend.lora.slots_in_use() == 0 and len(engine.sessions) == 0
    finally:
        asyncio.run(engine.close())


def test_a_later_request_for_the_resident_adapter_queues_behind_a_waiting_one(base, adapters):
    """First come, first served for slots: while a2 waits for a1's only slot, a new a1 request does not pass
    it (it would keep the slot held for ever under steady a1 traffic); the base still passes."""
    from core.adapters import AdapterPolicy, LoraModule
    from core.config import EngineConfig
    from core.engine import AsyncEngine
    from core_pytorch_backend.backend import PytorchBackend

    policy = AdapterPolicy(lora_modules=tuple(LoraModule(n, str(adapters[n])) for n in ("a1", "a2")),
                           max_loras=1, max_lora_rank=8)
    engine = AsyncEngine(PytorchBackend(EngineConfig(model=str(base), dtype="float32", adapters=policy)))

    async def run():
        holder = engine.generate([1, 2, 3, 4], GenerationConfig(max_new_tokens=200, ignore_eos=True, adapter="a1"))
        assert (await anext(aiter(holder))).finish_reason is None  # a1 holds the only slot
        waiter = asyncio.ensure_future(collect(engine.generate([5, 6, 7], greedy("a2"))))
        while engine.stats().waiting == 0:
            await asyncio.sleep(0.005)
        later = asyncio.ensure_future(collect(engine.generate([8, 9], greedy("a1"))))
        for _ in range(400):  # up to 2 s for the engine loop to take it in
            if engine.stats().waiting == 2 or later.done():
                break
            await asyncio.sleep(0.005)
        assert engine.stats().waiting == 2 and engine.stats().running == 1  # the later a1 request did not start ahead of a2
        assert (await collect(engine.generate([5, 6, 7], greedy()))).finish_reason == "length"
        await holder.aclose()  # a1's slot frees: a2 runs, then the later a1
        return await waiter, await later

    try:
        waited, later = asyncio.run(run())
        assert waited.finish_reason == later.finish_reason == "length"
        assert waited.token_ids == peft_greedy(base, adapters["a2"], [5, 6, 7])
        assert later.token_ids == peft_greedy(base, adapters["a1"], [8, 9])
        stats = engine.stats()
        assert stats.kv_blocks_used == 0 and stats.running == stats.waiting == stats.sessions == 0
        assert engine.backend.lora.slots_in_use() == 0
    finally:
        asyncio.run(engine.close())


def test_unload_in_use_is_409_and_lru_evicts_idle(base, adapters):
    from core.adapters import AdapterPolicy, LoraModule
    from core_pytorch_backend.loader import load_checkpoint
    from core_pytorch_backend.lora.manager import AdapterManager

    model = load_checkpoint(base, dtype="float32").model
    manager = AdapterManager(model, AdapterPolicy(max_loras=2, max_lora_rank=8), torch.device("cpu"), torch.float32)
    for name, folder in adapters.items():
        manager.add(LoraModule(name, str(folder)), manager.read(LoraModule(name, str(folder))))
    slot1, key1 = manager.acquire("a1")
    manager.acquire("a2")
    assert not manager.has_slot_for("a3")  # both slots held by running requests: the loop keeps it waiting
    with pytest.raises(CoreError) as info:
        manager.acquire("a3")
    assert info.value.code.http_status == 503
    with pytest.raises(AdapterInUseError):
        manager.remove("a1")
    manager.release("a1")
    assert manager.has_slot_for("a3") and manager.has_slot_for("a2")
    assert manager.acquire("a3")[0] == slot1  # a1 idle: evicted (LRU)
    manager.remove("a1")
    assert "a1" not in manager.registry


@pytest.mark.parametrize("problem", ["missing", "modules_to_save", "rank", "target", "hidden"])
def test_bad_adapter_folder_is_a_clear_400(problem, base, adapters, tmp_path, tiny_checkpoint_factory):
    from core.adapters import AdapterPolicy, LoraModule
    from core_pytorch_backend.loader import load_checkpoint
    from core_pytorch_backend.lora.manager import AdapterManager

    folder = adapters["a1"]
    if problem == "missing":
        folder = tmp_path / "empty"
        folder.mkdir()
    elif problem == "modules_to_save":
        folder = make_adapter(base, tmp_path / "m", 4, modules_to_save=["lm_head"])
    elif problem == "target":
        folder = make_adapter(base, tmp_path / "t", 4, targets=["q_proj"])
        config = json.loads((folder / "adapter_config.json").read_text())
        from safetensors.torch import load_file, save_file
        tensors = {k.replace("q_proj", "no_such_proj"): v for k, v in load_file(folder / "adapter_model.safetensors").items()}
        save_file(tensors, folder / "adapter_model.safetensors")
        assert config
    elif problem == "hidden":
        folder = make_adapter(tiny_checkpoint_factory("llama", hidden_size=32), tmp_path / "h", 4)
    model = load_checkpoint(base, dtype="float32").model
    manager = AdapterManager(model, AdapterPolicy(max_lora_rank=2 if problem == "rank" else 8),
                             torch.device("cpu"), torch.float32)
    with pytest.raises(InvalidRequestError) as info:
        manager.read(LoraModule("x", str(folder)))
    assert info.value.param == "lora_path"
    assert not manager.registry.names()
