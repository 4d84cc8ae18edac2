"""Serve one model as R engine replicas behind one endpoint, on Ray Serve (`pip install 'core-serve[ray]'`).

`core serve MODEL --replicas R [--ray-address auto|ADDRESS]` runs it from the command line; to compose
your own Ray Serve application, build the deployment here::

    from ray import serve
    from core.config import EngineConfig
    from core.ray import engine_app

    app = engine_app(EngineConfig(model="/models/llama"), replicas=2, ray_actor_options={"num_gpus": 1})
    serve.run(app, name="core", route_prefix="/")   # the OpenAI and Anthropic routes, streaming included

Each replica is an `EngineReplica`: one `AsyncEngine` and the FastAPI app `core serve` runs over it
(`core.server.app.build_app`). Routing, health checks (`EngineReplica.check_health`) and restarts are
Ray Serve's; every response names its replica in the `X-Core-Replica` header. A replica that dies is
replaced by Ray; the requests it held fail (a 500, or a stream cut short), the others are untouched.
Nothing here is imported by `import core`.
"""

from __future__ import annotations

RAY_INSTALL = "pip install 'core-serve[ray]'"

try:
    import ray.serve  # noqa: F401
except ImportError as exc:
    raise ImportError(f"core.ray needs Ray Serve: {RAY_INSTALL} ({exc})", name="ray") from exc

from core.ray.deployment import engine_app, engine_deployment  # noqa: E402
from core.ray.middleware import REPLICA_HEADER  # noqa: E402
from core.ray.replica import EngineDiedError, EngineReplica  # noqa: E402

__all__ = ["REPLICA_HEADER", "EngineDiedError", "EngineReplica", "engine_app", "engine_deployment"]
