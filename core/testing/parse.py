"""Parsers of what the server writes, for tests, the soak and quick checks: SSE bodies and /metrics text."""

from __future__ import annotations


def parse_sse(text: str) -> list[tuple[str | None, str]]:
    """(event name, data) pairs of an SSE body."""
    events = []
    for block in text.split("\n\n"):
        name, data = None, []
        for line in block.splitlines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].strip())
        if name is not None or data:
            events.append((name, "\n".join(data)))
    return events


def parse_metrics(text: str) -> dict[str, float]:
    """Sample name (with labels) -> value of a Prometheus text page."""
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples
