"""Hook implementations of the pytorch backend: the backend, its built-in architectures, the default
structured-output engine (xgrammar) and the n-gram proposer of speculative decoding.

Everything is registered lazily ("module:attr" strings), so `core plugins` never imports torch.
"""

from __future__ import annotations

from core import hookimpl
from core_pytorch_backend.models import BUILTIN_ARCHITECTURES

BACKEND_NAME = "pytorch"
# Below the cuda backend (20): on a GPU machine with both installed, cuda is preferred.
PRIORITY = 10


@hookimpl
def core_register_backends(register):
    register(BACKEND_NAME, "core_pytorch_backend.backend_choice:make_backend", priority=PRIORITY,
             description="paged KV cache, continuous batching, prefix caching; Triton kernels on CUDA, "
                         "plain torch on the CPU")


@hookimpl
def core_register_structured_output_engines(register):
    register("xgrammar", "core_pytorch_backend.xgrammar_engine:make_engine", priority=PRIORITY,
             description="xgrammar: JSON schema, regex, choice and EBNF grammars as token masks")


@hookimpl
def core_register_speculative_proposers(register):
    register("ngram", "core.scheduling.ngram:make_ngram_proposer",
             description="prompt lookup: the tokens that followed the latest earlier match of the last n tokens")
    register("draft", "core_pytorch_backend.speculative.draft_model:make_draft_proposer",
             description="a smaller model of the same tokenizer (--draft-model), greedy, its own paged KV cache")


@hookimpl
def core_register_model_architectures(register):
    for architecture, target in BUILTIN_ARCHITECTURES.items():
        register(architecture, target, backend=BACKEND_NAME)
