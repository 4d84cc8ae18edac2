"""Command-line options shared by every command that builds an engine (`core serve`, `chat`, `generate`,
`bench offline`), and the EngineConfig they describe. Light: importing it loads neither torch nor the
server.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from core.config import QUANTIZATIONS
from core.content_format import CONTENT_FORMATS

if TYPE_CHECKING:
    from core.config import EngineConfig
    from core.speculative import SpeculativeConfig

ENGINE_FLAGS = ("backend", "dtype", "quantization", "device", "max_model_len", "block_size", "kv_cache_memory_gib",
                "max_num_seqs", "max_num_batched_tokens", "chat_template", "served_model_name",
                "allow_special_tokens_in_content", "chat_template_content_format", "structured_output_engine",
                "tensor_parallel_size")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by every command that builds an engine."""
    g = parser.add_argument_group("engine")
    g.add_argument("--backend", help="backend name (see `core plugins`); default: best available")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--quantization", default="auto", choices=list(QUANTIZATIONS),
                   help="auto: a GGUF file's quantized weights stay packed (CPU); none: dequantize them; "
                        "int8 / int4: quantize a float checkpoint at load (CPU)")
    g.add_argument("--device", help="cpu, cuda or cuda:N (default: the backend's choice)")
    g.add_argument("--max-model-len", type=int, help="context window (default: the model's)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument("--kv-cache-memory", dest="kv_cache_memory_gib", type=float, metavar="GIB",
                   help="KV-cache budget in GiB (default: a fraction of free GPU memory, or 1 GiB on CPU)")
    g.add_argument("--max-num-seqs", type=int, default=256, help="most sequences in one batch")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable prefix caching")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, metavar="N",
                   help="shard the model over N ranks (processes; gloo on the CPU, NCCL on GPUs), each holding "
                        "1/N of every layer and its own KV-cache shard; default: 1")
    g.add_argument("--enforce-eager", action="store_true",
                   help="run every step through the model's modules: no CUDA graphs, no native CPU decode "
                        "stack (the backend option enforce_eager)")
    g.add_argument("--amx-rows", choices=["prompt", "all", "none"],
                   help="on a CPU with AVX512-BF16, which rows the packed weights multiply by their bfloat16 "
                        "prompt loop (on the AMX tiles where the CPU has them): prompt (prompt tokens: the "
                        "default), all (generated tokens too: faster at many streams, several times slower for "
                        "one) or none (every row by the VNNI loop: closer to the float model, prompts slower); "
                        "the backend option amx_rows")
    g.add_argument("--kv-cache-dtype", choices=["auto", "int8"],
                   help="auto: the model's dtype (bfloat16 for a GGUF on the CPU); int8 (CPU): each position's "
                        "keys and values as 8-bit codes with a scale and a minimum a head, 1.8x the tokens in the "
                        "same memory, slightly less exact (the backend option kv_cache_dtype)")
    g.add_argument("--chat-template", help="a registered template name or a Jinja file")
    g.add_argument("--chat-template-content-format", choices=list(CONTENT_FORMATS),
                   help="how message content reaches the template: string (text parts joined with a newline), "
                        "openai (a list of parts, as sent) or auto (detected from the template; the default)")
    g.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="the model names clients use: the first is reported in responses, all are accepted")
    g.add_argument("--structured-output-engine", metavar="NAME",
                   help="the grammar engine of structured output (see `core plugins`); default: xgrammar")
    g.add_argument("--allow-special-tokens-in-content", action="store_true", default=None,
                   help="let control strings in message text (<|im_end|>, ...) become control tokens; by "
                        "default they stay text, so a client cannot forge turns")
    add_speculative_arguments(parser)


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    """Speculative decoding (core.speculative): off unless --speculative names a proposer."""
    from core.speculative import SpeculativeConfig

    g = parser.add_argument_group("speculative decoding")
    g.add_argument("--speculative", metavar="METHOD",
                   help="propose tokens and verify them in one forward pass: ngram (prompt lookup), draft "
                        "(a draft model), or a plugin's proposer; default: off")
    g.add_argument("--num-speculative-tokens", type=int, default=SpeculativeConfig.num_speculative_tokens,
                   metavar="K", help="most tokens proposed per sequence and step")
    g.add_argument("--ngram-min", type=int, default=SpeculativeConfig.ngram_min, metavar="N",
                   help="shortest suffix prompt lookup matches")
    g.add_argument("--ngram-max", type=int, default=SpeculativeConfig.ngram_max, metavar="M",
                   help="longest suffix prompt lookup tries first")
    g.add_argument("--draft-model", metavar="PATH", help="the draft model of --speculative draft")
    g.add_argument("--no-speculative-backoff", dest="speculative_backoff", action="store_false",
                   help="always propose K tokens, even for sequences whose proposals are rarely accepted "
                        "(default: each sequence's draft length follows its measured acceptance)")


