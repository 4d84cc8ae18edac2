"""GenerationConfig and EngineConfig validation: every error names the field and the value."""

from __future__ import annotations

import pytest

from core.config import EngineConfig, GenerationConfig
from core.errors import InvalidRequestError


@pytest.mark.parametrize(
    ("field", "value"),
    [("n", 0), ("n", True), ("max_new_tokens", 0), ("min_new_tokens", -1), ("temperature", -1),
     ("temperature", float("nan")), ("top_p", -0.1), ("top_p", 1.5), ("top_k", -2), ("min_p", 2),
     ("repetition_penalty", 0), ("presence_penalty", 3), ("frequency_penalty", -2.5), ("seed", 2**63),
     ("top_logprobs", 21), ("stop", [""]), ("stop", 5), ("stop_token_ids", [-1]), ("ignore_eos", "yes"),
     ("logprobs", 1), ("logit_bias", {1: 200}), ("logit_bias", {-1: 1.0}), ("skip_special_tokens", None),
     # past int64: a backend's tensors would overflow (and fail every request of the batch step)
     ("top_k", 2**70), ("stop_token_ids", [2**70]), ("logit_bias", {2**70: 1.0}), ("max_new_tokens", 2**70),
     ("min_new_tokens", 2**70), ("allowed_token_ids", []), ("allowed_token_ids", [-1]), ("allowed_token_ids", 5),
     ("allowed_token_ids", [2**70]), ("truncate_prompt_tokens", 0), ("truncate_prompt_tokens", -2),
     ("truncate_prompt_tokens", "10")],
)
def test_bad_values_name_the_field(field, value):
    with pytest.raises(InvalidRequestError) as info:
        GenerationConfig(**{field: value})
    assert field.split()[0] in str(info.value) and isinstance(info.value, ValueError)
    assert info.value.param.startswith(field.split("[")[0].split()[0])


def test_cross_field_rules():
    with pytest.raises(InvalidRequestError, match="min_new_tokens"):
        GenerationConfig(max_new_tokens=2, min_new_tokens=3)
    with pytest.raises(InvalidRequestError, match="top_logprobs needs logprobs"):
        GenerationConfig(top_logprobs=3)


def test_defaults_come_from_the_model_then_fallbacks():
    config = GenerationConfig(top_p=0.5).with_defaults({"temperature": 0.7, "top_p": 0.9})
    assert (config.temperature, config.top_p, config.top_k, config.repetition_penalty) == (0.7, 0.5, 0, 1.0)
    assert GenerationConfig(temperature=0).with_defaults().is_greedy


def test_top_p_takes_the_range_openai_documents_zero_included():
    """0 keeps the top token alone (OpenAI and transformers take it; vLLM refuses it)."""
    assert GenerationConfig(top_p=0.0).top_p == 0.0 and GenerationConfig(top_p=1).top_p == 1


def test_stop_accepts_a_string_and_lists_become_tuples():
    assert GenerationConfig(stop="END", stop_token_ids=[3]).stop == ("END",)
    assert GenerationConfig(stop_token_ids=[3]).stop_token_ids == (3,)


def test_from_dict_rejects_unknown_keys():
    with pytest.raises(InvalidRequestError, match="'max_tokens'"):
        GenerationConfig.from_dict({"max_tokens": 3})


@pytest.mark.parametrize(("field", "value"), [("dtype", "int4"), ("quantization", "q4"), ("block_size", 0), ("kv_cache_memory_gib", 0),
                                              ("max_num_seqs", 0), ("backend_options", "eager")])
def test_engine_config_validation(field, value):
    with pytest.raises(InvalidRequestError, match=field):
        EngineConfig(**{field: value})


def test_model_name():
    assert EngineConfig(model="/models/SmolLM2/").model_name == "SmolLM2"
    assert EngineConfig(model="x", served_model_name="alias").model_name == "alias"


def test_quantization_flag_reaches_the_engine_config():
    import argparse

    from core.cli import add_engine_arguments, engine_config

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config(parser.parse_args([])).quantization == "auto"
    assert engine_config(parser.parse_args(["--quantization", "int4"])).quantization == "int4"
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int3"])


def test_backend_flags_become_backend_options():
    import argparse

    from core.cli import add_engine_arguments, engine_config

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_config(parser.parse_args([])).backend_options == {}
    both = engine_config(parser.parse_args(["--enforce-eager", "--amx-rows", "all"])).backend_options
    assert both == {"enforce_eager": True, "amx_rows": "all"}
    assert engine_config(parser.parse_args(["--kv-cache-dtype", "int8"])).backend_options == {"kv_cache_dtype": "int8"}
    with pytest.raises(SystemExit):
        parser.parse_args(["--amx-rows", "decode"])
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-dtype", "fp8"])


def test_served_model_names_split_into_the_reported_name_and_aliases():
    config = EngineConfig(served_model_name=["main", "other", "main", "third"])
    assert config.model_name == config.served_model_name == "main"
    assert config.served_model_aliases == ("other", "third")
    assert EngineConfig(served_model_name="only").served_model_aliases == ()
    for bad in ([], [""], ["ok", 3]):
        with pytest.raises(InvalidRequestError, match="served_model_name"):
            EngineConfig(served_model_name=bad)


def test_chat_template_content_format_is_checked():
    assert EngineConfig().chat_template_content_format == "auto"
    assert EngineConfig(chat_template_content_format="string").chat_template_content_format == "string"
    with pytest.raises(InvalidRequestError, match="chat_template_content_format"):
        EngineConfig(chat_template_content_format="list")
