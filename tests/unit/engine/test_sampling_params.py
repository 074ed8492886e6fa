"""SamplingParams: the logit adjustments (penalties, min_p, logit_bias)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from engine.sampling_params import SamplingParams, SamplingParamsError


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"presence_penalty": 2.01}, "presence_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"presence_penalty": "1"}, "presence_penalty"),
        ({"presence_penalty": True}, "presence_penalty"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
        ({"frequency_penalty": float("-inf")}, "frequency_penalty"),
        ({"frequency_penalty": None}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.2}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"min_p": float("nan")}, "min_p"),
        ({"logit_bias": {5: 100.5}}, "logit_bias"),
        ({"logit_bias": {5: -101}}, "logit_bias"),
        ({"logit_bias": {5: float("nan")}}, "logit_bias"),
        ({"logit_bias": {-1: 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 1.0}}, "logit_bias"),
        ({"logit_bias": {True: 1.0}}, "logit_bias"),
        ({"logit_bias": [(5, 1.0)]}, "logit_bias"),
    ],
)
def test_bad_adjustments_name_the_field(kwargs: dict[str, Any], field: str) -> None:
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(**kwargs)
    assert err.value.field == field
    assert str(err.value).startswith(f"{field}:")


def test_the_bad_bias_is_named_with_its_token() -> None:
    with pytest.raises(SamplingParamsError, match="bias of token 7 must be in"):
        SamplingParams(logit_bias={3: 1.0, 7: 200.0})


@pytest.mark.parametrize(
    "kwargs",
    [
        {"presence_penalty": -2, "frequency_penalty": 2.0},
        {"repetition_penalty": 1e-3},
        {"repetition_penalty": 50},
        {"min_p": 0},
        {"min_p": 1},
        {"logit_bias": {0: -100, 49151: 100.0}},
    ],
)
def test_bounds_are_inclusive(kwargs: dict[str, Any]) -> None:
    params = SamplingParams(**kwargs)
    for name, value in kwargs.items():
        assert getattr(params, name) == value


def test_defaults_are_off_and_derived_flags_follow_the_values() -> None:
    plain = SamplingParams()
    assert plain.presence_penalty == plain.frequency_penalty == plain.min_p == 0.0
    assert plain.repetition_penalty == 1.0 and plain.logit_bias == {}
    assert not plain.uses_penalties and not plain.adjusts_logits
    # min_p alone is applied after temperature, not as a logit adjustment.
    assert not SamplingParams(min_p=0.1).adjusts_logits
    bias = SamplingParams(logit_bias={3: 1.0})
    assert bias.adjusts_logits and not bias.uses_penalties
    for kwargs in (
        {"presence_penalty": 0.1},
        {"frequency_penalty": -1},
        {"repetition_penalty": 0.9},
    ):
        params = SamplingParams(**kwargs)
        assert params.uses_penalties and params.adjusts_logits
    # replace() re-validates and re-derives.
    assert not dataclasses.replace(
        SamplingParams(presence_penalty=1.0), presence_penalty=0
    ).uses_penalties
    with pytest.raises(SamplingParamsError, match=r"^min_p:"):
        dataclasses.replace(plain, min_p=2.0)


def test_logit_bias_is_copied() -> None:
    """A caller reusing its dict must not change a request already made."""
    bias = {3: 1.0}
    params = SamplingParams(logit_bias=bias)
    bias[4] = 2.0
    assert params.logit_bias == {3: 1.0}
    assert SamplingParams(logit_bias={1: 1.0}) == SamplingParams(logit_bias={1: 1.0})


def test_include_stop_str_in_output_is_a_bool_off_by_default() -> None:
    assert SamplingParams().include_stop_str_in_output is False
    assert SamplingParams(include_stop_str_in_output=True).include_stop_str_in_output
    with pytest.raises(SamplingParamsError) as err:
        SamplingParams(include_stop_str_in_output=1)  # type: ignore[arg-type]
    assert err.value.field == "include_stop_str_in_output"
