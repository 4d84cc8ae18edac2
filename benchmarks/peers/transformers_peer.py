"""transformers as a peer: `transformers serve --continuous-batching` when it runs here, else batched
`generate` offline (labelled so in the table), both in their own virtualenv on the bfloat16 folder."""

from __future__ import annotations

import json
from pathlib import Path

from peers.common import TORCH, Venv
from peers.peer import Context, Launch

VERSION = "5.24.0"
OFFLINE_SCRIPT = Path(__file__).with_name("transformers_offline.py")


def venv() -> Venv:
    return Venv("transformers", [
        ["install", TORCH],
        ["install", f"transformers[serving]=={VERSION}", "accelerate", TORCH],
        ["uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
        ["!", "{python}", "-c", "import transformers, fastapi, uvicorn"],
    ])


def launch_serve(ctx: Context) -> Launch:
    env = venv().ensure()
    folder = str(ctx.bf16_folder)
    command = [str(env.bin("transformers")), "serve", folder, "--continuous-batching", "--dtype", "bfloat16",
               "--device", "cpu", "--host", "127.0.0.1", "--port", str(ctx.port), "--log-level", "warning"]
    return Launch(command, model=folder, version=f"transformers {env.version_of('transformers')}",
                  env={"OMP_NUM_THREADS": str(ctx.threads), "HF_HUB_OFFLINE": "1"}, start_timeout_s=180.0,
                  ignore_eos=False, extra_body={"generation_config": fixed_length_config(ctx)})


def fixed_length_config(ctx: Context) -> str:
    """`transformers serve` rejects `ignore_eos`; its `generation_config` field (a JSON string that replaces
    the model's) gives the same fixed length: min_new_tokens = the output length, greedy."""
    config = json.loads((ctx.bf16_folder / "generation_config.json").read_text())
    config.pop("transformers_version", None)
    config.update(min_new_tokens=ctx.output_len, max_new_tokens=ctx.output_len, do_sample=False)
    return json.dumps(config)


def offline_command(ctx: Context, spec_path: Path, result_path: Path) -> tuple[list[str], str]:
    """The offline fallback: the script, its arguments, and the version string."""
    env = venv().ensure()
    command = [str(env.python), str(OFFLINE_SCRIPT), str(ctx.bf16_folder), str(spec_path), str(result_path),
               "--threads", str(ctx.threads)]
    return command, f"transformers {env.version_of('transformers')}"
