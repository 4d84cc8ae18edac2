"""Speculative decoding's core pieces, without torch: the option and its flags, the proposer hook, the
n-gram lookup, the acceptance rule, the back-off gate, the counters in /metrics and the request opt-out."""

from __future__ import annotations

import pytest

from core import hookimpl
from core.backend import BackendStats
from core.cli import build_parser
from core.cli_options import engine_config
from core.config import GenerationConfig
from core.errors import InvalidRequestError, PluginError
from core.plugins import load_plugins
from core.resolve import speculative_proposer
from core.scheduling.ngram import NgramProposer, lookup, make_ngram_proposer
from core.scheduling.speculation import (
    AcceptanceBackoff,
    accepted_length,
    best_draft_length,
    draft_token_cost,
    expected_tokens,
    verified_tokens,
)
from core.server.metrics import Metrics
from core.server.openai_protocol import CompletionRequest
from core.server.openai_translate import completion_generation_config
from core.speculative import DraftRequest, Proposer, SpecDecodeStats, SpeculativeConfig

# -- the option --------------------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [("num_speculative_tokens", 0), ("num_speculative_tokens", 33),
                                               ("ngram_min", 0), ("ngram_max", True), ("method", "")])
def test_bad_speculative_options_name_their_field(field, value):
    with pytest.raises(InvalidRequestError) as info:
        SpeculativeConfig(**{field: value})
    assert info.value.param == (field if field != "method" else "speculative")


def test_ngram_min_must_not_exceed_ngram_max():
    with pytest.raises(InvalidRequestError, match="ngram_min"):
        SpeculativeConfig(ngram_min=5, ngram_max=3)


def test_flags_build_the_speculative_config():
    args = build_parser().parse_args(["serve", "--speculative", "ngram", "--num-speculative-tokens", "6",
                                      "--ngram-min", "2", "--ngram-max", "5", "--no-speculative-backoff"])
    spec = engine_config(args).speculative
    assert spec == SpeculativeConfig("ngram", 6, 2, 5, None, backoff=False)
    assert engine_config(build_parser().parse_args(["serve"])).speculative is None


def test_a_request_opts_out_with_speculative_false():
    assert completion_generation_config(CompletionRequest(prompt="x", speculative=False)).speculative is False
    assert completion_generation_config(CompletionRequest(prompt="x")).speculative is True
    with pytest.raises(InvalidRequestError) as info:
        GenerationConfig(speculative="no")
    assert info.value.param == "speculative"


# -- the hook ----------------------------------------------------------------------------------------


class EchoProposer(Proposer):
    def propose(self, requests):
        return [list(r.token_ids[-1:]) * r.max_tokens for r in requests]


def test_hook_core_register_speculative_proposers():
    class Plugin:
        @hookimpl
        def core_register_speculative_proposers(self, register):
            register("echo", lambda config: EchoProposer(), description="repeats the last token")
            register("lazy", "core.scheduling.ngram:make_ngram_proposer")

    host = load_plugins(allow="", use_environment=False)
    host.register(Plugin())
    proposer = speculative_proposer(host, "echo").load()(SpeculativeConfig("echo"))
    assert proposer.propose([DraftRequest("a", [1, 2], 2, 3)]) == [[2, 2, 2]]
    assert speculative_proposer(host, "lazy").load() is make_ngram_proposer
    with pytest.raises(PluginError, match="echo, lazy"):
        speculative_proposer(host, "draft")


# -- n-gram lookup -----------------------------------------------------------------------------------


def test_lookup_proposes_what_followed_the_latest_match_of_the_longest_suffix():
    assert lookup([1, 2, 3, 9, 1, 2, 4, 8, 1, 2], 3, 1, 4) == [4, 8, 1]  # latest [1, 2] is at 4
    assert lookup([5, 1, 2, 3, 7, 7, 2, 3, 6, 1, 2, 3], 2, 1, 3) == [7, 7]  # [1, 2, 3] beats [2, 3]
    assert lookup([1, 2, 3, 4], 3, 1, 4) == []  # nothing repeats
    assert lookup([1, 2, 3, 4], 3, 2, 4) == []


def test_lookup_continues_a_loop_past_the_end():
    assert lookup([9, 1, 2, 1, 2], 5, 1, 2) == [1, 2, 1, 2, 1]
    assert lookup([4, 4, 4], 3, 1, 4) == [4, 4, 4]


