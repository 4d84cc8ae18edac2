"""Dataset builders: lengths, determinism, shared prefixes and the shipped multi-turn chats."""

from __future__ import annotations

import json

import pytest

from core.bench.datasets import (
    MULTI_TURN_FILE,
    WORDS,
    BenchRequest,
    build_requests,
    fixed_requests,
    load_conversations,
    multi_turn_requests,
    random_requests,
    shared_prefix_requests,
)


def test_fixed_lengths_are_exact_and_prompts_distinct():
    requests = fixed_requests(20, input_len=32, output_len=7, seed=0)
    assert all(len(r.prompt.split()) == 32 and r.output_len == 7 for r in requests)
    assert len({r.prompt for r in requests}) == 20
    assert all(word in WORDS for word in requests[0].prompt.split())


def test_random_lengths_stay_in_range_and_vary():
    requests = random_requests(200, input_len=100, output_len=40, range_ratio=0.5, seed=1)
    inputs = [len(r.prompt.split()) for r in requests]
    outputs = [r.output_len for r in requests]
    assert min(inputs) >= 50 and max(inputs) <= 150 and len(set(inputs)) > 20
    assert min(outputs) >= 20 and max(outputs) <= 60 and len(set(outputs)) > 10


def test_builders_are_deterministic_per_seed():
    assert random_requests(5, 10, 5, seed=4) == random_requests(5, 10, 5, seed=4)
    assert random_requests(5, 10, 5, seed=4) != random_requests(5, 10, 5, seed=5)


def test_shared_prefix_requests_share_exactly_the_prefix():
    requests = shared_prefix_requests(10, prefix_len=50, input_len=8, output_len=4, seed=0)
    prefixes = {r.prompt.split("\n")[0] for r in requests}
    assert len(prefixes) == 1 and len(prefixes.pop().split()) == 50
    assert len({r.prompt.split("\n")[1] for r in requests}) == 10


def test_multi_turn_requests_end_on_a_user_turn_with_full_history():
    requests = multi_turn_requests(40, output_len=16)
    assert len(requests) == 40 and all(r.is_chat and r.output_len == 16 for r in requests)
    assert all(r.messages[-1]["role"] == "user" for r in requests)
    assert any(len(r.messages) >= 6 for r in requests)  # later turns carry the earlier replies


def test_shipped_multi_turn_file_is_valid():
    conversations = load_conversations(MULTI_TURN_FILE)
    assert len(conversations) >= 10
    assert all(c[-1]["role"] == "user" for c in conversations)


def test_bad_multi_turn_file_names_the_line(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n{\"nope\": 1}\n")
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        multi_turn_requests(3, 4, path)
    with pytest.raises(ValueError, match="does not exist"):
        multi_turn_requests(3, 4, tmp_path / "missing.jsonl")


@pytest.mark.parametrize(("kwargs", "field"), [({"num_prompts": 0}, "num_prompts"), ({"input_len": 0}, "input_len"),
                                               ({"output_len": 0}, "output_len")])
def test_bad_sizes_name_the_argument(kwargs, field):
    args = {"num_prompts": 2, "input_len": 4, "output_len": 4, **kwargs}
    with pytest.raises(ValueError, match=field):
        build_requests("fixed", **args)


def test_unknown_dataset_lists_the_choices():
    with pytest.raises(ValueError, match="random, fixed, shared-prefix, multi-turn"):
        build_requests("sharegpt", num_prompts=1, input_len=1, output_len=1)


def test_request_needs_exactly_one_input():
    with pytest.raises(ValueError, match="exactly one"):
        BenchRequest(output_len=1)
    with pytest.raises(ValueError, match="output_len"):
        BenchRequest(output_len=0, prompt="x")
