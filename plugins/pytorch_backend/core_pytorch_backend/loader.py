"""Load a model + tokenizer from a Hugging Face folder or a single GGUF file."""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from tqdm.auto import tqdm

from core.cache_folder import cache_folder
from core.memory import trim_heap

from .default_model import default_model_path, generation_defaults  # noqa: F401 (default_model_path: re-exported)
from .kernels import select_ops
from .layers.matmul import select_matmul, use_matmul
from .layers.quantized import AffineRows, Int4Weight
from .layers.rotary import (
    context_positions,
    fit_rotary_tables,
    rope_parameters,
    rotary_rows,
    serve_longrope_long,
)
from .light_config import read_light_config, write_light_config
from .models import BUILTIN_ARCHITECTURES, resolve_class
from .native.half_weights import half_kernels, keep_sixteen_bit, pack_bfloat16, pack_exact_halves
from .native.library import CpuKernels
from .native.packed_weight import NativeWeight
from .quant.affine import AffineWeight
from .quant.attach import MODES as QUANTIZE_MODES
from .quant.attach import attach_quantized, attaching_as_loaded, quantize_model
from .quant.fp8_blocks import fp8_block_size, fp8_blocks_dequantized
from .quant.gguf_file import gguf_weights
from .quant.gguf_index import TensorEntry, read_gguf_index
from .quant.kernel_choice import PackedKernel, packed_kernel

if TYPE_CHECKING:
    from .distributed.shard import ModelShard

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANTIZATIONS = ("auto", "none", *QUANTIZE_MODES)
# 2: the dequantized weights are optional (packed serving needs none); 3: head_dim from the file (gguf_config);
# 4: rope base, rotated width and frequency divisors from the file; 5: the experts' widths and gpt-oss's
# window from the file
GGUF_CACHE_VERSION = 5
_COMPLETE_MARKER = ".complete"
_WEIGHTS_MARKER = ".weights-complete"


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any  # an HF tokenizer (None only for folders that ship none)
    hf_config: Any
    generation_config: dict = field(default_factory=dict)
    dtype: torch.dtype = torch.float32
    kv_cache_dtype: torch.dtype | None = None  # None: ``dtype`` (filled in)
    chat_template: str | None = None
    max_model_len: int = 2048
    source: str = ""
    quantization: str = "none"  # what the packed layers hold (for the start-up log)

    def __post_init__(self) -> None:
        if self.kv_cache_dtype is None:
            self.kv_cache_dtype = self.dtype