def test_lookup_matches_whole_tokens_only():
    # 256 and 1 pack into bytes 00 01 00 00 / 01 00 00 00: a byte-level match across tokens is not one
    assert lookup([1, 256, 0, 0, 1, 0, 0, 256], 2, 1, 1) == [0, 0]
    assert lookup([65536, 1, 0, 256], 2, 1, 1) == []


def test_ngram_proposer_respects_each_rows_limit():
    proposer = NgramProposer(1, 3)
    rows = [DraftRequest("a", [1, 2, 3, 1, 2], 5, 2), DraftRequest("b", [7, 8], 2, 4)]
    assert proposer.propose(rows) == [[3, 1], []]
    with pytest.raises(ValueError):
        NgramProposer(3, 2)


# -- acceptance ----------------------------------------------------------------------------------------


def test_the_longest_agreeing_prefix_and_the_targets_next_token_are_kept():
    assert accepted_length([5, 6, 7], [5, 6, 9, 1]) == 2
    assert verified_tokens([5, 6, 7], [5, 6, 9, 1]) == [5, 6, 9]
    assert verified_tokens([5, 6, 7], [5, 6, 7, 1]) == [5, 6, 7, 1]
    assert verified_tokens([5], [4, 5]) == [4]
    with pytest.raises(ValueError):
        accepted_length([1, 2], [1, 2])


def test_the_draft_length_maximises_expected_tokens_per_cost():
    assert expected_tokens(0.5, 2) == 1.75 and expected_tokens(1.0, 4) == 5
    assert best_draft_length(1.0, 6, cost=0.2) == 6  # all accepted: as long as allowed
    assert best_draft_length(0.9, 32, cost=0.2) == 7
    assert best_draft_length(0.7, 8, cost=0.2) == 3
    assert best_draft_length(0.5, 8, cost=0.2) == 1
    assert best_draft_length(0.15, 8, cost=0.2) == 0  # a draft costs more than it gives
    assert best_draft_length(0.15, 8, cost=0.05) == 1
    assert draft_token_cost(1) == pytest.approx(0.2) and draft_token_cost(8) == pytest.approx(0.4)
    assert best_draft_length(0.6, 8, cost=draft_token_cost(1)) > best_draft_length(0.6, 8, cost=draft_token_cost(8))


def test_backoff_shortens_then_pauses_a_row_whose_proposals_fail():
    gate = AcceptanceBackoff(cost=0.2, decay=0.5, min_pause=2, max_pause=8)
    assert gate.draft_length(5) == 5  # optimistic at first
    gate.record(5, 5)
    assert gate.draft_length(5) == 5
    gate.record(4, 0)
    assert gate.draft_length(5) == 3  # half right: shorter runs
    for _ in range(4):
        gate.record(4, 0)
    assert 0 < gate.rate < 0.15
    assert [gate.draft_length(5) for _ in range(3)] == [0, 0, 1]  # a pause of 2 steps, then a probe
    gate.record(1, 0)
    while gate.draft_length(5) == 0:  # failed probes: the pause doubles
        pass
    assert gate.pause == 8
    gate.record(1, 1)  # an accepted draft: pauses are short again
    assert gate.pause == 2 and gate.draft_length(5) > 0


def test_spec_decode_counters_and_metrics():
    stats = SpecDecodeStats()
    stats.record(4, 2)
    stats.record(2, 2)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 6, 4)
    assert stats.accepted_per_position == [2, 2, 0, 0] and stats.acceptance_rate == pytest.approx(4 / 6)
    text = Metrics().render(BackendStats(spec_decode=stats), "m")
    assert "core:spec_decode_num_draft_tokens_total 6" in text
    assert "core:spec_decode_num_accepted_tokens_total 4" in text
    assert "core:spec_decode_num_drafts_total 2" in text
    assert 'core:spec_decode_num_accepted_tokens_per_pos_total{position="1"} 2' in text
    assert "spec_decode" not in Metrics().render(BackendStats(), "m")


def test_a_backend_that_cannot_speculate_refuses_to_start_with_it():
    from core.config import EngineConfig
    from core.engine import AsyncEngine
    from core.errors import UnsupportedError
    from core.testing.fake import FakeBackend

    class Plugin:
        @hookimpl
        def core_register_backends(self, register):
            register("toy", lambda config: FakeBackend(max_model_len=64))

    host = load_plugins(allow="", use_environment=False)
    host.register(Plugin())
    with pytest.raises(UnsupportedError) as info:
        AsyncEngine.from_config(EngineConfig(backend="toy", speculative=SpeculativeConfig()), plugins=host)
    assert info.value.param == "speculative"
