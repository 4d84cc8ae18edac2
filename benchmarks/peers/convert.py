"""Convert the default GGUF once into a bfloat16 safetensors folder (for peers that cannot read GGUF).

transformers dequantizes the GGUF but refuses to `save_pretrained` a model loaded from one, so the weights
are copied into a fresh model built from the same config and that one is saved. Runs in a subprocess
with a Python that has torch, transformers, gguf and accelerate:

    python benchmarks/peers/convert.py MODEL.gguf OUT_DIR
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

READY_MARK = ".converted"


def converted_folder(gguf: Path, out: Path, python: str = sys.executable) -> Path:
    """The folder for `gguf` (converted once, in a subprocess, with `python`)."""
    if not (out / READY_MARK).is_file():
        from peers.common import run_logged

        run_logged([python, __file__, str(gguf), str(out)], "convert-gguf")
    return out


def convert(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    config = copy.deepcopy(loaded.config)
    config.__dict__.pop("quantization_config", None)  # else readers would look for GGUF quantization
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    fresh.load_state_dict(loaded.state_dict())
    out.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    fresh.generation_config.save_pretrained(str(out))
    if "quantization_config" in (out / "config.json").read_text():
        raise RuntimeError("the saved config still names the GGUF quantization")
    (out / READY_MARK).write_text(gguf.name)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: convert.py MODEL.gguf OUT_DIR")
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