def load_checkpoint(
    path: str | os.PathLike,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    architectures: Mapping[str, type | str] | None = None,
    ops: Any = None,
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
    quantization: str = "auto",
    shard: ModelShard | None = None,
    packed_choice: PackedKernel | None = None,
    max_model_len: int | None = None,
) -> LoadedModel:
    """Build the model for a checkpoint and load its weights.

    ``path`` is an HF folder (config.json + safetensors) or a ``.gguf`` file. ``quantization``:

    - ``auto``: a GGUF file's block-quantized tensors stay packed on the CPU (``quant.gguf_blocks``;
      float and other types dequantized); a float checkpoint is served as it is (on the CPU a bf16
      model's linear layers multiply on the native kernels, and a GGUF file's F16 / BF16 tensors stay 16-bit:
      ``native.half_weights``).
    - ``none``: everything dequantized (a GGUF file is converted once into an HF folder under
      ``cache_dir`` unless ``use_cache`` is False).
    - ``int8`` / ``int4``: linear layers quantized at load (``quant.attach.quantize_model``), CPU only.

    Packed weights are multiplied by the plugin's native kernels wherever they build
    (``quant.kernel_choice``: the kernels that meet the accuracy bar, not timed), and then, with
    ``dtype="auto"``, the model runs in float32 with a bfloat16 KV cache (half the memory; agreement with
    the float32 model 99.65% against 99.9%, measured); where no compiler builds them, torch's int4 kernel
    runs and the model in that kernel's fastest dtype (bfloat16 on CPUs with bf16 instructions). A dtype
    named explicitly is the model's and its KV cache's.
    ``architectures`` maps HF architecture names to classes or ``"module:Class"``
    strings (built-ins by default). ``shard`` builds one tensor-parallel rank's part instead
    (``distributed.shard.ModelShard``: its config, its slices of the tensors, its collectives), and
    ``packed_choice`` imposes a packed-weights kernel instead of choosing one (ranks > 0 take rank 0's:
    ranks whose kernels or dtypes differed could not sum their partial results). ``max_model_len``: the
    context the caller will serve, where the model's positions depend on it (LongRoPE past its original
    context: ``layers.rotary.serve_longrope_long``); a shorter one than the model's cuts its rotary tables to
    it (``fit_rotary_tables``), and the loaded model then serves that many positions.
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {quantization!r}")
    path, device = Path(path), torch.device(device)
    gguf = _gguf_file(path)
    packed = gguf is not None and quantization == "auto" and device.type == "cpu"
    if quantization in QUANTIZE_MODES and device.type != "cpu":
        raise ValueError(f"quantization={quantization!r} runs on the CPU only; device is {device}")
    config, tokenizer, weights, generation = _open(path, gguf, packed, cache_dir, use_cache)
    if gguf is None and (fp8_block := fp8_block_size(config)) is not None:
        weights = fp8_blocks_dequantized(weights, fp8_block)
    if serve_longrope_long(config.get_text_config(), max_model_len):
        log.warning("%s: max_model_len %d is past LongRoPE's original %d positions: every position takes the "
                    "long factors (transformers keeps the short ones for sequences within the original context, "
                    "so their text differs from transformers')", path.name, max_model_len,
                    rope_parameters(config.get_text_config())["original_max_position_embeddings"])
    generation = {**generation_defaults(gguf), **generation}
    kernel = (packed_choice or packed_kernel()) if packed or quantization in QUANTIZE_MODES else None
    torch_dtype = resolve_dtype(dtype, config, gguf is not None, kernel is not None)
    kv_cache_dtype = (torch.bfloat16 if kernel is not None and kernel.native is not None and dtype == "auto"
                      else torch_dtype)
    architectures = architectures or BUILTIN_ARCHITECTURES
    model_config = config if shard is None else shard.model_config(config, architectures)
    model = build_model(model_config, architectures, ops or select_ops(device), device, torch_dtype)
    halves = half_kernels(device, torch_dtype, shard is not None, packed)  # packed: from a GGUF file
    if shard is not None:
        weights = shard.weights(weights)
    elif halves is not None and torch_dtype == torch.float32:
        weights = keep_sixteen_bit(weights)  # a GGUF file's F16 / BF16 tensors packed as they are
    with torch.inference_mode():
        native = kernel.native if kernel is not None else None
        with attaching_as_loaded(model, torch_dtype, native, halves):
            left = model.load_weights(weights) or {}
        attach_quantized(model, left, torch_dtype, native, halves)
        if quantization in QUANTIZE_MODES:
            count = quantize_model(model, quantization, torch_dtype, native)
            log.info("quantized %d linear layers to %s at load", count, quantization)
        _pack_halves(model, halves, torch_dtype)
    _use_dense_matmul(model, device, torch_dtype)
    if shard is not None:
        shard.parallelize(model)
    positions = getattr(model, "max_positions", None) or context_positions(config.get_text_config())
    if max_model_len and max_model_len < positions:
        positions = fit_rotary_tables(model, max_model_len)
    elif (rows := rotary_rows(model)) is not None and rows < positions:
        log.info("%s: serving %d of its %d positions (its rotary tables' first rows); --max-model-len serves more",
                 path.name, rows, positions)
        positions = rows
    trim_heap()  # the load's staging copies and parsing leave ~350 MB freed but kept (default model: 929 -> 582)
    return LoadedModel(
        model=model.eval(),
        tokenizer=tokenizer,
        hf_config=config,
        generation_config=generation,
        dtype=torch_dtype,
        kv_cache_dtype=kv_cache_dtype,
        chat_template=getattr(tokenizer, "chat_template", None) or legacy_chat_template(path),
        max_model_len=positions,  # the positions the rotary tables (an encoder's learned positions) hold
        source=str(gguf or path),
        quantization=_describe_weights(model),
    )


def legacy_chat_template(path: Path) -> str | None:
    """The template of a folder's ``chat_template.json`` (``{"chat_template": "..."}``), the processor file
    older vision checkpoints ship instead of a tokenizer template; transformers' AutoProcessor reads it.
    A list or mapping of named templates gives the one named "default"."""
    legacy = path / "chat_template.json"
    if not path.is_dir() or not legacy.is_file():
        return None
    template = json.loads(legacy.read_text(encoding="utf-8")).get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}], as tokenizer_config.json allows
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) and template else None


def _open(path: Path, gguf: Path | None, packed: bool, cache_dir, use_cache: bool):
    """(config, tokenizer, weights, generation config) of a checkpoint; ``packed`` reads a GGUF file's
    tensors as they are stored."""
    cache_root = Path(cache_dir) if cache_dir else None
    if gguf is not None and packed:
        folder = cached_gguf_folder(gguf, cache_root, with_weights=False)
        config, tokenizer, _, generation = _open_hf_folder(folder, converted=True)
        return config, tokenizer, gguf_weights(gguf, config, cache_root or default_cache_dir()), generation
    if gguf is not None:
        return _open_hf_folder(cached_gguf_folder(gguf, cache_root), converted=True) if use_cache else _open_gguf(gguf)
    return _open_hf_folder(path)


def _pack_halves(model: nn.Module, kernels: CpuKernels | None, dtype: torch.dtype) -> None:
    """A bf16 model's weights, and a float32 model's from a GGUF file that 16 bits hold (its F16 / BF16
    tensors, attached as they are, and any float32 weight of exact 16-bit values), on the native
    ``kernels`` (``half_weights.half_kernels``; None: torch keeps them) (native/half_weights.py)."""
    if kernels is None:
        return
    if dtype == torch.bfloat16:
        pack_bfloat16(model, kernels)
    else:
        pack_exact_halves(model, kernels)
    count = sum(1 for m in model.modules() if isinstance(m, NativeWeight) and m.bits == 16)
    if count:
        log.info("16-bit weights: %d linear layers multiplied by the native %s kernel in %s (native/half_weights.py)",
                 count, kernels.variant, str(dtype).replace("torch.", ""))


def _use_dense_matmul(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    matmul = select_matmul(model, device, dtype)
    if matmul is not None:
        log.info("this CPU has no native %s matrix instructions: GEMMs of 4+ rows run in float32 on the %s "
                 "weights", dtype, dtype)
    use_matmul(model, matmul)


def _describe_weights(model: nn.Module) -> str:
    """``"none"``, or what the packed layers hold, e.g. ``"codes x1, int4 x120, int8-native x1"`` (int8:
    8-bit codes as two 4-bit planes for torch's kernel; -native: the plugin's own kernel; codes: an
    embedding table kept quantized). 16-bit float weights on the native kernels are not quantized: not
    counted (the load logs them)."""
    kinds: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, NativeWeight) and module.bits == 16:
            continue
        if isinstance(module, (AffineRows, Int4Weight, NativeWeight)):
            name = "codes" if isinstance(module, AffineRows) else module.kind
            kinds[name] = kinds.get(name, 0) + 1
    return ", ".join(f"{k} x{n}" for k, n in kinds.items()) or "none"


def resolve_dtype(dtype: str | torch.dtype, config: Any, is_gguf: bool = False, packed: bool = False) -> torch.dtype:
    """The dtype named, else: the packed kernels' fastest on this CPU for a model with packed weights,
    float32 for a dequantized GGUF file, the checkpoint's own."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
    if packed:
        return packed_kernel().dtype
    if is_gguf:
        return torch.float32
    found = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(found, str):
        found = DTYPES.get(found.replace("torch.", ""), None)
    return found if isinstance(found, torch.dtype) else torch.float32


