"""Speculative decoding's share of a benchmark run: the server's `spec_decode_*` counters read before and
after the load (from `/metrics` for `bench serve`, from the engine's stats for `bench offline`), and the
difference reported beside the throughputs. A server without those counters (a peer, or core without
``--speculative``) reports nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_NAMES = {"num_drafts": "spec_decode_num_drafts_total",
          "num_draft_tokens": "spec_decode_num_draft_tokens_total",
          "num_accepted_tokens": "spec_decode_num_accepted_tokens_total"}


@dataclass(frozen=True)
class SpecDecodeCounts:
    """Rows that verified a proposal, tokens proposed and tokens accepted (a snapshot or a difference)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    def minus(self, before: SpecDecodeCounts) -> SpecDecodeCounts:
        return SpecDecodeCounts(self.num_drafts - before.num_drafts,
                                self.num_draft_tokens - before.num_draft_tokens,
                                self.num_accepted_tokens - before.num_accepted_tokens)

    def record(self) -> dict[str, Any]:
        """What `--json` prints."""
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "acceptance_rate": self.acceptance_rate}


def parse_metrics(text: str) -> SpecDecodeCounts | None:
    """The counters in a Prometheus scrape (any `prefix:` before the names); None when it has none."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, _, value = line.partition(" ")
        bare = name.rsplit(":", 1)[-1]
        for field, metric in _NAMES.items():
            if bare == metric:
                values[field] = int(float(value))
    return SpecDecodeCounts(**values) if values else None


async def scrape(base_url: str, api_key: str | None = None) -> SpecDecodeCounts | None:
    """The server's counters from its `/metrics`; None when it has none or no such page."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with httpx.AsyncClient(base_url=base_url.rstrip("/"), headers=headers, timeout=30.0) as http:
            response = await http.get("/metrics")
    except httpx.HTTPError:
        return None
    return parse_metrics(response.text) if response.status_code == 200 else None


def from_stats(stats: Any) -> SpecDecodeCounts | None:
    """The counters of an engine's BackendStats (None: it does not speculate)."""
    spec = getattr(stats, "spec_decode", None)
    if spec is None:
        return None
    return SpecDecodeCounts(spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens)


def difference(before: SpecDecodeCounts | None, after: SpecDecodeCounts | None) -> SpecDecodeCounts | None:
    """What the run added (None when the server has no counters)."""
    if after is None:
        return None
    return after.minus(before or SpecDecodeCounts())

