"""The `core bench serve` and `core bench offline` subcommands: argument parsing and printing only.

Nothing heavy is imported here: httpx when `bench serve` runs, torch and the engine when `bench offline`
runs, so `core --help` stays fast.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
from pathlib import Path
from typing import Any

from core.bench.datasets import DATASETS, BenchRequest, build_requests
from core.cli_options import add_engine_arguments, engine_config


def add_bench_parser(sub: Any) -> None:
    """Register `bench` with its two subcommands on the CLI's subparsers."""
    bench = sub.add_parser("bench", help="benchmark a running server (serve) or the engine in-process (offline)")
    modes = bench.add_subparsers(dest="bench_mode", metavar="MODE", required=True)

    p = modes.add_parser("serve", help="drive an OpenAI-compatible server (ours or any other), like vLLM's")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (without /v1)")
    p.add_argument("--model", help="the model name to send (default: the first one /v1/models lists)")
    p.add_argument("--api-key", help="bearer token for servers that require one")
    p.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="requests per second, Poisson arrivals (default: inf = all at once)")
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrivals (1 = Poisson)")
    p.add_argument("--max-concurrency", type=int, help="most requests in flight at once (default: no limit)")
    _add_dataset_arguments(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the dataset and of the arrivals")
    p.add_argument("--extra-body", type=_json_object, default={},
                   help='JSON fields added to every request, e.g. \'{"min_tokens": 128}\'')
    p.add_argument("--structured", choices=["json_schema"],
                   help="run the load twice, unconstrained then under a JSON schema (vLLM's structured_outputs), "
                        "and report the constrained / unconstrained output tokens/s")
    p.set_defaults(run=cmd_bench_serve)

    p = modes.add_parser("offline", help="run the same datasets in-process through core.pipeline")
    p.add_argument("--model", help="a Hugging Face folder or .gguf file (default: SmolLM2-135M-Instruct)")
    _add_dataset_arguments(p)
    p.add_argument("--seed", type=int, default=0, help="seed of the dataset")
    add_engine_arguments(p)
    p.set_defaults(run=cmd_bench_offline)


def _add_dataset_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset", choices=DATASETS, default="random")
    g.add_argument("--dataset-path", type=Path,
                   help="multi-turn: a JSON-lines file; repeat: a file of sentences (default: shipped ones)")
    g.add_argument("--num-prompts", type=int, default=100)
    g.add_argument("--input-len", type=int, default=128, help="prompt length in words (about one token each)")
    g.add_argument("--output-len", type=int, default=128, help="tokens to generate per request")
    g.add_argument("--prefix-len", type=int, default=256, help="shared-prefix: words in the common prefix")
    g.add_argument("--range-ratio", type=float, default=0.5, help="random: lengths vary by +- this fraction")
    g.add_argument("--ignore-eos", action="store_true", help="always generate --output-len tokens")
    g.add_argument("--json", action="store_true", help="print the settings and metrics as JSON")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--request-rate must be a number or inf, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"--request-rate must be positive (or inf), got {text!r}")
    return value


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"--extra-body must be a JSON object: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("--extra-body must be a JSON object")
    return value


def requests_from(args: argparse.Namespace) -> list[BenchRequest]:
    try:
        return build_requests(args.dataset, num_prompts=args.num_prompts, input_len=args.input_len,
                              output_len=args.output_len, prefix_len=args.prefix_len, range_ratio=args.range_ratio,
                              seed=args.seed, dataset_path=args.dataset_path)
    except ValueError as exc:
        raise SystemExit(f"core bench: error: {exc}") from None


def _settings(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    names = ("dataset", "num_prompts", "input_len", "output_len", "ignore_eos", "seed")
    return {**{n: getattr(args, n) for n in names}, **extra}


def _print(metrics: Any, args: argparse.Namespace, title: str, **settings: Any) -> None:
    from core.bench.metrics import format_report
    from core.bench.serve import result_record

    if args.json:
        print(json.dumps(result_record(metrics, **_settings(args, **settings)), indent=2))
    else:
        print(format_report(metrics, title))


def cmd_bench_serve(args: argparse.Namespace) -> int:
    from core.bench.client import first_model
    from core.bench.serve import LoadOptions, benchmark_server

    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request would bury the report

    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise SystemExit(f"core bench: error: --max-concurrency must be at least 1, got {args.max_concurrency}")
    requests = requests_from(args)
    options = LoadOptions(args.request_rate, args.max_concurrency, args.burstiness, args.seed, not args.no_progress)

    async def run(extra_body: dict[str, Any]) -> Any:
        model = args.model or await first_model(args.base_url, args.api_key)
        return model, await benchmark_server(args.base_url, model, requests, options, api_key=args.api_key,
                                             ignore_eos=args.ignore_eos, extra_body=extra_body)

    if args.structured:
        return _structured_comparison(args, run)
    try:
        model, metrics = asyncio.run(run(args.extra_body))
    except (ConnectionError, OSError, ValueError) as exc:
        raise SystemExit(f"core bench serve: error: {exc}") from None
    except Exception as exc:  # httpx errors: a clear line, not a traceback
        raise SystemExit(f"core bench serve: error: cannot reach {args.base_url}: {exc}") from None
    _print(metrics, args, "Serving benchmark result", base_url=args.base_url, model=model,
           request_rate=args.request_rate, max_concurrency=args.max_concurrency)
    return 0 if metrics.failed == 0 else 1


# A schema that cannot close before --output-len tokens (64 items at least), so both runs generate the same
# number of tokens, through string, integer and structural states of the grammar.
BENCH_SCHEMA = {"type": "object", "required": ["items"], "properties": {"items": {
    "type": "array", "minItems": 64, "items": {"type": "object", "required": ["id", "name"], "properties": {
        "id": {"type": "integer"}, "name": {"type": "string", "maxLength": 16}}}}}}


def _structured_comparison(args: argparse.Namespace, run: Any) -> int:
    """The same load unconstrained, then constrained; both reports and the ratio of output tokens/s."""
    results = {}
    for name, extra in (("unconstrained", {}), ("json_schema", {"structured_outputs": {"json": BENCH_SCHEMA}})):
        try:
            model, results[name] = asyncio.run(run({**args.extra_body, **extra}))
        except Exception as exc:
            raise SystemExit(f"core bench serve: error: {exc}") from None
        _print(results[name], args, f"Serving benchmark result ({name})", base_url=args.base_url, model=model,
               structured=name, max_concurrency=args.max_concurrency)
    plain, constrained = results["unconstrained"].output_throughput, results["json_schema"].output_throughput
    ratio = constrained / plain if plain else 0.0
    print(json.dumps({"structured_ratio": ratio}) if args.json else
          f"json_schema / unconstrained output tokens/s: {constrained:.1f} / {plain:.1f} = {ratio:.2f}x")
    return 0 if all(m.failed == 0 for m in results.values()) else 1


def cmd_bench_offline(args: argparse.Namespace) -> int:
    from core.bench.offline import run_offline, warm_up
    from core.pipelines import Pipeline

    requests = requests_from(args)
    with Pipeline.from_config(engine_config(args)) as pipe:
        warm_up(pipe, requests[0])
        metrics = run_offline(pipe, requests, ignore_eos=args.ignore_eos, progress=not args.no_progress)
    _print(metrics, args, "Offline benchmark result", model=args.model or "default")
    return 0 if metrics.failed == 0 else 1