def architecture_of(config: Any) -> str:
    archs = list(getattr(config, "architectures", None) or [])
    if archs:
        return archs[0]
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(getattr(config, "model_type", ""))
    if name is None:
        raise ValueError(
            f"cannot tell the architecture of model_type {getattr(config, 'model_type', None)!r}"
        )
    return name


def build_model(
    config: Any,
    architectures: Mapping[str, type | str],
    ops: Any,
    device: str | torch.device,
    dtype: torch.dtype,
) -> nn.Module:
    """An unloaded model (uninitialised weights) of the config's architecture."""
    arch = architecture_of(config)
    if arch not in architectures:
        raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(sorted(architectures))}")
    cls = resolve_class(architectures[arch])
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # parameters are born in their dtype: no float32 copy to convert
    try:
        with torch.device(device):
            model = cls(config, ops)
    finally:
        torch.set_default_dtype(default)
    return model.to(dtype=dtype)


# ---------------------------------------------------------------- Hugging Face folders


def _open_hf_folder(path: Path, converted: bool = False):
    """(config, tokenizer, weights, generation config) of an HF folder; ``converted``: one this loader made
    from a GGUF file, whose config and tokenizer are read without transformers' per-architecture lookups
    where they can be (``light_config``)."""
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is neither a .gguf file nor a folder with config.json")
    kept = read_light_config(path) if converted else None
    if kept is not None:
        config, tokenizer_class = kept
        tokenizer = None if tokenizer_class is None else tokenizer_class.from_pretrained(path)
    else:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(path)
        tokenizer = _load_tokenizer(path, config)
        if converted:
            write_light_config(config, path, None if tokenizer is None else type(tokenizer))
    generation_file = path / "generation_config.json"
    generation = json.loads(generation_file.read_text()) if generation_file.is_file() else {}
    return config, tokenizer, _safetensors_weights(path), generation


