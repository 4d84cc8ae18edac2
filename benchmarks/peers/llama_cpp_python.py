"""llama-cpp-python's OpenAI server (`python -m llama_cpp.server`) in its own virtualenv, built from source.

Its server runs one request at a time (no parallel slots), which the table shows as flat throughput.
Its build would use GGML_NATIVE=ON (ggml's default), which dies with "Illegal instruction" on the AMX
Xeons these machines have, so it gets llama-server's explicit instruction-set flags through CMAKE_ARGS
(scikit-build-core passes them to cmake). pip's wheel cache ignores CMAKE_ARGS, so that one install
skips the cache; the virtualenv's stamp includes the flags, so another CPU rebuilds it.
"""

from __future__ import annotations

from peers.common import Venv
from peers.llamacpp import VERSION, ggml_cpu_flags
from peers.peer import Context, Launch


def venv() -> Venv:
    return Venv("llama-cpp-python", [
        ["install", "--no-cache-dir", "--no-binary", "llama-cpp-python",
         f"llama-cpp-python[server]=={VERSION}"],
        ["!", "{python}", "-c", "import llama_cpp.server"],
    ], env={"CMAKE_ARGS": " ".join(ggml_cpu_flags())})


def launch(ctx: Context) -> Launch:
    env = venv().ensure()
    command = [str(env.python), "-m", "llama_cpp.server", "--model", str(ctx.gguf), "--model_alias", "smollm2",
               "--host", "127.0.0.1", "--port", str(ctx.port), "--n_threads", str(ctx.threads),
               "--n_threads_batch", str(ctx.threads), "--n_ctx", "2048",
               "--interrupt_requests", "False"]  # by default a new request cuts off the running one
    # it takes `ignore_eos` silently and ignores it; `min_tokens` holds EOS back instead
    return Launch(command, model="smollm2", version=f"llama-cpp-python {env.version_of('llama-cpp-python')}",
                  start_timeout_s=120.0, extra_body={"min_tokens": ctx.output_len},
                  build_flags=ggml_cpu_flags())
