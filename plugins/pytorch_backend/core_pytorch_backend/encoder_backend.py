"""PytorchEncoderBackend: an encoder-only checkpoint (BERT family) served on the pooling path.

It generates nothing (`supports_generation` is False, so the engine answers generation requests with a
400) and keeps no KV cache: `embed` runs the PoolingRunner. The pooling is the checkpoint's own
sentence-transformers configuration when it ships one, else mean pooling with normalisation (what
sentence-transformers assumes for a bare BERT). Sleep level 1 keeps the weights (they are already in host
memory on the CPU; on a GPU they move there); level 2 drops them, and wakeup reads them again.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import torch

from core.backend import Backend, BackendOutput, BackendStats, EndResult, GenerateRequest, ModelInfo
from core.config import EngineConfig
from core.errors import EngineSleepingError, InvalidRequestError, UnsupportedError
from core.pooling import PoolingConfig, sentence_transformers_max_length, sentence_transformers_pooling
from core_pytorch_backend.dense_projection import load_projection
from core_pytorch_backend.kernels import select_ops
from core_pytorch_backend.loader import LoadedModel, load_checkpoint
from core_pytorch_backend.models import resolve_class
from core_pytorch_backend.pooling_runner import PoolingRunner

log = logging.getLogger(__name__)
ENCODER_POOLING = PoolingConfig(method="mean", normalize=True)  # sentence-transformers' default for BERT


def is_encoder_checkpoint(path: str | None, architectures: dict[str, Any]) -> bool:
    """Whether the folder's config.json names an architecture whose model class declares
    `is_encoder = True` (models/bert.py; a third party's encoder class does the same)."""
    config = Path(path or "") / "config.json"
    if not path or not config.is_file():
        return False
    names = json.loads(config.read_text()).get("architectures") or []
    if not names or names[0] not in architectures:
        return False
    return getattr(resolve_class(architectures[names[0]]), "is_encoder", False) is True


class PytorchEncoderBackend(Backend):
    """Embeddings from an encoder: batched forward passes on one thread, no KV cache, no generation."""

    name = "pytorch"
    supports_generation = False

    def __init__(self, config: EngineConfig, *, architectures: dict[str, Any]) -> None:
        self.config, self._architectures = config, architectures
        if config.tensor_parallel_size > 1:
            raise InvalidRequestError("encoders (BERT) are not sharded: drop --tensor-parallel-size",
                                      param="tensor_parallel_size")
        self.device = torch.device(config.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.source = str(config.model)
        loaded = self._load()
        self.tokenizer, self.dtype = loaded.tokenizer, loaded.dtype
        # a cross-encoder's own (models/bert.py), else the checkpoint's sentence-transformers pooling
        self.pooling = (getattr(loaded.model, "pooling", None) or sentence_transformers_pooling(self.source)
                        or ENCODER_POOLING)
        self.model_info = self._model_info(loaded)
        pad = getattr(loaded.hf_config, "pad_token_id", None) or 0
        self.runner = PoolingRunner(loaded.model, self.pooling, self.device, pad_token_id=pad,
                                    projection=load_projection(self.source, self.pooling.projections, self.device))
        self._asleep: set[str] = set()
        log.info("encoder %s: %s pooling%s, at most %d tokens per input", self.model_info.architecture,
                 self.pooling.method, " with normalisation" if self.pooling.normalize else "",
                 self.model_info.max_model_len)

    def _load(self) -> LoadedModel:
        loaded = load_checkpoint(self.source, dtype=self.config.dtype, device=self.device,
                                 architectures=self._architectures, ops=select_ops(self.device),
                                 quantization="none" if self.config.quantization == "auto" else self.config.quantization)
        if hasattr(loaded.model, "set_separator"):  # a BERT cross-encoder's pairs: token types from the [SEP]
            loaded.model.set_separator(getattr(loaded.tokenizer, "sep_token_id", None))
        return loaded

    def _model_info(self, loaded: LoadedModel) -> ModelInfo:
        limit = sentence_transformers_max_length(self.source) or loaded.max_model_len
        return ModelInfo(name=self.config.served_model_name or Path(self.source).name,
                         architecture=loaded.hf_config.architectures[0],
                         max_model_len=min(self.config.max_model_len or limit, loaded.max_model_len),
                         dtype=str(loaded.dtype).replace("torch.", ""), vocab_size=int(loaded.hf_config.vocab_size))

    async def embed(self, prompts: Sequence[Sequence[int]]) -> list[list[float]]:
        if self._asleep:
            raise EngineSleepingError(set(self._asleep))
        return await self.runner.embed(prompts)

    def generate(self, request: GenerateRequest) -> AsyncIterator[BackendOutput]:
        raise UnsupportedError(f"{self.model_info.name!r} is an encoder-only model: it does not generate",
                               param="model")

    async def abort(self, session_id: str) -> None:
        return None

    async def end(self, session_id: str) -> EndResult:
        return EndResult.NOT_FOUND

    async def sleep(self, level: int) -> None:
        self._asleep = {"weights", "kv_cache"}
        if level >= 2:
            self.runner.model = None  # type: ignore[assignment]
        elif self.device.type != "cpu":
            await asyncio.to_thread(self.runner.model.to, "cpu")

    async def wakeup(self, tags: Sequence[str]) -> None:
        if "weights" in tags and "weights" in self._asleep:
            if self.runner.model is None:
                self.runner.model = (await asyncio.to_thread(self._load)).model
            else:
                await asyncio.to_thread(self.runner.model.to, self.device)
        self._asleep -= set(tags)

    @property
    def is_sleeping(self) -> bool:
        return bool(self._asleep)

    def stats(self) -> BackendStats:
        return BackendStats(is_sleeping=self.is_sleeping)

    async def close(self) -> None:
        await asyncio.to_thread(self.runner.close)