def add_media_arguments(parser: argparse.ArgumentParser) -> None:
    """Where request images may come from (vision-language models), and their limits."""
    from core.media import DOMAINS_FLAG, LOCAL_PATH_FLAG, MediaPolicy

    g = parser.add_argument_group("images (vision-language models)")
    g.add_argument(DOMAINS_FLAG, dest="allowed_media_domains", nargs="+", metavar="DOMAIN", default=[],
                   help="domains (and their subdomains) that http(s) image URLs may name; default: none")
    g.add_argument(LOCAL_PATH_FLAG, dest="allowed_local_media_path", metavar="DIR",
                   help="allow local image files (paths, file:// URLs) under DIR; default: none")
    g.add_argument("--max-images-per-request", type=int, default=MediaPolicy.max_images_per_request)
    g.add_argument("--max-image-bytes", type=int, default=MediaPolicy.max_image_bytes,
                   help="largest encoded image, in bytes")
    g.add_argument("--max-image-pixels", type=int, default=MediaPolicy.max_image_pixels,
                   help="largest decoded image, width x height")
    g.add_argument("--media-fetch-timeout", dest="fetch_timeout_s", type=float,
                   default=MediaPolicy.fetch_timeout_s, metavar="SECONDS", help="time limit of one image fetch")


def add_adapter_arguments(parser: argparse.ArgumentParser) -> None:
    """LoRA adapters served beside the base model (core.adapters)."""
    from core.adapters import AdapterPolicy

    g = parser.add_argument_group("LoRA adapters")
    g.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH", default=[],
                   help="PEFT adapter folders to load at start-up; a request's model NAME runs through one")
    g.add_argument("--max-loras", type=int, default=AdapterPolicy.max_loras,
                   help="adapters resident at once (others wait on host, least recently used evicted)")
    g.add_argument("--max-lora-rank", type=int, default=AdapterPolicy.max_lora_rank, help="the largest rank accepted")
    g.add_argument("--enable-runtime-lora", dest="runtime_loading", action="store_true",
                   help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (off by default)")
    g.add_argument("--allowed-lora-path", dest="allowed_paths", nargs="+", metavar="DIR", default=[],
                   help="folders runtime loading may read adapters from; default: none")


def add_replica_arguments(parser: argparse.ArgumentParser) -> None:
    """Replicas of the engine on Ray Serve (core.ray; needs `pip install 'core-serve[ray]'`)."""
    g = parser.add_argument_group("replicas through Ray (pip install 'core-serve[ray]')")
    g.add_argument("--replicas", type=_positive_int, metavar="R",
                   help="serve R engine replicas behind one endpoint with Ray Serve (routing, health checks "
                        "and restarts are Ray's); default: one engine in this process, no Ray")
    g.add_argument("--ray-address", metavar="auto|ADDRESS",
                   help="the Ray cluster of --replicas: auto (the running one), host:port, or local (a new "
                        "instance); default: $RAY_ADDRESS, else a Ray instance started for this command")
    g.add_argument("--replica-cpus", type=float, default=1.0, metavar="N",
                   help="CPUs Ray reserves for each replica (default: 1)")
    g.add_argument("--replica-gpus", type=float, metavar="N",
                   help="GPUs Ray reserves for each replica (default: 1 with --device cuda, else 0)")


def check_replica_arguments(args: argparse.Namespace) -> None:
    """The Ray flags other than --replicas make sense only with it."""
    if args.replicas is None:
        given = [flag for flag, value in (("--ray-address", args.ray_address), ("--replica-gpus", args.replica_gpus))
                 if value is not None]
        if given or args.replica_cpus != 1.0:
            raise SystemExit(f"core serve: {', '.join(given) or '--replica-cpus'} needs --replicas")


def _positive_int(raw: str) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {raw!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


ADAPTER_FLAGS = ("lora_modules", "max_loras", "max_lora_rank", "runtime_loading", "allowed_paths")
MEDIA_FLAGS = ("allowed_media_domains", "allowed_local_media_path", "max_images_per_request", "max_image_bytes",
               "max_image_pixels", "fetch_timeout_s")


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig the parsed engine (and, where present, media) options describe."""
    from core.adapters import AdapterPolicy
    from core.config import EngineConfig
    from core.media import MediaPolicy

    options = {name: getattr(args, name) for name in ENGINE_FLAGS if getattr(args, name, None) is not None}
    media = MediaPolicy(**{name: getattr(args, name) for name in MEDIA_FLAGS if hasattr(args, name)})
    adapters = AdapterPolicy(**{name: getattr(args, name) for name in ADAPTER_FLAGS if hasattr(args, name)})
    backend_options: dict[str, object] = {"enforce_eager": True} if args.enforce_eager else {}
    if args.amx_rows is not None:
        backend_options["amx_rows"] = args.amx_rows
    if args.kv_cache_dtype is not None:
        backend_options["kv_cache_dtype"] = args.kv_cache_dtype
    return EngineConfig(model=getattr(args, "model", None), enable_prefix_caching=not args.no_prefix_caching,
                        backend_options=backend_options, media=media, adapters=adapters,
                        speculative=speculative_config(args), **options)


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """The SpeculativeConfig of --speculative and its options; None when it is not given."""
    from core.speculative import SpeculativeConfig

    method = getattr(args, "speculative", None)
    if method is None:
        return None
    return SpeculativeConfig(method=method, num_speculative_tokens=args.num_speculative_tokens,
                             ngram_min=args.ngram_min, ngram_max=args.ngram_max, draft_model=args.draft_model,
                             backoff=args.speculative_backoff)
