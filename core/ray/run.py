"""`core serve MODEL --replicas R`: the engine replicas on Ray Serve, until Ctrl-C or SIGTERM.

Connects to the Ray cluster at `--ray-address` (Ray's default without it: $RAY_ADDRESS, else a new
local instance), starts Serve's HTTP proxy on --host/--port, deploys `core.ray.engine_app` and waits.
On exit the application is deleted; a Ray instance this command started is shut down with it.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time

import ray
from ray import serve

from core.config import EngineConfig
from core.ray.deployment import engine_app
from core.server.limits import ServerLimits
from core.server.run import API_KEY_VARIABLE

log = logging.getLogger("core.ray")
APP_NAME = "core"


def app_options(args: argparse.Namespace) -> dict:
    """`build_app`'s keyword arguments from `core serve`'s flags (as core.server.run passes them)."""
    return {"api_key": args.api_key or os.environ.get(API_KEY_VARIABLE) or None,
            "reasoning_parser": args.reasoning_parser, "tool_call_parser": args.tool_call_parser,
            "limits": ServerLimits.from_args(args), "web_ui": not args.no_web_ui}


def actor_options(args: argparse.Namespace, config: EngineConfig) -> dict:
    """Each replica's Ray resources: --replica-cpus, and one GPU when the device is CUDA."""
    gpus = args.replica_gpus if args.replica_gpus is not None else int((config.device or "").startswith("cuda"))
    return {"num_cpus": args.replica_cpus, "num_gpus": gpus}


def serve_replicas(args: argparse.Namespace, config: EngineConfig) -> int:
    """Deploy `args.replicas` engines behind http://HOST:PORT and block until Ctrl-C or SIGTERM (status 0)."""
    started_here = not ray.is_initialized()
    context = ray.init(address=args.ray_address) if started_here else None
    # SIGTERM ends the wait as Ctrl-C does (set after ray.init, which installs its own sys.exit handler)
    previous = signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        app = engine_app(config, app_options=app_options(args), replicas=args.replicas,
                         ray_actor_options=actor_options(args, config),
                         graceful_shutdown_timeout_s=args.shutdown_timeout)  # what SIGTERM lets finish
        _deploy(app)
        cluster = context.address_info["gcs_address"] if context is not None else "already connected"
        log.info("serving %d replica(s) of %s at http://%s:%d (Ray cluster %s)", args.replicas,
                 config.model or "the default model", args.host, args.port, cluster)
        while True:
            time.sleep(1.0)
    except KeyboardInterrupt:
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous)
        _tear_down(started_here)


def _deploy(app: serve.Application) -> None:
    """Run `app` once every replica is up; a replica that cannot start (Ray tried it a few times) is an
    exit with status 1 (its traceback is in the log above, from Ray's controller)."""
    try:
        serve.run(app, name=APP_NAME, route_prefix="/")
    except RuntimeError as exc:  # Ray's "Deploying application ... failed"
        raise SystemExit(f"core serve: the replicas did not start ({exc}); their error is logged above") from exc


def _tear_down(started_here: bool) -> None:
    """Delete the application; shut down the Ray connection this command opened."""
    try:
        serve.delete(APP_NAME)
    except Exception:  # the cluster may already be gone
        log.exception("could not delete the Ray Serve application %r", APP_NAME)
    if started_here:
        ray.shutdown()
