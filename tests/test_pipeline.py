"""Pipeline: blocking batch inference, multiplexed streaming and stateless multi-turn chat."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading

import pytest

from core.chat_template import ChatTemplate
from core.config import GenerationConfig
from core.engine import AsyncEngine
from core.errors import BackendError
from core.pipelines import ChatSession, Pipeline
from core.request import REMOVED_KEYWORDS
from core.testing.fake import FakeBackend

GREEDY = GenerationConfig(temperature=0.0, max_new_tokens=6, ignore_eos=True)


class RecordingTemplate(ChatTemplate):
    """Records the messages of every render, to check what each chat turn sends."""

    def __init__(self) -> None:
        self.seen: list[list[dict]] = []

    def render(self, messages, *, add_generation_prompt=True, tools=None, **kwargs):
        self.seen.append([dict(m) for m in messages])
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


@pytest.fixture
def template() -> RecordingTemplate:
    return RecordingTemplate()


@pytest.fixture
def pipe(template):
    with Pipeline(AsyncEngine(FakeBackend(), chat_template=template)) as pipe:
        yield pipe


def test_infer_one_prompt_and_a_batch(pipe):
    one = pipe.infer("hello", GREEDY)
    batch = pipe.infer(["hello", [1, 2, 3], [{"role": "user", "content": "hi"}]], GREEDY)
    assert one.text and len(one.token_ids) == 6
    assert [r.index for r in batch] == [0, 1, 2]
    assert batch[0].token_ids == one.token_ids


def test_one_config_per_prompt(pipe):
    configs = [GREEDY.replace(max_new_tokens=2), GREEDY.replace(max_new_tokens=4)]
    assert [len(r.token_ids) for r in pipe.infer(["a", "b"], configs)] == [2, 4]
    with pytest.raises(ValueError, match="2 entries for 3 prompts"):
        pipe.infer(["a", "b", "c"], configs)


def test_stream_infer_multiplexes_with_indices(pipe):
    seen: dict[int, str] = {}
    for index, output in pipe.stream_infer(["a", "bb", "ccc"], GREEDY):
        seen[index] = seen.get(index, "") + output.text
    assert seen == {i: r.text for i, r in enumerate(pipe.infer(["a", "bb", "ccc"], GREEDY))}


def test_stream_infer_stopped_early_leaks_nothing(pipe):
    for _ in pipe.stream_infer(["a", "b"], GREEDY.replace(max_new_tokens=100)):
        break
    assert len(pipe.engine.sessions) == 0 and pipe.engine.stats().kv_blocks_used == 0


def test_chat_resends_the_whole_history(pipe, template):
    session = pipe.chat("first", gen_config=GREEDY)
    first_answer = session.response.text
    pipe.chat("second", session, GREEDY)
    assert template.seen[-1] == [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": first_answer},
        {"role": "user", "content": "second"},
    ]
    assert len(session.history) == 2 and session.history[0] == ("first", first_answer)


def test_a_failed_turn_adds_no_history(template):
    with Pipeline(AsyncEngine(FakeBackend(fail_after=1), chat_template=template)) as pipe:
        session = ChatSession(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}])
        with pytest.raises(BackendError):
            pipe.chat("again", session, GREEDY)
        assert len(session.messages) == 2


def test_stop_all_between_turns_does_not_drop_chat_sessions(pipe):
    session = pipe.chat("one", gen_config=GREEDY)
    pipe._loop.run(pipe.engine.stop_all())
    pipe.chat("two", session, GREEDY)
    assert session.response.finish_reason == "length" and len(session.history) == 2


@pytest.mark.parametrize("keyword", REMOVED_KEYWORDS)
def test_removed_keywords_are_rejected_everywhere(pipe, keyword):
    for call in (lambda: pipe.infer("x", **{keyword: 1}), lambda: pipe.stream_infer("x", **{keyword: 1}),
                 lambda: pipe.chat("x", **{keyword: 1})):
        with pytest.raises(TypeError, match=keyword):
            call()


def test_close_stops_the_loop_thread(template):
    before = threading.active_count()
    pipe = Pipeline(AsyncEngine(FakeBackend(), chat_template=template))
    pipe.close()
    pipe.close()
    assert threading.active_count() == before


def test_core_pipeline_stays_the_function_whatever_was_imported_before():
    """`core.pipeline` is the factory on every access: the module that defines it is `core.pipelines`, so
    importing it (the CLI does) cannot put a module where the function was (a second `core.pipeline(...)`
    in one process raised "'module' object is not callable" while the module was `core/pipeline.py`)."""
    code = textwrap.dedent("""
        import core
        first = core.pipeline
        import core.pipelines, core.cli
        from core.pipelines import Pipeline, pipeline
        assert core.pipeline is first is pipeline and callable(core.pipeline), core.pipeline
        assert core.Pipeline is Pipeline
    """)
    subprocess.run([sys.executable, "-c", code], check=True)
