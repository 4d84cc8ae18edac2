"""Pipeline.infer under faults: each batch item ends on its own, and work dropped by stop_all is an error."""

from __future__ import annotations

import threading

import pytest

from core import pipelines as pipeline_module
from core.chat_template import ChatTemplate
from core.config import GenerationConfig
from core.engine import AsyncEngine
from core.errors import ContextTooLongError
from core.pipelines import DROPPED_MESSAGE, Pipeline
from core.testing.fake import FakeBackend, next_token_rule
from core.vision import MultiModalInputs, PlaceholderRange, VisionProcessor

GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=6, ignore_eos=True)
MARKER = list(b"BOOM")


class PlainTemplate(ChatTemplate):
    def render(self, messages, *, add_generation_prompt=True, tools=None, **kwargs):
        return "".join(f"<{m['role']}>" for m in messages)


def exploding_rule(context, choice):
    """The fake's rule, but a prompt holding "BOOM" fails in the backend after two tokens."""
    if any(list(context[i:i + 4]) == MARKER for i in range(len(context) - 4)) and len(context) > 20:
        raise RuntimeError("injected failure")
    return next_token_rule(context, choice)


class RecordingProgress:
    """Stands in for tqdm: records updates and whether it was closed."""

    def __init__(self, total: int, show: bool) -> None:
        self.total, self.updates, self.closed = total, 0, False

    def update(self, n: int) -> None:
        self.updates += n

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def progress(monkeypatch):
    bars: list[RecordingProgress] = []
    monkeypatch.setattr(pipeline_module, "_progress", lambda total, show: bars.append(RecordingProgress(total, show))
                        or bars[-1])
    return bars


def test_a_failing_item_ends_alone_and_its_siblings_normally(progress):
    prompts = ["a fine prompt here", "xxxxxBOOMxxxxxxxxx", "another fine one"]
    with Pipeline(AsyncEngine(FakeBackend(next_token=exploding_rule, step_delay=0.001))) as pipe:
        alone = [pipe.infer(p, GREEDY).token_ids for p in (prompts[0], prompts[2])]
        responses = pipe.infer(prompts, GREEDY.replace(max_new_tokens=30))
        assert [r.finish_reason for r in responses] == ["length", "error", "length"]
        assert responses[1].error and "RuntimeError" in responses[1].error
        assert responses[0].error is None and responses[0].token_ids[:6] == alone[0]
        assert responses[2].token_ids[:6] == alone[1]
        assert progress[-1].closed and progress[-1].updates == 3
        assert len(pipe.engine.sessions) == 0 and pipe.engine.stats().running == 0


def test_an_item_failing_preprocessing_does_not_sink_the_batch(progress):
    with Pipeline(AsyncEngine(FakeBackend(max_model_len=64))) as pipe:
        responses = pipe.infer(["short", "x" * 200, "also short"], GREEDY, n=2)
        assert [r.finish_reason for r in responses] == ["length", "error", "length"]
        assert [c.finish_reason for c in responses[1].choices] == ["error", "error"]
        assert "context" in responses[1].error
        assert progress[-1].closed
        with pytest.raises(ContextTooLongError):  # a single prompt raises its error
            pipe.infer("x" * 200, GREEDY)


class BlockingVision(VisionProcessor):
    """Encoding waits for the test: the request stays in preparation, before the backend."""

    def __init__(self) -> None:
        self.encoding, self.release = threading.Event(), threading.Event()

    def preprocess(self, prompt, images):
        return MultiModalInputs([5, 9, 9, 6], image_token_id=9, placeholder_ranges=[PlaceholderRange(1, 2)],
                                image_hashes=["h"] * len(images))

    def encode(self, inputs):
        self.encoding.set()
        assert self.release.wait(10)
        return [[0.0]]


def test_work_dropped_by_a_sleep_before_it_started_is_an_error_not_an_empty_result():
    from PIL import Image

    vision = BlockingVision()
    engine = AsyncEngine(FakeBackend(), chat_template=PlainTemplate(), vision=vision)
    with Pipeline(engine) as pipe:
        image = Image.new("RGB", (4, 4))
        results: list = []
        worker = threading.Thread(target=lambda: results.append(pipe.infer([("one", image), ("two", image)],
                                                                           GREEDY)))
        worker.start()
        assert vision.encoding.wait(10)
        pipe._loop.run(engine.sleep(1))
        pipe._loop.run(engine.wakeup())
        vision.release.set()
        worker.join(10)
        [responses] = results
        assert [r.finish_reason for r in responses] == ["error", "error"]
        assert all(r.error == DROPPED_MESSAGE for r in responses)
        assert pipe.infer(("three", image), GREEDY).finish_reason == "length"  # served again once awake
