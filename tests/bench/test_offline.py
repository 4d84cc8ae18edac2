"""`core bench offline`'s measurement through a Pipeline on the fake backend (no torch)."""

from __future__ import annotations

import sys

import pytest

from core.bench.datasets import fixed_requests, multi_turn_requests
from core.bench.offline import run_offline, warm_up
from core.chat_template import ChatTemplate
from core.engine import AsyncEngine
from core.pipelines import Pipeline
from core.testing.fake import FakeBackend


class PlainChat(ChatTemplate):
    """The smallest chat template: role: content lines."""

    def render(self, messages, *, add_generation_prompt=True, tools=None, **kwargs):
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant: "


@pytest.fixture
def pipe():
    backend = FakeBackend(max_model_len=4096, num_blocks=8192, block_size=16, step_delay=0.001)
    with Pipeline(AsyncEngine(backend, chat_template=PlainChat())) as pipeline:
        yield pipeline


def test_offline_counts_every_token_and_times_each_stream(pipe):
    requests = fixed_requests(6, input_len=5, output_len=9)
    warm_up(pipe, requests[0])
    metrics = run_offline(pipe, requests, ignore_eos=True, progress=False)
    assert (metrics.completed, metrics.failed) == (6, 0)
    assert metrics.total_output_tokens == 54
    assert metrics.total_input_tokens == sum(len(r.prompt.encode()) + 1 for r in requests)  # bytes + <bos>
    assert 0 < metrics.ttft_ms.mean <= metrics.e2el_ms.mean
    assert metrics.itl_ms.median > 0 and metrics.tpot_ms.mean > 0


def test_offline_runs_chat_requests(pipe):
    metrics = run_offline(pipe, multi_turn_requests(4, output_len=3), progress=False)
    assert metrics.completed == 4 and metrics.total_output_tokens == 12


def test_offline_needs_requests(pipe):
    with pytest.raises(ValueError, match="num_prompts"):
        run_offline(pipe, [], progress=False)


def test_bench_modules_do_not_import_torch():
    assert "torch" not in sys.modules or pytest.skip("torch was imported by another test in this process")
    import core.bench.commands  # noqa: F401
    import core.bench.offline  # noqa: F401
    import core.bench.serve  # noqa: F401

    assert "torch" not in sys.modules