def _load_tokenizer(path: Path, config: Any):
    """The folder's tokenizer (None where it ships none); handed ``config``, AutoTokenizer does not load it again."""
    from transformers import AutoTokenizer

    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((path / n).is_file() for n in names):
        return None
    return AutoTokenizer.from_pretrained(path, config=config)


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / name for name in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors weights in {path}")
    return files


def _safetensors_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = _safetensors_files(path)
    handles = [safe_open(str(f), framework="pt", device="cpu") for f in files]
    total = sum(len(list(h.keys())) for h in handles)
    with tqdm(total=total, desc=f"Loading {path.name}", unit="tensor", leave=False) as bar:
        for handle in handles:
            for name in handle.keys():
                yield name, handle.get_tensor(name)
                bar.update(1)


# ---------------------------------------------------------------- GGUF files


def _gguf_file(path: Path) -> Path | None:
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir() and not (path / "config.json").is_file():
        found = sorted(path.glob("*.gguf"))
        if len(found) == 1:
            return found[0]
    if not path.exists():
        raise FileNotFoundError(f"no checkpoint at {path}")
    return None


def _open_gguf(gguf: Path):
    """(config, tokenizer, dense float32 weights, {}) of a GGUF file: ``gguf_weights`` with each packed
    tensor dequantized (exactly the values llama.cpp's dequantization gives: ``quant.gguf_blocks``), so a
    dense load reads the file as the packed one does (the same names, row orders and expert stacks)."""
    from transformers import AutoTokenizer

    config = gguf_config(gguf)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return config, tokenizer, _dequantized(gguf_weights(gguf, config)), {}


