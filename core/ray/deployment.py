"""The Ray Serve deployment of R engine replicas behind one HTTP endpoint.

Ray Serve's proxy receives every request and its router picks a replica (power of two choices over the
replicas' queue lengths); each replica runs the app `core serve` runs, so the routes, streaming and
error bodies are the same. Health checks (`EngineReplica.check_health`) and restarts are Ray's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ray import serve
from ray.serve import Application
from ray.serve.deployment import Deployment

from core.config import EngineConfig
from core.ray.replica import EngineReplica

DEPLOYMENT_NAME = "Engine"
HEALTH_CHECK_PERIOD_S = 5.0  # a dead engine is noticed within this (a dead process at once)


def engine_deployment(*, replicas: int = 1, max_ongoing_requests: int = 256,
                      ray_actor_options: Mapping[str, Any] | None = None, **options: Any) -> Deployment:
    """The engine replicas as a Ray Serve deployment, not yet bound to a config.

    :param replicas: how many engines Ray keeps running (`num_replicas`).
    :param max_ongoing_requests: requests one replica holds at once; the rest wait in Ray's router, which
        can then hand them to a less busy replica. Match it to the engine's batch (`max_num_seqs`).
    :param ray_actor_options: each replica's resources, e.g. {"num_cpus": 2} or {"num_gpus": 1}.
    :param options: any other `serve.deployment` option (autoscaling_config, health_check_timeout_s...).
    :raises ValueError: when `replicas` is below 1.
    """
    if replicas < 1:
        raise ValueError(f"replicas must be at least 1, got {replicas}")
    body = serve.ingress()(EngineReplica)
    settings = {"name": DEPLOYMENT_NAME, "num_replicas": replicas, "max_ongoing_requests": max_ongoing_requests,
                "health_check_period_s": HEALTH_CHECK_PERIOD_S, "ray_actor_options": dict(ray_actor_options or {}),
                **options}
    return serve.deployment(body, **settings)


def engine_app(config: EngineConfig, *, app_options: Mapping[str, Any] | None = None, replicas: int = 1,
               ray_actor_options: Mapping[str, Any] | None = None, **options: Any) -> Application:
    """An application of `replicas` engines built from `config`, ready for `serve.run(app, route_prefix=...)`.

    :param app_options: keyword arguments of `core.server.app.build_app` (api_key, reasoning_parser,
        tool_call_parser, limits, web_ui), the same on every replica.
    The other parameters are `engine_deployment`'s; `max_ongoing_requests` defaults to `config.max_num_seqs`.
    """
    options.setdefault("max_ongoing_requests", config.max_num_seqs)
    deployment = engine_deployment(replicas=replicas, ray_actor_options=ray_actor_options, **options)
    return deployment.bind(config, dict(app_options or {}))
