"""Benchmark datasets: what each request sends and how many tokens it asks for.

No tokenizer is used on the client side (the benchmark drives any server), so synthetic prompts are
built from common English words that byte-pair tokenizers keep as one token each: an input length of N
is N words, about N tokens. The token counts that the metrics use are the server's own (its `usage`).

- random: prompt and output lengths drawn uniformly from [len * (1 - ratio), len * (1 + ratio)];
- fixed: every prompt exactly `input_len` words, every output `output_len` tokens;
- shared-prefix: a common prefix of `prefix_len` words, then a unique `input_len`-word question;
- multi-turn: the chat conversations shipped in benchmarks/datasets/multi_turn_chat.jsonl, one request
  per assistant turn carrying the whole history before it (requests are stateless; prefix caching makes
  the repeated history cheap);
- repeat: chat requests to repeat, correct or copy out a passage of about `input_len` words (sentences
  from benchmarks/datasets/passages.txt), so the answer repeats the prompt: where prompt lookup
  (``--speculative ngram``) helps. `random` is the dataset where it does not.
"""

from __future__ import annotations

import json
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATASETS = ("random", "fixed", "shared-prefix", "multi-turn", "repeat")
MULTI_TURN_FILE = Path(__file__).resolve().parents[2] / "benchmarks" / "datasets" / "multi_turn_chat.jsonl"
PASSAGES_FILE = MULTI_TURN_FILE.with_name("passages.txt")
REPEAT_INSTRUCTIONS = ("Repeat the following text exactly, word for word:",
                       "Correct any mistakes in the following text and write it out again in full:",
                       "Copy out the following text, keeping every sentence:")

WORDS = tuple("""
the of and to in is it you that he was for on are with as his they be at one have this from or had by
not word but what some we can out other were all there when up use your how said an each she which do
their time if will way about many then them write would like so these her long make thing see him two
has look more day could go come did number sound no most people my over know water than call first who
may down side been now find any new work part take get place made live where after back little only
round man year came show every good me give our under name very through just form sentence great think
say help low line differ turn cause much mean before move right boy old too same tell does set three
want air well also play small end put home read hand port large spell add even land here must big high
such follow act why ask men change went light kind off need house picture try us again animal point
mother world near build self earth father head stand own page should country found answer school grow
study still learn plant cover food sun four between state keep eye never last let thought city tree
cross farm hard start might story saw far sea draw left late run while press close night real life few
north open seem together next white children begin got walk example ease paper group always music those
both mark often letter until mile river car feet care second book carry took science eat room friend
began idea fish mountain stop once base hear horse cut sure watch color face wood main enough plain girl
usual young ready above ever red list though feel talk bird soon body dog family direct pose leave song
""".split())


@dataclass(frozen=True)
class BenchRequest:
    """One request: a completion `prompt` or chat `messages` (exactly one), and its output length."""

    output_len: int
    prompt: str | None = None
    messages: tuple[Mapping[str, str], ...] | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("BenchRequest needs exactly one of prompt and messages")
        if self.output_len < 1:
            raise ValueError(f"output_len must be at least 1, got {self.output_len}")

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


def words(rng: random.Random, count: int) -> str:
    """`count` random common words (about `count` tokens for a BPE tokenizer)."""
    return " ".join(rng.choice(WORDS) for _ in range(count))


def _length(rng: random.Random, mean: int, ratio: float) -> int:
    low, high = max(1, round(mean * (1 - ratio))), max(1, round(mean * (1 + ratio)))
    return rng.randint(low, high)


def random_requests(num_prompts: int, input_len: int, output_len: int, range_ratio: float = 0.5,
                    seed: int = 0) -> list[BenchRequest]:
    """Prompts and output lengths drawn uniformly around `input_len` and `output_len`."""
    _check_positive(num_prompts=num_prompts, input_len=input_len, output_len=output_len)
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    return [BenchRequest(prompt=words(rng, _length(rng, input_len, range_ratio)),
                         output_len=_length(rng, output_len, range_ratio)) for _ in range(num_prompts)]


def fixed_requests(num_prompts: int, input_len: int, output_len: int, seed: int = 0) -> list[BenchRequest]:
    """Distinct prompts of exactly `input_len` words, each asking for `output_len` tokens."""
    _check_positive(num_prompts=num_prompts, input_len=input_len, output_len=output_len)
    rng = random.Random(seed)
    return [BenchRequest(prompt=words(rng, input_len), output_len=output_len) for _ in range(num_prompts)]


