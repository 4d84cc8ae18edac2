"""The HTTP server: OpenAI- and Anthropic-compatible routes plus admin and metrics over AsyncEngine.

`build_app(engine)` (core.server.app) makes the FastAPI app; `serve(args, engine_config)`
(core.server.run) is what `core serve` runs.
"""
