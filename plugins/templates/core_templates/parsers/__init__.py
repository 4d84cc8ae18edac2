"""Reasoning and tool-call parsers (one module each); the contracts live in core.parsers."""
