"""Config and SamplingParams validation: errors name the field."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, ConfigError, SchedulerConfig
from engine.request import Request, RequestStatus
from engine.sampling_params import SamplingParams, SamplingParamsError


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
        ({"max_model_len": 1}, "max_model_len"),
        ({"long_prefill_token_threshold": -5}, "long_prefill_token_threshold"),
        ({"policy": "lifo"}, "policy"),
        ({"max_num_partial_prefills": 0}, "max_num_partial_prefills"),
        (
            {"max_num_partial_prefills": 2, "max_long_partial_prefills": 3},
            "max_long_partial_prefills",
        ),
        (
            {
                "max_num_partial_prefills": 2,
                "enable_chunked_prefill": False,
                "max_model_len": 100,
                "max_num_batched_tokens": 100,
            },
            "max_num_partial_prefills",
        ),
        ({"num_lookahead_tokens": -1}, "num_lookahead_tokens"),
    ],
)
def test_scheduler_config_names_the_bad_field(kwargs, field):
    with pytest.raises(ConfigError, match=f"^{field}="):
        SchedulerConfig(**kwargs)


def test_partial_prefills_default_the_long_threshold_like_v0():
    cfg = SchedulerConfig(max_model_len=1000, max_num_partial_prefills=2)
    assert cfg.partial_prefills_enabled and cfg.effective_long_prefill_threshold == 40
    assert SchedulerConfig().effective_long_prefill_threshold == 0


@pytest.mark.parametrize(
    ("kwargs", "field"), [({"block_size": 12}, "block_size"), ({"num_blocks": 1}, "num_blocks")]
)
def test_cache_config_names_the_bad_field(kwargs, field):
    with pytest.raises(ConfigError, match=f"^{field}="):
        CacheConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"temperature": 1e30}, "temperature"),
        ({"seed": "x"}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"logprobs": 21}, "logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": True}, "prompt_logprobs"),
        ({"prompt_logprobs": 2.0}, "prompt_logprobs"),
    ],
)
def test_sampling_params_name_the_bad_field(kwargs, field):
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}:")


def test_top_k_minus_one_is_off():
    """vLLM's spelling of "no top-k" means what 0 means here."""
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(temperature=100.0).temperature == 100.0  # the bound itself


def test_prompt_logprobs_bounds_are_accepted_and_skip_the_prefix_cache():
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0
    assert SamplingParams(prompt_logprobs=20).prompt_logprobs == 20
    assert SamplingParams().prompt_logprobs is None
    assert Request("r", [1, 2], SamplingParams(prompt_logprobs=0)).skip_reading_prefix_cache
    assert not Request("r", [1, 2], SamplingParams(logprobs=3)).skip_reading_prefix_cache


def test_sampling_params_accept_a_single_stop_string():
    assert SamplingParams(stop="###").stop == ["###"]  # type: ignore[arg-type]
    assert SamplingParams(temperature=0).greedy


def test_request_rejects_empty_input_and_reports_finish_reasons():
    with pytest.raises(ValueError, match="prompt_token_ids"):
        Request("r", [], SamplingParams())
    with pytest.raises(ValueError, match="request_id"):
        Request("", [1], SamplingParams())
    req = Request("r", [1, 2], SamplingParams())
    assert req.get_finished_reason() is None and not req.is_finished()
    req.status = RequestStatus.FINISHED_ERROR
    assert str(req.get_finished_reason()) == "error" and req.is_finished()