def shared_prefix_requests(num_prompts: int, prefix_len: int, input_len: int, output_len: int,
                           seed: int = 0) -> list[BenchRequest]:
    """One common `prefix_len`-word context followed by a distinct `input_len`-word question each."""
    _check_positive(num_prompts=num_prompts, prefix_len=prefix_len, input_len=input_len, output_len=output_len)
    rng = random.Random(seed)
    prefix = words(rng, prefix_len)
    return [BenchRequest(prompt=f"{prefix}\n{words(rng, input_len)}", output_len=output_len)
            for _ in range(num_prompts)]


def multi_turn_requests(num_prompts: int, output_len: int, path: Path | None = None) -> list[BenchRequest]:
    """One chat request per assistant turn of the shipped conversations, cycled to `num_prompts`."""
    _check_positive(num_prompts=num_prompts, output_len=output_len)
    path = path or MULTI_TURN_FILE
    if not path.is_file():
        raise ValueError(f"the multi-turn dataset {path} does not exist (give one with --dataset-path)")
    turns = [history for conversation in load_conversations(path)
             for history in _histories(conversation)]
    if not turns:
        raise ValueError(f"{path} holds no user turn")
    return [BenchRequest(messages=turns[i % len(turns)], output_len=output_len) for i in range(num_prompts)]


def repeat_requests(num_prompts: int, input_len: int, output_len: int, seed: int = 0,
                    path: Path | None = None) -> list[BenchRequest]:
    """Chat requests whose answer repeats a passage of about `input_len` words given in the prompt."""
    _check_positive(num_prompts=num_prompts, input_len=input_len, output_len=output_len)
    path = path or PASSAGES_FILE
    if not path.is_file():
        raise ValueError(f"the passages file {path} does not exist (give one with --dataset-path)")
    sentences = [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not sentences:
        raise ValueError(f"{path} holds no sentence")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_prompts):
        passage: list[str] = []
        while sum(len(s.split()) for s in passage) < input_len:
            passage.append(rng.choice(sentences))
        ask = f"{rng.choice(REPEAT_INSTRUCTIONS)}\n\n{' '.join(passage)}"
        requests.append(BenchRequest(messages=({"role": "user", "content": ask},), output_len=output_len))
    return requests


def load_conversations(path: Path) -> list[list[dict[str, str]]]:
    """Conversations from a JSON-lines file: one {"messages": [{"role", "content"}, ...]} per line."""
    conversations = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        record = json.loads(line)
        messages = record.get("messages") if isinstance(record, dict) else None
        if not isinstance(messages, list) or not all(_is_message(m) for m in messages):
            raise ValueError(f"{path}:{number}: expected {{\"messages\": [{{\"role\", \"content\"}}, ...]}}")
        conversations.append([{"role": m["role"], "content": m["content"]} for m in messages])
    return conversations


def _is_message(message: Any) -> bool:
    return (isinstance(message, dict) and message.get("role") in ("system", "user", "assistant")
            and isinstance(message.get("content"), str))


def _histories(conversation: Sequence[dict[str, str]]) -> list[tuple[dict[str, str], ...]]:
    """The context of each reply: every message before each user turn's answer, ending on that turn."""
    return [tuple(conversation[:i + 1]) for i, m in enumerate(conversation) if m["role"] == "user"]


def build_requests(dataset: str, *, num_prompts: int, input_len: int, output_len: int, prefix_len: int = 256,
                   range_ratio: float = 0.5, seed: int = 0, dataset_path: Path | None = None) -> list[BenchRequest]:
    """The requests of a named dataset (see the module docstring)."""
    if dataset == "random":
        return random_requests(num_prompts, input_len, output_len, range_ratio, seed)
    if dataset == "fixed":
        return fixed_requests(num_prompts, input_len, output_len, seed)
    if dataset == "shared-prefix":
        return shared_prefix_requests(num_prompts, prefix_len, input_len, output_len, seed)
    if dataset == "multi-turn":
        return multi_turn_requests(num_prompts, output_len, dataset_path)
    if dataset == "repeat":
        return repeat_requests(num_prompts, input_len, output_len, seed, dataset_path)
    raise ValueError(f"unknown dataset {dataset!r}; choose one of {', '.join(DATASETS)}")


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
