"""PytorchBackend: the Backend contract over the engine loop, for checkpoints on disk.

Loading: a Hugging Face folder or a GGUF file (the default model when none is given), the model built
from the architecture registry (built-ins plus third-party plugins). Sleep level 1 releases the KV cache
and moves weights to host memory; level 2 releases both (weights are re-read from the checkpoint on
wakeup). Embeddings (`embed`) are prefill-only requests through the same engine loop, pooled as the
checkpoint's sentence-transformers files say, else from the last token, normalised (pooled_prompt.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch

from core.adapters import AdapterInfo, AdapterPolicy, LoraModule
from core.backend import Backend, BackendOutput, BackendStats, EndResult, GenerateRequest, ModelInfo
from core.channel import LoopChannel
from core.config import EngineConfig, GenerationConfig
from core.errors import BackendError, EngineSleepingError, InvalidRequestError, UnsupportedError
from core.openmp import release_openmp_pool
from core.pooling import PoolingConfig, sentence_transformers_pooling
from core_pytorch_backend import huge_pages
from core_pytorch_backend.cuda_graphs import make_decode_graphs
from core_pytorch_backend.distributed import TensorParallel
from core_pytorch_backend.engine_loop import EngineLoop
from core_pytorch_backend.kernels import kv_int8, select_ops
from core_pytorch_backend.layers.recurrent import recurrent_layers, state_bytes_per_sequence
from core_pytorch_backend.loader import LoadedModel, default_model_path, load_checkpoint
from core_pytorch_backend.lora.manager import AdapterManager
from core_pytorch_backend.model_runner import ModelRunner, kv_cache_blocks, state_snapshot_budget
from core_pytorch_backend.native import tile_rows
from core_pytorch_backend.native_decode import make_native_decode
from core_pytorch_backend.pooled_prompt import PooledPrompt
from core_pytorch_backend.request_state import RequestState
from core_pytorch_backend.sampling_batch import SamplingParams
from core_pytorch_backend.speculative import make_speculative_decoder
from core_pytorch_backend.step_interrupt import StepInterrupt

log = logging.getLogger(__name__)
GENERATION_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
KV_CACHE_DTYPES = ("auto", "int8")


@dataclass(frozen=True)
class PytorchOptions:
    """The backend options this backend understands (`EngineConfig.backend_options`).

    :param kv_cache_memory_fraction: the share of free GPU memory the KV cache takes when
        `EngineConfig.kv_cache_memory_gib` is not given.
    :param enforce_eager: run every step through the model's modules: no CUDA graphs on a GPU, no native
        decode stack on the CPU (``--enforce-eager``).
    :param amx_rows: on a CPU with AVX512-BF16, which rows the packed weights multiply by their prompt loop
        (the AMX tiles where the CPU has them; native/tile_rows.py, ``--amx-rows``): ``prompt`` (prompt
        tokens), ``all`` (every row, generated tokens' and the LM head's too, in the native decode stack as
        well) or ``none`` (every row by the VNNI loop).
    :param kv_cache_dtype: ``auto`` (the model's dtype; bfloat16 for a float32 model on the native packed
        kernels) or ``int8`` (CPU only: each position's row of a KV head as 8-bit codes with its scale and
        minimum, kernels/kv_int8.py: 1.8x the tokens in the same memory and half the bytes a decode step's
        attention reads; ``--kv-cache-dtype``).
    """

    kv_cache_memory_fraction: float = 0.85
    enforce_eager: bool = False
    amx_rows: str = "prompt"
    kv_cache_dtype: str = "auto"

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> PytorchOptions:
        """Validated options; an unknown name or a bad value is an InvalidRequestError naming it."""
        known = {f.name for f in fields(cls)}
        for name in options:
            if name not in known:
                raise InvalidRequestError(f"backend option {name!r} is not one of the pytorch backend's: "
                                          f"{', '.join(sorted(known))}", param=f"backend_options.{name}")
        chosen = cls(**options)
        fraction = chosen.kv_cache_memory_fraction
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 < fraction <= 1.0:
            raise InvalidRequestError(f"kv_cache_memory_fraction must be in (0.0, 1.0], got {fraction!r}",
                                      param="backend_options.kv_cache_memory_fraction")
        if not isinstance(chosen.enforce_eager, bool):
            raise InvalidRequestError(f"enforce_eager must be true or false, got {chosen.enforce_eager!r}",
                                      param="backend_options.enforce_eager")
        if chosen.amx_rows not in tile_rows.RULES:
            raise InvalidRequestError(f"amx_rows must be one of {', '.join(tile_rows.RULES)}, got {chosen.amx_rows!r}",
                                      param="backend_options.amx_rows")
        if chosen.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequestError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got "
                                      f"{chosen.kv_cache_dtype!r}", param="backend_options.kv_cache_dtype")
        return chosen


def architectures_for(backend_name: str) -> dict[str, Any]:
    """Model classes registered for this backend through `core_register_model_architectures`."""
    from core.plugins import get_plugins

    return {name: entry.target for name, entry in get_plugins().model_architectures.in_scope(backend_name).items()}


def resolve_device(requested: str | None) -> torch.device:
    if requested:
        return torch.device(requested)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class PytorchBackend(Backend):
    """Paged KV cache, continuous batching, prefix caching and batched sampling in torch."""

    name = "pytorch"
    supports_prompt_logprobs = True  # such requests skip reading the prefix cache (prompt_logprobs.py)
    supports_structured_output = True  # the sampler masks each constrained row (sampling.apply_constraints)
    supports_adapters = True  # LoRA adapters per row of a step (lora/)
    supports_speculative_decoding = True  # proposals verified in the step's forward pass (speculative/)

    def __init__(self, config: EngineConfig, *, architectures: dict[str, Any] | None = None) -> None:
        self.config = config
        self.options = PytorchOptions.from_mapping(config.backend_options)
        self.device = resolve_device(config.device)
        if self.options.kv_cache_dtype == "int8" and self.device.type != "cpu":
            raise InvalidRequestError(f"kv_cache_dtype int8 runs on the CPU only; the device is {self.device}",
                                      param="backend_options.kv_cache_dtype")
        self.source = str(config.model) if config.model else str(default_model_path())
        self._architectures = architectures if architectures is not None else architectures_for(self.name)
        declared = sentence_transformers_pooling(self.source)  # before the weights: a refusal loads nothing
        if declared is not None and declared.projections:
            raise UnsupportedError(f"{self.source}: sentence-transformers Dense modules after a decoder's pooling are "
                                   "not supported (an encoder's are)", param="model")
        self.ops = self._select_ops()  # chosen once; a level-2 wakeup reloads the weights onto the same set
        self.tp = TensorParallel.from_config(config, self.device)  # None unless --tensor-parallel-size > 1
        loaded = self._load()
        snapshots = self._check_recurrent_state(loaded.model)
        self.tokenizer = loaded.tokenizer
        self.dtype = loaded.dtype
        kv_dtype = kv_int8.DTYPE if self.options.kv_cache_dtype == "int8" else loaded.kv_cache_dtype
        num_blocks = kv_cache_blocks(loaded.model, config.block_size, kv_dtype, self.device,
                                     config.kv_cache_memory_gib, self.options.kv_cache_memory_fraction)
        max_len = self._max_model_len(loaded, num_blocks)
        self.model_info = self._model_info(loaded, max_len)
        self.pooling = declared or PoolingConfig(method="last", normalize=True)
        self._pooling_to_log = None if declared else (  # said once, on the first embedding request
            f"{self.model_info.name} declares no pooling (no sentence-transformers modules.json): "
            "embeddings use last-token pooling, L2-normalised")
        fast = not self.options.enforce_eager and self.tp is None  # (for now) none under tensor parallelism
        decode_path = (functools.partial(make_native_decode, device=self.device, enabled=fast)
                       if self.device.type == "cpu" else
                       functools.partial(make_decode_graphs, device=self.device, block_size=config.block_size,
                                         enabled=fast, max_model_len=max_len, max_num_seqs=config.max_num_seqs))
        self.lora = self._start_adapters(loaded, config.adapters)
        speculative = (make_speculative_decoder(config.speculative, self.model_info.vocab_size)
                       if config.speculative is not None else None)
        interrupt = StepInterrupt() if self.tp is None else None  # ranks must run each step to its end together
        runner = ModelRunner(loaded.model, block_size=config.block_size, num_blocks=num_blocks,
                             device=self.device, dtype=loaded.dtype, kv_cache_dtype=kv_dtype,
                             decode_path=decode_path, lora_step=self.lora.step if self.lora else None,
                             tile_rule=self.options.amx_rows, interrupt=interrupt)
        if runner.marks_tile_rows:
            loop = {"amx": "the AMX tiles", "vectors": "AVX512-BF16 vectors"}[tile_rows.prompt_loop_of(loaded.model)]
            log.info("packed matmuls' prompt loop on %s: %s", loop, tile_rows.RULES[self.options.amx_rows])
        if self.tp is not None:  # ranks 1..N-1 start now; the engine loop drives them through rank 0's runner
            runner = self.tp.start(runner, config=config, source=self.source,
                                   architectures=self._architectures, ops_kind=self.ops.name)
        self.loop = EngineLoop(runner, max_model_len=max_len, max_num_seqs=config.max_num_seqs,
                               max_num_batched_tokens=max(config.max_num_batched_tokens, 1),
                               enable_prefix_caching=config.enable_prefix_caching, state_snapshots=snapshots,
                               sample_kernel=getattr(self.ops, "sample_tokens", None),
                               argmax_kernel=getattr(self.ops, "argmax_rows", None), adapters=self.lora,
                               speculative=speculative, interrupt=interrupt)
        log.info("KV cache: %d blocks of %d tokens (%d tokens) on %s, %s", num_blocks, config.block_size,
                 num_blocks * config.block_size, self.device, kv_int8.describe(kv_dtype))
        if self.device.type == "cpu":
            log.info("large CPU tensors: %s", huge_pages())
        release_openmp_pool()  # this thread's idle OpenMP workers would slow the engine thread's (core.openmp)

    # -- loading --------------------------------------------------------------------------------------

    def _load(self) -> LoadedModel:
        try:
            return load_checkpoint(self.source, dtype=self.config.dtype, device=self.device,
                                   architectures=self._architectures, ops=self.ops,
                                   quantization=self.config.quantization, max_model_len=self.config.max_model_len,
                                   shard=self.tp.shard if self.tp is not None else None)  # rank 0's part under TP
        except NotImplementedError as exc:  # a setting of the checkpoint no layer implements (e.g. a rope type)
            raise UnsupportedError(f"{self.source}: {exc}") from exc

    def _check_recurrent_state(self, model: torch.nn.Module) -> int:
        """A model with recurrent layers (Mamba, gated DeltaNet, short convolutions) keeps one state per sequence
        that only its tokens in order rebuild: it never advances by guesses (no speculative decoding), its layers
        are not sharded across ranks, and a sequence starts from cached KV blocks only where a snapshot of its
        state was kept. How many snapshots the prefix cache keeps (0: none, or no recurrent layers)."""
        layers = recurrent_layers(model)
        if not layers:
            return 0
        if self.config.speculative is not None:
            raise UnsupportedError(f"{self.source}: speculative decoding is not supported for a model with recurrent "
                                   "layers (a rejected draft would have advanced their state)", param="speculative")
        if self.tp is not None:
            raise UnsupportedError(f"{self.source}: tensor parallelism does not shard recurrent layers yet",
                                   param="tensor_parallel_size")
        per_seq = state_bytes_per_sequence(model, next(model.parameters()).dtype)
        budget = state_snapshot_budget(self.device, self.config.kv_cache_memory_gib,
                                       self.options.kv_cache_memory_fraction)
        snapshots = min(self.config.max_num_seqs, int(budget // per_seq)) if self.config.enable_prefix_caching else 0
        log.info("recurrent state: %.1f MiB per sequence in %d layers; prefix caching %s", per_seq / 2**20,
                 len(layers), f"keeps up to {snapshots} state snapshots ({snapshots * per_seq / 2**20:.0f} MiB) at "
                 "prompts' last block boundaries" if snapshots else "off")
        return snapshots

    def _select_ops(self) -> Any:
        """The op set the model's layers run on; a backend with its own kernels overrides this."""
        return select_ops(self.device)

    def _max_model_len(self, loaded: LoadedModel, num_blocks: int) -> int:
        wanted = self.config.max_model_len or loaded.max_model_len
        if wanted > loaded.max_model_len:  # past the positions the model (and its rotary tables) knows
            raise InvalidRequestError(
                f"max_model_len {wanted} exceeds the {loaded.max_model_len} positions {self.source} serves "
                "(max_position_embeddings, or what its YaRN rope scaling extends that to)", param="max_model_len")
        capacity = num_blocks * self.config.block_size
        if wanted > capacity:
            log.warning("max_model_len %d exceeds the KV cache (%d tokens); using %d", wanted, capacity, capacity)
        return min(wanted, capacity)

    def _model_info(self, loaded: LoadedModel, max_len: int) -> ModelInfo:
        eos = loaded.generation_config.get("eos_token_id", getattr(loaded.hf_config, "eos_token_id", None))
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        if not eos_ids and getattr(loaded.tokenizer, "eos_token_id", None) is not None:
            eos_ids = (loaded.tokenizer.eos_token_id,)
        defaults = {k: loaded.generation_config[k] for k in GENERATION_DEFAULT_KEYS if k in loaded.generation_config}
        if loaded.generation_config.get("do_sample") is False:
            defaults["temperature"] = 0.0
        return ModelInfo(
            name=self.config.served_model_name or _display_name(self.source),
            architecture=(getattr(loaded.hf_config, "architectures", None) or ["unknown"])[0],
            max_model_len=max_len, eos_token_ids=eos_ids, chat_template=loaded.chat_template,
            generation_defaults=defaults, dtype=str(loaded.dtype).replace("torch.", ""),
            vocab_size=int(loaded.hf_config.get_text_config().vocab_size),  # VL configs nest it
            quantization=loaded.quantization,
        )

    # -- the contract ---------------------------------------------------------------------------------

    def generate(self, request: GenerateRequest) -> AsyncIterator[BackendOutput]:
        return self._generate(request)

    async def _generate(self, request: GenerateRequest) -> AsyncIterator[BackendOutput]:
        async with contextlib.aclosing(self._run(self._state(request))) as items:
            async for item in items:
                yield item

    async def embed(self, prompts: Sequence[Sequence[int]]) -> list[list[float]]:
        if self._pooling_to_log:
            log.warning("%s", self._pooling_to_log)
            self._pooling_to_log = None
        return list(await asyncio.gather(*(self._embed_one(prompt) for prompt in prompts)))

    async def _embed_one(self, prompt: Sequence[int]) -> list[float]:
        """One prefill-only request: the engine loop sends its pooled vector, then ends it."""
        request = GenerateRequest(f"embed-{uuid.uuid4().hex}", list(prompt), GenerationConfig(), max_new_tokens=1)
        state = self._state(request, PooledPrompt(self.pooling, len(prompt)))
        async with contextlib.aclosing(self._run(state)) as items:
            async for item in items:
                if isinstance(item, list):
                    return item
        raise BackendError("the embedding request was aborted before its prompt was computed")

    def _state(self, request: GenerateRequest, pooling: PooledPrompt | None = None) -> RequestState:
        if self.loop.asleep:
            raise EngineSleepingError(set(self.loop.asleep))  # a request that raced a sleep: a 503, not a 500
        return RequestState(request, LoopChannel(asyncio.get_running_loop()),
                            SamplingParams.from_config(request.config), self.model_info.max_model_len,
                            pooling=pooling)

    async def _run(self, state: RequestState) -> AsyncIterator[Any]:
        """Add `state` to the engine loop and yield what it sends; aborted if left before the end."""
        try:
            await asyncio.wrap_future(self.loop.call(lambda: self.loop.add(state)))
        except ValueError as exc:
            raise InvalidRequestError(str(exc), param="prompt") from exc
        try:
            async for item in state.channel:
                yield item
        finally:
            if not state.channel.closed:
                aborting = self.loop.call_aborting(lambda: self.loop.abort(state.session_id), [state.session_id])
                await asyncio.shield(asyncio.wrap_future(aborting))

    async def abort(self, session_id: str) -> None:
        await asyncio.wrap_future(self.loop.call_aborting(lambda: self.loop.abort(session_id), [session_id]))

    async def abort_many(self, session_ids: Sequence[str]) -> None:
        """All of them in one command: done within one engine step, however many there are."""
        ids = list(session_ids)
        await asyncio.wrap_future(self.loop.call_aborting(lambda: self.loop.abort_many(ids), ids))

    async def end(self, session_id: str) -> EndResult:
        return await asyncio.wrap_future(self.loop.call(lambda: self.loop.end(session_id)))

    async def sleep(self, level: int) -> None:
        await asyncio.wrap_future(self.loop.call_aborting(lambda: self.loop.sleep(level), None))

    async def wakeup(self, tags: Sequence[str]) -> None:
        await asyncio.wrap_future(self.loop.call(lambda: self.loop.wakeup(tags, self._reload_model)))

    def _reload_model(self) -> torch.nn.Module:
        """The model with its weights read again (a wakeup after a level-2 sleep, on the loop thread)."""
        model = self._load().model
        if self.lora is not None:
            self.lora.attach(model)
        return model

    # -- LoRA adapters (lora/) ------------------------------------------------------------------------

    def _start_adapters(self, loaded: LoadedModel, policy: AdapterPolicy) -> AdapterManager | None:
        """The adapters' slots on the model and the start-up adapters loaded (a bad one stops start-up).

        Over quantized base weights the slots hold bfloat16: a decode step's adapter term is bound by
        reading them (benchmarks/lora_throughput.py), and their rounding is far below the base's own
        (benchmarks/lora_accuracy.py); over float weights they keep the model's dtype."""
        if not policy.enabled:
            return None
        weights_dtype = torch.bfloat16 if loaded.quantization != "none" else self.dtype
        manager = AdapterManager(loaded.model, policy, self.device, self.dtype, weights_dtype)
        for module in policy.lora_modules:
            manager.add(module, manager.read(module))
        return manager

    def adapters(self) -> Sequence[AdapterInfo]:
        return self.lora.registry.all() if self.lora is not None else ()

    async def load_adapter(self, module: LoraModule) -> AdapterInfo:
        lora = self._adapters_on()
        weights = await asyncio.to_thread(lora.read, module)  # reading and checking stay off the loop
        return await asyncio.wrap_future(self.loop.call(lambda: lora.add(module, weights)))

    async def unload_adapter(self, name: str) -> None:
        lora = self._adapters_on()
        await asyncio.wrap_future(self.loop.call(lambda: lora.remove(name)))

    def _adapters_on(self) -> AdapterManager:
        if self.lora is None:
            raise UnsupportedError("LoRA adapters are off: start with --lora-modules or --enable-runtime-lora",
                                   param="lora_name")
        return self.lora

    @property
    def is_sleeping(self) -> bool:
        return bool(self.loop.asleep)

    def stats(self) -> BackendStats:
        if self.tp is not None:
            self.tp.check()  # a rank died: /health answers 503 and the server exits non-zero
        return self.loop.stats(self.is_sleeping)

    async def close(self) -> None:
        try:
            await asyncio.get_running_loop().run_in_executor(None, self.loop.stop)
        finally:
            if self.tp is not None:  # after the loop: nothing drives the ranks any more
                await asyncio.get_running_loop().run_in_executor(None, self.tp.close)


def _display_name(source: str) -> str:
    name = source.rstrip("/").rsplit("/", 1)[-1]
    return name[:-5] if name.endswith(".gguf") else name