def _dequantized(weights: Iterator[tuple[str, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, weight in weights:
        yield name, torch.from_numpy(weight.dequantize()) if isinstance(weight, AffineWeight) else weight.float()


def default_cache_dir() -> Path:
    return cache_folder("gguf")


def cached_gguf_folder(gguf: Path, cache_root: Path | None = None, with_weights: bool = True) -> Path:
    """An HF folder (config, tokenizer and, ``with_weights``, float32 safetensors) converted from ``gguf``
    once, keyed by the file's name, size and content (``gguf_fingerprint``), under ``cache_root``
    (default: ``default_cache_dir()``). Not by mtime: a reinstalled package (a new virtualenv, a fresh
    clone's nox session) has a new mtime and would convert again, a few seconds of every first start.

    Serving the file's packed tensors needs only the config and tokenizer, which convert in a few seconds;
    the dequantized weights are added the first time a dense load asks for them.
    """
    cache_root = cache_root or default_cache_dir()
    folder = cache_root / f"{gguf.stem}-{gguf.stat().st_size}-{gguf_fingerprint(gguf)}-v{GGUF_CACHE_VERSION}"
    if not (folder / _COMPLETE_MARKER).is_file():
        cache_root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cache_root))
        try:
            _convert_gguf_metadata(gguf, tmp)
            shutil.rmtree(folder, ignore_errors=True)
            os.replace(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if with_weights and not (folder / _WEIGHTS_MARKER).is_file():
        _convert_gguf_weights(gguf, folder)
    return folder


FINGERPRINT_HEAD = 8 << 20  # the header (metadata, tokenizer) and the first tensors
FINGERPRINT_SAMPLES, FINGERPRINT_SAMPLE = 32, 64 << 10  # and 32 slices of 64 KiB spread over the rest


def gguf_fingerprint(gguf: Path) -> str:
    """16 hex digits of SHA-256 over the file's first 8 MiB and 32 slices of 64 KiB spread over the rest
    (a few milliseconds: two files alike there but not elsewhere are not a case to guard against)."""
    size = gguf.stat().st_size
    digest = hashlib.sha256()
    with gguf.open("rb") as f:
        digest.update(f.read(FINGERPRINT_HEAD))
        for i in range(FINGERPRINT_SAMPLES):
            f.seek(FINGERPRINT_HEAD + (size - FINGERPRINT_HEAD) * i // FINGERPRINT_SAMPLES if size > FINGERPRINT_HEAD else 0)
            digest.update(f.read(FINGERPRINT_SAMPLE))
    return digest.hexdigest()[:16]


def gguf_config(gguf: Path) -> Any:
    """transformers' config of a GGUF file, completed from the file where transformers' GGUF mapping for its
    architecture lacks a key the file states: the attention heads' width (``{arch}.attention.key_length``;
    Qwen3's mapping in transformers 5.x: a file whose heads are not 128 wide got 128, and its q/k norms'
    weights did not fit), the rotary base (``{arch}.rope.freq_base``; StarCoder 2's and StableLM's: a
    StarCoder 2 file got the config class's default of 10,000, not its own) and the values of each head
    rotary turns (``{arch}.rope.dimension_count``; StableLM's: the default quarter whatever the file said),
    the experts' widths (``_experts_from_file``), gpt-oss's window (``_sliding_window_from_file``), and a
    Llama file's experts (``_mixtral_of_llama_file``)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    index = read_gguf_index(gguf)
    metadata, architecture = index.metadata, index.architecture
    config = _mixtral_of_llama_file(config, metadata, architecture, gguf.name)
    key_length = metadata.get(f"{architecture}.attention.key_length")
    value_length = metadata.get(f"{architecture}.attention.value_length", key_length)
    if (isinstance(key_length, int) and key_length > 0 and key_length == value_length
            and isinstance(getattr(config, "head_dim", None), int) and config.head_dim != key_length):
        log.info("%s: head_dim %d from the file's %s.attention.key_length (transformers' config said %d)",
                 gguf.name, key_length, architecture, config.head_dim)
        config.head_dim = key_length
    _rope_from_file(config, metadata, architecture, gguf.name)
    _experts_from_file(config, metadata, architecture, gguf.name)
    _sliding_window_from_file(config, metadata, architecture, gguf.name)
    _rope_factors_from_file(config, index.tensors, gguf.name)
    _longrope_from_file(config, index.tensors, metadata, architecture, gguf.name)
    return config


#: llama.cpp's converter writes Llama 3.1's rope scaling (``llama3``) as this tensor of per-frequency divisors
#: and no keys; Phi-3's LongRoPE as the other two
ROPE_FACTORS_TENSOR, LONGROPE_TENSORS = "rope_freqs.weight", ("rope_factors_long.weight", "rope_factors_short.weight")


def _rope_factors_from_file(config: Any, tensors: list[TensorEntry], name: str) -> None:
    """The file's per-frequency rotary divisors into ``config.rope_parameters["rope_freq_factors"]``
    (layers.rotary divides the frequencies by them, as llama.cpp does): transformers' GGUF loading reads no
    such tensor, so a Llama 3.1 / 3.2 file ran at unscaled frequencies."""
    import numpy as np

    by_name = {tensor.name: tensor for tensor in tensors}
    factors = by_name.get(ROPE_FACTORS_TENSOR)
    if factors is None:
        return
    params = getattr(config, "rope_parameters", None)
    if (not isinstance(params, dict) or any(isinstance(value, dict) for value in params.values())
            or params.get("rope_type", "default") != "default"):
        raise NotImplementedError(f"{name}: {ROPE_FACTORS_TENSOR} beside rope settings {params!r}")
    params["rope_freq_factors"] = np.asarray(factors.data, dtype=np.float32).reshape(-1).tolist()
    log.info("%s: %d rotary frequency divisors from the file's %s", name, len(params["rope_freq_factors"]),
             ROPE_FACTORS_TENSOR)


def _longrope_from_file(config: Any, tensors: list[TensorEntry], metadata: dict[str, Any], architecture: str,
                        name: str) -> None:
    """Phi-3's LongRoPE as llama.cpp's converter writes it (its factors as the two tensors, the original
    context as ``{arch}.rope.scaling.original_context_length``, the attention factor as
    ``{arch}.rope.scaling.attn_factor``) into ``config.rope_parameters``, which transformers' GGUF mapping
    leaves at default frequencies. layers.rotary serves it over the original context, with the short factors."""
    import numpy as np

    by_name = {tensor.name: tensor for tensor in tensors}
    present = [tensor for tensor in LONGROPE_TENSORS if tensor in by_name]
    if not present:
        return
    original = metadata.get(f"{architecture}.rope.scaling.original_context_length")
    params = getattr(config, "rope_parameters", None)
    if (len(present) < 2 or not isinstance(original, int) or original <= 0 or not isinstance(params, dict)
            or params.get("rope_type", "default") != "default"):
        raise NotImplementedError(f"{name}: LongRoPE needs both {' and '.join(LONGROPE_TENSORS)}, a positive "
                                  f"{architecture}.rope.scaling.original_context_length and no other rope scaling")
    long_factor, short_factor = (np.asarray(by_name[tensor].data, dtype=np.float32).reshape(-1).tolist()
                                 for tensor in LONGROPE_TENSORS)
    params.update(rope_type="longrope", long_factor=long_factor, short_factor=short_factor,
                  original_max_position_embeddings=original)
    attention = metadata.get(f"{architecture}.rope.scaling.attn_factor")
    if isinstance(attention, (int, float)) and attention > 0:
        params["attention_factor"] = float(attention)
    log.info("%s: LongRoPE from the file (%d short factors), served over its original %d positions", name,
             len(short_factor), original)


def _rope_from_file(config: Any, metadata: dict[str, Any], architecture: str, name: str) -> None:
    """The file's rotary base and rotated width into ``config.rope_parameters`` where they differ (one table
    for every layer only: Gemma's per-layer-type settings are mapped by transformers)."""
    from .layers.rotary import rope_parameters, rotary_dim_of
    from .models.llama import head_dim_of

    params = getattr(config, "rope_parameters", None)
    if not isinstance(params, dict) or any(isinstance(value, dict) for value in params.values()):
        return
    theta = metadata.get(f"{architecture}.rope.freq_base")
    if isinstance(theta, (int, float)) and theta > 0 and float(theta) != float(rope_parameters(config)["rope_theta"]):
        log.info("%s: rope_theta %s from the file's %s.rope.freq_base", name, theta, architecture)
        params["rope_theta"] = float(theta)
    rotated, head_dim = metadata.get(f"{architecture}.rope.dimension_count"), head_dim_of(config)
    if isinstance(rotated, int) and 0 < rotated < head_dim and rotated != rotary_dim_of(config, head_dim):
        log.info("%s: rotary on %d of each head's %d values from the file's %s.rope.dimension_count", name,
                 rotated, head_dim, architecture)
        factor = rotated / head_dim
        params["partial_rotary_factor"] = factor if int(head_dim * factor) == rotated else (rotated + 0.5) / head_dim


def _mixtral_of_llama_file(config: Any, metadata: dict[str, Any], architecture: str, name: str) -> Any:
    """A Mixtral config where a ``llama`` file has experts (``llama.expert_count``: llama.cpp writes Mixtral,
    and Mistral's other sparse models, as Llama with stacked experts), else ``config``: transformers maps
    such a file to a dense Llama, whose MLPs the file does not have."""
    experts = metadata.get(f"{architecture}.expert_count")
    if architecture != "llama" or not isinstance(experts, int) or experts <= 0:
        return config
    from transformers import MixtralConfig

    values = {key: value for key, value in config.to_dict().items()
              if key not in ("model_type", "architectures", "transformers_version", "mlp_bias", "pretraining_tp")}
    used = metadata.get(f"{architecture}.expert_used_count")
    mixtral = MixtralConfig(**values, num_local_experts=experts,
                            num_experts_per_tok=used if isinstance(used, int) and used > 0 else 2)
    mixtral.architectures = ["MixtralForCausalLM"]
    log.info("%s: a Llama file with %d experts, %d a token: read as Mixtral", name, experts,
             mixtral.num_experts_per_tok)
    return mixtral


#: llama.cpp's keys for the width of each routed and of the shared expert -> the HF config's fields
EXPERT_WIDTHS = {"expert_feed_forward_length": "moe_intermediate_size",
                 "expert_shared_feed_forward_length": "shared_expert_intermediate_size"}


def _experts_from_file(config: Any, metadata: dict[str, Any], architecture: str, name: str) -> None:
    """The file's expert widths (``EXPERT_WIDTHS``) into the config fields the model has: transformers'
    mappings for Qwen2-MoE and Qwen3-MoE read neither, so any width but the config class's default (768 for
    Qwen3-MoE, 1408 for Qwen2-MoE) did not fit the file's expert tensors."""
    for key, attribute in EXPERT_WIDTHS.items():
        width = metadata.get(f"{architecture}.{key}")
        if isinstance(width, int) and width > 0 and hasattr(config, attribute) and getattr(config, attribute) != width:
            log.info("%s: %s %d from the file's %s.%s", name, attribute, width, architecture, key)
            setattr(config, attribute, width)


def _sliding_window_from_file(config: Any, metadata: dict[str, Any], architecture: str, name: str) -> None:
    """The file's ``{arch}.attention.sliding_window`` where the config has a window: transformers' mapping for
    gpt-oss looks for ``gpt-oss.sliding_window``, so any window but the class's 128 was lost."""
    window = metadata.get(f"{architecture}.attention.sliding_window")
    if isinstance(window, int) and window > 0 and getattr(config, "sliding_window", None) not in (None, window):
        log.info("%s: sliding_window %d from the file's %s.attention.sliding_window", name, window, architecture)
        config.sliding_window = window


def _convert_gguf_metadata(gguf: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    folder, name = str(gguf.parent), gguf.name
    with _gguf_read_once():
        config = gguf_config(gguf)
        if not getattr(config, "architectures", None):
            config.architectures = [architecture_of(config)]
        config.save_pretrained(out)
        AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    (out / _COMPLETE_MARKER).write_text(str(gguf))


_GGUF_READ_LOCK = threading.Lock()


@contextmanager
def _gguf_read_once() -> Iterator[None]:
    """transformers' ``load_gguf_checkpoint`` without tensors, read once per file inside the block: its
    config and its tokenizer each read the whole file's metadata with gguf-py's reader (the default model:
    ~4 s each on a 2-core Zen 5 EPYC, the 49,152-token vocabulary a field at a time), the same dict both
    times. Each caller gets its own copy; the function is restored after the block."""
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    with _GGUF_READ_LOCK:
        original, read = gguf_utils.load_gguf_checkpoint, {}

        def load_once(path, *args, **kwargs):
            if args or kwargs.keys() - {"return_tensors"} or kwargs.get("return_tensors"):
                return original(path, *args, **kwargs)  # tensors asked for: not what the block reads twice
            if str(path) not in read:
                read[str(path)] = original(path, return_tensors=False)
            return copy.deepcopy(read[str(path)])

        gguf_utils.load_gguf_checkpoint = load_once
        try:
            yield
        finally:
            gguf_utils.load_gguf_checkpoint = original


def _convert_gguf_weights(gguf: Path, folder: Path) -> None:
    """Dequantized float32 weights into ``folder``, written under a temporary name and renamed."""
    from safetensors.torch import save_file

    _, _, weights, _ = _open_gguf(gguf)
    tensors = {name: t.contiguous() for name, t in weights}
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".part", dir=folder)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": "pt", "source": gguf.name})
        os.replace(tmp, folder / "model.safetensors")
    finally:
        Path(tmp).unlink(missing_ok=True)
    (folder / _WEIGHTS_MARKER).write_text(str(gguf))
