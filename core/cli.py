"""The `core` command line: a thin layer over the public API.

Heavy modules (torch, the server) are imported inside the commands that need them, so `core --help` and
`core plugins` stay fast and never touch a GPU. Plugins add commands through `core_register_commands`.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from core import __version__
from core.cli_options import (
    add_adapter_arguments,
    add_engine_arguments,
    add_media_arguments,
    add_replica_arguments,
    check_replica_arguments,
    engine_config,
)
from core.errors import CoreError, PluginError

# -- plugins ---------------------------------------------------------------------------------------


def plugins_report() -> dict[str, Any]:
    """Everything `core plugins` shows, as plain data."""
    from core.plugins import get_plugins
    from core.resolve import backend_choices

    host = get_plugins()
    report: dict[str, Any] = {
        "plugins": [
            {"name": p.name, "distribution": p.distribution, "version": p.version, "hooks": list(p.hooks)}
            for p in host.info()
        ],
        "failed": [{"name": f.name, "distribution": f.distribution, "error": f.error} for f in host.failures],
        "backends": [
            {"name": c.name, "plugin": c.entry.plugin, "priority": c.priority,
             "available": c.unavailable_reason is None, "reason": c.unavailable_reason}
            for c in backend_choices(host)
        ],
    }
    for key, registry in (("model_architectures", host.model_architectures), ("chat_templates", host.chat_templates),
                          ("reasoning_parsers", host.reasoning_parsers), ("tool_call_parsers", host.tool_call_parsers),
                          ("vision_processors", host.vision_processors),
                          ("structured_output_engines", host.structured_output_engines),
                          ("speculative_proposers", host.speculative_proposers), ("commands", host.commands)):
        report[key] = [{"name": e.name, "plugin": e.plugin, **({"backend": e.scope} if e.scope else {})}
                       for e in registry]
    return report


def cmd_plugins(args: argparse.Namespace) -> int:
    report = plugins_report()
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    for p in report["plugins"]:
        print(f"{p['name']}  {p['distribution'] or '-'} {p['version'] or ''}".rstrip())
        print(f"  hooks: {', '.join(p['hooks']) or 'none'}")
    for f in report["failed"]:
        print(f"{f['name']}  FAILED TO LOAD: {f['error']}")
    print("backends (best first):")
    for b in report["backends"]:
        state = "available" if b["available"] else f"unavailable: {b['reason']}"
        print(f"  {b['name']} (priority {b['priority']}, from {b['plugin']}): {state}")
    for key in ("model_architectures", "chat_templates", "reasoning_parsers", "tool_call_parsers",
                "vision_processors", "structured_output_engines", "speculative_proposers", "commands"):
        if report[key]:
            print(f"{key.replace('_', ' ')}: {', '.join(sorted({e['name'] for e in report[key]}))}")
    return 0


# -- generate / chat -------------------------------------------------------------------------------


def _generation_config(args: argparse.Namespace) -> Any:
    from core.config import GenerationConfig

    return GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature)


def cmd_generate(args: argparse.Namespace) -> int:
    from core.pipelines import Pipeline

    if len(args.words) > 2:
        raise SystemExit("core generate: give at most a model and one prompt (quote the prompt)")
    args.model, prompt = (args.words[0], args.words[1]) if len(args.words) == 2 else (None, args.words[0])
    with Pipeline.from_config(engine_config(args)) as pipe:
        has_template = pipe.engine.chat_template is not None
        inputs: Any = [{"role": "user", "content": prompt}] if has_template and not args.raw else prompt
        print(pipe.infer(inputs, _generation_config(args)).text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from core.pipelines import ChatSession, Pipeline

    with Pipeline.from_config(engine_config(args)) as pipe:
        session, config = ChatSession(), _generation_config(args)
        print("Type a message; an empty line or Ctrl-D ends the chat.", file=sys.stderr)
        while True:
            try:
                prompt = input("you> ").strip()
            except EOFError:
                break
            if not prompt or prompt in ("exit", "quit"):
                break
            print("assistant> ", end="", flush=True)
            for delta in pipe.stream_chat(prompt, session, config):
                print(delta, end="", flush=True)
            print()
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    check_replica_arguments(args)
    if args.replicas is not None:
        return _serve_replicas(args)
    try:
        from core.server.run import serve
    except ImportError as exc:
        raise PluginError(f"the HTTP server needs its dependencies: pip install 'core-serve[serve]' ({exc})") from exc
    return serve(args, engine_config(args))


def _serve_replicas(args: argparse.Namespace) -> int:
    try:
        from core.ray.run import serve_replicas
    except ImportError as exc:
        if exc.name != "ray":
            raise
        cause = exc.__cause__ or exc  # core.ray's own ImportError wraps ray's
        raise PluginError(f"--replicas needs Ray Serve: pip install 'core-serve[ray]' ({cause})") from exc
    return serve_replicas(args, engine_config(args))


# -- parser ----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="core", description="A pluggable LLM-serving framework.")
    parser.add_argument("--version", action="version", version=f"core {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("serve", help="serve a model over an OpenAI- and Anthropic-compatible HTTP API")
    p.add_argument("model", nargs="?", help="a Hugging Face folder or .gguf file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require this key (also read from CORE_API_KEY)")
    p.add_argument("--no-web-ui", action="store_true", help="do not serve the chat page at / (see README)")
    p.add_argument("--reasoning-parser", metavar="NAME",
                   help="a registered reasoning parser, or 'none' (default: chosen by the model's architecture "
                        "and chat template when exactly one fits)")
    p.add_argument("--tool-call-parser", metavar="NAME",
                   help="a registered tool-call parser, or 'none' (default: chosen like --reasoning-parser); "
                        "used for requests that send tools")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM, how long requests in flight may finish before the rest are aborted")
    from core.server.limits import DEFAULT_MAX_QUEUED_REQUESTS, DEFAULT_MAX_REQUEST_BYTES  # light: no fastapi

    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="BYTES",
                   help="largest request body; a larger one is a 413 (default: 8 MiB)")
    p.add_argument("--max-queued-requests", type=int, default=DEFAULT_MAX_QUEUED_REQUESTS, metavar="N",
                   help="most generation requests held at once (preparing, waiting or running); past it a "
                        "503 with Retry-After (default: 1024)")
    add_engine_arguments(p)
    add_media_arguments(p)
    add_adapter_arguments(p)
    add_replica_arguments(p)
    p.set_defaults(run=cmd_serve)

    for name, help_text, run in (("generate", "generate a reply to one prompt", cmd_generate),
                                 ("chat", "chat in the terminal (the whole history is resent each turn)", cmd_chat)):
        p = sub.add_parser(name, help=help_text)
        if name == "generate":
            p.add_argument("words", nargs="+", metavar="[MODEL] PROMPT")
            p.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
        else:
            p.add_argument("model", nargs="?", help="a Hugging Face folder or .gguf file (default model if omitted)")
        p.add_argument("--max-new-tokens", type=int, default=256)
        p.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the model's)")
        add_engine_arguments(p)
        p.set_defaults(run=run)

    p = sub.add_parser("plugins", help="list installed plugins, their hooks and what they register")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=cmd_plugins)
    from core.bench.commands import add_bench_parser  # light: httpx and torch load only when a bench runs

    add_bench_parser(sub)
    _add_plugin_commands(sub)
    return parser


def _add_plugin_commands(sub: Any) -> None:
    from core.plugins import get_plugins

    for entry in get_plugins().commands:
        p = sub.add_parser(entry.name, help=entry.meta.get("help", f"(from plugin {entry.plugin})"))
        configure = entry.meta.get("configure")
        if configure is not None:
            configure(p)
        p.set_defaults(run=entry.load())


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if not getattr(args, "run", None):
        parser.print_help()
        return 0
    try:
        return int(args.run(args) or 0)
    except (CoreError, PluginError, LookupError) as exc:
        print(f"core {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
