"""Benchmarks: `core bench serve` drives any OpenAI-compatible server, `core bench offline` the engine.

One concept per module: datasets (what is sent), arrivals (when), client (one timed stream), metrics
(the numbers), serve and offline (the two runs), progress (the bar), commands (the CLI). Nothing here
imports torch at module level.
"""
